"""`elasticflow scale` and `inject`, and the devices `elasticflow status` shows: talk to a running job through its run
directory and its agent's store. (The status page itself is rendered above, in ``elasticflow.observability.status``.)"""
from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Dict, Iterable

from ...errors import ElasticFlowError
from .. import protocol
from ..store import stores
from . import inject as injection, scaling

ASK_AGAIN_S = 3.0  # a scale request unanswered this long is written again (the agent answers within ~50 ms)


def _running_agent(run_dir: Path) -> dict:
    path = protocol.agent_file(run_dir)
    if not run_dir.is_dir():
        raise ElasticFlowError(f"run directory '{run_dir}' does not exist", "pass the run's hydra.run.dir")
    if not path.is_file():
        raise ElasticFlowError(f"no running agent in '{run_dir}' (the job has ended, or it runs one worker "
                               "in-process)", "start multi-worker jobs with launcher.workers=N or "
                               "launcher.max_workers=N to reach them with scale or inject")
    return json.loads(path.read_text())


def scale(run_dir: Path, workers: int, wait_s: float = 120.0) -> str:
    """Ask the job's agent for ``workers`` workers; return when the membership shows them (or after
    ``wait_s``); raise when the agent refuses, or the job ends first."""
    agent = _running_agent(run_dir)
    try:
        token = protocol.read_token(run_dir)
    except OSError as exc:
        raise ElasticFlowError(f"cannot read the job token in {run_dir}/.elasticflow/token ({exc.strerror})",
                               "run `elasticflow scale` as the user who started the job") from exc
    try:
        store = stores.client(agent["address"], 10.0, token)
    except Exception as exc:
        raise ElasticFlowError(f"the agent at {agent['address']} does not answer ({exc})",
                               "the job may have just ended; see `elasticflow status RUN_DIR`") from exc
    nonce, at = secrets.token_hex(8), time.time()
    request = json.dumps({"workers": workers, "nonce": nonce, "time": at, "mac": protocol.sign(
        token, scaling.scale_message(str(agent.get("job", "")), workers, nonce, at))})
    # Each request in a numbered slot of its own (the agent reads them all): a single slot could be held by
    # anyone, so that real requests time out waiting for it.
    reply_key, verdicts = f"control/reply/{nonce}", protocol.Sealer(token)
    deadline, reply, asked = time.monotonic() + 30, None, 0.0
    while reply is None:
        if time.monotonic() > deadline:
            raise ElasticFlowError(f"the agent at {agent['address']} did not answer the scale request within 30s",
                                   "the agent answers only requests signed with the job's token: is "
                                   "RUN_DIR/.elasticflow/token this run's? Else the agent may be stopped or "
                                   "overloaded; see `elasticflow status RUN_DIR`")
        if time.monotonic() - asked > ASK_AGAIN_S:
            # Again, under a new number, while unanswered: a stranger may have deleted or overwritten the request
            # (or reset the counter below what the agent read). The nonce is taken once, so it acts once.
            store.set(f"control/request/{protocol.draw(store, 'control/count', 'control/count')}", request)
            asked = time.monotonic()
        reply = protocol.fetch_json(store, verdicts, reply_key, "scale reply")
        time.sleep(0.02)
    if not reply["ok"]:
        raise ElasticFlowError(f"the agent refused to scale to {workers}: {reply['reason']}",
                               "choose a number within launcher.min_workers..launcher.max_workers")
    return _await_target(run_dir, workers, wait_s)


def inject(run_dir: Path, action: str, rank: int, factor: float = 1.0, for_s: float = 0.0, tensor: str = "") -> str:
    """Ask the job's agent to cause ``action`` (kill, hang, slow, bitflip: ``factor`` the bit, ``tensor`` the
    parameter) on the member at ``rank`` (agent/inject.py); returns the line to print, naming the worker and its
    pid; raises when the agent refuses or does not answer."""
    agent = _running_agent(run_dir)
    try:
        token = protocol.read_token(run_dir)
        store = stores.client(agent["address"], 10.0, token)
    except OSError as exc:
        raise ElasticFlowError(f"cannot read the job token in {run_dir}/.elasticflow/token ({exc.strerror})",
                               "run `elasticflow inject` as the user who started the job") from exc
    except Exception as exc:
        raise ElasticFlowError(f"the agent at {agent['address']} does not answer ({exc})",
                               "the job may have just ended; see `elasticflow status RUN_DIR`") from exc
    nonce, at = secrets.token_hex(8), time.time()
    factor, for_s = float(factor), float(for_s)
    request = json.dumps({"action": action, "rank": rank, "factor": factor, "for_s": for_s, "nonce": nonce,
                          "time": at, "tensor": tensor, "mac": protocol.sign(token, injection.message(
                              str(agent.get("job", "")), action, rank, factor, for_s, nonce, at, tensor))})
    verdicts, deadline, reply, asked = protocol.Sealer(token), time.monotonic() + 30, None, 0.0
    while reply is None:  # as scale's: again under a new number while unanswered; the nonce acts once
        if time.monotonic() > deadline or not protocol.agent_file(run_dir).is_file():
            raise ElasticFlowError(f"the agent at {agent['address']} did not answer the inject request",
                                   f"the job may have ended, or the token is not this run's; see `elasticflow "
                                   f"status {run_dir}`")
        if time.monotonic() - asked > ASK_AGAIN_S:
            store.set(f"{injection.REQUEST_PREFIX}/{protocol.draw(store, injection.COUNT_KEY, injection.COUNT_KEY)}",
                      request)
            asked = time.monotonic()
        reply = protocol.fetch_json(store, verdicts, injection.reply_key(nonce), "inject reply")
        time.sleep(0.02)
    if not reply["ok"]:
        raise ElasticFlowError(f"the agent refused to inject {action} at rank {rank}: {reply['reason']}",
                               f"see the ranks in `elasticflow status {run_dir}`")
    who = f"rank {rank} (worker {reply['worker_id']}, pid {reply['pid']} on {reply['host']})"
    if action == "kill":
        return f"killed {who} with SIGKILL: the others regroup without it"
    if action == "hang":
        return (f"stopped {who} with SIGSTOP: the job cuts it out as hung after elastic.heartbeat_timeout_s")
    if action == "bitflip":
        return (f"asked {who} to flip bit {int(factor)} of {tensor or 'its first parameter'}[0] at its next step "
                "(within a second): its worker log says what it flipped, the members' fingerprints catch it")
    if factor <= 1.0:
        return f"ended the slowdown of {who} (from its next step boundary)"
    return (f"slowed {who} {factor:g}x{f' for {for_s:g}s' if for_s > 0 else ' until the run ends'}, from its "
            "next step boundary (within a second)")


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


def devices(run_dir: Path, worker_ids: Iterable[int]) -> Dict[int, str]:
    """Each worker's ``worker/<id>/device`` in the running job's store; missing ones are left out.

    Empty when the store does not answer (the job ended while we read): status then shows no devices.
    Costs a store connection and two round trips per worker.
    """
    try:
        try:
            token = protocol.read_token(run_dir)
        except OSError:
            token = None  # a plain TCPStore needs none; the job's own stores refuse us: no devices shown
        store = stores.client(json.loads(protocol.agent_file(run_dir).read_text())["address"], 2.0, token)
        found = {}
        for wid in worker_ids:
            key = protocol.device_key(wid)
            raw = protocol.read(store, key)  # never get(): it waits for a missing key
            if raw is not None:
                found[wid] = raw.decode(errors="replace")
        return found
    except Exception:
        return {}
