"""The goodput ledger: every second of a run, productive (steps kept) or lost, and to what.

Built after the fact from the run's own records, so it covers a run of several jobs (a requeue, a
resume) and answers for a running job too (`elasticflow status`). Written to RUN_DIR/goodput.json at
the end of each job and printed before the closing ``done:`` line.

The accounting:

- **wall**: from the first job's process start to the last job's end: the ``job_start`` event's
  ``started`` (the CLI or SLURM agent process's start, read from /proc, so imports count) to the
  ``job_end`` event of the last job (for a job killed or still running: its newest record).
- Per job, three windows that tile it: start-up ``[started, ready)``, the loop ``[ready, trained]``,
  shutdown ``(trained, job_end]``. ``ready`` is rank 0's event when its first step begins; ``trained``
  is the event of whoever is rank 0 when training ends (finished, interrupted or stopped).
- Inside the loop every worker runs a ``Meter``: each cost is measured where it happens and taken out
  of the time since the previous logged step; the rest is **productive**, written as ``train_s`` on each
  logged step of metrics.jsonl (and the unlogged rest on ``trained``). The costs, each from its record:

  ======================  ==================================================================================
  ``redone``              compute of a step attempt a failure threw away (``recovered.redone_s``; 0 when a
                          member had committed the step and the rest adopted it: the step was kept)
  ``detection``           blocked in the collective that failed, until the failure surfaced (``detect_s``)
  ``rebuild``             from the failure to the next generation's group (``recovery_s - transfer_s``),
                          less the time the agent waited below ``launcher.min_workers`` meanwhile
  ``transfer``            the state sent to the members behind after a failure (``transfer_s``)
  ``below_min``           the agent waiting for workers below ``launcher.min_workers`` (``below_min.waited_s``)
  ``regroup``             a membership change at a step boundary: a join or a scale-down (``regrouped``)
  ``checkpoint``          training stalled by a save (``checkpoint.stall_s``: the snapshot of an async save;
                          the whole write of the final, Ctrl-C and stop saves, and a save still in flight)
  ``eval``                evaluation (``evaluation_s`` on metrics.jsonl's eval records)
  ======================  ==================================================================================
- ``startup`` (each job's) and ``shutdown`` (process exit after ``trained``) are their windows, less any
  cost recorded in them. ``requeue``: the gap between the end of a job that was preempted (its ``preempt``
  event: SLURM's warning signal) and the next one's start, the scheduler's pause. The gap after any other end
  (finished, Ctrl-C, stopped, killed) is **between runs**: no job of the run existed, which is a user's pause,
  not the run's cost; it is reported (``between_runs_s``) and left out of wall and goodput.
- ``other``: wall less every part above. Zero by construction with one rank 0 per job (the meter
  partitions the loop); a new rank 0 after a kill goes on from its own meter, which was reset at the
  same logged step, so ``other`` is the difference between two processes' clocks (milliseconds).

Note: a step skipped for a non-finite loss or a float16 overflow counts as productive: the ledger
accounts failures and elasticity, not numerics. Hosts' clocks must agree (one host, or NTP).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from ..errors import ElasticFlowError, RunDirectoryMoved, TrainingInterrupted
from .._util import untrusted
from .._util.fileio import append_event, read_jsonl, write_atomic

# The order the ledger lists its parts in; "recovery" in the text is detection + rebuild + transfer.
CAUSES = ("productive", "startup", "redone", "detection", "rebuild", "transfer", "below_min", "regroup",
          "checkpoint", "eval", "shutdown", "requeue", "other")
RECOVERY = ("detection", "rebuild", "transfer")
FAILURES = ("redone", *RECOVERY, "below_min")  # what failures cost (the question the ledger answers)
# Events written only for the ledger (`status` leaves them out of its recent membership events).
ACCOUNTING_EVENTS = {"job_start", "job_end", "ready", "trained", "checkpoint"}
_first_job_in_process = True


class Meter:
    """One worker's split of its training loop into productive time and measured costs.

    Every moment after ``start`` is productive unless ``lose`` takes it: a cost is measured where it
    happens (a recovery, a checkpoint stall, an evaluation) and handed over once it has ended.
    ``flush`` returns the productive seconds since the previous flush. Cost: one perf_counter() per
    flush (once per logged step), nothing per step.
    """

    def __init__(self) -> None:
        self._mark: Optional[float] = None
        self._lost = 0.0

    @property
    def started(self) -> bool:
        return self._mark is not None

    def start(self) -> None:
        self._mark, self._lost = time.perf_counter(), 0.0

    def lose(self, seconds: float) -> None:
        self._lost += seconds

    def flush(self) -> float:
        if self._mark is None:
            return 0.0
        now = time.perf_counter()
        productive = now - self._mark - self._lost
        self._mark, self._lost = now, 0.0
        return productive


def process_started() -> float:
    """time.time() when this process started (Linux /proc, to 10 ms); now where that cannot be read."""
    now = time.time()
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime; [0] is field 3
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age if 0 <= age < 86400 else now


def outcome_of(exc: BaseException) -> Optional[str]:
    """How the run that ``exc`` ended ended, for the ledger (``job_end``, ``trained``): interrupted (Ctrl-C),
    stopped (an ElasticFlowError), failed; None where the run directory moved, and nothing more is written there."""
    if isinstance(exc, RunDirectoryMoved):
        return None
    return ("interrupted" if isinstance(exc, TrainingInterrupted) else
            "stopped" if isinstance(exc, ElasticFlowError) else "failed")


@contextmanager
def job(run_dir: Path) -> Iterator[None]:
    """Around one job of a run (`elasticflow train`, or a SLURM allocation's agent): ``job_start`` and
    ``job_end`` in events.jsonl, and RUN_DIR/goodput.json rewritten at the end."""
    global _first_job_in_process
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    events = run_dir / "events.jsonl"
    # A sweep (-m) runs its jobs one after another in one process: only the first began with it.
    started = process_started() if _first_job_in_process else time.time()
    _first_job_in_process = False
    append_event(events, "job_start", "launcher", started=started, pid=os.getpid())
    outcome: Optional[str] = "failed"
    try:
        yield
        outcome = "finished"
    except BaseException as exc:
        outcome = outcome_of(exc)
        raise
    finally:
        if outcome is not None:
            append_event(events, "job_end", "launcher", outcome=outcome)
            try:
                write_atomic(run_dir / "goodput.json", json.dumps(ledger(run_dir), indent=1))
            except Exception:  # noqa: BLE001 - a report: a run never fails for it (`status` recomputes it)
                pass


# ---------------------------------------------------------------------- the reader's side
FIGURES = ("started", "train_s", "steps_redone", "redone_s", "detect_s", "transfer_s", "recovery_s", "stall_s",
           "waited_s", "evaluation_s")


def _sane(record: Dict[str, Any]) -> bool:
    """Whether the figures the ledger reads from ``record`` are finite numbers (or absent): a line someone
    crafted in events.jsonl is left out, never a reason for `status` or the ledger to fail."""
    return all(k not in record or record[k] is None or untrusted.number(record[k], 1e11) for k in FIGURES)


def _costs(event: Dict[str, Any]) -> Dict[str, float]:
    """The seconds one event records, by cause."""
    kind, get = event.get("event"), lambda k: float(event.get(k) or 0.0)
    if kind == "recovered":
        return {"redone": get("redone_s"), "detection": get("detect_s"), "transfer": get("transfer_s"),
                "rebuild": get("recovery_s") - get("transfer_s")}
    if kind == "regrouped":
        return {"regroup": get("recovery_s")}
    if kind == "checkpoint":
        return {"checkpoint": get("stall_s")}
    if kind == "below_min":
        return {"below_min": get("waited_s")}
    if "evaluation_s" in event:  # an eval record of metrics.jsonl
        return {"eval": get("evaluation_s")}
    return {}


def _job(start: Dict[str, Any], events: List[Dict[str, Any]], metrics: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One job's parts; ``events`` and ``metrics`` are the records written during it."""
    began = float(start["started"])
    end = next((e for e in events if e.get("event") == "job_end"), None)
    times = [float(r["time"]) for r in events + metrics if "time" in r]
    ended = float(end["time"]) if end else max(times + [float(start["time"])])
    ready = next((e for e in events if e.get("event") == "ready"), None)
    ready_at = float(ready["time"]) if ready else ended
    trained = [e for e in events if e.get("event") == "trained"]
    steps = [r for r in metrics if "loss" in r]
    if trained:
        trained_at = float(trained[-1]["time"])
    else:  # killed, or still running: as of its newest logged step
        trained_at = float(steps[-1]["time"]) if steps else ready_at
    trained_at = min(max(trained_at, ready_at), ended)

    parts = dict.fromkeys(CAUSES, 0.0)
    parts["productive"] = sum(float(r.get("train_s") or 0.0) for r in steps)
    parts["productive"] += float(trained[-1].get("train_s") or 0.0) if trained else 0.0
    outside = {"startup": 0.0, "shutdown": 0.0}  # costs recorded outside the loop window
    below = 0.0
    for record in events + [r for r in metrics if "loss" not in r]:
        costs = _costs(record)
        below += costs.pop("below_min", 0.0)
        for cause, seconds in costs.items():
            parts[cause] += seconds
        t = float(record.get("time", ready_at))
        if t < ready_at or t > trained_at:
            outside["startup" if t < ready_at else "shutdown"] += sum(costs.values())
    # The agent's wait below min_workers is time the survivors spent in a recovery's rebuild: moved, not added.
    parts["below_min"] = min(below, parts["rebuild"])
    parts["rebuild"] -= parts["below_min"]
    parts["startup"] = ready_at - began - outside["startup"]
    parts["shutdown"] = ended - trained_at - outside["shutdown"]
    wall = ended - began
    parts["other"] = wall - sum(parts.values())
    recovered = [e for e in events if e.get("event") == "recovered"]
    return {"started": began, "ended": ended, "finished": end is not None,
            "outcome": end.get("outcome") if end else "running or killed", "wall_s": wall, "seconds": parts,
            "recoveries": len(recovered), "steps_redone": sum(int(e.get("steps_redone") or 0) for e in recovered),
            "preempted": any(e.get("event") == "preempt" for e in events),
            "regroups": sum(e.get("event") == "regrouped" for e in events),
            "checkpoints": sum(e.get("event") == "checkpoint" for e in events)}


def ledger(run_dir: Path) -> Dict[str, Any]:
    """The ledger of ``run_dir``: wall, seconds by cause (``CAUSES``; they sum to wall), goodput, per job."""
    run_dir = Path(run_dir)
    events = [e for e in read_jsonl(run_dir / "events.jsonl", timed=True) if _sane(e)]
    starts = [e for e in events if e.get("event") == "job_start" and "started" in e]
    if not starts:
        raise ElasticFlowError(f"{run_dir} has no goodput records (no job_start in events.jsonl)",
                               "the ledger covers runs trained since it was added; retrain to get one")
    metrics = [r for r in read_jsonl(run_dir / "metrics.jsonl", timed=True) if _sane(r)]
    jobs = []
    for i, start in enumerate(starts):
        lo, hi = float(start["time"]), float(starts[i + 1]["time"]) if i + 1 < len(starts) else float("inf")
        jobs.append(_job(start, [e for e in events if lo <= float(e["time"]) < hi and e is not start],
                         [r for r in metrics if lo <= float(r["time"]) < hi]))
    seconds = dict.fromkeys(CAUSES, 0.0)
    for j in jobs:
        for cause, s in j["seconds"].items():
            seconds[cause] += s
    gaps = [(a["preempted"], max(0.0, b["started"] - a["ended"])) for a, b in zip(jobs, jobs[1:])]
    seconds["requeue"] = sum((gap for preempted, gap in gaps if preempted), 0.0)
    between = sum((gap for preempted, gap in gaps if not preempted), 0.0)
    wall = jobs[-1]["ended"] - jobs[0]["started"] - between
    # What rounding and an overlap of jobs (a second one started before the first ended) leave over.
    seconds["other"] += wall - sum(seconds.values())
    rounded = {k: round(v, 4) for k, v in seconds.items()}
    for j in jobs:
        j["seconds"] = {k: round(v, 4) for k, v in j["seconds"].items()}
        j["wall_s"] = round(j["wall_s"], 4)
    return {"wall_s": round(wall, 4), "goodput": round(seconds["productive"] / wall, 4) if wall > 0 else 0.0,
            "between_runs_s": round(between, 4),
            "seconds": rounded, "failures_s": round(sum(seconds[c] for c in FAILURES), 4),
            "recoveries": sum(j["recoveries"] for j in jobs), "steps_redone": sum(j["steps_redone"] for j in jobs),
            "regroups": sum(j["regroups"] for j in jobs), "checkpoints": sum(j["checkpoints"] for j in jobs),
            "jobs": jobs}


def render(led: Dict[str, Any]) -> str:
    """The ledger as a short block of text: productive, then each cause that cost anything, then other."""
    wall, s = led["wall_s"], led["seconds"]
    pct = (lambda x: x / wall * 100) if wall > 0 else (lambda x: 0.0)
    plural = lambda n, word: f"{n} {word}" + ("" if n == 1 else "s")  # noqa: E731
    lines = [f"goodput {pct(s['productive']):.1f}%: {s['productive']:.2f} s productive of {wall:.2f} s wall "
             f"({plural(len(led['jobs']), 'job')})"]
    notes = {"recovery": " (" + ", ".join(f"{c} {s[c]:.3f}" for c in RECOVERY) + ")",
             "redone": f" ({plural(led['steps_redone'], 'step')})", "other": " (not explained by any record)"}
    rows = [("startup", s["startup"]), ("recovery", sum(s[c] for c in RECOVERY))]
    rows += [(c, s[c]) for c in CAUSES if c not in ("productive", "startup", "other", *RECOVERY)]
    for cause, seconds in rows + [("other", s["other"])]:
        seconds = 0.0 if abs(seconds) < 0.0005 else seconds  # no "-0.000"
        if seconds or cause == "other":
            lines.append(f"  {cause:<11}{seconds:>9.3f} s {pct(seconds):>5.1f}%{notes.get(cause, '')}")
    if led.get("between_runs_s"):
        lines.append(f"  between runs {led['between_runs_s']:.3f} s with no job running: not counted")
    if led["recoveries"] or s["below_min"]:
        lines.append(f"  failures cost {led['failures_s']:.3f} s ({pct(led['failures_s']):.1f}%): "
                     f"{led['recoveries']} recover{'y' if led['recoveries'] == 1 else 'ies'}, "
                     f"{plural(led['steps_redone'], 'step')} redone")
    return "\n".join(lines)


def load(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The run's ledger, computed from its records now (None: the run has none)."""
    try:
        return ledger(run_dir)
    except ElasticFlowError:
        return None
