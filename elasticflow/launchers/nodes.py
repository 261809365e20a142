"""launcher=nodes: a job across hosts started torchrun-style, the same command on every host.

    elasticflow train model.py launcher=nodes launcher.endpoint=10.0.0.1:29400 launcher.procs_per_node=2 \
        launcher.nodes=2 launcher.token_file=/shared/job.token hydra.run.dir=/shared/runs/job1

The host that owns the endpoint's address runs the job's agent (its store listens there) and its own
workers; every other host runs a node agent (distributed/agent/node_agent.py) that starts, watches and restarts
its workers and joins them to the job. A host started later joins the running job: that is how a job
grows by a host. docs/multi-host.md says what the hosts must share (the token, the run directory and
checkpoint.dir) and what the endpoint trusts.
"""
from __future__ import annotations

import os
import math
import socket
import string
from pathlib import Path
from typing import Any, Dict

from .._util import paths
from ..distributed import protocol
from ..distributed.comm import netif
from ..errors import ElasticFlowError
from .local import LocalLaunch

TOKEN_HINT = ("write one secret to a file readable only by you (`openssl rand -hex 32 > ~/.ef-token; "
              "chmod 600 ~/.ef-token`) and pass launcher.token_file=$HOME/.ef-token on every host, or export "
              f"{protocol.ENV_JOB_TOKEN}")


def job_token(cfg: Any) -> str:
    """The job's shared secret: launcher.token_file, else $ELASTICFLOW_JOB_TOKEN. It signs every request to
    the agent and never crosses the network itself."""
    path = cfg.launcher.token_file
    if path:
        token = paths.read_secret(path, "launcher.token_file", "can join or stop the job", TOKEN_HINT)
    else:
        token = os.environ.get(protocol.ENV_JOB_TOKEN, "").strip()
    if not token:
        raise ElasticFlowError("launcher=nodes needs the job's shared token", TOKEN_HINT)
    bits = token_bits(token)
    if bits < MIN_TOKEN_BITS:
        where = str(path) if path else f"${protocol.ENV_JOB_TOKEN}"
        raise ElasticFlowError(f"the job token in {where} is too weak to guess offline: about {bits:.0f} bits, "
                               f"at least {MIN_TOKEN_BITS} needed (records travel in clear, sealed with it)",
                               "generate one: `openssl rand -hex 32 > ~/.ef-token; chmod 600 ~/.ef-token`")
    return token


MIN_TOKEN_BITS = 128


def token_bits(token: str) -> float:
    """What a token is worth against guessing, estimated from its alphabet: 32 hex digits are 128 bits. A token
    of fewer than 8 distinct characters ("x" * 32, "abab...") counts as nothing: no generator makes one."""
    if len(set(token)) < 8:
        return 0.0
    if all(c in string.hexdigits for c in token):
        alphabet = 16
    elif token.isdigit():
        alphabet = 10
    elif all(c in string.ascii_letters + string.digits + "-_+/=" for c in token):
        alphabet = 64  # base64 (a lowercase-only token is rated as if it were, a little generously)
    else:
        alphabet = 94  # printable ASCII
    return len(token) * math.log2(alphabet)


def owns(host: str) -> bool:
    """Whether ``host`` (the endpoint's) is an address of this machine."""
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise ElasticFlowError(f"cannot resolve launcher.endpoint's host {host!r} ({exc})",
                               "pass its address: launcher.endpoint=10.0.0.1:29400") from None
    return address in netif.interfaces().values()


def run(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    token = job_token(cfg)
    if cfg.checkpoint.dir:  # the workers of every host must name the same directory: no relative path
        cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir).expanduser().absolute())
    if cfg.launcher.store == "etcd":  # no endpoint: every host runs a standby agent (failover.py)
        from .failover import run as run_with_standbys
        return run_with_standbys(cfg, run_dir, token)
    host, port = cfg.launcher.endpoint.rsplit(":", 1)
    if not owns(host):
        from ..distributed.agent.node_agent import NodeAgent

        launch = LocalLaunch(cfg.launcher.fork_workers)
        try:
            return NodeAgent(cfg, cfg.launcher.endpoint, token, launch,
                             bind=netif.address_toward(host, cfg.launcher.interface)).run()
        finally:
            launch.close()
    from ..distributed.agent.agent import Agent
    from ..observability.goodput import job

    from .._util.envnames import ENV_RUN_DIR_ID
    from .._util.paths import identity

    address = socket.gethostbyname(host)
    launch = LocalLaunch(cfg.launcher.fork_workers)
    try:  # this host's workers read config.yaml from the run directory as checked (worker._read_config)
        agent = Agent(cfg, run_dir, host=address, port=int(port), token=token, launch=launch,
                      worker_env={protocol.ENV_BIND: address, ENV_RUN_DIR_ID: identity(run_dir)})
    except OSError as exc:
        raise ElasticFlowError(f"cannot listen on launcher.endpoint={cfg.launcher.endpoint} ({exc.strerror})",
                               "pick a free port (another job may hold this one), the same on every host") from None
    try:
        with job(run_dir):  # the job's start and end, for the goodput ledger
            return agent.run()
    finally:
        launch.close()
