"""Launchers: how the workers of a run are started (local processes, processes on several hosts, SLURM job steps,
or Kubernetes pods)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict


def run(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    """Train ``cfg`` (already validated: see cli._train_task) with its launcher; returns the final summary."""
    if not cfg.launcher.trust_shared_dirs:
        from .._util.paths import checkpoint_dir, refuse_code_folder, refuse_if_shared

        # Before anything of ours is written there, or read back (the workers import what config.yaml names),
        # each with every directory above it: a parent others may write lets them swap the folder whole.
        for what, path in (("run directory", run_dir), ("run directory's .elasticflow/", run_dir / ".elasticflow"),
                           ("checkpoint folder", checkpoint_dir(cfg, run_dir))):
            refuse_if_shared(path, what)
        if cfg.model:
            refuse_code_folder(Path(str(cfg.model)).parent, "model file's folder")
    if cfg.launcher.name == "slurm":
        from .slurm import run as run_slurm

        return run_slurm(cfg, run_dir)
    if cfg.launcher.name == "kubernetes":
        from .kubernetes import run as run_kubernetes

        return run_kubernetes(cfg, run_dir)
    if cfg.launcher.name == "nodes":
        from .nodes import run as run_nodes

        return run_nodes(cfg, run_dir)
    from .local import run as run_local

    return run_local(cfg, run_dir)
