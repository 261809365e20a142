"""The agent (job master): hosts the store, spawns and watches workers, owns membership.

Membership is a generation number plus the member list in rank order. At every change the agent
publishes the next generation in the store and rewrites RUN_DIR/workers.json; survivors keep their
relative order, so ranks stay dense. Workers enter through a join request signed with the job
token; a refused request is logged to RUN_DIR/events.jsonl.

Health: a member whose heartbeat stops for ``elastic.heartbeat_timeout_s`` (a stopped process) is
SIGKILLed; so is one that never reports when its peers' collectives of a generation failed (a
deadlock or a stuck collective). Killing, not aborting, is what wakes peers blocked on it.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from omegaconf import OmegaConf
from torch.distributed import TCPStore

from ..errors import ElasticFlowError, TrainingInterrupted
from ..fileio import append_event, write_atomic
from . import protocol

log = logging.getLogger("elasticflow")
WATCH_S = 0.01     # how often the agent polls its workers: a SIGKILLed worker is noticed within ~10 ms
HEALTH_S = 0.1     # how often heartbeats and failure reports are read
REPORT_GRACE_S = 2.0  # after a peer reports a failed collective, how long the others have to report too
CLEAN_EXITS = (protocol.EXIT_OK, protocol.EXIT_INTERRUPTED, protocol.EXIT_BELOW_MIN, protocol.EXIT_AGENT_LOST)


HOSTNAME = socket.gethostname()


def local_launch(env: Dict[str, str]) -> subprocess.Popen:
    """Start a worker process on this machine."""
    # Own session: a terminal Ctrl-C reaches only the agent, which forwards it once.
    return subprocess.Popen([sys.executable, "-m", "elasticflow.distributed.worker"], env=env, start_new_session=True)


def listening_store(host: str, timeout_s: float) -> "tuple[TCPStore, socket.socket]":
    """A TCPStore listening on ``host`` only (TCPStore alone would listen on every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    store = TCPStore(host, sock.getsockname()[1], None, True, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False, master_listen_fd=sock.fileno())
    return store, sock


@dataclass
class Worker:
    id: int
    pid: int                                  # the worker process (behind srun: learned from its join request)
    proc: Optional[subprocess.Popen] = None   # what we started (the worker, or its srun); None if started elsewhere
    host: str = HOSTNAME
    state: str = "joining"
    spawned_at: float = field(default_factory=time.time)
    hb_value: int = -1
    hb_seen: float = field(default_factory=time.monotonic)

    def poll(self) -> Optional[int]:
        return self.proc.poll() if self.proc is not None else None

    def signal(self, sig: int) -> None:
        """Signal the worker itself; on another node, through its srun (which forwards USR1, and
        cancels the step on TERM)."""
        try:
            if self.host == HOSTNAME or self.proc is None:
                os.kill(self.pid, sig)
            elif sig in (signal.SIGINT, signal.SIGUSR1):
                self.proc.send_signal(signal.SIGUSR1)
            else:
                self.proc.terminate()
        except ProcessLookupError:
            pass

    def describe(self, rank: Optional[int] = None) -> dict:
        out = {"worker_id": self.id, "pid": self.pid, "host": self.host, "state": self.state}
        return {"rank": rank, **out} if rank is not None else out


class Agent:
    """Run ``cfg`` with ``launcher.workers`` local worker processes; returns rank 0's summary."""

    def __init__(self, cfg: Any, run_dir: Path, host: str = "127.0.0.1",
                 launch: Callable[[Dict[str, str]], subprocess.Popen] = local_launch, worker_env=None):
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
        self.joining: Dict[int, Worker] = {}  # spawned, join request not yet accepted
        self.admitted: List[Worker] = []     # accepted, enter at the next generation
        self.retiring: List[Worker] = []     # dropped by a scale-down, exiting at a step boundary
        self.finished: List[Worker] = []
        self.next_id = 0
        self.requests_seen = 0
        self.restarts = 0
        self.dirty = False                    # members changed since the last publish
        self.below_min_since: Optional[float] = None
        self.stop_reason = ""
        self.interrupted = False
        self.started = time.monotonic()
        self.failed_reports_since: Dict[int, float] = {}

    # ------------------------------------------------------------------ workers
    def spawn(self) -> Worker:
        wid = self.next_id
        self.next_id += 1
        env = {**os.environ, **self.worker_env, protocol.ENV_STORE: self.address, protocol.ENV_WORKER_ID: str(wid),
               protocol.ENV_RUN_DIR: str(self.run_dir), protocol.ENV_TOKEN: self.token,
               protocol.ENV_LOCAL_WORKERS: str(max(self.cfg.launcher.workers, self.target_workers() + 1)),
               protocol.ENV_SPAWNED_AT: str(time.time())}
        proc = self.launch(env)
        worker = Worker(wid, proc.pid, proc)
        self.joining[wid] = worker
        return worker

    def target_workers(self) -> int:
        return len(self.members) + len(self.admitted) + len(self.joining)

    def publish(self, action: str = "train", reason: str = "") -> None:
        """Announce the next generation with the current members (admitted joiners enter now)."""
        for w in self.admitted:
            w.state = "training"
            w.hb_seen = time.monotonic()
        if self.generation < 0:  # the first generation ranks workers by id, not by who was quicker
            self.admitted.sort(key=lambda w: w.id)
        self.members += self.admitted
        self.admitted = []
        self.generation += 1
        g = self.generation
        self.store.set(protocol.generation_key(g), protocol.encode([w.id for w in self.members], action, reason))
        self.store.set("gen/current", str(g))
        self.dirty = False
        self.write_workers_json(action)

    def write_workers_json(self, action: str = "train") -> None:
        snapshot = {"generation": self.generation, "time": time.time(), "action": action,
                    "members": [w.describe(r) for r, w in enumerate(self.members)],
                    "joining": [w.describe() for w in [*self.joining.values(), *self.admitted]],
                    "retiring": [w.describe() for w in self.retiring],
                    "restarts": self.restarts, "max_restarts": self.cfg.launcher.max_restarts,
                    "agent_pid": os.getpid()}
        # Atomic: `elasticflow status` and `scale` read it while the job runs.
        write_atomic(self.run_dir / "workers.json", json.dumps(snapshot, indent=1))

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
        try:
            return self._watch()
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGUSR1, previous_usr1)
            self._reap_all()
            protocol.agent_file(self.run_dir).unlink(missing_ok=True)

    def _on_sigint(self, signum, frame) -> None:
        if self.interrupted:  # second Ctrl-C: stop everything now
            for w in self.live():
                w.signal(signal.SIGKILL)
            raise KeyboardInterrupt
        self.interrupted = True
        log.warning("Ctrl-C: workers finish the current step and write a checkpoint (Ctrl-C again to abort)")
        for w in self.members:
            w.signal(signal.SIGINT)
        for w in [*self.joining.values(), *self.admitted]:
            w.signal(signal.SIGKILL)

    def _on_preempt(self, signum, frame) -> None:
        """SLURM's warning before preemption or the time limit: checkpoint at the next step and stop."""
        if self.preempted:
            return
        self.preempted = True
        log.warning("preemption warning (SIGUSR1): workers checkpoint at the next step boundary")
        self.event("preempt", generation=self.generation)
        self._on_sigint(signum, frame)

    def live(self) -> List[Worker]:
        return [*self.members, *self.joining.values(), *self.admitted, *self.retiring]

    def _watch(self) -> Dict[str, Any]:
        next_health = 0.0
        while True:
            error = self._reap()
            if error is not None:
                return self._fail_with_worker_error(*error)
            self._admit()
            self._control()
            now = time.monotonic()
            if now >= next_health:
                self._check_health(now)
                next_health = now + HEALTH_S
            self._maybe_publish(now)
            if not self.members and self.generation >= 0 and (self.finished or not (self.joining or self.admitted)):
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
        for w in list(self.retiring):
            rc = w.poll()
            if rc is not None:
                self.retiring.remove(w)
                self.event("retired", worker=w.id, pid=w.pid, exit_code=rc)
                self.write_workers_json()
        return None

    def _lost(self, w: Worker, cause: str) -> None:
        log.warning("worker %d (pid %d) left (%s)", w.id, w.pid, cause)
        self.event("left", worker=w.id, pid=w.pid, cause=cause, generation=self.generation)
        self.dirty = True
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
        while self.requests_seen < count:
            n = self.requests_seen + 1
            key = f"join/request/{n}"
            if not self.store.check([key]):
                return  # counted but not written yet; next round
            self.requests_seen = n
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
        if not (self.dirty or self.admitted) or not (self.members or self.admitted):
            return
        if len(self.members) + len(self.admitted) >= lc.min_workers:
            if self.below_min_since is not None:
                self.below_min_since = None
            self.publish()
            return
        if self.below_min_since is None:
            self.below_min_since = now
            log.warning("%d worker(s) left, fewer than launcher.min_workers=%d; waiting up to elastic.wait_s=%gs",
                        len(self.members), lc.min_workers, el.wait_s)
        elif now - self.below_min_since > el.wait_s:
            self.stop_reason = (f"only {len(self.members)} worker(s) left, fewer than launcher.min_workers="
                                f"{lc.min_workers}, for elastic.wait_s={el.wait_s:g}s")
            self.event("stop", reason=self.stop_reason, generation=self.generation + 1)
            self.publish("stop", self.stop_reason)
            self.below_min_since = None

    # ------------------------------------------------------------------ health
    def _check_health(self, now: float) -> None:
        el = self.cfg.elastic
        for w in list(self.members):
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
        reported = [w for w in self.members if self.store.check([f"gen/{g}/failed/{w.id}"])]
        if not reported or len(reported) == len(self.members):
            self.failed_reports_since.pop(g, None)
            return
        since = self.failed_reports_since.setdefault(g, now)
        if now - since > min(REPORT_GRACE_S, el.heartbeat_timeout_s):
            for w in self.members:
                if w not in reported and w.state != "killed":
                    self._cut_out(w, "its peers' collectives failed and it never reported (stuck or deadlocked)")

    def _cut_out(self, w: Worker, why: str) -> None:
        log.warning("worker %d (pid %d): %s; killing it", w.id, w.pid, why)
        self.event("hung", worker=w.id, pid=w.pid, reason=why, generation=self.generation)
        w.state = "killed"
        w.signal(signal.SIGKILL)
        if w.proc is None:  # not our child: we cannot wait for its exit code
            self.members.remove(w)
            self._lost(w, "killed: hung")

    # ------------------------------------------------------------------ scale requests
    def _control(self) -> None:
        if not self.store.check(["control/scale"]):
            return
        raw = self.store.get("control/scale")
        self.store.delete_key("control/scale")
        try:
            req = protocol.decode(raw)
            reply = self._scale(req)
        except (ValueError, KeyError) as exc:
            req, reply = {}, {"ok": False, "reason": f"malformed scale request ({exc})"}
        self.store.set(f"control/reply/{req.get('nonce', 'none')}", json.dumps(reply))

    def _scale(self, req: dict) -> dict:
        target, nonce = int(req["workers"]), str(req["nonce"])
        if not protocol.verify(self.token, f"scale:{target}:{nonce}", req.get("mac", "")):
            self.event("refused", reason="scale request with a wrong or missing job token")
            return {"ok": False, "reason": "wrong or missing job token"}
        lc = self.cfg.launcher
        if target < max(1, lc.min_workers):
            return {"ok": False, "reason": f"{target} is below launcher.min_workers={lc.min_workers}"}
        if lc.max_workers and target > lc.max_workers:
            return {"ok": False, "reason": f"{target} is above launcher.max_workers={lc.max_workers}"}
        current = self.target_workers()
        self.event("scale", requested=target, current=current, generation=self.generation)
        if target > current:
            for _ in range(target - current):
                self.spawn()
        elif target < current:
            surplus = current - target
            for w in sorted(self.joining.values(), key=lambda w: -w.id)[:surplus]:  # cancel starts first
                self.joining.pop(w.id)
                w.signal(signal.SIGKILL)
                surplus -= 1
            while surplus and self.admitted:
                self.admitted.pop().signal(signal.SIGKILL)
                surplus -= 1
            if surplus:
                # The last-joined members leave; the rest keep their relative order.
                leaving, self.members = self.members[-surplus:], self.members[:-surplus]
                for w in leaving:
                    w.state = "retiring"
                self.retiring += leaving
                self.dirty = True
        self.write_workers_json()
        return {"ok": True, "workers": target}

    # ------------------------------------------------------------------ the end
    def _result(self) -> Dict[str, Any]:
        for w in [*self.joining.values(), *self.admitted]:  # training ended before they could join
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
