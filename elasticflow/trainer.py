"""ElasticTrainer: the train loop, one step function, gradient accumulation, logging, checkpoints.

The trainer is the one place that knows every part; each part returns results and never calls back:
``state.TrainState`` (progress), ``replica.Replica`` (reductions, recovery), ``checkpoint.CheckpointManager``
(saves, resume), ``evaluation.Evaluation``, ``reporting.RunLog`` (metrics.jsonl, events.jsonl),
``goodput.Meter`` (productive time against the costs it measures: goodput.py defines the accounting).
Counters, never mixed: ``step`` counts optimizer steps, ``micro_step`` micro-batches,
``cursor.samples_seen`` samples, ``generation`` membership changes.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
from omegaconf import OmegaConf

from . import affinity, data, devices, evaluation, grad_check, loss_scale, modelfile, ops, optim, randomness
from .checkpoint import Checkpointer, CheckpointInterval, CheckpointManager
from .config import TrainerConfig, compose
from .data import GlobalBatch
from .distributed import protocol
from .distributed.protocol import CommError
from .errors import ElasticFlowError, TrainingInterrupted
from .buffers import Reconciler
from .goodput import Meter
from .prefetch import Prefetcher
from .replica import Agreed, Replica
from .reporting import Progress, RunLog, StepLog, banner, rss_mib
from .signals import StopSignal
from .current import _context, context  # noqa: F401 - context: elasticflow.context()
from .state import TrainState

log = logging.getLogger("elasticflow")
__all__ = ["ElasticTrainer", "CheckpointInterval", "GlobalBatch", "context"]


class ElasticTrainer:
    """Trains the model file's ``model()`` with ``forward()`` on ``data()``.

    Args:
        model: path to the model file (or a loaded ``ModelFile``).
        cfg: a config from ``elasticflow.config.compose`` (or Hydra); None composes the defaults.
        checkpoint_interval: overrides ``checkpoint.interval`` from the config.
        run_dir: where metrics.jsonl and checkpoints go (default: the current directory).
        membership: set by the worker process of a multi-worker job (``distributed.membership``).

    Example (your own loop; ``fit()`` is exactly this plus the progress bar):
        >>> trainer = ElasticTrainer("models/digits_mlp.py", compose("models/digits_mlp.py", ["trainer.max_steps=50"]),
        ...                          checkpoint_interval=CheckpointInterval(steps=10), run_dir="runs/a")
        >>> trainer.prepare()
        >>> for epoch in trainer.epoch_range():
        ...     with trainer.epoch(epoch):
        ...         for batch in trainer.batches():
        ...             with trainer.step():
        ...                 metrics = trainer.train_step(batch)
        >>> trainer.finish()
    """

    def __init__(self, model: Any, cfg: Any = None, checkpoint_interval: Optional[CheckpointInterval] = None,
                 run_dir: Optional[str] = None, membership: Any = None):
        self.model_file = model if isinstance(model, modelfile.ModelFile) else None
        self.cfg = cfg if cfg is not None else compose(str(model))  # compose() and the CLI validate it
        # The loop reads these settings several times a step, and one OmegaConf attribute read costs
        # 40-100 us (it walks the parent chain for flags and interpolations): ten a step nearly doubled
        # the step time of models/digits_mlp.py. A plain dataclass copy, taken once, costs nothing to read.
        self.tcfg = TrainerConfig(**OmegaConf.to_container(self.cfg.trainer, resolve=True))
        iv = self.cfg.checkpoint.interval
        self.interval = checkpoint_interval or CheckpointInterval(steps=iv.steps, epochs=iv.epochs)
        self.run_dir = Path(run_dir or ".").resolve()
        self.ckpt_dir = Path(self.cfg.checkpoint.dir).expanduser() if self.cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.membership = membership
        self.state = TrainState()
        self.run_log = RunLog(self.run_dir, tensorboard=self.tcfg.tensorboard)
        self.stop_signal = StopSignal(console=membership is None)  # with workers, the agent says it once
        self.metric_names: list = []
        self.last_eval: Dict[str, float] = {}
        self.resumed_from: Optional[str] = None
        self._agreed = Agreed()  # what the members agreed on in the last step's reduction
        self.meter = Meter()
        self._own_memory = (-1e9, 0.0)  # (monotonic time read, resident MiB): this process's, for _memory
        self._reduce_started = 0.0  # perf_counter() when this step attempt's reduction began
        self.step_log = StepLog(self.run_log, self.tcfg.log_every, self._memory)
        self._prepared = False

    # Where this worker sits (the replica follows the membership through every regroup).
    rank = property(lambda self: self.replica.rank)
    world = property(lambda self: self.replica.world)
    generation = property(lambda self: self.replica.generation)
    step_count = property(lambda self: self.state.step, doc="optimizer steps completed")

    # ------------------------------------------------------------------ setup
    def prepare(self) -> "ElasticTrainer":
        """Resolve the backend, build parameters and optimizer, load data, resume if a checkpoint exists."""
        cfg, t = self.cfg, self.tcfg
        ops.use(cfg.backend.name)  # the backend is resolved once, before anything imports a framework
        self.backend = ops.current()
        local_workers = int(os.environ.get(protocol.ENV_LOCAL_WORKERS, "1"))
        self.placement = devices.resolve(cfg, self.backend, local_workers)
        loaders = cfg.data.workers if cfg.data.worker_type == "process" else 0
        threads = cfg.backend.threads or devices.intra_op_threads(os.cpu_count() or 1, local_workers, loaders)
        self.backend.setup(threads, cfg.seed, self.placement)
        np.random.seed(cfg.seed)
        mf = self.model_file = self.model_file or modelfile.load(cfg.model)
        mf.check_eval(t.eval_every)
        built = modelfile.build(mf, cfg, self.backend)
        self.spec = built.optimizer
        self.engine = self.backend.Engine(built.model, mf.forward, self.spec, jit=cfg.backend.jit,
                                          placement=self.placement)
        self.seed = int(cfg.seed)  # read every micro-batch: not through OmegaConf (40-100 us a read)
        _context.seed = self.seed
        rules = self.engine.buffer_rules()
        self.reconciler = Reconciler(rules) if rules else None
        self.shards = None
        if t.shard != "none":  # ZeRO stage 1/2: this worker keeps only its ranges of the optimizer state
            from .shard import ShardedState

            self.shards = ShardedState(self.engine, self.spec, t.shard, int(cfg.elastic.shard_replicas))

        self.source = data.Source(data.Dataset(mf.call("data", cfg), "data()"), self.backend, self.placement,
                                  t.data_on_device)
        data.check_size(len(self.source), t.global_batch_size)
        d = cfg.data
        self.prefetch = Prefetcher(self.source, self.seed, d.prefetch, d.workers, d.worker_type)
        self.schedule = data.Schedule(len(self.source), t.global_batch_size, t.drop_last, t.max_steps, t.epochs)
        self.step_log.total_steps = self.schedule.total_steps
        eval_dataset = data.Dataset(mf.call("eval_data", cfg), "eval_data()") if mf.eval_data else None

        self.replica = Replica(self.membership, self.engine, self.state_dict, self.load_state_dict,
                               cfg.comm.bucket_mb, self.shards)
        if self.membership is not None and self.placement.comm == "nccl":
            self.membership.nccl_device = self.placement.device  # GPU tensors reduce over NCCL from the first group
        self.checkpoints = CheckpointManager(Checkpointer.for_run(self.ckpt_dir, cfg, self.run_dir, self.membership),
                                             cfg, self.spec.name, self.backend.NAME, self.state_dict,
                                             self.load_state_dict)
        resumed = self.checkpoints.resume()
        self.resumed_from = str(resumed) if resumed else None
        probe = evaluation.probe(self.engine, self.source, mf.check_fields)
        self.metric_names = probe.metric_names
        self.evaluation = None if eval_dataset is None else evaluation.Evaluation(
            eval_dataset, self.backend, self.metric_names, t.micro_batch_size or t.global_batch_size)
        self._join()
        if self.replica.lost:
            self._fall_back(self.state.step)
        if self.membership is not None:  # once joined: a worker started by srun learns its id on joining
            self.membership.report_device(self.placement.describe())  # for `elasticflow status`
        self.checkpoints.reserve(self.rank, self.world, self.replica.sharding())
        if cfg.backend.pin_cores and self.placement.kind == "cpu":  # last: what started above keeps every core
            affinity.pin_training_thread(devices.local_slot(), local_workers)
        self._prepared = True
        self.meter.start()  # from here every second is productive or a measured cost (goodput.py)
        if self.rank == 0:
            self.run_log.event("ready", step=self.state.step, world_size=self.world, resumed_from=self.resumed_from)
            log.info(banner(backend=self.backend.NAME, device=self.placement.describe(), world=self.world, global_batch=t.global_batch_size,
                            micro=t.micro_batch_size, optimizer=optim.describe(self.spec)
                            + (" (from the model file)" if built.optimizer_from_model else ""),
                            samples=len(self.source), steps_per_epoch=self.schedule.steps_per_epoch,
                            total_steps=self.schedule.total_steps, run_dir=self.run_dir, resumed=self.resumed_from))
            statistics = bool(self.reconciler and self.reconciler.has_batch_statistics)
            warning = t.micro_batch_size is None and randomness.warning(
                randomness.sources(built.model, probe.drew), statistics, t.global_batch_size,
                max(self.world, cfg.launcher.workers, cfg.launcher.max_workers or 0, 2))  # a resume may add one
            if warning:
                log.warning(warning)
        return self

    def _join(self) -> None:
        """Enter the job (a multi-worker run); a worker that joined a running job says what it cost."""
        ready_at = time.time()
        joined = self.replica.join(self.state.cursor.samples_seen)
        self._entered_generation()
        if joined is not None and (joined.generation > 0 or joined.state_received):
            spawned = float(os.environ.get(protocol.ENV_SPAWNED_AT, ready_at))
            self.run_log.event("joined", worker=self.replica.worker_id, generation=joined.generation,
                               world_size=joined.world, start_s=round(ready_at - spawned, 4),
                               admit_s=round(joined.admit_s, 4), rebuild_s=round(joined.rebuild_s, 4),
                               transfer_s=round(joined.transfer_s, 4), state_received=joined.state_received)

    # ------------------------------------------------------------------ the state, for checkpoints and replicas
    def state_dict(self) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        """(arrays, progress): the engine's tensors by name (views: read them before the next update) and
        the TrainState's fields. No generator state: every micro-batch seeds its own (``data.micro_seed``).
        With trainer.shard the optimizer's tensors are this worker's own ranges (``Partial``)."""
        arrays = self.engine.state(copy=False)
        if self.shards is not None:
            arrays.update(self.shards.partials())
        return arrays, self.state.state_dict()

    def load_state_dict(self, arrays: Dict[str, np.ndarray], progress: Dict[str, Any]) -> None:
        self.state.load_state_dict(progress)
        if self.shards is None:
            self.engine.load_state(arrays, self.state.step)
            return
        slots = {k: v for k, v in arrays.items() if k.startswith("optimizer/")}
        rest = {k: v for k, v in arrays.items() if k not in slots}
        if all(n in rest for n in self.shards.param_at):  # a checkpoint: whole tensors
            self.engine.load_state(rest, self.state.step)
            self.shards.load_full(slots, self.state.cursor.samples_seen)
        else:  # a peer's buffers in a recovery: the parameters came with the ranges and their allgather
            self.engine.set_buffers(rest)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Dict[str, Any]:
        """Prepare (if needed), train to the configured end, evaluate, write the final checkpoint."""
        if not self._prepared:
            self.prepare()
        self.step_log.progress = Progress(self.tcfg.progress if self.rank == 0 else False, self.schedule.total_steps,
                                          self.state.step)
        try:
            with self.stop_signal.installed():
                for epoch in self.epoch_range():
                    with self.epoch(epoch):
                        for batch in self.batches():
                            with self.step():
                                self.train_step(batch)
        except BaseException as exc:
            self.step_log.flush()  # the last step's record before the loop's end (the ledger's "trained")
            self._trained("interrupted" if isinstance(exc, TrainingInterrupted) else
                          "stopped" if isinstance(exc, ElasticFlowError) else "failed")
            raise
        finally:
            self.step_log.flush()
            self.step_log.progress.close()
            self.prefetch.close()
        return self.finish()

    def epoch_range(self) -> Iterator[int]:
        """Epochs still to train, starting at the data cursor's epoch."""
        return self.schedule.epochs(self.state)

    @contextmanager
    def epoch(self, epoch: int):
        """Before: fix the epoch's global sample order. After: advance the cursor, maybe checkpoint."""
        cursor = self.state.cursor
        if epoch != cursor.epoch:
            raise ValueError(f"epoch({epoch}) called while the data cursor is at epoch {cursor.epoch}")
        self._order = self.prefetch.order(epoch)
        yield
        cursor = self.state.cursor  # a recovery may have adopted another member's cursor ...
        if cursor.epoch == epoch and cursor.samples_in_epoch >= self.schedule.epoch_samples:  # ... in the next epoch
            cursor.epoch += 1
            cursor.samples_in_epoch = 0
            if self.interval.should_save(current_epoch=cursor.epoch):
                self.save_checkpoint(f"epoch_{cursor.epoch}", wait=False)

    def batches(self) -> Iterator[GlobalBatch]:
        """The epoch's remaining global batches, from the data cursor; stops at max_steps."""
        return self.schedule.batches(self.state)

    @contextmanager
    def step(self):
        """Around one train_step: time it, then log, evaluate and checkpoint on their intervals, and act
        on what the members agreed (stop, regroup).

        Note: with more than one worker, rank 0 writes a step's record (metrics.jsonl, the console, the
        progress bar) while the next step's reduction is in flight, or before an evaluation, a checkpoint,
        a regroup or ``finish()``, whichever comes first (``reporting.StepLog``).
        """
        started = time.perf_counter()
        yield
        elapsed = time.perf_counter() - started
        s, m = self.state, self.state.last_metrics
        m["step_time_s"] = elapsed
        if self.step_log.due(m):  # on every rank: a worker that becomes rank 0 goes on from the same logged step
            m["train_s"] = self.meter.flush()  # productive seconds since the previous logged step
        self.step_log.ended(m, self.rank, self.world)
        ev = self.tcfg.eval_every
        if ev and self.evaluation is not None and s.step % ev == 0 and not m.get("skipped"):
            self.evaluate()
        if self.interval.should_save(current_step=s.step) and not m.get("skipped") and s.last_saved_step != s.step:
            self.save_checkpoint(f"step_{s.step}", wait=False)
        self._act_on_agreement()

    def _act_on_agreement(self) -> None:
        """Act, at this step boundary, on what every member agreed on in the step's reduction."""
        agreed, self._agreed = self._agreed, Agreed()
        self.stop_signal.announce()
        # A single process needs no vote: it honours a stop asked at any time before the boundary.
        if agreed.interrupt or (self.membership is None and self.stop_signal.requested):
            self.save_checkpoint(f"step_{self.state.step}")
            raise TrainingInterrupted()
        if agreed.agent_lost:
            self.save_checkpoint(f"step_{self.state.step}")
            raise ElasticFlowError("the agent (job master) is gone; checkpoint written, worker exiting",
                                   "rerun the same command: resume=auto continues from the checkpoint",
                                   exit_code=protocol.EXIT_AGENT_LOST)
        if agreed.membership:
            self._recover(None)

    # ------------------------------------------------------------------ one step
    def train_step(self, batch: GlobalBatch) -> Dict[str, Any]:
        """Forward and backward over this worker's micro-batches, reduce, clip, apply once.

        When a peer fails mid-step the partial step is discarded, the group rebuilt and the same
        global batch re-split over the survivors -- unless a survivor had already committed it, in
        which case its state is adopted (``Replica.sync_state``) and nothing is redone.
        """
        while True:
            attempt_started = time.perf_counter()
            try:
                return self._attempt(batch)
            except CommError as exc:
                failure, failed = str(exc), time.perf_counter()
            # Recover out here, not in the except block: until it ends, the exception's traceback keeps the
            # failed attempt's frames, and in them the reduction's gloo works, and so the dead group's
            # sockets open. A member blocked in a receive from this one would wait for the group's timeout
            # (30 s in bench_elastic's kills, 2 in 5) instead of waking at once when they close.
            # The attempt's compute, then the time blocked in the collective that failed (detection).
            reduced = self._reduce_started if self._reduce_started >= attempt_started else failed
            c = self.state.cursor
            committed = c.epoch > batch.epoch or c.samples_in_epoch >= batch.end  # failed in the allgather
            start = self.reconciler and self.reconciler.start_values()
            if start and not committed:  # the failed step's forwards moved the buffers: redo from the start
                self.engine.set_buffers(start)
            self._recover(failure, (reduced - attempt_started, failed - reduced))
            c = self.state.cursor
            # Done (a member had committed it), or a fall back to a checkpoint moved the cursor back.
            if c.epoch != batch.epoch or c.samples_in_epoch != batch.start:
                return self.state.last_metrics

    def _attempt(self, batch: GlobalBatch) -> Dict[str, Any]:
        t, s, engine = self.tcfg, self.state, self.engine
        _context.step, _context.epoch = s.step + 1, batch.epoch
        share = data.deal((batch.start, batch.end), self.rank, self.world, t.micro_batch_size)
        reconciler = self.reconciler if self.world > 1 else None  # one worker's buffers are already sequential
        if reconciler is not None:
            reconciler.begin(engine.buffer_arrays())
        engine.train_mode(True)
        engine.zero_grad()
        scaling = self.placement.loss_scaling
        if scaling:
            engine.grad_scale = s.loss_scale
        loss_sum, metric_sums = None, {}
        keys = self.schedule.ahead(batch, share, self.prefetch.depth, self.state.step, self.rank, self.world,
                                   t.micro_batch_size)
        for i, (a, b) in enumerate(share.micro):
            # Dropout draws from a generator seeded by the micro-batch's place in the global order only.
            engine.seed(data.micro_seed(self.seed, batch.epoch, batch.start, share.first + i))
            rows = self.prefetch.take(keys[i], keys[i + 1:]) if keys else self.source.rows(self._order[a:b])
            if i == len(share.micro) - 1:
                self.replica.begin_backward()  # the gradient is final as backward finishes each bucket
            loss_w, metrics_w = engine.accumulate(rows, (b - a) / batch.size)
            if loss_sum is None:  # the first (often only) micro-batch: no tensor additions
                loss_sum, metric_sums = loss_w, dict(metrics_w)
            else:
                loss_sum = loss_sum + loss_w
                for k, v in metrics_w.items():
                    metric_sums[k] = metric_sums.get(k, 0.0) + v
            s.micro_step += 1
        loss_sum = 0.0 if loss_sum is None else loss_sum  # an empty share (more workers than samples)
        # float(): a sync point on accelerators; the non-finite check needs it anyway.
        scalars = [float(loss_sum)] + [float(metric_sums.get(k, 0.0)) for k in self.metric_names]
        contribution = None if reconciler is None else reconciler.contribution(
            engine.buffer_arrays(), share.first, len(share.micro), share.total, self.rank, self.world)
        self._reduce_started = time.perf_counter()
        reduction = self.replica.start_reduce(scalars, self.stop_signal.requested, contribution)
        self.step_log.flush()  # rank 0: the previous step's record, while the reduction is in flight
        scalars, agreed, buffers = self.replica.finish_reduce(reduction)
        if buffers is not None:
            engine.set_buffers(reconciler.finish(buffers))
        loss, metric_values = scalars[0], dict(zip(self.metric_names, scalars[1:]))

        record: Dict[str, Any] = {"epoch": batch.epoch}
        verdict = grad_check.check(engine, loss, t.grad_clip, s.loss_scale if scaling else None)
        lr = optim.lr_at(self.spec, s.step, self.schedule.total_steps)
        if verdict.overflow:  # float16 overflowed: skip the update, as torch's GradScaler does, and lower the scale
            s.skipped_steps += 1
            log.debug("float16 gradient overflow at step %d; loss scale %g -> %g", s.step + 1, s.loss_scale,
                      s.loss_scale * loss_scale.BACKOFF)
            record.update(skipped=True, overflow=True)
        elif not verdict.finite:
            what = verdict.problem(loss)
            if t.on_nonfinite == "stop":
                raise ElasticFlowError(
                    f"{what} at step {s.step + 1} (epoch {batch.epoch}); training stopped, "
                    f"no update applied", "lower optimizer.lr, set trainer.grad_clip, or pass "
                    "trainer.on_nonfinite=skip to skip such steps", exit_code=1)
            s.skipped_steps += 1
            log.warning("%s at step %d; skipping the update (trainer.on_nonfinite=skip)", what, s.step + 1)
            record["skipped"] = True
        elif self.shards is not None:
            self.replica.update(lr, s.step + 1, s.cursor.samples_seen + batch.size)
            s.step += 1
        else:
            engine.apply(lr)
            s.step += 1
        if scaling:
            record["loss_scale"] = s.loss_scale
            s.loss_scale, s.loss_scale_good_steps = loss_scale.next_scale(s.loss_scale, s.loss_scale_good_steps,
                                                                         verdict.overflow)
        # Committed: from here on this worker's state includes the step.
        self._agreed = agreed
        s.cursor.samples_in_epoch = batch.end
        s.cursor.samples_seen += batch.size
        record.update(step=s.step, loss=loss, lr=lr, samples_seen=s.cursor.samples_seen, world_size=self.world,
                      generation=self.generation, micro_step=s.micro_step, global_batch=batch.size, time=time.time())
        record.update(metric_values)
        if verdict.grad_norm is not None:
            record["grad_norm"] = verdict.grad_norm
        s.last_metrics = record
        self.step_log.committed(record)
        if self.shards is not None:
            # After the commit: a member failing here leaves the step applied to every range held, and
            # the recovery rebuilds the parameters from them.
            self.replica.gather()
        return record

    # ------------------------------------------------------------------ membership
    def _entered_generation(self) -> None:
        """After joining or regrouping: the process context, and the log's new owner."""
        if self.rank == 0 and self.generation > 0:
            self.run_log.take_over()  # a rank 0 that left may have logged steps this worker has not
        _context.rank, _context.world_size, _context.generation = self.rank, self.world, self.generation
        if self.shards is not None:  # scripts/bench_shard.py reads this line from each worker's log
            log.info("sharded optimizer state: %d bytes in %d range(s) (replicated: %d) at world %d",
                     self.shards.slot_bytes(), len(self.shards.held),
                     4 * self.shards.n * len(self.shards.slot_names), self.world)

    def _memory(self) -> Dict[str, float]:
        """Resident MiB of each worker, by worker id, for rank 0's step records (TensorBoard's memory/)."""
        m = self.membership
        if m is not None and m.memory:
            return {str(k): v for k, v in m.memory.items()}  # gathered by rank 0's membership thread
        read_at, mib = self._own_memory
        if time.monotonic() - read_at > 2.0:  # a /proc read: not on every logged step
            mib = round(rss_mib(), 1)
            self._own_memory = (time.monotonic(), mib)
        return {str(self.replica.worker_id or 0): mib}

    def _recover(self, failure: Optional[str], attempt: Tuple[float, float] = (0.0, 0.0)) -> float:
        """Regroup after a failed collective (``failure``: what failed) or an agreed membership change.

        ``attempt``: (compute, blocked) seconds of the step attempt the failure ended. Returns the
        seconds the recovery took.
        """
        s = self.state
        self.step_log.flush()  # while this worker is still the rank 0 that committed the step
        if failure is not None:
            log.warning("worker step %d: %s; rebuilding", s.step + 1, failure)
        before, before_step = s.cursor.samples_seen, s.step
        r = self.replica.recover(failure, before)
        # Rolled forward: a member had committed the attempt's step, so its compute was kept, not redone.
        redone_s = 0.0 if r.rolled_forward else attempt[0]
        self.meter.lose(redone_s + attempt[1] + r.recovery_s)
        if r.stop == "removed":
            log.info("worker %s retired by the agent (%s)", self.replica.worker_id, r.stop_reason)
            raise ElasticFlowError(f"worker {self.replica.worker_id} retired: {r.stop_reason}", "",
                                   exit_code=protocol.EXIT_REMOVED)
        if r.stop == "agent_lost":
            self.save_checkpoint(f"step_{s.step}")
            raise ElasticFlowError(f"the agent (job master) is gone: {r.stop_reason}",
                                   "rerun the same command: resume=auto continues from the newest checkpoint",
                                   exit_code=protocol.EXIT_AGENT_LOST)
        self._entered_generation()
        if self.rank == 0:
            self.step_log.rewrite(s.last_metrics)  # the records a rank 0 that left may not have written
            reason = failure or "membership change at a step boundary"
            self.run_log.event("regrouped" if failure is None else "recovered", generation=self.generation,
                               previous_generation=r.previous_generation, world_size=self.world,
                               previous_world_size=r.previous_world, reason=reason.splitlines()[0][:200],
                               recovery_s=round(r.recovery_s, 4), transfer_s=round(r.transfer_s, 4),
                               redone_s=round(redone_s, 4), detect_s=round(attempt[1], 4),
                               rolled_forward=r.rolled_forward,
                               **({"shard_elements_moved": self.replica.shard_moved} if self.shards else {}),
                               # An unplanned failure interrupts one step, which the members redo -- unless
                               # one of them had committed it and the rest adopted its state (rolled forward).
                               steps_redone=0 if failure is None or r.rolled_forward else 1,
                               samples_adopted=s.cursor.samples_seen - before, step=s.step)
        if self.replica.lost:
            self._fall_back(before_step)
        if r.stop == "below_min":
            self.save_checkpoint(f"step_{s.step}")
            raise ElasticFlowError(f"{r.stop_reason}; checkpoint written",
                                   "resume with the same command (resume=auto), or lower launcher.min_workers",
                                   exit_code=protocol.EXIT_BELOW_MIN)
        return r.recovery_s

    def _fall_back(self, step_before: int) -> None:
        """Sharded state with a range nobody holds (its owner and its buddy both gone): every member loads
        the newest checkpoint they all see and takes its own ranges from it; the steps since are redone."""
        lost = ", ".join(f"[{a}, {b})" for a, b in self.replica.lost)
        self.replica.lost = []
        found = self.checkpoints.by_step()
        try:
            step = self.replica.agree_min(max(found, default=-1))
        except CommError as exc:
            failure = str(exc)
        else:
            failure = None
        if failure is not None:  # recovered out of the except block: see train_step
            self._recover(failure)
            return
        if step < 0 or step not in found:
            raise ElasticFlowError(f"the sharded optimizer state of range(s) {lost} was lost with its owner and "
                                   "its buddy, and there is no checkpoint to fall back to",
                                   "set checkpoint.interval.steps so a lost slice costs only the steps since")
        self.checkpoints.load(found[step])
        self.shards.keep_local(self.rank, self.world)
        redone = step_before - self.state.step
        log.warning("sharded state of range(s) %s lost with its owner and buddy: fell back to checkpoint %s "
                    "(step %d), redoing %d step(s)", lost, found[step], step, redone)
        if self.rank == 0:
            self.run_log.event("fell_back", checkpoint=str(found[step]), step=step, steps_redone=redone,
                               lost=lost, generation=self.generation, world_size=self.world)

    # ------------------------------------------------------------------ evaluation, checkpoints, end
    def evaluate(self) -> Dict[str, float]:
        """Mean loss and metrics over eval_data(), logged as eval_<name>; each worker evaluates a share."""
        if self.evaluation is None:
            return {}
        self.step_log.flush()  # the step's record before the evaluation's, as the steps were run
        started, recovering = time.perf_counter(), 0.0
        while True:
            try:
                self.last_eval = self.evaluation.run(self.engine, self.replica)
                break
            except CommError as exc:
                failure = str(exc)
            recovering += self._recover(failure)  # out of the except block (see train_step); its own cost
        seconds = time.perf_counter() - started - recovering
        self.meter.lose(seconds)
        if self.rank == 0:
            self.run_log.eval({"step": self.state.step, "epoch": self.state.cursor.epoch, **self.last_eval,
                               "evaluation_s": round(seconds, 4), "time": time.time()})
            log.info("eval at step %d: %s", self.state.step,
                     " ".join(f"{k}={v:.4g}" for k, v in self.last_eval.items()))
        return self.last_eval

    def save_checkpoint(self, name: str, wait: bool = True) -> Optional[Path]:
        """Save the state as checkpoint ``name`` (see ``CheckpointManager.save``); its path on rank 0."""
        self.step_log.flush()
        started = time.perf_counter()
        self.state.last_saved_step = self.state.step
        path = self.checkpoints.save(name, self.replica, wait=wait)
        self._stalled(name, time.perf_counter() - started, wait)
        return path

    def _stalled(self, name: str, seconds: float, wait: bool) -> None:
        """Training stood still ``seconds`` for checkpoint ``name`` (one event line per save)."""
        self.meter.lose(seconds)
        if self.rank == 0:
            self.run_log.event("checkpoint", name=name, step=self.state.step, stall_s=round(seconds, 4), wait=wait)

    def _trained(self, outcome: str) -> None:
        """The loop's end (the ledger's ``trained``): the productive seconds not yet on a logged step."""
        if self.rank == 0 and self.meter.started:
            self.run_log.event("trained", step=self.state.step, train_s=round(self.meter.flush(), 4), outcome=outcome)

    def load_checkpoint(self, path: Path) -> None:
        """Load checkpoint ``path`` (written by any number of workers, on either backend)."""
        self.checkpoints.load(Path(path))
        self.resumed_from = str(path)

    def finish(self) -> Dict[str, Any]:
        """Evaluate (if eval_data exists and the last step was not just evaluated) and write the final checkpoint."""
        s, ev = self.state, self.tcfg.eval_every
        self.step_log.flush()
        self.prefetch.close()  # your own loop (README) ends here, not in fit(): no readers left behind
        if self.evaluation is not None and not (self.last_eval and ev and s.step % ev == 0):
            self.evaluate()
        final, started = None, time.perf_counter()
        if s.last_saved_step != s.step:
            s.last_saved_step = s.step
            final = self.checkpoints.save(f"step_{s.step}", self.replica)
        # An interval save may still be in flight; a failed background write is raised here.
        final = self.checkpoints.close() or final
        self._stalled(f"step_{s.step}" if final else "in flight", time.perf_counter() - started, True)
        self._trained("finished")
        self.run_log.close()
        return {"step": s.step, "epochs_completed": s.epochs_completed, "samples_seen": s.cursor.samples_seen,
                "loss": s.last_metrics.get("loss"), **self.last_eval,
                "checkpoint": str(final or self.checkpoints.latest() or "")}
