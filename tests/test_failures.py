"""What ends a request, by type (`router.flow`'s docstring): a bug in router code answers
INTERNAL, logged once with its traceback and the request id, and no worker is marked down for
it; a worker whose engine died answers UNAVAILABLE and is marked down. Real in-process workers
on the tiny checkpoint behind a started Router (`tests.in_process.run_with_workers`)."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from decode_workers.worker import DecodeWorker
from engine.loop import EngineFailed
from engine.sampling import SamplingParams
from pdserve.checkpoint import write_checkpoint
from pdserve.client import make_request
from pdserve.launch import engine_config
from prefill_workers.worker import PrefillWorker
from router.active import RequestFailed
from router.flow import RequestFlow
from tests.in_process import local_config, run_with_workers

IDS = [4 + (j * 7) % 400 for j in range(40)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


async def _drive(router: Any, request_id: str) -> list[int]:
    """One request as the gRPC face drives it: a request that did not complete is released."""
    act = await router.admit(make_request(IDS, request_id, max_tokens=8, temperature=0.0))
    toks: list[int] = []
    completed = False
    try:
        async for resp in router.run(act):
            toks += resp.chunk.token_ids
            completed = resp.HasField("complete")
    finally:
        router.finish(act, completed)
    return toks


async def _until_no_block_is_used(decode: DecodeWorker, timeout_s: float = 10.0) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (used := await decode.check_integrity()) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return used


def test_a_bug_in_router_code_is_internal_and_blames_no_worker(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def injected_bug(*args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("an injected bug")

    async def body(router: Any, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        # Router code that runs once the prompt pass and its transfer are done.
        monkeypatch.setattr(RequestFlow, "_transfer_done", staticmethod(injected_bug))
        with pytest.raises(RequestFailed) as failed:
            await _drive(router, "bug-1")
        monkeypatch.undo()
        assert failed.value.code == grpc.StatusCode.INTERNAL, failed.value.details
        assert "ZeroDivisionError" in failed.value.details and "bug-1" in failed.value.details
        workers = router.prefill.workers + router.decode.workers
        assert all(w.healthy for w in workers), [w.client.name for w in workers if not w.healthy]
        assert len(await _drive(router, "after-the-bug")) == 8  # both workers still serve
        assert await _until_no_block_is_used(decode) == 0  # what it reserved was released

    with caplog.at_level(logging.ERROR, logger="router.flow"):
        run_with_workers(local_config(tiny_dir), tiny_dir, body)
    logged = [r for r in caplog.records if r.exc_info and "bug-1" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is ZeroDivisionError


def test_a_dead_engine_is_unavailable_and_its_worker_marked_down(tiny_dir: Path) -> None:
    async def body(router: Any, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        decode.loop.fatal = EngineFailed("an injected engine death")
        with pytest.raises(RequestFailed) as failed:
            await _drive(router, "dead-engine")
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE, failed.value.details
        assert not router.decode.workers[0].healthy  # its reservation raised EngineFailed
        assert router.prefill.workers[0].healthy

    run_with_workers(local_config(tiny_dir), tiny_dir, body)


def test_a_call_to_a_frozen_worker_ends_when_it_is_found_silent_or_at_its_deadline() -> None:
    """A worker whose calls never answer (frozen): a call ends as soon as the router finds
    it silent, a heartbeat after its own short deadline, anything else at `deadline_s`."""
    from engine.sampling import SamplingParams
    from pool_api.messages import WorkerRequest
    from router.clients import HEARTBEAT_DEADLINE_S, DecodeClient, WorkerUnavailable

    class Frozen:
        async def reserve(self, request: object) -> None:
            await asyncio.Event().wait()

        async def heartbeat(self, request_id: str) -> None:
            await asyncio.Event().wait()

    client = DecodeClient("pdserve-decode-0", Frozen())  # type: ignore[arg-type]
    request = WorkerRequest("r", (4, 5, 6), SamplingParams(max_tokens=2))

    async def main() -> None:
        call = asyncio.ensure_future(client.reserve(request))
        await asyncio.sleep(0.1)
        assert not call.done()
        client.went_silent()
        with pytest.raises(WorkerUnavailable, match="was found silent"):
            await asyncio.wait_for(call, 5.0)
        heartbeat_bound = re.escape(f"did not answer in {HEARTBEAT_DEADLINE_S:g} s")
        with pytest.raises(WorkerUnavailable, match=heartbeat_bound):
            await asyncio.wait_for(client.heartbeat("r"), 10.0)
        client.deadline_s = 0.2
        with pytest.raises(WorkerUnavailable, match=r"did not answer in 0\.2 s"):
            await asyncio.wait_for(client.reserve(request), 10.0)

    asyncio.run(main())


def test_a_drain_that_runs_out_ends_each_stream_with_a_status(tiny_dir: Path) -> None:
    """SIGTERM's drain with a grace shorter than a stream: the stream ends UNAVAILABLE
    "server shutting down" (the HTTP face turns it into an SSE error event), not cut off
    with no ending; the router lets go of it and counts it in `request_failure_total`."""

    async def body(router: Any, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        from router.metrics import RouterMetrics

        metrics = RouterMetrics.install(router)
        labels = {
            "model_name": router.model_info.served_model_name,
            "role": "router",
            "code": "UNAVAILABLE",
        }

        def failures() -> float:
            value = metrics.registry.get_sample_value("pdserve:request_failure_total", labels)
            return value or 0.0

        request = make_request(IDS, "long", max_tokens=1900, ignore_eos=True, temperature=0.0)
        act = await router.admit(request)
        tokens = 0
        failed: RequestFailed | None = None

        async def consume() -> None:
            nonlocal tokens, failed
            try:
                async for resp in router.run(act):
                    tokens += len(resp.chunk.token_ids)
            except RequestFailed as e:
                failed = e
            finally:
                router.finish(act, False)

        task = asyncio.ensure_future(consume())
        while tokens < 8:  # it streams
            await asyncio.sleep(0.01)
        await router.drain(0.2)
        await asyncio.wait_for(task, 5.0)
        assert failed is not None and failed.code == grpc.StatusCode.UNAVAILABLE, failed
        assert failed.details == "server shutting down" and tokens < 1900
        assert not router.active
        assert failures() == 1.0  # counted as a failure, not as a finished request

    run_with_workers(local_config(tiny_dir), tiny_dir, body)


def test_an_abort_that_overtakes_its_prompt_pass_refuses_it(tiny_dir: Path) -> None:
    """The router's abort can reach the prefill worker before the prompt-pass call it
    follows: that pass is refused at once (the request ends as aborted), not run to a
    transfer nobody waits for."""
    from kv_transfer.wire import TransferError
    from pool_api.config import WorkerConfig
    from pool_api.messages import PrefillTask, Role, WorkerRequest

    cfg = local_config(tiny_dir)
    engine_cfg = engine_config(cfg, tiny_dir)
    prefill = PrefillWorker(WorkerConfig("pdserve-prefill-0", engine_cfg, cfg.transfer,
                                         cfg.index, "tiny", role=Role.PREFILL))  # fmt: skip

    async def main() -> None:
        assert await prefill.abort("early") is False  # no job yet
        request = WorkerRequest("early", tuple(IDS), SamplingParams(max_tokens=4))
        with pytest.raises(TransferError, match="aborted by router before its prompt pass"):
            await asyncio.wait_for(prefill.prefill(PrefillTask(request, b"")), 5.0)
        assert await prefill.check_integrity() == 0

    try:
        asyncio.run(main())
    finally:
        prefill.shutdown()
