# pdserve: set-up, tests, demo and benchmarks. Every target creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PACKAGES := engine kv_transfer pool_api worker_common prefill_workers decode_workers router pdserve
export PDSERVE_HOME ?= $(CURDIR)/.venv/pdserve-home
TEST_WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: install demo test lint typecheck bench bench-determinism bench-pool bench-engine bench-transfer bench-prefix bench-serving bench-structured bench-choices bench-pinning bench-kernels bench-peers bench-peers-api bench-plan redis chaos

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 first, with pip: the CPU wheel from local disk, never a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0 uv
	# The rest with uv (the same versions as pip's resolver, in 12 s where pip took 83 s);
	# the torch installed above satisfies the pin and stays.
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[models,dev]'
	# pdserve's C++ kernels, built for this CPU and torch (else the first worker builds them)
	$(BIN)/python -m engine.native
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m pdserve.demo

# redis-server is needed by the integration tests; install it when missing.
redis:
	@command -v redis-server >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

# pytest's exit code 5 (no tests collected) is a failure like any other non-zero code.
test: $(STAMP) redis
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# mypy runs beside the suite (a minute of one core, taken from the suite's waits); its
	# report prints after the suite's, and either failing fails the target.
	# Two workers (pytest-xdist), each taking whole groups: a module, or the modules that
	# share one server (their servers start once), the longest first (tests/conftest.py).
	# PYTHONFAULTHANDLER: a crash, even at exit, prints its stack, in the workers too.
	# --durations: where the suite's time goes, on every run.
	@mkdir -p build; \
	{ $(MAKE) --no-print-directory typecheck > build/mypy.log 2>&1; echo $$? > build/mypy.rc; } & \
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests $(PYTEST_ARGS); \
	rc=$$?; wait; cat build/mypy.log; \
	test $$rc -eq 0 && test "$$(cat build/mypy.rc)" = 0

typecheck: $(STAMP)
	$(BIN)/mypy $(PACKAGES)
	$(BIN)/mypy benchmarks  # apart: benchmarks/engine.py would clash with the engine package

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory typecheck

# MODEL=... (and DTYPE=...) run a benchmark on another model, e.g.
#   make bench-engine MODEL=smollm2-135m-instruct DTYPE=float32
BENCH_MODEL_ARGS := $(if $(MODEL),--model $(MODEL)) $(if $(DTYPE),--dtype $(DTYPE))

bench-engine: $(STAMP)
	$(BIN)/python benchmarks/engine.py $(BENCH_MODEL_ARGS)

bench-prefix: $(STAMP) redis
	$(BIN)/python benchmarks/prefix_cache.py $(BENCH_MODEL_ARGS)

bench-transfer: $(STAMP)
	$(BIN)/python benchmarks/kv_transfer.py

bench-serving: $(STAMP)
	$(BIN)/python benchmarks/serving.py $(BENCH_MODEL_ARGS)

bench-structured: $(STAMP)
	$(BIN)/python benchmarks/structured.py

# n > 1: n choices from one prompt pass against n = 1, TTFT and decode tokens/s, both modes
# (benchmarks/choices.py).
bench-choices: $(STAMP)
	$(BIN)/python benchmarks/choices.py

# Disaggregated on one host, each worker pinned to its core or not, A/B (benchmarks/pinning.py).
bench-pinning: $(STAMP)
	$(BIN)/python benchmarks/pinning.py

# The kernel selection on this CPU, checked (exit 1 when an automatic choice is > 10% slower
# than the fastest candidate), and the real model's prompt pass and decode step A/B across
# kernel sets (benchmarks/kernel_options.py).
bench-kernels: $(STAMP)
	$(BIN)/python benchmarks/kernel_options.py

# Greedy tokens of 64 prompts cold, cached, batched, chunked, disaggregated and as choice 0
# of n = 4: exit 1 unless all are identical (pdserve/tools/determinism.py).
# Pool operations on the default model: a cold worker start against flips of a warm worker
# (idle, both ways), then a flip and a drain under load that must lose nothing
# (benchmarks/pool_ops.py, docs/operations.md); then the router's placement and planner
# tick at 20-200 workers (benchmarks/pool_scale.py), and the real router and planner
# against 20-200 mock workers on Ray (benchmarks/pool_mock.py), and the planner acting on
# mock workers under a 3x load step (benchmarks/planner_step_mock.py), reactive alone and
# with the forecast floor, then advising only (with the floor); each run beside the
# simulator's prediction of the planner acting on the same arrivals and on 20 other draws
# of the load (pdserve.plan.elastic); ~16 min.
bench-pool: $(STAMP)
	$(BIN)/python benchmarks/pool_ops.py
	$(BIN)/python benchmarks/pool_scale.py
	$(BIN)/python benchmarks/pool_mock.py
	$(BIN)/python benchmarks/planner_step_mock.py --predict
	$(BIN)/python benchmarks/planner_step_mock.py --predict --floor --out benchmarks/results/planner-step-mock-floor.json
	$(BIN)/python benchmarks/planner_step_mock.py --predict --floor --mode advisory --out benchmarks/results/planner-step-mock-advisory.json

bench-determinism: $(STAMP)
	$(BIN)/python -m pdserve.tools.determinism

# pdserve plan against real runs: the profile's held-out step shapes (lane A) and transfer
# sizes (lane B), and real colocated and 1P1D runs of three workloads at six rates against
# the simulator's prediction, served costs measured on one workload (lane C);
# benchmarks/plan_validation.py, ~70 min. Then where disaggregation wins on H100/H200,
# predicted from their rooflines (benchmarks/plan_devices.py on a 4-device unit, ~3 min; its
# defaults, a 3x3 grid on an 8-device node, take over 4 min a cell on 2 cores).
bench-plan: $(STAMP) redis
	$(BIN)/python benchmarks/plan_validation.py $(BENCH_PLAN_ARGS)
	$(BIN)/python benchmarks/plan_devices.py --unit 4 --prompts 512,4096 --tpot-ms 25,100

# The API side by side with vLLM's CPU build: shapes and greedy tokens (benchmarks/peers_api.py).
bench-peers-api: $(STAMP)
	$(BIN)/python benchmarks/peers_api.py

# Load while faults are injected (kill -9 of workers, of a router and of redis-server, a
# 40 s SIGSTOP of a prefill and of a decode worker, cancels, a stalled transfer, 2x
# overload, an abusive client): per fault, what became of every request, and proof that the
# fault hit (docs/reliability.md). ~4 minutes.
chaos: $(STAMP) redis
	$(BIN)/pdserve chaos --out build/chaos

# pdserve against vLLM's CPU build on the same machine, model and `vllm bench serve` load, one
# server at a time (benchmarks/peers.py): vLLM installs once into build/vllm-venv (~4 min),
# its first start compiles (~2-5 min, cached in build/vllm-cache); ~20 minutes in all.
bench-peers: $(STAMP)
	$(BIN)/python benchmarks/peers.py
	$(BIN)/python benchmarks/report.py

# One after another (never in parallel: they share the cores), then the dated report.
bench: $(STAMP)
	$(MAKE) --no-print-directory bench-engine
	$(MAKE) --no-print-directory bench-transfer
	$(MAKE) --no-print-directory bench-prefix
	$(MAKE) --no-print-directory bench-serving
	$(BIN)/python benchmarks/report.py
