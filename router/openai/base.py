"""The pieces every OpenAI request part is built from: OpenAI's error object (`HTTPError`,
`bad_request`, pydantic's errors as the 400 a client gets), the strict field types, and
`RequestPart`, a model over one part of a request body (router/openai/protocol.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


# ---- errors -------------------------------------------------------------------------------
class HTTPError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(param: str | None, message: str) -> HTTPError:
    return HTTPError(400, message, param=param)


# The validators' own errors: worded after the field's name ("stop" + "must be ..."), or whole.
_AFTER_NAME = "pdserve_after_name"
_WHOLE = "pdserve_whole"
# pydantic's errors in the wording clients have always had; `{input}` is the value as JSON.
_PHRASES = {
    "float_type": "must be a number, got {input}",
    "int_type": "must be an integer, got {input}",
    "bool_type": "must be a boolean, got {input}",
    "string_type": "must be a string",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}
_OUT_OF_RANGE = ("greater_than_equal", "less_than_equal")


def invalid(what: str) -> PydanticCustomError:
    """A validator's failure, said after the field's name: `invalid("must be ...")`."""
    return PydanticCustomError(_AFTER_NAME, what)


def refused(message: str) -> PydanticCustomError:
    """A validator's failure, said in a message of its own."""
    return PydanticCustomError(_WHOLE, message)


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code, which clients match
_TOO_LONG = "pdserve_context_length"


def too_long(message: str) -> PydanticCustomError:
    """A length refusal: its own message, and OpenAI's `context_length_exceeded` code."""
    return PydanticCustomError(_TOO_LONG, message)


def _param(loc: tuple[int | str, ...]) -> str | None:
    """pydantic's location as a path: `("messages", 0, "role")` is `messages[0].role`."""
    if not loc:
        return None
    path = str(loc[0])
    for part in loc[1:]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _message(err: ErrorDetails, param: str | None) -> str:
    """One error as the message a client gets; pydantic's own words only where no phrase
    covers the error."""
    kind, name = err["type"], param or "request body"
    if kind in (_WHOLE, _TOO_LONG):
        return err["msg"]
    if kind == _AFTER_NAME:
        return f"{name} {err['msg']}"
    if kind in _OUT_OF_RANGE:
        return f"{name} is out of range: {_integral(err['input'])}"
    phrase = _PHRASES.get(kind)
    if phrase is None:
        return f"{name}: {err['msg']}"
    if "{input}" in phrase:
        phrase = phrase.format(input=json.dumps(err["input"]))
    return f"{name} {phrase}"


def from_validation(e: ValidationError) -> HTTPError:
    """The first of pydantic's errors (fields are declared in the order they are checked) as
    the 400 a client gets."""
    err = e.errors(include_url=False)[0]
    param = _param(err["loc"])
    code = CONTEXT_LENGTH_EXCEEDED if err["type"] == _TOO_LONG else None
    return HTTPError(400, _message(err, param), param=param, code=code)


# ---- field types --------------------------------------------------------------------------
def _integral(v: object) -> object:
    """JSON has one number type: 2.0 is the integer 2, 2.5 is not an integer."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _reworded(what: str) -> WrapValidator:
    """Whatever is wrong with the value, the client reads `what` after the field's name."""

    def wrap(v: object, handler: ValidatorFunctionWrapHandler) -> object:
        try:
            return handler(v)
        except ValidationError:
            raise invalid(what) from None

    return WrapValidator(wrap)


_StrictInt32 = Annotated[StrictInt, Field(ge=INT32[0], le=INT32[1])]  # 2.0 is refused
Int32 = Annotated[_StrictInt32, BeforeValidator(_integral)]
Int64 = Annotated[StrictInt, Field(ge=INT64[0], le=INT64[1]), BeforeValidator(_integral)]
Number = StrictFloat  # an int is a number too; a boolean is not
Stop = Annotated[StrictStr | list[StrictStr], _reworded("must be a string or a list of strings")]
TokenIdList = Annotated[list[_StrictInt32], _reworded("must be a list of integers")]
Role = Literal["system", "developer", "user", "assistant", "tool"]

B = TypeVar("B", bound="RequestPart")


class RequestPart(BaseModel):
    """One part of a request body, validated from the whole JSON object."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """A null field is unset, as if absent (defaults and required fields included)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @classmethod
    def of(cls: type[B], body: dict[str, Any], **context: Any) -> B:
        """The part of `body` this model describes; its first error is an HTTPError."""
        try:
            return cls.model_validate(body, context=context or None)
        except ValidationError as e:
            raise from_validation(e) from e
