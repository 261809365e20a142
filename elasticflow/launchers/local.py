"""The local launcher: one worker trains in this process (elastic multi-worker runs come with the agent)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ..config import validate
from ..errors import ElasticFlowError


def run(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    from ..trainer import ElasticTrainer

    validate(cfg)
    if cfg.launcher.workers != 1:
        raise ElasticFlowError(f"launcher.workers={cfg.launcher.workers}: multi-worker training is not available "
                               "in this version", "run with launcher.workers=1")
    return ElasticTrainer(cfg.model, cfg, run_dir=str(run_dir)).fit()
