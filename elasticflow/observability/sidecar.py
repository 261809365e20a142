"""The sidecar: a process that follows the run's own records into its trackers (``trainer.loggers``:
observability/trackers.py).

It reads metrics.jsonl (steps and evaluations) and events.jsonl (the agent's and the workers' membership
events) as they grow, and hands each new record to every tracker. Not a thread of the trainer: TensorBoard's
record checksum is pure Python without TensorFlow (~55 us an event) and MLflow's store is a database, and a
thread would take that from the step through the GIL. The training thread pays nothing beyond the
metrics.jsonl line it writes anyway.

Rank 0 starts the sidecar (``Sidecar.start``); it remembers how far each tracker read
(RUN_DIR/.elasticflow/trackers.json), so a worker that becomes rank 0, or a resumed run, starts one that goes
on from there, and it drains and exits when its stdin closes (``close``, or the trainer's death).

    python -m elasticflow.observability.sidecar RUN_DIR --parent PID --loggers tensorboard,mlflow
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .._util import untrusted
from .._util.fileio import write_atomic
from .trackers import Tracker, open_trackers, params_of

POLL_S = 0.5  # how often the sidecar looks for new lines
NICE = 10     # the sidecar's scheduling priority, below the trainer's
OFFSETS = "trackers.json"  # RUN_DIR/.elasticflow/trackers.json: bytes of each record file each tracker has had
PARAMS = "params.json"  # RUN_DIR/.elasticflow/params.json: the config, flattened, for the trackers

# The record keys of metrics.jsonl that are not scalars worth a chart (or are charted under another name).
_NOT_CHARTED = {"step", "epoch", "samples_seen", "time", "micro_step", "global_batch", "step_time_s", "world_size",
                "generation", "skipped", "overflow", "train_s"}  # train_s: the goodput ledger's (goodput.py)


def scalars_of(record: Dict[str, Any]) -> Dict[str, float]:
    """A metrics.jsonl record as TensorBoard tags and values (``eval_*`` keys go under ``eval/``)."""
    if "loss" not in record:
        return {k.replace("eval_", "eval/", 1): float(v) for k, v in record.items()
                if k.startswith("eval_") and isinstance(v, (int, float))}
    out = {f"train/{k}": float(v) for k, v in record.items()
           if k not in _NOT_CHARTED and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "step_time_s" in record:
        out["speed/step_time_s"] = float(record["step_time_s"])
        out["speed/samples_per_s"] = record.get("global_batch", 0) / max(float(record["step_time_s"]), 1e-9)
    for k in ("world_size", "generation"):
        if k in record:
            out[f"elastic/{k}"] = float(record[k])
    out["train/skipped"] = 1.0 if record.get("skipped") else 0.0
    for worker, mib in (record.get("memory_mib") or {}).items():
        out[f"memory/worker_{worker}_mib"] = float(mib)  # resident memory of each worker, by worker id
    return out


class Sidecar:
    """The trainer's handle on the sidecar: ``start`` once (rank 0), ``close`` at the end.

    ``loggers``: the tracker names (trainer.loggers); ``config``: the run's, which trackers record as its
    parameters, with ``optimizer`` (``optim.summary`` of the one that trains, once built) for its ``optimizer.*``."""

    def __init__(self, run_dir: Path, loggers: List[str], config: Any = None):
        self.run_dir, self.loggers, self.config = Path(run_dir), list(loggers), config
        self.optimizer: Dict[str, Any] = {}
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        if self.proc is None:
            (self.run_dir / ".elasticflow").mkdir(parents=True, exist_ok=True)
            params = params_of(self.config, self.optimizer) if self.config is not None else {}
            write_atomic(self.run_dir / ".elasticflow" / PARAMS, json.dumps(params, default=str))
            # Its stdin is the stop request: closed by close(), or by the kernel when this process dies.
            # (Not a signal: one sent while the sidecar is still starting would kill it before it wrote.)
            self.proc = subprocess.Popen([sys.executable, "-m", "elasticflow.observability.sidecar", str(self.run_dir),
                                          "--parent", str(os.getpid()), "--loggers", ",".join(self.loggers)],
                                         stdin=subprocess.PIPE)

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the sidecar write what is left and exit (bounded: a stuck disk does not hold the exit)."""
        if self.proc is None:
            return
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


# ---------------------------------------------------------------------------------------------- sidecar
class _Follower:
    """Hands new complete lines of metrics.jsonl and events.jsonl to each tracker that has not had them."""

    def __init__(self, run_dir: Path, trackers: List[Tracker]):
        self.run_dir, self.trackers = run_dir, trackers
        (run_dir / ".elasticflow").mkdir(parents=True, exist_ok=True)
        try:
            kept = json.loads((run_dir / ".elasticflow" / OFFSETS).read_text())
        except (OSError, ValueError):
            kept = {}
        # bytes of metrics.jsonl and events.jsonl each tracker has had (a tracker added on a resume starts at 0)
        self.read = {t.name: {"metrics": 0, "events": 0, **kept.get(t.name, {})} for t in trackers}
        self.step = 0
        self.failed: Dict[str, str] = {}  # tracker -> its error, reported once; it is given nothing more

    def poll(self) -> None:
        had, lines = self._new_lines("metrics")
        for at, record in lines:
            try:  # a crafted line (text where a figure belongs) is skipped, never the end of the sidecar
                step, wall, values = int(record.get("step", self.step)), _wall(record), scalars_of(record)
            except (TypeError, ValueError, OverflowError):
                continue
            self.step = step
            if values:
                self._each(lambda t: t.scalars(step, values, wall), at, had)
        had, lines = self._new_lines("events")
        for at, event in lines:
            kind = str(event.get("event", "event"))
            fields = {k: v for k, v in event.items() if k not in ("event", "time")}
            try:
                wall = _wall(event)
            except (TypeError, ValueError, OverflowError):
                continue
            self._each(lambda t: t.event(self.step, kind, fields, wall), at, had)
        self._each(lambda t: t.flush())
        write_atomic(self.run_dir / ".elasticflow" / OFFSETS, json.dumps(self.read))

    def _each(self, call, at: int = 0, had: Optional[Dict[str, int]] = None) -> None:
        """``call(tracker)`` for each tracker that has not failed and, given ``had`` (the bytes of the file each
        tracker had), had not had the line starting at byte ``at``."""
        for t in self.trackers:
            if t.name in self.failed or (had is not None and at < had[t.name]):
                continue
            try:
                call(t)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure (a full disk, a lost server) is its own
                self.failed[t.name] = f"{type(exc).__name__}: {exc}"
                print(f"warning: the {t.name} logger failed ({self.failed[t.name][:300]}); it gets nothing more "
                      "in this job (the run's own metrics.jsonl and events.jsonl have everything)", file=sys.stderr)

    def _new_lines(self, name: str) -> Tuple[Dict[str, int], List[Tuple[int, Dict[str, Any]]]]:
        """The bytes of ``name``.jsonl each tracker had before, and (start byte, record) of each complete line past
        what the furthest-behind tracker had; each tracker's count moves to the end of those lines."""
        had = {t: r[name] for t, r in self.read.items()}
        path = self.run_dir / f"{name}.jsonl"
        start = min(had.values(), default=0)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return had, []
        if size <= start:
            return had, []
        with open(path, "rb") as f:
            f.seek(start)
            chunk = f.read(size - start)
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being appended waits for the next poll
        end = start + len(complete)
        for r in self.read.values():
            r[name] = max(r[name], end)
        records, at = [], start
        for line in complete.split(b"\n")[:-1]:
            try:  # bounded: a crafted line is no parser bomb
                record = untrusted.loads(line.decode(errors="replace"), max_bytes=1 << 20)
            except ValueError:  # a torn line of a killed writer, or a crafted one
                record = None
            if isinstance(record, dict):
                records.append((at, record))
            at += len(line) + 1
        return had, records

    def close(self) -> None:
        for t in self.trackers:
            try:
                t.close()
            except Exception:  # noqa: BLE001 - closing what already failed
                pass


def _wall(record: Dict[str, Any]) -> float:
    wall = float(record.get("time", time.time()))
    if not 0 < wall < 1e11:
        raise ValueError(f"{wall} is no Unix time")
    return wall


def _until_eof(stop: threading.Event) -> None:
    """Set ``stop`` when the trainer closes our stdin. Raw reads of fd 0, not sys.stdin.buffer: a daemon
    thread blocked in the buffered reader holds its lock, and an exit of ours while the trainer still
    runs (its run directory removed) would then abort at interpreter shutdown."""
    while os.read(0, 4096):
        pass
    stop.set()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Follow a run's metrics and events into its trackers.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--parent", type=int, required=True, help="exit (after a last drain) when this pid is gone")
    p.add_argument("--loggers", default="tensorboard", help="the trackers, comma-separated (trainer.loggers)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; it closes our stdin when done
    # A follower: it may lag, the workers may not. Where they use every core (2 workers on 2 cores), its
    # checksums (pure Python, ~0.08 ms of CPU per logged step) took their time slices at normal priority.
    os.nice(NICE)
    stop = threading.Event()
    threading.Thread(target=_until_eof, args=(stop,), daemon=True).start()
    try:
        params = json.loads((args.run_dir / ".elasticflow" / PARAMS).read_text())
    except (OSError, ValueError):
        params = {}
    follower = _Follower(args.run_dir, open_trackers([n for n in args.loggers.split(",") if n], args.run_dir,
                                                     params))
    try:
        while os.getppid() == args.parent:
            follower.poll()
            if stop.wait(POLL_S):
                break
        follower.poll()  # the last lines, written before the trainer asked us to stop
    except FileNotFoundError:
        if args.run_dir.is_dir():
            raise
        return  # the run directory was removed under us (a temporary one): nothing left to follow
    finally:
        follower.close()


if __name__ == "__main__":
    main()
