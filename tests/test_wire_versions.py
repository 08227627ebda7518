"""Versioned wires: every wire between pdserve's processes carries `WIRE_VERSION`
(protos/pdserve/v1/__init__.py has its history), and processes of different versions, or
serving different checkpoints, never pair. Each refusal names both sides. The other version
is faked on one side: the KV ticket's layout, the token stream's hello, a worker's startup
summary."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from pathlib import Path

import pytest

from decode_workers.worker import DecodeWorker
from engine.config import ConfigError
from engine.sampling import SamplingParams
from pdserve.checkpoint import write_checkpoint
from pdserve.config import ServeConfig
from pdserve.launch import build_router, check_workers, engine_config
from pool_api import token_stream
from pool_api.config import WorkerConfig
from pool_api.messages import PrefillTask, Role, WorkerRequest
from pool_api.token_stream import SinkConnection
from prefill_workers.worker import PrefillWorker
from protos.pdserve.v1 import WIRE_VERSION
from protos.pdserve.v1 import kv_transfer_pb2 as kvpb
from router.token_sink import TokenSinkServer
from worker_common import StartupSummary


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


def config(model: Path, **cache: int) -> ServeConfig:
    return ServeConfig.load(
        None,
        {"model": {"model": str(model)}, "transfer": {"transport": "local"}, "cache": cache},
    )


def worker_config(cfg: ServeConfig, name: str, role: Role) -> WorkerConfig:
    ecfg = engine_config(cfg, Path(cfg.model.model))
    return WorkerConfig(name, ecfg, cfg.transfer, cfg.index, "tiny", role=role)


def test_a_kv_ticket_of_another_wire_version_is_refused_naming_both(tiny_dir: Path) -> None:
    cfg = config(tiny_dir)
    prefill = PrefillWorker(worker_config(cfg, "pdserve-prefill-0", Role.PREFILL))
    decode = DecodeWorker(worker_config(cfg, "pdserve-decode-0", Role.DECODE))

    async def main() -> str:
        request = WorkerRequest("r", tuple(range(4, 60)), SamplingParams(max_tokens=4))
        rr = await decode.reserve(request)
        assert rr.ticket is not None
        ticket = kvpb.TransferTicket.FromString(rr.ticket)
        ticket.layout.wire_version = WIRE_VERSION + 1  # a decode worker of the next version
        res = await prefill.prefill(PrefillTask(request, ticket.SerializeToString()))
        await decode.release_reservation("r", ticket.transfer_id)
        return res.error

    try:
        error = asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()
    want = f"wire version mismatch: receiver {WIRE_VERSION + 1}, sender {WIRE_VERSION}"
    assert want in error, error


def test_a_ticket_of_another_grammar_is_refused_before_the_prompt_pass(tiny_dir: Path) -> None:
    """Token #1 is sampled by the prefill worker under the grammar and only checked on the
    decode side: a ticket whose grammar fingerprint is not the sender's own (another
    backend, tokenizer or spec) is refused, naming both, before anything runs."""
    from engine.structured import StructuredOutput
    from kv_transfer.wire import TransferError

    cfg = config(tiny_dir)
    prefill = PrefillWorker(worker_config(cfg, "pdserve-prefill-0", Role.PREFILL))
    decode = DecodeWorker(worker_config(cfg, "pdserve-decode-0", Role.DECODE))
    params = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "[a-z]+"))

    async def main() -> None:
        request = WorkerRequest("g", tuple(range(4, 60)), params)
        rr = await decode.reserve(request)
        assert rr.ticket is not None
        ticket = kvpb.TransferTicket.FromString(rr.ticket)
        assert ticket.grammar_fingerprint  # the receiver's, for the sender to match
        mine = ticket.grammar_fingerprint
        ticket.grammar_fingerprint = "0" * 32  # a receiver with another grammar
        try:
            with pytest.raises(
                TransferError, match=f"grammar mismatch: receiver 0{{32}}, sender {mine}"
            ):
                await prefill.prefill(PrefillTask(request, ticket.SerializeToString()))
            assert prefill.num_requests_total == 0  # refused before the engine saw it
        finally:
            await decode.release_reservation("g", ticket.transfer_id)

    try:
        asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_token_stream_of_another_wire_version_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(token_stream, "WIRE_VERSION", WIRE_VERSION + 1)  # the worker's side
    lost = threading.Event()

    async def main() -> int:
        server = TokenSinkServer("127.0.0.1")
        sink = await server.start()
        conn = await asyncio.to_thread(SinkConnection, sink, "w0", lambda s, why: lost.set())
        for _ in range(100):  # the router reads the hello, refuses it and hangs up
            if server.num_rejected_total:
                break
            await asyncio.sleep(0.05)
        for _ in range(200):  # the worker then finds its connection gone at a send
            conn.send(b"\0" * 64)
            if await asyncio.to_thread(lost.wait, 0.05):
                break
        conn.close()
        await server.stop()
        return server.num_rejected_total

    with caplog.at_level(logging.WARNING, logger="router.token_sink"):
        assert asyncio.run(main()) == 1
    assert lost.is_set()
    want = f"wire version mismatch: worker {WIRE_VERSION + 1}, router {WIRE_VERSION}"
    assert any(want in r.getMessage() for r in caplog.records), caplog.text


@pytest.fixture(scope="module")
def summary(tiny_dir: Path) -> StartupSummary:
    cfg = config(tiny_dir)
    worker = DecodeWorker(worker_config(cfg, "pdserve-decode-0", Role.DECODE))
    worker.shutdown()
    return worker.summary


def test_a_router_pairs_only_workers_of_its_version_and_checkpoint(
    tmp_path: Path, tiny_dir: Path, summary: StartupSummary
) -> None:
    cfg = config(tiny_dir)
    info = build_router(cfg, tiny_dir, [], []).model_info
    check_workers([summary], info, cfg)  # the same: no complaint

    other_version = dataclasses.replace(summary, wire_version=WIRE_VERSION + 1)
    with pytest.raises(
        ConfigError, match=f"version {WIRE_VERSION + 1}, this router {WIRE_VERSION}"
    ):
        check_workers([summary, other_version], info, cfg)

    other = write_checkpoint("tiny", tmp_path / "other", seed=1)  # other weights
    other_cfg = config(other)
    other_info = build_router(other_cfg, other, [], []).model_info
    with pytest.raises(ConfigError, match=r"serves tiny .*this router other") as e:
        check_workers([summary], other_info, other_cfg)
    assert summary.model_fingerprint[:12] in str(e.value)
    assert other_info.model_fingerprint[:12] in str(e.value)

    other_backend = dataclasses.replace(summary, grammar_backend="xgrammar 0.0.1")
    with pytest.raises(ConfigError, match=r"compiles grammars with xgrammar 0\.0\.1, this router"):
        check_workers([summary, other_backend], info, cfg)

    smaller = config(tiny_dir, num_blocks=64)  # --num-kv-blocks 64 on a router attaching
    with pytest.raises(ConfigError, match=r"keeps num_blocks=\d+, .* asks for num_blocks=64"):
        check_workers([summary], build_router(smaller, tiny_dir, [], []).model_info, smaller)
