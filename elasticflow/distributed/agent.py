"""The agent (job master): hosts the store, spawns and watches workers, owns membership.

Membership is a generation number plus the member list in rank order. At every change the agent
publishes the next generation in the store and rewrites RUN_DIR/workers.json (workers_json.py);
survivors keep their relative order, so ranks stay dense. Workers enter through a join request signed
with the job token; a refused request is logged to RUN_DIR/events.jsonl.

A generation that fails to form (rendezvous.py says when) is superseded by the next one, with the
members that arrived or reported; the others *wait* (alive, out of the generation) and re-enter a
later one once they arrive. Joiners admitted while a generation forms enter the next one together.

Where each worker is in its lifecycle is the roster's (roster.py): one place per worker, its state written
as it moves. Health (heartbeats, failure reports, cutting out the silent) is health.py's. Every record the
agent writes is sealed with the job token and every one it reads is checked (_util/sealing.py).
"""
from __future__ import annotations

import gc
import json
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from .._util.console import DetachedConsole
from ..errors import ElasticFlowError, TrainingInterrupted
from .._util.fileio import append_event
from . import admission, health, hosts, leadership, protocol, scaling, stores, workers_json
from ..config.launchers import store_kind
from .etcd_store import Deposed
from .process import Worker
from .rendezvous import Rendezvous
from .roster import Roster

log = logging.getLogger("elasticflow")
WATCH_S = 0.01     # how often the agent polls its workers: a SIGKILLed worker is noticed within ~10 ms
REQUESTS_S = 0.05  # how often join and scale requests are read: two store round trips, which every 10 ms
                   # were a sixth of the agent's CPU while training (scripts/bench_agent.py: 6.8% -> 5.6% of a
                   # core), taken from the workers' cores; a joiner waits <= 50 ms more, beside the seconds
                   # its process takes to start
HEALTH_S = health.HEALTH_S  # how often heartbeats and failure reports are read
REAP_S = 10.0  # at the end, how long workers have to exit on their own before SIGKILL
CRASH_REAP_S = 120.0  # ... after the agent failed: time to agree on a last checkpoint and write it
CONSOLE_DRAIN_S = 30.0  # at the end, how long the agent waits for a console that is not read (then writes on)
CLEAN_EXITS = (protocol.EXIT_OK, protocol.EXIT_INTERRUPTED, protocol.EXIT_BELOW_MIN, protocol.EXIT_AGENT_LOST)


class Agent:
    """Run ``cfg`` with ``launcher.workers`` worker processes; returns rank 0's summary.

    ``launch(env)`` starts one worker process with that environment (the launcher's: local.py, slurm.py,
    nodes.py). ``port``: where the store listens (0: any free port); ``token``: the job's shared secret
    (None: a new random one). Workers on other hosts are started by their node agents (hosts.py).
    ``capacity`` (an attribute the launcher may set before ``run``): its source of more hosts
    (launchers/slurm_grow.py's worker jobs), or None. Its ``serve(agent)`` runs every request round,
    ``rescale(agent, target)`` answers a scale request first (scaling.py), ``close(agent)`` runs at the end.
    """

    def __init__(self, cfg: Any, run_dir: Path, host: str = "127.0.0.1", *,
                 launch: Callable[[Dict[str, str]], subprocess.Popen], worker_env=None, port: int = 0,
                 token: Optional[str] = None, served: Optional[tuple] = None, job: Optional[str] = None):
        self.cfg, self.run_dir, self.host, self.launch = cfg, Path(run_dir), host, launch
        self.capacity = None
        self.worker_env = dict(worker_env or {})
        self.state_dir = self.run_dir / ".elasticflow"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.token = protocol.new_token(self.run_dir, token)
        self.job = job or secrets.token_hex(8)  # this run's id, inside every record's MAC (_util/sealing.py)
        self.sealer = protocol.Sealer(self.token, self.job)
        self.verdicts = protocol.Sealer(self.token)  # join verdicts: they hand the job id out
        self.refused_joins = 0
        self.join_rechecks: Dict[int, tuple] = {}  # admission: requests that failed their MAC, read again
        self.record: Dict[str, str] = {}      # the agent's own records as sealed, put back if a stranger replaces one
        protocol.REFUSED.on_first = lambda kind, detail: self.event("forged", record=kind, detail=detail)
        kind = store_kind(cfg.launcher)
        # ``served``: (client, address, close) of a store this process does not serve (etcd: launchers/failover.py)
        self.store, self.address, self._stop_serving = served or stores.serve(kind, host, port, self.state_dir,
                                                                              cfg.elastic.timeout_s, self.token)
        if kind == stores.TCP:
            log.warning("the job's store is a TCPStore on %s, which anyone who reaches it may connect to (every "
                        "record is sealed, the connection is not): keep the job on a network only your hosts "
                        "reach (docs/security.md)", self.address)
        self.hosts = hosts.Hosts(self)        # the node agents of other hosts, and their workers' exits
        self.leader = None                    # launcher.store=etcd: this agent's lease (leadership.Leadership)
        self.local_workers = cfg.launcher.workers  # started here at the start (etcd: 0, each host's node agent's)
        self.preempted = False
        self.generation = -1                  # nothing published yet
        self.roster = Roster()                # every worker, in one place of its lifecycle (roster.py)
        self.published: List[Worker] = []    # the published generation's members as published (they leave
                                             # roster.members as they exit)
        # Every worker of a starting job asks at once: the backlog holds them all (at 1,024 workers, 256 dropped
        # the older requests of each burst, whose workers asked again 5 s later, and some gave up)
        lc = cfg.launcher
        expected = max(lc.workers * (lc.nodes or 1), lc.max_workers or 0)
        self.join_requests = protocol.Inbox("join/count", "join/request", backlog=max(256, 2 * expected))
        self.scale_requests = protocol.Inbox("control/count", "control/request")
        self.scale_nonces: Dict[str, None] = {}  # taken once (scaling.py), oldest first
        self.restarts = 0
        self.dirty = False                    # members changed since the last publish
        self.gone: List[int] = []             # members declared gone since the last publish (its record's "gone")
        self.below_min_since: Optional[float] = None
        self.stop_reason = ""
        self.interrupted = False
        self._notices: List[Tuple[str, Optional[str]]] = []  # the signal handlers' (line, event), for _watch
        self.started = time.monotonic()
        self.failed_reports_since: Dict[int, float] = {}
        self.hb_cursor = 0                    # health.due: where the next round's heartbeat reads start
        self.rdv = Rendezvous(self.store, cfg.elastic.timeout_s, self.sealer)
        self.supersede_at: Optional[float] = None  # a failed generation's successor is due then (back-off)
        self.trained = False                  # a member finished training (exit 0): nothing more is published
        self.supersede_cause = ""

    # ------------------------------------------------------------------ workers
    # The roster's places, to read (moves go through self.roster).
    members = property(lambda self: self.roster.members, doc="the published generation, rank order")
    joining = property(lambda self: self.roster.joining, doc="spawned, join request not yet accepted")
    admitted = property(lambda self: self.roster.admitted, doc="accepted, enter at the next generation")
    waiting = property(lambda self: self.roster.waiting, doc="alive, left out of a generation that failed")
    retiring = property(lambda self: self.roster.retiring, doc="leaving after a scale-down")
    finished = property(lambda self: self.roster.finished, doc="exited after training or a clean stop")

    def new_id(self) -> int:
        """The next worker id, from the store's counter: node agents on other hosts draw from it too."""
        return protocol.draw(self.store, protocol.IDS_KEY, protocol.IDS_KEY) - 1

    def spawn(self) -> Worker:
        wid = self.new_id()
        here = [w for w in self.members + self.admitted + list(self.joining.values()) + self.waiting if w.node is None]
        # The lowest slot no live worker of this host holds: a replacement binds the GPU of the one it replaces.
        held = {w.slot for w in here}
        slot = next(i for i in range(len(held) + 1) if i not in held)
        env = {**os.environ, **self.worker_env, protocol.ENV_LOCAL_SLOT: str(slot),
               protocol.ENV_STORE: self.address, protocol.ENV_WORKER_ID: str(wid),
               protocol.ENV_RUN_DIR: str(self.run_dir), protocol.ENV_TOKEN: self.token,
               protocol.ENV_LOCAL_WORKERS: str(max(self.cfg.launcher.workers, len(here) + 1)),
               protocol.ENV_SPAWNED_AT: str(time.time())}
        proc = self.launch(env)
        return self.roster.add(Worker(wid, proc.pid, proc, slot=slot))

    def target_workers(self) -> int:
        return len(self.members) + len(self.admitted) + len(self.joining) + len(self.waiting)

    def publish(self, action: str = "train", reason: str = "") -> None:
        """Announce the next generation with the current members (admitted joiners enter now)."""
        for w in self.admitted:
            w.hb_seen = time.monotonic()
        if self.generation < 0:  # the first generation ranks workers by id, not by who was quicker
            self.admitted.sort(key=lambda w: w.id)
        self.roster.move_all(self.admitted, "members")
        self.published = list(self.members)
        self._announce_generation([w.id for w in self.members], [w.id for w in self.waiting], action, reason,
                                  self.gone)
        self.gone = []
        self.dirty = False
        self.supersede_at = None
        self.write_workers_json(action)

    def _announce_generation(self, ids: List[int], waiting: List[int], action: str, reason: str,
                             gone: List[int] = ()) -> None:
        """Write the next generation's record and name it current; the one still forming is superseded."""
        now = time.monotonic()
        self.generation += 1
        g = self.generation
        if self.rdv.forming:  # replaced before it formed: a member left, or the job stops
            self.event("superseded", generation=self.rdv.generation, cause=reason or "a member left while it formed",
                       after_s=round(now - self.rdv.published_at, 3), waiting=[], retry_in_s=0)
        # The generation's record goes in before gen/current names it: a worker reads them in that order.
        self._put(protocol.generation_key(g), protocol.encode(ids, action, reason, waiting, gone))
        self._put("gen/current", str(g))
        self.rdv.opened(g, ids, now)
        self.event("generation", generation=g, members=ids, waiting=waiting, action=action, reason=reason)

    def _put(self, key: str, payload: str) -> None:
        """Write one of the agent's own records, sealed, and remember it (``reassert``)."""
        self.record[key] = self.sealer.seal(key, payload)
        self.store.set(key, self.record[key])

    def write_workers_json(self, action: str = "train") -> None:
        workers_json.write(self, action)

    def event(self, kind: str, **fields) -> None:
        append_event(self.run_dir / "events.jsonl", kind, "agent", **fields)

    # ------------------------------------------------------------------ main loop
    def run(self, resume: Optional[dict] = None) -> Dict[str, Any]:
        """Start the job and watch it to its end. ``resume``: the state of a leader whose lease expired
        (leadership.py): go on with its job, whose workers are still training, instead of starting one."""
        OmegaConf.save(self.cfg, self.state_dir / "config.yaml")
        protocol.write_private(protocol.agent_file(self.run_dir), json.dumps(  # the job id is `scale`'s to sign
            {"address": self.address, "pid": os.getpid(), "started": time.time(), "job": self.job}))
        if resume is None:
            self._start()
        else:
            leadership.restore(self, resume)
            self.event("failover", generation=self.generation, members=[w.id for w in self.members],
                       host=self.host)
        main = threading.current_thread() is threading.main_thread()  # a standby's agent runs on a thread
        handlers = [(sig, signal.signal(sig, handler)) for sig, handler in
                    ((signal.SIGINT, self._on_sigint), (signal.SIGUSR1, self._on_preempt))] if main else []
        console = DetachedConsole()  # a console nobody reads must not stop the watch (console.py)
        crashed = handed_over = False
        try:
            return self._watch()
        except Exception as exc:
            crashed = not isinstance(exc, ElasticFlowError) and bool(self.live())
            # Deposed: a standby leads now. A crash with a standby: its lease is released (failover.py) and a
            # standby takes the job over; either way the workers, and the records, are left as they are.
            handed_over = isinstance(exc, Deposed) or (crashed and self.leader is not None)
            if crashed and not handed_over:  # a bug of ours: the workers must not pay for it with their training
                log.error("the agent failed (%s: %s); closing the job's store so that the workers write their "
                          "checkpoint and exit", type(exc).__name__, str(exc)[:200])
                traceback.clear_frames(exc.__traceback__)  # its frames hold the store: it must close now
            raise
        finally:
            for sig, handler in handlers:
                signal.signal(sig, handler)
            if not handed_over:
                self._end(crashed)
            console.close(timeout_s=CONSOLE_DRAIN_S)

    def _start(self) -> None:
        """A new job: the first records, and this host's workers."""
        self._put("gen/current", "-1")
        # Sealed with the token alone: a worker checks its token against it before it joins (check_token).
        self.record["job/check"] = self.verdicts.seal("job/check", "ok")
        self.store.set("job/check", self.record["job/check"])
        self.store.add("join/count", 0)
        for _ in range(self.local_workers):
            self.spawn()
        self.write_workers_json()
        self.event("started", workers=list(self.joining), pids=[w.pid for w in self.joining.values()], host=self.host)

    def _end(self, crashed: bool) -> None:
        if crashed:
            self._close_store()
        else:
            self._announce()
        if self.capacity is not None:  # before the reaping: nothing of the job stays queued, however it ends
            self.capacity.close(self)
        self._reap_all(CRASH_REAP_S if crashed else REAP_S)
        workers_json.write_ended(self)
        protocol.agent_file(self.run_dir).unlink(missing_ok=True)
        if not crashed:
            self._stop_serving()  # the private store's socket goes with the job

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
        return self.roster.live()

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
                self.hosts.serve()
                if self.capacity is not None:
                    self.capacity.serve(self)
                self._control()
                if self.leader is not None:  # renew the lease; the state a standby would go on from
                    self.leader.tick(self)
                next_requests = now + REQUESTS_S
            if now >= next_health:
                self._check_health(now)
                next_health = now + HEALTH_S
            self._maybe_publish(now)
            if self.trained and self.rdv.forming and self.rdv.ids:
                self._end_stragglers()
            if not self.members and self.generation >= 0 and (
                    self.finished or not (self.joining or self.admitted or self.waiting)):
                return self._result()
            # Every worker died before the first generation -- unless the workers come on their own (Kubernetes
            # pods, placed when the cluster has room; launcher.store=etcd, every host's node agent's) and none has
            # come yet.
            if self.generation < 0 and not self.live() and ((self.cfg.launcher.name != "kubernetes"
                                                             and self.local_workers) or self.interrupted):
                return self._result()
            time.sleep(WATCH_S)

    # ------------------------------------------------------------------ exits
    def _reap(self):
        for w in list(self.members):
            rc = w.poll()
            if rc is None:
                continue
            if rc in CLEAN_EXITS and not self._announced(w):
                self.roster.drop(w)
                self._lost(w, f"exit code {rc} without the worker's exit record (its node or its srun failed)")
            elif rc in CLEAN_EXITS or (rc == protocol.EXIT_REMOVED and self.trained):
                self.roster.move(w, "finished")
                self.trained = self.trained or rc == protocol.EXIT_OK
            elif rc in (1, 2, protocol.EXIT_REFUSED):
                self.roster.move(w, "finished")
                return w, rc
            else:
                self.roster.drop(w)
                self._lost(w, f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}")
        for w in list(self.joining.values()) + list(self.admitted):
            rc = w.poll()
            if rc is None:
                continue
            self.roster.drop(w)
            if rc in (1, 2):
                return w, rc
            self.event("join_failed", worker=w.id, pid=w.pid, exit_code=rc)
            self._maybe_restart(w)
        for w in list(self.waiting):
            rc = w.poll()
            if rc is None:
                continue
            if rc in (1, 2, protocol.EXIT_REFUSED):
                self.roster.move(w, "finished")
                return w, rc
            if (rc in CLEAN_EXITS or rc == protocol.EXIT_REMOVED) and self._announced(w):
                self.roster.move(w, "finished")
            else:  # not in the generation: its loss changes no group, so nothing to publish
                self.roster.drop(w)
                self._lost(w, f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}", dirty=False)
        for w in list(self.retiring):
            rc = w.poll()
            if rc is not None:
                self.roster.drop(w)
                self.event("retired", worker=w.id, pid=w.pid, exit_code=rc)
                self.write_workers_json()
        return None

    def _announced(self, w: Worker) -> bool:
        """Whether ``w`` recorded its exit code (protocol.exit_key): a clean code from srun may be srun's own."""
        return protocol.fetch(self.store, self.sealer, protocol.exit_key(w.id), "exit") is not None

    def _lost(self, w: Worker, cause: str, dirty: bool = True) -> None:
        log.warning("worker %d (pid %d) left (%s)", w.id, w.pid, cause)
        self.event("left", worker=w.id, pid=w.pid, cause=cause, generation=self.generation)
        self.dirty = self.dirty or dirty
        if dirty:  # a member: its peers cut their links to it as the next generation is published
            self.gone.append(w.id)
        self._maybe_restart(w)

    def _maybe_restart(self, w: Worker) -> None:
        lc = self.cfg.launcher
        if not lc.restart_failed or self.finished or self.interrupted or w.node is not None:
            return  # a worker of another host is restarted by its node agent
        if self.restarts >= lc.max_restarts:
            self.event("restart_refused", replacing=w.id, restarts=self.restarts, max_restarts=lc.max_restarts)
            return
        self.restarts += 1
        new = self.spawn()
        self.event("restart", replacing=w.id, worker=new.id, pid=new.pid, restarts=self.restarts)
        self.write_workers_json()

    # ------------------------------------------------------------------ joins
    def _admit(self) -> None:
        admission.admit(self)

    def _end_stragglers(self) -> None:
        """Training finished while a generation formed (a joiner admitted in the last steps): its members
        can never meet, the others are done. An empty "stop" generation tells every worker still waiting
        for one to exit (membership.Removed, code 5) -- a remote one too, with no signal to carry."""
        self._announce_generation([], [], "stop", "training finished before this generation formed")

    def _maybe_publish(self, now: float) -> None:
        lc, el = self.cfg.launcher, self.cfg.elastic
        if self.trained:
            return  # the job is over: no generation can form any more
        if self.generation < 0:
            # The first generation waits for every initial worker, on every host launcher.nodes names (or
            # min_workers after wait_s); on Kubernetes, for min_workers pods: the rest join as they are placed.
            ready = len(self.admitted)
            initial = {"nodes": lc.nodes * lc.procs_per_node, "kubernetes": lc.min_workers}.get(lc.name, 0)
            every = not self.joining and ready >= initial
            if ready and (every or (now - self.started > el.wait_s and ready >= lc.min_workers)):
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
        health.check(self, now)

    def _cut_out(self, w: Worker, why: str) -> None:
        health.cut_out(self, w, why)

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

    def _close_store(self) -> None:
        """Stop serving the store: each worker's next store call fails, so it takes the agent-lost path (the
        members agree on a last checkpoint, write it and exit 4), as when the agent's host is lost. Without
        this, a crashed agent's cleanup SIGKILLed the workers while they still saw a store, and the steps since
        the last periodic checkpoint were lost."""
        self._stop_serving()
        self.store = self.rdv.store = None
        gc.collect()  # the TCPStore's server (and with it every worker's connection) closes with its last reference

    def _reap_all(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        for w in self.live():
            while w.poll() is None and w.proc is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            if w.poll() is None:
                w.signal(signal.SIGKILL)
                if w.proc is not None:
                    w.proc.wait(5)
