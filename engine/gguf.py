"""GGUF checkpoints (llama.cpp's format), read through `gguf` and transformers' converters.

A GGUF file carries the weights (often quantized), the architecture and the tokenizer in one
file. pdserve never parses it by hand: `gguf` reads and dequantizes the tensors (pdserve
only splits metadata arrays faster, into the same parts, `_plain_view_reader`) and
transformers maps llama.cpp's names and metadata onto HF's (including the inverse of the q/k
row permutation llama.cpp's converter applies for its rotary layout), so a GGUF loads into
exactly the tensors an HF checkpoint of the same model would hold.

Both libraries are imported inside the functions: `engine` itself imports with torch,
safetensors and tokenizers alone, and only a GGUF user needs the `gguf` extra.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config import MODEL_TYPES, SUPPORTED_ARCHITECTURES, ConfigError

_ARCH_OF_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}


def _transformers() -> Any:
    try:
        import gguf  # noqa: F401 - transformers needs it for GGUF and says so less clearly
        import transformers
    except ImportError as e:
        raise ConfigError(
            "loading a .gguf file needs the `gguf` and `transformers` packages: "
            "pip install 'pdserve[models]'"
        ) from e
    return transformers


def write_hf_metadata(gguf_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write `config.json`, the tokenizer files and `generation_config.json` for a GGUF.

    The tokenizer (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) and its
    special tokens come from the GGUF's metadata through transformers' GGUF tokenizer
    converter. Returns the config dict written. Raises ConfigError for an architecture
    pdserve does not serve.
    """
    tf = _transformers()
    src = Path(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with faster_gguf():  # config and tokenizer from one read of the metadata
        config = tf.AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
        arch = _ARCH_OF_MODEL_TYPE.get(MODEL_TYPES.get(config.model_type, config.model_type))
        if arch is None:
            raise ConfigError(
                f"{src.name}: GGUF architecture {config.model_type!r} is not served "
                f"(pdserve serves {sorted(_ARCH_OF_MODEL_TYPE)})"
            )
        config.architectures = [arch]
        config.save_pretrained(str(out))
        tf.GenerationConfig.from_model_config(config).save_pretrained(str(out))
        tokenizer = tf.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tokenizer.save_pretrained(str(out))
    with open(out / "config.json") as f:
        written: dict[str, Any] = json.load(f)
    return written


def gguf_tensors(
    gguf_path: str | Path, hf_config_dir: str | Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a GGUF, dequantized to float32, under its HF name.

    `hf_config_dir` holds the `config.json` that `write_hf_metadata` wrote for this file:
    transformers derives the llama.cpp -> HF name map from a model of that config, built on
    the meta device (no memory).
    """
    tf = _transformers()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = tf.AutoConfig.from_pretrained(str(hf_config_dir))
    with torch.device("meta"):
        skeleton = tf.AutoModelForCausalLM.from_config(config)
    with faster_gguf():
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    while tensors:
        name = next(iter(tensors))
        yield name, tensors.pop(name)


@contextlib.contextmanager
def faster_gguf() -> Iterator[None]:
    """Costs of `gguf` that transformers' GGUF loader pays, removed while it runs:

    - transformers builds gguf's tensor-name map anew for every module of the model (397
      times for a 30-layer Llama); the map is a pure function of (architecture, layer count),
      so one is built and reused;
    - `GGUFReader` walks the metadata one element at a time through `np.memmap` views, whose
      subclass hooks cost more than the walk itself: a 262k-token vocabulary is millions of
      them. `_PlainViewReader` reads the same mapped bytes through plain ndarray views (the
      same fields and tensors, and still no copy);
    - each of transformers' loads (config, tokenizer, tensors) opens its own reader of the
      same file and walks that metadata again: within one context a file is read once (a
      reader only maps the file read-only; nothing transformers does changes it).

    Re-entrant: an inner context uses the outer one's readers.
    """
    import gguf

    lib: Any = gguf  # its attributes are replaced for the load, then put back
    if getattr(lib.GGUFReader, "_pdserve_readers", None) is not None:
        yield
        return
    names, reader = lib.get_tensor_name_map, lib.GGUFReader
    plain = _plain_view_reader()
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = plain(path, mode)
        return readers[key]

    shared_reader._pdserve_readers = readers  # type: ignore[attr-defined]
    lib.get_tensor_name_map = functools.lru_cache(maxsize=None)(names)
    lib.GGUFReader = shared_reader
    try:
        yield
    finally:
        lib.get_tensor_name_map, lib.GGUFReader = names, reader
        readers.clear()


@functools.cache
def _plain_view_reader() -> type:
    import gguf
    import numpy as np

    vt = gguf.GGUFValueType

    class _PlainViewReader(gguf.GGUFReader):
        """`GGUFReader` whose `data` (set once, in its constructor, to the file's memmap) is
        a plain ndarray view of that memmap, and whose metadata arrays of strings or scalars
        are split into their elements in one loop (`_array_parts`) instead of one recursive
        `_get_field_parts` call each: a 262k-token vocabulary is 786k such calls, half of a
        Gemma 3 GGUF's load (docs/benchmarks.md). The fields are the stock reader's, part
        for part (same offsets, dtypes, indices and types; tests/test_gguf.py compares
        them, and test_real_model on the real file)."""

        @property
        def data(self) -> Any:
            return self._plain_data

        @data.setter
        def data(self, value: Any) -> None:
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type == vt.ARRAY:
                item = int(self._get(orig_offs, np.uint32)[0])
                if item == vt.STRING or item in self.gguf_scalar_to_np:
                    return self._array_parts(orig_offs, item)
            return super()._get_field_parts(orig_offs, raw_type)

        def _array_parts(self, orig_offs: int, item: int) -> Any:
            """The stock parts of an array of strings or scalars: its item type and length,
            then per element a (length, bytes) pair or a one-element view; the data indices
            point at each element's bytes or value."""
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs, n, data = orig_offs + 12, int(alen[0]), self.data
            parts: list[Any] = [raw_itype, alen]
            if item == vt.STRING:
                u64 = alen.dtype  # in the file's byte order, as `_get` gives it
                idxs = list(range(3, 3 + 2 * n, 2))
                for _ in range(n):
                    slen = data[offs : offs + 8].view(u64)
                    size = int(slen[0])
                    parts += (slen, data[offs + 8 : offs + 8 + size])
                    offs += 8 + size
            else:
                whole = self._get(offs, self.gguf_scalar_to_np[vt(item)], n)
                parts += (whole[i : i + 1] for i in range(n))
                idxs = list(range(2, 2 + n))
                offs += int(whole.nbytes)
            return offs - orig_offs, parts, idxs, [vt.ARRAY, *([vt(item)] if n else [])]

    return _PlainViewReader
