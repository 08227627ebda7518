"""The OpenAI request bodies (docs/http.md) as pydantic models, their translation into a
`pdserve.v1.GenerateRequest`, and OpenAI's error object.

A body is validated in parts, each a model over the same JSON object: how it streams
(`StreamOptions`), its prompt (`CompletionPrompt`, `ChatPrompt`), then its sampling fields
(`CompletionSampling`, `ChatSampling`). Chat renders its prompt between the last two, since an
unset `max_tokens` is the rest of the context; and the parts, like the fields within each,
come in the order the checks have always run, because only the first mistake is answered: a
400 naming its field (`param`) in OpenAI's error body. Before them, every field pdserve does
not honour is refused (`refuse_unsupported`, the list in router/openai/fields.py); unknown
fields are ignored (as OpenAI and vLLM do) and a top-level null is the same as an absent
field.

Shapes and types are checked here, and the chat content's length, which must be bounded
before the template runs. Other values (sampling ranges, prompt lengths, the served model name)
are the router's (router/validation.py, engine/validation.py), shared with gRPC.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Protocol, get_args

from pydantic import (
    AliasChoices,
    AliasPath,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from engine.sampling import MAX_LOGPROBS, InvalidParameterError
from engine.tokenizer import Tokenizer
from engine.validation import ContextLengthError, too_long_message
from protos.pdserve.v1 import generation_pb2 as gen
from router.config import RouterConfig
from router.openai.base import (
    CONTEXT_LENGTH_EXCEEDED,
    INT32,
    HTTPError,
    Int32,
    Int64,
    Number,
    RequestPart,
    Role,
    Stop,
    TokenIdList,
    _reworded,
    bad_request,
    from_validation,
    invalid,
    refused,
    too_long,
)
from router.openai.fields import Endpoint, unsupported
from router.openai.structured import Structured, structured_field
from router.openai.tools import ToolPlan, plan_tools, template_message
from router.validation import ModelLimits

__all__ = [
    "HTTPError",
    "RequestPart",
    "TokenIdList",
    "bad_request",
    "from_validation",
    "invalid",
    "refused",
    "structured_field",
]


# ---- streaming ----------------------------------------------------------------------------
class StreamOptions(RequestPart):
    """`stream`, and `stream_options`, which only a streaming request may send; and how
    the output names tokens."""

    # a bad include_usage is named by its own name, not its path, as it always was
    model_config = ConfigDict(extra="ignore", frozen=True, loc_by_alias=False)

    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    include_usage: StrictBool = Field(
        False, validation_alias=AliasPath("stream_options", "include_usage")
    )

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, v: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if v is not None and not info.data.get("stream"):
            raise invalid("is only allowed when stream is true")
        return v

    # vLLM's: logprobs name tokens `token_id:<id>` (not part of streaming, but of the output)
    return_tokens_as_token_ids: StrictBool = False

    @field_validator("include_usage", mode="before")
    @classmethod
    def _null_is_false(cls, v: object) -> object:
        return False if v is None else v


# ---- prompts ------------------------------------------------------------------------------
def _one_prompt(v: object) -> object:
    """A string or a list of token ids, or a batch of exactly one of those."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
        v = v[0]
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if not all(INT32[0] <= t <= INT32[1] for t in v):
            raise refused("prompt token ids are out of range")
        return v
    if isinstance(v, list) and len(v) > 1:  # a batch mixing strings and id lists
        raise refused("a batch of prompts is all strings or all token-id lists")
    if v is None or v == []:
        raise invalid("is required")
    raise invalid("must be a string or a list of token ids")


def _request(model: str | None, cache_salt: str | None, request_id: str) -> gen.GenerateRequest:
    r = gen.GenerateRequest(request_id=request_id, model=model or "")
    if cache_salt:
        r.cache_salt = cache_salt
    return r


class CompletionPrompt(RequestPart):
    """POST /v1/completions: the prompt and what names it."""

    model: StrictStr | None = None
    cache_salt: StrictStr | None = None
    add_special_tokens: StrictBool = True  # vLLM's: False tokenizes the text without BOS
    # validated when absent too: the validator says it is required
    prompt: Annotated[StrictStr | list[StrictInt], BeforeValidator(_one_prompt)] = Field(
        None, validate_default=True
    )

    def request(self, request_id: str) -> gen.GenerateRequest:
        r = _request(self.model, self.cache_salt, request_id)
        if isinstance(self.prompt, str):
            r.text = self.prompt
        else:
            r.token_ids.ids.extend(self.prompt)
        return r


class TextPart(BaseModel):
    """A chat content part: only text is supported."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["text"]
    text: StrictStr


_TEXT_PARTS = TypeAdapter(list[TextPart])


def _text_content(v: object) -> object:
    """Content as one string: null is empty, text parts are joined."""
    if v is None:
        return ""
    if isinstance(v, list):
        try:
            parts = _TEXT_PARTS.validate_python(v)
        except ValidationError:
            raise refused("only text content parts are supported") from None
        return "".join(p.text for p in parts)
    return v


class ChatMessage(BaseModel):
    """One chat message as the template sees it: a role and its text."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # validated when absent too: a message without a role names the roles
    role: Annotated[Role, _reworded(f"must be one of {list(get_args(Role))}")] = Field(
        None, validate_default=True
    )
    content: Annotated[StrictStr, BeforeValidator(_text_content)] = ""
    # an assistant turn's calls, and a tool turn's answer to one (the next turn of a tool
    # round trip), passed to the template as HF passes them
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None

    def for_template(self) -> dict[str, Any]:
        # OpenAI's `developer` is the system turn for every model without its own role for
        # it (as OpenAI maps it for them); chat templates know `system`
        role = "system" if self.role == "developer" else self.role
        m: dict[str, Any] = {"role": role, "content": self.content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if (v := getattr(self, key)) is not None:
                m[key] = v
        return template_message(m)


def _non_empty_list(v: object) -> object:
    if not isinstance(v, list) or not v:
        raise invalid("must be a non-empty list")
    return v


MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 8192
_TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "tools"})


class ChatPrompt(RequestPart):
    """POST /v1/chat/completions: the messages and what names the request. Validated with
    context `max_content_chars`: the content is bounded before the template runs."""

    messages: Annotated[list[ChatMessage], BeforeValidator(_non_empty_list)] = Field(
        None, validate_default=True
    )
    model: StrictStr | None = None
    cache_salt: StrictStr | None = None
    # vLLM's: how the template renders and the result is tokenized (unset: the defaults)
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    # vLLM's: more template variables (Qwen3's enable_thinking), bounded
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _bounded_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if len(v) > MAX_TEMPLATE_KWARGS or len(json.dumps(v)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise invalid(
                f"may hold at most {MAX_TEMPLATE_KWARGS} keys and "
                f"{MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON"
            )
        if taken := sorted(set(v) & _TEMPLATE_OWN):
            raise invalid(f"may not set {taken} (the request's own fields set them)")
        return v

    @field_validator("messages")
    @classmethod
    def _within_limit(cls, v: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
        limit = int((info.context or {})["max_content_chars"])
        chars = sum(len(m.content) for m in v)
        if chars > limit:
            tokens = int((info.context or {})["max_model_len"])
            what = (
                f"your messages have {chars} characters of content, and at most {limit} are "
                "accepted before they are rendered and tokenized"
            )
            raise too_long(too_long_message(tokens, what))
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise refused(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return v

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def request(self, request_id: str) -> gen.GenerateRequest:
        return _request(self.model, self.cache_salt, request_id)


# ---- sampling -----------------------------------------------------------------------------
_NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


class Sampling(RequestPart):
    """OpenAI's sampling fields plus vLLM's extras; unset stays unset in the proto."""

    max_tokens: Int32 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    top_k: Int32 | None = None
    min_tokens: Int32 | None = None
    n: Int32 | None = None
    best_of: Int32 | None = None
    seed: Int64 | None = None
    ignore_eos: StrictBool | None = None
    stop: Stop | None = None
    stop_token_ids: TokenIdList | None = None
    allowed_token_ids: TokenIdList | None = None
    bad_words: list[StrictStr] | None = None

    def proto(self, max_tokens: int | None) -> gen.SamplingParams:
        s = gen.SamplingParams()
        for key in _NUMBERS:
            if (v := getattr(self, key)) is not None:
                setattr(s, key, v)
        if self.top_k is not None and self.top_k not in (-1, 0):  # vLLM: -1 or 0 disables
            s.top_k = self.top_k
        for key in ("min_tokens", "n", "best_of", "seed"):
            if (iv := getattr(self, key)) is not None:
                setattr(s, key, iv)
        if max_tokens is not None:
            s.max_tokens = max_tokens
        if self.ignore_eos is not None:
            s.ignore_eos = self.ignore_eos
        if isinstance(self.stop, str):
            s.stop.append(self.stop)
        elif self.stop is not None:
            s.stop.extend(self.stop)
        if self.stop_token_ids is not None:
            s.stop_token_ids.extend(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            s.allowed_token_ids.ids.extend(self.allowed_token_ids)
            s.allowed_token_ids.SetInParent()  # set, even when empty (then refused)
        if self.bad_words:
            s.bad_words.extend(self.bad_words)
        return s


class CompletionSampling(Sampling):
    """POST /v1/completions: the sampling fields."""

    logprobs: Int32 | None = None  # top-N
    echo: StrictBool = False  # the prompt leads the text (and, with logprobs, the logprobs)
    prompt_logprobs: Int32 | None = None  # vLLM's


class ChatSampling(Sampling):
    """POST /v1/chat/completions: the sampling fields, checked after the prompt rendered."""

    # max_completion_tokens wins; then max_tokens is not looked at (nor checked)
    max_tokens: Int32 | None = Field(
        None, validation_alias=AliasChoices("max_completion_tokens", "max_tokens")
    )
    top_logprobs: Int32 | None = None
    logprobs: StrictBool | None = None
    prompt_logprobs: Int32 | None = None  # vLLM's


# ---- requests -----------------------------------------------------------------------------
class ChatRouter(Protocol):
    """What a chat request needs of the router (`router.core.Router`)."""

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def limits(self) -> ModelLimits: ...

    @property
    def cfg(self) -> RouterConfig: ...


def refuse_unsupported(d: dict[str, Any], endpoint: Endpoint) -> None:
    """A 400 naming the first field pdserve does not honour (router/openai/fields.py)."""
    if (hit := unsupported(d, endpoint)) is not None:
        raise bad_request(*hit)


def edge_checked(limits: ModelLimits, r: gen.GenerateRequest) -> gen.GenerateRequest:
    """`r` within the edge limits (router/validation.py), else the 400 naming the field."""
    try:
        limits.edge_limits().check(r)
    except ContextLengthError as e:
        raise HTTPError(400, e.message, param=e.field, code=CONTEXT_LENGTH_EXCEEDED) from e
    except InvalidParameterError as e:
        raise bad_request(e.field, str(e)) from e
    return r


def completion_request(
    d: dict[str, Any], request_id: str, router: ChatRouter | None = None
) -> gen.GenerateRequest:
    """POST /v1/completions body -> GenerateRequest (one prompt). A text prompt with
    `add_special_tokens: false` is tokenized here (on the caller's thread: give it a
    `router`); otherwise the router tokenizes it."""
    refuse_unsupported(d, "completions")
    prompt = CompletionPrompt.of(d)
    sampling = CompletionSampling.of(d)
    r = prompt.request(request_id)
    if not prompt.add_special_tokens and isinstance(prompt.prompt, str):
        if router is None or router.tokenizer is None:
            raise bad_request("prompt", "this model has no tokenizer; send token ids")
        edge_checked(router.limits, r)  # bounded before it is tokenized
        r.token_ids.ids.extend(router.tokenizer.encode(prompt.prompt, False))
    r.sampling.CopyFrom(sampling.proto(sampling.max_tokens))
    if sampling.logprobs is not None:
        r.sampling.logprobs = sampling.logprobs
    # echo with logprobs is what lm-evaluation-harness sends to score a prompt: its
    # tokens' logprobs come from the prompt pass (the larger top-N of the two fields)
    wanted = [n for n in (sampling.prompt_logprobs,) if n is not None]
    if sampling.echo and sampling.logprobs is not None:
        wanted.append(sampling.logprobs)
    if wanted:
        r.sampling.prompt_logprobs = max(wanted)
    Structured.of(d).apply(r)
    return r


def _continued(text: str, final: str) -> str:
    """The rendered chat cut after the final message's content, which the model then
    continues (transformers' `continue_final_message`, which vLLM uses)."""
    stripped = final.strip()
    at = text.rfind(stripped) if stripped else -1
    if at < 0:
        raise bad_request(
            "continue_final_message",
            "the final message does not appear in the chat after applying the chat template",
        )
    if text[at : at + len(final.lstrip())] == final:  # the template kept its spacing
        return text[: at + len(final.lstrip())]
    return text[: at + len(stripped)]


def render_chat(
    router: ChatRouter, prompt: ChatPrompt, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The template-rendered prompt's ids. By default the rendered text is tokenized without
    special tokens again: the template placed BOS (if any), as HF's
    apply_chat_template(tokenize=True) and vLLM do; `add_special_tokens` adds them."""
    tokenizer = router.tokenizer
    if tokenizer is None:
        raise bad_request("messages", "this model has no tokenizer; use /v1/completions")
    continued = prompt.continue_final_message
    add_generation_prompt = prompt.add_generation_prompt
    if add_generation_prompt is None:
        add_generation_prompt = not continued
    messages = prompt.template_messages()
    try:
        extra = dict(prompt.chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        text = tokenizer.apply_chat_template(messages, add_generation_prompt, extra)
    except ValueError as e:  # ChatTemplateError: the template's own message
        raise bad_request("messages", str(e).removeprefix("messages: ")) from e
    if continued:
        text = _continued(text, messages[-1]["content"])
    return tokenizer.encode(text, prompt.add_special_tokens)


def chat_request(router: ChatRouter, d: dict[str, Any], request_id: str) -> gen.GenerateRequest:
    """POST /v1/chat/completions body -> GenerateRequest (the template-rendered prompt)."""
    return chat_request_and_tools(router, d, request_id)[0]


def chat_request_and_tools(
    router: ChatRouter, d: dict[str, Any], request_id: str
) -> tuple[gen.GenerateRequest, ToolPlan | None]:
    """The GenerateRequest of a chat body, and how its tool calls are read (None: no tools
    in play; router/openai/tools.py)."""
    refuse_unsupported(d, "chat")
    limits = router.limits
    prompt = ChatPrompt.of(
        d,
        max_content_chars=limits.edge_limits().max_prompt_chars,
        max_model_len=limits.max_model_len,
    )
    sampling = ChatSampling.of(d)
    top = sampling.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:  # named as the client sent it
        raise bad_request("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
    http = router.cfg.http
    reads_tools = router.tokenizer is not None and router.tokenizer.template_reads("tools")
    plan = plan_tools(d, http.enable_auto_tool_choice, http.tool_call_parser, reads_tools)
    ids = render_chat(router, prompt, plan.template_tools() if plan else None)
    r = prompt.request(request_id)
    r.token_ids.ids.extend(ids)
    max_tokens = sampling.max_tokens
    if max_tokens is None:  # as vLLM: the rest of the context (as far as the KV cache holds
        # it), or generation_config's max_new_tokens if smaller
        rest = limits.room_after(len(ids))
        max_tokens = min(rest, limits.sampling_defaults.max_tokens or rest)
    r.sampling.CopyFrom(sampling.proto(max_tokens))
    if sampling.logprobs:
        r.sampling.logprobs = sampling.top_logprobs or 0
    elif sampling.top_logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
    if sampling.prompt_logprobs is not None:
        r.sampling.prompt_logprobs = sampling.prompt_logprobs
    constrained_by = Structured.of(d).apply(r)
    forced = plan.grammar() if plan else None
    if forced is not None:
        if constrained_by:
            raise bad_request(constrained_by, "a forced tool call is its own output constraint")
        r.structured_output.CopyFrom(forced)
    return r, plan
