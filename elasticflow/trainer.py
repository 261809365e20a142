"""ElasticTrainer: the train loop, one step function, gradient accumulation, logging, checkpoints.

Counters, never mixed: ``step`` counts optimizer steps, ``micro_step`` counts micro-batches,
``cursor.samples_seen`` counts samples consumed, ``generation`` counts membership changes.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import numpy as np
from omegaconf import OmegaConf

from . import checkpoint as ckpt
from . import data, ops, optim
from . import replica
from .config import TrainerConfig, compose, validate
from .distributed import protocol
from .distributed.protocol import CommError
from .errors import CheckpointMismatch, ElasticFlowError, TrainingInterrupted
from .modelfile import ModelFile, load as load_model_file
from .reporting import MetricsWriter, Progress, banner, last_logged_step, step_line

log = logging.getLogger("elasticflow")


@dataclass
class Context:
    """Where training is right now, for data sources and logging hooks (``elasticflow.context()``).

    ``step`` is the optimizer step being computed (completed steps + 1 inside a train step).
    """
    rank: int = 0
    world_size: int = 1
    generation: int = 0
    step: int = 0
    epoch: int = 0


_context = Context()


def context() -> Context:
    """The calling process's current rank, world size, generation, step and epoch."""
    return _context


class CheckpointInterval:
    """When to save: every ``steps`` optimizer steps or every ``epochs`` epochs (not both).

    Example:
        >>> CheckpointInterval(steps=100).should_save(current_step=200)
        True
    """

    def __init__(self, steps: Optional[int] = None, epochs: Optional[int] = None):
        if steps and epochs:
            raise ValueError("Only one of 'steps' or 'epochs' should be set.")
        self.steps = steps
        self.epochs = epochs

    def should_save(self, current_step: Optional[int] = None, current_epoch: Optional[int] = None) -> bool:
        if self.steps and current_step and current_step % self.steps == 0:
            return True
        if self.epochs and current_epoch and current_epoch % self.epochs == 0:
            return True
        return False


@dataclass
class GlobalBatch:
    """Positions [start, end) of one global batch in the epoch's permutation."""
    epoch: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


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
        self.model_file = model if isinstance(model, ModelFile) else None
        self.cfg = cfg if cfg is not None else compose(str(model))
        validate(self.cfg)
        # The loop reads these settings several times a step, and one OmegaConf attribute read costs
        # 40-100 us (it walks the parent chain for flags and interpolations): ten a step nearly doubled
        # the step time of models/digits_mlp.py. A plain dataclass copy, taken once, costs nothing to read.
        self.tcfg = TrainerConfig(**OmegaConf.to_container(self.cfg.trainer, resolve=True))
        iv = self.cfg.checkpoint.interval
        self.interval = checkpoint_interval or CheckpointInterval(steps=iv.steps, epochs=iv.epochs)
        self.run_dir = Path(run_dir or ".").resolve()
        self.ckpt_dir = Path(self.cfg.checkpoint.dir).expanduser() if self.cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.membership = membership
        # A worker has no rank until it enters a generation (-1 keeps it from logging before that).
        self.rank, self.world, self.generation = (0 if membership is None else -1), 1, 0
        self.metric_names: list = []
        self.progress: Optional[Progress] = None  # fit()'s bar; None in a custom loop
        self._pending: Dict[str, bool] = {}
        self._writer: Optional[MetricsWriter] = None
        self._written_step = -1
        self.step_count = 0          # optimizer steps completed
        self.micro_step = 0          # micro-batches processed
        self.skipped_steps = 0       # steps dropped by trainer.on_nonfinite=skip
        self.epochs_completed = 0
        self.cursor = data.Cursor()
        self.last_metrics: Dict[str, Any] = {}
        self.last_eval: Dict[str, float] = {}
        self.last_saved_step: Optional[int] = None
        self.resumed_from: Optional[str] = None
        self._interrupt_requested = False
        self._prepared = False

    # ------------------------------------------------------------------ setup
    def prepare(self) -> "ElasticTrainer":
        """Resolve the backend, build parameters and optimizer, load data, resume if a checkpoint exists."""
        cfg = self.cfg
        t = cfg.trainer
        # The backend is resolved once, before anything imports a framework.
        ops.use(cfg.backend.name)
        self.backend = ops._impl
        threads = cfg.backend.threads or max(1, (os.cpu_count() or 1) // max(1, self.local_workers()))
        self.backend.setup(threads, cfg.seed)
        np.random.seed(cfg.seed)
        if self.model_file is None:
            self.model_file = load_model_file(cfg.model)
        mf = self.model_file

        built = mf.call("model", cfg)
        spec = optim.from_config(cfg.optimizer)
        self.optimizer_from_model = False
        if isinstance(built, dict) and "optimizer" in built:
            built = dict(built)
            spec = built.pop("optimizer")
            if not isinstance(spec, optim.OptimizerSpec):
                raise ElasticFlowError(f"model()['optimizer'] is a {type(spec).__name__}, not an optimizer spec",
                                       "use elasticflow.optim.SGD(lr), Adam(lr) or AdamW(lr)")
            self.optimizer_from_model = True
        foreign = self.backend.native_kind(built)
        if foreign:
            raise ElasticFlowError(f"model() returned {foreign}, which backend={self.backend.NAME} cannot train",
                                   "run it with the backend it was written for, or return a dict of arrays "
                                   "to run on every backend")
        if not isinstance(built, dict) and not self.backend.is_native(built):
            raise ElasticFlowError(f"model() returned a {type(built).__name__}; expected a dict of named parameters "
                                   f"or a native {self.backend.NAME} model", "return e.g. {'W': np.zeros((4, 2))}")
        self.spec = spec
        self.engine = self.backend.Engine(built, mf.forward, spec, jit=cfg.backend.jit)

        self.dataset = data.Dataset(mf.call("data", cfg), "data()")
        data.check_size(len(self.dataset), t.global_batch_size)
        self.resident = self.backend.resident(self.dataset.arrays) if self.dataset.arrays is not None else None
        self.eval_dataset = None
        if mf.eval_data is not None:
            self.eval_dataset = data.Dataset(mf.call("eval_data", cfg), "eval_data()")
        self.steps_per_epoch = data.steps_per_epoch(len(self.dataset), t.global_batch_size, t.drop_last)
        self.max_epochs = t.epochs if t.epochs is not None else (None if t.max_steps else 1)
        horizon = [x for x in (t.max_steps, self.max_epochs and self.max_epochs * self.steps_per_epoch) if x]
        self.total_steps: Optional[int] = min(horizon) if horizon else None

        self.checkpointer = ckpt.Checkpointer.for_run(self.ckpt_dir, cfg, self.run_dir, self.membership)
        self._resume()
        self.metric_names = self._probe_metric_names()
        if self.membership is not None:
            ready_at = time.time()
            self.membership.join()
            joined_at = time.time()
            self._adopt_membership()
            moved = self._sync_state()
            if self.generation > 0 or moved:  # joined a running job: say what it cost
                spawned = float(os.environ.get("ELASTICFLOW_SPAWNED_AT", ready_at))
                self.event("joined", worker=self.membership.worker_id, generation=self.generation,
                           world_size=self.world, start_s=round(ready_at - spawned, 4),
                           admit_s=round(self.membership.admitted_at - ready_at, 4),
                           rebuild_s=round(joined_at - self.membership.admitted_at, 4),
                           transfer_s=round(time.time() - joined_at, 4), state_received=bool(moved))
        self.checkpointer.reserve(self._checkpoint_state(), self.rank, self.world)
        self._order_epoch = -1
        self._prepared = True
        if self.rank == 0:
            log.info(banner(backend=self.backend.NAME, world=self.world, global_batch=t.global_batch_size,
                            micro=t.micro_batch_size, optimizer=optim.describe(spec)
                            + (" (from the model file)" if self.optimizer_from_model else ""),
                            samples=len(self.dataset), steps_per_epoch=self.steps_per_epoch,
                            total_steps=self.total_steps, run_dir=self.run_dir, resumed=self.resumed_from))
        return self

    def local_workers(self) -> int:
        return int(os.environ.get("ELASTICFLOW_LOCAL_WORKERS", "1"))

    def _probe_metric_names(self) -> list:
        """forward() on two samples, once: checks its output early and fixes the metric order
        every worker reduces in (a worker with an empty share still sends zeros for each)."""
        batch = self._rows(self.dataset, self.resident, np.arange(min(2, len(self.dataset))))
        self.engine.train_mode(False)
        try:
            return sorted(k for k in self.engine.evaluate(batch) if k != "loss")
        finally:
            self.engine.train_mode(True)

    @property
    def metrics(self) -> Optional[MetricsWriter]:
        """RUN_DIR/metrics.jsonl, written by whichever worker is rank 0 now."""
        if self.rank != 0:
            return None
        if self._writer is None:
            self._writer = MetricsWriter(self.run_dir / "metrics.jsonl")
        return self._writer

    def event(self, kind: str, **fields) -> None:
        """Append a membership event to RUN_DIR/events.jsonl (the agent writes there too)."""
        import json

        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "event": kind, "source": "worker", **fields}) + "\n")

    def _log_record(self, record: Dict[str, Any]) -> None:
        writer = self.metrics
        if writer is None or record.get("step", -1) <= self._written_step:
            return
        writer.write(record)
        self._written_step = record["step"]

    def _resume(self) -> None:
        mode = str(self.cfg.resume)
        if mode == "none":
            return
        if mode == "auto":  # this job's checkpoints, newest first
            candidates = list(reversed(ckpt.complete_checkpoints(self.checkpointer.job_dir)))
            for path in candidates:
                try:
                    self.load_checkpoint(path)
                    return
                except CheckpointMismatch:
                    raise  # starting fresh would silently discard this job's training
                except ElasticFlowError as exc:
                    log.warning("skipping checkpoint %s: %s; falling back to the previous one", path, exc.message)
            return
        # resume=PATH: a checkpoint, or a job dir / checkpoint.dir (its newest complete checkpoint)
        self.load_checkpoint(ckpt.resolve(Path(mode).expanduser()))

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Dict[str, Any]:
        """Prepare (if needed), train to the configured end, evaluate, write the final checkpoint."""
        if not self._prepared:
            self.prepare()
        restore = self._install_sigint()
        self.progress = Progress(self.tcfg.progress if self.rank == 0 else False,
                                 self.total_steps, self.step_count)
        try:
            for epoch in self.epoch_range():
                with self.epoch(epoch):
                    for batch in self.batches():
                        with self.step():
                            self.train_step(batch)
        finally:
            self.progress.close()
            restore()
        return self.finish()

    def epoch_range(self) -> Iterator[int]:
        """Epochs still to train, starting at the data cursor's epoch."""
        epoch = self.cursor.epoch
        while not self.done and (self.max_epochs is None or epoch < self.max_epochs):
            yield epoch
            epoch = self.cursor.epoch

    @property
    def done(self) -> bool:
        t = self.tcfg
        if t.max_steps is not None and self.step_count >= t.max_steps:
            return True
        return self.max_epochs is not None and self.cursor.epoch >= self.max_epochs

    @contextmanager
    def epoch(self, epoch: int):
        """Before: fix the epoch's global sample order. After: advance the cursor, maybe checkpoint."""
        if epoch != self.cursor.epoch:
            raise ValueError(f"epoch({epoch}) called while the data cursor is at epoch {self.cursor.epoch}")
        self._order = data.permutation(len(self.dataset), self.cfg.seed, epoch)
        self._order_epoch = epoch
        yield
        # A recovery may have rolled this worker forward into the next epoch already.
        if self.cursor.epoch == epoch and self.cursor.samples_in_epoch >= self._epoch_samples():
            self.cursor.epoch += 1
            self.cursor.samples_in_epoch = 0
            self.epochs_completed = self.cursor.epoch
            if self.interval.should_save(current_epoch=self.epochs_completed):
                self.save_checkpoint(f"epoch_{self.epochs_completed}", wait=False)

    def _epoch_samples(self) -> int:
        n, b = len(self.dataset), self.tcfg.global_batch_size
        return (n // b) * b if self.tcfg.drop_last else n

    def batches(self) -> Iterator[GlobalBatch]:
        """The epoch's remaining global batches, from the data cursor; stops at max_steps."""
        b = self.tcfg.global_batch_size
        end_of_epoch = self._epoch_samples()
        epoch = self.cursor.epoch
        while self.cursor.epoch == epoch and self.cursor.samples_in_epoch < end_of_epoch and not self.done:
            start = self.cursor.samples_in_epoch
            yield GlobalBatch(self.cursor.epoch, start, min(start + b, end_of_epoch))

    @contextmanager
    def step(self):
        """Around one train_step: time it, then log, checkpoint on the interval, honour Ctrl-C."""
        started = time.perf_counter()
        yield
        elapsed = time.perf_counter() - started
        m = self.last_metrics
        m["step_time_s"] = elapsed
        if self.rank == 0:
            bar = self.progress
            if self._should_log(m):
                self._log_record(m)
                if bar is None or not bar.active:
                    log.info(step_line(m))
            if bar is not None:
                bar.update(m["loss"], m["global_batch"] / max(elapsed, 1e-9))
        ev = self.tcfg.eval_every
        if ev and self.eval_dataset is not None and self.step_count % ev == 0 and not m.get("skipped"):
            self.evaluate()
        if self.interval.should_save(current_step=self.step_count) and not m.get("skipped"):
            self.save_checkpoint(f"step_{self.step_count}", wait=False)
        self._act_on_agreed_flags()

    def _should_log(self, record: Dict[str, Any]) -> bool:
        return record["step"] % self.tcfg.log_every == 0 or record["step"] == self.total_steps

    def _act_on_agreed_flags(self) -> None:
        """Act, at this step boundary, on what every member agreed on in the step's reduction."""
        pending, self._pending = self._pending, {}
        if self.membership is None:
            pending["interrupt"] = self._interrupt_requested
        if pending.get("interrupt"):
            self.save_checkpoint(f"step_{self.step_count}")
            raise TrainingInterrupted()
        if pending.get("agent_lost"):
            self.save_checkpoint(f"step_{self.step_count}")
            raise ElasticFlowError("the agent (job master) is gone; checkpoint written, worker exiting",
                                   "rerun the same command: resume=auto continues from the checkpoint",
                                   exit_code=protocol.EXIT_AGENT_LOST)
        if pending.get("membership"):
            self._recover("membership change at a step boundary", planned=True)

    # ------------------------------------------------------------------ one step
    def train_step(self, batch: GlobalBatch) -> Dict[str, Any]:
        """Forward and backward over this worker's micro-batches, reduce, clip, apply once.

        When a peer fails mid-step the partial step is discarded, the group rebuilt and the same
        global batch re-split over the survivors -- unless a survivor had already committed it, in
        which case its state is adopted (``replica.sync_state``) and nothing is redone.
        """
        while True:
            try:
                return self._attempt(batch)
            except CommError as exc:
                self._recover(str(exc))
                c = self.cursor
                if c.epoch > batch.epoch or c.samples_in_epoch >= batch.end:
                    return self.last_metrics

    def _attempt(self, batch: GlobalBatch) -> Dict[str, Any]:
        t = self.tcfg
        engine = self.engine
        _context.step, _context.epoch = self.step_count + 1, batch.epoch
        lo, hi = data.worker_share((batch.start, batch.end), self.rank, self.world)
        engine.train_mode(True)
        engine.zero_grad()
        loss_sum, metric_sums = None, {}
        for a, b in data.micro_batches(lo, hi, t.micro_batch_size):
            loss_w, metrics_w = engine.accumulate(self._fetch(a, b), (b - a) / batch.size)
            if loss_sum is None:  # the first (often only) micro-batch: no tensor additions
                loss_sum, metric_sums = loss_w, dict(metrics_w)
            else:
                loss_sum = loss_sum + loss_w
                for k, v in metrics_w.items():
                    metric_sums[k] = metric_sums.get(k, 0.0) + v
            self.micro_step += 1
        loss_sum = 0.0 if loss_sum is None else loss_sum  # an empty share (more workers than samples)
        # float(): a sync point on accelerators; the non-finite check needs it anyway.
        scalars = [float(loss_sum)] + [float(metric_sums.get(k, 0.0)) for k in self.metric_names]
        scalars, agreed = replica.reduce_step(self, scalars)
        loss, metric_values = scalars[0], dict(zip(self.metric_names, scalars[1:]))

        record: Dict[str, Any] = {"epoch": batch.epoch}
        finite = math.isfinite(loss)
        grad_norm = None
        if finite and t.grad_clip is not None:
            grad_norm = engine.grad_norm()
            finite = math.isfinite(grad_norm)
            if finite and grad_norm > t.grad_clip:
                engine.scale_grad(t.grad_clip / (grad_norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s formula
        lr = optim.lr_at(self.spec, self.step_count, self.total_steps)
        if not finite:
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
            if t.on_nonfinite == "stop":
                raise ElasticFlowError(
                    f"{what} at step {self.step_count + 1} (epoch {batch.epoch}); training stopped, "
                    f"no update applied", "lower optimizer.lr, set trainer.grad_clip, or pass "
                    "trainer.on_nonfinite=skip to skip such steps", exit_code=1)
            self.skipped_steps += 1
            log.warning("%s at step %d; skipping the update (trainer.on_nonfinite=skip)", what, self.step_count + 1)
            record["skipped"] = True
        else:
            engine.apply(lr)
            self.step_count += 1
        # Committed: from here on this worker's state includes the step.
        self._pending = agreed
        self.cursor.samples_in_epoch = batch.end
        self.cursor.samples_seen += batch.size
        record.update(step=self.step_count, loss=loss, lr=lr, samples_seen=self.cursor.samples_seen,
                      world_size=self.world, generation=self.generation, micro_step=self.micro_step,
                      global_batch=batch.size, time=time.time())
        record.update(metric_values)
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        self.last_metrics = record
        return record

    def _fetch(self, a: int, b: int):
        return self._rows(self.dataset, self.resident, self._order[a:b])

    def _rows(self, ds: data.Dataset, resident, positions: np.ndarray):
        """The rows at ``positions`` as backend tensors: gathered from the resident copy of an
        array dataset, or fetched from an indexable one and converted."""
        if resident is not None:
            return self.backend.gather(resident, self.backend.index(positions))
        return tuple(self.backend.to_tensor(x) for x in ds.fetch(positions))

    # ------------------------------------------------------------------ membership
    def _adopt_membership(self) -> None:
        m = self.membership
        if m.rank == 0 and self.rank != 0 and m.generation > 0:
            # Taking over as the logger from a rank 0 that left: it may have logged steps we have not.
            self._written_step = last_logged_step(self.run_dir / "metrics.jsonl")
        self.rank, self.world, self.generation = m.rank, m.world, m.generation
        _context.rank, _context.world_size, _context.generation = m.rank, m.world, m.generation

    def _sync_state(self) -> bool:
        return replica.sync_state(self)

    def _recover(self, reason: str, planned: bool = False) -> None:
        replica.recover(self, reason, planned)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> Dict[str, float]:
        """Mean loss and metrics over eval_data(), logged as eval_<name>; each worker evaluates a share."""
        if self.eval_dataset is None:
            return {}
        while True:
            try:
                return self._evaluate_once()
            except CommError as exc:
                self._recover(str(exc))

    def _evaluate_once(self) -> Dict[str, float]:
        engine, ds = self.engine, self.eval_dataset
        chunk = self.tcfg.micro_batch_size or self.tcfg.global_batch_size
        if not hasattr(self, "_eval_resident"):
            self._eval_resident = self.backend.resident(ds.arrays) if ds.arrays is not None else None
        resident = self._eval_resident
        names = ["loss", *self.metric_names]
        totals = [0.0] * len(names)
        lo, hi = data.worker_share((0, len(ds)), self.rank, self.world)
        engine.train_mode(False)
        try:
            for a in range(lo, hi, chunk):
                positions = np.arange(a, min(a + chunk, hi))
                values = engine.evaluate(self._rows(ds, resident, positions))
                for i, k in enumerate(names):
                    totals[i] += values.get(k, 0.0) * len(positions)
        finally:
            engine.train_mode(True)
        totals = replica.reduce_sum(self, totals)
        self.last_eval = {f"eval_{k}": v / len(ds) for k, v in zip(names, totals)}
        if self.rank == 0:
            self.metrics.write({"step": self.step_count, "epoch": self.cursor.epoch, **self.last_eval})
            log.info("eval at step %d: %s", self.step_count,
                     " ".join(f"{k}={v:.4g}" for k, v in self.last_eval.items()))
        return self.last_eval

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, name: str, wait: bool = True) -> Optional[Path]:
        """Every member writes its 1/W slice of the state; rank 0 commits once all W are on disk.

        ``wait=False`` (the interval saves) returns after an in-memory snapshot when
        ``checkpoint.async``; other saves (final, Ctrl-C, stop, agent lost) return once written,
        since the process may exit next. Returns the checkpoint's path on rank 0.
        """
        rank, world, m = self.rank, self.world, self.membership
        if m is not None and world > 1 and (m.agent_lost or not ckpt.store_alive(m.store)):
            # No store, no coordinated save: the state is replicated, so rank 0 writes all of it.
            if rank != 0:
                return None
            rank, world = 0, 1
        state = self._checkpoint_state()
        info = {"step": self.step_count, "epoch": self.cursor.epoch, "micro_step": self.micro_step,
                "skipped_steps": self.skipped_steps, "cursor": self.cursor.as_dict(), "world_size": self.world,
                "backend": self.backend.NAME, "optimizer": self.spec.name, "seed": self.cfg.seed,
                "global_batch_size": self.tcfg.global_batch_size, "saved_at": time.time(),
                "generation": self.generation, "config_hash": ckpt.config_hash(self.cfg)}
        path = self.checkpointer.save(name, state, info, rank=rank, world=world, generation=self.generation,
                                      wait=wait)
        self.last_saved_step = self.step_count
        return path

    def _checkpoint_state(self) -> Dict[str, np.ndarray]:
        # Views (no copy of the model): the checkpointer copies only this rank's slice.
        state = self.engine.state(copy=False)
        state.update(self.engine.rng_state())
        return state

    def load_checkpoint(self, path: Path) -> None:
        state, meta = ckpt.load_with_metadata(path)
        expected = {n: v.shape for n, v in self.engine.state(copy=False).items()}
        model_names = {n: s for n, s in expected.items() if not n.startswith("optimizer/")}
        found = {n: tuple(v.shape) for n, v in state.items() if not n.startswith(("optimizer/", "rng/"))}
        diffs = list(ckpt.compare_names(model_names, found))
        if diffs:
            shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
            raise CheckpointMismatch(f"checkpoint '{path}' does not match this model: {shown}",
                                     "resume with the model file that wrote it, or pass resume=none to start fresh")
        if meta.get("optimizer") != self.spec.name and any(n.startswith("optimizer/") for n in state):
            raise CheckpointMismatch(f"checkpoint '{path}' holds {meta.get('optimizer')} state but this run uses "
                                     f"{self.spec.name}", "resume with the same optimizer, or pass resume=none")
        self.engine.load_state(state, int(meta["step"]))
        self.engine.set_rng_state(state)
        self.step_count = int(meta["step"])
        self.micro_step = int(meta.get("micro_step", 0))
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.cursor = data.Cursor(**meta["cursor"])
        self.epochs_completed = self.cursor.epoch
        self.last_saved_step = self.step_count
        self.resumed_from = str(path)

    # ------------------------------------------------------------------ end
    def finish(self) -> Dict[str, Any]:
        """Evaluate (if eval_data exists and the last step was not just evaluated) and write the final checkpoint."""
        if self.eval_dataset is not None and not (self.last_eval and self.tcfg.eval_every
                                                  and self.step_count % self.tcfg.eval_every == 0):
            self.evaluate()
        final = None
        if self.last_saved_step != self.step_count:
            final = self.save_checkpoint(f"step_{self.step_count}")
        # An interval save may still be in flight; a failed background write is raised here.
        final = self.checkpointer.close() or final
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        summary = {"step": self.step_count, "epochs_completed": self.epochs_completed,
                   "samples_seen": self.cursor.samples_seen, "loss": self.last_metrics.get("loss"),
                   **self.last_eval, "checkpoint": str(final or ckpt.latest(self.checkpointer.job_dir) or "")}
        return summary

    def _install_sigint(self):
        """First Ctrl-C (or SIGUSR1): finish the step, checkpoint, exit 130. Second Ctrl-C: stop at once."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, frame):
            if self._interrupt_requested:
                raise KeyboardInterrupt
            self._interrupt_requested = True
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            log.warning("%s: finishing the current step, then writing a checkpoint (Ctrl-C again to abort)", what)

        # SIGUSR1 is SLURM's warning before preemption or the time limit: the same orderly stop.
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGUSR1)}
        return lambda: [signal.signal(sig, h) for sig, h in previous.items()]

