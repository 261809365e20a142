"""launcher=nodes with launcher.store=etcd: no host the job cannot lose, the agent's own included.

    elasticflow train model.py launcher=nodes launcher.store=etcd launcher.procs_per_node=2 launcher.nodes=2 \
        launcher.etcd.endpoints=[https://10.0.0.1:2379,https://10.0.0.2:2379,https://10.0.0.3:2379] \
        launcher.etcd.ca=ca.pem launcher.etcd.cert=client.pem launcher.etcd.key=client.key \
        launcher.token_file=/shared/job.token hydra.run.dir=/shared/runs/job1

The same command on every host. The job's records live in etcd, which no host of the job serves. Every host
runs its node agent (its own workers, as with launcher.endpoint) and a standby agent; the first standby to
claim the leader key (distributed/agent/leadership.py) runs the job's agent on a thread of this process. When the
leader's host is lost its lease expires, and another host's standby takes the job over from the state the
leader kept in etcd: the workers of the surviving hosts keep their generation and go on training, the lost
host's are cut out once their heartbeats are ``elastic.heartbeat_timeout_s`` old, and no checkpoint is read.
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from .._util import paths
from ..distributed.agent.leadership import LEADER, Leadership
from ..distributed.comm import netif
from ..distributed.store import etcd as etcd_store, stores
from ..errors import ElasticFlowError, TrainingInterrupted
from .local import LocalLaunch

log = logging.getLogger("elasticflow")


def store_address(cfg: Any, run_dir: Path, token: str) -> str:
    """The job's store in the etcd cluster: its keys under a prefix drawn from the token and the run directory
    (two jobs, or two runs of one, never share keys), or ``launcher.etcd.prefix``."""
    e = cfg.launcher.etcd
    digest = hashlib.sha256(f"{token}\0{Path(run_dir).absolute()}".encode()).hexdigest()[:16]
    files = [Path(f).expanduser().absolute() for f in (e.ca, e.cert, e.key)]
    for what, path in zip(("ca", "cert", "key"), files):
        if not os.access(path, os.R_OK) or not path.is_file():
            raise ElasticFlowError(f"launcher.etcd.{what}={str(path)!r} is not a file this host can read",
                                   "every host needs the CA, the client certificate and its key at the paths given "
                                   "(docs/multi-host.md#no-single-point-of-failure)")
    files = [str(f) for f in files]
    return etcd_store.address(list(e.endpoints), e.prefix or f"elasticflow/{digest}/", *files, *_login(e))


def _login(e: Any) -> Tuple[str, str]:
    """launcher.etcd.user and its password file (checked: a file only you can read), or ('', '')."""
    if not e.user and not e.password_file:
        return "", ""
    hint = ("with etcd's authentication on, pass the job's etcd user and a file holding its password: "
            "launcher.etcd.user=job1 launcher.etcd.password_file=$HOME/.etcd-job1 (chmod 600; "
            "docs/multi-host.md#another-job-on-the-same-etcd)")
    if not e.user or not e.password_file:
        missing = "launcher.etcd.password_file" if e.user else "launcher.etcd.user"
        raise ElasticFlowError(f"{missing} is not set: the etcd login needs both", hint)
    if not e.prefix:
        raise ElasticFlowError("launcher.etcd.user needs launcher.etcd.prefix: the job's etcd role reaches that "
                               "prefix only, so the job's keys must live under it", hint)
    path = Path(e.password_file).expanduser().absolute()
    paths.read_secret(path, "launcher.etcd.password_file", "reaches the job's keys", hint)  # read at each login
    return str(e.user), str(path)


class Standby(threading.Thread):
    """This host's claim on the job's agent: it campaigns while the job runs, and leads when it wins."""

    def __init__(self, cfg: Any, run_dir: Path, token: str, address: str, bind: str):
        super().__init__(name="elasticflow-standby", daemon=True)
        self.cfg, self.run_dir, self.token, self.address, self.bind = cfg, run_dir, token, address, bind
        store = etcd_store.EtcdStore(address, datetime.timedelta(seconds=cfg.elastic.timeout_s))
        self.lead = Leadership(store, token, cfg.launcher.etcd.lease_s)
        self.stop = threading.Event()
        self.leading = threading.Event()     # this host runs the job's agent now (or did, to its end)
        self.result: Optional[Dict[str, Any]] = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                if self.lead.holder() is None and self.lead.claim():
                    self._lead()
            except Exception as exc:  # noqa: BLE001 - etcd without a quorum: a standby waits it out
                if not self.stop.is_set():  # told to stop while its request was in flight: nothing to try again
                    log.warning("the standby agent could not reach etcd (%s); trying again", str(exc)[:160])
            self.stop.wait(self.lead.lease_s / 4)

    def _lead(self) -> None:
        from ..distributed.agent.agent import Agent
        from ..observability.goodput import job

        state = self.lead.state()
        store = self.lead.fenced()
        if state is None:
            store.wipe_except(LEADER)  # a new job: whatever a previous run under this prefix left goes
        agent = Agent(self.cfg, self.run_dir, host=self.bind, token=self.token, launch=_no_launch,
                      served=(store, self.address, store.close), job=state and state["job"])
        agent.local_workers, agent.leader = 0, self.lead
        self.leading.set()
        if state is not None:
            why = "the leader key was forged" if self.lead.forged else "the leader's lease expired"
            log.warning("this host takes over as the job's agent (%s) at generation %d", why, state["generation"])
        try:
            if state is None:
                with job(self.run_dir):  # the job's start and end, for the goodput ledger
                    self.result = agent.run()
            else:
                self.result = agent.run(resume=state)
            self.lead.resign(agent.state.store, agent.state_dict())
        except etcd_store.Deposed as exc:
            # A successor leads, or the key was forged (then this standby's next round takes the job back).
            log.warning("this host's agent lost its leadership (%s); standing by", exc)
            store.close()
            self.leading.clear()
            return
        except (ElasticFlowError, TrainingInterrupted, KeyboardInterrupt) as exc:
            self.error = exc
            self.lead.resign(agent.state.store, agent.state_dict())
        except BaseException as exc:  # a bug of ours: the lease goes at once, and a standby takes the job over
            self.error = exc
            self.lead.resign()
        self.stop.set()

    def finish(self, node: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """This host's node agent is done: wait for the job's end if this host leads it, else stop standing by."""
        if not self.leading.is_set():
            self.stop.set()
        self.join()
        if self.error is not None:
            raise self.error
        return {**(node or {}), **(self.result or {})}


def _no_launch(env):
    raise AssertionError("with launcher.store=etcd every worker is started by its host's node agent")


def run(cfg: Any, run_dir: Path, token: str) -> Dict[str, Any]:
    from ..distributed.agent.node_agent import NodeAgent

    address = store_address(cfg, run_dir, token)
    bind = netif.address_toward(stores.host_of(address), cfg.launcher.interface)
    standby = Standby(cfg, run_dir, token, address, bind)
    standby.start()
    try:
        _wait_for_the_job(standby, cfg.elastic.wait_s)
    except BaseException:
        standby.stop.set()  # the standby goes too: in a process that goes on (fit(), a test), it would campaign on
        raise
    launch = LocalLaunch(cfg.launcher.fork_workers)
    node = None
    try:
        node = NodeAgent(cfg, "etcd", token, launch, bind=bind, address=address).run()
    finally:
        launch.close()
        result = standby.finish(node)
    return result


def _wait_for_the_job(standby: Standby, wait_s: float) -> None:
    """Until an agent runs this job (its state record is fresh): a node agent registering earlier would write
    into keys the first agent wipes (those of an earlier run under the same prefix)."""
    deadline = time.monotonic() + wait_s
    store = standby.lead.store.clone()  # a connection of its own, whose calls give up within wait_s
    store.set_timeout(datetime.timedelta(seconds=min(store.timeout_s, max(wait_s, 2 * etcd_store.OP_S))))
    lead = Leadership(store, standby.token, standby.lead.lease_s)
    while True:
        try:
            if lead.state() is not None:
                return
        except Exception as exc:  # noqa: BLE001 - etcd not up yet (or without a quorum)
            if time.monotonic() > deadline:
                raise ElasticFlowError(f"no etcd member of launcher.etcd.endpoints answers ({str(exc)[:160]})",
                                       "start etcd, or check launcher.etcd.endpoints and the TLS files") from None
        if time.monotonic() > deadline:
            raise ElasticFlowError(f"no agent started the job within elastic.wait_s={wait_s:g}s",
                                   "is etcd answering writes (a quorum of its members up)? see this host's output")
        time.sleep(0.05)
