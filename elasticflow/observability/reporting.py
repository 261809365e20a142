"""What the user sees and what tests read: the run log (metrics.jsonl, events.jsonl), the progress bar,
the banner, log lines."""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..data.order import deal, split_evenly
from .._util import untrusted
from .._util.fileio import append_event, open_append, write_atomic
from .._util.memory import rss_mib  # also re-exported: the trainer reads it from here

log = logging.getLogger("elasticflow")
PACE_LINES = 5  # the step lines whose intervals the ETA averages (StepLog._pace)
OPTIMIZER = "optimizer.json"  # RUN_DIR/.elasticflow/optimizer.json: the optimizer that trains (RunLog.trains_with)
SCHEDULE = "schedule.json"  # RUN_DIR/.elasticflow/schedule.json: {"total_steps": N}, this job's last step (status)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the line parseable
    return value


def last_logged_step(path: Path, field: str = "step") -> int:
    """The highest training step already in metrics.jsonl (-1 if none); a torn last line is ignored.

    ``field="samples_seen"``: the samples of that record instead (it also moves on a skipped step).
    """
    if not path.is_file():
        return -1
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 65536))
        tail = f.read().decode(errors="replace").splitlines()
    for line in reversed(tail):
        try:
            record = untrusted.loads(line, max_bytes=1 << 20)
            if isinstance(record, dict) and "loss" in record and field in record:
                return int(record[field])
        except (ValueError, TypeError, OverflowError):  # a torn line, or a crafted one
            continue
    return -1


class MetricsWriter:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl (appends across resumes)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open_append(path, buffering=1)
        if path.stat().st_size:  # a writer killed mid-line must not glue its torn line to ours
            with open(path, "rb") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    self._file.write("\n")

    def write(self, record: Dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        self._file.close()


class RunLog:
    """RUN_DIR/metrics.jsonl (one record per logged step and per evaluation, written by rank 0) and
    RUN_DIR/events.jsonl (membership events; the agent appends there too).

    Each step is written once, even across a change of rank 0: a new logger first reads the last step
    already in the file (``take_over``).
    """

    def __init__(self, run_dir: Path, loggers: Sequence[str] = (), config: Any = None):
        self.run_dir = run_dir
        self._writer: Optional[MetricsWriter] = None
        self._written = -1  # samples_seen of the newest record in metrics.jsonl
        self._board = None
        self.optimizer: Dict[str, Any] = {}  # optim.summary of the optimizer that trains (trains_with)
        self.total_steps: Optional[int] = None  # the schedule's last step, left for `status` (SCHEDULE)
        self._said_optimizer = False
        if loggers:
            from .sidecar import Sidecar

            # a process that follows metrics.jsonl and events.jsonl into the trackers, started by rank 0
            self._board = Sidecar(run_dir, list(loggers), config)

    def _metrics(self) -> MetricsWriter:
        if self._writer is None:
            self._writer = MetricsWriter(self.run_dir / "metrics.jsonl")
        return self._writer

    def trains_with(self, optimizer: Dict[str, Any]) -> None:
        """The optimizer, lr and schedule that train (``optim.summary``), once built: the trackers record them in
        place of the config's ``optimizer.*``, and rank 0 leaves them for `elasticflow status`
        (RUN_DIR/.elasticflow/optimizer.json, ``OPTIMIZER``)."""
        self.optimizer = dict(optimizer)
        if self._board is not None:
            self._board.optimizer = self.optimizer

    def take_over(self) -> None:
        """This worker became rank 0 in place of one that left: it may have logged steps we have not."""
        self._written = max(self._written, last_logged_step(self.run_dir / "metrics.jsonl", "samples_seen"))

    def step(self, record: Dict[str, Any]) -> None:
        """Append a training step's record, unless that step is in the file already.

        A step is known by its samples_seen, not its step number: a skipped step (an overflow, a
        non-finite loss) keeps the step number of the one before it, and is logged too.
        """
        if record.get("samples_seen", -1) <= self._written:
            return
        self._metrics().write(record)
        self._written = record["samples_seen"]
        if not self._said_optimizer:  # rank 0's first record: once a job
            self._said_optimizer = True
            (self.run_dir / ".elasticflow").mkdir(parents=True, exist_ok=True)
            if self.optimizer:
                write_atomic(self.run_dir / ".elasticflow" / OPTIMIZER, json.dumps(self.optimizer, default=str))
            if self.total_steps:
                write_atomic(self.run_dir / ".elasticflow" / SCHEDULE, json.dumps({"total_steps": self.total_steps}))
        if self._board is not None and self._board.proc is None:
            self._board.start()

    def eval(self, record: Dict[str, Any]) -> None:
        self._metrics().write(record)

    def event(self, kind: str, **fields: Any) -> None:
        append_event(self.run_dir / "events.jsonl", kind, "worker", **fields)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._board is not None:
            self._board.close()


class Progress:
    """A tqdm bar over optimizer steps (step, ETA, loss, samples/s, workers, generation); silent when disabled."""

    def __init__(self, enabled: Optional[bool], total: Optional[int], initial: int):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)
            # tqdm reads the size at every refresh and draws nothing on a terminal that reports 0x0 (a `docker
            # exec -t` or CI pseudo-terminal with no size): the run went silent. Read it as 80x20.
            size = getattr(self.bar, "dynamic_ncols", None)
            if callable(size):
                self.bar.dynamic_ncols = lambda fp: _some_width(size(fp))
                self.bar.ncols, self.bar.nrows = _some_width((self.bar.ncols, self.bar.nrows))  # as read at start
                self.bar.refresh()

    @property
    def active(self) -> bool:
        return self.bar is not None

    def update(self, loss: float, samples_per_s: float, world: int = 1, generation: int = 0) -> None:
        """One optimizer step; the bar shows the loss, samples/s, the workers and the membership
        generation (tqdm adds the ETA from the steps left)."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4g}", samples_s=f"{samples_per_s:,.0f}", workers=world,
                                 gen=generation, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StepLog:
    """Rank 0's step records (metrics.jsonl, the console, the progress bar), written while no peer waits.

    Every member waits at the next reduction for the last one to arrive, so rank 0's bookkeeping between
    steps held all of them up (~0.15 ms a logged step on 2 cores, a third of the digits MLP's compute).
    With more than one worker rank 0 keeps a step's record (``ended``) and writes it while the next step's
    reduction is in flight (``flush``), or before an evaluation, a checkpoint, a regroup or the loop's end,
    whichever comes first; the record's ``time`` is still the step's end.

    Note: rank 0 writes step N's record after its part of step N+1's reduction is sent, so a rank 0 that
    dies in between leaves the others to commit N+1 with N unwritten. Every rank keeps the records of
    the last two steps it committed, and a new rank 0 writes them (``rewrite``; RunLog skips those there).
    """

    def __init__(self, run_log: RunLog, log_every: int, memory: Callable[[], Dict[str, float]]):
        self.run_log, self.log_every, self.memory = run_log, log_every, memory
        self.total_steps: Optional[int] = None  # the schedule's last step, always logged (once it is known)
        self.progress: Optional[Progress] = None  # fit()'s bar; None in a custom loop
        self._deferred: Optional[Dict[str, Any]] = None
        self._recent: deque = deque(maxlen=2)
        self._shown: deque = deque(maxlen=PACE_LINES + 1)  # (step, time, samples_seen) of the last step lines

    def built(self, total_steps: Optional[int], optimizer: Dict[str, Any]) -> None:
        """What the logs learn once the run's parts are built: the schedule's last step, and the optimizer that
        trains (``optim.summary``: ``RunLog.trains_with``)."""
        self.total_steps = self.run_log.total_steps = total_steps
        self.run_log.trains_with(optimizer)

    def due(self, record: Dict[str, Any]) -> bool:
        """Whether ``record``'s step is written to metrics.jsonl (every ``log_every`` steps, and the last)."""
        return record["step"] % self.log_every == 0 or record["step"] == self.total_steps

    def committed(self, record: Dict[str, Any]) -> None:
        """Every rank, as a step commits: its record, for a ``rewrite`` should this worker become rank 0."""
        self._recent.append(record)

    def ended(self, record: Dict[str, Any], rank: int, world: int) -> None:
        """Rank 0, when the step's bookkeeping is done: write it now (one worker) or at the next ``flush``."""
        if rank == 0:
            if world > 1:
                self._deferred = record
            else:
                self._write(record)

    def write_now(self, record: Dict[str, Any]) -> None:
        """Rank 0: write ``record`` at once (a step committed inside a round of steps, train/local_sgd.py)."""
        self._write(record)

    def flush(self) -> None:
        """Write the record ``ended`` kept, if any."""
        if self._deferred is not None:
            record, self._deferred = self._deferred, None
            self._write(record)

    def rewrite(self, adopted: Dict[str, Any]) -> None:
        """This worker is rank 0 after a regroup: the records a rank 0 that left may not have written, in
        order -- the steps this worker committed and ``adopted``, the newest (from a member, if rolled forward)."""
        records = {r["samples_seen"]: r for r in (*self._recent, adopted) if r}
        for _, record in sorted(records.items()):
            if self.due(record):
                self.run_log.step(record)

    def _write(self, record: Dict[str, Any]) -> None:
        bar = self.progress
        if self.due(record):
            self.run_log.step({**record, "memory_mib": self.memory()})
            if bar is None or not bar.active:
                log.info(step_line(record, *self._pace(record), total=self.total_steps))
        if bar is not None:
            bar.update(record["loss"], record["global_batch"] / max(record["step_time_s"], 1e-9),
                       record["world_size"], record["generation"])


    def _pace(self, record: Dict[str, Any]) -> Tuple[Optional[float], Optional[float], Optional[float]]:
        """(seconds per step since the previous step line, samples/s over that interval, seconds per step over
        the last ``PACE_LINES`` lines: the ETA's), all None for this process's first line.

        The interval's mean, not one step's own time: that hid a 10-step interval of 1.6 s behind "3.6 ms". The
        ETA's window is longer, so that one slow interval (an evaluation, a checkpoint) does not swing it, and
        short enough to follow a change of the number of workers."""
        t = record.get("time")
        if t is None:
            return None, None, None
        shown = self._shown
        if shown and record["step"] <= shown[-1][0]:  # a step line again for a step already shown: start over
            shown.clear()
        shown.append((record["step"], t, record.get("samples_seen", 0)))
        if len(shown) < 2:
            return None, None, None
        (step0, t0, _), (step1, t1, seen1), (_, t2, seen2) = shown[0], shown[-2], shown[-1]
        interval = (t2 - t1) / (record["step"] - step1)
        rate = (seen2 - seen1) / (t2 - t1) if t2 > t1 else None
        return interval, rate, (t2 - t0) / (record["step"] - step0)


def batch_layout(global_batch: int, world: int, micro: Optional[int]) -> str:
    """How ``data.deal`` cuts a global batch and deals it out, as the banner says it.

    >>> batch_layout(64, 3, 16)
    '4 micro-batches of 16, dealt 2+1+1 over 3 workers'
    >>> batch_layout(64, 3, None)
    '22+21+21 samples over 3 workers, one micro-batch per worker'
    """
    def spread(counts) -> str:  # 2+1+1, or for many workers the range
        if len(counts) <= 8:
            return "+".join(map(str, counts))
        return f"{counts[0]} each" if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)} each"

    if world == 1:
        return f"1 micro-batch of {global_batch}" if not micro else _cut(global_batch, micro)
    over = f"over {world} workers"
    if not micro:
        samples = spread(split_evenly(global_batch, world))
        samples = samples.replace(" each", " samples each") if " each" in samples else f"{samples} samples"
        return f"{samples} {over}, one micro-batch per worker"
    dealt = [len(deal((0, global_batch), r, world, micro).micro) for r in range(world)]
    return f"{_cut(global_batch, micro)}, dealt {spread(dealt)} {over}"


def _cut(global_batch: int, micro: int) -> str:
    micro = min(micro, global_batch)
    n, last = -(-global_batch // micro), global_batch % micro
    return f"{n} micro-batch{'es' if n != 1 else ''} of {micro}" + (f" (the last {last})" if last else "")


def banner(*, backend: str, device: str, world: int, global_batch: int, micro: Optional[int], optimizer: str,
           samples: int, steps_per_epoch: int, total_steps: Optional[int], run_dir: Path, resumed: Optional[str],
           threads: str = "") -> str:
    lines = [
        f"elasticflow | backend {backend} | {device} | workers {world} | "
        f"global batch {global_batch} = {batch_layout(global_batch, world, micro)}",
        *([f"  {threads}"] if threads else []),
        f"  optimizer {optimizer} | {samples} samples, {steps_per_epoch} steps/epoch"
        + (f", {total_steps} steps in all" if total_steps else ""),
        f"  run dir {run_dir}" + (f" | resumed from {resumed}" if resumed else ""),
    ]
    return "\n".join(lines)


def step_line(record: Dict[str, Any], interval_s: Optional[float] = None, samples_per_s: Optional[float] = None,
              eta_step_s: Optional[float] = None, total: Optional[int] = None) -> str:
    """The console's line for a logged step, the same on a terminal or not: the step of ``total``, the loss, the
    time per step, samples/s and the ETA, then the model's own metrics.

    ``interval_s``: the mean seconds per step since the previous line (shown instead of this step's own time,
    which says nothing of the steps between) and ``samples_per_s`` over it; ``eta_step_s``: the seconds per
    step the ETA assumes (``StepLog``: over the last few lines). Without them (a process's first line) its own
    step's time stands for all three.

    >>> step_line({"step": 10, "epoch": 0, "loss": 2.05, "lr": 0.1, "samples_seen": 640, "global_batch": 64,
    ...            "step_time_s": 0.002, "accuracy": 0.41}, 0.004, 16000.0, 0.004, total=100)
    'step 10/100 epoch 0 loss 2.05 lr 0.1 samples 640 4.0 ms/step 16,000 samples/s ETA 0:00 accuracy=0.41'
    """
    extra = " ".join(f"{k}={v:.4g}" for k, v in record.items()
                     if k not in ("step", "epoch", "loss", "lr", "samples_seen", "world_size", "generation",
                                  "step_time_s", "train_s", "micro_step", "time", "global_batch")
                     and isinstance(v, float))
    own = record["step_time_s"]
    per_step = interval_s if interval_s is not None else own
    if samples_per_s is None and record.get("global_batch") and own > 0:
        samples_per_s = record["global_batch"] / own
    speed = f" {samples_per_s:,.0f} samples/s" if samples_per_s is not None else ""
    of = f"/{total}" if total else ""
    eta = ""
    if total and total >= record["step"]:
        eta = f" ETA {clock((total - record['step']) * (eta_step_s if eta_step_s is not None else per_step))}"
    return (f"step {record['step']}{of} epoch {record['epoch']} loss {record['loss']:.5g} lr {record['lr']:.3g} "
            f"samples {record['samples_seen']} {per_step * 1e3:.1f} ms/step{speed}{eta} {extra}").rstrip()


def clock(seconds: float) -> str:
    """A duration as a clock: ``M:SS``, or ``H:MM:SS`` from an hour (``?`` when it is not a finite number).

    >>> clock(75.4), clock(3725), clock(float("nan"))
    ('1:15', '1:02:05', '?')
    """
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def _some_width(size: Tuple[Any, Any]) -> Tuple[int, int]:
    """A terminal's (columns, rows) as tqdm reads them, 80x20 where it reports none: tqdm reads a 0x0 terminal as
    -1x-1, and draws nothing on a screen of fewer rows than its bar's position."""
    cols, rows = size
    return (cols if cols and cols > 0 else 80, rows if rows and rows > 0 else 20)


def membership_line(step: int, before: Sequence[int], after: Sequence[int], record: Mapping[str, Any], *,
                    failed: bool, redone: bool, stopping: bool = False) -> Optional[str]:
    """The console's line for a membership change, in plain words (the new rank 0 says it once it regrouped).

    ``step``: the step the change met (after a failure, the step being attempted; at a step boundary, the
    last committed one); ``before``/``after``: the worker ids of the generations either side; ``record``: the new
    generation's record (protocol.encode: ``gone``, the ``pids`` of those who came or went, ``causes``; a
    generation superseded in between is not read: who went there is named without pid or cause);
    ``failed``: a collective failed (a member died or hung); ``redone``: the failed step is redone (False where a
    member had committed it and the rest adopted its state); ``stopping``: the job stops below
    launcher.min_workers. The raw reason (gloo's text) is the worker logs' (and the console's with --debug).

    >>> membership_line(39, [0, 1, 2], [0, 2], {"gone": [1], "pids": {"1": 123}, "causes": {"1": "signal SIGKILL"}},
    ...                 failed=True, redone=True)
    'worker 1 (pid 123) died at step 39 (signal SIGKILL): continuing with 2 workers, step 39 redone'
    >>> membership_line(120, [0, 1], [0, 1, 3], {"gone": []}, failed=False, redone=False)
    'worker 3 joined at step 120: 3 workers'
    """
    def num(value: Any) -> Optional[int]:  # the record is the agent's (sealed), read as untrusted all the same
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    pids = record.get("pids") if isinstance(record.get("pids"), dict) else {}
    causes = record.get("causes") if isinstance(record.get("causes"), dict) else {}
    gone = {num(i) for i in record.get("gone", []) if num(i) is not None} if isinstance(record.get("gone"), list) \
        else set()

    def who(i: int) -> str:
        pid = num(pids.get(str(i)))
        return f"worker {i}" + (f" (pid {pid})" if pid is not None else "")

    clauses: List[str] = []
    retired = [i for i in before if i not in after and i not in gone and not failed]  # left at a step boundary
    joined = [i for i in after if i not in before]
    for i in (i for i in before if i not in after and i not in retired):
        cause = causes.get(str(i))
        cause = untrusted.printable(cause, 120) if isinstance(cause, str) and cause else ""
        if cause.startswith("hung"):  # health.cut_out's "hung: <why>"
            why = cause[len("hung"):].lstrip(": ")
            clauses.append(f"{who(i)} hung at step {step}" + (f" ({why})" if why else "") + " and was stopped")
        else:
            clauses.append(f"{who(i)} died at step {step}" + (f" ({cause})" if cause else ""))
    clauses += [f"{' and '.join(map(who, ids))} {verb} at step {step}" for ids, verb in ((retired, "retired"),
                                                                                   (joined, "joined")) if ids]
    if not clauses and not failed:
        return None
    if not clauses:  # every member is still here: a collective failed for another reason (a link, a timeout)
        clauses.append(f"a collective of step {step} failed with every member still in the job")
    n = len(after)
    workers = f"{n} worker{'s' if n != 1 else ''}"
    if stopping:
        outcome = f"stopping with {workers}, fewer than launcher.min_workers (a checkpoint is written)"
    elif failed:
        outcome = f"continuing with {workers}, " + (f"step {step} redone" if redone else "nothing redone")
    else:
        outcome = workers
    return "; ".join(clauses) + ": " + outcome


class WorkerMemory:
    """Resident MiB of each worker, by worker id, for rank 0's step records (TensorBoard's memory/):
    what rank 0's membership thread gathered, or without one this process's own, read at most every 2 s
    (a /proc read: not on every logged step)."""

    def __init__(self, membership: Any, worker_id: Callable[[], Any]):
        self.membership, self.worker_id = membership, worker_id
        self._own = (-1e9, 0.0)  # (monotonic time read, resident MiB)

    def __call__(self) -> Dict[str, float]:
        m = self.membership
        if m is not None and m.memory:
            return {str(k): v for k, v in m.memory.items()}
        read_at, mib = self._own
        if time.monotonic() - read_at > 2.0:
            mib = round(rss_mib(), 1)
            self._own = (time.monotonic(), mib)
        return {str(self.worker_id() or 0): mib}
