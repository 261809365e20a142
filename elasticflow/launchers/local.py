"""The local launcher: one worker trains in this process; several are run by an agent.

With ``launcher.workers=1`` (and no room to grow) there is nothing to be elastic about, so the
worker trains in the CLI process itself and skips the store and the process spawn.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Dict

from .worker import COMMAND


def local_launch(env: Dict[str, str]) -> subprocess.Popen:
    """Start a worker process on this machine (the agent's ``launch``)."""
    # Own session: a terminal Ctrl-C reaches only the agent, which forwards it once.
    return subprocess.Popen(COMMAND, env=env, start_new_session=True)


def run(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    # cfg arrives validated (cli._train_task): nothing here checks it again.
    from ..observability.goodput import job

    with job(run_dir):  # the job's start and end, for the goodput ledger
        if cfg.launcher.workers == 1 and not cfg.launcher.max_workers:
            from ..trainer import ElasticTrainer

            return ElasticTrainer(cfg.model, cfg, run_dir=str(run_dir)).fit()
        from ..distributed.agent import Agent

        return Agent(cfg, run_dir, launch=local_launch).run()
