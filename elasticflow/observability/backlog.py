"""How far each tracker (``trainer.loggers``) is behind the run's own records, and the backlog file that says so.

The sidecar (observability/sidecar.py) writes RUN_DIR/.elasticflow/trackers.json after each batch it handed
on: for each tracker, the bytes of metrics.jsonl and events.jsonl it has had (written through: flushed to
the tracker), and whether it was closed (an MLflow run marked FINISHED, a W&B run finished). A record is one
complete line of those files. What a tracker has not had when the run stops (the sidecar cut off at
``trainer.loggers_wait_s``, or a tracker that failed) is listed in RUN_DIR/trackers-backlog.json, with a
warning; the next start of the run, or ``elasticflow sync RUN_DIR``, catches it up and removes the file.
Nothing is lost meanwhile: metrics.jsonl and events.jsonl hold every record.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .._util import untrusted
from .._util.fileio import write_atomic

OFFSETS = "trackers.json"  # RUN_DIR/.elasticflow/trackers.json: what each tracker has had (above)
BACKLOG = "trackers-backlog.json"  # RUN_DIR/trackers-backlog.json: what each was missing when the run stopped
FILES = ("metrics", "events")  # RUN_DIR/<name>.jsonl, the records the trackers follow
TITLES = {"tensorboard": "TensorBoard", "csv": "CSV", "mlflow": "MLflow", "wandb": "W&B"}


def read_offsets(run_dir: Path) -> Dict[str, Dict[str, Any]]:
    """RUN_DIR/.elasticflow/trackers.json: ``{tracker: {"metrics": bytes, "events": bytes, "closed": bool}}``."""
    try:
        found = untrusted.loads((Path(run_dir) / ".elasticflow" / OFFSETS).read_text(), max_bytes=1 << 16)
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {name: {"closed": entry.get("closed") is True,
                   **{f: entry[f] for f in FILES if type(entry.get(f)) is int and entry[f] >= 0}}
            for name, entry in found.items() if isinstance(entry, dict)}


def write_offsets(run_dir: Path, offsets: Dict[str, Dict[str, Any]]) -> None:
    (Path(run_dir) / ".elasticflow").mkdir(exist_ok=True)  # not the run directory: one removed stays removed
    write_atomic(Path(run_dir) / ".elasticflow" / OFFSETS, json.dumps(offsets))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _lines(path: Path, upto: int = -1) -> int:
    """Complete lines in the first ``upto`` bytes of ``path`` (all of it with -1); 0 where it is missing."""
    count, left = 0, upto
    try:
        with open(path, "rb") as f:
            while left != 0:
                chunk = f.read(1 << 20 if left < 0 else min(left, 1 << 20))
                if not chunk:
                    break
                count += chunk.count(b"\n")
                left = left - len(chunk) if left > 0 else left
    except OSError:
        return 0
    return count


def sizes(run_dir: Path) -> Dict[str, int]:
    """The bytes of each record file now: ``behind``'s ``upto``."""
    return {f: _size(Path(run_dir) / f"{f}.jsonl") for f in FILES}


def behind(run_dir: Path, loggers: Iterable[str], upto: Optional[Dict[str, int]] = None
           ) -> Dict[str, Tuple[int, int, bool]]:
    """``{tracker: (records it has had, records of the run, closed)}`` for each of ``loggers`` that lacks a record
    or was not closed; {} when every one is caught up. A tracker the sidecar never got to (cut off while it
    imported its library) has had 0. ``upto``: the bytes of each file that count (``sizes`` when the run
    stopped); default all."""
    run_dir, offsets = Path(run_dir), read_offsets(run_dir)
    sizes_now = sizes(run_dir)
    sizes_ = {f: min(sizes_now[f], (upto or sizes_now)[f]) for f in FILES}
    loggers = [n for n in loggers if not offsets.get(n, {}).get("closed")
               or any(offsets[n].get(f, 0) < sizes_[f] for f in FILES)]
    if not loggers:  # the usual end: each had every byte and was closed; no file is read
        return {}
    totals = {f: _lines(run_dir / f"{f}.jsonl", sizes_[f]) for f in FILES}
    out = {}
    for name in loggers:
        entry = offsets.get(name, {})
        had = sum(totals[f] if entry.get(f, 0) >= sizes_[f] else _lines(run_dir / f"{f}.jsonl", entry.get(f, 0))
                  for f in FILES)
        total = sum(totals.values())
        if had < total or not entry.get("closed"):
            out[name] = (had, total, bool(entry.get("closed")))
    return out


def describe(lagging: Dict[str, Tuple[int, int, bool]]) -> str:
    """``MLflow has 120 of 400 records`` (and the others), or ``... has every record but was not closed``."""
    return ", ".join(f"{TITLES.get(n, n)} has {had} of {total} records" if had < total
                     else f"{TITLES.get(n, n)} has every record but was not closed" for n, (had, total, _)
                     in lagging.items())


def progress_line(run_dir: Path, loggers: Iterable[str], left_s: float, upto: Optional[Dict[str, int]] = None
                  ) -> str:
    """What the trainer prints while it waits for the sidecar: ``waiting for MLflow to catch up: 120 of 400
    records``, one clause a tracker behind."""
    lagging = {n: v for n, v in behind(run_dir, loggers, upto).items() if v[0] < v[1]}
    if not lagging:
        return f"waiting for the trackers to close (at most {left_s:.0f} s more: trainer.loggers_wait_s)"
    bound = f" (at most {left_s:.0f} s more: trainer.loggers_wait_s)"
    if len(lagging) == 1:
        (name, (had, total, _)), = lagging.items()
        return f"waiting for {TITLES.get(name, name)} to catch up: {had} of {total} records{bound}"
    each = [f"{TITLES.get(n, n)} ({had} of {total} records)" for n, (had, total, _) in lagging.items()]
    return f"waiting for {', '.join(each[:-1])} and {each[-1]} to catch up{bound}"


def settle(run_dir: Path, loggers: List[str], why: str, upto: Optional[Dict[str, int]] = None) -> str:
    """After the sidecar exited (or was cut off, ``why`` says how): list what each tracker lacks of the records up
    to ``upto`` in RUN_DIR/trackers-backlog.json and return the warning that says so, or remove the file and
    return ""."""
    run_dir = Path(run_dir)
    lagging = behind(run_dir, loggers, upto)
    path = run_dir / BACKLOG
    if not lagging:
        path.unlink(missing_ok=True)
        return ""
    write_atomic(path, json.dumps({"time": time.time(), "why": why, "sync": f"elasticflow sync {run_dir}",
                                   "trackers": {n: {"records": had, "of": total, "closed": closed}
                                                for n, (had, total, closed) in lagging.items()}}, indent=1))
    return (f"warning: the trackers are behind this run ({why}): {describe(lagging)}. Nothing is lost: "
            f"metrics.jsonl and events.jsonl hold every record, and the next start of this run catches them up, "
            f"or now: elasticflow sync {run_dir} (listed in {path})")


def pending(run_dir: Path) -> List[str]:
    """The trackers RUN_DIR/trackers-backlog.json lists ([] where there is none)."""
    try:
        found = untrusted.loads((Path(run_dir) / BACKLOG).read_text(), max_bytes=1 << 16)
    except (OSError, ValueError):
        return []
    trackers = found.get("trackers") if isinstance(found, dict) else None
    return [str(n) for n in trackers if n in TITLES] if isinstance(trackers, dict) else []
