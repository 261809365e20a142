"""The node agent: on a host that does not own launcher.endpoint, start this host's workers, watch them,
restart them, and join them to the job whose agent listens at the endpoint (launcher=nodes).

The agent (agent.py) stays the one judge of membership: the node agent registers with the job token,
checks that it sees the agent's run directory and checkpoint.dir (a shared filesystem), starts
``launcher.procs_per_node`` workers that join like any other, reports their exits, and carries out the
signals the agent sends them (a cut-out is a SIGKILL). hosts.py is the agent's side.

While the endpoint is unreachable (a partition) the node agent keeps its workers' exits to report later
and restarts nothing. A worker cut off longer than elastic.timeout_s takes the agent for lost: it writes a
checkpoint and exits (code 4). With launcher.restart_failed, such workers are started again once the
endpoint answers (they join as new members); if it does not answer for elastic.wait_s, the node agent
gives up with one line.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ...errors import ElasticFlowError, TrainingInterrupted
from ...config.launchers import store_kind
from .. import protocol
from ..store import stores
from .hosts import node_message

log = logging.getLogger("elasticflow")
WATCH_S = 0.01         # how often children are polled (a dead one reported within ~10 ms, as the agent does)
STORE_S = 0.05         # how often the store is read: signals, heartbeat, reports
RECONNECT_S = 1.0      # while the endpoint does not answer, how often to try again
STORE_OP_S = 5.0       # a store call that takes longer means the link is down
UNVERIFIED_S = 3.0     # an answer that does not verify is taken for a refusal only after this long without one
CLEAN_EXITS = (protocol.EXIT_OK, protocol.EXIT_INTERRUPTED, protocol.EXIT_BELOW_MIN, protocol.EXIT_AGENT_LOST,
               protocol.EXIT_REMOVED)
ERROR_EXITS = (1, 2, protocol.EXIT_REFUSED)  # the worker's own error line; the agent fails the job with it


connect = stores.client  # the agent's side: no torch (store/stores.py)


class NodeAgent:
    """This host's workers in the job at ``endpoint``; ``run()`` returns when none is left.

    Args:
        launch: starts one worker process with an environment (launchers/local.py's local_launch).
        bind: this host's address on the route to the endpoint, for the workers' gloo (netif.address_toward).
        name: this node agent's name in the job, unique among its node agents (default: the host name; a
            SLURM worker job adds its job id, since two of them can share a node).
        address: the job's store, where it is not the endpoint's (launcher.store=etcd: launchers/failover.py).
    """

    def __init__(self, cfg: Any, endpoint: str, token: str, launch: Callable[[Dict[str, str]], subprocess.Popen],
                 bind: str, name: Optional[str] = None, address: Optional[str] = None):
        self.cfg, self.endpoint, self.token, self.launch, self.bind = cfg, endpoint, token, launch, bind
        # The store's address, with its kind (``address``: given where no host serves it, launcher.store=etcd)
        self.address = address or stores.address_of(store_kind(cfg.launcher), endpoint)
        self.name = name or socket.gethostname()
        self.store = None  # a client of the agent's store (stores.client)
        self.lost_since: Optional[float] = None
        self.workers: Dict[int, subprocess.Popen] = {}  # worker id -> process
        self.slots: Dict[int, int] = {}
        self.codes: Dict[int, int] = {}                 # exited workers' codes
        self.unsent: List[tuple] = []                   # exit reports not yet delivered (endpoint unreachable)
        self.signals = protocol.Inbox(f"node/{self.name}/signals", f"node/{self.name}/signal")
        self.cut_out: set = set()                       # workers the agent told us to kill
        self.restarts = 0
        self.pending_restarts = 0                       # restarts owed once the endpoint answers again
        self.interrupted = False
        self.run_dir: Optional[Path] = None
        self.run_dir_id: Optional[str] = None  # the run directory's identity as this host checked it (seen_run_dir)
        self.sealer = protocol.Sealer(token)   # for the job once its verdict names it
        self.beats = 0

    # ------------------------------------------------------------------ joining the job
    def register(self) -> None:
        deadline = time.monotonic() + self.cfg.elastic.wait_s
        while True:
            try:
                self.store = connect(self.address, STORE_OP_S, self.token)
                break
            except stores.WrongToken as exc:
                raise ElasticFlowError(f"the job at {self.endpoint} refused host {self.name}: wrong or missing job "
                                       f"token ({str(exc)[:160]})",
                                       "use the same launcher.token_file (or $ELASTICFLOW_JOB_TOKEN) on every host",
                                       exit_code=protocol.EXIT_REFUSED) from None
            except Exception as exc:  # noqa: BLE001 - TCPStore raises RuntimeError/TimeoutError/DistStoreError
                if time.monotonic() > deadline:
                    raise ElasticFlowError(
                        f"no job answers at launcher.endpoint={self.endpoint} after elastic.wait_s="
                        f"{self.cfg.elastic.wait_s:g}s ({str(exc).splitlines()[0][:120]})",
                        "start the same command on the endpoint's host, or check launcher.endpoint and the "
                        "firewall") from None
                time.sleep(RECONNECT_S)
        n = protocol.draw(self.store, "node/count", "node/count")
        pid, nonce = os.getpid(), secrets.token_hex(8)
        self.store.set(f"node/request/{n}", json.dumps({"name": self.name, "pid": pid, "nonce": nonce, "mac":
                                                         protocol.sign(self.token, node_message(n, self.name, pid, nonce))}))
        verdict = self._verdict(n, nonce, deadline + STORE_OP_S)
        if not verdict.get("ok"):
            raise ElasticFlowError(f"the job at {self.endpoint} refused host {self.name}: {verdict.get('reason')}",
                                   "use the same launcher.token_file (or $ELASTICFLOW_JOB_TOKEN) on every host",
                                   exit_code=protocol.EXIT_REFUSED)
        self.sealer = protocol.Sealer(self.token, str(verdict["job"]))
        self.run_dir = Path(verdict["run_dir"])
        self.run_dir_id = seen_run_dir(self.name, self.run_dir, Path(verdict["checkpoint_dir"]), verdict["probe"])

    def _verdict(self, n: int, nonce: str, deadline: float) -> dict:
        """The agent's sealed answer to our request (it names our nonce). One that does not verify is a
        stranger's -- or the agent's, when this host's token is wrong: taken as a refusal after UNVERIFIED_S."""
        key, sealer, unverified_since = f"node/verdict/{n}", protocol.Sealer(self.token), None
        while time.monotonic() < deadline:  # the agent answers within its next round (50 ms)
            raw = protocol.read(self.store, key)
            if raw is not None:
                try:
                    verdict = protocol.loads(sealer.open(key, raw))
                    if isinstance(verdict, dict) and verdict.get("nonce") == nonce:
                        return verdict
                except protocol.Forged:
                    unverified_since = unverified_since or time.monotonic()
                    if time.monotonic() - unverified_since > UNVERIFIED_S:
                        return {"ok": False, "reason": "wrong or missing job token (the agent's answer does not "
                                                       "verify with this host's token)"}
            time.sleep(0.01)
        raise ElasticFlowError(f"the job at {self.endpoint} took this host's request but never answered",
                               "is the endpoint's agent stopped (SIGSTOP) or overloaded? see its output")

    # ------------------------------------------------------------------ workers
    def spawn(self) -> None:
        wid = protocol.draw(self.store, protocol.IDS_KEY, protocol.IDS_KEY) - 1
        slot = next(i for i in range(len(self.slots) + 1) if i not in self.slots.values())
        env = {**os.environ, protocol.ENV_STORE: self.address, protocol.ENV_WORKER_ID: str(wid),
               protocol.ENV_RUN_DIR: str(self.run_dir), protocol.ENV_TOKEN: self.token,
               protocol.ENV_NODE: self.name, protocol.ENV_BIND: self.bind, protocol.ENV_LOCAL_SLOT: str(slot),
               protocol.ENV_LOCAL_WORKERS: str(self.cfg.launcher.procs_per_node),
               protocol.ENV_SPAWNED_AT: str(time.time())}
        if self.run_dir_id is not None:  # each worker reads config.yaml only from that directory (worker.py)
            from ..._util.envnames import ENV_RUN_DIR_ID
            env[ENV_RUN_DIR_ID] = self.run_dir_id
        self.workers[wid] = self.launch(env)
        self.slots[wid] = slot

    def run(self) -> Dict[str, Any]:
        self.register()
        log.info("host %s: joined the job at %s; starting %d worker(s)", self.name, self.endpoint,
                 self.cfg.launcher.procs_per_node)
        for _ in range(self.cfg.launcher.procs_per_node):
            self.spawn()
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            self._watch()
            self._report_last_exits()
        finally:
            signal.signal(signal.SIGINT, previous)
            for proc in self.workers.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)
        return self._result()

    def _on_sigint(self, signum, frame) -> None:
        if self.interrupted:
            for proc in self.workers.values():
                proc.kill()
            raise KeyboardInterrupt
        self.interrupted = True
        for proc in self.workers.values():  # each worker checkpoints with the job at the step boundary
            proc.send_signal(signal.SIGINT)

    def _watch(self) -> None:
        next_store = 0.0
        while self.workers or self.pending_restarts:
            if not self.workers and self.lost_since is not None and \
                    time.monotonic() - self.lost_since > self.cfg.elastic.wait_s:
                self.pending_restarts = 0  # the job is gone, not cut off from us: _result says so
                break
            for wid, proc in list(self.workers.items()):
                code = proc.poll()
                if code is not None:
                    self._exited(wid, code)
            now = time.monotonic()
            if now >= next_store:
                self._talk(now)
                next_store = time.monotonic() + STORE_S
            time.sleep(WATCH_S)

    def _report_last_exits(self) -> None:
        """The last workers' exits, which the agent waits for (bounded: it may be gone)."""
        deadline = time.monotonic() + STORE_OP_S
        while self.unsent and time.monotonic() < deadline:
            self._talk(time.monotonic())
            if self.unsent:
                time.sleep(STORE_S)

    def _exited(self, wid: int, code: int) -> None:
        del self.workers[wid]
        del self.slots[wid]
        self.codes[wid] = code
        self.unsent.append((wid, code))
        if wid in self.cut_out or code == protocol.EXIT_CUT_OUT:
            log.warning("host %s: worker %d was cut out of the job by the agent (hung, or this host was cut off)",
                        self.name, wid)
        elif code not in CLEAN_EXITS and code not in ERROR_EXITS:
            log.warning("host %s: worker %d died (%s)", self.name, wid,
                        f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
        lc = self.cfg.launcher
        cut_off = code == protocol.EXIT_AGENT_LOST  # the agent lost, or only this host cut off from it
        if (code in CLEAN_EXITS and not cut_off) or code in ERROR_EXITS or self.interrupted:
            return
        if not lc.restart_failed:
            log.warning("host %s: worker %d not restarted (launcher.restart_failed=false)", self.name, wid)
            return
        if self.restarts + self.pending_restarts >= lc.max_restarts:
            log.warning("host %s: not restarted: launcher.max_restarts=%d reached", self.name, lc.max_restarts)
            return
        self.pending_restarts += 1  # started by the next _talk, once the endpoint answers (at once if it does)

    def _talk(self, now: float) -> None:
        """One round with the agent's store: heartbeat, exit reports, signals; reconnect after a failure."""
        if self.store is None:
            if now - (self.lost_since or now) < RECONNECT_S and self.lost_since is not None:
                return
            try:
                self.store = connect(self.address, STORE_OP_S, self.token)
            except Exception:  # noqa: BLE001 - still unreachable
                self.lost_since = time.monotonic()
                return
            log.warning("host %s: the job's endpoint %s answers again", self.name, self.endpoint)
            self.lost_since = None
        try:
            self.beats += 1
            protocol.put(self.store, self.sealer, f"node/{self.name}/hb", str(self.beats))
            while self.unsent:
                wid, code = self.unsent[0]
                k = protocol.draw(self.store, "node/exits", "node/exits")
                protocol.put(self.store, self.sealer, f"node/exit/{k}",
                             json.dumps({"node": self.name, "worker": wid, "code": code}))
                self.unsent.pop(0)
            for k, _ in self.signals.read(self.store):
                order = protocol.fetch_json(self.store, self.sealer, f"{self.signals.prefix}/{k}", "node signal")
                if order is not None and type(order.get("worker")) is int and type(order.get("signal")) is int:
                    self._signal(order["worker"], order["signal"])
            if self.pending_restarts and self._job_running():
                log.warning("host %s: starting %d worker(s) again; they join the job as new members", self.name,
                            self.pending_restarts)
                while self.pending_restarts:
                    self.spawn()
                    self.pending_restarts -= 1
                    self.restarts += 1
        except Exception as exc:  # noqa: BLE001 - the link is down or the agent is gone: keep the workers
            if self.lost_since is None:
                log.warning("host %s: the job's endpoint %s stopped answering (%s)", self.name, self.endpoint,
                            str(exc).splitlines()[0][:120])
            self.store, self.lost_since = None, time.monotonic()

    def _job_running(self) -> bool:
        g = protocol.fetch(self.store, self.sealer, "gen/current", "gen/current")
        if g is None or int(g) < 0:
            return g is not None
        info = protocol.fetch_json(self.store, self.sealer, protocol.generation_key(int(g)), "generation")
        return info is not None and info.get("action") != "stop"

    def _signal(self, wid: int, sig: int) -> None:
        proc = self.workers.get(wid)
        if proc is None or not sig:
            return
        if sig == signal.SIGKILL:
            self.cut_out.add(wid)
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def _result(self) -> Dict[str, Any]:
        codes = list(self.codes.values())
        if self.interrupted or protocol.EXIT_INTERRUPTED in codes:
            raise TrainingInterrupted()
        errors = [c for c in codes if c in ERROR_EXITS]
        if errors:
            raise ElasticFlowError(f"host {self.name}: a worker failed (exit code {errors[0]})",
                                   f"the job's error line is on the endpoint's host; see {self.run_dir}/logs/",
                                   exit_code=errors[0])
        # EXIT_REMOVED: this host's last workers were let go (a scale-down, or the job ended before they entered)
        if protocol.EXIT_OK not in codes and protocol.EXIT_REMOVED not in codes and protocol.EXIT_AGENT_LOST in codes:
            raise ElasticFlowError(f"host {self.name}: the job's agent at {self.endpoint} is gone; this host's "
                                   "workers wrote a checkpoint where they could and exited",
                                   "rerun the same command on every host: resume=auto continues from the newest "
                                   "checkpoint", exit_code=protocol.EXIT_AGENT_LOST)
        if protocol.EXIT_OK not in codes and protocol.EXIT_REMOVED not in codes:
            raise ElasticFlowError(f"host {self.name}: no worker of this host finished training "
                                   f"(exit codes {sorted(set(codes))})",
                                   f"see {self.run_dir}/logs/ and the endpoint host's output; rerun this command "
                                   "to rejoin a job that is still running", exit_code=1)
        return {"host": self.name, "workers": len(codes), "restarts": self.restarts}


def seen_run_dir(name: str, run_dir: Path, checkpoint_dir: Path, probe: str) -> str:
    """``check_shared``, and the identity (``paths.identity``, st_dev:st_ino as this host sees it) of the run
    directory in which this host found the probe the agent's host had just written: the workers this node agent
    starts, restarts included, read config.yaml from that directory only, not from one put in its place since
    (worker._read_config, as the local launcher's workers do). Another host sees another st_dev: each node agent
    takes its own."""
    from ..._util.paths import identity

    try:
        before: Optional[str] = identity(run_dir)
    except OSError:
        before = None  # not visible here: check_shared says so in its own line
    check_shared(name, run_dir, checkpoint_dir, probe)
    now = identity(run_dir)
    if now != before:
        raise ElasticFlowError(f"host {name}: the run directory {run_dir} was renamed or replaced while this host "
                               f"checked it (st_dev:st_ino {before}, then {now})",
                               "start the job again in a directory whose parents only you may write")
    return now


def check_shared(name: str, run_dir: Path, checkpoint_dir: Path, probe: str) -> None:
    """Fail in one line unless this host sees (and can remove) the probe files the agent's host just wrote in
    the run directory and checkpoint.dir: without a shared filesystem the workers could neither read the
    job's config nor write checkpoint shards the others can load."""
    for what, shown, directory in (("the run directory", run_dir, run_dir / ".elasticflow" / "hosts"),
                                   ("checkpoint.dir", checkpoint_dir, checkpoint_dir)):
        path = directory / f".probe-{name}-{probe}"
        try:
            seen = path.read_text() == probe
            path.unlink()
        except OSError:
            seen = False
        if not seen:
            raise ElasticFlowError(
                f"host {name} cannot see {what} {shown} "
                "that the endpoint's host writes: launcher=nodes needs it on a filesystem every host shares",
                "put hydra.run.dir and checkpoint.dir on a shared filesystem (NFS, a cluster filesystem) mounted "
                "at the same path on every host")
