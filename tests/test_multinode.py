"""Placement on a real two-node Ray cluster: prefill on one node, decode on the other.

Two `ray start` nodes run on this machine, each with its own temp dir, ports and node IP
(the head's own address, the worker on 127.0.0.2: anything in 127/8 is loopback), and one
custom resource each: `pdserve_prefill` on the head, `pdserve_decode` on the worker. The
nodes have one CPU each, so placement is decided by the custom resources alone (the pools ask
for half a unit of theirs). `pdserve serve --ray-address HEAD:PORT` joins the cluster like a
deployment would (`transfer.host: auto`, each worker resolving its own node's IP), a greedy
request is compared token by token with the in-process engine, and Ray's state API shows
where each named actor runs.

Everything this module starts runs in sessions of its own (`start_new_session`) and is
stopped by session id: never `ray stop`, which would end every Ray cluster on the machine.
Token auth is on, with a token held only in the environment of these processes (nothing is
written to ~/.ray/auth_token).
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.client import Client

pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(420)

BIN = Path(sys.executable).parent
RAY = BIN / "ray"
PDSERVE = BIN / "pdserve"
WORKER_IP = "127.0.0.2"
PROMPT = "Prefill on one node, decode on the other."
MAX_TOKENS = 12
STARTUP_S = 240.0

# The driver script that reads Ray's state API (a separate process: this pytest process
# never joins the cluster, so other tests' `ray.init` is unaffected).
STATE_SCRIPT = """
import json, sys
from ray.util.state import list_actors, list_nodes
address = sys.argv[1]  # the GCS: the state API finds the dashboard through it
nodes = [
    {"node_id": n.node_id, "node_ip": n.node_ip, "state": n.state,
     "is_head_node": n.is_head_node, "resources_total": n.resources_total}
    for n in list_nodes(address=address, detail=True)
]
actors = [
    {"name": a.name, "state": a.state, "node_id": a.node_id, "class_name": a.class_name}
    for a in list_actors(address=address, detail=True, filters=[("ray_namespace", "=", "pdserve")])
]
print("STATE " + json.dumps({"nodes": nodes, "actors": actors}), flush=True)
"""


def free_ports(n: int) -> list[int]:
    """n distinct ports free right now (held open together, so no duplicates)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def session_pids(sid: int) -> list[int]:
    """Every live process of session `sid` (Ray's daemons and the workers they fork)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces, so split after ')'
        rest = stat[stat.rindex(")") + 2 :].split()
        if int(rest[3]) == sid and rest[0] != "Z":
            pids.append(int(entry))
    return pids


def stop_session(sid: int, grace_s: float = 5.0) -> None:
    """SIGTERM every process of the session, then SIGKILL what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = session_pids(sid)
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not session_pids(sid):
            return


@dataclass
class Node:
    sid: int
    log: Path


class TwoNodeCluster:
    """`ray start --head` plus one `ray start --address`, each in its own session."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.nodes: list[Node] = []
        self.head_ip = "127.0.0.1"
        self.gcs_port = 0

    def _ray_start(self, name: str, args: Callable[[], list[str]]) -> str:
        """`ray start` with `args()`; once more (fresh ports and temp dir) if it fails.

        Ray gives a new node 30 s to register with the GCS, which a machine that is busy
        with other work can miss: a second try is cheaper than a flaky test.
        """
        for attempt in (1, 2):
            log = self.root / f"{name}-{attempt}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    [str(RAY), "start", *args(), f"--temp-dir={self.root / f'{name}-{attempt}'}"],
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.nodes.append(Node(proc.pid, log))
            rc = proc.wait(timeout=STARTUP_S)
            text = log.read_text()
            if rc == 0:
                return text
            stop_session(proc.pid)
        raise AssertionError(f"ray start ({name}) failed twice; last:\n{text[-4000:]}")

    def start(self) -> None:
        common = ["--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats"]

        def node_ports(p: Iterator[int]) -> list[str]:
            return [
                f"--node-manager-port={next(p)}",
                f"--object-manager-port={next(p)}",
                f"--dashboard-agent-listen-port={next(p)}",
                f"--dashboard-agent-grpc-port={next(p)}",
                f"--runtime-env-agent-port={next(p)}",
                f"--metrics-export-port={next(p)}",
                "--min-worker-port=0",  # workers bind ports the OS picks
                "--max-worker-port=0",
            ]

        def head_args() -> list[str]:
            p = iter(free_ports(9))
            self.gcs_port = next(p)
            return [
                "--head",
                f"--port={self.gcs_port}",
                "--node-ip-address=127.0.0.1",
                '--resources={"pdserve_prefill": 1}',
                "--include-dashboard=true",  # the state API answers through the dashboard
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={next(p)}",
                f"--ray-client-server-port={next(p)}",
                *common,
                *node_ports(p),
            ]

        def worker_args() -> list[str]:
            return [
                f"--address={self.address}",
                f"--node-ip-address={WORKER_IP}",
                '--resources={"pdserve_decode": 1}',
                *common,
                *node_ports(iter(free_ports(6))),
            ]

        out = self._ray_start("head", head_args)
        # Ray replaces 127.0.0.1 with this machine's address for the head.
        m = re.search(r"Local node IP: (\S+)", re.sub(r"\x1b\[[0-9;]*m", "", out))
        if m:
            self.head_ip = m.group(1)
        self._ray_start("worker", worker_args)

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.gcs_port}"

    def stop(self) -> None:
        for node in reversed(self.nodes):
            stop_session(node.sid)

    def logs(self) -> str:
        return "\n".join(f"--- {n.log.name}\n{n.log.read_text()[-3000:]}" for n in self.nodes)


class Served:
    """`pdserve serve` in its own session; `target` once it prints its gRPC address."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.lines: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            [str(PDSERVE), "serve", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "w") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                self.lines.put(line)

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            m = re.match(r"pdserve: gRPC listening on (\S+):(\d+)", line)
            if m:
                return f"127.0.0.1:{m.group(2)}"
        self.reader.join(timeout=2)
        pytest.fail(f"pdserve serve did not come up (rc={self.proc.poll()}):\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text()[-5000:] if self.log.exists() else ""

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drain, stop the workers, exit 0
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        stop_session(self.proc.pid, grace_s=5.0)
        self.reader.join(timeout=5)
        return self.proc.poll()


@dataclass
class Env:
    cluster: TwoNodeCluster
    served: Served
    target: str
    env: dict[str, str]


def serve_config(root: Path) -> Path:
    cfg: dict[str, Any] = {
        "model": {"model": "tiny"},
        "transfer": {"transport": "torch_dist", "host": "auto"},
        # Each pool asks for half a unit of its node's custom resource (and a little CPU).
        "prefill": {"num_workers": 1, "num_cpus": 0.25, "resources": {"pdserve_prefill": 0.5}},
        "decode": {"num_workers": 1, "num_cpus": 0.25, "resources": {"pdserve_decode": 0.5}},
        "router": {"host": "127.0.0.1", "grpc": {"port": 0}, "http": {"port": 0}},
        "ray": {"namespace": "pdserve"},
    }
    path = root / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def deployed() -> Iterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="pdmn-", dir="/tmp"))  # short: unix socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1",
    )
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        cluster = TwoNodeCluster(root, env)
        stack.callback(cluster.stop)
        cluster.start()
        served = Served(
            ["--config", str(serve_config(root)), "--ray-address", cluster.address],
            env,
            root / "serve.log",
        )
        stack.callback(served.stop)
        try:
            target = served.wait_ready(STARTUP_S)
        except BaseException:
            print(cluster.logs())
            raise
        yield Env(cluster, served, target, env)
        rc = served.stop()
        assert rc == 0, f"pdserve serve exited {rc} on SIGTERM:\n{served.tail()}"


def ray_state(d: Env) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", STATE_SCRIPT, d.cluster.address],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    for line in out.stdout.splitlines():
        if line.startswith("STATE "):
            state: dict[str, Any] = json.loads(line[len("STATE ") :])
            return state
    raise AssertionError(f"state script failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")


def expected_tokens() -> list[int]:
    """Greedy tokens from the colocated engine in this process (the same tiny checkpoint)."""
    from engine.sampling import SamplingParams
    from pdserve.cli import load_engine

    engine = load_engine("tiny", "auto")
    assert engine.tokenizer is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (req,) = engine.generate([engine.tokenizer.encode(PROMPT)], params)
    return list(req.output_token_ids)


def test_pools_land_on_their_nodes_and_a_request_completes(deployed: Env) -> None:
    client = Client(deployed.target, timeout_s=120)
    try:
        done = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    finally:
        client.channel.close()
    assert done.finish_reason == "length"
    assert done.token_ids == expected_tokens()
    assert done.complete is not None and done.complete.usage.completion_tokens == MAX_TOKENS

    state = ray_state(deployed)
    nodes = {n["node_id"]: n for n in state["nodes"] if n["state"] == "ALIVE"}
    assert len(nodes) == 2, state["nodes"]
    actors = {a["name"]: a for a in state["actors"] if a["state"] == "ALIVE"}
    prefill, decode = actors["pdserve-prefill-0"], actors["pdserve-decode-0"]
    assert prefill["class_name"] == decode["class_name"] == "WorkerActor"
    p_node, d_node = nodes[prefill["node_id"]], nodes[decode["node_id"]]
    assert p_node["node_id"] != d_node["node_id"]
    assert "pdserve_prefill" in p_node["resources_total"] and p_node["is_head_node"]
    assert "pdserve_decode" in d_node["resources_total"] and not d_node["is_head_node"]
    # transfer.host "auto" resolved on the decode worker's own node: KV crossed "nodes"
    assert d_node["node_ip"] == WORKER_IP
    assert p_node["node_ip"] == deployed.cluster.head_ip != WORKER_IP
