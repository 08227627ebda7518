"""Secrets of `pdserve serve` stay off command lines, reprs and logs.

Ray records a driver's command line (`ray job list`, the dashboard's /api/jobs: Ray reads it
from the process, `psutil.Process().cmdline()`), and `ps` shows it to every user of the
host. So the API key and the Redis password can come from files (`--api-key-file`,
`--redis-password-file`) or env (`PDSERVE_API_KEY`, `PDSERVE_REDIS_URL`,
`PDSERVE_REDIS_PASSWORD`); on the command line they still work, with a warning. The config
reaches the workers as Ray actor arguments (`WorkerConfig`), whose repr hides them, and
nothing printed at startup holds them. All of it is checked here without starting Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from engine.engine import EngineConfig
from pdserve import serve as serve_mod
from pdserve.cli import build_parser, main, serve_config
from pdserve.config import ServeConfig
from pool_api.config import WorkerConfig, redact_url, url_password, with_password
from pool_api.messages import Role

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-api-key-never-printed-1234"
PASSWORD = "redis-pw-never-printed"
KV_SECRET = "kv-secret-never-printed-0123"
SECRETS = (API_KEY, PASSWORD, KV_SECRET)
SECRET_ENV = ("PDSERVE_API_KEY", "PDSERVE_REDIS_URL", "PDSERVE_REDIS_PASSWORD")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SECRET_ENV:
        monkeypatch.delenv(name, raising=False)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def secret_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def no_secret_in(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{leaked} in {text!r}"


# ---- the API key ----------------------------------------------------------------------------
def test_api_key_from_a_file_or_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = secret_file(tmp_path, "api-key", f"{API_KEY}\n")  # `echo KEY > file`
    assert serve_config(parse("--api-key-file", key_file)).router.api_key == API_KEY
    assert serve_config(parse()).router.api_key is None
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert serve_config(parse()).router.api_key == "from-env"
    # flag > file > env > YAML
    assert serve_config(parse("--api-key-file", key_file)).router.api_key == API_KEY
    assert serve_config(parse("--api-key", "on-argv")).router.api_key == "on-argv"
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"router": {"api_key": "from-yaml"}}))
    assert serve_config(parse("--config", str(config))).router.api_key == "from-env"
    monkeypatch.delenv("PDSERVE_API_KEY")
    assert serve_config(parse("--config", str(config))).router.api_key == "from-yaml"


def test_api_key_and_api_key_file_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse("--api-key", API_KEY, "--api-key-file", secret_file(tmp_path, "k", API_KEY))


@pytest.mark.parametrize("text", ["", " \n", "two\nlines\n"])
def test_a_bad_secret_file_is_refused_without_its_contents(tmp_path: Path, text: str) -> None:
    path = secret_file(tmp_path, "k", text)
    with pytest.raises(ValueError, match=r"--api-key-file .*: must hold the secret on one line"):
        serve_config(parse("--api-key-file", path))
    with pytest.raises(ValueError, match=r"--redis-password-file .*: No such file"):
        serve_config(
            parse("--redis-url", "redis://h", "--redis-password-file", str(tmp_path / "none"))
        )


def test_api_key_on_the_command_line_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.cli"):
        assert serve_config(parse("--api-key", API_KEY)).router.api_key == API_KEY
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message and record.levelno == logging.WARNING
    for words in (
        "--api-key",
        "process table",
        "ray job list",
        "--api-key-file",
        "PDSERVE_API_KEY",
    ):
        assert words in message
    no_secret_in(message)


def test_no_warning_for_files_and_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDSERVE_REDIS_URL", f"redis://:{PASSWORD}@h:6379/0")  # env: fine
    with caplog.at_level(logging.WARNING, logger="pdserve.cli"):
        serve_config(parse("--api-key-file", secret_file(tmp_path, "k", API_KEY)))
        serve_config(parse("--redis-url", "redis://user@h:6379/0"))  # no password in it
    assert caplog.records == []


# ---- the Redis URL and its password ---------------------------------------------------------
def test_redis_password_in_the_url_on_the_command_line_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://user:{PASSWORD}@h:6379/0"
    with caplog.at_level(logging.WARNING, logger="pdserve.cli"):
        assert serve_config(parse("--redis-url", url)).index.redis_url == url
    (record,) = caplog.records
    message = record.getMessage()
    assert "--redis-url" in message and "PDSERVE_REDIS_PASSWORD" in message
    assert "--redis-password-file" in message and "PDSERVE_REDIS_URL" in message
    no_secret_in(message)


def kwargs_of(url: str | None) -> dict[str, Any]:
    assert url is not None
    return dict(redis.ConnectionPool.from_url(url).connection_kwargs)


@pytest.mark.parametrize("password", [PASSWORD, "p@ss:w/rd %1"])
def test_redis_password_from_env_or_file_joins_the_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, password: str
) -> None:
    monkeypatch.setenv("PDSERVE_REDIS_URL", "rediss://pdserve@r.example:6380/2")
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", password)
    kw = kwargs_of(serve_config(parse()).index.redis_url)
    assert (kw["username"], kw["password"], kw["host"], kw["db"]) == (
        "pdserve",
        password,
        "r.example",
        2,
    )
    # --redis-url beats PDSERVE_REDIS_URL; --redis-password-file beats PDSERVE_REDIS_PASSWORD
    pw_file = secret_file(tmp_path, "pw", password + "-file\n")
    cfg = serve_config(parse("--redis-url", "redis://h:6379/1", "--redis-password-file", pw_file))
    kw = kwargs_of(cfg.index.redis_url)
    assert (kw.get("username"), kw["password"], kw["host"], kw["db"]) == (
        None,
        password + "-file",
        "h",
        1,
    )
    # ... and a URL from the YAML file takes it too
    monkeypatch.delenv("PDSERVE_REDIS_URL")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"index": {"redis_url": "redis://yaml-host:6379/0"}}))
    kw = kwargs_of(serve_config(parse("--config", str(config))).index.redis_url)
    assert (kw["host"], kw["password"]) == ("yaml-host", password)


def test_redis_password_without_a_url_or_twice_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", PASSWORD)
    with pytest.raises(ValueError, match="needs a Redis URL") as e:
        serve_config(parse())
    no_secret_in(str(e.value))
    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://:other@h:6379/0")
    with pytest.raises(ValueError, match="given twice") as e:
        serve_config(parse())
    no_secret_in(str(e.value))


def test_url_helpers() -> None:
    assert redact_url(f"redis://u:{PASSWORD}@h:6379/0") == "redis://u:***@h:6379/0"
    assert redact_url(f"rediss://:{PASSWORD}@h/2") == "rediss://:***@h/2"
    assert redact_url("redis://u@h:6379/0") == "redis://u@h:6379/0"
    assert redact_url("redis://[::1") == "***"  # unparsable: none of it
    assert url_password("redis://:p%40ss@h") == "p@ss"
    assert url_password("redis://u@h") is None and url_password("redis://u:@h") is None
    assert with_password("redis://u:@h/0", "x y") == "redis://u:x%20y@h/0"


# ---- reprs, config dumps, startup lines -----------------------------------------------------
def secret_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ServeConfig:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"transfer": {"shared_secret": KV_SECRET}}))
    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://pdserve@redis.internal:6379/0")
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", PASSWORD)
    args = parse(
        "--config",
        str(config),
        "--api-key-file",
        secret_file(tmp_path, "k", API_KEY),
        "--grpc-port",
        "0",
        "--http-port",
        "0",
    )
    cfg = serve_config(args)
    assert cfg.router.api_key == API_KEY and cfg.transfer.shared_secret == KV_SECRET
    assert url_password(cfg.index.redis_url or "") == PASSWORD
    return cfg


def worker_config(cfg: ServeConfig) -> WorkerConfig:
    """What pdserve.launch hands each Ray actor (its creation arguments)."""
    engine = EngineConfig(model="/m", cache=cfg.cache, scheduler=cfg.scheduler)
    return WorkerConfig(
        name="pdserve-decode-0",
        engine=engine,
        transfer=cfg.transfer,
        index=cfg.index,
        role=Role.DECODE,
    )


def test_reprs_of_the_config_tree_hold_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = secret_config(tmp_path, monkeypatch)
    wcfg = worker_config(cfg)
    assert wcfg.index.redis_url == cfg.index.redis_url  # the workers do get it ...
    for obj in (cfg, cfg.router, cfg.index, cfg.transfer, wcfg, wcfg.index, wcfg.transfer):
        no_secret_in(repr(obj))  # ... but no repr (Ray's errors, logs, debuggers) shows it
        no_secret_in(str(obj))
        no_secret_in(f"{obj}")


def test_to_dict_redacts_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = secret_config(tmp_path, monkeypatch)
    data = cfg.to_dict()
    no_secret_in(json.dumps(data))
    no_secret_in(yaml.safe_dump(data))
    assert data["router"]["api_key"] == data["transfer"]["shared_secret"] == "***"
    assert data["index"]["redis_url"] == "redis://pdserve:***@redis.internal:6379/0"
    assert data["router"]["grpc"]["port"] == 0  # the rest is as it was
    full = cfg.to_dict(reveal_secrets=True)
    assert full["router"]["api_key"] == API_KEY
    assert full["transfer"]["shared_secret"] == KV_SECRET
    assert full["index"]["redis_url"] == cfg.index.redis_url
    assert ServeConfig.load(None, full) == cfg  # the revealed tree round-trips
    assert cfg.to_dict() != full and ServeConfig().to_dict() == ServeConfig().to_dict(
        reveal_secrets=True
    )


def test_startup_lines_hold_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdserve serve` up to starting the workers (stubbed): what it prints."""
    cfg = secret_config(tmp_path, monkeypatch)

    class Stop(Exception):
        pass

    class NoDeployment:
        def __init__(self, cfg: ServeConfig) -> None:
            pass

        def start(self) -> None:
            raise Stop

    monkeypatch.setattr(serve_mod, "Deployment", NoDeployment)
    with pytest.raises(Stop):
        serve_mod.run(cfg)
    out = capsys.readouterr()
    no_secret_in(out.out + out.err)
    lines = out.err.splitlines()
    assert "pdserve: API key required on HTTP /v1/* and gRPC" in lines
    assert "pdserve: prefix index on Redis at redis://pdserve:***@redis.internal:6379/0" in lines


def test_an_unreadable_key_file_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pdserve: error: --api-key-file ") and "No such file" in line


# ---- what Ray records -----------------------------------------------------------------------
# A `pdserve serve` process stopped where it would start Ray (`pdserve.serve.run`): it prints
# what Ray's job table would record as its entrypoint (Ray's own function, over this very
# process's command line) and the config it got.
_DRIVER = """
import json, sys, types
import ray._private.utils
fake = types.ModuleType("pdserve.serve")
def run(cfg):
    print(json.dumps({"entrypoint": ray._private.utils.get_entrypoint_name(),
                      "api_key": cfg.router.api_key, "redis_url": cfg.index.redis_url,
                      "repr": repr(cfg)}))
    return 0
fake.run = run
sys.modules["pdserve.serve"] = fake
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_recommended_invocation_puts_no_secret_where_ray_records_it(
    tmp_path: Path,
) -> None:
    key_file = secret_file(tmp_path, "api-key", API_KEY)
    pw_file = secret_file(tmp_path, "redis-pw", PASSWORD)
    argv = ["serve", "--api-key-file", key_file, "--redis-url", "redis://pdserve@h:6379/0"]
    argv += ["--redis-password-file", pw_file]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _DRIVER, *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["api_key"] == API_KEY  # the server has both secrets ...
    assert url_password(got["redis_url"]) == PASSWORD
    assert key_file in got["entrypoint"] and "serve" in got["entrypoint"]
    no_secret_in(got["entrypoint"])  # ... and Ray's job table neither
    no_secret_in(got["repr"])
    no_secret_in(out.stderr)
    assert "warning" not in out.stderr


def test_the_kv_secret_is_generated_on_our_own_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_transfer.auth import SECRET_ENV
    from kv_transfer.config import TransferConfig
    from pdserve.launch import kv_secret_by_default

    monkeypatch.delenv(SECRET_ENV, raising=False)
    a = kv_secret_by_default(TransferConfig(), own_cluster=True).shared_secret
    b = kv_secret_by_default(TransferConfig(), own_cluster=True).shared_secret
    assert a and b and a != b and len(a) >= 32
    assert a not in repr(kv_secret_by_default(TransferConfig(), own_cluster=True))
    # on a cluster someone else runs, the workers' nodes hold it: nothing is made up here
    assert kv_secret_by_default(TransferConfig(), own_cluster=False).shared_secret is None
    # a configured secret (or env) is kept; the in-process transport needs none
    assert (
        kv_secret_by_default(TransferConfig(shared_secret="s" * 20), True).shared_secret == "s" * 20
    )
    monkeypatch.setenv(SECRET_ENV, "e" * 20)
    assert kv_secret_by_default(TransferConfig(), True).shared_secret is None  # env reaches workers
    assert kv_secret_by_default(TransferConfig(transport="local"), True).shared_secret is None
