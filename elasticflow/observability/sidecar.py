"""The sidecar: a process that follows the run's own records into its trackers (``trainer.loggers``:
observability/trackers.py).

It reads metrics.jsonl (steps and evaluations) and events.jsonl (the agent's and the workers' membership
events) as they grow, and hands each new record to every tracker. Not a thread of the trainer: TensorBoard's
record checksum is pure Python without TensorFlow (~55 us an event) and MLflow's store is a database, and a
thread would take that from the step through the GIL. The training thread pays nothing beyond the
metrics.jsonl line it writes anyway.

Rank 0 starts the sidecar (``Sidecar.start``); it remembers how far each tracker read
(RUN_DIR/.elasticflow/trackers.json, observability/backlog.py), so a worker that becomes rank 0, or a resumed run,
starts one that goes on from there, and it drains and exits when its stdin closes (``close``, or the trainer's
death). ``close`` waits for it at most ``trainer.loggers_wait_s``, saying how far each tracker is after a few
seconds; what a tracker still lacks then (a loaded machine, a slow server, a tracker that failed) is written
down in RUN_DIR/trackers-backlog.json with a warning, and caught up by the next start of the run or by
``elasticflow sync RUN_DIR`` (``sync``). One sidecar at a time writes a run's trackers (a lock): a new rank 0's
waits for the one of a rank 0 that was killed to drain.

    python -m elasticflow.observability.sidecar RUN_DIR --parent PID --loggers tensorboard,mlflow
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import ElasticFlowError, RunDirectoryMoved
from .._util import untrusted
from .._util.envnames import ENV_RUN_DIR_ID
from .._util.paths import HeldDirectory
from .._util.fileio import write_atomic
from . import backlog
from .backlog import FILES, TITLES
from .trackers import Tracker, open_trackers, params_of

POLL_S = 0.5  # how often the sidecar looks for new lines
NICE = 10     # the follower thread's scheduling priority while the run trains, below the trainer's
PARAMS = "params.json"  # RUN_DIR/.elasticflow/params.json: the config, flattened, for the trackers
LOCK = "trackers.lock"  # RUN_DIR/.elasticflow/trackers.lock: held by the one process writing the trackers
WAIT_S = 60.0  # trainer.loggers_wait_s where no config says it
BATCH = 500  # lines of each file handed on at a time: offsets are saved after each batch (progress, and memory)
MAX_CHUNK = 4 << 20  # bytes read at a time; a longer "line" is no record (untrusted.loads takes 1 MiB)
SAY_AFTER_S, SAY_EVERY_S = 2.0, 10.0  # close(): the first progress line, and the next ones

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
    parameters, with ``optimizer`` (``optim.summary`` of the one that trains, once built) for its ``optimizer.*``,
    and whose ``trainer.loggers_wait_s`` bounds ``close``."""

    def __init__(self, run_dir: Path, loggers: List[str], config: Any = None):
        self.run_dir, self.loggers, self.config = Path(run_dir), list(loggers), config
        self.optimizer: Dict[str, Any] = {}
        self.proc: Optional[subprocess.Popen] = None
        try:
            self.wait_s = max(0.0, float(config.trainer.loggers_wait_s))
        except (AttributeError, TypeError, ValueError):
            self.wait_s = WAIT_S

    def start(self) -> None:
        if self.proc is None:
            (self.run_dir / ".elasticflow").mkdir(parents=True, exist_ok=True)
            params = params_of(self.config, self.optimizer) if self.config is not None else {}
            write_atomic(self.run_dir / ".elasticflow" / PARAMS, json.dumps(params, default=str))
            behind = [TITLES.get(n, n) for n in backlog.pending(self.run_dir)]
            if behind:
                print(f"warning: {' and '.join(behind)} did not have every record when this run last stopped "
                      f"({self.run_dir / backlog.BACKLOG}): catching up now", file=sys.stderr, flush=True)
            # Its stdin is the stop request: closed by close(), or by the kernel when this process dies.
            # (Not a signal: one sent while the sidecar is still starting would kill it before it wrote.)
            self.proc = subprocess.Popen([sys.executable, "-m", "elasticflow.observability.sidecar", str(self.run_dir),
                                          "--parent", str(os.getpid()), "--loggers", ",".join(self.loggers)],
                                         stdin=subprocess.PIPE)

    def close(self) -> None:
        """Let the sidecar write what is left and exit, waiting at most ``trainer.loggers_wait_s`` (a loaded
        machine or a stuck server does not hold the run's exit) and saying how far each tracker is once the wait
        is noticeable; what a tracker still lacks is written down (``backlog.settle``) with a warning."""
        if self.proc is None:
            return
        # What the trackers owe is what the records held when the run stopped: an event the agent appends
        # meanwhile (another worker's exit) is for the next start or `sync`, not a warning of this one's.
        sizes = backlog.sizes(self.run_dir)
        self.proc.stdin.close()
        began = time.monotonic()
        deadline, say_at = began + self.wait_s, began + SAY_AFTER_S
        cut = False
        while True:
            now = time.monotonic()
            try:
                self.proc.wait(max(0.0, min(deadline, say_at) - now))
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now >= deadline:
                    self.proc.kill()
                    self.proc.wait()
                    cut = True
                    break
                if now >= say_at:
                    print(backlog.progress_line(self.run_dir, self.loggers, deadline - now, sizes), file=sys.stderr,
                          flush=True)
                    say_at = now + SAY_EVERY_S
        self.proc = None
        why = (f"cut off after trainer.loggers_wait_s={self.wait_s:g} s" if cut else
               "a tracker failed or could not start: see its warning above")
        warning = backlog.settle(self.run_dir, self.loggers, why, sizes)
        if warning:
            print(warning, file=sys.stderr, flush=True)


def sync(run_dir: Path, say=print) -> None:
    """``elasticflow sync RUN_DIR``: hand each tracker of the run the records it lacks (after a run whose sidecar
    was cut off or whose tracker failed), close its run, and remove RUN_DIR/trackers-backlog.json.

    Note: refused while the run's own sidecar writes them (the run is live: it catches up by itself)."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ElasticFlowError(f"'{run_dir}' is not a run directory (no metrics.jsonl)",
                               "pass the run's hydra.run.dir, e.g. elasticflow sync outputs/2026-11-22/10-00-00")
    lock = _lock(run_dir, wait=False)
    if lock is None:
        raise ElasticFlowError(f"the sidecar of {run_dir} is writing its trackers now (the run is live)",
                               "let the run catch up by itself, or sync after it has ended")
    try:
        # What the backlog lists, else the trackers the run's newest job named (one left out of trainer.loggers
        # on a resume was left out on purpose: it is not filled in).
        names = backlog.pending(run_dir) or [n for n in TITLES if f"'{n}'" in str(_params(run_dir).get(
            "trainer.loggers", ""))]
        lagging = backlog.behind(run_dir, names)
        if not lagging:
            backlog.settle(run_dir, names, "")
            say(f"nothing to sync: {', '.join(TITLES.get(n, n) for n in names)} "
                f"{'has' if len(names) == 1 else 'have'} every record of {run_dir}" if names else
                f"nothing to sync: the newest job of {run_dir} named no tracker (trainer.loggers)")
            return
        say(f"syncing {run_dir}: {backlog.describe(lagging)}")
        follower = _Follower(run_dir, open_trackers(list(lagging), run_dir, _params(run_dir)))
        said = time.monotonic()
        while follower.poll():
            if time.monotonic() - said > SAY_AFTER_S:
                say("; ".join(f"{TITLES.get(n, n)}: {had} of {total} records" for n, (had, total, _) in
                              backlog.behind(run_dir, list(lagging)).items()))
                said = time.monotonic()
        follower.close()
        still = backlog.behind(run_dir, list(lagging))
        backlog.settle(run_dir, names, "elasticflow sync could not finish")
    finally:
        if lock >= 0:
            os.close(lock)
    if still:
        raise ElasticFlowError(f"{backlog.describe(still)} after the sync", "see the tracker's warning above; "
                               f"the backlog stays listed in {run_dir / backlog.BACKLOG} for the next sync")
    say("synced: " + ", ".join(f"{TITLES.get(n, n)} has all {total} records" for n, (_, total, _) in lagging.items()))


def _lock(run_dir: Path, wait: bool) -> Optional[int]:
    """The descriptor holding RUN_DIR/.elasticflow/trackers.lock (released when closed, or when the process dies);
    None where another process holds it and ``wait`` is False; -1 where the file is not ours to open (a run
    directory shared with another user): then no lock is taken, as before there was one."""
    (run_dir / ".elasticflow").mkdir(exist_ok=True)  # not the run directory itself: one removed stays removed
    try:
        fd = os.open(run_dir / ".elasticflow" / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except PermissionError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _params(run_dir: Path) -> Dict[str, Any]:
    try:
        found = untrusted.loads((run_dir / ".elasticflow" / PARAMS).read_text(), max_bytes=1 << 22)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


# ---------------------------------------------------------------------------------------------- sidecar
class _Follower:
    """Hands new complete lines of metrics.jsonl and events.jsonl to each tracker that has not had them, a batch at
    a time, and after each batch saves how far each tracker is (``backlog.write_offsets``): the bytes it had, as
    far as its last flush that succeeded (a tracker that failed keeps the offsets of its last good flush, for the
    next start or ``sync``; one not ``durable``, W&B, those of its close), and whether it was closed."""

    def __init__(self, run_dir: Path, trackers: List[Tracker]):
        self.run_dir, self.trackers = run_dir, trackers
        # As the worker that started it was handed it: once its path leads elsewhere, no offsets are written there
        self.held = HeldDirectory(run_dir, expect=os.environ.get(ENV_RUN_DIR_ID))
        self.kept = backlog.read_offsets(run_dir)  # trackers not open here keep their entries as they are
        # bytes of metrics.jsonl and events.jsonl each tracker was handed (a tracker added on a resume starts at 0)
        self.read = {t.name: {f: self.kept.get(t.name, {}).get(f, 0) for f in FILES} for t in trackers}
        self.done = {name: dict(had) for name, had in self.read.items()}  # ... and flushed
        self.closed: set = set()
        self.step = 0
        self.failed: Dict[str, str] = {}  # tracker -> its error, reported once; it is given nothing more

    def poll(self) -> bool:
        """Hand on the next batch of lines; whether more are waiting."""
        had, lines, more = self._new_lines("metrics")
        for at, record in lines:
            try:  # a crafted line (text where a figure belongs) is skipped, never the end of the sidecar
                step, wall, values = int(record.get("step", self.step)), _wall(record), scalars_of(record)
            except (TypeError, ValueError, OverflowError):
                continue
            self.step = step
            if values:
                self._each(lambda t: t.scalars(step, values, wall), at, had)
        had, lines, more_events = self._new_lines("events")
        for at, event in lines:
            kind = str(event.get("event", "event"))
            fields = {k: v for k, v in event.items() if k not in ("event", "time")}
            try:
                wall = _wall(event)
            except (TypeError, ValueError, OverflowError):
                continue
            self._each(lambda t: t.event(self.step, kind, fields, wall), at, had)
        self._each(lambda t: t.flush())
        for t in self.trackers:
            if t.name not in self.failed and t.durable:
                self.done[t.name] = dict(self.read[t.name])
        self._save()
        return more or more_events

    def _save(self) -> None:
        self.held.check()  # a run directory moved or removed ends the sidecar (main): nothing is written at its path
        backlog.write_offsets(self.run_dir, {**self.kept, **{name: {**had, "closed": name in self.closed}
                                                             for name, had in self.done.items()}})

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
                      "in this job (the run's own metrics.jsonl and events.jsonl have everything, and "
                      "`elasticflow sync RUN_DIR` hands them on later)", file=sys.stderr)

    def _new_lines(self, name: str) -> Tuple[Dict[str, int], List[Tuple[int, Dict[str, Any]]], bool]:
        """The bytes of ``name``.jsonl each tracker had before; (start byte, record) of each complete line past
        what the furthest-behind tracker (of those not failed) had, at most BATCH; and whether more lines wait.
        Each tracker's count moves to the end of those lines."""
        had = {t: r[name] for t, r in self.read.items()}
        live = [t for t in had if t not in self.failed]
        path = self.run_dir / f"{name}.jsonl"
        start = min((had[t] for t in live), default=0)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return had, [], False
        if not live or size <= start:
            return had, [], False
        with open(path, "rb") as f:
            f.seek(start)
            chunk = f.read(min(size - start, MAX_CHUNK))
        lines = chunk[:chunk.rfind(b"\n") + 1].split(b"\n")[:-1]  # a line still being appended waits
        more = len(lines) > BATCH or (len(chunk) == MAX_CHUNK and start + len(chunk) < size)
        lines = lines[:BATCH]
        end = start + sum(len(line) + 1 for line in lines)
        if not lines and len(chunk) == MAX_CHUNK:  # no line end in MAX_CHUNK bytes: no record; skipped
            end, more = start + len(chunk), True
        for t in live:
            self.read[t][name] = max(self.read[t][name], end)
        records, at = [], start
        for line in lines:
            try:  # bounded: a crafted line is no parser bomb
                record = untrusted.loads(line.decode(errors="replace"), max_bytes=1 << 20)
            except ValueError:  # a torn line of a killed writer, or a crafted one
                record = None
            if isinstance(record, dict):
                records.append((at, record))
            at += len(line) + 1
        return had, records, more

    def close(self) -> None:
        for t in self.trackers:
            if t.name in self.failed:
                continue
            try:
                t.close()
                self.closed.add(t.name)
                self.done[t.name] = dict(self.read[t.name])  # a tracker not ``durable`` has them now
            except Exception as exc:  # noqa: BLE001 - its run stays open; the backlog says so
                print(f"warning: the {t.name} logger failed as it closed ({type(exc).__name__}: "
                      f"{str(exc)[:300]})", file=sys.stderr)
        try:
            self._save()
        except (OSError, RunDirectoryMoved):  # the run directory was removed under us (a temporary one), or moved
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


def _follow(follower: "_Follower", turn: threading.Lock, stop: threading.Event, errors: list) -> None:
    """The follower thread: hands new lines on while the trainer runs, at nice NICE. On Linux a thread has its own
    nice value (setpriority on its TID): it may lag, the workers may not. Where they use every core (2 workers on
    2 cores), its checksums (pure Python, ~0.08 ms of CPU per logged step) took their time slices at normal
    priority. The process itself stays at the trainer's priority for the end (``main``)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: it runs at the process's priority
        pass
    try:
        while not stop.is_set():
            with turn:  # one thread hands lines on at a time: main() takes over at the end
                more = not stop.is_set() and follower.poll()
            if not more:
                stop.wait(POLL_S)
    except BaseException as exc:  # noqa: BLE001 - main() re-raises it (or ends quietly: a removed run directory)
        errors.append(exc)
        stop.set()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Follow a run's metrics and events into its trackers.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--parent", type=int, required=True, help="exit (after a last drain) when this pid is gone")
    p.add_argument("--loggers", default="tensorboard", help="the trackers, comma-separated (trainer.loggers)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; it closes our stdin when done
    stop = threading.Event()
    threading.Thread(target=_until_eof, args=(stop,), daemon=True).start()
    try:
        # Waits while another sidecar (of a rank 0 that was killed) drains: two would hand the same lines on twice.
        _lock(args.run_dir, wait=True)
    except FileNotFoundError:
        return  # the run directory was removed under us (a temporary one): nothing to follow
    # Opening (MLflow's import and store: ~2.5 s of CPU, W&B's ~0.5 s) and the last drain at the end run at the
    # trainer's priority, only the following while it trains at nice NICE (_follow): a process at nice 10 on a
    # loaded machine (4 busy processes on 2 cores) opened no tracker in 60 s, and the run's end cut it off with
    # nothing written (issue 68). A nice value cannot be lowered again without privileges, hence the two threads.
    follower = _Follower(args.run_dir, open_trackers([n for n in args.loggers.split(",") if n], args.run_dir,
                                                     _params(args.run_dir)))
    turn, errors = threading.Lock(), []
    threading.Thread(target=_follow, args=(follower, turn, stop, errors), daemon=True).start()
    try:
        while os.getppid() == args.parent and not stop.wait(POLL_S):
            pass
        stop.set()
        with turn:  # the follower's batch in hand ends (at nice NICE: at most BATCH lines), then none starts
            if errors:
                raise errors[0]
            while follower.poll():  # the last lines, written before the trainer asked us to stop, a batch at a time
                pass
    except RunDirectoryMoved:  # removed under us (a temporary one), or moved: nothing left to follow there
        return
    except FileNotFoundError:
        if args.run_dir.is_dir():
            raise
        return  # the run directory was removed under us (a temporary one): nothing left to follow
    finally:
        follower.close()


if __name__ == "__main__":
    main()
