"""ElasticTrainer: the train loop. ``fit()`` shows every side effect of a step in order: the step
(``stepper.Stepper``: accumulate, reduce, update, commit), its record, evaluation, save, and acting on what
the members agreed (stop, regroup: ``regroup.Regrouper``). The parts come from ``builder``; each returns
results and never calls back into the loop. Counters, never mixed: ``step`` counts optimizer steps,
``micro_step`` micro-batches, ``cursor.samples_seen`` samples, ``generation`` membership changes.
"""
from __future__ import annotations

import itertools
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np
from omegaconf import OmegaConf

from ._util import affinity
from .train import builder, callbacks, evaluation, model_file
from .config import devices
from .checkpoint import Checkpointer, CheckpointInterval, CheckpointManager
from .config.schema import TrainerConfig, compose
from .data.order import GlobalBatch
from .distributed import protocol
from .errors import ElasticFlowError, TrainingInterrupted
from .observability.goodput import Meter, outcome_of
from ._util.paths import checkpoint_dir
from .train.regroup import Regrouper, collective
from .replica.replica import Agreed, Replica
from .observability.reporting import Progress, RunLog, StepLog, WorkerMemory
from ._util.signals import StopSignal
from ._util.context import context  # noqa: F401 - elasticflow.context()
from .train.state import TrainState

log = logging.getLogger("elasticflow")
__all__ = ["ElasticTrainer", "CheckpointInterval", "GlobalBatch", "context"]


class ElasticTrainer:
    """Trains the model file's ``model()`` with ``forward()`` on ``data()``.

    Args:
        model: path to the model file (or a loaded ``ModelFile``).
        cfg: a config from ``elasticflow.config.schema.compose`` (or Hydra); None composes the defaults.
        checkpoint_interval: overrides ``checkpoint.interval`` from the config.
        run_dir: where metrics.jsonl and checkpoints go (default: the current directory).
        membership: set by the worker process of a multi-worker job (``distributed.membership``).

    Example (your own loop; ``fit()`` is the same calls plus the progress bar):
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
        self.model_file = model if isinstance(model, model_file.ModelFile) else None
        self.cfg = cfg if cfg is not None else compose(str(model))  # compose() and the CLI validate it
        # The loop reads these settings several times a step, and one OmegaConf attribute read costs
        # 40-100 us (it walks the parent chain for flags and interpolations): ten a step nearly doubled
        # the step time of models/digits_mlp.py. A plain dataclass copy, taken once, costs nothing to read.
        self.tcfg = TrainerConfig(**OmegaConf.to_container(self.cfg.trainer, resolve=True))
        iv = self.cfg.checkpoint.interval
        self.interval = checkpoint_interval or CheckpointInterval(steps=iv.steps, epochs=iv.epochs)
        self.run_dir = Path(run_dir or ".").resolve()
        self.ckpt_dir = checkpoint_dir(self.cfg, self.run_dir)
        self.membership = membership
        self.state = TrainState()
        self.run_log = RunLog(self.run_dir, self.tcfg.loggers, config=self.cfg)
        self.stop_signal = StopSignal(console=membership is None)  # with workers, the agent says it once
        self.metric_names: list = []
        self.last_eval: Dict[str, float] = {}
        self.resumed_from: Optional[str] = None
        self.meter = Meter()
        self.step_log = StepLog(self.run_log, self.tcfg.log_every,
                                WorkerMemory(membership, lambda: self.replica.worker_id))
        self._prepared = False

    # Where this worker sits (the replica follows the membership through every regroup).
    rank = property(lambda self: self.replica.rank)
    world = property(lambda self: self.replica.world)
    generation = property(lambda self: self.replica.generation)
    step_count = property(lambda self: self.state.step, doc="optimizer steps completed")

    # ------------------------------------------------------------------ setup
    def prepare(self) -> "ElasticTrainer":
        """Build the parts (backend, model, optimizer, data), resume if a checkpoint exists, join the job."""
        cfg, t = self.cfg, self.tcfg
        p = builder.build(cfg, t, self.model_file)  # the parts the loop reads, each by its name
        self.model_file, self.backend, self.placement, self.spec = p.model_file, p.backend, p.placement, p.spec
        self.local_workers, self.engine, self.reconciler = p.local_workers, p.engine, p.reconciler
        self.shards, self.outer = p.shards, p.outer  # trainer.shard's state; topology=local_sgd|diloco's
        self.source, self.prefetch, self.schedule, self.eval_dataset = p.source, p.prefetch, p.schedule, p.eval_dataset
        self.step_log.built(self.schedule.total_steps, p.trains)
        self.callbacks = callbacks.from_config(cfg, self.model_file)  # before resuming: checkpoints hold their state
        self.replica = Replica(self.membership, self.engine, self.state_dict, self.load_state_dict,
                               cfg.comm.bucket_mb, self.shards)
        if self.membership is not None and self.placement.comm == "nccl":
            self.membership.nccl_device = self.placement.device  # GPU tensors reduce over NCCL from the first group
        self.checkpoints = CheckpointManager(Checkpointer.for_run(self.ckpt_dir, cfg, self.run_dir, self.membership),
                                             cfg, self.spec.name, self.backend.NAME, self.state_dict,
                                             self.load_state_dict, epoch_samples=self.schedule.epoch_samples)
        self.regrouper = Regrouper(self.replica, self.state, self.shards, self.checkpoints, self.run_log,
                                   self.step_log, self.meter, self.save_checkpoint)
        resumed = self.checkpoints.resume()
        self.resumed_from = str(resumed) if resumed else None
        probe = evaluation.probe(self.engine, self.source, self.model_file.check_fields)
        self.metric_names = probe.metric_names
        self.evaluation = None if self.eval_dataset is None else evaluation.Evaluation(
            self.eval_dataset, self.backend, self.metric_names, t.micro_batch_size or t.global_batch_size,
            t.reproducible)
        self.stepper = builder.stepper(p, t, self.state, self.replica, self.step_log,
                                       lambda: self.stop_signal.requested, self.metric_names, probe.weight)
        self.regrouper.join()
        if self.membership is not None:  # once joined: a worker started by srun learns its id on joining
            self.membership.report_device(self.placement.describe())  # for `elasticflow status`
        self.checkpoints.reserve(self.rank, self.world, self.replica.sharding())
        if cfg.backend.pin_cores and self.placement.kind == "cpu":  # last: what started above keeps every core
            affinity.pin_training_thread(devices.local_slot(), self.local_workers)
        self._prepared = True
        self.meter.start()  # from here every second is productive or a measured cost (goodput.py)
        if self.rank == 0:
            self.run_log.event("ready", step=self.state.step, world_size=self.world, resumed_from=self.resumed_from)
            builder.announce(p, cfg, t, self.world, self.run_dir, self.resumed_from, probe.drew)
        self.callbacks.train_start(self)
        return self

    # ------------------------------------------------------------------ the state, for checkpoints and replicas
    def state_dict(self) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        """(arrays, progress): the engine's tensors by name (views: read them before the next update) and
        the TrainState's fields. No generator state: every micro-batch seeds its own (``data.micro_seed``).
        With trainer.shard the optimizer's tensors are this worker's own ranges (``Partial``)."""
        arrays = self.engine.state(copy=False)
        arrays.update(self.shards.partials() if self.shards else self.outer.arrays() if self.outer else {})
        self.state.callbacks = self.callbacks.state_dict()
        return arrays, self.state.state_dict()

    def load_state_dict(self, arrays: Dict[str, np.ndarray], progress: Dict[str, Any]) -> None:
        self.state.load_state_dict(progress)
        self.callbacks.load_state_dict(self.state.callbacks)
        if self.outer is not None:  # DiLoCo's momentum (train/local_sgd.py)
            self.outer.load(arrays)
        if self.shards is None:
            self.engine.load_state(arrays, self.state.step)
        else:  # a checkpoint's whole tensors, or a peer's buffers in a recovery (the ranges came before)
            self.shards.load(self.engine, arrays, self.state.step, self.state.cursor.samples_seen)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Dict[str, Any]:
        """Prepare (if needed), train to the configured end, evaluate, write the final checkpoint."""
        if not self._prepared:
            self.prepare()
        s, t = self.state, self.tcfg
        self.step_log.progress = Progress(t.progress if self.rank == 0 else False, self.schedule.total_steps, s.step)
        try:
            with self.stop_signal.installed():
                for epoch in self.epoch_range():
                    self.begin_epoch(epoch)
                    for batch in self.batches():
                        started = time.perf_counter()
                        self.train_step(batch)
                        self.record_step(time.perf_counter() - started)
                        if self.evaluation_due():
                            self.evaluate()
                        if self.save_due():
                            self.save_checkpoint(f"step_{s.step}", wait=False)
                        self.act_on_agreement()  # stop, or regroup: what every member agreed in the step
                    self.end_epoch(epoch)
        except BaseException as exc:
            self.step_log.flush()  # the last step's record before the loop's end (the ledger's "trained")
            self._trained(outcome_of(exc))
            raise
        finally:
            self.step_log.flush()
            self.step_log.progress.close()
            self.prefetch.close()
        return self.finish()

    def epoch_range(self) -> Iterator[int]:
        """Epochs still to train, starting at the data cursor's epoch (none once a callback's stop is agreed)."""
        return itertools.takewhile(lambda _: not self.callbacks.stopping, self.schedule.epochs(self.state))

    def begin_epoch(self, epoch: int) -> None:
        """Fix the epoch's global sample order."""
        if epoch != self.state.cursor.epoch:
            raise ValueError(f"epoch({epoch}) called while the data cursor is at epoch {self.state.cursor.epoch}")
        self.stepper.order = self.prefetch.order(epoch)

    def end_epoch(self, epoch: int) -> None:
        """Advance the cursor past a finished epoch, and checkpoint on an epoch interval."""
        cursor = self.state.cursor  # a recovery may have adopted another member's cursor ...
        if cursor.epoch == epoch and cursor.samples_in_epoch >= self.schedule.epoch_samples:  # ... in the next epoch
            cursor.epoch += 1
            cursor.samples_in_epoch = 0
            if self.interval.should_save(current_epoch=cursor.epoch):
                self.save_checkpoint(f"epoch_{cursor.epoch}", wait=False)

    def batches(self) -> Iterator[GlobalBatch]:
        """The epoch's remaining global batches, from the data cursor; stops at max_steps, or when a
        callback's stop is agreed (``request_stop``)."""
        return itertools.takewhile(lambda _: not self.callbacks.stopping, self.schedule.batches(self.state))

    def record_step(self, elapsed: float) -> None:
        """The step's record (metrics.jsonl, the console, the progress bar; when: ``reporting.StepLog``)."""
        m = self.state.last_metrics
        m["step_time_s"] = elapsed / m.pop("round_steps", 1)  # a round of steps (train/local_sgd.py): their mean
        if self.step_log.due(m):  # on every rank: a worker that becomes rank 0 goes on from the same logged step
            m["train_s"] = self.meter.flush()  # productive seconds since the previous logged step
        self.callbacks.step_end(self, m)  # before the record is written: keys they add are logged
        self.step_log.ended(m, self.rank, self.world)

    def evaluation_due(self) -> bool:
        ev, s = self.tcfg.eval_every, self.state
        return bool(ev and self.evaluation is not None and s.step % ev == 0 and not s.last_metrics.get("skipped"))

    def save_due(self) -> bool:
        s = self.state
        return (self.interval.should_save(current_step=s.step) and not s.last_metrics.get("skipped")
                and s.last_saved_step != s.step)

    def act_on_agreement(self) -> None:
        """Act, at this step boundary, on what every member agreed on in the step's reduction."""
        agreed, self.stepper.agreed = self.stepper.agreed, Agreed()
        self.stop_signal.announce()
        # A single process needs no vote: it honours a stop asked at any time before the boundary.
        if agreed.interrupt or (self.membership is None and self.stop_signal.requested):
            self.regrouper.checkpoint_and_raise(TrainingInterrupted())
        if agreed.agent_lost:
            self.regrouper.checkpoint_and_raise(ElasticFlowError(
                "the agent (job master) is gone; checkpoint written, worker exiting",
                "rerun the same command: resume=auto continues from the checkpoint",
                exit_code=protocol.EXIT_AGENT_LOST))
        if agreed.membership:
            self.regrouper.regroup(None)
        if agreed.finish:  # a rank-0 callback's request, voted in this step
            self.callbacks.stopping = self.callbacks.stopping or self.callbacks.vote or "a callback on rank 0 asked"

    def request_stop(self, reason: str) -> None:
        """End the run at a step boundary every member agrees on (a callback's early stop): at this one when
        the calling callback runs on every rank, else after the next step (train/callbacks.py). The run then
        finishes as at its end: evaluation, final checkpoint, ``fit()``'s result."""
        self.replica.finish_asked = self.callbacks.request_stop(reason)

    @contextmanager
    def epoch(self, epoch: int):
        """Your own loop's epoch: ``begin_epoch`` before, ``end_epoch`` after."""
        self.begin_epoch(epoch)
        yield
        self.end_epoch(epoch)

    @contextmanager
    def step(self):
        """Your own loop's step, around ``train_step``: after it, what ``fit()`` does after each step
        (record, evaluate and save on their intervals, act on the members' agreement)."""
        started = time.perf_counter()
        yield
        self.record_step(time.perf_counter() - started)
        if self.evaluation_due():
            self.evaluate()
        if self.save_due():
            self.save_checkpoint(f"step_{self.state.step}", wait=False)
        self.act_on_agreement()

    # ------------------------------------------------------------------ one step
    def train_step(self, batch: GlobalBatch) -> Dict[str, Any]:
        """Forward and backward over this worker's micro-batches, reduce, clip, apply once.

        When a peer fails mid-step the partial step is discarded, the group rebuilt and the same
        global batch re-split over the survivors -- unless a survivor had already committed it, in
        which case its state is adopted (``Replica.sync_state``) and nothing is redone.
        """
        while True:
            attempt_started = time.perf_counter()
            record, failure = collective(lambda: self.stepper.attempt(batch))
            if failure is None:
                return record
            # Done (a member had committed it), or a fall back to a checkpoint moved the cursor back.
            if self.regrouper.after_failed_step(batch, failure, attempt_started, self.stepper.reduce_started,
                                                self.reconciler):
                return self.state.last_metrics

    # ------------------------------------------------------------------ evaluation, checkpoints, end
    def evaluate(self) -> Dict[str, float]:
        """Mean loss and metrics over eval_data(), logged as eval_<name>; each worker evaluates a share."""
        if self.evaluation is None:
            return {}
        self.step_log.flush()  # the step's record before the evaluation's, as the steps were run
        started = time.perf_counter()
        self.last_eval, recovering = self.regrouper.until_done(lambda: self.evaluation.run(self.engine, self.replica))
        seconds = time.perf_counter() - started - recovering
        self.meter.lose(seconds)
        if self.rank == 0:
            evaluation.report(self.run_log, self.state, self.last_eval, seconds)
        self.callbacks.call("on_eval_end", self, self.last_eval)
        return self.last_eval

    def save_checkpoint(self, name: str, wait: bool = True) -> Optional[Path]:
        """Save the state as checkpoint ``name`` (see ``CheckpointManager.save``); its path on rank 0."""
        self.step_log.flush()
        started = time.perf_counter()
        self.state.last_saved_step = self.state.step
        path = self.checkpoints.save(name, self.replica, wait=wait)
        self._stalled(name, time.perf_counter() - started, wait)
        self.callbacks.call("on_save", self, name, str(path) if path else None)
        return path

    def _stalled(self, name: str, seconds: float, wait: bool) -> None:
        """Training stood still ``seconds`` for checkpoint ``name`` (one event line per save)."""
        self.meter.lose(seconds)
        if self.rank == 0:
            self.run_log.event("checkpoint", name=name, step=self.state.step, stall_s=round(seconds, 4), wait=wait)

    def _trained(self, outcome: Optional[str]) -> None:
        """The loop's end (the ledger's ``trained``): the productive seconds not yet on a logged step. None: the run
        directory moved (goodput.outcome_of), and no event is written at its path."""
        if outcome is not None and self.rank == 0 and self.meter.started:
            self.run_log.event("trained", step=self.state.step, train_s=round(self.meter.flush(), 4), outcome=outcome)

    def finish(self) -> Dict[str, Any]:
        """Evaluate (if eval_data exists and the last step was not just evaluated) and write the final checkpoint."""
        s, ev = self.state, self.tcfg.eval_every
        self.step_log.flush()
        if self.callbacks.stopping and self.rank == 0:
            self.run_log.event("stopped_early", step=s.step, reason=self.callbacks.stopping)
            log.info("stopping at step %d: %s", s.step, self.callbacks.stopping)
        self.prefetch.close()  # your own loop (docs/own-loop.md) ends here, not in fit(): no readers left behind
        if self.evaluation is not None and not (self.last_eval and ev and s.step % ev == 0):
            self.evaluate()
        final, started = None, time.perf_counter()
        if s.last_saved_step != s.step:
            s.last_saved_step = s.step
            final = self.checkpoints.save(f"step_{s.step}", self.replica)
        # An interval save may still be in flight; a failed background write is raised here.
        final = self.checkpoints.close() or final
        self.checkpoints.require_final(final, s.step, self.rank)  # the trained state on disk, or the run fails
        self._stalled(f"step_{s.step}" if final else "in flight", time.perf_counter() - started, True)
        self._trained("finished")
        result = {"step": s.step, "epochs_completed": s.epochs_completed, "samples_seen": s.cursor.samples_seen,
                  "loss": s.last_metrics.get("loss"), **self.last_eval,
                  "checkpoint": str(final or self.checkpoints.latest() or "")}
        self.callbacks.train_end(self, result)
        self.run_log.close()
        return result
