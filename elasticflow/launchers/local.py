"""The local launcher: one worker trains in this process; several are run by an agent.

With ``launcher.workers=1`` (and no room to grow) there is nothing to be elastic about, so the
worker trains in the CLI process itself and skips the store and the process spawn.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

from .worker import COMMAND
from .zygote import ForkServer

log = logging.getLogger("elasticflow")


def local_launch(env: Dict[str, str]) -> subprocess.Popen:
    """Start a worker process on this machine as a fresh interpreter."""
    # Own session: a terminal Ctrl-C reaches only the agent, which forwards it once.
    return subprocess.Popen(COMMAND, env=env, start_new_session=True)


class LocalLaunch:
    """The agent's (or a node agent's) ``launch`` on this machine: each worker forked from the zygote
    (``zygote.py``: torch imported once, not once a worker) with ``launcher.fork_workers`` on Linux, else,
    or where the zygote cannot serve, a fresh interpreter. ``close()`` when no more workers will start."""

    def __init__(self, fork: bool = True):
        self.fork = fork and sys.platform == "linux"
        self.server: Optional[ForkServer] = None

    def __call__(self, env: Dict[str, str]) -> Any:
        if self.fork:
            if self.server is None:
                self.server = ForkServer()
            proc = self.server.launch(env)
            if proc is not None:
                return proc
            self.fork = False
            log.debug("the fork server cannot serve: workers start as fresh interpreters")
        return local_launch(env)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def run(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    # cfg arrives validated (cli._train_task): nothing here checks it again.
    from ..checkpoint import jobdir
    from ..observability.goodput import job

    with job(run_dir):  # the job's start and end, for the goodput ledger
        if cfg.launcher.workers == 1 and not cfg.launcher.max_workers:
            from ..trainer import ElasticTrainer

            try:
                return ElasticTrainer(cfg.model, cfg, run_dir=str(run_dir)).fit()
            finally:  # a failed run frees its folder too: the next in this process (elasticflow.fit()) takes it
                jobdir.release_all()
        from ..distributed.agent.agent import Agent
        from .._util.envnames import ENV_RUN_DIR_ID
        from .._util.paths import identity

        launch = LocalLaunch(cfg.launcher.fork_workers)
        # The run directory as checked (launchers.run): each worker reads config.yaml from it only if it is still
        # that directory, not one put in its place through a parent others may write (worker._read_config).
        checked = {ENV_RUN_DIR_ID: identity(run_dir)}
        try:
            return Agent(cfg, run_dir, launch=launch, worker_env=checked).run()
        finally:
            launch.close()
