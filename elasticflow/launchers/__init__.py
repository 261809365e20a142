"""Launchers: how the workers of a run are started (local processes now; SLURM later)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict


def run(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    """Train ``cfg`` with its launcher; returns the final summary."""
    from .local import run as run_local

    return run_local(cfg, run_dir)
