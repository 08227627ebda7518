"""Turning a `GenerateRequest` into checked prompt ids and `SamplingParams`.

Everything here runs at the edge: a bad request raises InvalidParameterError naming the field
and never reaches a worker.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from engine.config import GenerationDefaults
from engine.sampling import InvalidParameterError, SamplingParams
from engine.structured import StructuredOutput
from engine.tokenizer import Tokenizer
from engine.validation import ContextLengthError, check_request, too_long_message
from pool_api.messages import WorkerRequest
from protos.pdserve.v1 import generation_pb2 as gen
from router.config import RouterConfig

_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class ModelLimits:
    served_model_name: str
    vocab_size: int
    max_model_len: int
    # The KV pool every worker has (both pools share the cache config); 0: not checked.
    block_size: int = 0
    num_kv_blocks: int = 0
    # The checkpoint's generation_config.json: defaults for fields a request leaves unset.
    sampling_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    edge: EdgeLimits | None = None  # None: RouterConfig's defaults for max_model_len

    def edge_limits(self) -> EdgeLimits:
        return self.edge or EdgeLimits.of(RouterConfig(), self.max_model_len)

    def room_after(self, num_prompt_tokens: int) -> int:
        """The most tokens a request of this prompt may generate: the rest of the context,
        and no more than one request alone can hold in the KV cache (its peak is every
        token but the last sampled one); at least 1, so an overlong prompt meets the
        context-length check rather than a max_tokens one."""
        rest = self.max_model_len - num_prompt_tokens
        if self.num_kv_blocks:
            rest = min(rest, self.num_kv_blocks * self.block_size - num_prompt_tokens + 1)
        return max(rest, 1)


def _float(s: gen.SamplingParams, name: str, default: float) -> float:
    return float(getattr(s, name)) if s.HasField(name) else default


_MAX_NAME_CHARS = 256  # request_id, model, cache_salt
_ECHO_CHARS = 64  # of user input quoted back in an error message
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request (an internal bound, not a setting)
# Structured outputs, bounded before anything compiles (the compile itself is bounded in
# time by router.grammar_check): a spec's bytes, a JSON schema's nesting, a regex's length,
# the choices; and logit_bias's entries (OpenAI's own bound).
MAX_GRAMMAR_BYTES = 64 << 10
MAX_SCHEMA_DEPTH = 32
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_LOGIT_BIAS = 300
MAX_ALLOWED_TOKEN_IDS = 65536
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
STRUCTURED_FIELD = "structured_output"  # the GenerateRequest field (HTTP names its own)


@dataclass(frozen=True)
class EdgeLimits:
    """Bounds on a request's size, checked before it is tokenized (router.config)."""

    max_prompt_chars: int
    max_prompt_tokens: int
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 256
    max_n: int = 16

    @classmethod
    def of(cls, cfg: RouterConfig, max_model_len: int) -> EdgeLimits:
        return cls(
            max_prompt_chars=cfg.limits.max_prompt_chars or 32 * max_model_len,
            max_prompt_tokens=max_model_len,
            max_stop_strings=cfg.limits.max_stop_strings,
            max_stop_chars=cfg.limits.max_stop_chars,
            max_stop_token_ids=MAX_STOP_TOKEN_IDS,
            max_n=cfg.limits.max_n,
        )

    def check(self, request: gen.GenerateRequest) -> None:
        """Raise InvalidParameterError naming the first field over its bound."""
        for name in ("request_id", "model", "cache_salt"):
            if len(getattr(request, name)) > _MAX_NAME_CHARS:
                raise InvalidParameterError(name, f"must be at most {_MAX_NAME_CHARS} characters")
        if any(ord(c) < 0x20 for c in request.request_id):  # the engine's choice separator
            raise InvalidParameterError("request_id", "must not contain control characters")
        chat = request.WhichOneof("prompt") == "chat"
        field, chars = (
            ("chat", sum(len(m.role) + len(m.content) for m in request.chat.messages))
            if chat
            else ("prompt", len(request.text))
        )
        if chars > self.max_prompt_chars:
            what = (
                f"your {field} has {chars} characters, and at most "
                f"{self.max_prompt_chars} are accepted before it is tokenized"
            )
            raise ContextLengthError(field, too_long_message(self.max_prompt_tokens, what))
        if len(request.token_ids.ids) > self.max_prompt_tokens:
            what = f"your prompt has {len(request.token_ids.ids)} tokens"
            raise ContextLengthError("prompt", too_long_message(self.max_prompt_tokens, what))
        s = request.sampling
        check_choices(s, self.max_n)
        if len(s.stop) > self.max_stop_strings:
            raise InvalidParameterError("stop", f"at most {self.max_stop_strings} stop strings")
        if any(len(x) > self.max_stop_chars for x in s.stop):
            raise InvalidParameterError(
                "stop", f"a stop string may have at most {self.max_stop_chars} characters"
            )
        if len(s.stop_token_ids) > self.max_stop_token_ids:
            raise InvalidParameterError(
                "stop_token_ids", f"at most {self.max_stop_token_ids} stop token ids"
            )
        if len(s.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParameterError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
        if len(s.allowed_token_ids.ids) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidParameterError(
                "allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} token ids"
            )
        if len(s.bad_words) > MAX_BAD_WORDS or any(
            not w or len(w) > MAX_BAD_WORD_CHARS for w in s.bad_words
        ):
            raise InvalidParameterError(
                "bad_words",
                f"at most {MAX_BAD_WORDS} words, each 1 to {MAX_BAD_WORD_CHARS} characters",
            )


def check_choices(s: gen.SamplingParams, max_n: int) -> None:
    """`n` and `best_of` within `router.limits.max_n` (best_of at least n); an unset n is 1,
    an n of 0 is refused (as OpenAI does), never taken for 1."""
    n = _int(s, "n")
    n = 1 if n is None else n
    best_of = _int(s, "best_of")
    if not 1 <= n <= max_n:
        raise InvalidParameterError("n", f"must be in [1, {max_n}], got {n}")
    if best_of is not None and not n <= best_of <= max_n:
        raise InvalidParameterError("best_of", f"must be in [n={n}, {max_n}], got {best_of}")


def echo(value: str) -> str:
    """User input quoted in an error message, cut to a bounded length."""
    return repr(value if len(value) <= _ECHO_CHARS else value[:_ECHO_CHARS] + "...")


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _int(s: gen.SamplingParams, name: str) -> int | None:
    return int(getattr(s, name)) if s.HasField(name) else None


def sampling_from_proto(
    s: gen.SamplingParams, defaults: GenerationDefaults | None = None
) -> SamplingParams:
    """Unset optional scalars take the checkpoint's generation defaults where it has them,
    else OpenAI's (temperature 1.0, not 0; max_tokens 16)."""
    defaults = defaults or GenerationDefaults()
    n = _int(s, "n") or 1
    best_of = _int(s, "best_of") or n
    logprobs = _int(s, "logprobs")
    if best_of > n and logprobs is None:
        logprobs = 0  # the router ranks sequences by their tokens' logprobs (not returned)
    max_tokens = _int(s, "max_tokens")
    if max_tokens is None:
        max_tokens = defaults.max_tokens or _DEFAULT_MAX_TOKENS
    top_k = _int(s, "top_k")
    return SamplingParams(
        temperature=_float(s, "temperature", _or(defaults.temperature, 1.0)),
        top_p=_float(s, "top_p", _or(defaults.top_p, 1.0)),
        top_k=top_k if s.HasField("top_k") else defaults.top_k,
        min_p=_float(s, "min_p", _or(defaults.min_p, 0.0)),
        repetition_penalty=_float(s, "repetition_penalty", _or(defaults.repetition_penalty, 1.0)),
        frequency_penalty=_float(s, "frequency_penalty", 0.0),
        presence_penalty=_float(s, "presence_penalty", 0.0),
        seed=_int(s, "seed"),
        max_tokens=max_tokens,
        min_tokens=_int(s, "min_tokens") or 0,
        ignore_eos=s.HasField("ignore_eos") and s.ignore_eos,
        stop=tuple(s.stop),
        stop_token_ids=tuple(int(t) for t in s.stop_token_ids),
        logprobs=logprobs,
        prompt_logprobs=_int(s, "prompt_logprobs"),
        n=best_of,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items())),
        allowed_token_ids=(
            tuple(int(t) for t in s.allowed_token_ids.ids)
            if s.HasField("allowed_token_ids")
            else None
        ),
    )


def json_depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, depth = stack.pop()
        deepest = max(deepest, depth)
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack.extend((c, depth + 1) for c in children)
    return deepest


def structured_from_proto(request: gen.GenerateRequest) -> StructuredOutput | None:
    """The request's output constraint, bounded at the edge; InvalidParameterError names
    `structured_output` (HTTP maps it to the field its body used)."""
    if not request.HasField("structured_output"):
        return None
    so = request.structured_output
    kind = so.WhichOneof("kind")
    f = STRUCTURED_FIELD
    if kind is None:
        raise InvalidParameterError(f, "set one of json_schema, json_object, regex, choice, ...")
    if kind == "json_object":
        return StructuredOutput("json_object", "", f)
    if kind == "choice":
        choices = list(so.choice.choices)
        if not choices or len(choices) > MAX_CHOICES or not all(choices):
            raise InvalidParameterError(f, f"choice: 1 to {MAX_CHOICES} non-empty strings")
        spec = json.dumps(choices)
    else:
        spec = getattr(so, kind)
    if len(spec.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidParameterError(f, f"{kind}: at most {MAX_GRAMMAR_BYTES} bytes")
    if kind == "regex" and len(spec) > MAX_REGEX_CHARS:
        raise InvalidParameterError(f, f"regex: at most {MAX_REGEX_CHARS} characters")
    if kind in ("json_schema", "structural_tag"):
        try:
            parsed = json.loads(spec)
        except ValueError as e:
            raise InvalidParameterError(f, f"{kind}: not valid JSON ({e})") from e
        if kind == "json_schema" and not isinstance(parsed, dict | bool):
            raise InvalidParameterError(f, "json_schema: must be a JSON object")
        if json_depth(parsed) > MAX_SCHEMA_DEPTH:
            raise InvalidParameterError(f, f"{kind}: nested deeper than {MAX_SCHEMA_DEPTH}")
    if kind == "json_schema":
        return StructuredOutput("json", spec, f, strict=not so.lenient)
    return StructuredOutput(kind, spec, f)


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of `bad_words`: each word as written (its leading spaces
    stripped), and again after a space when that gives other tokens of the same count (the
    word in mid-sentence)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if bare:
            out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def check_model(limits: ModelLimits, model: str) -> None:
    """The served name, or none at all; else LookupError (NOT_FOUND / 404)."""
    if model and model != limits.served_model_name:
        raise LookupError(
            f"model {echo(model)} is not served here (serving {limits.served_model_name!r})"
        )


def prepare(
    request: gen.GenerateRequest, tokenizer: Tokenizer | None, limits: ModelLimits
) -> WorkerRequest:
    """Validate and tokenize; raises InvalidParameterError naming the bad field."""
    limits.edge_limits().check(request)  # sizes first: nothing below runs on an oversized request
    check_model(limits, request.model)
    params = sampling_from_proto(request.sampling, limits.sampling_defaults)
    structured = structured_from_proto(request)
    if structured is not None:
        params = replace(params, structured=structured)
    if request.sampling.bad_words:
        if tokenizer is None:
            raise InvalidParameterError("bad_words", "this model has no tokenizer")
        words = bad_words_token_ids(tokenizer, request.sampling.bad_words)
        params = replace(params, bad_words_token_ids=words)
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise InvalidParameterError("prompt", "must not be empty")
        if tokenizer is None:
            raise InvalidParameterError("text", "this model has no tokenizer; send token_ids")
        ids = tokenizer.encode(request.text)
    elif kind == "token_ids":
        ids = [int(t) for t in request.token_ids.ids]
    elif kind == "chat":
        if tokenizer is None:
            raise InvalidParameterError("chat", "this model has no tokenizer; send token_ids")
        ids = chat_ids(tokenizer, request.chat)
    else:
        raise InvalidParameterError("prompt", "must not be empty: set text, token_ids or chat")
    check_request(
        ids,
        params,
        limits.vocab_size,
        limits.max_model_len,
        limits.block_size,
        limits.num_kv_blocks,
    )
    return WorkerRequest(
        request_id=request.request_id or f"req-{uuid.uuid4().hex}",
        prompt_token_ids=tuple(ids),
        params=params,
        cache_salt=request.cache_salt,
    )


CHAT_ROLES = ("system", "user", "assistant")


def chat_ids(tokenizer: Tokenizer, chat: gen.Chat) -> list[int]:
    """A gRPC chat's prompt ids: the model's chat template with the generation prompt, then
    tokenized without adding special tokens again (what HTTP's chat does, router/openai)."""
    if not chat.messages:
        raise InvalidParameterError("chat.messages", "must not be empty")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidParameterError(
                f"chat.messages[{i}].role",
                f"must be one of {', '.join(CHAT_ROLES)}, got {echo(m.role)}",
            )
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    try:
        return tokenizer.encode_chat(messages)
    except ValueError as e:  # the template's own refusal (a role order it does not take)
        raise InvalidParameterError("chat.messages", str(e).removeprefix("messages: ")) from e
