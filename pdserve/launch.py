"""Standing up a deployment: Ray, the two pools as named actors, and the router in front.

Workers are named actors in the `pdserve` namespace (``pdserve-prefill-<i>``,
``pdserve-decode-<i>``), created with `get_if_exists`, so a restarted router finds pools that
are already running. The router loads only the checkpoint's config and tokenizer, never its
weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from engine.config import ConfigError, GenerationDefaults, ModelConfig
from engine.engine import EngineConfig, resolve_dtype
from engine.loop import EngineFailed
from engine.model import give_freed_memory_back
from engine.structured import backend_name
from engine.tokenizer import Tokenizer
from engine.weights import checkpoint_files, checkpoint_fingerprint
from kv_transfer.auth import SECRET_ENV
from kv_transfer.config import TransferConfig
from pdserve.checkpoint import PRESETS
from pdserve.config import PoolConfig, ServeConfig, cpu_sets
from pdserve.models import NAMED_MODELS, require_tokenizer, resolve_model
from pool_api import logs
from pool_api.config import WorkerConfig
from pool_api.messages import Role
from pool_api.prefix_index import make_index
from protos.pdserve.v1 import WIRE_VERSION
from protos.pdserve.v1 import generation_pb2 as gen
from router.clients import DecodeClient, PrefillClient
from router.core import Router
from router.pools import Pool
from router.validation import EdgeLimits, ModelLimits

if TYPE_CHECKING:
    from worker_common import StartupSummary, WorkerBase

log = logging.getLogger(__name__)
# Calls a worker actor runs at once (Ray async actors; an internal, not a setting).
ACTOR_MAX_CONCURRENCY = 1000


def engine_config(cfg: ServeConfig, model_path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model_path),
        dtype=cfg.model.dtype,
        device=cfg.model.device,
        chat_template=cfg.model.chat_template,
        kernels=cfg.model.kernels,
        batch_invariant=cfg.model.batch_invariant,
        cache=cfg.cache,
        scheduler=cfg.scheduler,
    )


def served_name(cfg: ServeConfig) -> str:
    """`--served-model-name`, else the preset, named model, hub id or file/directory name."""
    model = cfg.model.model
    if cfg.model.served_model_name:
        return cfg.model.served_model_name
    if model in PRESETS or model in NAMED_MODELS or not Path(model).exists():
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def wait_ready(ray: Any, refs: list[Any]) -> list[Any]:
    """Each worker's `ready()` answer, in order; a progress bar counts the workers that have
    loaded their model (on a terminal only)."""
    from tqdm import tqdm

    results: dict[Any, Any] = {}
    pending = list(refs)
    with tqdm(
        total=len(refs), desc="loading workers", unit="worker", disable=not sys.stderr.isatty()
    ) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                results[ref] = ray.get(ref)  # raises what a failed worker raised
            bar.update(len(done))
    return [results[ref] for ref in refs]


def kv_secret_by_default(transfer: TransferConfig, own_cluster: bool) -> TransferConfig:
    """KV channels are authenticated unless told otherwise. On the Ray cluster this process
    started, with no secret configured, the deployment generates one for its workers, as
    Ray generates its token. On an existing cluster the workers' nodes hold the secret
    (env PDSERVE_KV_SECRET, which the Helm chart generates); none configured here is warned
    about, since this process cannot see the workers' environment."""
    if transfer.transport == "local" or transfer.resolve_secret() is not None:
        return transfer
    if not own_cluster:
        log.warning(
            "no KV secret configured here: KV channels are authenticated only if the worker "
            "nodes set %s (the Helm chart does)",
            SECRET_ENV,
        )
        return transfer
    log.info("KV channels authenticated with a generated secret (%s sets your own)", SECRET_ENV)
    return replace(transfer, shared_secret=secrets.token_urlsafe(32))


def build_router(
    cfg: ServeConfig,
    model_path: Path,
    prefill: list[PrefillClient],
    decode: list[DecodeClient],
) -> Router:
    """The router for these pools, with the model's limits read from the checkpoint."""
    mcfg = ModelConfig.from_hf(model_path)
    # Deployment.start refused a checkpoint without one; from_dir raises if it is gone.
    tokenizer = Tokenizer.from_dir(model_path, mcfg, cfg.model.chat_template)
    max_len = cfg.scheduler.context_len(mcfg)
    name = served_name(cfg)
    info = gen.ModelInfo(
        served_model_name=name,
        max_context_length=max_len,
        vocab_size=mcfg.vocab_size,
        eos_token_ids=list(tokenizer.eos_token_ids),
        block_size=cfg.cache.block_size,
        dtype=str(resolve_dtype(cfg.model.dtype, mcfg.dtype, cfg.model.device)).removeprefix(
            "torch."
        ),
        model_fingerprint=checkpoint_fingerprint(mcfg, checkpoint_files(model_path)),
    )
    index = make_index(cfg.index.redis_url, name, cfg.index.ttl_s, cfg.index.timeout_s)
    return Router(
        cfg.router,
        ModelLimits(
            name,
            mcfg.vocab_size,
            max_len,
            cfg.cache.block_size,
            cfg.cache.num_blocks,
            GenerationDefaults.from_dir(model_path),
            EdgeLimits.of(cfg.router, max_len),
        ),
        tokenizer,
        info,
        Pool(Role.PREFILL, prefill),
        Pool(Role.DECODE, decode),
        cfg.transfer.transport,
        index=index,
        colocated=cfg.colocated,
    )


def router_view(cfg: ServeConfig, summaries: list[StartupSummary]) -> ServeConfig:
    """`cfg` with the KV pool the router checks requests against: the smallest worker's,
    where workers sized their caches from memory (`--kv-cache-memory`)."""
    if not summaries:
        return cfg
    num_blocks = min(s.num_blocks for s in summaries)
    return replace(cfg, cache=replace(cfg.cache, num_blocks=num_blocks))


def check_workers(summaries: list[StartupSummary], info: gen.ModelInfo, cfg: ServeConfig) -> None:
    """Refuse, in one line naming both sides, a worker this router cannot serve with: it
    speaks another pdserve wire version, serves another checkpoint, compiles grammars with
    another backend, or keeps another KV layout or cache than this config asks for (workers
    `get_if_exists` attached to, started by an earlier router with other flags). KV then
    never crosses checkpoints or versions.
    """
    mine = served_name(cfg)
    grammar_backend = backend_name()
    for s in summaries:
        theirs = f"worker {s.name} ({s.role})"
        if s.wire_version != WIRE_VERSION:
            raise ConfigError(
                f"{theirs} speaks pdserve wire version {s.wire_version}, this router "
                f"{WIRE_VERSION}: workers and routers of different versions never pair"
            )
        if s.model_fingerprint != info.model_fingerprint:
            raise ConfigError(
                f"{theirs} serves {s.model} (checkpoint {s.model_fingerprint[:12]}), this router "
                f"{mine} (checkpoint {info.model_fingerprint[:12]}): stop those workers (or "
                "their Ray cluster), or serve their model"
            )
        if "none" not in (s.grammar_backend, grammar_backend) and (
            s.grammar_backend != grammar_backend
        ):
            raise ConfigError(
                f"{theirs} compiles grammars with {s.grammar_backend}, this router with "
                f"{grammar_backend}: a constrained request's token #1 would be checked "
                "against another grammar; run one pdserve install everywhere"
            )
        asked = {"dtype": info.dtype, "block_size": info.block_size}
        if not cfg.cache.sized_from_memory:
            asked["num_blocks"] = cfg.cache.num_blocks
        for key, want in asked.items():
            if getattr(s, key) != want:
                raise ConfigError(
                    f"{theirs} keeps {key}={getattr(s, key)}, this router's config asks for "
                    f"{key}={want}: stop those workers (or their Ray cluster) to apply it"
                )


@dataclass
class Deployment:
    """Ray plus both pools. `start` blocks until every worker answered `ready`; afterwards
    the router's pool admin (`router.membership`) adds, flips and retires workers through
    it (`launch`, `flip`, `retire`: the router's `WorkerLauncher`)."""

    cfg: ServeConfig
    model_path: Path | None = None
    # every worker actor by name, whatever its role now (a flip keeps the name)
    actors: dict[str, Any] = field(default_factory=dict)
    started_ray: bool = False
    # what each worker loaded and its KV cache, from `ready` (pdserve.serve prints them)
    summaries: list[StartupSummary] = field(default_factory=list)
    _engine: EngineConfig | None = None
    _transfer: TransferConfig | None = None
    _router_info: gen.ModelInfo | None = None

    def start(self) -> Router:
        import ray

        cfg = self.cfg
        self.model_path = resolve_model(
            cfg.model.model, seed=cfg.model.weights_seed, revision=cfg.model.revision
        )
        require_tokenizer(self.model_path, cfg.model.model)
        if not ray.is_initialized():
            if not sys.stderr.isatty():  # a log file or a pod log: no colour codes in it
                os.environ.setdefault("RAY_COLOR_PREFIX", "0")
            init_ray(
                # None starts a fresh local Ray ("local"): plain None would join whatever
                # RAY_ADDRESS or the last `ray start` (/tmp/ray/ray_current_cluster) names.
                address=cfg.ray.address or "local",
                namespace=cfg.ray.namespace,
                include_dashboard=False,
                logging_level=logging.WARNING,
                # Workers' log records (pool_api.logs) show in this process's terminal.
                log_to_driver=True,
            )
            self.started_ray = cfg.ray.address is None
        self._engine = engine_config(cfg, self.model_path)
        # host "auto" is resolved by each decode actor on its node
        self._transfer = kv_secret_by_default(cfg.transfer, own_cluster=self.started_ray)
        # (name, role, index in its pool: its core set when pinned)
        roles: list[tuple[str, Role, int]] = []
        if not cfg.colocated:
            roles += [
                (f"pdserve-prefill-{i}", Role.PREFILL, i) for i in range(cfg.prefill.num_workers)
            ]
        decode_role = self.decode_role
        roles += [(f"pdserve-decode-{i}", decode_role, i) for i in range(cfg.decode.num_workers)]
        actors = [self._actor(name, role, i) for name, role, i in roles]
        self.summaries = wait_ready(ray, [a.ready.remote() for a in actors])
        self.actors = {name: a for (name, _, _), a in zip(roles, actors, strict=True)}
        view = router_view(cfg, self.summaries)
        if cfg.router.token_stream_host == "auto" and not self.started_ray:
            # joined a cluster: decode workers elsewhere reach this node's address
            host = ray.util.get_node_ip_address()
            view = replace(view, router=replace(view.router, token_stream_host=host))
        router = build_router(
            view,
            self.model_path,
            [PrefillClient.of_actor(n, self.actors[n]) for n, r, _ in roles if r is Role.PREFILL],
            [
                DecodeClient.of_actor(n, self.actors[n], r)
                for n, r, _ in roles
                if r is not Role.PREFILL
            ],
        )
        check_workers(self.summaries, router.model_info, cfg)
        self._router_info = router.model_info
        router.admin.launcher = self
        return router

    @property
    def decode_role(self) -> Role:
        return Role.COLOCATED if self.cfg.colocated else Role.DECODE

    def _pool(self, role: Role) -> PoolConfig:
        return self.cfg.prefill if role is Role.PREFILL else self.cfg.decode

    def _worker_cfg(self, name: str, role: Role, i: int) -> WorkerConfig:
        """Worker `name`, the `i`-th of its role's pool at start (its cores, if pinned)."""
        assert self._engine is not None and self._transfer is not None, "start() first"
        cfg, pool = self.cfg, self._pool(role)
        sets = cpu_sets(pool.cpu_affinity)
        cpus = sets[i] if i < len(sets) else ()
        # pinned: a thread per core; else as set, or auto
        threads = len(cpus) or pool.num_threads or self._auto_threads(pool)
        return WorkerConfig(
            name=name,
            engine=replace(self._engine, num_threads=threads) if cpus else self._engine,
            transfer=self._transfer,
            index=cfg.index,
            model_name=served_name(cfg),
            num_threads=threads,
            cpus=cpus,
            stall_timeout_s=pool.stall_timeout_s,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            role=role,
            # ten missed long polls, and never under the default
            stream_idle_timeout_s=max(30.0, 10 * cfg.router.heartbeat_s),
        )

    def _auto_threads(self, pool: PoolConfig) -> int:
        """`num_threads: 0`: on the cluster pdserve started, this host's cores shared evenly
        among the workers it starts (torch's threads past the cores would only preempt
        each other); on a cluster it joined, the worker's Ray CPUs, where Ray places it."""
        if not self.started_ray:
            return max(1, int(pool.num_cpus))
        cfg = self.cfg
        workers = cfg.decode.num_workers + (0 if cfg.colocated else cfg.prefill.num_workers)
        return max(1, len(os.sched_getaffinity(0)) // max(1, workers))

    def _actor(self, name: str, role: Role, i: int) -> Any:
        import ray

        from pdserve.worker_actor import WorkerActor

        pool = self._pool(role)
        opts: dict[str, Any] = dict(
            name=name,
            namespace=self.cfg.ray.namespace,
            num_cpus=pool.num_cpus,
            num_gpus=pool.num_gpus,
            resources=dict(pool.resources),
            max_restarts=pool.max_restarts,
            max_concurrency=ACTOR_MAX_CONCURRENCY,
            get_if_exists=True,
        )
        if self.cfg.ray.detached:
            opts["lifetime"] = "detached"
        return ray.remote(WorkerActor).options(**opts).remote(self._worker_cfg(name, role, i))

    def client(self, name: str, role: Role) -> PrefillClient | DecodeClient:
        actor = self.actors[name]
        if role is Role.PREFILL:
            return PrefillClient.of_actor(name, actor)
        return DecodeClient.of_actor(name, actor, role)

    def _check(self, summary: StartupSummary) -> None:
        assert self._router_info is not None, "start() first"
        check_workers([summary], self._router_info, self.cfg)

    # ---- the router's WorkerLauncher (router.membership) ---------------------------------
    async def launch(self, role: Role) -> PrefillClient | DecodeClient:
        """A new worker of `role` (decode: the deployment's decode role), started on any
        node with the pool's resources, ready and checked against this router (checkpoint,
        wire version, KV layout) before it is returned; one that fails the check is
        stopped."""
        import ray

        role = self.decode_role if role is not Role.PREFILL else role
        if role is Role.PREFILL and self.cfg.colocated:
            raise ValueError("role: a colocated deployment has no prefill pool")
        kind = "prefill" if role is Role.PREFILL else "decode"
        taken = {int(n.rsplit("-", 1)[1]) for n in self.actors if n.startswith(f"pdserve-{kind}-")}
        i = next(i for i in range(len(taken) + 1) if i not in taken)
        name = f"pdserve-{kind}-{i}"
        actor = self._actor(name, role, i)
        try:
            summary = await actor.ready.remote()
            self._check(summary)
        except BaseException:
            ray.kill(actor)
            raise
        self.actors[name] = actor
        self.summaries.append(summary)
        log.warning("added %s: %s", name, summary.line())
        return self.client(name, role)

    async def flip(self, name: str, to: Role) -> tuple[PrefillClient | DecodeClient, float]:
        """Worker `name`, drained, switched to role `to` in place (weights and KV cache
        kept): its client of the new role, and the switch's seconds on the worker."""
        summary: StartupSummary = await self.actors[name].flip.remote(to.value)
        self._check(summary)
        self.summaries = [s for s in self.summaries if s.name != name] + [summary]
        return self.client(name, to), summary.load_s

    async def retire(self, name: str) -> None:
        """Stop worker `name` (drained) and forget it."""
        import ray

        actor = self.actors.pop(name)
        self.summaries = [s for s in self.summaries if s.name != name]
        try:
            await asyncio.wait_for(actor.shutdown.remote(), 5)
        except Exception as e:  # it may be gone already: killing it is what matters
            log.debug("shutdown of %s failed: %s", name, e)
        ray.kill(actor)

    def stop(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        if not self.cfg.ray.detached:
            for a in self.actors.values():
                try:
                    ray.get(a.shutdown.remote(), timeout=5)
                except Exception as e:
                    log.debug("shutdown of a worker failed: %s", e)
                ray.kill(a)
        if self.started_ray:
            ray.shutdown()


def run_with_workers(cfg: Any, model_dir: Any, body: Any) -> None:
    """`await body(router, prefill, decode)` against a started Router over one in-process
    prefill and one decode worker of `cfg` (a ServeConfig; use transport `local`); drained
    and shut down afterwards, whatever happens, and their memory handed back (the caller
    may host the next set). Tests and the determinism census use it."""
    try:
        _serve_in_process(cfg, model_dir, body)
    finally:
        give_freed_memory_back()


class _Handle:
    """Worker `name` of `workers`, looked up on every call (an in-process actor handle)."""

    def __init__(self, workers: dict[str, WorkerBase], name: str) -> None:
        self._workers, self._name = workers, name

    def __getattr__(self, method: str) -> Any:
        worker = self._workers.get(self._name)
        if worker is not None:
            return getattr(worker, method)

        async def gone(*args: Any) -> Any:  # as a killed actor's calls fail
            raise EngineFailed(f"{self._name} was stopped")

        return gone


class InProcessLauncher:
    """The router's `WorkerLauncher` for workers that live in this process (tests, the
    determinism census, benchmarks): the same workers and the same role switch
    (`pdserve.worker_actor.switch_role`) as the Ray actors, without Ray. `cfg` is a
    ServeConfig (use transport `local`)."""

    def __init__(self, cfg: ServeConfig, model_dir: Path) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.workers: dict[str, WorkerBase] = {}

    def _worker_cfg(self, name: str, role: Role) -> WorkerConfig:
        ecfg = engine_config(self.cfg, self.model_dir)
        return WorkerConfig(name, ecfg, self.cfg.transfer, self.cfg.index, "tiny", role=role)

    def start(self, name: str, role: Role) -> WorkerBase:
        """Worker `name`, built here and now (the caller's thread)."""
        from pdserve.worker_actor import make_worker

        worker = self.workers[name] = make_worker(self._worker_cfg(name, role))
        return worker

    def client(self, name: str, role: Role | None = None) -> PrefillClient | DecodeClient:
        """A client of worker `name` that, as a Ray actor handle does, reaches whichever
        worker object serves under that name now (a flip replaces it)."""
        handle = cast(Any, _Handle(self.workers, name))
        if (role or self.workers[name].role) is Role.PREFILL:
            return PrefillClient(name, handle)
        return DecodeClient(name, handle, role=role or self.workers[name].role)

    async def launch(self, role: Role) -> PrefillClient | DecodeClient:
        names = (f"pdserve-{role.value}-{i}" for i in range(len(self.workers) + 1))
        name = next(n for n in names if n not in self.workers)
        worker = await asyncio.to_thread(self.start, name, role)
        await worker.start_feed()
        return self.client(worker.name)

    async def flip(self, name: str, to: Role) -> tuple[PrefillClient | DecodeClient, float]:
        from pdserve.worker_actor import switch_role

        t0 = time.perf_counter()
        old = self.workers[name]
        self.workers[name], _ = await switch_role(old, replace(old.cfg, role=to))
        return self.client(name), time.perf_counter() - t0

    async def retire(self, name: str) -> None:
        self.workers.pop(name).shutdown()

    def shutdown(self) -> None:
        for w in self.workers.values():
            w.shutdown()


def _serve_in_process(cfg: Any, model_dir: Any, body: Any) -> None:
    launcher = InProcessLauncher(cfg, model_dir)
    try:
        prefill = launcher.start("pdserve-prefill-0", Role.PREFILL)
        decode = launcher.start("pdserve-decode-0", Role.DECODE)
        router = build_router(
            cfg,
            model_dir,
            [cast(PrefillClient, launcher.client(prefill.name))],
            [cast(DecodeClient, launcher.client(decode.name))],
        )
        router.admin.launcher = launcher

        async def main() -> None:
            await router.start()
            try:
                await body(router, prefill, decode)
            finally:
                await router.drain(0.0)

        asyncio.run(main())
    finally:
        launcher.shutdown()


_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _token_auth_on_notice(record: logging.LogRecord) -> bool:
    """Drop Ray's notice that a new local cluster has token auth on (its default), which
    advises opting out on every start; its warning that auth is *off* still shows."""
    return not record.getMessage().startswith("Token authentication is enabled")


def init_ray(worker_niceness: int | None = None, **kwargs: Any) -> None:
    """`ray.init(**kwargs)`, tried a second time, saying so, when a fresh local node does
    not come up ("The current node timed out during startup": its raylet never started,
    seen once in 5 fresh-clone test runs on a 2-core host). Joining a cluster is not retried:
    there a failure is the cluster's to report.

    `worker_niceness` (a fresh local node only; None: Ray's default, 15): pdserve serves with
    Ray's default, so that on a shared host the router keeps its priority over the workers
    (at 0, `pdserve chaos`'s overload row saw rejections take 225 ms instead of ~20). The test
    suite starts its clusters at 0: there the other pytest worker's in-process engines, at 0,
    took ~30x the CPU of workers at 15, and a restarted worker took over 90 s to load
    (docs/benchmarks.md)."""
    import ray

    if kwargs.get("address") == "local":
        logging.getLogger(_RAY_AUTH_LOGGER).addFilter(_token_auth_on_notice)
        if worker_niceness is not None:
            system = kwargs.get("_system_config", {})
            kwargs["_system_config"] = {"worker_niceness": worker_niceness, **system}
    # Ray's driver-side lines in pdserve's format: before init, and again after it
    # (ray.init sets its own formatter on the `ray` logger)
    logs.adopt("ray")
    try:
        ray.init(**kwargs)
    except Exception as e:  # ray raises plain Exception subclasses here
        if kwargs.get("address") != "local" or "timed out" not in str(e):
            raise
        log.warning("ray.init: the local node did not start (%s); starting it again", e)
        ray.shutdown()
        ray.init(**kwargs)
    logs.adopt("ray")
