"""The agent (job master): hosts the store, spawns and watches workers, owns membership.

Membership is a generation number plus the member list in rank order. At every change the agent
publishes the next generation in the store and rewrites RUN_DIR/workers.json; survivors keep their
relative order, so ranks stay dense.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf
from torch.distributed import TCPStore

from ..errors import ElasticFlowError
from . import protocol

log = logging.getLogger("elasticflow")
WATCH_S = 0.01  # how often the agent polls its workers: a SIGKILLed worker is noticed within ~10 ms


@dataclass
class Worker:
    id: int
    proc: subprocess.Popen
    started: float

    @property
    def pid(self) -> int:
        return self.proc.pid


class Agent:
    """Run ``cfg`` with ``launcher.workers`` local worker processes; returns rank 0's summary."""

    def __init__(self, cfg: Any, run_dir: Path, host: str = "127.0.0.1"):
        self.cfg, self.run_dir, self.host = cfg, Path(run_dir), host
        self.state_dir = self.run_dir / ".elasticflow"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=cfg.elastic.timeout_s),
                              wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"
        self.generation = 0
        self.members: List[Worker] = []      # rank order
        self.finished: List[Worker] = []
        self.next_id = 0
        self.below_min_since: Optional[float] = None
        self.interrupted = False

    # ------------------------------------------------------------------ workers
    def spawn(self) -> Worker:
        wid = self.next_id
        self.next_id += 1
        env = {**os.environ, protocol.ENV_STORE: self.address, protocol.ENV_WORKER_ID: str(wid),
               protocol.ENV_RUN_DIR: str(self.run_dir),
               protocol.ENV_LOCAL_WORKERS: str(max(self.cfg.launcher.workers, 1))}
        # Own session: a terminal Ctrl-C reaches only the agent, which forwards it once.
        proc = subprocess.Popen([sys.executable, "-m", "elasticflow.distributed.worker"], env=env,
                                start_new_session=True)
        return Worker(wid, proc, time.time())

    def publish(self, action: str = "train", reason: str = "") -> None:
        """Announce generation ``self.generation`` with the current members."""
        g = self.generation
        self.store.set(protocol.generation_key(g), protocol.encode([w.id for w in self.members], action, reason))
        self.store.set("gen/current", str(g))
        snapshot = {"generation": g, "time": time.time(), "action": action,
                    "members": [{"rank": r, "worker_id": w.id, "pid": w.pid, "host": self.host}
                                for r, w in enumerate(self.members)]}
        tmp = self.run_dir / ".workers.json.tmp"
        tmp.write_text(json.dumps(snapshot, indent=1))
        os.replace(tmp, self.run_dir / "workers.json")

    def event(self, kind: str, **fields) -> None:
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "event": kind, "source": "agent", **fields}) + "\n")

    # ------------------------------------------------------------------ main loop
    def run(self) -> Dict[str, Any]:
        OmegaConf.save(self.cfg, self.state_dir / "config.yaml")
        self.members = [self.spawn() for _ in range(self.cfg.launcher.workers)]
        self.publish()
        self.event("started", generation=0, workers=[w.id for w in self.members], pids=[w.pid for w in self.members])
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            return self._watch()
        finally:
            signal.signal(signal.SIGINT, previous)
            self._reap_all()

    def _on_sigint(self, signum, frame) -> None:
        if self.interrupted:  # second Ctrl-C: stop everything now
            for w in self.members:
                _signal(w, signal.SIGKILL)
            raise KeyboardInterrupt
        self.interrupted = True
        log.warning("Ctrl-C: workers finish the current step and write a checkpoint (Ctrl-C again to abort)")
        for w in self.members:
            _signal(w, signal.SIGINT)

    def _watch(self) -> Dict[str, Any]:
        lc, el = self.cfg.launcher, self.cfg.elastic
        while True:
            changed = False
            for w in list(self.members):
                rc = w.proc.poll()
                if rc is None:
                    continue
                self.members.remove(w)
                if rc == protocol.EXIT_OK:
                    self.finished.append(w)
                    continue
                if rc in (protocol.EXIT_INTERRUPTED, protocol.EXIT_BELOW_MIN) or rc in (1, 2):
                    self.finished.append(w)
                    if rc in (1, 2):
                        return self._fail_with_worker_error(w, rc)
                    continue
                how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                log.warning("worker %d (pid %d) died (%s)", w.id, w.pid, how)
                self.event("left", worker=w.id, pid=w.pid, cause=how, generation=self.generation + 1)
                changed = True
            if changed and self.members:
                self.generation += 1
                if len(self.members) >= lc.min_workers:
                    self.publish()
                elif self.below_min_since is None:
                    self.below_min_since = time.monotonic()
            if self.below_min_since is not None and self.members:
                if len(self.members) >= lc.min_workers:
                    self.below_min_since = None
                    self.publish()
                elif time.monotonic() - self.below_min_since > el.wait_s:
                    reason = (f"only {len(self.members)} worker(s) left, fewer than launcher.min_workers="
                              f"{lc.min_workers}, for elastic.wait_s={el.wait_s:g}s")
                    self.event("stop", reason=reason, generation=self.generation)
                    self.publish("stop", reason)
                    self.below_min_since = None
                    self.stop_reason = reason
            if not self.members:
                return self._result()
            time.sleep(WATCH_S)

    def _result(self) -> Dict[str, Any]:
        codes = [w.proc.returncode for w in self.finished]
        if protocol.EXIT_BELOW_MIN in codes:
            raise ElasticFlowError(getattr(self, "stop_reason", "too few workers") + "; a checkpoint was written",
                                   "resume with the same command (resume=auto), or lower launcher.min_workers",
                                   exit_code=protocol.EXIT_BELOW_MIN)
        if protocol.EXIT_INTERRUPTED in codes or self.interrupted:
            from ..errors import TrainingInterrupted

            raise TrainingInterrupted()
        if not self.finished:
            raise ElasticFlowError("every worker died; nothing finished training",
                                   "see the worker logs under RUN_DIR/logs/; resume=auto continues from the "
                                   "newest checkpoint", exit_code=1)
        summary_file = self.run_dir / "summary.json"
        return json.loads(summary_file.read_text()) if summary_file.is_file() else {}

    def _fail_with_worker_error(self, w: Worker, rc: int) -> Dict[str, Any]:
        err_file = self.state_dir / f"error-{w.id}.json"
        err = json.loads(err_file.read_text()) if err_file.is_file() else {
            "message": f"worker {w.id} failed with exit code {rc}", "hint": "see RUN_DIR/logs/"}
        for other in self.members:
            _signal(other, signal.SIGTERM)
        raise ElasticFlowError(err["message"], err.get("hint", ""), exit_code=rc)

    def _reap_all(self) -> None:
        deadline = time.monotonic() + 10
        for w in self.members:
            while w.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if w.proc.poll() is None:
                _signal(w, signal.SIGKILL)
                w.proc.wait(5)


def _signal(w: Worker, sig: int) -> None:
    try:
        w.proc.send_signal(sig)
    except ProcessLookupError:
        pass
