"""vLLM's `POST /tokenize` and `POST /detokenize` (docs/http.md#tokenize-and-detokenize).

`/tokenize` takes vLLM's TokenizeCompletionRequest (`prompt`, `add_special_tokens` true by
default) or, when the body has `messages`, its TokenizeChatRequest (the chat rendered as
`/v1/chat/completions` renders it: `add_generation_prompt`, `continue_final_message`,
`add_special_tokens` false by default) and answers ``{"count", "max_model_len", "tokens",
"token_strs": null}``. `/detokenize` takes ``{"model"?, "tokens"}`` and answers
``{"prompt": text}`` (special tokens kept, as vLLM's). Both are bounded by the edge limits
before the tokenizer runs, and run on a worker thread (the caller's `asyncio.to_thread`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictBool, StrictStr

from protos.pdserve.v1 import generation_pb2 as gen
from router.openai.protocol import (
    ChatPrompt,
    ChatRouter,
    HTTPError,
    RequestPart,
    TokenIdList,
    bad_request,
    edge_checked,
    invalid,
    refuse_unsupported,
    render_chat,
)
from router.openai.tools import ToolsPart, rendered
from router.validation import check_model as served_model


def _required(v: object) -> object:
    if v is None:
        raise invalid("is required")
    return v


class TokenizeText(RequestPart):
    """vLLM's TokenizeCompletionRequest."""

    model: StrictStr | None = None
    prompt: Annotated[StrictStr, BeforeValidator(_required)] = Field(None, validate_default=True)
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChat(ChatPrompt):
    """vLLM's TokenizeChatRequest: the chat prompt's fields."""

    return_token_strs: StrictBool = False


class Detokenize(RequestPart):
    """vLLM's DetokenizeRequest."""

    model: StrictStr | None = None
    tokens: TokenIdList = Field(None, validate_default=True)


def check_model(router: ChatRouter, model: str | None) -> None:
    """The served name (or none), else OpenAI's 404 with the router's message."""
    try:
        served_model(router.limits, model or "")
    except LookupError as e:
        raise HTTPError(404, str(e), param="model", code="model_not_found") from e


def _no_token_strs(wanted: bool) -> None:
    if wanted:
        raise bad_request(
            "return_token_strs", "return_token_strs is not supported (detokenize the ids)"
        )


def tokenize(router: ChatRouter, body: dict[str, Any]) -> dict[str, Any]:
    """POST /tokenize: the prompt's (or the rendered chat's) token ids."""
    limits = router.limits
    if "messages" in body:
        refuse_unsupported(body, "tokenize")
        chat = TokenizeChat.of(
            body,
            max_content_chars=limits.edge_limits().max_prompt_chars,
            max_model_len=limits.max_model_len,
        )
        _no_token_strs(chat.return_token_strs)
        edge_checked(limits, gen.GenerateRequest(model=chat.model or ""))
        check_model(router, chat.model)
        # the tools, as chat renders them for the model (vLLM's /tokenize takes them too)
        tools = ToolsPart.of(body).tools
        ids = render_chat(router, chat, rendered(tools) if tools else None)
    else:
        text = TokenizeText.of(body)
        _no_token_strs(text.return_token_strs)
        edge_checked(limits, gen.GenerateRequest(model=text.model or "", text=text.prompt))
        check_model(router, text.model)
        if router.tokenizer is None:
            raise bad_request("prompt", "this model has no tokenizer")
        ids = router.tokenizer.encode(text.prompt, text.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": limits.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }


def detokenize(router: ChatRouter, body: dict[str, Any]) -> dict[str, Any]:
    """POST /detokenize: the text of token ids."""
    limits = router.limits
    req = Detokenize.of(body)
    probe = gen.GenerateRequest(model=req.model or "")
    probe.token_ids.ids.extend(req.tokens)
    try:
        edge_checked(limits, probe)
    except HTTPError as e:
        if e.param == "prompt":  # the ids are this request's `tokens`
            raise bad_request("tokens", e.message.replace("prompt: ", "tokens: ", 1)) from e
        raise
    check_model(router, req.model)
    bad = next((t for t in req.tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise bad_request(
            "tokens", f"tokens: {bad} is not a token id (a vocabulary of {limits.vocab_size})"
        )
    if router.tokenizer is None:
        raise bad_request("tokens", "this model has no tokenizer")
    return {"prompt": router.tokenizer.decode(list(req.tokens), skip_special_tokens=False)}
