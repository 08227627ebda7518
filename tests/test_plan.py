"""`pdserve profile` and `pdserve plan`: the step-time fit, the workloads, the simulator's
fidelity to pdserve's own scheduler and placement, the search, and the CLI's errors.

The simulator's tests use a chosen step-time model (not a measured one): they check that
the simulator turns a model into the times pdserve's scheduling implies, exactly, which a
measured model's noise would hide. The measured profile's accuracy is `make bench-plan`'s
job (validation lanes A-C).
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.checkpoint import write_checkpoint
from pdserve.cli import main
from pdserve.plan import plan as planner
from pdserve.plan.attainment import goodput, parse_slo
from pdserve.plan.elastic import ElasticSimulator, attainment_series, recovered_after
from pdserve.plan.profile import transports_to_time
from pdserve.plan.sim import Overheads, PoolShape, SimConfig, Simulator, Transfer, simulate
from pdserve.plan.stepmodel import TERMS, StepModel, StepShape, fit, mape
from pdserve.plan.transfer import fit_transfer
from pdserve.plan.workload import WorkloadRequest, built_in, dump, load, token_ids
from pool_api.messages import Role
from router.config import PlannerSettings
from router.planner import Decision

MODEL = StepModel((0.010, 0.002, 60e-6, 2e-9, 5e-9, 0.0004, 2e-7))
KV_BLOCK = 368_640


def _cfg(shape: PoolShape, **kw: object) -> SimConfig:
    return SimConfig(shape, MODEL, MODEL, 16, KV_BLOCK, 1024, **kw)  # type: ignore[arg-type]


# ---- the step-time model ------------------------------------------------------------------
def test_fit_recovers_a_known_model_from_its_own_times() -> None:
    shapes = [StepShape(((n, c),)) for n in (16, 64, 256, 1024, 2048) for c in (0, 512)]
    shapes += [StepShape(((n, 0),) * k) for n in (32, 128) for k in (2, 4)]
    shapes += [StepShape((), (c,) * b) for b in (1, 4, 16, 32) for c in (64, 1024)]
    shapes += [StepShape(((n, 0),), (c,) * b) for n, c, b in ((256, 128, 4), (512, 1024, 8))]
    got = fit(shapes, [MODEL.predict(s) for s in shapes])
    for term, want, have in zip(TERMS, MODEL.coef, got.coef, strict=True):
        assert have == pytest.approx(want, rel=1e-6), term
    assert mape([got.predict(s) for s in shapes], [MODEL.predict(s) for s in shapes]) < 1e-6


def test_fit_never_gives_a_negative_cost() -> None:
    """Times that fall with the batch (noise on a grid) would fit a negative per-row cost;
    the fit drops that term instead, so no shape off the grid is predicted negative."""
    shapes = [StepShape((), (128,) * b) for b in (1, 2, 4, 8)]
    model = fit(shapes, [0.030, 0.029, 0.028, 0.027])
    assert all(c >= 0 for c in model.coef)
    assert model.predict(StepShape((), (128,) * 64)) > 0


def test_transfer_fit_recovers_alpha_and_beta() -> None:
    rows = [(b, 0.003 + b / 2e9) for b in (1 << 16, 1 << 20, 1 << 24)]
    alpha, beta = fit_transfer(rows)
    assert alpha == pytest.approx(0.003, rel=1e-6) and beta == pytest.approx(2e9, rel=1e-6)


def test_profile_transports_are_named_and_checked() -> None:
    assert transports_to_time(None)[0] == "torch_dist"
    assert transports_to_time("grpc,torch_dist,grpc") == ["grpc", "torch_dist"]
    assert transports_to_time("none") == []
    for bad in ("local", "carrier-pigeon", ","):
        with pytest.raises(ValueError, match="--transports"):
            transports_to_time(bad)


def test_fit_refuses_a_non_positive_time() -> None:
    with pytest.raises(ValueError, match="positive"):
        fit([StepShape(((8, 0),))], [0.0])


# ---- workloads ---------------------------------------------------------------------------
def test_built_in_workloads_are_a_function_of_their_seed() -> None:
    for name in ("chat", "documents", "agentic"):
        a, b = built_in(name, 1.0, 60, seed=3), built_in(name, 1.0, 60, seed=3)
        assert a == b and a, name
        assert a != built_in(name, 1.0, 60, seed=4)
        assert all(x.arrival_s <= y.arrival_s for x, y in itertools.pairwise(a))


def test_prefix_groups_share_exactly_their_prefix() -> None:
    chat = built_in("chat", 2.0, 30, seed=0)
    ids = token_ids(chat, 49152)
    for r, t in zip(chat[1:], ids[1:], strict=True):
        assert t[:64] == ids[0][:64] and len(t) == r.prompt_tokens
    assert all(t[64] != ids[0][64] for t in ids[1:4])  # the tails are each their own

    agentic = built_in("agentic", 0.5, 60, seed=1)
    ids = token_ids(agentic, 49152)
    last: dict[int, list[int]] = {}
    for r, t in zip(agentic, ids, strict=True):
        assert r.prefix_group is not None
        if r.prefix_group in last:  # a later turn starts with the whole last prompt
            before = last[r.prefix_group]
            assert r.prefix_tokens == len(before) and t[: len(before)] == before
        last[r.prefix_group] = t


def test_a_trace_file_round_trips_and_its_errors_name_the_line(tmp_path: Path) -> None:
    reqs = built_in("agentic", 0.5, 30, seed=2)
    dump(reqs, tmp_path / "w.jsonl")
    assert load(tmp_path / "w.jsonl") == reqs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 4}\n{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load(bad)
    bad.write_text('{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 4, "prefix_tokens": 9}\n')
    with pytest.raises(ValueError, match="prefix_tokens"):
        load(bad)


# ---- the simulator -----------------------------------------------------------------------
def test_a_lone_colocated_request_takes_exactly_its_steps() -> None:
    """A 1000-token prompt under a 256-token budget runs as 4 chunks (the scheduler's own
    chunking), then one decode step per further token: TTFT and TPOT are those steps'
    predicted times plus the fixed costs, to the microsecond."""
    over = Overheads(router_s=0.003, hop_s=0.001, stream_s=0.002)
    cfg = _cfg(PoolShape(colocated=1, budget=256), overheads=over)
    [out] = simulate(cfg, [WorkloadRequest(1.0, 1000, 5)])
    chunks = [StepShape(((min(256, 1000 - s), s),)) for s in range(0, 1000, 256)]
    want_ttft = 0.003 + 0.001 + sum(MODEL.predict(c) for c in chunks) + 0.002
    assert out.ttft_s == pytest.approx(want_ttft, abs=1e-9)
    steps = [MODEL.predict(StepShape((), (1000 + i,))) for i in range(4)]
    assert out.tpot_s == pytest.approx(sum(steps) / 4, abs=1e-9)
    assert out.placement == "colocated" and not out.failed


def test_served_steps_scale_with_the_offered_token_rate() -> None:
    """`Overheads.step_scale` and `scale_per_token_s`: every step takes the model's time
    times (scale + per-token-rate x the output tokens per second the workload offers)."""
    reqs = [WorkloadRequest(0.0, 200, 10), WorkloadRequest(50.0, 200, 10)]  # 0.4 tokens/s
    base = simulate(_cfg(PoolShape(colocated=1)), reqs)
    over = Overheads(step_scale=1.5, scale_per_token_s=1.25)  # x (1.5 + 1.25 x 0.4) = x 2
    scaled = simulate(_cfg(PoolShape(colocated=1), overheads=over), reqs)
    for b, s in zip(base, scaled, strict=True):
        assert s.ttft_s == pytest.approx(2 * b.ttft_s, rel=1e-9)
        assert s.tpot_s == pytest.approx(2 * b.tpot_s, rel=1e-9)


def test_a_lone_disaggregated_request_waits_for_its_transfer() -> None:
    tr = Transfer(alpha_s=0.004, beta_bytes_per_s=1e8)
    cfg = _cfg(PoolShape(prefill=1, decode=1), transfer=tr)
    [out] = simulate(cfg, [WorkloadRequest(0, 512, 3)])
    prefill = MODEL.predict(StepShape(((512, 0),)))
    assert out.ttft_s == pytest.approx(prefill, abs=1e-9)
    landed = tr.seconds(32 * KV_BLOCK)  # from the pass's start: it overlaps the pass
    assert landed > prefill
    decode = [MODEL.predict(StepShape((), (512 + i,))) for i in range(2)]
    # the last token: transfer landed, then two decode steps
    assert out.tpot_s == pytest.approx((landed + sum(decode) - prefill) / 2, abs=1e-9)
    assert out.placement == "disaggregated"


@pytest.mark.parametrize(
    "shape", [PoolShape(colocated=2), PoolShape(prefill=1, decode=2)], ids=["colocated", "split"]
)
def test_every_request_ends_and_every_block_is_released(shape: PoolShape) -> None:
    reqs = built_in("agentic", 3.0, 40, seed=5)
    sim = Simulator(_cfg(shape, transfer=Transfer(0.002, 1e9)))
    outcomes = sim.run(reqs)
    assert len(outcomes) == len(reqs)
    assert all(o.first_token_s is not None and not o.failed for o in outcomes)
    for w in sim.prefill + sim.decode:
        assert not w.scheduler.has_work() and not w.live
        assert w.blocks.num_used_blocks == 0, w.name
        w.blocks.check_integrity()


def test_prefix_sharing_lowers_the_predicted_ttft() -> None:
    """The same agentic requests with their prefixes shared and with none: the shared run
    hits the cache (the engine's own block hashes), so its prompt passes are shorter."""
    reqs = built_in("agentic", 0.5, 60, seed=7)
    alone = [WorkloadRequest(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs]
    shape = PoolShape(colocated=1)
    shared = [o.ttft_s for o in simulate(_cfg(shape), reqs)]
    cold = [o.ttft_s for o in simulate(_cfg(shape), alone)]
    assert sum(shared) < 0.8 * sum(cold)  # type: ignore[arg-type]


def test_a_full_kv_pool_makes_requests_wait_not_fail() -> None:
    """A decode pool too small for the burst: reservations wait for room (first come,
    first served) and every request still ends."""
    cfg = SimConfig(PoolShape(prefill=1, decode=1), MODEL, MODEL, 16, KV_BLOCK, 80)
    burst = [WorkloadRequest(0.0, 600, 20) for _ in range(6)]
    outcomes = simulate(cfg, burst)
    assert all(not o.failed for o in outcomes)
    firsts = sorted(o.first_token_s for o in outcomes)  # type: ignore[type-var]
    assert firsts[-1] > firsts[0] + 20 * MODEL.predict(StepShape((), (600,)))


# ---- the search ----------------------------------------------------------------------------
def test_candidates_use_every_core_and_no_more() -> None:
    shapes = planner.candidates([1, 2], 2)
    assert {s.label for s in shapes} == {
        "colocated 2x1t b2048",
        "colocated 1x2t b2048",
        "1P1t:1D1t b2048",
    }
    for s in planner.candidates([1, 2, 4], 8, budgets=(512, 2048)):
        assert 7 <= s.cores <= 8


def test_goodput_is_the_first_downward_crossing() -> None:
    assert goodput([1, 2, 3], [1.0, 0.95, 0.85])["rps"] == pytest.approx(2.5)
    assert goodput([1, 2], [0.5, 0.4])["bound"] == "below_sweep"
    assert goodput([1, 2], [1.0, 0.95])["bound"] == "lower"


@pytest.mark.parametrize(
    "text, message",
    [("ttft=100", "both"), ("ttft=a,tpot=3", "number"), ("p99=1,tpot=2", "expected"),
     ("ttft=0,tpot=2", "positive")],
)  # fmt: skip
def test_a_bad_slo_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_slo(text)


def _synthetic_profile(path: Path) -> Path:
    slow = StepModel(tuple(2 * c for c in MODEL.coef))
    path.write_text(
        json.dumps(
            {
                "model_name": "synthetic", "dtype": "bfloat16", "cpu": "none", "measured": False,
                "block_size": 16, "kv_bytes_per_block": KV_BLOCK, "pool_blocks": 1024,
                "workers": {"1": {"step_model": slow.to_json()},
                            "2": {"step_model": MODEL.to_json()}},
                "transfer": {"chosen": {"alpha_s": 0.002, "beta_bytes_per_s": 1e9}},
            }
        )
    )  # fmt: skip
    return path


def test_plan_answers_with_curves_and_the_best_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = _synthetic_profile(tmp_path / "p.json")
    rc = main(["plan", "--profile", str(prof), "--workload", "documents", "--slo",
               "ttft=2000,tpot=120", "--cores", "2", "--duration", "30", "--jobs", "1",
               "--json", "--plot", str(tmp_path / "c.png")])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0, out.err
    answer = json.loads(out.out)
    best = answer["candidates"][0]
    assert answer["best"] == best["shape"]
    assert best["goodput_rps"] == max(c["goodput_rps"] or 0 for c in answer["candidates"])
    for c in answer["candidates"]:
        assert [p["rate"] for p in c["curve"]] == answer["rates"]
    assert answer["errors"]["A_step_time"] == "unvalidated"
    assert (tmp_path / "c.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [(["--slo", "ttft=1"], "--slo"), (["--slo", "ttft=1,tpot=1", "--workload", "nope"],
     "--workload"), (["--slo", "ttft=1,tpot=1", "--cores", "0"], "--cores")],
)  # fmt: skip
def test_plan_refuses_bad_input_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    prof = _synthetic_profile(tmp_path / "p.json")
    rc = main(["plan", "--profile", str(prof), *args])
    assert rc == 2 and message in capsys.readouterr().err


def test_a_validated_profile_carries_its_served_costs_per_kind(tmp_path: Path) -> None:
    """`make bench-plan` writes one set of served costs per kind of shape; a colocated
    shape simulates with the colocated set and a split with the split set."""
    prof = json.loads(_synthetic_profile(tmp_path / "p.json").read_text())
    prof["overheads"] = {"colocated": {"step_s": 0.001}, "split": {"step_s": 0.002, "row_s": 1e-4}}
    prof["validation"] = {"C": {"scores": {"colocated/chat below 85% load": {"runs": 2}}}}
    (tmp_path / "v.json").write_text(json.dumps(prof))
    p = planner.Profile.read(tmp_path / "v.json")
    assert planner.sim_config(p, PoolShape(colocated=1)).overheads.step_s == 0.001
    split = planner.sim_config(p, PoolShape(prefill=1, decode=1)).overheads
    assert (split.step_s, split.row_s) == (0.002, 1e-4)
    assert p.errors["C_end_to_end"]["scores"]
    flat = json.loads((tmp_path / "p.json").read_text()) | {"overheads": {"router_s": 0.05}}
    (tmp_path / "f.json").write_text(json.dumps(flat))
    f = planner.Profile.read(tmp_path / "f.json")
    assert f.overheads["colocated"] == f.overheads["split"] == Overheads(router_s=0.05)


# ---- the profile ---------------------------------------------------------------------------
def test_profile_fits_and_scores_on_held_out_shapes(tmp_path: Path) -> None:
    """`pdserve profile --quick` on the tiny preset: the real engine timed, the model fitted
    on one grid and scored on another, a residual plot beside the JSON."""
    model = write_checkpoint("tiny", tmp_path / "tiny")
    out = tmp_path / "profile.json"
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "profile", "--model", str(model), "--quick",
         "--threads", "1", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    prof = json.loads(out.read_text())
    w = prof["workers"]["1"]
    assert w["held_out"]["n"] >= 4 and w["fit"]["n"] >= 8
    fitted = {json.dumps([s["chunks"], s["decode"]]) for s in w["samples"]["fit"]}
    held = {json.dumps([s["chunks"], s["decode"]]) for s in w["samples"]["held_out"]}
    assert not fitted & held  # no held-out shape was fitted
    assert all(v >= 0 for v in w["step_model"].values())
    assert {s["kind"] for s in w["samples"]["fit"]} == {"prefill", "decode", "mixed"}
    assert w["held_out"]["noise_pct"] is not None
    assert prof["kv_bytes_per_block"] > 0 and prof["cpu"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "held-out MAPE" in run.stdout
    # lane B: each cross-process transport timed between two processes, fitted, scored
    transfer = prof["transfer"]
    assert set(transfer["transports"]) == {"torch_dist", "grpc"}
    assert transfer["chosen"]["transport"] == "torch_dist"  # the serving default comes first
    for t in transfer["transports"].values():
        fit_blocks = {r["blocks"] for r in t["samples"]["fit"]}
        held_blocks = {r["blocks"] for r in t["samples"]["held_out"]}
        assert held_blocks and not fit_blocks & held_blocks
        assert t["alpha_s"] >= 0 and t["beta_bytes_per_s"] > 0
        assert all(r["bytes"] == r["blocks"] * prof["kv_bytes_per_block"]
                   for r in t["samples"]["held_out"])  # fmt: skip
    assert planner.Profile.read(out).errors["B_transfer"]["n"] == len(held_blocks)
    assert "transfer grpc" in run.stdout


# ---- device profiles ------------------------------------------------------------------------
def test_a_device_profile_counts_what_pdserve_trace_counts() -> None:
    """The roofline's FLOPs and bytes of a step are `trace_counts`' own: a decode row with
    its context and a prompt pass, every op of the step summed."""
    from engine.config import ModelConfig
    from pdserve.plan.device import GEOMETRIES, RooflineModel, counts
    from pdserve.tools.trace_counts import Totals, embed_ops, head_ops, layer_ops

    cfg = ModelConfig.from_hf_dict(GEOMETRIES["llama-3-8b"])
    roof = RooflineModel(*counts(cfg), flop_rate=1.0, byte_rate=1.0, step_s=0.0)

    def step(t: int, ctx: int, decode: bool) -> Totals:
        ops = embed_ops(cfg, t, 2) + head_ops(cfg, 1, 2)
        for li in range(cfg.num_layers):
            ops += layer_ops(cfg, li, t, ctx, 2, decode=decode, workspace=False)
        return Totals.of(ops)

    dec, pre = step(1, 301, True), step(200, 200, False)
    assert roof.flops_of(StepShape((), (300,))) == dec.flops
    assert roof.bytes_of(StepShape((), (300,))) == dec.bytes
    assert roof.flops_of(StepShape(((200, 0),))) == pre.flops
    assert roof.bytes_of(StepShape(((200, 0),))) == pre.bytes


def test_plan_on_devices_is_copies_of_one_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdserve profile --device h100` writes an unmeasured profile; `pdserve plan --devices
    16` plans one 8-device node and reports two copies of it; a CPU profile or a count that
    is no multiple of 8 is refused by name."""
    prof = tmp_path / "h100.json"
    assert main(["profile", "--device", "h100", "--model", "llama-3-8b", "--out", str(prof)]) == 0
    d = json.loads(prof.read_text())
    assert d["measured"] is False and d["assumptions"] and d["pool_blocks"] > 0
    capsys.readouterr()
    rc = main(["plan", "--profile", str(prof), "--devices", "16", "--workload", "documents",
               "--slo", "ttft=1000,tpot=60", "--duration", "2", "--jobs", "1",
               "--json"])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0, out.err
    answer = json.loads(out.out)
    assert (answer["unit"], answer["replicas"], answer["cores"]) == ("devices", 2, 16)
    assert not answer["measured_profile"]
    assert {c["cores"] for c in answer["candidates"]} == {8}
    assert any(c["pool"]["colocated"] == 0 for c in answer["candidates"])
    for args, message in ((["--devices", "12"], "multiple"), (["--devices", "4"], "CPU")):
        cpu = _synthetic_profile(tmp_path / "cpu.json") if message == "CPU" else prof
        rc = main(["plan", "--profile", str(cpu), "--slo", "ttft=1,tpot=1", *args])
        assert rc == 2 and message in capsys.readouterr().err


# ---- the planner on simulated time (pdserve.plan.elastic) ----------------------------------
def _step_load(rates: tuple[float, ...], phase_s: float, prompt: int) -> list[WorkloadRequest]:
    """Poisson arrivals at each rate in turn for `phase_s`, a fixed seed."""
    rng, out, t = random.Random(0), [], 0.0
    for k, rate in enumerate(rates):
        while (t := t + rng.expovariate(rate)) < (k + 1) * phase_s:
            out.append(WorkloadRequest(t, prompt, 16))
        t = (k + 1) * phase_s
    return out


def _acting(**kw: object) -> PlannerSettings:
    return PlannerSettings(
        enabled=True, mode="act", interval_s=2, ttft_ms=1000, tpot_ms=100, window_s=10,
        patience=2, max_prefill=4, max_decode=4, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_planner_on_simulated_time_grows_the_pools_under_a_step_and_shrinks_after() -> None:
    """A 3x step of long prompts on 1P1D: the planner's own decisions, carried out on
    simulated time, add prefill workers in the step, bring attainment back before it ends
    (where the fixed pools stay at 0), and give a worker back after; nothing fails."""
    cfg = SimConfig(PoolShape(prefill=1, decode=1), MODEL, MODEL, 16, KV_BLOCK, 8192)
    load = _step_load((3, 9, 3), 30.0, 2048)
    run = ElasticSimulator(cfg, _acting(), start_s=5.0).run_elastic(load)
    assert not [o for o in run.outcomes if o.failed or o.last_token_s is None]
    adds = [t for t, line in run.decisions if line.startswith("add a prefill worker")]
    assert adds and 30 < adds[0] < 60, run.decisions
    assert any(t > 60 and line.startswith("drain") for t, line in run.decisions), run.decisions
    elastic = attainment_series(run.outcomes, 1.0, 0.1, 10)
    fixed = attainment_series(Simulator(cfg).run(load), 1.0, 0.1, 10)
    after = [a for t, a in elastic if 62 <= t <= 75]
    assert after and all(a is not None and a >= 0.9 for a in after), elastic
    assert all(a is not None and a < 0.5 for t, a in fixed if 50 <= t <= 75), fixed
    back = recovered_after(elastic, 30, 90, 10)  # seconds after the step began, to stay
    assert back is not None and back < 35, elastic
    late = recovered_after(fixed, 30, 90, 10)
    assert late is None or late > 50, fixed


def test_a_simulated_flip_drains_the_worker_then_it_joins_the_other_role() -> None:
    """A flip takes the worker out of routing at once, moves it once it holds nothing
    (its prompt passes done, its blocks freed), and it serves the other role `flip_s`
    later; the operation holds the planner until then."""
    cfg = SimConfig(PoolShape(prefill=2, decode=1), MODEL, MODEL, 16, KV_BLOCK, 1024)
    sim = ElasticSimulator(cfg, _acting(), flip_s=0.5)
    load = [WorkloadRequest(0.01 * i, 512, 4) for i in range(6)]
    sim.clock.at(0.02, lambda: sim._carry_out(Decision("flip", "test", Role.DECODE, "prefill-1")))
    seen: list[tuple[float, list[str], list[str], bool]] = []
    for t in (0.03, 1.0, 3.0):
        sim.clock.at(t, lambda: seen.append(_pools(sim)))
    outcomes = sim.run(load)
    assert not [o for o in outcomes if o.failed or o.last_token_s is None]
    at_flip = seen[0]
    assert at_flip[1] == ["prefill-0"] and at_flip[3], seen  # out of routing, op running
    final = seen[-1]
    assert final[1] == ["prefill-0"] and sorted(final[2]) == ["decode-0", "prefill-1"], seen
    assert not final[3], seen  # the operation ended when it joined


def _pools(sim: ElasticSimulator) -> tuple[float, list[str], list[str], bool]:
    routable = [w.client.name for w in sim.prefill_pool.routable()]
    return (sim.clock.now, routable, [w.client.name for w in sim.decode_pool.routable()],
            sim.op_running)  # fmt: skip
