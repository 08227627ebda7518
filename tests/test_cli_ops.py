"""Operating `pdserve serve` like `vllm serve`: flags, --version, --help speed, the busy-port
exit, KV cache sizing from memory and the worker's startup summary line."""

from __future__ import annotations

import logging
import os
import resource
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from engine.config import (
    CacheConfig,
    ConfigError,
    ModelConfig,
    format_bytes,
    kv_blocks_for,
    kv_bytes_per_block,
    parse_bytes,
)
from pdserve.cli import (
    LOG_LEVEL_ENV,
    SERVE_TABLE,
    build_parser,
    configure_logging,
    main,
    serve_config,
)
from pdserve.config import ServeConfig

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

TINY = {  # 2 layers, 2 KV heads of 16 dims
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}


def parse(*argv: str) -> Any:
    return build_parser().parse_args(["serve", *argv])


# ---- KV sizing math -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("4096", 4096),
        ("4GiB", 4 << 30),
        ("4gib", 4 << 30),
        ("512MiB", 512 << 20),
        ("512 MiB", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("2Gi", 2 << 30),
        ("1GB", 10**9),
        ("3G", 3 * 10**9),
        ("64KiB", 64 << 10),
        ("10B", 10),
    ],
)
def test_parse_bytes(text: str, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "4XB", "-1GiB", "4 G i B", "1e9"])
def test_parse_bytes_refuses(text: str) -> None:
    with pytest.raises(ConfigError, match="not a byte count"):
        parse_bytes(text)


def test_blocks_from_memory() -> None:
    mcfg = ModelConfig.from_hf_dict(TINY)
    # block_size x 2 (K, V) x num_layers x num_kv_heads x head_dim x dtype bytes
    assert kv_bytes_per_block(mcfg, 16, 4) == 16 * 2 * 2 * 2 * 16 * 4 == 8192
    assert kv_bytes_per_block(mcfg, 16, 2) == 4096
    assert kv_blocks_for(1 << 20, 8192) == 128
    assert kv_blocks_for(8191, 8192) == 0
    cache = CacheConfig(kv_cache_memory=(1 << 20) + 100)
    assert cache.with_memory(cache.kv_cache_memory or 0, 8192).num_blocks == 128
    with pytest.raises(ConfigError, match="holds no block"):
        CacheConfig(kv_cache_memory=100).with_memory(100, 8192)


def test_size_kv_cache() -> None:
    import torch

    from engine.engine import size_kv_cache

    mcfg = ModelConfig.from_hf_dict(TINY)
    plain = CacheConfig()
    assert size_kv_cache(plain, mcfg, torch.float32, "cpu") is plain  # 1024 blocks as before
    sized = size_kv_cache(CacheConfig(kv_cache_memory=64 << 20), mcfg, torch.bfloat16, "cpu")
    assert sized.num_blocks == (64 << 20) // 4096
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        size_kv_cache(CacheConfig(gpu_memory_utilization=0.9), mcfg, torch.float32, "cpu")


def test_cache_config_checks_memory_settings() -> None:
    assert CacheConfig(kv_cache_memory="2GiB").kv_cache_memory == 2 << 30  # type: ignore[arg-type]
    for bad in ({"kv_cache_memory": 0}, {"gpu_memory_utilization": 1.5}):
        with pytest.raises(ConfigError):
            CacheConfig(**bad)
    with pytest.raises(ConfigError, match="set one"):
        CacheConfig(kv_cache_memory=1 << 30, gpu_memory_utilization=0.5)


def test_num_kv_blocks_overrides_memory(tmp_path: Path) -> None:
    yaml_blocks = tmp_path / "blocks.yaml"
    yaml_blocks.write_text("cache:\n  num_blocks: 77\n")
    yaml_mem = tmp_path / "mem.yaml"
    yaml_mem.write_text("cache:\n  kv_cache_memory: 512MiB\n")
    assert serve_config(parse()).cache == CacheConfig()
    cache = serve_config(parse("--kv-cache-memory", "1GiB")).cache
    assert (cache.kv_cache_memory, cache.sized_from_memory) == (1 << 30, True)
    cache = serve_config(parse("--kv-cache-memory", "1GiB", "--num-kv-blocks", "9")).cache
    assert (cache.num_blocks, cache.sized_from_memory) == (9, False)
    cache = serve_config(parse("--config", str(yaml_blocks), "--kv-cache-memory", "1G")).cache
    assert cache.kv_cache_memory == 10**9  # the flag beats the file's num_blocks
    assert serve_config(parse("--config", str(yaml_mem))).cache.kv_cache_memory == 512 << 20
    cache = serve_config(parse("--config", str(yaml_mem), "--num-kv-blocks", "5")).cache
    assert (cache.num_blocks, cache.kv_cache_memory) == (5, None)
    cache = serve_config(parse("--config", str(yaml_mem), "--gpu-memory-utilization", "0.8")).cache
    assert (cache.gpu_memory_utilization, cache.kv_cache_memory) == (0.8, None)


def test_engine_sizes_its_cache_and_reports_it(tmp_path: Path) -> None:
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.checkpoint import write_checkpoint
    from worker_common import StartupSummary

    path = write_checkpoint("tiny", tmp_path / "tiny")
    cache = CacheConfig(kv_cache_memory=4 << 20)
    engine = LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32", cache=cache))
    per_block = kv_bytes_per_block(engine.model_config, 16, 4)
    assert engine.blocks.num_blocks == (4 << 20) // per_block
    assert engine.cache.data.numel() * 4 == engine.blocks.num_blocks * per_block
    s = StartupSummary.of("pdserve-decode-0", "decode", "tiny", engine, 1.234)
    assert s.kv_bytes == engine.blocks.num_blocks * per_block
    line = s.line()
    tokens = s.num_blocks * 16
    assert f"KV cache {s.num_blocks} blocks x 16 = {tokens} tokens" in line
    assert "by kv_cache_memory" in line and "loaded in 1.23 s" in line
    assert f"float32 on cpu ({engine.runner.model.matmul_path} matmuls)" in line
    assert "M parameters" in line and "; kernels " in line  # the kernel choice, measured
    blocks_per_request = -(-engine.max_model_len // 16)
    want = f"Maximum concurrency for {engine.max_model_len} tokens per request: "
    assert want + f"{s.num_blocks / blocks_per_request:.2f}x" in line


def test_router_checks_against_the_smallest_worker_cache() -> None:
    from pdserve.launch import router_view
    from worker_common import StartupSummary

    def summary(n: int) -> StartupSummary:
        return StartupSummary(
            "w", "decode", "m", "cpu", "float32", "plain float32", 1, 0.0, 16, n, 0, 64, "x"
        )

    cfg = ServeConfig()
    assert router_view(cfg, []) is cfg
    assert router_view(cfg, [summary(300), summary(200)]).cache.num_blocks == 200
    assert summary(8).max_concurrency == 2.0  # 8 blocks / (64 tokens / 16)


@pytest.mark.parametrize(
    ("overrides", "started_ray", "threads"),
    [
        ({"colocated": True}, True, 8),  # one worker alone: every core, as vLLM takes them
        ({}, True, 4),  # 1P1D on the host: half each (on 2 cores, one each)
        ({"prefill": {"num_workers": 2}, "decode": {"num_workers": 2}}, True, 2),
        ({"prefill": {"num_workers": 9}, "decode": {"num_workers": 9}}, True, 1),
        ({"decode": {"num_cpus": 3}}, False, 3),  # a cluster it joined: the Ray CPUs
        ({}, False, 1),  # num_cpus 0.5
        ({"decode": {"num_threads": 5}}, True, 5),  # as set
    ],
)
def test_worker_threads_default_to_the_cores_they_share(
    monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any], started_ray: bool, threads: int
) -> None:
    """`num_threads: 0` (auto): a colocated `pdserve serve` used one torch thread of the
    host's cores (its prompt pass at half speed on 2 cores, 1/16 on 16)."""
    from engine.engine import EngineConfig
    from kv_transfer.config import TransferConfig
    from pdserve.launch import Deployment
    from pool_api.messages import Role

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    cfg = ServeConfig.load(None, overrides)
    d = Deployment(cfg, started_ray=started_ray)
    d._engine, d._transfer = EngineConfig(model="tiny"), TransferConfig()
    assert d._worker_cfg("pdserve-decode-0", Role.DECODE, 0).num_threads == threads


def test_format_bytes() -> None:
    assert format_bytes(100) == "100 B"
    assert format_bytes(3 << 29) == "1.50 GiB"


# ---- flags ----------------------------------------------------------------------------------


def test_flags_map_onto_the_tree() -> None:
    cfg = serve_config(parse("--port", "9001", "--host", "0.0.0.0", "--grpc-port", "0"))
    assert (cfg.router.http.port, cfg.router.host, cfg.router.grpc.port) == (9001, "0.0.0.0", 0)
    assert serve_config(parse("--http-port", "9002")).router.http.port == 9002
    router = serve_config(parse("--stats-interval-s", "0", "--enable-log-requests")).router
    assert (router.stats_log_interval_s, router.log_requests) == (0.0, True)
    router = serve_config(parse()).router
    assert (router.stats_log_interval_s, router.log_requests) == (10.0, False)
    assert serve_config(parse("--gpu-memory-utilization", "0.5")).cache.gpu_memory_utilization
    assert parse("-tp", "1").tensor_parallel_size == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "70000"],
        ["--gpu-memory-utilization", "1.5"],
        ["--gpu-memory-utilization", "0"],
        ["--kv-cache-memory", "lots"],
        ["--log-level", "loud"],
    ],
)
def test_bad_flag_values_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["-tp", "--tensor-parallel-size"])
def test_tensor_parallelism_is_refused_clearly(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", flag, "2"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pdserve: error: --tensor-parallel-size 2: ")
    assert "not supported yet" in line


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("token_stream", "poll", "router.token_stream was removed"),
        ("poll_timeout_s", 1.0, "router.poll_timeout_s was renamed router.heartbeat_s"),
    ],
)
def test_a_retired_key_is_refused_with_what_became_of_it(key: str, value: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ServeConfig.load(None, {"router": {key: value}})


def test_docs_config_md_is_generated_from_the_settings() -> None:
    """docs/config.md's reference is what the settings' declarations generate (run
    `python -m pdserve.config` after changing one)."""
    from pdserve.config import GENERATED_BEGIN, GENERATED_END, reference_markdown

    text = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    begin, end = text.index(GENERATED_BEGIN), text.index(GENERATED_END) + len(GENERATED_END)
    assert text[begin:end] == reference_markdown(), "stale: run python -m pdserve.config"


def test_serve_help_is_each_settings_own_doc_and_default() -> None:
    from pdserve.config import setting_doc, settings

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    serve = {a.dest: a for a in sub.choices["serve"]._actions}  # type: ignore[index]
    paths = {d.path for d in settings()}
    for flag in SERVE_TABLE:
        assert flag.path in paths, flag.dest
        doc = setting_doc(flag.path)
        text = " ".join((serve[flag.dest].help or "").replace("%%", "%").split())
        assert " ".join(doc.doc.split()) in text, flag.dest
        assert f"(default: {doc.default_text()})" in text, flag.dest


@pytest.mark.parametrize(
    ("section", "value", "says"),
    [
        ({"cache": {"block_size": 12}}, 12, r"cache\.block_size=12 must be a power of two"),
        ({"router": {"http": {"port": 70000}}}, 70000, r"router\.http\.port=70000 must be <="),
        ({"router": {"policy": {"max_queue_len": 0}}}, 0, r"max_queue_len=0 must be >= 1"),
        ({"transfer": {"transport": "ucx"}}, "ucx", r"transport='ucx' choose from"),
    ],
)
def test_a_value_out_of_its_declared_bounds_is_refused_naming_it(
    section: dict[str, Any], value: Any, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        ServeConfig.load(None, section)


def test_a_flag_out_of_bounds_is_refused_naming_the_flag() -> None:
    """The command line's own words: `--block-size 3` is named as such, not as the config
    path it sets; the same value from a YAML file keeps the config path."""
    args = build_parser().parse_args(["serve", "--model", "tiny", "--block-size", "3"])
    with pytest.raises(ValueError) as e:
        serve_config(args)
    assert str(e.value) == "--block-size 3: must be a power of two"
    with pytest.raises(ValueError, match=r"^config: cache\.block_size=3 must be a power of two"):
        ServeConfig.load(None, {"cache": {"block_size": 3}})


def test_every_taken_port_is_named_at_once() -> None:
    """Both router ports held by other servers: one refusal names both, each with its flag
    (a user fixing one learns of the other only on the next start otherwise)."""
    import socket

    from router.ports import check_ports

    held = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        held.append(s)
    grpc_port, http_port = (s.getsockname()[1] for s in held)
    router = ServeConfig.load(
        None,
        {"router": {"host": "127.0.0.1", "grpc": {"port": grpc_port}, "http": {"port": http_port}}},
    ).router
    try:
        with pytest.raises(ValueError) as e:
            check_ports(router, keep_http=True)
    finally:
        for s in held:
            s.close()
    lines = str(e.value).splitlines()
    assert len(lines) == 2, lines
    assert f"router.grpc.port: cannot listen on 127.0.0.1:{grpc_port}" in lines[0]
    assert "--grpc-port" in lines[0]
    assert f"router.http.port: cannot listen on 127.0.0.1:{http_port}" in lines[1]
    assert "--http-port" in lines[1]


def test_every_serve_flag_has_help_and_its_default() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("serve", "generate", "trace", "client"):  # bench, chaos: pdserve.tools
        for action in sub.choices[name]._actions:  # type: ignore[index]
            assert action.help, f"pdserve {name} {action.option_strings or action.dest}"
    serve = sub.choices["serve"]  # type: ignore[index]
    for action in serve._actions:
        if action.option_strings and action.dest not in (
            "help",
            "api_key_file",
            "redis_password_file",
        ):
            text = action.help or ""
            assert "default" in text, action.option_strings
    assert {f.name for f in fields(CacheConfig)} >= {"kv_cache_memory", "gpu_memory_utilization"}


def test_configure_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    before = root.level
    try:
        monkeypatch.setenv(LOG_LEVEL_ENV, "DEBUG")
        configure_logging(None)
        assert root.level == logging.DEBUG
        configure_logging("warning")  # the flag beats the env
        assert root.level == logging.WARNING
        monkeypatch.setenv(LOG_LEVEL_ENV, "chatty")
        with pytest.raises(ValueError, match=LOG_LEVEL_ENV):
            configure_logging(None)
    finally:
        root.setLevel(before)


# ---- the command as a process ---------------------------------------------------------------


def timed(argv: list[str], **kw: Any) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """The process, its wall time and its CPU time (user + sys: what a loaded host does not
    inflate)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, **kw)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, wall, cpu


def test_version() -> None:
    proc, _, cpu = timed([str(BIN / "pdserve"), "--version"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("pdserve ") and proc.stdout.split()[1][0].isdigit()
    assert cpu < 1.0


@pytest.mark.parametrize("argv", [["--help"], ["client", "--help"], ["serve", "--help"]])
def test_help_is_fast(argv: list[str]) -> None:
    proc, wall, cpu = timed([str(BIN / "pdserve"), *argv])
    assert proc.returncode == 0, proc.stderr
    assert cpu < 1.0, f"{cpu:.2f} s of CPU"
    assert wall < 5.0, f"{wall:.2f} s"


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_busy_port_exits_2_within_3_s(tmp_path: Path, flag: str) -> None:
    """Checked before torch is imported: ~0.5 s of CPU. The wall-clock bound is looser than
    3 s only because a loaded CI host (2 cores, other suites) stretches wall time."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--grpc-port" if flag == "--http-port" else "--http-port"
        env = {**os.environ, "PDSERVE_HOME": str(tmp_path), "RAY_ADDRESS": ""}
        argv = [str(BIN / "pdserve"), "serve", "--model", "tiny", flag, str(port), other, "0"]
        proc, wall, cpu = timed(argv, env=env)
    assert proc.returncode == 2, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert line.startswith("pdserve: error: router.") and f"127.0.0.1:{port}" in line
    assert flag in line
    assert cpu < 1.5, f"{cpu:.2f} s of CPU: torch was imported before the port check?"
    assert wall < 10.0, f"{wall:.1f} s"


def test_model_list_names_what_model_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    """`pdserve model list`, which `--model`'s help names: every named model (the default
    marked) and every preset."""
    from pdserve.checkpoint import PRESETS
    from pdserve.cli import main
    from pdserve.models import DEFAULT_MODEL, NAMED_MODELS

    assert main(["model", "list"]) == 0
    out = capsys.readouterr().out
    assert f"{DEFAULT_MODEL} (the default)" in out
    for name in [*NAMED_MODELS, *PRESETS]:
        assert any(line.startswith(f"{name}") for line in out.splitlines()), name


def test_ray_token_auth_notice_is_dropped_and_its_off_warning_kept() -> None:
    """A local start does not print Ray's notice that token auth is on (advising to turn it
    off, on every start); Ray's warning that auth is off still shows."""
    from pdserve.launch import _token_auth_on_notice

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("ray", logging.WARNING, "f", 1, msg, None, None)

    assert not _token_auth_on_notice(
        record("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=...")
    )
    assert _token_auth_on_notice(record("Token authentication is disabled for this Ray cluster."))
