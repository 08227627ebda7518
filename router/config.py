"""The router's own settings; pdserve.config composes them into the serve config tree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

PrefillFailurePolicy = Literal["recompute", "fail"]


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # 0 picks a free port
    # Admitted requests that have not sent their first token yet (waiting for KV room,
    # prefilling, transferring): one more is refused at once with RESOURCE_EXHAUSTED.
    max_queue_len: int = 256
    queue_timeout_s: float = (
        30.0  # how long a request may wait for KV room: then RESOURCE_EXHAUSTED
    )
    # Prompts with at most this many uncached tokens are prefilled on the decode worker
    # (conditional disaggregation). 0: always disaggregate.
    local_prefill_threshold: int = 0
    # Prefill overflow (conditional disaggregation by load, as Dynamo's prefill queue limit):
    # when every healthy prefill worker already has at least this many prompt tokens sent
    # and not returned, a prompt is prefilled on a decode worker with fewer prompt tokens of
    # its own outstanding. A busy prefill pool then borrows idle decode compute, at the cost
    # of the decode worker's running streams stalling for that prompt pass. 0: never.
    prefill_overflow_tokens: int = 0
    drain_grace_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    # A request whose decode worker pushed nothing for this long gets a heartbeat call
    # (over Ray) to that worker: a dead worker or a forgotten request ends it.
    heartbeat_s: float = 1.0
    # Address the token sink binds and gives decode workers; "auto": 127.0.0.1 for a local
    # Ray, this node's IP when joining a cluster (pdserve.launch).
    token_stream_host: str = "auto"
    stats_interval_s: float = 0.2  # how often worker load is refreshed for routing
    # A prefill worker dying under a request: "recompute" (prefill it again on another
    # prefill worker, or on its decode worker when none is healthy) or "fail" (UNAVAILABLE).
    prefill_failure_policy: PrefillFailurePolicy = "recompute"
    # The pair-routing cost model (router.pools.rank_pairs): prefill speed and KV transfer
    # bandwidth, to weigh prompt tokens a prefill worker must compute against KV bytes a
    # (prefill, decode) pair must move. Only their ratio matters; set them to measured
    # figures (`make bench`) for your hardware.
    prefill_tokens_per_s: float = 4000.0
    transfer_gbps: float = 1.0
    http_port: int = 8000  # the OpenAI-compatible HTTP server (docs/http.md); 0 picks one
    http_enabled: bool = True
    # Bearer key for HTTP /v1/* and gRPC calls; never logged, not in repr. `pdserve serve`
    # reads it from --api-key-file or env PDSERVE_API_KEY (--api-key puts it in `ps`).
    api_key: str | None = field(default=None, repr=False)
    # TLS on both ports (router/tls.py; PEM files): certificate chain and its key, together.
    tls_cert: str | None = None
    tls_key: str | None = None
    # A CA bundle: both ports then require a client certificate it signed (mTLS).
    tls_client_ca: str | None = None
    # Limits at the edge (router/validation.py: EdgeLimits), checked before tokenizing so no
    # request can hold the event loop or the engine thread. 0: derived from max_model_len
    # (prompt text: 32 characters a token; HTTP body: room for that text, JSON-escaped).
    max_prompt_chars: int = 0
    max_body_bytes: int = 0
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 256
    max_json_depth: int = 32
    # Connection hygiene (docs/config.md#connections). HTTP (router/http_guard.py): a request
    # head must arrive whole within http_header_timeout_s (counted from the connection, or
    # from its first byte after a keep-alive wait: answered 408, closed); a body that sends
    # nothing for http_body_timeout_s is dropped; an idle keep-alive connection is closed
    # after http_keepalive_timeout_s (uvicorn's timeout_keep_alive).
    http_header_timeout_s: float = 20.0
    http_body_timeout_s: float = 60.0
    http_keepalive_timeout_s: float = 5.0
    http_max_header_bytes: int = 16384  # a larger request head is refused (400): h11's limit
    http_backlog: int = 2048  # the HTTP socket's listen backlog (uvicorn's)
    # Open connections on each port (HTTP and gRPC alike): one more is refused at once
    # (HTTP: 503 and closed; gRPC: closed before its handshake). 0: no cap.
    max_connections: int = 1024
    # gRPC (router/service.py: grpc_options). Streams per connection (more wait client-side);
    # a connection that has not completed its handshake (HTTP/2 preface, TLS) in time is
    # closed; keepalive pings find dead peers; a connection with no call for
    # grpc_max_connection_idle_s is closed (GOAWAY: clients reconnect on their next call).
    grpc_max_concurrent_streams: int = 1024
    grpc_handshake_timeout_s: float = 20.0
    grpc_keepalive_time_s: float = 60.0
    grpc_keepalive_timeout_s: float = 20.0
    grpc_max_connection_idle_s: float = 300.0  # 0: never
    # Connection age (GOAWAY after this long, to rebalance behind an L4 load balancer): 0
    # never. Calls in flight then get grpc_max_connection_age_grace_s to finish (0: as long
    # as they take, so a long Generate stream is never cut; new calls use a new connection).
    grpc_max_connection_age_s: float = 0.0
    grpc_max_connection_age_grace_s: float = 0.0
    # Operator logging (`pdserve serve --stats-interval-s`, `--enable-log-requests`): how often
    # the router logs one line of throughput and load (0: never), and one line per request.
    stats_log_interval_s: float = 10.0
    log_requests: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port={self.grpc_port} is not a port")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port={self.http_port} is not a port")
        if self.max_queue_len < 1 or self.queue_timeout_s <= 0:
            raise ValueError("max_queue_len and queue_timeout_s must be positive")
        if self.prefill_failure_policy not in get_args(PrefillFailurePolicy):
            raise ValueError("prefill_failure_policy must be 'recompute' or 'fail'")
        if self.heartbeat_s <= 0:
            raise ValueError("router.heartbeat_s must be positive")
        if self.prefill_tokens_per_s <= 0 or self.transfer_gbps <= 0:
            raise ValueError("prefill_tokens_per_s and transfer_gbps must be positive")
        if self.stats_log_interval_s < 0:
            raise ValueError("router.stats_log_interval_s must be >= 0 (0: off)")
        if self.local_prefill_threshold < 0 or self.prefill_overflow_tokens < 0:
            raise ValueError("local_prefill_threshold and prefill_overflow_tokens must be >= 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        self._check_connection_limits()

    def _check_connection_limits(self) -> None:
        positive = (
            "http_header_timeout_s",
            "http_body_timeout_s",
            "http_keepalive_timeout_s",
            "http_max_header_bytes",
            "http_backlog",
            "grpc_max_concurrent_streams",
            "grpc_handshake_timeout_s",
            "grpc_keepalive_time_s",
            "grpc_keepalive_timeout_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"router.{name} must be positive")
        never_or_positive = (
            "max_connections",
            "grpc_max_connection_idle_s",
            "grpc_max_connection_age_s",
            "grpc_max_connection_age_grace_s",
        )
        for name in never_or_positive:
            if getattr(self, name) < 0:
                raise ValueError(f"router.{name} must be >= 0 (0: no limit)")
