"""The flags of `pdserve profile` and `pdserve plan`, apart from their code: `pdserve --help`
builds every subcommand's flags, and must not import torch or numpy to do it."""

from __future__ import annotations

import argparse

WORKLOADS = ("chat", "documents", "agentic")
DEVICES = ("h100", "h200")
"""The accelerators `pdserve profile --device` extrapolates (`pdserve.plan.device`)."""
"""The built-in workloads (`pdserve.plan.workload`)."""


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the profile's JSON path (a .png goes beside)")
    p.add_argument(
        "--threads", default=None, help="worker sizes to profile, e.g. 1,2 (default: 1 and all)"
    )
    p.add_argument("--repeats", type=int, default=5, help="times each shape is measured")
    p.add_argument("--quick", action="store_true", help="a smaller grid (a first look, tests)")
    p.add_argument(
        "--device",
        default=None,
        choices=DEVICES,
        help="extrapolate an accelerator's profile from its published roofline instead of "
        "measuring this machine (unmeasured; --model may also be llama-3-8b)",
    )
    p.add_argument(
        "--transports",
        default=None,
        help="KV transports to time, the plan's first, e.g. grpc,torch_dist; none: skip "
        "(default: the serving config's transport first, then the others)",
    )


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a `pdserve profile` JSON")
    p.add_argument(
        "--workload", default="chat", help=f"{', '.join(WORKLOADS)}, or a trace .jsonl file"
    )
    p.add_argument("--slo", required=True, help="ttft=MS,tpot=MS (both bounds, in ms)")
    p.add_argument(
        "--cores", type=int, default=None, help="CPU cores to plan for (default: this machine's)"
    )
    p.add_argument(
        "--devices", type=int, default=None, help="devices to plan for (a device profile)"
    )
    p.add_argument("--rate", type=float, default=None, help="also report this request rate (req/s)")
    p.add_argument(
        "--duration", type=float, default=600.0, help="seconds of workload simulated per rate"
    )
    p.add_argument("--seed", type=int, default=0, help="the workload's random seed")
    p.add_argument(
        "--budgets", default=None, help="step budgets to try, e.g. 512,2048 (default: 2048)"
    )
    p.add_argument(
        "--jobs", type=int, default=None, help="processes simulating candidates (default: cores)"
    )
    p.add_argument("--plot", default=None, help="write the attainment curves to this PNG")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
