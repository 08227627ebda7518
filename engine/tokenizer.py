"""Tokenizer from ``tokenizer.json`` (HF `tokenizers`), plus incremental detokenization.

The model never sees text; the engine uses this only to turn generated ids into text deltas
(for stop strings and streaming). `IncrementalDetokenizer` holds back a delta while it ends in
an incomplete UTF-8 sequence, so a stream never carries a broken character. The chat template
and the special tokens it reads come from the checkpoint (`engine.chat_template`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.chat_template import ChatTemplate, find_template
from engine.config import ConfigError, ModelConfig
from engine.structured import GrammarBackend

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
        chat_template: str | None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self._tok = tok
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._template = ChatTemplate(chat_template, self.special_tokens) if chat_template else None

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        cfg: ModelConfig | None = None,
        chat_template: str | Path | None = None,
    ) -> Tokenizer:
        """Read `tokenizer.json` and its configs; `chat_template` is a file that overrides
        the checkpoint's template. Raises ConfigError when there is no `tokenizer.json`."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise ConfigError(f"{root}: no tokenizer.json")
        tok = HFTokenizer.from_file(str(root / "tokenizer.json"))
        tok_cfg = {
            **_read_json(root / "special_tokens_map.json"),
            **_read_json(root / "tokenizer_config.json"),
        }
        gen_cfg = _read_json(root / "generation_config.json")
        special = _special_tokens(tok, tok_cfg, cfg)
        eos: set[int] = set(cfg.eos_token_ids) if cfg else set()
        gen_eos = gen_cfg.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos.add(gen_eos)
        elif isinstance(gen_eos, list):
            eos.update(int(e) for e in gen_eos)
        eos_id = tok.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if eos_id is not None:
            eos.add(int(eos_id))
        bos = cfg.bos_token_id if cfg else None
        template = find_template(root, tok_cfg, chat_template)
        return cls(tok, tuple(sorted(eos)), bos, template, special)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it runs (encode holds it): a long text
        # tokenized on a worker thread then leaves the caller's event loop running.
        [enc] = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(enc.ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """Render chat messages as HF's `apply_chat_template(tokenize=False)` does.

        Raises ChatTemplateError (a ValueError) with the template's own message; tokenize
        the result with `encode_chat`, since the template already placed any BOS.
        """
        if self._template is None:
            raise ValueError(
                "messages: this model has no chat template (give one with --chat-template FILE)"
            )
        return self._template.render(messages, add_generation_prompt, extra)

    def template_reads(self, name: str) -> bool:
        """Whether the chat template reads the variable `name` (False: no template)."""
        return self._template is not None and self._template.reads(name)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Template and tokenize as HF's `apply_chat_template(tokenize=True)`: the rendered
        text is encoded without adding special tokens again."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), False)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok)

    def to_str(self) -> str:
        """tokenizer.json as text (what a grammar backend in another process loads)."""
        return str(self._tok.to_str())

    def grammar_backend(self, vocab_size: int) -> GrammarBackend:
        """The structured-output backend for this tokenizer and a model's vocabulary (the
        model's may be larger than the tokenizer's); EOS ids stop a complete grammar."""
        return GrammarBackend(self._tok, vocab_size, self.eos_token_ids)


class IncrementalDetokenizer:
    """Feeds ids one at a time; returns only complete characters."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)
        self.text = ""

    def add(self, token_id: int) -> str:
        delta = self._stream.step(self._tok, token_id) or ""
        self.text += delta
        return delta


def _read_json(p: Path) -> dict[str, Any]:
    if not p.exists():
        return {}
    with open(p) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_str(v: object) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def _special_tokens(
    tok: HFTokenizer, tok_cfg: Mapping[str, Any], cfg: ModelConfig | None
) -> dict[str, str]:
    """`bos_token`, `eos_token`, ... as strings: the tokenizer config's, else the config ids'."""
    out: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = _token_str(tok_cfg.get(key))
        if value is not None:
            out[key] = value
    ids = (
        {"bos_token": cfg.bos_token_id, "eos_token": next(iter(cfg.eos_token_ids), None)}
        if cfg
        else {}
    )
    for key, token_id in ids.items():
        if key not in out and token_id is not None:
            text = tok.id_to_token(token_id)
            if text is not None:
                out[key] = text
    return out
