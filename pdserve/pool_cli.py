"""`pdserve pool status|add|drain|flip`: the router's pool admin (docs/operations.md) over
its HTTP API (`/v1/admin/pool`, router/admin_http.py).

The API key comes from env PDSERVE_API_KEY or `--api-key-file`, never from a flag: a command
line is visible to every user of the host (`ps`). `drain` and `flip` wait for the router's
answer, which comes once the worker is drained (up to `--bound-s`, then what is left is
ended) and stopped or switched.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

API_KEY_ENV = "PDSERVE_API_KEY"
DEFAULT_URL = "http://127.0.0.1:8000"
_EXTRA_WAIT_S = 60.0  # beyond a drain's bound: the worker's stop or flip, the answer's trip
_ADD_WAIT_S = 600.0  # a new worker loads its model (and Ray may have to find it a node)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help="the router's HTTP API")
    p.add_argument(
        "--api-key-file",
        default=None,
        help=f"read the API key from this file (one line); env {API_KEY_ENV} otherwise",
    )
    p.add_argument("--tls-ca", default=None, help="PEM CA to trust for an https --url")
    p.add_argument("--json", action="store_true", help="print the router's answer as JSON")
    ops = p.add_subparsers(dest="pool_command", required=True)
    ops.add_parser("status", help="every worker: role, state, load")
    add = ops.add_parser("add", help="start a worker of ROLE; it joins once it is ready")
    add.add_argument("role", choices=["prefill", "decode"])
    for name, text in (
        ("drain", "stop a worker once what it holds has ended"),
        ("flip", "drain a worker, then switch its role in place (weights kept)"),
    ):
        op = ops.add_parser(name, help=text)
        op.add_argument("worker", help="its name (pdserve pool status)")
        if name == "flip":
            op.add_argument("--to", required=True, choices=["prefill", "decode"])
        op.add_argument(
            "--bound-s",
            type=float,
            default=None,
            help="how long to wait for its requests before ending them (default: the router's)",
        )


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        return Path(args.api_key_file).read_text().strip() or None
    return os.environ.get(API_KEY_ENV) or None


def call(
    url: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    api_key: str | None,
    timeout_s: float,
    tls_ca: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON answer) of one admin call."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + path, data, headers, method=method)
    context = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"error": {"message": raw.decode(errors="replace")}}


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, float]:
    """(method, path, body, timeout) of the chosen operation."""
    op = args.pool_command
    if op == "status":
        return "GET", "/v1/admin/pool", None, 30.0
    if op == "add":
        return "POST", "/v1/admin/pool/add", {"role": args.role}, _ADD_WAIT_S
    body: dict[str, Any] = {"worker": args.worker}
    if op == "flip":
        body["to"] = args.to
    if args.bound_s is not None:
        body["bound_s"] = args.bound_s
    bound = args.bound_s if args.bound_s is not None else 60.0
    return "POST", f"/v1/admin/pool/{op}", body, bound + _EXTRA_WAIT_S


def format_status(answer: dict[str, Any]) -> str:
    rows = [("WORKER", "ROLE", "STATE", "IN FLIGHT", "RUN/WAIT/RSV", "FREE BLOCKS", "PID")]
    for w in answer["workers"]:
        load = f"{w.get('num_running', '-')}/{w.get('num_waiting', '-')}/"
        load += str(w.get("num_reserved", "-"))
        blocks = f"{w.get('num_free_blocks', '-')}/{w.get('num_total_blocks', '-')}"
        rows.append(
            (w["name"], w["role"], w["state"], str(w["in_flight"]), load, blocks,
             str(w.get("pid", "-")))
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)).rstrip() for r in rows]
    head = f"{answer['mode']}: {answer['prefill']} prefill and {answer['decode']} decode workers "
    return "\n".join([head + "taking requests", *lines])


def run_pool(args: argparse.Namespace) -> int:
    method, path, body, timeout_s = _request(args)
    status, answer = call(args.url, method, path, body, _api_key(args), timeout_s, args.tls_ca)
    if status != 200:
        err = answer.get("error", {})
        field = f" ({err['param']})" if err.get("param") else ""
        message = err.get("message", answer)
        print(f"pdserve: error: HTTP {status}{field}: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    elif args.pool_command == "status":
        print(format_status(answer))
    else:
        print(", ".join(f"{k}: {v}" for k, v in answer.items()))
    return 0
