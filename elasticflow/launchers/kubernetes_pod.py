"""What runs in the pods of launcher=kubernetes (kubernetes_manifests.py writes these commands):

    python -m elasticflow.launchers.kubernetes_pod agent  --run-dir DIR --files DIR --submission ID --port PORT
    python -m elasticflow.launchers.kubernetes_pod worker --run-dir DIR --files DIR --submission ID --endpoint H:P

The agent pod runs the job's agent with no worker of its own, its store on the pod's address. Each worker pod
waits for the agent's Service to answer, then runs a node agent (distributed/agent/node_agent.py) with one worker,
named after the pod. Kubernetes ends a pod with SIGTERM (a scale-down, a preemption, a deletion); Python as
PID 1 would ignore it, so both install a handler: the worker pod kills its worker (the job goes on without
it, exactly as after any lost worker) and exits 143; the agent takes it as Ctrl-C (the workers checkpoint at
the step boundary and stop).

The agent writes RUN_DIR/.elasticflow/ended-<submission> with its exit code as it ends: a worker pod placed
after a finished job (0) exits 0, and after one that failed for good (an exit its Job's failure policy fails
the Job on) with the same code, instead of waiting for an agent that will not come back.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from ..distributed import protocol
from ..distributed.agent.agent import Agent
from ..errors import ElasticFlowError
from .kubernetes_manifests import ENV_NODE_NAME, ENV_POD_IP, FAIL_JOB_EXITS
from .local import local_launch

log = logging.getLogger("elasticflow")
WAIT_LOG_S = 60.0  # while the agent does not answer, say so this often


def _no_local_worker(env: Dict[str, str]):
    raise ElasticFlowError("the Kubernetes agent pod starts no worker of its own", "workers come in worker pods")


def load_config(files: Path) -> Any:
    """The config written at submission (validated then), its model file where the pod holds it."""
    from ..config.schema import Config

    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(files / "config.yaml"))
    cfg.model = str(files / Path(cfg.model).name)
    return cfg


def _environ(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ElasticFlowError(f"${name} is not set in this pod", "run the pods from the manifests that "
                                                                  "launcher=kubernetes writes (they set it)")
    return value


def ended_file(run_dir: Path, submission: str) -> Path:
    return run_dir / ".elasticflow" / f"ended-{submission}"


def ended(run_dir: Path, submission: str) -> Optional[int]:
    """The agent's exit code once it has ended (this submission's), else None."""
    try:
        return int(ended_file(run_dir, submission).read_text())
    except (OSError, ValueError):
        return None


def run_agent(cfg: Any, ns: argparse.Namespace) -> Dict[str, Any]:
    from ..observability.goodput import job

    run_dir = Path(ns.run_dir)
    ended_file(run_dir, ns.submission).unlink(missing_ok=True)  # a retried agent pod: the job is on again
    cfg.launcher.workers = 0
    # Kubernetes' SIGTERM is a Ctrl-C to the agent: its handler (set by Agent.run) checkpoints and stops.
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    try:
        agent = Agent(cfg, run_dir, host=_environ(ENV_POD_IP), port=ns.port, token=_environ(protocol.ENV_JOB_TOKEN),
                         launch=_no_local_worker)
    except OSError as exc:
        raise ElasticFlowError(f"cannot listen on port {ns.port} in the agent pod ({exc.strerror})",
                               "pass another launcher.port") from None
    with job(run_dir):  # the job's start and end, for the goodput ledger
        return agent.run()


def _wait_for_agent(endpoint: str, run_dir: Path, submission: str) -> Optional[int]:
    """Until the agent's Service answers (None), or the agent has ended for good (its exit code: 0, or one
    that fails its Job). A worker pod may be placed long before the agent pod (an image pull, a full node), or
    while the agent Job replaces a lost agent pod: it waits, without spending the Job's backoffLimit."""
    host, port = endpoint.rsplit(":", 1)
    said = -WAIT_LOG_S
    while True:
        code = ended(run_dir, submission)
        if code == 0 or code in FAIL_JOB_EXITS:
            return code
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            return None
        except OSError as exc:
            if time.monotonic() - said >= WAIT_LOG_S:
                log.info("waiting for the job's agent at %s (%s)", endpoint, exc)
                said = time.monotonic()
            time.sleep(1.0)


class _Leave:
    """The worker pod's SIGTERM: kill this pod's worker and exit 143, before or while the node agent runs."""

    def __init__(self):
        self.node = None

    def __call__(self, signum, frame) -> None:
        for proc in (self.node.workers.values() if self.node is not None else ()):
            proc.kill()
        raise SystemExit(128 + signal.SIGTERM)


def run_worker(cfg: Any, ns: argparse.Namespace) -> Dict[str, Any]:
    from ..distributed.agent.node_agent import NodeAgent

    leave = _Leave()
    signal.signal(signal.SIGTERM, leave)
    run_dir, name = Path(ns.run_dir), os.environ.get(ENV_NODE_NAME) or socket.gethostname()
    cfg.launcher.procs_per_node = 1
    token, bind = _environ(protocol.ENV_JOB_TOKEN), _environ(ENV_POD_IP)
    code = _wait_for_agent(ns.endpoint, run_dir, ns.submission)
    if code == 0:
        return {"host": name, "workers": 0, "joined": "no, the job had finished"}
    if code is not None:
        raise ElasticFlowError(f"the job's agent ended with exit code {code} before pod {name} joined",
                               "see the agent pod's log (kubectl logs job/JOB-agent)", exit_code=code)
    leave.node = node = NodeAgent(cfg, ns.endpoint, token, local_launch, bind=bind, name=name)
    try:
        summary = node.run()
    except ElasticFlowError as exc:
        if node.codes and set(node.codes.values()) == {protocol.EXIT_BELOW_MIN}:
            # The job stopped below min_workers: the pod's exit says so (STOPPED_EXITS), not a failure of its own.
            raise ElasticFlowError(exc.message, exc.hint, exit_code=protocol.EXIT_BELOW_MIN) from None
        raise
    if protocol.EXIT_OK not in node.codes.values():
        # Retired by a scale-down through the agent's store: exit 0 would complete the Job (its success
        # policy), removing the other pods. `elasticflow scale` patches the Job instead (kubernetes.scale).
        raise ElasticFlowError(f"pod {name}'s worker left the job before it finished training",
                               "scale a Kubernetes job with `elasticflow scale RUN_DIR` where you submitted it",
                               exit_code=protocol.EXIT_REMOVED)
    return summary


def main(argv: Optional[List[str]] = None) -> None:
    from .exits import debug_requested, print_done, report

    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("role", choices=("agent", "worker"))
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--files", required=True, help="where config.yaml and the model file are")
    parser.add_argument("--submission", required=True)
    parser.add_argument("--port", type=int, default=29400, help="agent: where the store listens")
    parser.add_argument("--endpoint", help="worker: the agent's Service, HOST:PORT")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = Path(ns.run_dir)
    handlers: List[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if ns.role == "agent":  # the job's log on the volume, as the other launchers' agents write it
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=handlers)
    try:
        # No validate() here: the file is the config that `elasticflow train` validated before writing it
        # (the merge into the schema still refuses unknown keys and wrong types).
        cfg = load_config(Path(ns.files))
        summary = run_agent(cfg, ns) if ns.role == "agent" else run_worker(cfg, ns)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - one line, as in the CLI
        try:
            report(exc, debug_requested())
        except SystemExit as done:
            if ns.role == "agent":
                protocol.write_private(ended_file(run_dir, ns.submission), str(done.code))
            raise
    if ns.role == "agent":
        protocol.write_private(ended_file(run_dir, ns.submission), "0")
    print_done(summary, run_dir if ns.role == "agent" else None)


if __name__ == "__main__":
    main()
