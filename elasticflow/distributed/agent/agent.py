"""The agent (job master): hosts the store, spawns and watches workers, owns membership.

The agent is a loop over parts it owns, each handed the agent's state (state.py) and what else it needs, none
calling back into the agent: admission (join requests), health (heartbeats, failure reports, the verdict on a
forming generation), scaling (`elasticflow scale`), injection (`elasticflow inject`), processes (starting, reaping
and restarting workers), generations (publishing the next one), hosts (the node agents of other hosts), the workers
file (workers.json) and, with launcher.store=etcd, leadership (the lease, and the state a standby goes on from).

Membership is a generation number plus the member list in rank order. At every change the agent
publishes the next generation in the store and rewrites RUN_DIR/workers.json (workers_json.py);
survivors keep their relative order, so ranks stay dense. Workers enter through a join request signed
with the job token; a refused request is logged to RUN_DIR/events.jsonl.

A generation that fails to form (membership/rendezvous.py says when) is superseded by the next one, with the
members that arrived or reported; the others *wait* (alive, out of the generation) and re-enter a
later one once they arrive. Joiners admitted while a generation forms enter the next one together.

Where each worker is in its lifecycle is the roster's (roster.py): one place per worker, its state written
as it moves. Every record the agent writes is sealed with the job token and every one it reads is checked
(_util/sealing.py).
"""
from __future__ import annotations

import gc
import json
import logging
import os
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from ..._util.console import DetachedConsole
from ..._util.envnames import ENV_RUN_DIR_ID
from ..._util.paths import HeldDirectory
from ...config.launchers import store_kind
from ...errors import ElasticFlowError, RunDirectoryMoved, TrainingInterrupted
from .. import protocol
from ..membership.rendezvous import Rendezvous
from ..store import stores
from ..store.etcd import Deposed
from . import health, leadership, workers_json
from .admission import Admission
from .generations import Generations
from .health import Health
from .hosts import Hosts
from .inject import Injection
from .process import Worker
from .processes import Processes
from .scaling import Scaling
from .state import AgentState

log = logging.getLogger("elasticflow")
WATCH_S = 0.01     # how often the agent polls its workers: a SIGKILLed worker is noticed within ~10 ms
REQUESTS_S = 0.05  # how often join and scale requests are read: two store round trips, which every 10 ms
                   # were a sixth of the agent's CPU while training (scripts/bench/bench_agent.py: 6.8% -> 5.6% of a
                   # core), taken from the workers' cores; a joiner waits <= 50 ms more, beside the seconds
                   # its process takes to start
HEALTH_S = health.HEALTH_S  # how often heartbeats and failure reports are read
REAP_S = 10.0  # at the end, how long workers have to exit on their own before SIGKILL
CRASH_REAP_S = 120.0  # ... after the agent failed: time to agree on a last checkpoint and write it
CONSOLE_DRAIN_S = 30.0  # at the end, how long the agent waits for a console that is not read (then writes on)


class Agent:
    """Run ``cfg`` with ``launcher.workers`` worker processes; returns rank 0's summary.

    ``launch(env)`` starts one worker process with that environment (the launcher's: local.py, slurm.py,
    nodes.py). ``port``: where the store listens (0: any free port); ``token``: the job's shared secret
    (None: a new random one). Workers on other hosts are started by their node agents (hosts.py).
    ``capacity`` (an attribute the launcher may set before ``run``): its source of more hosts
    (launchers/slurm_grow.py's worker jobs), or None. Its ``serve(state)`` runs every request round,
    ``rescale(state, target)`` answers a scale request first (scaling.py), ``close(state)`` runs at the end;
    each is handed the agent's state (state.AgentState).
    """

    def __init__(self, cfg: Any, run_dir: Path, host: str = "127.0.0.1", *,
                 launch: Callable[[Dict[str, str]], subprocess.Popen], worker_env=None, port: int = 0,
                 token: Optional[str] = None, served: Optional[tuple] = None, job: Optional[str] = None):
        # The run directory the launcher checked, held open: once its path leads elsewhere the job stops (_watch)
        self.held = HeldDirectory(run_dir, expect=(worker_env or {}).get(ENV_RUN_DIR_ID))
        self.moved = False  # it did: nothing more is written by its path
        self.state = state = AgentState(cfg, run_dir, host, token, job)
        self.capacity = None
        protocol.REFUSED.on_first = lambda kind, detail: state.event("forged", record=kind, detail=detail)
        kind = store_kind(cfg.launcher)
        # ``served``: (client, address, close) of a store this process does not serve (etcd: launchers/failover.py)
        state.store, state.address, self._stop_serving = served or stores.serve(
            kind, host, port, state.state_dir, cfg.elastic.timeout_s, state.token)
        if kind == stores.TCP:
            log.warning("the job's store is a TCPStore on %s, which anyone who reaches it may connect to (every "
                        "record is sealed, the connection is not): keep the job on a network only your hosts "
                        "reach (docs/security.md)", state.address)
        state.started = time.monotonic()      # the first generation's elastic.wait_s runs from here
        self.leader = None                    # launcher.store=etcd: this agent's lease (leadership.Leadership)
        self.local_workers = cfg.launcher.workers  # started here at the start (etcd: 0, each host's node agent's)
        self._notices: List[Tuple[str, Optional[str]]] = []  # the signal handlers' (line, event), for _watch
        # The parts, each with the state and the callables it needs; none of them knows the agent.
        self.rdv = Rendezvous(state.store, cfg.elastic.timeout_s, state.sealer)
        self.hosts = Hosts(state)             # the node agents of other hosts, and their workers' exits
        self.processes = Processes(state, launch, worker_env)
        self.generations = Generations(state, self.rdv)
        self.admission = Admission(state, self.hosts)
        self.health = Health(state, self.rdv, self.hosts, self.processes.lost)
        self.scaling = Scaling(state, self.processes.spawn)
        self.injection = Injection(state)     # `elasticflow inject`: faults caused on purpose (drills)

    def state_dict(self) -> Dict[str, Any]:
        """What a standby needs to go on where this agent is (leadership.py): JSON only."""
        return leadership.snapshot(self.state, self.rdv, self.hosts, self.admission, self.scaling, self.injection)

    # ------------------------------------------------------------------ main loop
    def run(self, resume: Optional[dict] = None) -> Dict[str, Any]:
        """Start the job and watch it to its end. ``resume``: the state of a leader whose lease expired
        (leadership.py): go on with its job, whose workers are still training, instead of starting one."""
        state = self.state
        OmegaConf.save(state.cfg, state.state_dir / "config.yaml")
        protocol.write_private(protocol.agent_file(state.run_dir), json.dumps(  # the job id is `scale`'s to sign
            {"address": state.address, "pid": os.getpid(), "started": time.time(), "job": state.job}))
        if resume is None:
            self._start()
        else:
            leadership.restore(resume, state, self.rdv, self.hosts, self.admission, self.scaling, self.injection)
            state.event("failover", generation=state.generation, members=[w.id for w in state.members],
                        host=state.host)
        main = threading.current_thread() is threading.main_thread()  # a standby's agent runs on a thread
        handlers = [(sig, signal.signal(sig, handler)) for sig, handler in
                    ((signal.SIGINT, self._on_sigint), (signal.SIGUSR1, self._on_preempt))] if main else []
        console = DetachedConsole()  # a console nobody reads must not stop the watch (console.py)
        crashed = handed_over = False
        try:
            return self._watch()
        except Exception as exc:
            crashed = not isinstance(exc, ElasticFlowError) and bool(state.live())
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
            self.held.close()
            console.close(timeout_s=CONSOLE_DRAIN_S)

    def _start(self) -> None:
        """A new job: the first records, and this host's workers."""
        state = self.state
        state.put("gen/current", "-1")
        # Sealed with the token alone: a worker checks its token against it before it joins (check_token).
        state.record["job/check"] = state.verdicts.seal("job/check", "ok")
        state.store.set("job/check", state.record["job/check"])
        state.store.add("join/count", 0)
        for _ in range(self.local_workers):
            self.processes.spawn()
        workers_json.write(state)
        state.event("started", workers=list(state.joining), pids=[w.pid for w in state.joining.values()],
                    host=state.host)

    def _end(self, crashed: bool) -> None:
        if crashed:
            self._close_store()
        elif not self.moved:
            self._log_notices()
        if self.capacity is not None:  # before the reaping: nothing of the job stays queued, however it ends
            self.capacity.close(self.state)
        self.processes.reap_all(CRASH_REAP_S if crashed else REAP_S)
        if not self.moved:  # else these would go into the directory put in the run directory's place
            workers_json.write_ended(self.state)
            protocol.agent_file(self.state.run_dir).unlink(missing_ok=True)
        if not crashed:
            self._stop_serving()  # the private store's socket goes with the job

    def _check_run_dir(self) -> None:
        """RunDirectoryMoved where the run directory's path leads to another directory than the one the job
        started in (paths.HeldDirectory: a stat, every round): every worker is SIGKILLed first, since what it
        wrote next (a checkpoint, its records) would go into the directory put in its place."""
        try:
            self.held.check()
        except RunDirectoryMoved:
            self.moved = True
            for w in self.state.live():
                w.signal(signal.SIGKILL)
            raise

    def _on_sigint(self, signum, frame) -> None:
        state = self.state
        if state.interrupted:  # second Ctrl-C: stop everything now
            for w in state.live():
                w.signal(signal.SIGKILL)
            raise KeyboardInterrupt
        state.interrupted = True
        # Logged by _watch, not here: a handler that logs can interrupt a logging call holding the
        # console's lock and wait for it forever (signals.StopSignal has the story).
        self._notices.append(("Ctrl-C: workers finish the current step and write a checkpoint (Ctrl-C again to abort)",
                              None))
        for w in state.members:
            w.signal(signal.SIGINT)
        for w in [*state.joining.values(), *state.admitted, *state.waiting]:
            w.signal(signal.SIGKILL)

    def _on_preempt(self, signum, frame) -> None:
        """SLURM's warning before preemption or the time limit: checkpoint at the next step and stop."""
        if self.state.preempted:
            return
        self.state.preempted = True
        self._notices.append(("preemption warning (SIGUSR1): workers checkpoint at the next step boundary", "preempt"))
        self._on_sigint(signum, frame)

    def _log_notices(self) -> None:
        """Log what the signal handlers recorded (and the preemption's event), from the loop."""
        while self._notices:
            line, event = self._notices.pop(0)
            log.warning("%s", line)
            if event is not None:
                self.state.event(event, generation=self.state.generation)

    def _watch(self) -> Dict[str, Any]:
        state = self.state
        next_health = next_requests = 0.0
        while True:
            self._check_run_dir()
            self._log_notices()
            error = self.processes.reap()  # waitpid: no store round trip
            if error is not None:
                return self._fail_with_worker_error(*error)
            now = time.monotonic()
            if now >= next_requests:
                self.admission.admit()
                self.hosts.serve()
                if self.capacity is not None:
                    self.capacity.serve(state)
                self.scaling.serve(self.capacity)
                self.injection.serve()
                if self.leader is not None:  # renew the lease; the state a standby would go on from
                    self.leader.tick(state.store, self.state_dict)
                next_requests = now + REQUESTS_S
            if now >= next_health:
                self.health.check(now)
                next_health = now + HEALTH_S
            self.generations.maybe_publish(now)
            if state.trained and self.rdv.forming and self.rdv.ids:
                self.generations.end_stragglers()
            if not state.members and state.generation >= 0 and (
                    state.finished or not (state.joining or state.admitted or state.waiting)):
                return self._result()
            # Every worker died before the first generation -- unless the workers come on their own (Kubernetes
            # pods, placed when the cluster has room; launcher.store=etcd, every host's node agent's) and none has
            # come yet.
            if state.generation < 0 and not state.live() and ((state.cfg.launcher.name != "kubernetes"
                                                               and self.local_workers) or state.interrupted):
                return self._result()
            time.sleep(WATCH_S)

    # ------------------------------------------------------------------ the end
    def _result(self) -> Dict[str, Any]:
        state = self.state
        for w in [*state.joining.values(), *state.admitted, *state.waiting]:  # training ended without them
            w.signal(signal.SIGKILL)
        codes = [w.poll() for w in state.finished]
        if protocol.EXIT_BELOW_MIN in codes:
            raise ElasticFlowError((state.stop_reason or "too few workers") + "; a checkpoint was written",
                                   "resume with the same command (resume=auto), or lower launcher.min_workers",
                                   exit_code=protocol.EXIT_BELOW_MIN)
        if protocol.EXIT_INTERRUPTED in codes or state.interrupted:
            raise TrainingInterrupted()
        if protocol.EXIT_OK not in codes:
            raise ElasticFlowError("every worker died; nothing finished training",
                                   "see the worker logs under RUN_DIR/logs/; resume=auto continues from the "
                                   "newest checkpoint", exit_code=1)
        summary_file = state.run_dir / "summary.json"
        return json.loads(summary_file.read_text()) if summary_file.is_file() else {}

    def _fail_with_worker_error(self, w: Worker, rc: int) -> Dict[str, Any]:
        self._check_run_dir()  # a worker that stopped because it moved: not an error record read from elsewhere
        err_file = self.state.state_dir / f"error-{w.id}.json"
        err = json.loads(err_file.read_text()) if err_file.is_file() else {
            "message": f"worker {w.id} failed with exit code {rc}", "hint": "see RUN_DIR/logs/"}
        for other in self.state.live():
            other.signal(signal.SIGTERM)
        raise ElasticFlowError(err["message"], err.get("hint", ""), exit_code=rc)

    def _close_store(self) -> None:
        """Stop serving the store: each worker's next store call fails, so it takes the agent-lost path (the
        members agree on a last checkpoint, write it and exit 4), as when the agent's host is lost. Without
        this, a crashed agent's cleanup SIGKILLed the workers while they still saw a store, and the steps since
        the last periodic checkpoint were lost."""
        self._stop_serving()
        self.state.store = self.rdv.store = None
        gc.collect()  # the TCPStore's server (and with it every worker's connection) closes with its last reference
