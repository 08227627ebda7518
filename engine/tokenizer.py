"""Tokenizer from ``tokenizer.json`` (HF `tokenizers`), plus incremental detokenization.

The model never sees text; the engine uses this only to turn generated ids into text deltas
(for stop strings and streaming). `IncrementalDetokenizer` holds back a delta while it ends in
an incomplete UTF-8 sequence, so a stream never carries a broken character.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.config import ModelConfig


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self._tok = tok
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path: str | Path, cfg: ModelConfig | None = None) -> Tokenizer:
        root = Path(path)
        tok = HFTokenizer.from_file(str(root / "tokenizer.json"))
        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        eos: set[int] = set(cfg.eos_token_ids) if cfg else set()
        gen_eos = gen_cfg.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos.add(gen_eos)
        elif isinstance(gen_eos, list):
            eos.update(int(e) for e in gen_eos)
        eos_tok = _token_str(tok_cfg.get("eos_token"))
        eos_id = tok.token_to_id(eos_tok) if eos_tok is not None else None
        if eos_id is not None:
            eos.add(int(eos_id))
        bos = cfg.bos_token_id if cfg else None
        template = tok_cfg.get("chat_template")
        return cls(tok, tuple(sorted(eos)), bos, template if isinstance(template, str) else None)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render chat messages with the checkpoint's Jinja template (jinja2 imported lazily)."""
        if not self.chat_template:
            raise ValueError("messages: this model has no chat template")
        import jinja2  # only the chat path needs it

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token="",
            eos_token="",
        )

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok)


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
