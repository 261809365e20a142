"""`elasticflow status RUN_DIR [--json]`: a run at a glance, running or not, from its own records.

Generation, members (and, while the job runs, each one's device, asked of its agent's store by
``distributed.agent.control``), the newest step and its lr, the optimizer and schedule that train (not the config's
defaults where model() gave its own), recent membership events and the goodput ledger.
Rendering is the CLI's side: the distributed layer only answers what the running job knows.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import List, Optional, Tuple

from ..distributed import protocol
from ..distributed.agent import control
from ..errors import ElasticFlowError
from .._util.fileio import read_jsonl
from .._util import untrusted
from .._util.untrusted import printable

ETA_RECORDS = 50  # the newest step records whose pace the ETA assumes


def _check_run_dir(run_dir: Path) -> None:
    if not (run_dir / "workers.json").is_file() and not (run_dir / "metrics.jsonl").is_file():
        raise ElasticFlowError(f"'{run_dir}' is not a run directory (no workers.json or metrics.jsonl)",
                               "pass the run's hydra.run.dir, e.g. outputs/2026-11-22/10-00-00")


def _last_step(run_dir: Path) -> dict:
    """The newest training step's record of metrics.jsonl ({} before the first)."""
    from .reporting import last_logged_step

    metrics = run_dir / "metrics.jsonl"
    step = last_logged_step(metrics)
    last = {}
    if step >= 0:
        for line in metrics.read_text().splitlines()[-50:]:
            try:
                record = untrusted.loads(line, max_bytes=1 << 20)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("step") == step and untrusted.number(record.get("loss")):
                last = record
    return last


def _total_steps(run_dir: Path) -> Optional[int]:
    """The last step of the newest job's schedule (``reporting.SCHEDULE``, rank 0's at its first step), else None."""
    from .reporting import SCHEDULE

    try:
        found = untrusted.loads((run_dir / ".elasticflow" / SCHEDULE).read_text(), max_bytes=1 << 12)
    except (OSError, ValueError):
        return None
    total = found.get("total_steps") if isinstance(found, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None


def _eta(run_dir: Path, last: dict, total: Optional[int]) -> Optional[str]:
    """The time left at the pace of the last logged steps (up to ``ETA_RECORDS`` of them), as ``M:SS``; None
    without a total or a pace (one record, or times that do not move forward)."""
    from .reporting import clock

    if not total or last.get("step", total) >= total:
        return None
    steps = []
    with open(run_dir / "metrics.jsonl", "rb") as f:  # its tail only: a long run's file is large
        f.seek(0, 2)
        cut = f.tell() > 1 << 18
        f.seek(max(0, f.tell() - (1 << 18)))
        tail = f.read().decode(errors="replace").splitlines()[int(cut):]  # a cut first line is not a record
    for line in tail[-4 * ETA_RECORDS:]:
        try:
            r = untrusted.loads(line, max_bytes=1 << 20)
        except ValueError:
            continue
        if isinstance(r, dict) and "loss" in r and untrusted.number(r.get("time")) and isinstance(r.get("step"), int):
            steps.append((r["step"], r["time"]))
    steps = [p for p in steps if p[0] <= last["step"]][-ETA_RECORDS:]
    if len(steps) < 2 or steps[-1][0] <= steps[0][0] or steps[-1][1] <= steps[0][1]:
        return None
    per_step = (steps[-1][1] - steps[0][1]) / (steps[-1][0] - steps[0][0])
    return clock((total - last["step"]) * per_step)


def _optimizer(run_dir: Path) -> dict:
    """The optimizer, lr and schedule that train (``RunLog.trains_with``: rank 0's, from its first step), {} before."""
    from .reporting import OPTIMIZER

    try:
        found = untrusted.loads((run_dir / ".elasticflow" / OPTIMIZER).read_text(), max_bytes=1 << 16)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _recent_events(run_dir: Path, events: int) -> Tuple[List[dict], int]:
    """The newest ``events`` membership events (the goodput ledger's own records left out), and how many lines
    of events.jsonl were skipped as unreadable (torn, or crafted)."""
    from .goodput import ACCOUNTING_EVENTS

    records = read_jsonl(run_dir / "events.jsonl", timed=True)
    membership = [e for e in records if e.get("event") not in ACCOUNTING_EVENTS]
    return membership[-events:], records.skipped


def _stragglers(run_dir: Path) -> List[str]:
    """The shares by speed in force and the stragglers reported since the members last changed
    (train/balance.py's ``rebalanced`` and ``straggler`` events)."""
    found: List[str] = []
    for e in read_jsonl(run_dir / "events.jsonl", timed=True):
        kind = e.get("event")
        if kind in ("ready", "recovered", "regrouped", "joined"):
            found = []  # new members: equal shares again
        elif kind == "rebalanced" and isinstance(e.get("shares"), list):
            found = [x for x in found if not x.startswith("shares")]
            found.append(f"shares by speed since step {e.get('step')}: "
                         + "+".join(str(n) for n in e["shares"]) + " micro-batches by rank")
        elif kind == "straggler":
            found.append(f"straggler: worker {e.get('worker')} (rank {e.get('rank')}) {e.get('slowdown')}x the "
                         f"others' time per micro-batch, from step {e.get('step')} ({e.get('action')})")
    return found


def status_record(run_dir: Path, events: int = 8) -> dict:
    """What `status --json` prints: running, workers.json, the newest step, recent events, the goodput ledger."""
    from . import goodput

    _check_run_dir(run_dir)
    workers = run_dir / "workers.json"
    return {"run_dir": str(run_dir), "running": protocol.agent_file(run_dir).is_file(),
            "workers": json.loads(workers.read_text()) if workers.is_file() else None,
            "last_step": _last_step(run_dir) or None, "total_steps": _total_steps(run_dir),
            "optimizer": _optimizer(run_dir) or None,
            "recent_events": _recent_events(run_dir, events)[0], "stragglers": _stragglers(run_dir),
            "goodput": goodput.load(run_dir)}


def status(run_dir: Path, events: int = 8) -> str:
    """Generation, members (and, while the job runs, each one's device), progress, recent membership
    events and the goodput ledger of a run (running or not)."""
    from . import goodput

    _check_run_dir(run_dir)
    running = protocol.agent_file(run_dir).is_file()
    lines: List[str] = [f"run {run_dir}: {'running' if running else 'not running'}"]
    if (run_dir / "workers.json").is_file():
        snap = json.loads((run_dir / "workers.json").read_text())
        lines.append(f"generation {snap['generation']}  workers {len(snap['members'])}  "
                     f"restarts {snap.get('restarts', 0)}/{snap.get('max_restarts', '-')}")
        lines.append(f"  {'rank':>4}  {'worker':>6}  {'pid':>8}  {'host':<16} state")
        for m in snap["members"]:
            lines.append(f"  {m['rank']:>4}  {m['worker_id']:>6}  {m['pid']:>8}  {m['host']:<16} {m['state']}")
        others = snap.get("joining", []) + snap.get("retiring", [])
        for m in others:
            lines.append(f"  {'-':>4}  {m['worker_id']:>6}  {m['pid']:>8}  {m['host']:<16} {m['state']}")
        devices = control.devices(run_dir, [m["worker_id"] for m in snap["members"] + others]) if running else {}
        if devices:
            lines.append("devices:")
        for m in snap["members"] + others:
            if m["worker_id"] in devices:
                where = f"rank {m['rank']}" if m.get("rank") is not None else m["state"]
                lines.append(f"  worker {m['worker_id']}: {where}, {devices[m['worker_id']]}")
    last = _last_step(run_dir)
    if last:
        lr = f"  lr {last['lr']:.4g}" if untrusted.number(last.get("lr")) else ""
        total = _total_steps(run_dir)
        of = f" of {total}" if total else ""
        eta = _eta(run_dir, last, total) if running else None
        lines.append(f"step {last['step']}{of}  epoch {last.get('epoch')}  "
                     f"samples consumed {last.get('samples_seen')}  "
                     f"loss {last.get('loss', float('nan')):.5g}{lr}" + (f"  ETA {eta}" if eta else ""))
    o = _optimizer(run_dir)
    if o:
        schedule = o.get("schedule_detail", o.get("schedule"))
        lines.append(f"optimizer {o.get('name')}  lr {o.get('lr')}  schedule {schedule}  (from the "
                     f"{o.get('source', 'config')})")
    lines.extend(_stragglers(run_dir))
    recent, skipped = _recent_events(run_dir, events)
    if recent:
        lines.append("recent events:")
    for e in recent:
        when = datetime.datetime.fromtimestamp(e.pop("time")).strftime("%H:%M:%S.%f")[:-3]
        kind = e.pop("event")
        e.pop("source", None)
        lines.append(f"  {when} {kind:<10} " + " ".join(f"{k}={v}" for k, v in e.items()))
    if skipped:
        lines.append(f"  ({skipped} unreadable line{'s' if skipped != 1 else ''} of events.jsonl skipped)")
    ledger = goodput.load(run_dir)
    if ledger is not None:  # one line each: printable() below would show a newline as a literal \n
        lines.extend((("so far: " if running else "") + goodput.render(ledger)).splitlines())
    # Hosts, devices and reasons come from workers and requests: printed as text, never as terminal escapes.
    return "\n".join(printable(line, limit=4000) for line in lines)
