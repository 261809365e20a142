"""Where the packaged configs live (in the wheel: elasticflow/conf; in a checkout: ./conf)."""
from pathlib import Path


def conf_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"elasticflow's conf/ directory is missing next to {here}; reinstall the package")
