"""The router's own settings, by subsystem; pdserve.config composes them into the serve tree.

Each setting is documented once, in its `setting(...)` declaration, with its bounds beside
it (engine.settings); `--help` and docs/config.md are generated from these. Internals nobody
tunes are module constants where they are used (`router.http_guard`, `router.service`,
`router.core`, `router.validation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.settings import check_settings, setting

PrefillFailurePolicy = Literal["recompute", "fail"]


@dataclass(frozen=True)
class PolicySettings:
    """Where requests go and how long they may wait (router.flow, router.pools)."""

    max_queue_len: int = setting(
        256,
        "admitted requests without a first token yet (waiting for KV room, prefilling, "
        "transferring); one more is refused at once with RESOURCE_EXHAUSTED (HTTP 429)",
        ge=1,
    )
    queue_timeout_s: float = setting(
        30.0, "how long a request may wait for KV room before RESOURCE_EXHAUSTED", gt=0
    )
    local_prefill_threshold: int = setting(
        0,
        "prompts with at most this many uncached tokens prefill on their decode worker "
        "(conditional disaggregation)",
        ge=0,
        zero="always disaggregate",
    )
    prefill_overflow_tokens: int = setting(
        0,
        "when every healthy prefill worker has this many prompt tokens sent and not returned, "
        "a prompt prefills on a decode worker with fewer of its own (its running streams "
        "stall for that pass)",
        ge=0,
        zero="never",
    )
    prefill_failure_policy: PrefillFailurePolicy = setting(
        "recompute",
        "a prefill worker dying under a request: recompute (prefill it again on another "
        "prefill worker, or on its decode worker when none is left) or fail (UNAVAILABLE)",
        choices=("recompute", "fail"),
    )
    prefill_tokens_per_s: float = setting(
        4000.0,
        "the pair-routing cost model's prefill speed, weighed against transfer_gbps (only "
        "their ratio matters; set both to `make bench` figures for your hardware)",
        gt=0,
    )
    transfer_gbps: float = setting(
        1.0, "the pair-routing cost model's KV transfer bandwidth (GB/s)", gt=0
    )

    def __post_init__(self) -> None:
        check_settings(self, "router.policy.")


@dataclass(frozen=True)
class HttpSettings:
    """The OpenAI-compatible HTTP server (router.http, router.http_guard)."""

    enabled: bool = setting(True, "serve the HTTP API (`--no-http`: gRPC only)")
    port: int = setting(
        8000, "the OpenAI-compatible HTTP API's port", ge=0, le=65535, zero="pick a free one"
    )
    keepalive_timeout_s: float = setting(
        5.0, "an idle keep-alive connection is closed after this long (uvicorn's)", gt=0
    )
    enable_auto_tool_choice: bool = setting(
        False,
        "chat `tool_choice: auto` (the default when tools are sent): the model decides, and "
        "`tool_call_parser` reads its calls; `required` and named calls need neither",
    )
    tool_call_parser: str | None = setting(
        None,
        "how tool calls are read from the model's text under `auto` (router.openai.tools): "
        "hermes (<tool_call>{json}</tool_call>, Qwen2.5/Qwen3), llama3_json or mistral",
        choices=(None, "hermes", "llama3_json", "mistral"),
    )

    def __post_init__(self) -> None:
        check_settings(self, "router.http.")


@dataclass(frozen=True)
class GrpcSettings:
    """The gRPC server (router.service: grpc_options)."""

    port: int = setting(50051, "the gRPC API's port", ge=0, le=65535, zero="pick a free one")
    max_concurrent_streams: int = setting(
        1024, "streams per connection (more wait client-side)", ge=1
    )
    max_connection_idle_s: float = setting(
        300.0,
        "a connection with no call for this long is closed (GOAWAY: clients reconnect on "
        "their next call)",
        gt=0,
        zero="never",
    )
    max_connection_age_s: float = setting(
        0.0,
        "GOAWAY after this long, to rebalance behind an L4 load balancer; new calls then use "
        "a new connection",
        gt=0,
        zero="never",
    )
    max_connection_age_grace_s: float = setting(
        0.0,
        "calls in flight at that GOAWAY get this long to finish",
        gt=0,
        zero="as long as they take (a Generate stream is never cut)",
    )

    def __post_init__(self) -> None:
        check_settings(self, "router.grpc.")


@dataclass(frozen=True)
class LimitSettings:
    """What one client may send, checked at the edge before tokenizing (router.validation:
    EdgeLimits), so that no request can hold the event loop or the engine thread."""

    max_prompt_chars: int = setting(
        0, "prompt text per request", ge=1, zero="derived: 32 characters a context token"
    )
    max_body_bytes: int = setting(
        0, "HTTP request body", ge=1, zero="derived: room for that text, JSON-escaped"
    )
    max_stop_strings: int = setting(16, "stop strings per request", ge=0)
    max_stop_chars: int = setting(256, "characters of one stop string", ge=1)
    max_n: int = setting(
        16,
        "choices of one request (n, and best_of: the sequences decoded from its one prompt pass)",
        ge=1,
        le=256,
    )
    max_connections: int = setting(
        1024,
        "open connections on each port (HTTP and gRPC alike); one more is refused at once "
        "(HTTP: 503 and closed; gRPC: closed before its handshake)",
        ge=1,
        zero="no cap",
    )

    def __post_init__(self) -> None:
        check_settings(self, "router.limits.")


@dataclass(frozen=True)
class TlsSettings:
    """TLS on both ports (router.tls; PEM files)."""

    cert: str | None = setting(None, "certificate chain; serve gRPC and HTTP over TLS")
    key: str | None = setting(None, "the private key of tls.cert (unencrypted PEM)")
    client_ca: str | None = setting(
        None, "a CA bundle: both ports then require a client certificate it signed (mTLS)"
    )

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("router.tls.cert and router.tls.key go together: set both or neither")
        if self.client_ca is not None and self.cert is None:
            raise ValueError("router.tls.client_ca (mTLS) needs router.tls.cert and key")


PlannerMode = Literal["advisory", "act"]


@dataclass(frozen=True)
class PlannerSettings:
    """Pool sizes that follow the load (router.planner; docs/operations.md)."""

    enabled: bool = setting(
        False, "watch the load and the SLO, and decide pool changes (off: pools change by hand)"
    )
    mode: PlannerMode = setting(
        "advisory",
        "advisory: log and export each decision; act: also carry it out through the pool "
        "admin (flip before adding)",
        choices=("advisory", "act"),
    )
    interval_s: float = setting(5.0, "seconds between the planner's ticks", gt=0)
    ttft_ms: float = setting(2000.0, "the SLO's TTFT bound, per request", gt=0)
    tpot_ms: float = setting(200.0, "the SLO's TPOT bound, per request", gt=0)
    target_attainment: float = setting(
        0.9, "the share of requests within both bounds the planner keeps", gt=0, le=1
    )
    window_s: float = setting(
        60.0, "the rolling window of finished requests the signals are read from", gt=0
    )
    patience: int = setting(
        2,
        "ticks in a row a change's condition must hold before it is made, and ticks held "
        "after one (hysteresis)",
        ge=1,
    )
    min_prefill: int = setting(1, "the planner keeps at least this many prefill workers", ge=0)
    max_prefill: int = setting(4, "and at most this many", ge=0)
    min_decode: int = setting(1, "the planner keeps at least this many decode workers", ge=1)
    max_decode: int = setting(4, "and at most this many", ge=1)
    profile: str = setting(
        "",
        "a `pdserve profile` JSON: the planner then also keeps each role at least at the "
        "workers its step model says the window's load needs (the forecast floor); empty: "
        "the reactive loop alone",
    )
    profile_threads: int = setting(
        0, "the worker size (threads) of that profile to read (0: its smallest)", ge=0
    )

    def __post_init__(self) -> None:
        check_settings(self, "planner.")
        if self.min_prefill > self.max_prefill or self.min_decode > self.max_decode:
            raise ValueError("planner: each role's min must not exceed its max")


@dataclass(frozen=True)
class RouterConfig:
    host: str = setting("127.0.0.1", "bind address of both ports")
    api_key: str | None = setting(
        None,
        "bearer key for HTTP /v1/* and gRPC calls; `pdserve serve` reads it from "
        "--api-key-file or env PDSERVE_API_KEY (--api-key puts it in `ps`); never logged",
        secret=True,
    )
    drain_grace_s: float = setting(
        30.0, "on SIGTERM, in-flight requests get this long to finish", ge=0
    )
    heartbeat_s: float = setting(
        1.0,
        "a request whose decode worker pushed nothing for this long gets a heartbeat call "
        "to it: a dead worker or a forgotten request ends it",
        gt=0,
    )
    worker_call_timeout_s: float = setting(
        60.0,
        "a call to a worker that neither answers nor finds that worker silent (its stats "
        "timed out) within this long fails, and its request ends UNAVAILABLE",
        gt=0,
    )
    token_stream_host: str = setting(
        "auto",
        "address the token sink binds and gives decode workers; auto: 127.0.0.1 with a "
        "local Ray, this node's IP when joining a cluster",
    )
    stats_log_interval_s: float = setting(
        10.0, "one log line of throughput and load every this many seconds", ge=0, zero="off"
    )
    log_requests: bool = setting(
        False, "one log line per request (id, tokens, finish reason, latency; never its text)"
    )
    policy: PolicySettings = field(default_factory=PolicySettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    tls: TlsSettings = field(default_factory=TlsSettings)

    def __post_init__(self) -> None:
        check_settings(self, "router.")
