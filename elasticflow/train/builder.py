"""The parts of a run, built from its config before the first step: what ``ElasticTrainer.prepare`` calls.

``build`` resolves the backend once, places the worker (device, threads), calls the model file's
``model()`` and ``data()``, and returns the parts the loop trains with; ``announce`` is rank 0's start
banner. Nothing here keeps state: the trainer owns what is returned.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

from ..data import order as data
from ..config import devices, optim, reproducible, topology
from . import model_file, ops, randomness, local_sgd
from .balance import Balance
from ..backends.buffers import Reconciler
from .._util import affinity
from .._util.context import _context
from ..distributed import protocol
from ..data.prefetch import Prefetcher
from ..observability.reporting import banner

log = logging.getLogger("elasticflow")


@dataclass
class Parts:
    """What a run trains with: ``ElasticTrainer.prepare`` takes the ones the loop reads as attributes of the same
    name; the stepper (``stepper()``) gets the rest."""
    backend: Any                    # the backend module (elasticflow.backends.<name>)
    placement: devices.Placement    # device, precision, comm backend
    local_workers: int              # workers on this host (core pinning, threads)
    model_file: model_file.ModelFile
    built: model_file.Built          # what model() returned, checked
    spec: optim.OptimizerSpec
    trains: Dict[str, Any]          # optim.summary: the optimizer, lr and schedule that train (trackers, status)
    engine: Any                     # the backend's Engine
    seed: int                       # read every micro-batch: a plain int, not an OmegaConf read (40-100 us)
    reconciler: Optional[Reconciler]  # buffers (BatchNorm statistics) reconciled across workers; None without
    shards: Any                     # shard.ShardedState with trainer.shard, else None
    outer: Any                      # local_sgd.Outer for topology=local_sgd|diloco, else None
    source: data.Source
    prefetch: Prefetcher
    schedule: data.Schedule
    eval_dataset: Optional[data.Dataset]
    balance: Any = None             # balance.Balance: the members' speeds and the shares dealt by them
    fingerprint: bool = False       # elastic.fingerprint: the members' parameters compared every step
    verify_every: Optional[int] = None  # elastic.verify_every: a micro-batch computed twice every N steps
    threads: str = ""               # the banner's words for the intra-op threads and where their number came from


def build(cfg: Any, t: Any, loaded: Optional[model_file.ModelFile]) -> Parts:
    """The parts of the run ``cfg`` describes (``t``: its trainer section as a plain dataclass)."""
    ops.use(cfg.backend.name)  # the backend is resolved once, before anything imports a framework
    backend = ops.current()
    local_workers = int(os.environ.get(protocol.ENV_LOCAL_WORKERS, "1"))
    placement = devices.resolve(cfg, backend, local_workers)
    loaders = cfg.data.workers if cfg.data.worker_type == "process" else 0
    set_to = reproducible.threads(cfg) or cfg.backend.threads
    host = affinity.cores(look=False)
    share = devices.intra_op_threads(host.usable, local_workers, loaders)
    if not set_to and share > 1:  # ~12 ms: are other processes holding some of the share? (_util/affinity.py)
        host = affinity.cores()
    threads = set_to or affinity.default_threads(share, host)
    backend.setup(threads, cfg.seed, placement, deterministic=bool(t.reproducible))
    np.random.seed(cfg.seed)
    mf = loaded or model_file.load(cfg.model)
    mf.check_eval(t.eval_every)
    built = model_file.build(mf, cfg, backend)
    paged = {"paged_params": True} if t.shard == "parameters" else {}  # stage 3 (torch: TensorFlow is refused)
    engine = backend.Engine(built.model, mf.forward, built.optimizer, jit=cfg.backend.jit, placement=placement, **paged)
    seed = _context.seed = int(cfg.seed)
    rules = engine.buffer_rules()
    shards = None
    checked = topology.validate(cfg.topology)
    kind = checked.kind
    if t.shard != "none":  # ZeRO stage 1/2: this worker keeps only its ranges of the optimizer state
        from ..replica.shard import ShardedState

        shards = ShardedState(engine, built.optimizer, t.shard, int(cfg.elastic.shard_replicas))
        shards.reproducible = bool(t.reproducible)
        if t.shard == "parameters":  # stage 3: units brought in for forward and backward (param_units.py)
            from ..replica.param_units import ParamUnits

            shards.units = ParamUnits(engine, shards, list(t.shard_units), model=built.model)
    elif kind == "parameter_server":  # the aggregators keep the shards (replica/parameter_server.py)
        from ..distributed.comm.hierarchy import tag_hash
        from ..replica.shard import ShardedState

        tag = topology.this_workers_group(checked, os.environ.get(protocol.ENV_LOCAL_SLOT))
        copies = next(r.replica for r in checked.roles if not r.data_consumer)  # the aggregator role's replica
        shards = ShardedState(engine, built.optimizer, "gradients", 0,
                              serve=(int(cfg.topology.aggregators), copies, tag_hash(tag)))
    outer = None
    if kind in local_sgd.KINDS:  # the replicas' buffers meet at each round's end (local_sgd.py), not every step
        topo, rules = cfg.topology, {}
        outer = local_sgd.Outer(kind, topo.replicas, topo.sync_every, topo.outer_lr, topo.outer_momentum,
                             engine.flat_layout())
    train = data.Dataset(mf.call("data", cfg), "data()", mf.collate, mf.field_names())
    source = data.Source(train, backend, placement, t.data_on_device)
    data.check_size(len(source), t.global_batch_size)
    d = cfg.data
    return Parts(backend=backend, placement=placement, local_workers=local_workers, model_file=mf, built=built,
                 spec=built.optimizer, trains=optim.summary(built.optimizer, built.optimizer_from_model),
                 engine=engine, seed=seed, reconciler=Reconciler(rules) if rules else None,
                 shards=shards, outer=outer, source=source,
                 prefetch=Prefetcher(source, seed, d.prefetch, d.workers, d.worker_type, d.shuffle),
                 schedule=data.Schedule(len(source), t.global_batch_size, t.drop_last, t.max_steps, t.epochs),
                 balance=Balance(cfg.elastic, t.micro_batch_size, t.global_batch_size, cfg.launcher.min_workers),
                 fingerprint=bool(cfg.elastic.fingerprint), verify_every=cfg.elastic.verify_every,
                 eval_dataset=data.Dataset(mf.call("eval_data", cfg), "eval_data()", mf.collate, mf.field_names())
                 if mf.eval_data else None,
                 threads=f"{threads} intra-op thread{'s' if threads != 1 else ''} per worker ("
                 + (("trainer.reproducible" if t.reproducible else "backend.threads") if set_to
                    else f"{host.describe()}; backend.threads overrides") + ")")


def stepper(parts: Parts, *args: Any) -> Any:
    """The step's attempt for this run: ``stepper.Stepper`` (every step synchronous), or ``local_sgd.RoundStepper``
    (local SGD, DiLoCo: a round of steps at a time). ``args``: the rest of ``Stepper``'s arguments."""
    from .stepper import Stepper

    return (Stepper if parts.outer is None else local_sgd.RoundStepper)(parts, *args)


def announce(parts: Parts, cfg: Any, t: Any, world: int, run_dir: Any, resumed: Optional[str], drew: Any) -> None:
    """Rank 0's start banner, and the warning when the result would depend on the number of workers
    (random draws or batch statistics without ``trainer.micro_batch_size``). ``drew``: what the start-up
    probe saw forward() draw (``evaluation.probe``)."""
    log.info(banner(backend=parts.backend.NAME, device=parts.placement.describe(), world=world,
                    global_batch=t.global_batch_size, micro=t.micro_batch_size,
                    optimizer=optim.describe(parts.spec)
                    + (" (from the model file)" if parts.built.optimizer_from_model else ""),
                    samples=len(parts.source), steps_per_epoch=parts.schedule.steps_per_epoch,
                    total_steps=parts.schedule.total_steps, run_dir=run_dir, resumed=resumed, threads=parts.threads))
    if t.reproducible:
        log.info("  reproducible: exact sums, %d intra-op thread(s) per worker, deterministic kernels: the same bits "
                 "for any number of workers (docs/exactness.md)", reproducible.threads(cfg))
    if parts.engine.compiling:
        log.info("  torch.compile: the first step compiles the model (tens of seconds on a CPU, longer for a "
                 "large model); the steps after it run the compiled code")
    statistics = bool(parts.reconciler and parts.reconciler.has_batch_statistics)
    warning = t.micro_batch_size is None and randomness.warning(
        randomness.sources(parts.built.model, drew), statistics, t.global_batch_size,
        max(world, cfg.launcher.workers, cfg.launcher.max_workers or 0, 2),  # a resume may add workers
        parts.placement.compute_dtype)
    if warning:
        log.warning(warning)
