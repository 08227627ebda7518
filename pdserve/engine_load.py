"""The engine in process for a `--model` flag, shared by `pdserve generate` and the tools.

Its own module so that `pdserve.tools.trace` needs nothing from `pdserve.cli` (which imports
the tools' argument parsers): no import cycle. Importing it must stay cheap: the engine, and
with it torch, is imported only when `load_engine` runs (`pdserve --help` never does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.engine import LLMEngine


def load_engine(
    model: str,
    dtype: str,
    weights_seed: int = 0,
    chat_template: str | None = None,
    revision: str | None = None,
) -> LLMEngine:
    """The engine in process for `--model` (refused without a tokenizer: it takes text)."""
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.models import require_tokenizer, resolve_model

    path = resolve_model(model, seed=weights_seed, revision=revision)
    require_tokenizer(path, model)
    return LLMEngine.from_config(
        EngineConfig(model=str(path), dtype=dtype, chat_template=chat_template)
    )
