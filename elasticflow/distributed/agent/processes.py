"""The agent's worker processes: starting one, noticing how each exited, restarting the lost.

A worker's exit moves it in the roster: a clean exit (with the worker's own exit record, protocol.exit_key) to
``finished``, a crash out of the roster and into a restart (``launcher.restart_failed``), a user error (exit 1
or 2, a refused join) up to the agent, which ends the job with the worker's message.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Callable, Dict, Optional, Tuple

from .. import protocol
from . import workers_json
from .process import Worker
from .state import AgentState

log = logging.getLogger("elasticflow")
CLEAN_EXITS = (protocol.EXIT_OK, protocol.EXIT_INTERRUPTED, protocol.EXIT_BELOW_MIN, protocol.EXIT_AGENT_LOST)

# Exit codes of a worker its peers cut out (train/balance.py, train/fingerprint.py): the cause its `left` event says
EVICTED = {protocol.EXIT_STRAGGLER: "evicted: a straggler", protocol.EXIT_CORRUPT: "evicted: its parameters differed",
           protocol.EXIT_MISCOMPUTE: "evicted: its computation differed"}


class Processes:
    """The workers of the job in ``state`` as processes: ``launch(env)`` starts one (the launcher's), with
    ``worker_env`` over this process' environment."""

    def __init__(self, state: AgentState, launch: Callable[[Dict[str, str]], subprocess.Popen],
                 worker_env: Optional[Dict[str, str]] = None):
        self.state, self.launch = state, launch
        self.worker_env = dict(worker_env or {})

    def spawn(self) -> Worker:
        state = self.state
        wid = state.new_id()
        here = [w for w in state.members + state.admitted + list(state.joining.values()) + state.waiting
                if w.node is None]
        # The lowest slot no live worker of this host holds: a replacement binds the GPU of the one it replaces.
        held = {w.slot for w in here}
        slot = next(i for i in range(len(held) + 1) if i not in held)
        env = {**os.environ, **self.worker_env, protocol.ENV_LOCAL_SLOT: str(slot),
               protocol.ENV_STORE: state.address, protocol.ENV_WORKER_ID: str(wid),
               protocol.ENV_RUN_DIR: str(state.run_dir), protocol.ENV_TOKEN: state.token,
               protocol.ENV_LOCAL_WORKERS: str(max(state.cfg.launcher.workers, len(here) + 1)),
               protocol.ENV_SPAWNED_AT: str(time.time())}
        proc = self.launch(env)
        return state.roster.add(Worker(wid, proc.pid, proc, slot=slot))

    def reap(self) -> Optional[Tuple[Worker, int]]:
        """Move every worker that exited since the last call (waitpid: no store round trip). Returns the first
        worker that failed with a user error (exit 1 or 2, or a refused join) and its code, or None."""
        state = self.state
        for w in list(state.members):
            rc = w.poll()
            if rc is None:
                continue
            if rc in CLEAN_EXITS and not self._announced(w):
                state.roster.drop(w)
                self.lost(w, f"exit code {rc} without the worker's exit record (its node or its srun failed)")
            elif rc in CLEAN_EXITS or (rc == protocol.EXIT_REMOVED and state.trained):
                state.roster.move(w, "finished")
                state.trained = state.trained or rc == protocol.EXIT_OK
            elif rc in (1, 2, protocol.EXIT_REFUSED):
                state.roster.move(w, "finished")
                return w, rc
            else:
                state.roster.drop(w)
                self.lost(w, f"signal {signal.Signals(-rc).name}" if rc < 0 else
                          EVICTED.get(rc, f"exit code {rc}"))
        for w in list(state.joining.values()) + list(state.admitted):
            rc = w.poll()
            if rc is None:
                continue
            state.roster.drop(w)
            if rc in (1, 2):
                return w, rc
            state.event("join_failed", worker=w.id, pid=w.pid, exit_code=rc)
            self._maybe_restart(w)
        for w in list(state.waiting):
            rc = w.poll()
            if rc is None:
                continue
            if rc in (1, 2, protocol.EXIT_REFUSED):
                state.roster.move(w, "finished")
                return w, rc
            if (rc in CLEAN_EXITS or rc == protocol.EXIT_REMOVED) and self._announced(w):
                state.roster.move(w, "finished")
            else:  # not in the generation: its loss changes no group, so nothing to publish
                state.roster.drop(w)
                self.lost(w, f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}", dirty=False)
        for w in list(state.retiring):
            rc = w.poll()
            if rc is not None:
                state.roster.drop(w)
                state.event("retired", worker=w.id, pid=w.pid, exit_code=rc)
                workers_json.write(state)
        return None

    def _announced(self, w: Worker) -> bool:
        """Whether ``w`` recorded its exit code (protocol.exit_key): a clean code from srun may be srun's own."""
        state = self.state
        return protocol.fetch(state.store, state.sealer, protocol.exit_key(w.id), "exit") is not None

    def lost(self, w: Worker, cause: str, dirty: bool = True) -> None:
        """``w`` (out of the roster already) left without finishing: log it, mark the members changed when it was
        one (``dirty``), and restart it if the launcher says so."""
        state = self.state
        # A member's loss is told by the new generation's rank 0, in one line with the step and what follows
        # (reporting.membership_line, from the record's pids and causes): here only with --debug (and in train.log).
        log.warning("worker %d (pid %d) died (%s)%s", w.id, w.pid, cause,
                    "" if dirty else " while it waited for a generation",
                    extra={"console": not dirty or os.environ.get(protocol.ENV_DEBUG) == "1"})
        state.event("left", worker=w.id, pid=w.pid, cause=cause, generation=state.generation)
        state.dirty = state.dirty or dirty
        if dirty:  # a member: its peers cut their links to it as the next generation is published
            state.gone.append(w.id)
            state.causes.setdefault(w.id, cause)  # health's "hung: ..." stands over the SIGKILL that followed
        self._maybe_restart(w)

    def _maybe_restart(self, w: Worker) -> None:
        state, lc = self.state, self.state.cfg.launcher
        if not lc.restart_failed or state.finished or state.interrupted or w.node is not None:
            return  # a worker of another host is restarted by its node agent
        if state.restarts >= lc.max_restarts:
            state.event("restart_refused", replacing=w.id, restarts=state.restarts, max_restarts=lc.max_restarts)
            return
        state.restarts += 1
        new = self.spawn()
        state.event("restart", replacing=w.id, worker=new.id, pid=new.pid, restarts=state.restarts)
        workers_json.write(state)

    def reap_all(self, wait_s: float) -> None:
        """The job is over: give every live worker until ``wait_s`` from now to exit, then SIGKILL it."""
        deadline = time.monotonic() + wait_s
        for w in self.state.live():
            while w.poll() is None and w.proc is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            if w.poll() is None:
                w.signal(signal.SIGKILL)
                if w.proc is not None:
                    w.proc.wait(5)
