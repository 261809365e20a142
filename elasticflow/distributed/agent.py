"""The agent (job master): hosts the store, spawns and watches workers, owns membership.

Membership is a generation number plus the member list in rank order. At every change the agent
publishes the next generation in the store and rewrites RUN_DIR/workers.json (workers_json.py);
survivors keep their relative order, so ranks stay dense. Workers enter through a join request signed
with the job token; a refused request is logged to RUN_DIR/events.jsonl.

A generation that fails to form (rendezvous.py says when) is superseded by the next one, with the
members that arrived or reported; the others *wait* (alive, out of the generation) and re-enter a
later one once they arrive. Joiners admitted while a generation forms enter the next one together.

Health: a member whose heartbeat stops for ``elastic.heartbeat_timeout_s`` (a stopped process) is
SIGKILLed; so is one that never reports when its peers' collectives of a generation failed (a
deadlock or a stuck collective). Killing, not aborting, is what wakes peers blocked on it.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from ..console import DetachedConsole
from ..errors import ElasticFlowError, TrainingInterrupted
from ..fileio import append_event
from . import protocol, scaling, workers_json
from .process import Worker, listening_store
from .rendezvous import Rendezvous, key

log = logging.getLogger("elasticflow")
WATCH_S = 0.01     # how often the agent polls its workers: a SIGKILLed worker is noticed within ~10 ms
REQUESTS_S = 0.05  # how often join and scale requests are read: two store round trips, which every 10 ms
                   # were a sixth of the agent's CPU while training (scripts/bench_agent.py: 6.8% -> 5.6% of a
                   # core), taken from the workers' cores; a joiner waits <= 50 ms more, beside the seconds
                   # its process takes to start
HEALTH_S = 0.1     # how often heartbeats and failure reports are read
REPORT_GRACE_S = 2.0  # after a peer reports a failed collective, how long the others have to report too
CONSOLE_DRAIN_S = 30.0  # at the end, how long the agent waits for a console that is not read (then writes on)
CLEAN_EXITS = (protocol.EXIT_OK, protocol.EXIT_INTERRUPTED, protocol.EXIT_BELOW_MIN, protocol.EXIT_AGENT_LOST)


class Agent:
    """Run ``cfg`` with ``launcher.workers`` worker processes; returns rank 0's summary.

    ``launch(env)`` starts one worker process with that environment (the launcher's: local.py, slurm.py).
    """

    def __init__(self, cfg: Any, run_dir: Path, host: str = "127.0.0.1", *,
                 launch: Callable[[Dict[str, str]], subprocess.Popen], worker_env=None):
        self.cfg, self.run_dir, self.host, self.launch = cfg, Path(run_dir), host, launch
        self.worker_env = dict(worker_env or {})
        self.state_dir = self.run_dir / ".elasticflow"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.token = protocol.new_token(self.run_dir)
        self.store, self._listener = listening_store(host, cfg.elastic.timeout_s)
        self.address = f"{host}:{self.store.port}"
        self.preempted = False
        self.generation = -1                  # nothing published yet
        self.members: List[Worker] = []      # the published generation, rank order
        self.published: List[Worker] = []    # ... as published (members leave it as they exit)
        self.joining: Dict[int, Worker] = {}  # spawned, join request not yet accepted
        self.admitted: List[Worker] = []     # accepted, enter at the next generation
        self.retiring: List[Worker] = []     # dropped by a scale-down, exiting at a step boundary
        self.waiting: List[Worker] = []      # alive, left out of a generation that failed to form
        self.finished: List[Worker] = []
        self.next_id = 0
        self.requests_seen = 0                # join requests counted so far (join/count) ...
        self.unread: List[int] = []           # ... of which these have not been written yet
        self.restarts = 0
        self.dirty = False                    # members changed since the last publish
        self.below_min_since: Optional[float] = None
        self.stop_reason = ""
        self.interrupted = False
        self._notices: List[Tuple[str, Optional[str]]] = []  # the signal handlers' (line, event), for _watch
        self.started = time.monotonic()
        self.failed_reports_since: Dict[int, float] = {}
        self.rdv = Rendezvous(self.store, cfg.elastic.timeout_s)
        self.supersede_at: Optional[float] = None  # a failed generation's successor is due then (back-off)
        self.supersede_cause = ""

    # ------------------------------------------------------------------ workers
    def spawn(self) -> Worker:
        wid = self.next_id
        self.next_id += 1
        # The lowest slot no live worker holds: a replacement binds the GPU of the worker it replaces.
        held = {w.slot for w in self.members + self.admitted + list(self.joining.values()) + self.waiting}
        slot = next(i for i in range(len(held) + 1) if i not in held)
        env = {**os.environ, **self.worker_env, protocol.ENV_LOCAL_SLOT: str(slot),
               protocol.ENV_STORE: self.address, protocol.ENV_WORKER_ID: str(wid),
               protocol.ENV_RUN_DIR: str(self.run_dir), protocol.ENV_TOKEN: self.token,
               protocol.ENV_LOCAL_WORKERS: str(max(self.cfg.launcher.workers, self.target_workers() + 1)),
               protocol.ENV_SPAWNED_AT: str(time.time())}
        proc = self.launch(env)
        worker = Worker(wid, proc.pid, proc, slot=slot)
        self.joining[wid] = worker
        return worker

    def target_workers(self) -> int:
        return len(self.members) + len(self.admitted) + len(self.joining) + len(self.waiting)

    def publish(self, action: str = "train", reason: str = "") -> None:
        """Announce the next generation with the current members (admitted joiners enter now)."""
        for w in self.admitted:
            w.state = "training"
            w.hb_seen = time.monotonic()
        if self.generation < 0:  # the first generation ranks workers by id, not by who was quicker
            self.admitted.sort(key=lambda w: w.id)
        self.members += self.admitted
        self.admitted = []
        self.published = list(self.members)
        self.generation += 1
        g = self.generation
        if self.rdv.forming:  # replaced before it formed: a member left, or the job stops
            self.event("superseded", generation=self.rdv.generation, cause=reason or "a member left while it formed",
                       after_s=round(time.monotonic() - self.rdv.published_at, 3), waiting=[], retry_in_s=0)
        ids = [w.id for w in self.members]
        # The generation's record goes in before gen/current names it: a worker reads them in that order.
        self.store.set(protocol.generation_key(g), protocol.encode(ids, action, reason, [w.id for w in self.waiting]))
        self.store.set("gen/current", str(g))
        self.rdv.opened(g, ids, time.monotonic())
        self.dirty = False
        self.supersede_at = None
        self.event("generation", generation=g, members=ids, waiting=[w.id for w in self.waiting], action=action,
                   reason=reason)
        self.write_workers_json(action)

    def write_workers_json(self, action: str = "train") -> None:
        workers_json.write(self, action)

    def event(self, kind: str, **fields) -> None:
        append_event(self.run_dir / "events.jsonl", kind, "agent", **fields)

    # ------------------------------------------------------------------ main loop
    def run(self) -> Dict[str, Any]:
        OmegaConf.save(self.cfg, self.state_dir / "config.yaml")
        protocol.agent_file(self.run_dir).write_text(json.dumps(
            {"address": self.address, "pid": os.getpid(), "started": time.time()}))
        self.store.set("gen/current", "-1")
        self.store.add("join/count", 0)
        for _ in range(self.cfg.launcher.workers):
            self.spawn()
        self.write_workers_json()
        self.event("started", workers=list(self.joining), pids=[w.pid for w in self.joining.values()])
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        previous_usr1 = signal.signal(signal.SIGUSR1, self._on_preempt)
        console = DetachedConsole()  # a console nobody reads must not stop the watch (console.py)
        try:
            return self._watch()
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGUSR1, previous_usr1)
            self._announce()
            self._reap_all()
            workers_json.write_ended(self)
            protocol.agent_file(self.run_dir).unlink(missing_ok=True)
            console.close(timeout_s=CONSOLE_DRAIN_S)

    def _on_sigint(self, signum, frame) -> None:
        if self.interrupted:  # second Ctrl-C: stop everything now
            for w in self.live():
                w.signal(signal.SIGKILL)
            raise KeyboardInterrupt
        self.interrupted = True
        # Logged by _watch, not here: a handler that logs can interrupt a logging call holding the
        # console's lock and wait for it forever (signals.StopSignal has the story).
        self._notices.append(("Ctrl-C: workers finish the current step and write a checkpoint (Ctrl-C again to abort)",
                              None))
        for w in self.members:
            w.signal(signal.SIGINT)
        for w in [*self.joining.values(), *self.admitted, *self.waiting]:
            w.signal(signal.SIGKILL)

    def _on_preempt(self, signum, frame) -> None:
        """SLURM's warning before preemption or the time limit: checkpoint at the next step and stop."""
        if self.preempted:
            return
        self.preempted = True
        self._notices.append(("preemption warning (SIGUSR1): workers checkpoint at the next step boundary", "preempt"))
        self._on_sigint(signum, frame)

    def _announce(self) -> None:
        """Log what the signal handlers recorded (and the preemption's event), from the loop."""
        while self._notices:
            line, event = self._notices.pop(0)
            log.warning("%s", line)
            if event is not None:
                self.event(event, generation=self.generation)

    def live(self) -> List[Worker]:
        return [*self.members, *self.joining.values(), *self.admitted, *self.retiring, *self.waiting]

    def _watch(self) -> Dict[str, Any]:
        next_health = next_requests = 0.0
        while True:
            self._announce()
            error = self._reap()  # waitpid: no store round trip
            if error is not None:
                return self._fail_with_worker_error(*error)
            now = time.monotonic()
            if now >= next_requests:
                self._admit()
                self._control()
                next_requests = now + REQUESTS_S
            if now >= next_health:
                self._check_health(now)
                next_health = now + HEALTH_S
            self._maybe_publish(now)
            if not self.members and self.generation >= 0 and (
                    self.finished or not (self.joining or self.admitted or self.waiting)):
                return self._result()
            if self.generation < 0 and not self.live():  # every worker died before the first generation
                return self._result()
            time.sleep(WATCH_S)

    # ------------------------------------------------------------------ exits
    def _reap(self):
        for w in list(self.members):
            rc = w.poll()
            if rc is None:
                continue
            self.members.remove(w)
            if rc in CLEAN_EXITS:
                w.state = "finished"
                self.finished.append(w)
            elif rc in (1, 2, protocol.EXIT_REFUSED):
                self.finished.append(w)
                return w, rc
            else:
                self._lost(w, f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}")
        for w in list(self.joining.values()) + list(self.admitted):
            rc = w.poll()
            if rc is None:
                continue
            self.joining.pop(w.id, None)
            if w in self.admitted:
                self.admitted.remove(w)
            if rc in (1, 2):
                return w, rc
            self.event("join_failed", worker=w.id, pid=w.pid, exit_code=rc)
            self._maybe_restart(w)
        for w in list(self.waiting):
            rc = w.poll()
            if rc is None:
                continue
            self.waiting.remove(w)
            if rc in (1, 2, protocol.EXIT_REFUSED):
                self.finished.append(w)
                return w, rc
            if rc in CLEAN_EXITS or rc == protocol.EXIT_REMOVED:
                w.state = "finished"
                self.finished.append(w)
            else:  # not in the generation: its loss changes no group, so nothing to publish
                self._lost(w, f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}", dirty=False)
        for w in list(self.retiring):
            rc = w.poll()
            if rc is not None:
                self.retiring.remove(w)
                self.event("retired", worker=w.id, pid=w.pid, exit_code=rc)
                self.write_workers_json()
        return None

    def _lost(self, w: Worker, cause: str, dirty: bool = True) -> None:
        log.warning("worker %d (pid %d) left (%s)", w.id, w.pid, cause)
        self.event("left", worker=w.id, pid=w.pid, cause=cause, generation=self.generation)
        self.dirty = self.dirty or dirty
        self._maybe_restart(w)

    def _maybe_restart(self, w: Worker) -> None:
        lc = self.cfg.launcher
        if not lc.restart_failed or self.finished or self.interrupted:
            return
        if self.restarts >= lc.max_restarts:
            self.event("restart_refused", replacing=w.id, restarts=self.restarts, max_restarts=lc.max_restarts)
            return
        self.restarts += 1
        new = self.spawn()
        self.event("restart", replacing=w.id, worker=new.id, pid=new.pid, restarts=self.restarts)
        self.write_workers_json()

    # ------------------------------------------------------------------ joins
    def _admit(self) -> None:
        count = int(self.store.add("join/count", 0))
        self.unread += range(self.requests_seen + 1, count + 1)
        self.requests_seen = count
        # Each counted request is read when it is written, in any order: a joiner killed or stopped between
        # counting itself and writing its request must not hold up every join behind it. (A dead one's number
        # stays in the list: one store round trip per round each, no more.)
        for n in list(self.unread):
            key = f"join/request/{n}"
            if not self.store.check([key]):
                continue  # counted but not written yet; next round
            self.unread.remove(n)
            try:
                request = protocol.decode(self.store.get(key))
                verdict = self._judge(n, request)
            except (ValueError, KeyError) as exc:
                verdict = {"ok": False, "reason": f"malformed join request ({exc})"}
                request = {}
            if not verdict["ok"]:
                log.warning("refused a join request from pid %s on %s: %s", request.get("pid"), request.get("host"),
                            verdict["reason"])
                self.event("refused", pid=request.get("pid"), host=request.get("host"), reason=verdict["reason"])
            self.store.set(f"join/verdict/{n}", json.dumps(verdict))
            if verdict["ok"]:
                self.write_workers_json()  # `status` and `scale` see it admitted (it enters the next generation)

    def _judge(self, n: int, request: dict) -> dict:
        wid, pid = int(request["id"]), int(request["pid"])
        if not protocol.verify(self.token, f"{n}:{wid}:{pid}", request.get("mac", "")):
            return {"ok": False, "reason": "wrong or missing job token"}
        cap = self.cfg.launcher.max_workers
        if cap and len(self.members) + len(self.admitted) >= cap:
            return {"ok": False, "reason": f"the job already has launcher.max_workers={cap} workers"}
        worker = self.joining.pop(wid, None)
        if worker is not None:
            worker.pid = pid  # behind srun, the process we started is srun, not the worker
        else:
            # Started by someone holding the token (another launcher): give it a fresh id.
            worker = Worker(self.next_id, pid, None, request.get("host", "?"))
            self.next_id += 1
        worker.state = "admitted"
        worker.host = request.get("host", worker.host)
        self.admitted.append(worker)
        return {"ok": True, "id": worker.id}

    def _maybe_publish(self, now: float) -> None:
        lc, el = self.cfg.launcher, self.cfg.elastic
        if self.generation < 0:
            # The first generation waits for every initial worker (or min_workers after wait_s).
            ready = len(self.admitted)
            if ready and (not self.joining or (now - self.started > el.wait_s and ready >= lc.min_workers)):
                self.publish()
            return
        if not (self.members or self.admitted):
            return
        if self.supersede_at is not None:
            if now < self.supersede_at and not self.dirty:
                return  # back-off after repeated failures to form
        elif not self.dirty and (not self.admitted or self.rdv.forming):
            return  # joiners admitted while a generation forms enter the next one, together
        if len(self.members) + len(self.admitted) >= lc.min_workers:
            if self.below_min_since is not None:
                self._below_min_ended(now, "resumed")
            self.publish(reason=self.supersede_cause if self.supersede_at is not None else "")
            return
        if self.below_min_since is None:
            self.below_min_since = now
            log.warning("%d worker(s) left, fewer than launcher.min_workers=%d; waiting up to elastic.wait_s=%gs",
                        len(self.members), lc.min_workers, el.wait_s)
        elif now - self.below_min_since > el.wait_s:
            self.stop_reason = (f"only {len(self.members)} worker(s) left, fewer than launcher.min_workers="
                                f"{lc.min_workers}, for elastic.wait_s={el.wait_s:g}s")
            self._below_min_ended(now, "stopped")
            self.event("stop", reason=self.stop_reason, generation=self.generation + 1)
            self.publish("stop", self.stop_reason)

    def _below_min_ended(self, now: float, outcome: str) -> None:
        """The wait below launcher.min_workers is over (the goodput ledger's ``below_min``)."""
        self.event("below_min", waited_s=round(now - self.below_min_since, 4), outcome=outcome,
                   min_workers=self.cfg.launcher.min_workers, workers=len(self.members) + len(self.admitted))
        self.below_min_since = None

    # ------------------------------------------------------------------ health
    def _check_health(self, now: float) -> None:
        el = self.cfg.elastic
        # Retiring workers too: until a retiring worker leaves at the step boundary it is still in the current
        # group, and its peers' allreduce waits for it; stopped, it would hold them for elastic.timeout_s.
        for w in [*self.members, *self.waiting, *self.retiring]:
            if w.state == "killed":
                continue
            beats = int(self.store.add(f"worker/{w.id}/hb", 0))
            if beats != w.hb_value:
                w.hb_value, w.hb_seen = beats, now
            elif now - w.hb_seen > el.heartbeat_timeout_s:
                self._cut_out(w, f"no heartbeat for {now - w.hb_seen:.1f}s (stopped or hung)")
        g = self.generation
        if g < 0 or not self.members:
            return
        if self.supersede_at is None:
            # A waiting worker that arrived at the newest generation is ready: it enters the next one. (Not
            # while a successor is due: it arrived at the failed generation, before it was left out.)
            for w in [w for w in self.waiting if self.store.check([key(g, "arrived", w.id)])]:
                self.waiting.remove(w)
                w.state = "admitted"
                self.admitted.append(w)
        if not self.dirty:  # when dirty, the next generation is published this round anyway
            verdict = self.rdv.poll(now, [w.id for w in self.members if w.state != "killed"])
            if verdict is not None:
                self._judged(verdict, now)
        if self.rdv.phase != "formed":
            return
        reported = [w for w in self.members if self.store.check([key(g, "failed", w.id)])]
        if not reported or len(reported) == len(self.members):
            self.failed_reports_since.pop(g, None)
            return
        since = self.failed_reports_since.setdefault(g, now)
        if now - since > min(REPORT_GRACE_S, el.heartbeat_timeout_s):
            for w in self.members:
                if w not in reported and w.state != "killed":
                    self._cut_out(w, "its peers' collectives failed and it never reported (stuck or deadlocked)")

    def _judged(self, v, now: float) -> None:
        """The forming generation formed, or failed: then its successor is due (after the back-off)."""
        if v.outcome == "formed":
            for w in self.members:
                w.has_state = True
            self.event("formed", generation=v.generation, world=len(self.rdv.ids), formed_s=round(v.after_s, 3))
            return
        keep = [w for w in self.members if w.id in v.keep and w.state != "killed"]
        alive = [w for w in self.members if w.state != "killed"]
        if len(keep) < max(1, self.cfg.launcher.min_workers) or not any(w.has_state for w in keep):
            # Too few to go on without the rest, or only joiners, who hold no training state: retry with
            # every live member (after the back-off).
            keep = alive
        left_out = [w for w in alive if w not in keep]
        for w in left_out:
            w.state = "waiting"
        self.waiting += left_out
        self.members = [w for w in self.members if w not in left_out]
        delay = self.rdv.backoff_s()
        log.warning("generation %d did not form (%s); the next one in %.2fs with %d worker(s)",
                    v.generation, v.cause, delay, len(keep))
        self.event("superseded", generation=v.generation, cause=v.cause, after_s=round(v.after_s, 3),
                   waiting=[w.id for w in left_out], retry_in_s=delay, failures=self.rdv.failures)
        self.supersede_at, self.supersede_cause = now + delay, v.cause

    def _cut_out(self, w: Worker, why: str) -> None:
        log.warning("worker %d (pid %d): %s; killing it", w.id, w.pid, why)
        self.event("hung", worker=w.id, pid=w.pid, reason=why, generation=self.generation)
        w.state = "killed"
        w.signal(signal.SIGKILL)
        if w.proc is None:  # not our child: we cannot wait for its exit code
            if w in self.retiring:
                self.retiring.remove(w)
                self.event("retired", worker=w.id, pid=w.pid, exit_code=-int(signal.SIGKILL))
                return
            member = w in self.members
            (self.members if member else self.waiting).remove(w)
            self._lost(w, "killed: hung", dirty=member)  # a waiting worker is in no group: nothing to publish

    # ------------------------------------------------------------------ scale requests
    def _control(self) -> None:
        scaling.serve(self)

    # ------------------------------------------------------------------ the end
    def _result(self) -> Dict[str, Any]:
        for w in [*self.joining.values(), *self.admitted, *self.waiting]:  # training ended without them
            w.signal(signal.SIGKILL)
        codes = [w.poll() for w in self.finished]
        if protocol.EXIT_BELOW_MIN in codes:
            raise ElasticFlowError((self.stop_reason or "too few workers") + "; a checkpoint was written",
                                   "resume with the same command (resume=auto), or lower launcher.min_workers",
                                   exit_code=protocol.EXIT_BELOW_MIN)
        if protocol.EXIT_INTERRUPTED in codes or self.interrupted:
            raise TrainingInterrupted()
        if protocol.EXIT_OK not in codes:
            raise ElasticFlowError("every worker died; nothing finished training",
                                   "see the worker logs under RUN_DIR/logs/; resume=auto continues from the "
                                   "newest checkpoint", exit_code=1)
        summary_file = self.run_dir / "summary.json"
        return json.loads(summary_file.read_text()) if summary_file.is_file() else {}

    def _fail_with_worker_error(self, w: Worker, rc: int) -> Dict[str, Any]:
        err_file = self.state_dir / f"error-{w.id}.json"
        err = json.loads(err_file.read_text()) if err_file.is_file() else {
            "message": f"worker {w.id} failed with exit code {rc}", "hint": "see RUN_DIR/logs/"}
        for other in self.live():
            other.signal(signal.SIGTERM)
        raise ElasticFlowError(err["message"], err.get("hint", ""), exit_code=rc)

    def _reap_all(self) -> None:
        deadline = time.monotonic() + 10
        for w in self.live():
            while w.poll() is None and w.proc is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            if w.poll() is None:
                w.signal(signal.SIGKILL)
                if w.proc is not None:
                    w.proc.wait(5)
