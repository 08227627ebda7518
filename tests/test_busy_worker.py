"""A busy worker is not a dead one. Stats come from the engine thread between steps; during a
long step (a prompt pass of seconds on a CPU) a worker answers with the last stats it took,
and only a step or call running past `stall_timeout_s` makes its stats raise.

Before, `stats` waited on the engine thread and the router gave it 2 s: under 8 concurrent
512-token prompts a single-thread prefill worker's steps ran longer than that, so the router
marked it down several times a minute, reported the service unready, and prefilled 9-12 of 48
requests on the decode worker as if the prefill pool were gone.

Also here, since it is about a busy pool: prefill overflow (`router.prefill_overflow_tokens`)
sends a prompt to the decode worker while the prefill worker is busy.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pdserve.checkpoint import write_checkpoint
from pdserve.client import make_request
from pdserve.config import ServeConfig
from pdserve.launch import engine_config
from pool_api.config import WorkerConfig
from pool_api.messages import Role
from prefill_workers.worker import PrefillWorker
from tests.in_process import generate, local_config, run_with_workers
from worker_common import EngineStalled


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


def _worker_config(cfg: ServeConfig, name: str, role: Role) -> WorkerConfig:
    ecfg = engine_config(cfg, Path(cfg.model.model))
    return WorkerConfig(name, ecfg, cfg.transfer, cfg.index, "tiny", role=role)


def _hold_engine(worker: PrefillWorker) -> tuple[threading.Event, threading.Event]:
    """Occupy the engine thread (as one long step would) until the first event is set; the
    second is set when the thread is free again."""
    release, started, finished = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(30)
        finished.set()

    worker.loop.call(hold)
    assert started.wait(10)
    return release, finished


def test_a_busy_engine_answers_with_its_last_stats_and_a_stuck_one_raises(
    tiny_dir: Path,
) -> None:
    cfg = local_config(tiny_dir)
    worker = PrefillWorker(_worker_config(cfg, "pdserve-prefill-0", Role.PREFILL))
    try:

        async def main() -> None:
            taken = await worker.stats()  # fresh, between steps
            release, _ = _hold_engine(worker)
            try:
                during = await asyncio.wait_for(worker.stats(), 10)
                assert not release.is_set()  # answered while the engine was still held
                assert during == taken
                worker.cfg = replace(worker.cfg, stall_timeout_s=0.3)
                await asyncio.sleep(0.4)
                with pytest.raises(EngineStalled, match=r"stall_timeout_s=0\.3"):
                    await worker.stats()
            finally:
                release.set()
            assert (await worker.stats()).name == worker.name  # fresh again once it is free

        asyncio.run(main())
    finally:
        worker.shutdown()


def test_the_router_keeps_a_busy_prefill_worker_in_rotation(tiny_dir: Path) -> None:
    """The engine held past the router's 2 s stats timeout: still healthy, still serving,
    and the refresh loop goes on for the other workers (it used to wait on the busy one's
    index pull for as long as its step ran)."""

    async def body(router: Any, prefill: PrefillWorker, _: Any) -> None:
        release, finished = _hold_engine(prefill)
        try:
            seen = []
            for _ in range(6):  # 3 s of refreshes
                await asyncio.wait_for(router.refresh(), 10)
                assert router.prefill.workers[0].healthy
                assert router.serviceable()
                seen.append(router.decode.workers[0].stats)
                await asyncio.sleep(0.5)
            # Every refresh came back while the engine was held (the index pull from the
            # busy worker finishes later), and the decode worker's load kept coming (fresh
            # stats are new objects; a loaded machine may make one refresh reuse the last).
            assert not finished.is_set()
            assert len({id(s) for s in seen}) >= len(seen) // 2
        finally:
            release.set()

    run_with_workers(local_config(tiny_dir), tiny_dir, body)


def test_overflow_prefills_on_the_decode_worker_while_the_prefill_pool_is_busy(
    tiny_dir: Path,
) -> None:
    """`router.prefill_overflow_tokens`: with the prefill worker's engine held, a first
    request waits there (disaggregated); a second with the same prompt overflows to the
    decode worker and completes before the first, with the same greedy tokens."""
    cfg = ServeConfig.load(
        None,
        {
            "model": {"model": str(tiny_dir)},
            "transfer": {"transport": "local"},
            "router": {"policy": {"prefill_overflow_tokens": 1}},
        },
    )
    ids = [4 + (j * 13) % 400 for j in range(48)]

    async def body(router: Any, prefill: PrefillWorker, _: Any) -> None:
        def one(rid: str) -> Any:
            return generate(router, make_request(ids, rid, max_tokens=12, temperature=0.0))

        release, _ = _hold_engine(prefill)
        try:
            first = asyncio.create_task(one("first"))
            while router.prefill.workers[0].outstanding_tokens == 0:
                await asyncio.sleep(0.01)
            toks2, act2 = await asyncio.wait_for(one("second"), 30)
            assert not first.done()  # the prefill worker is still held
        finally:
            release.set()
        toks1, act1 = await asyncio.wait_for(first, 30)
        assert (act1.placement, act2.placement) == ("disaggregated", "overflow")
        assert toks1 == toks2 and len(toks1) == 12
        # both prompt passes are off the books once their first tokens came back
        loads = router.prefill.workers + router.decode.workers
        assert [w.outstanding_tokens for w in loads] == [0, 0]

    run_with_workers(cfg, tiny_dir, body)
