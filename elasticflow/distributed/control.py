"""`elasticflow scale` and `elasticflow status`: talk to a running job through its run directory."""
from __future__ import annotations

import datetime
import json
import secrets
import time
from pathlib import Path
from typing import Dict, Iterable, List

from ..errors import ElasticFlowError
from ..fileio import read_jsonl
from . import protocol


def _running_agent(run_dir: Path) -> dict:
    path = protocol.agent_file(run_dir)
    if not run_dir.is_dir():
        raise ElasticFlowError(f"run directory '{run_dir}' does not exist", "pass the run's hydra.run.dir")
    if not path.is_file():
        raise ElasticFlowError(f"no running agent in '{run_dir}' (the job has ended, or it runs one worker "
                               "in-process)", "start multi-worker jobs with launcher.workers=N or "
                               "launcher.max_workers=N to be able to scale them")
    return json.loads(path.read_text())


def scale(run_dir: Path, workers: int, wait_s: float = 120.0) -> str:
    """Ask the job's agent for ``workers`` workers; return when the membership shows them (or after
    ``wait_s``); raise when the agent refuses, or the job ends first."""
    from torch.distributed import TCPStore

    agent = _running_agent(run_dir)
    try:
        token = protocol.read_token(run_dir)
    except OSError as exc:
        raise ElasticFlowError(f"cannot read the job token in {run_dir}/.elasticflow/token ({exc.strerror})",
                               "run `elasticflow scale` as the user who started the job") from exc
    host, port = agent["address"].rsplit(":", 1)
    try:
        store = TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=10))
    except Exception as exc:
        raise ElasticFlowError(f"the agent at {agent['address']} does not answer ({exc})",
                               "the job may have just ended; see `elasticflow status RUN_DIR`") from exc
    nonce = secrets.token_hex(8)
    request = json.dumps({"workers": workers, "nonce": nonce, "mac": protocol.sign(token, f"scale:{workers}:{nonce}")})
    # One request slot, taken only while free: a plain set would overwrite another `scale` command's request
    # not yet read (two at once: one was lost and its client waited 30 s for a reply that never came).
    deadline = time.monotonic() + 30
    while store.compare_set("control/scale", "", request).decode() != request:
        if time.monotonic() > deadline:
            raise ElasticFlowError(f"the agent at {agent['address']} did not take the scale request within 30s "
                                   "(another request is still pending)",
                                   "the agent may be stopped or overloaded; see `elasticflow status RUN_DIR`")
        time.sleep(0.02)
    store.wait([f"control/reply/{nonce}"], datetime.timedelta(seconds=30))
    reply = json.loads(store.get(f"control/reply/{nonce}"))
    if not reply["ok"]:
        raise ElasticFlowError(f"the agent refused to scale to {workers}: {reply['reason']}",
                               "choose a number within launcher.min_workers..launcher.max_workers")
    return _await_target(run_dir, workers, wait_s)


def _await_target(run_dir: Path, workers: int, wait_s: float) -> str:
    """Watch workers.json until the job has ``workers`` members, or has ended, or ``wait_s`` passed.

    Returns the line to print when the target is reached; raises when the job ended first (its agent
    file is gone) or a worker was refused on the way in (e.g. the job is full).
    """
    deadline = time.monotonic() + wait_s
    refused_before = _count_refused(run_dir)
    while True:
        snapshot = json.loads((run_dir / "workers.json").read_text())
        if (len(snapshot["members"]) == workers and not snapshot["joining"] and not snapshot["retiring"]
                and not snapshot.get("waiting")):
            return f"reached: generation {snapshot['generation']} has {workers} workers"
        if not protocol.agent_file(run_dir).is_file():
            finished = (run_dir / "summary.json").is_file()
            raise ElasticFlowError(f"the job ended ({'it finished training' if finished else 'it stopped'}) with "
                                   f"{len(snapshot['members'])} worker(s), before reaching {workers}",
                                   f"see `elasticflow status {run_dir}`", exit_code=1)
        if _count_refused(run_dir) > refused_before:
            raise ElasticFlowError(f"the agent refused a worker on the way to {workers} workers",
                                   f"see the 'refused' events in `elasticflow status {run_dir}`", exit_code=1)
        if time.monotonic() > deadline:
            return (f"requested {workers} workers; still changing after {wait_s:g}s: generation "
                    f"{snapshot['generation']} has {len(snapshot['members'])} (see `elasticflow status {run_dir}`)")
        time.sleep(0.1)


def _count_refused(run_dir: Path) -> int:
    events = run_dir / "events.jsonl"
    return events.read_text().count('"event": "refused"') if events.is_file() else 0


def _devices(run_dir: Path, worker_ids: Iterable[int]) -> Dict[int, str]:
    """Each worker's ``worker/<id>/device`` in the running job's store; missing ones are left out.

    Empty when the store does not answer (the job ended while we read): status then shows no devices.
    Costs a store connection and two round trips per worker.
    """
    from torch.distributed import TCPStore

    try:
        host, port = json.loads(protocol.agent_file(run_dir).read_text())["address"].rsplit(":", 1)
        store = TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=2))
        found = {}
        for wid in worker_ids:
            key = protocol.device_key(wid)
            if store.check([key]):  # check first: get() on a missing key waits for the whole timeout
                found[wid] = store.get(key).decode()
        return found
    except Exception:
        return {}


def _check_run_dir(run_dir: Path) -> None:
    if not (run_dir / "workers.json").is_file() and not (run_dir / "metrics.jsonl").is_file():
        raise ElasticFlowError(f"'{run_dir}' is not a run directory (no workers.json or metrics.jsonl)",
                               "pass the run's hydra.run.dir, e.g. outputs/2026-11-22/10-00-00")


def _last_step(run_dir: Path) -> dict:
    """The newest training step's record of metrics.jsonl ({} before the first)."""
    from ..reporting import last_logged_step

    metrics = run_dir / "metrics.jsonl"
    step = last_logged_step(metrics)
    last = {}
    if step >= 0:
        for line in metrics.read_text().splitlines()[-50:]:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("step") == step and "loss" in record:
                last = record
    return last


def _recent_events(run_dir: Path, events: int) -> List[dict]:
    """The newest ``events`` membership events (the goodput ledger's own records left out)."""
    from ..goodput import ACCOUNTING_EVENTS

    membership = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") not in ACCOUNTING_EVENTS]
    return membership[-events:]


def status_record(run_dir: Path, events: int = 8) -> dict:
    """What `status --json` prints: running, workers.json, the newest step, recent events, the goodput ledger."""
    from .. import goodput

    _check_run_dir(run_dir)
    workers = run_dir / "workers.json"
    return {"run_dir": str(run_dir), "running": protocol.agent_file(run_dir).is_file(),
            "workers": json.loads(workers.read_text()) if workers.is_file() else None,
            "last_step": _last_step(run_dir) or None, "recent_events": _recent_events(run_dir, events),
            "goodput": goodput.load(run_dir)}


def status(run_dir: Path, events: int = 8) -> str:
    """Generation, members (and, while the job runs, each one's device), progress, recent membership
    events and the goodput ledger of a run (running or not)."""
    from .. import goodput

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
        devices = _devices(run_dir, [m["worker_id"] for m in snap["members"] + others]) if running else {}
        if devices:
            lines.append("devices:")
        for m in snap["members"] + others:
            if m["worker_id"] in devices:
                where = f"rank {m['rank']}" if m.get("rank") is not None else m["state"]
                lines.append(f"  worker {m['worker_id']}: {where}, {devices[m['worker_id']]}")
    last = _last_step(run_dir)
    if last:
        lines.append(f"step {last['step']}  epoch {last.get('epoch')}  samples consumed {last.get('samples_seen')}  "
                     f"loss {last.get('loss', float('nan')):.5g}")
    recent = _recent_events(run_dir, events)
    if recent:
        lines.append("recent events:")
    for e in recent:
        when = datetime.datetime.fromtimestamp(e.pop("time")).strftime("%H:%M:%S.%f")[:-3]
        kind = e.pop("event")
        e.pop("source", None)
        lines.append(f"  {when} {kind:<10} " + " ".join(f"{k}={v}" for k, v in e.items()))
    ledger = goodput.load(run_dir)
    if ledger is not None:
        lines.append(("so far: " if running else "") + goodput.render(ledger))
    return "\n".join(lines)
