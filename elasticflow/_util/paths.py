"""Where things live: the packaged configs (in the wheel: elasticflow/conf; in a checkout: ./conf), and a run's
checkpoints."""
from pathlib import Path
from typing import Any


def conf_dir() -> Path:
    here = Path(__file__).resolve().parents[1]  # elasticflow/ (this file is elasticflow/_util/paths.py)
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"elasticflow's conf/ directory is missing next to {here}; reinstall the package")


def checkpoint_dir(cfg: Any, run_dir: Path) -> Path:
    """``checkpoint.dir`` (``~`` expanded), else RUN_DIR/checkpoints."""
    return Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"
