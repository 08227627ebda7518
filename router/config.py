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
    drain_grace_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    poll_timeout_s: float = 1.0  # long-poll wait per decode poll
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
    # Bearer key for HTTP /v1/* and gRPC calls (env PDSERVE_API_KEY); never logged.
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

    def __post_init__(self) -> None:
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port={self.grpc_port} is not a port")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port={self.http_port} is not a port")
        if self.max_queue_len < 1 or self.queue_timeout_s <= 0:
            raise ValueError("max_queue_len and queue_timeout_s must be positive")
        if self.prefill_failure_policy not in get_args(PrefillFailurePolicy):
            raise ValueError("prefill_failure_policy must be 'recompute' or 'fail'")
        if self.prefill_tokens_per_s <= 0 or self.transfer_gbps <= 0:
            raise ValueError("prefill_tokens_per_s and transfer_gbps must be positive")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
