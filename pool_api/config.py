"""Configuration a pool worker is built from: what pdserve.launch hands each Ray actor.

`TransferConfig` is kv_transfer's own; `IndexConfig` and `WorkerConfig` live here because the
launcher, the router (in-memory index) and both worker packages read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from engine.settings import check_settings, setting
from kv_transfer.config import TransferConfig

if TYPE_CHECKING:  # torch loads only where an engine is built (`pdserve serve --help` is fast)
    from engine.engine import EngineConfig
    from pool_api.messages import Role

REDACTED = "***"


def url_password(url: str) -> str | None:
    """The password inside `url` (percent-decoded), or None when it has none."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password else None


def redact_url(url: str) -> str:
    """`url` with its password replaced by ***: what may be printed or logged."""
    try:
        parts = urlsplit(url)
        if not parts.password:
            return url
    except ValueError:  # unparsable (a bad port, a stray bracket): print none of it
        return REDACTED
    user, _, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{name}:{REDACTED}@{host}"))


def with_password(url: str, password: str) -> str:
    """`url` with `password` (percent-encoded) in it, keeping an ACL user name if present.

    Refuses a URL that already holds a password: which one was meant is unclear.
    """
    parts = urlsplit(url)
    if parts.password:
        raise ValueError("the Redis password is given twice: in the URL and on its own")
    user, _, host = parts.netloc.rpartition("@")
    name = quote(unquote(user.partition(":")[0]), safe="")
    return urlunsplit(parts._replace(netloc=f"{name}:{quote(password, safe='')}@{host}"))


@dataclass(frozen=True)
class IndexConfig:
    """The prefix index: Redis when `redis_url` is set, else in-process (in the router)."""

    redis_url: str | None = setting(
        None,
        "the prefix index on Redis (redis://[user@]host:port/db, rediss://); unset: in the "
        "router's memory. Its password: env PDSERVE_REDIS_PASSWORD or --redis-password-file",
        secret=True,
    )
    ttl_s: float = setting(120.0, "block entries expire unless a holder refreshes them", gt=0)
    timeout_s: float = setting(0.1, "per Redis call; a slower answer counts as a miss", gt=0)
    refresh_interval_s: float = setting(
        10.0, "how often workers re-assert every block they hold", gt=0
    )

    def __post_init__(self) -> None:
        check_settings(self, "index.")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one pool worker needs; built by pdserve.launch from the serve config."""

    name: str  # also its Ray actor name, e.g. pdserve-prefill-0
    engine: EngineConfig
    transfer: TransferConfig = field(default_factory=TransferConfig)
    index: IndexConfig = IndexConfig()
    model_name: str = "model"  # namespaces the prefix index
    num_threads: int = 1  # torch intra-op threads (Ray starts actors with 1)
    cpus: tuple[int, ...] = ()  # the cores its process is pinned to (() not pinned)
    # A decode stream whose router neither sent a heartbeat nor took a frame this long (it
    # forgot the stream) is aborted and dropped; the router sends a heartbeat for every
    # stream it waited `router.heartbeat_s` on.
    stream_idle_timeout_s: float = 30.0
    # An engine on one step or call this long is stuck: its stats raise, the router marks
    # the worker down. A long prompt pass is not: stats answer from the last ones taken.
    stall_timeout_s: float = 120.0
    log_level: str = "warning"  # the worker process's Python logging (the driver's, by launch)
    role: Role | None = None  # None: the worker class's own role
