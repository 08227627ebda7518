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

from engine import kernel_spec
from engine.config import CacheConfig, SchedulerConfig
from engine.settings import Bounds, check_settings, doc_of, setting
from kv_transfer.config import TransferConfig
from pdserve.models import DEFAULT_MODEL
from pool_api.config import REDACTED, IndexConfig, redact_url
from router.config import PlannerSettings, RouterConfig

T = TypeVar("T")


@dataclass(frozen=True)
class ModelSettings:
    """What is served (pdserve.models resolves `model`)."""

    model: str = setting(
        DEFAULT_MODEL,
        "a named model (`pdserve model list`), a preset (tiny, small), a checkpoint directory, "
        "a .gguf file or a Hub id",
    )
    served_model_name: str | None = setting(
        None, "the model name the API serves; unset: `model` as given"
    )
    dtype: str = setting(
        "auto",
        "compute dtype; auto: the checkpoint's, but 16-bit on a CPU only where bf16 runs in "
        "hardware (float16 computes in float32 on a CPU)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    chat_template: str | None = setting(
        None, "a Jinja file overriding the checkpoint's chat template"
    )
    weights_seed: int = setting(0, "seed of a generated preset's random weights")
    revision: str | None = setting(
        None,
        "a Hub id's branch, tag or commit (vLLM's --revision); a commit pins what is served; "
        "refused for anything but a Hub id; unset: the default branch",
    )
    device: str = setting("cpu", "cpu, or cuda (the Helm chart sets it from the pool's GPUs)")
    kernels: str = setting("auto", kernel_spec.HELP)
    batch_invariant: bool = setting(
        True,
        "a request's greedy tokens depend on the request alone, never on its batch, chunks, "
        "cached prefix or placement: only kernels that pass an invariance probe serve "
        "(docs/benchmarks.md has the cost)",
    )

    def __post_init__(self) -> None:
        check_settings(self, "model.")
        try:
            kernel_spec.parse_spec(self.kernels)
        except ValueError as e:
            raise ValueError(f"model.{e}") from None


@dataclass(frozen=True)
class PoolConfig:
    """One worker pool's size and Ray actor options."""

    num_workers: int = setting(1, "workers in the pool (Ray actors)", ge=0)
    num_cpus: float = setting(
        0.5,
        "Ray CPUs per worker (fractional on CPU: router + 1 prefill + 1 decode fit 2 cores)",
        ge=0,
    )
    num_gpus: float = setting(0.0, "Ray GPUs per worker", ge=0)
    resources: dict[str, float] = setting(
        default_factory=dict, doc="custom Ray resources per worker"
    )
    max_restarts: int = setting(
        10,
        "Ray restarts a dead worker this many times (-1: always); the router probes it back",
        ge=-1,
    )
    num_threads: int = setting(
        0,
        "torch intra-op threads per worker; auto: on the local cluster pdserve starts, this "
        "host's cores shared evenly among the workers it starts (a colocated worker alone "
        "gets them all, 1P1D on 2 cores one each), on a cluster it joins the worker's Ray "
        "CPUs (num_cpus, at least 1)",
        ge=0,
        zero="auto",
    )
    cpu_affinity: str = setting(
        "",
        "pin each worker to cores, one set per worker separated by ';' (e.g. '0;1', or "
        "'0-5;6,7' for a 6:2 split); a pinned worker runs as many torch threads as it has "
        "cores (num_threads is ignored); empty: not pinned",
        zero="not pinned",
    )
    stall_timeout_s: float = setting(
        120.0,
        "a worker whose engine has been on one step or call this long is stuck: its stats "
        "raise and the router marks it down (a busy worker answers with its last stats); "
        "above the longest prompt pass expected",
        gt=0,
    )

    def __post_init__(self) -> None:
        check_settings(self, "pool.")
        sets = cpu_sets(self.cpu_affinity)
        if sets and len(sets) < self.num_workers:
            raise ValueError(
                f"pool.cpu_affinity={self.cpu_affinity!r}: {len(sets)} core sets for "
                f"{self.num_workers} workers (one set each)"
            )


def cpu_sets(text: str) -> list[tuple[int, ...]]:
    """`cpu_affinity`'s core sets: '0-3;4,6' -> [(0, 1, 2, 3), (4, 6)]; ValueError naming
    the setting when a set is malformed or empty."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        cores: set[int] = set()
        for item in part.split(","):
            lo, _, hi = item.strip().partition("-")
            try:
                first, last = int(lo), int(hi or lo)
            except ValueError:
                raise ValueError(
                    f"pool.cpu_affinity={text!r}: {item.strip()!r} is not a core or a range"
                ) from None
            if first < 0 or last < first:
                raise ValueError(f"pool.cpu_affinity={text!r}: {item.strip()!r} is empty")
            cores.update(range(first, last + 1))
        out.append(tuple(sorted(cores)))
    return out


@dataclass(frozen=True)
class RayConfig:
    address: str | None = setting(
        None, "auto or HOST:PORT of a cluster started with `ray start --head`; unset: a local Ray"
    )
    namespace: str = setting("pdserve", "the Ray namespace the workers' named actors live in")
    detached: bool = setting(
        False, "keep the worker actors alive after `pdserve serve` exits (a later one attaches)"
    )


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
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    ray: RayConfig = field(default_factory=RayConfig)
    colocated: bool = setting(
        False, "decode workers run both phases, no prefill pool (the comparison baseline)"
    )

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
        merge(data, overrides)
        _one_kv_sizing(data, overrides)
        return from_dict(cls, data, "")

    def to_dict(self, *, reveal_secrets: bool = False) -> dict[str, Any]:
        """The tree as plain data, fit to print or log: the secret fields (those kept out of
        repr: `router.api_key`, `transfer.shared_secret`, `index.redis_url`) are masked, a URL
        down to its password (`redis://user:***@host`). `reveal_secrets` keeps them."""
        data = dataclasses.asdict(self)
        return data if reveal_secrets else _redacted(self, data)


def merge(into: dict[str, Any], overrides: dict[str, Any]) -> None:
    """`overrides` into `into`, section by section (a flag replaces one key, not a section)."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


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
_MOVED = {
    "router.grpc_port": "router.grpc.port",
    "router.http_port": "router.http.port",
    "router.http_enabled": "router.http.enabled",
    "router.http_keepalive_timeout_s": "router.http.keepalive_timeout_s",
    "router.grpc_max_concurrent_streams": "router.grpc.max_concurrent_streams",
    "router.grpc_max_connection_idle_s": "router.grpc.max_connection_idle_s",
    "router.grpc_max_connection_age_s": "router.grpc.max_connection_age_s",
    "router.grpc_max_connection_age_grace_s": "router.grpc.max_connection_age_grace_s",
    "router.tls_cert": "router.tls.cert",
    "router.tls_key": "router.tls.key",
    "router.tls_client_ca": "router.tls.client_ca",
    "router.max_prompt_chars": "router.limits.max_prompt_chars",
    "router.max_body_bytes": "router.limits.max_body_bytes",
    "router.max_stop_strings": "router.limits.max_stop_strings",
    "router.max_stop_chars": "router.limits.max_stop_chars",
    "router.max_connections": "router.limits.max_connections",
    "router.max_queue_len": "router.policy.max_queue_len",
    "router.queue_timeout_s": "router.policy.queue_timeout_s",
    "router.local_prefill_threshold": "router.policy.local_prefill_threshold",
    "router.prefill_overflow_tokens": "router.policy.prefill_overflow_tokens",
    "router.prefill_failure_policy": "router.policy.prefill_failure_policy",
    "router.prefill_tokens_per_s": "router.policy.prefill_tokens_per_s",
    "router.transfer_gbps": "router.policy.transfer_gbps",
    "router.poll_timeout_s": "router.heartbeat_s",
}
_INTERNAL = {
    "router.stats_interval_s": "router.core.STATS_REFRESH_S",
    "router.http_header_timeout_s": "router.http_guard.HEADER_TIMEOUT_S",
    "router.http_body_timeout_s": "router.http_guard.BODY_TIMEOUT_S",
    "router.http_max_header_bytes": "router.http_guard.MAX_HEADER_BYTES",
    "router.http_backlog": "router.http_guard.BACKLOG",
    "router.grpc_handshake_timeout_s": "router.service.HANDSHAKE_TIMEOUT_S",
    "router.grpc_keepalive_time_s": "router.service.KEEPALIVE_TIME_S",
    "router.grpc_keepalive_timeout_s": "router.service.KEEPALIVE_TIMEOUT_S",
    "router.max_stop_token_ids": "router.validation.MAX_STOP_TOKEN_IDS",
    "router.max_json_depth": "router.openai.body.MAX_JSON_DEPTH",
    "transfer.max_channels": "kv_transfer.sender.DEFAULT_MAX_CHANNELS",
    "index.publish_interval_s": "pool_api.index_feed.PUBLISH_INTERVAL_S",
    "prefill.max_concurrency": "pdserve.launch.ACTOR_MAX_CONCURRENCY",
    "decode.max_concurrency": "pdserve.launch.ACTOR_MAX_CONCURRENCY",
}
RETIRED_KEYS = {
    "router.token_stream": "removed: decode workers always push tokens to the router's sink",
    **{old: f"renamed {new}" for old, new in _MOVED.items()},
    **{old: f"removed: an internal now ({where})" for old, where in _INTERNAL.items()},
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
        # a setting's own check names its dotted path already ("cache.block_size=3 ...")
        named = where and str(e).startswith(where)
        raise ValueError(f"config: {e}" if named else f"config {where or '<root>'}: {e}") from e


def _dataclass_in(hint: Any) -> type | None:
    if is_dataclass(hint) and isinstance(hint, type):
        return hint
    if get_origin(hint) in (Union, types.UnionType):
        for arg in get_args(hint):
            if is_dataclass(arg) and isinstance(arg, type):
                return arg
    return None


# ---- the settings' documentation (--help, docs/config.md) --------------------------------
@dataclass(frozen=True)
class SettingDoc:
    """One setting as its declaration documents it (engine.settings.setting)."""

    path: str  # dotted: router.http.port
    type_name: str
    default: Any
    doc: str
    bounds: Bounds
    secret: bool

    def help_text(self) -> str:
        bounds = self.bounds.text()
        return f"{self.doc} [{bounds}]" if bounds and self.bounds.choices is None else self.doc

    def default_text(self) -> str:
        if self.secret:
            return "none"
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)


def settings(cls: type = ServeConfig, prefix: str = "", instance: Any = None) -> list[SettingDoc]:
    """Every setting of the tree under `cls`, in declaration order, sections depth first."""
    instance = cls() if instance is None else instance
    hints = get_type_hints(cls)
    out: list[SettingDoc] = []
    for f in fields(cls):
        value = getattr(instance, f.name)
        meta = doc_of(f)
        if meta is None:
            assert is_dataclass(value), f"{prefix}{f.name}: a setting without its documentation"
            out += settings(type(value), f"{prefix}{f.name}.", value)
            continue
        name = _type_name(hints[f.name])
        out.append(SettingDoc(f"{prefix}{f.name}", name, value, meta[0], meta[1], not f.repr))
    return out


def setting_doc(path: str) -> SettingDoc:
    """The setting at a dotted path of the serve tree."""
    parent = path.rpartition(".")[0]
    cls: Any = ServeConfig
    for section in parent.split(".") if parent else ():
        cls = _dataclass_in(get_type_hints(cls)[section])
    (doc,) = [d for d in settings(cls, f"{parent}." if parent else "") if d.path == path]
    return doc


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


GENERATED_BEGIN = "<!-- generated from the settings' declarations: python -m pdserve.config -->"
GENERATED_END = "<!-- end of generated -->"


def reference_markdown() -> str:
    """docs/config.md's reference part: every setting by section, with its type, default,
    bounds and description, then the whole tree as YAML. Generated, never edited by hand
    (tests/test_cli_ops.py checks that the committed docs are what this writes)."""
    lines = [GENERATED_BEGIN, ""]
    section = None
    for d in settings():
        head = d.path.rsplit(".", 1)[0] if "." in d.path else "(top level)"
        if head != section:
            section = head
            lines += ["", f"### `{head}`" if "." in d.path else "### top level", ""]
            lines += ["| setting | type | default | bounds | what it does |", "|---" * 5 + "|"]
        doc = d.doc.replace("|", "\\|")
        bounds = d.bounds.text().replace("|", "\\|")
        name = d.path.rsplit(".", 1)[-1]
        kind = d.type_name.replace("|", "\\|")
        lines.append(f"| `{name}` | {kind} | {d.default_text()} | {bounds} | {doc} |")
    tree = yaml.safe_dump(ServeConfig().to_dict(), sort_keys=False).rstrip()
    lines += ["", "The whole tree with its defaults, as YAML:", "", "```yaml", tree, "```", ""]
    return "\n".join([*lines, GENERATED_END])


def write_reference(path: Path) -> bool:
    """Replace the generated part of `path`; True when it changed."""
    text = path.read_text()
    begin, end = text.index(GENERATED_BEGIN), text.index(GENERATED_END) + len(GENERATED_END)
    new = text[:begin] + reference_markdown() + text[end:]
    path.write_text(new)
    return new != text


if __name__ == "__main__":  # python -m pdserve.config: regenerate docs/config.md
    docs = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    print(f"{docs}: {'updated' if write_reference(docs) else 'already current'}")
