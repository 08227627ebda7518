"""The serve config tree: every component's own config dataclass, composed once.

The YAML file (`--config`), the CLI flags and the Helm values all map onto this tree; none of
them redefines a setting. Precedence: defaults < YAML < flags. docs/config.md documents it.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from engine.config import CacheConfig, SchedulerConfig
from kv_transfer.config import TransferConfig
from pdserve.models import DEFAULT_MODEL
from pool_api.config import REDACTED, IndexConfig, redact_url
from router.config import RouterConfig

T = TypeVar("T")


@dataclass(frozen=True)
class ModelSettings:
    # A named model, preset, checkpoint directory, .gguf file or Hub id (pdserve.models).
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # default: the model's name as given
    # auto: the checkpoint's, but 16-bit on a CPU only with bf16 hardware (engine.engine)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (float16 -> float32 on CPU)
    chat_template: str | None = None  # a Jinja file overriding the checkpoint's template
    weights_seed: int = 0  # seed of a generated preset
    # A Hub id's branch, tag or commit (vLLM's --revision); None: its default branch. A
    # commit hash pins what is served; refused for anything but a Hub id.
    revision: str | None = None
    device: str = "cpu"


@dataclass(frozen=True)
class PoolConfig:
    """One worker pool's size and Ray actor options."""

    num_workers: int = 1
    num_cpus: float = 0.5  # fractional on CPU: router + 1 prefill + 1 decode fit on 2 cores
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources
    # Ray restarts a dead worker this many times (-1: always); the router probes it back.
    max_restarts: int = 10
    max_concurrency: int = 1000
    num_threads: int = 1  # torch intra-op threads per worker (Ray sets 1)
    # A worker whose engine has been on one step this long is stuck: the router marks it
    # down (a busy worker is not: WorkerBase.stats). Above the longest prompt pass expected.
    stall_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.num_workers < 0 or self.num_threads < 1:
            raise ValueError("num_workers must be >= 0 and num_threads >= 1")
        if self.stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be positive")


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # None: start a local Ray; "auto" or HOST:PORT: join one
    namespace: str = "pdserve"
    detached: bool = False  # keep worker actors alive after `pdserve serve` exits


@dataclass(frozen=True)
class ServeConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    colocated: bool = False  # decode workers run both phases (the comparison baseline)

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        overrides: dict[str, dict[str, Any] | Any] | None = None,
    ) -> ServeConfig:
        """Defaults, then the YAML file, then `overrides` ({section: {key: value}})."""
        data: dict[str, Any] = {}
        if path is not None:
            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: top level must be a mapping")
            data = loaded
        overrides = overrides or {}
        for key, value in overrides.items():
            if isinstance(value, dict):
                data.setdefault(key, {}).update(value)
            else:
                data[key] = value
        _one_kv_sizing(data, overrides)
        return from_dict(cls, data, "")

    def to_dict(self, *, reveal_secrets: bool = False) -> dict[str, Any]:
        """The tree as plain data, fit to print or log: the secret fields (those kept out of
        repr: `router.api_key`, `transfer.shared_secret`, `index.redis_url`) are masked, a URL
        down to its password (`redis://user:***@host`). `reveal_secrets` keeps them."""
        data = dataclasses.asdict(self)
        return data if reveal_secrets else _redacted(self, data)


KV_MEMORY_KEYS = ("kv_cache_memory", "gpu_memory_utilization")


def _one_kv_sizing(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    """One way to size the KV cache wins: `cache.num_blocks` given explicitly overrides the
    memory settings (`--num-kv-blocks` stays an override), unless a memory flag overrides a
    `num_blocks` from the YAML file; and a memory flag replaces the file's other one."""
    cache = data.get("cache")
    if not isinstance(cache, dict):
        return
    flags = overrides.get("cache") if isinstance(overrides.get("cache"), dict) else {}
    assert isinstance(flags, dict)
    memory_flags = [k for k in KV_MEMORY_KEYS if k in flags]
    if "num_blocks" in flags or ("num_blocks" in cache and not memory_flags):
        for key in KV_MEMORY_KEYS:
            cache.pop(key, None)
    elif memory_flags:
        cache.pop("num_blocks", None)
        if len(memory_flags) == 1:
            cache.pop(next(k for k in KV_MEMORY_KEYS if k not in memory_flags), None)


def _redacted(obj: Any, data: dict[str, Any]) -> dict[str, Any]:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            _redacted(value, data[f.name])
        elif not f.repr and value is not None:
            is_url = isinstance(value, str) and f.name.endswith("_url")
            data[f.name] = redact_url(value) if is_url else REDACTED
    return data


# Keys a config file may still carry from an earlier release: what became of each.
RETIRED_KEYS = {
    "router.token_stream": "removed: decode workers always push tokens to the router's sink",
    "router.poll_timeout_s": "renamed router.heartbeat_s",
}


def from_dict(cls: type[T], data: dict[str, Any], where: str) -> T:
    """Build a (nested) frozen dataclass, rejecting unknown keys with their dotted path (and
    a retired key with what became of it)."""
    assert is_dataclass(cls)
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    for key in sorted(f"{where}{k}" for k in unknown):
        if key in RETIRED_KEYS:
            raise ValueError(f"config: {key} was {RETIRED_KEYS[key]}")
    if unknown:
        raise ValueError(f"config: unknown key(s) {sorted(f'{where}{k}' for k in unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        target = _dataclass_in(hint)
        if target is not None and isinstance(value, dict):
            kwargs[name] = from_dict(target, value, f"{where}{name}.")
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config {where or '<root>'}: {e}") from e


def _dataclass_in(hint: Any) -> type | None:
    if is_dataclass(hint) and isinstance(hint, type):
        return hint
    if get_origin(hint) in (Union, types.UnionType):
        for arg in get_args(hint):
            if is_dataclass(arg) and isinstance(arg, type):
                return arg
    return None
