"""Structured outputs: what a request constrains its output to, and the grammar backend that
turns it into a per-step token bitmask (xgrammar, the default backend of vLLM and SGLang).

`StructuredOutput` is plain data (it rides `SamplingParams` to the workers): a kind and its
spec as text. `GrammarBackend` compiles it for one tokenizer, with a cache keyed by the spec
(one backend per tokenizer, so the key is (grammar, tokenizer) as the fingerprint says), and
makes a `GrammarMatcher` per request; the sampler fills each constrained row's bitmask from
its matcher and `Request.append_token` advances it.

Compiling is the slow part (milliseconds to seconds), so callers compile off the event loop
and off the engine thread (`compile` is thread-safe) and hand the compiled grammar to
`LLMEngine.make_request`. xgrammar loads lazily: a server that never sees a constrained
request never imports it.

What must hold across the prefill/decode handover: both sides compile the same spec with the
same backend and tokenizer (`fingerprint` names all three), the prefill side samples token
#1 under the grammar, and the decode side's matcher accepts it before anything else runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidParameterError

if TYPE_CHECKING:
    import xgrammar as xgr
    from tokenizers import Tokenizer as HFTokenizer

# json: a JSON schema (text); json_object: any JSON object (spec unused); regex; choice: a
# JSON list of strings; grammar: EBNF (GBNF, as xgrammar and llama.cpp read it);
# structural_tag: xgrammar's structural tag (JSON text), as vLLM passes it.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
CACHE_SIZE = 256  # compiled grammars kept per backend (LRU)
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def backend_name() -> str:
    """The grammar backend and its version: workers that differ here never pair."""
    try:
        return f"xgrammar {importlib.metadata.version('xgrammar')}"
    except importlib.metadata.PackageNotFoundError:
        return "none"


@dataclass(frozen=True)
class StructuredOutput:
    """One request's output constraint. `field` is the request field it came from (what an
    error names); it is not part of the constraint."""

    kind: str
    spec: str = ""
    field: str = field(default="structured_outputs", compare=False)
    strict: bool = True  # json: exactly the schema (False: unnamed properties allowed too)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParameterError(self.field, f"unknown kind {self.kind!r}; one of {KINDS}")

    @property
    def key(self) -> str:
        return f"{self.kind}\x00{int(self.strict)}\x00{self.spec}"


def lowly(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, run on the calling thread at a lower priority (nice +10 on Linux, where a
    thread has its own; a no-op elsewhere)."""

    def run() -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        fn()

    return run


class GrammarBackend:
    """xgrammar for one tokenizer and vocabulary. Thread-safe."""

    def __init__(self, tokenizer: HFTokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.name = backend_name()
        digest = hashlib.sha256(self.name.encode())
        digest.update(tokenizer.to_str().encode())
        digest.update(json.dumps([vocab_size, list(self.stop_token_ids)]).encode())
        self.tokenizer_fingerprint = digest.hexdigest()
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self.num_compiled = 0  # cache misses

    def fingerprint(self, so: StructuredOutput) -> str:
        """Backend version, tokenizer and grammar in one digest: equal on two workers only
        when their matchers accept the same tokens."""
        digest = hashlib.sha256(self.tokenizer_fingerprint.encode())
        digest.update(so.key.encode())
        return digest.hexdigest()[:32]

    def warm(self) -> None:
        """Do the cold work now (import xgrammar, build the tokenizer info: about a second):
        a worker calls it before it is ready and the router's checker child before its first
        check, so the first constrained request waits for its own compile only."""
        self._compiler_now()

    def _compiler_now(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids)
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar (cached); InvalidParameterError naming `so.field` when the
        spec does not compile."""
        with self._lock:
            hit = self._cache.get(so.key)
            if hit is not None:
                self._cache.move_to_end(so.key)
                return hit
        compiled = self._compile(self._compiler_now(), so)
        with self._lock:
            self._cache[so.key] = compiled
            self.num_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, so: StructuredOutput) -> xgr.CompiledGrammar:
        try:
            if so.kind == "json":
                return compiler.compile_json_schema(
                    so.spec, any_whitespace=False, strict_mode=so.strict
                )
            if so.kind == "json_object":  # an object, as OpenAI's json_object promises
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if so.kind == "regex":
                return compiler.compile_regex(so.spec)
            if so.kind == "choice":
                return compiler.compile_regex(choice_regex(json.loads(so.spec)))
            if so.kind == "grammar":
                return compiler.compile_grammar(so.spec)
            return _compile_structural_tag(compiler, so.spec)
        except InvalidParameterError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with its reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reason = _SOURCE_PREFIX.sub("", reason)  # "[07:40:25] /project/cpp/x.cc:94: "
            raise InvalidParameterError(so.field, f"does not compile: {reason[:300]}") from e

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)


def _compile_structural_tag(compiler: xgr.GrammarCompiler, spec: str) -> xgr.CompiledGrammar:
    """xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`), or vLLM's
    older form (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`)."""
    import xgrammar as xgr

    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
            )
            for s in tag["structures"]
        ]
        return compiler.compile_structural_tag(items, list(tag.get("triggers", [])))
    return compiler.compile_structural_tag(spec)


def choice_regex(choices: Any) -> str:
    """A regex matching exactly one of `choices` (a list of strings)."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def fill_bitmask(
    matchers: list[tuple[int, Any]], batch: int, vocab_size: int
) -> tuple[Any, list[int]]:
    """A [batch, words] bitmask with each (row, matcher)'s allowed tokens; the rows."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
    rows = []
    for row, m in matchers:
        m.fill_next_token_bitmask(bitmask, row)
        rows.append(row)
    return bitmask, rows


def apply_bitmask(logits: Any, bitmask: Any, rows: list[int]) -> None:
    """Mask out, in place, the tokens `bitmask` forbids on `rows` of `logits` [B, V]."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
