"""One writer per piece of worker state: the module docstrings of `decode_workers.worker` and
`prefill_workers.worker` table each field's owning thread, and with `PDSERVE_CHECK_OWNERS=1`
(tests/conftest.py sets it for the whole suite) each owner's methods assert they run there.
Here: the check is on, and it refuses a call from the wrong thread."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import worker_common
from decode_workers.worker import DecodeWorker
from pdserve.checkpoint import write_checkpoint
from pdserve.config import ServeConfig
from pdserve.launch import engine_config
from pool_api.config import WorkerConfig
from pool_api.messages import Role
from prefill_workers.worker import PrefillWorker


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


def worker_config(tiny_dir: Path, name: str, role: Role) -> WorkerConfig:
    cfg = ServeConfig.load(
        None, {"model": {"model": str(tiny_dir)}, "transfer": {"transport": "local"}}
    )
    return WorkerConfig(
        name, engine_config(cfg, tiny_dir), cfg.transfer, cfg.index, "tiny", role=role
    )


def test_the_owner_checks_are_on_in_the_suite() -> None:
    assert worker_common.CHECK_OWNERS


def test_engine_thread_state_is_refused_off_the_engine_thread(tiny_dir: Path) -> None:
    decode = DecodeWorker(worker_config(tiny_dir, "pdserve-decode-0", Role.DECODE))
    prefill = PrefillWorker(worker_config(tiny_dir, "pdserve-prefill-0", Role.PREFILL))
    try:
        with pytest.raises(worker_common.WrongThread, match="engine thread"):
            decode._emit([])  # the routes' owner is the engine thread
        with pytest.raises(worker_common.WrongThread, match="engine thread"):
            prefill._count_transfer(False, 1)
        # On its own thread the same call goes through.
        decode.loop.call(lambda: decode._emit([])).result(10)
        prefill.loop.call(lambda: prefill._count_transfer(False, 1)).result(10)
        assert prefill.num_transfer_bytes == 1
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_actor_loop_state_is_refused_off_the_actor_loop(tiny_dir: Path) -> None:
    decode = DecodeWorker(worker_config(tiny_dir, "pdserve-decode-0", Role.DECODE))

    async def on_the_actor_loop() -> bool:
        decode._actor_loop = asyncio.get_running_loop()  # as its first connection sets it
        return await decode.heartbeat("nobody")

    try:
        assert asyncio.run(on_the_actor_loop()) is False
        with pytest.raises(worker_common.WrongThread, match="actor loop"):
            asyncio.run(decode.heartbeat("nobody"))  # another event loop
    finally:
        decode.shutdown()
