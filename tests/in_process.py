"""Pieces several test modules stand up in the test process: a fresh local Ray cluster, and
a Router whose pools never get called."""

from __future__ import annotations

import logging
from typing import Any

from router.config import RouterConfig


def start_local_ray() -> None:
    """A fresh local Ray cluster for one test module (any cluster this process had is shut
    down first; never one found on the host). The workers ask for 0.5 logical CPUs each."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=4,
        namespace="pdserve",
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )


def router_without_workers(
    cfg: RouterConfig, num_free_blocks: int = 8, num_running: int = 0, num_requests_total: int = 0
) -> Any:
    """A Router whose pools report one healthy worker each (8 blocks, these stats) and never
    get called: enough for model info, health, auth, metrics and the TLS handshake."""
    from kv_transfer.messages import WorkerStats
    from protos.pdserve.v1 import generation_pb2 as gen
    from router.pools import Pool, WorkerHandle
    from router.service import Router
    from router.validation import ModelLimits

    def pool(role: str) -> Pool:
        p = Pool(role, [WorkerHandle(f"pdserve-{role}-0", role)])
        p.workers[0].stats = WorkerStats(
            name=f"pdserve-{role}-0",
            role=role,
            num_free_blocks=num_free_blocks,
            num_total_blocks=8,
            num_running=num_running,
            num_waiting=0,
            num_reserved=0,
            queued_prefill_tokens=0,
            num_requests_total=num_requests_total,
            num_preemptions_total=0,
        )
        return p

    info = gen.ModelInfo(served_model_name="m", max_context_length=2048, block_size=16)
    limits = ModelLimits("m", 512, 2048)
    return Router(cfg, limits, None, info, pool("prefill"), pool("decode"), "local")
