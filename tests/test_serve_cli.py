"""`pdserve serve` as a process: joining a Ray cluster with `--ray-address`, and SIGTERM.

The module starts its own Ray head with `ray start --head --block` (its own port and temp
dir, token authentication on) and runs `pdserve serve --ray-address HOST:PORT` against it.

Ray 2.60 token authentication, as this module relies on it:
- `ray start --head` turns token auth on when RAY_AUTH_MODE=token, or by itself when a token
  is already available (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN). It never
  creates the token (RAY_AUTH_MODE=token without one fails); `ray.init()` of a fresh local
  cluster does (it writes ~/.ray/auth_token).
- A driver joining by an explicit HOST:PORT (`pdserve serve --ray-address HOST:PORT`) never
  turns token auth on by itself: it needs RAY_AUTH_MODE=token *and* the token, from
  ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN. Without RAY_AUTH_MODE it fails
  with "Authentication token is missing or incorrect ... RAY_AUTH_MODE is currently
  'disabled'" (only `--ray-address auto` picks up an available token by itself).
The first server below gets the token through RAY_AUTH_TOKEN (another HOME, no token file),
the second through the token file in the head's HOME.

The head is stopped by signalling the `ray start --block` process this module started (it
shuts its own Ray processes down), never with `ray stop`, which stops every Ray on the host.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.checkpoint import write_checkpoint
from pdserve.cli import build_parser, main
from pdserve.client import make_request
from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc
from tests.serve_proc import ServeProcess

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROMPTS = ["hello world", "The quick brown fox", "Prefill and decode on two workers."]
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any], grace_s: float) -> int | None:
    """SIGTERM `proc` (a session leader this module started); SIGKILL its session after
    `grace_s`. Returns its exit code (None if it had to be killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            return None
    return proc.returncode


def greedy(prompt: str, max_tokens: int) -> gen.GenerateRequest:
    return make_request(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def collect(stream: Iterator[gen.GenerateResponse]) -> tuple[list[int], gen.GenerateComplete]:
    ids: list[int] = []
    complete = None
    for resp in stream:
        if resp.HasField("chunk"):
            ids.extend(resp.chunk.token_ids)
        else:
            complete = resp.complete
    assert complete is not None
    return ids, complete


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def references(model_dir: Path) -> dict[str, list[int]]:
    """`pdserve generate` (greedy, in process) for PROMPTS."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        argv = ["generate", "--json", "--ignore-eos", "--max-tokens", str(MAX_TOKENS)]
        assert main([*argv, "--model", str(model_dir), *PROMPTS]) == 0
    records = [json.loads(line) for line in buf.getvalue().splitlines()]
    return {r["prompt"]: r["token_ids"] for r in records}


class RayHead:
    def __init__(self, root: Path) -> None:
        self.home = root / "head-home"  # HOME of the head: its ~/.ray/auth_token
        (self.home / ".ray").mkdir(parents=True)
        self.token = secrets.token_hex(32)
        token_file = self.home / ".ray" / "auth_token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        # short: Ray puts unix sockets under it; its own, so no /tmp/ray/ray_current_cluster
        self.temp_dir = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = root / "ray-head.log"
        env = {**os.environ, "HOME": str(self.home), "RAY_AUTH_MODE": "token"}
        for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            env.pop(var, None)
        self.proc = subprocess.Popen(
            [
                str(BIN / "ray"),
                "start",
                "--head",
                "--block",
                f"--port={self.port}",
                "--num-cpus=2",
                "--node-ip-address=127.0.0.1",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--temp-dir={self.temp_dir}",
            ],
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_up(120)

    def _wait_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ray start exited:\n{self.log.read_text()}"
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return
            time.sleep(0.5)
        raise AssertionError(f"ray head not up after {timeout_s} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        stop_process(self.proc, grace_s=60)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    head = RayHead(tmp_path_factory.mktemp("ray"))
    yield head
    head.stop()


class Server:
    """`pdserve serve --grpc-port 0 --ray-address ...` as a subprocess."""

    def __init__(self, model_dir: Path, env: dict[str, str], log: Path, *flags: str) -> None:
        serve_opts = {a for action in _serve_parser()._actions for a in action.option_strings}
        no_http = ["--no-http"] if "--no-http" in serve_opts else []
        self.stderr = log
        self.proc = subprocess.Popen(
            [
                str(BIN / "pdserve"),
                "serve",
                "--model",
                str(model_dir),
                "--grpc-port",
                "0",
                *no_http,
                *flags,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(180) or self.proc.poll() is not None:
            stop_process(self.proc, grace_s=10)
            raise AssertionError(f"pdserve serve did not come up:\n{log.read_text()[-5000:]}")
        listening = next(x for x in self.lines if x.startswith("pdserve: gRPC listening on "))
        self.target = listening.rsplit(" ", 1)[1]
        self.channel = grpc.insecure_channel(self.target)
        self.stub = gen_grpc.GenerationStub(self.channel)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith("pdserve: gRPC listening on "):
                self._ready.set()
        self._ready.set()  # exited: let the waiter see it

    def stop(self, grace_s: float = 90) -> int | None:
        self.channel.close()
        rc = stop_process(self.proc, grace_s)
        self._reader.join(10)
        return rc


def _serve_parser() -> Any:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]


def serve_env(model_home: Path, home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HOME": str(home), "PDSERVE_HOME": str(model_home), **extra}
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        if var not in extra:
            env.pop(var, None)
    env["PYTHONPATH"] = str(REPO)
    return env


def descendants(pid: int) -> list[str]:
    """Command names of every live descendant of `pid` (from /proc)."""
    parent: dict[int, int] = {}
    name: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            comm_end = text.rindex(")")
            child = int(text[: text.index(" ")])
            name[child] = text[text.index("(") + 1 : comm_end]
            parent[child] = int(text[comm_end + 2 :].split()[1])
    found, frontier = [], {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier}
        found += [name[c] for c in frontier]
    return found


def no_local_ray(proc: subprocess.Popen[Any]) -> None:
    """A server that joined a cluster runs no Ray daemons of its own."""
    names = set(descendants(proc.pid))
    assert not names & {"gcs_server", "raylet"}, f"started its own Ray: {names}"


def test_serve_joins_ray_cluster(
    ray_head: RayHead,
    model_dir: Path,
    references: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"  # no token file here: RAY_AUTH_TOKEN carries it
    home.mkdir()
    env = serve_env(tmp_path, home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_head.token)
    server = Server(model_dir, env, tmp_path / "serve.log", "--ray-address", ray_head.address)
    try:
        no_local_ray(server.proc)
        health = health_pb2_grpc.HealthStub(server.channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        info = server.stub.GetServerInfo(gen.GetServerInfoRequest(), timeout=30)
        assert sorted(w.role for w in info.workers) == ["decode", "prefill"]
        for prompt in PROMPTS:
            ids, complete = collect(server.stub.Generate(greedy(prompt, MAX_TOKENS), timeout=60))
            assert ids == references[prompt], prompt
            assert complete.finish_reason == gen.FINISH_REASON_LENGTH
            assert complete.usage.completion_tokens == MAX_TOKENS
    finally:
        rc = server.stop()
    assert rc == 0, (tmp_path / "serve.log").read_text()[-5000:]
    assert ray_head.proc.poll() is None, "the cluster went down with the server"


def test_sigterm_drains_in_flight_requests(
    ray_head: RayHead, model_dir: Path, tmp_path: Path
) -> None:
    # the token from the token file: HOME is the head's, as on the head node itself
    env = serve_env(tmp_path, ray_head.home, RAY_AUTH_MODE="token")
    log = tmp_path / "serve.log"
    server = Server(model_dir, env, log, "--ray-address", ray_head.address)
    # long enough that the drain outlasts the checks below on a fast CPU (with 200 tokens,
    # an AMD EPYC once finished every stream and stopped before the first health check)
    n, max_tokens = 8, 1500
    started = threading.Barrier(n + 1, timeout=120)

    def one(i: int) -> tuple[list[int], gen.GenerateComplete]:
        request = greedy(PROMPTS[i % len(PROMPTS)], max_tokens)
        stream = server.stub.Generate(request, timeout=120)
        first = next(stream)  # in flight: the first token is out
        started.wait()
        ids, complete = collect(stream)
        return list(first.chunk.token_ids) + ids, complete

    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            started.wait()
            health = health_pb2_grpc.HealthStub(server.channel)
            check = health_pb2.HealthCheckRequest(service="")
            assert health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            server.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            # Health turns NOT_SERVING at once (load balancers stop sending new work); the
            # bound allows for a loaded machine, and is still far below the drain's.
            while health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() - t0 < 5.0, "health still SERVING 5 s after SIGTERM"
                time.sleep(0.02)
            while "pdserve: draining" not in log.read_text() and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            # draining: new requests are refused, the ones in flight go on
            with pytest.raises(grpc.RpcError) as e:
                list(server.stub.Generate(greedy("too late", 4), timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            results = [f.result() for f in futures]
        for ids, complete in results:
            assert complete.finish_reason == gen.FINISH_REASON_LENGTH
            assert len(ids) == complete.usage.completion_tokens == max_tokens
        rc = server.proc.wait(timeout=90)
    finally:
        server.stop()
    err = log.read_text()
    assert rc == 0, err[-5000:]
    assert "pdserve: draining" in err and "pdserve: stopped" in err


@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port"])
def test_a_busy_port_fails_in_one_line_before_any_worker_starts(tmp_path: Path, flag: str) -> None:
    """As `vllm serve` does: the port is checked before the engine is built, not found taken
    after a minute of start-up as a 38-line traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--http-port" if flag == "--grpc-port" else "--grpc-port"
        env = {**os.environ, "PDSERVE_HOME": str(tmp_path), "RAY_ADDRESS": ""}
        t0 = time.monotonic()
        proc = subprocess.run(
            [str(BIN / "pdserve"), "serve", "--model", "tiny", flag, str(port), other, "0"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("pdserve: error: router."), lines
    assert f"127.0.0.1:{port}" in lines[-1] and flag in lines[-1]
    assert not (tmp_path / "models").exists(), "the model was prepared before the port check"
    assert elapsed < 30, f"{elapsed:.1f} s: the check did not come first"


def test_help_and_client_do_not_import_torch() -> None:
    """`pdserve --help` and `pdserve client` took 4.5-5 s importing torch for nothing."""
    code = (
        "import sys; from pdserve.cli import build_parser; import pdserve.client; "
        "build_parser().format_help(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_worker_warning_reaches_the_serve_terminal(tmp_path: Path) -> None:
    """Workers' log records stream to `pdserve serve`'s stderr with their actor's name (they
    used to stay in Ray's session files). A float16 checkpoint served with `--dtype auto` on a
    CPU makes each worker warn that it computes in another dtype."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    ckpt = write_checkpoint("tiny", tmp_path / "fp16")
    weights = ckpt / "model.safetensors"
    save_file({k: v.to(torch.float16) for k, v in load_file(weights).items()}, weights)
    config = json.loads((ckpt / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config.pop("dtype", None)
    (ckpt / "config.json").write_text(json.dumps(config))
    (tmp_path / "home").mkdir()
    proc = ServeProcess(tmp_path / "home", model=str(ckpt))
    try:
        pattern = re.compile(
            r"\((?:WorkerActor|pdserve-\S+ \w+) pid=\d+\).*WARNING engine\.engine: dtype auto: "
            r"the float16 checkpoint computes in (?:bfloat16|float32)"
        )
        found = proc.wait_for(lambda: pattern.search(proc.log_tail(400)), timeout_s=60)
        assert found, proc.log_tail()
        line = next(ln for ln in proc.log_tail(400).splitlines() if pattern.search(ln))
        assert line.startswith("("), repr(line)  # no colour codes: stderr is not a terminal
    finally:
        proc.stop()


def test_a_drain_that_runs_out_ends_every_stream_on_both_faces(tmp_path: Path) -> None:
    """`router.drain_grace_s: 0.2` and streams that outlast it, on HTTP (SSE) and gRPC: after
    SIGTERM each stream ends with an error the client is told ("server shutting down": an
    SSE error event then `[DONE]`, or UNAVAILABLE), none is cut off with no ending; the log
    has no traceback and one request-log line per failed stream, and the process exits 0."""
    from pdserve.tools.drain import drain_overrun, log_problems

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("router:\n  drain_grace_s: 0.2\n")
    # The small preset: its streams outlast the grace *and* the servers' own stop, so that
    # without the drain's ending they would be cut off, not finish in time by luck.
    args = ("--config", str(cfg), "--enable-log-requests")
    server = ServeProcess(tmp_path, args, model="small")
    n = 6
    try:
        run = drain_overrun(server.proc, server.grpc_target, server.base_url, "small", n, 2000)
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert run.streaming_at_sigterm == n, run.ends
    assert all(e.told_shutting_down for e in run.ends), run.ends
    assert all(e.done for e in run.ends if e.face == "http"), run.ends
    assert {e.face for e in run.ends} == {"http", "grpc"}
    assert run.exit_code == 0, log[-3000:]
    assert not log_problems(log), log[-5000:]
    assert "pdserve: draining" in log and f"ending {n} requests in flight" in log
    assert log.count("failed: UNAVAILABLE") == n, log[-3000:]
