"""Shared test helpers: run the real CLI in a subprocess, read what a run wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
ELASTICFLOW = [sys.executable, "-m", "elasticflow.cli"]


def run_cli(args: List[str], cwd: Optional[Path] = None, timeout: float = 300, env: Optional[dict] = None,
            check: bool = False) -> subprocess.CompletedProcess:
    """`elasticflow ARGS` in a subprocess, bounded in time; returns the completed process (text output)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(ELASTICFLOW + [str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"elasticflow {' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def train(model: str | Path, run_dir: Path, *overrides: str, timeout: float = 300, check: bool = True,
          env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`elasticflow train MODEL hydra.run.dir=RUN_DIR OVERRIDES...`."""
    model = Path(model)
    if not model.is_absolute() and not model.exists():
        model = MODELS / model
    return run_cli(["train", model, f"hydra.run.dir={run_dir}", "trainer.progress=false", *overrides],
                   timeout=timeout, check=check, env=env)


def metrics(run_dir: Path) -> List[dict]:
    """Every record of RUN_DIR/metrics.jsonl (training and eval records)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def consumed_by_epoch(run_dir: Path, record: Path) -> Dict[int, Counter]:
    """The sample ids tests/models/digits_probe.py recorded under EF_PROBE_RECORD, per epoch, counting each
    step's ids from the generation that committed it (metrics.jsonl): a step redone after a failure counts once.
    Under topology=local_sgd|diloco a replica's part of a step counts from the generation that trained the
    replica whose move the round used (the ``round`` events' ``trained_in``): a survivor keeps its own."""
    committed = {r["step"]: r["generation"] for r in metrics(run_dir) if "loss" in r}
    trained: Dict[tuple, int] = {}  # (step, replica) -> generation
    events = Path(run_dir) / "events.jsonl"
    for line in (events.read_text().splitlines() if events.is_file() else []):
        e = json.loads(line)
        if e.get("event") == "round":
            for step in range(e["first_step"], e["last_step"] + 1):
                trained.update(((step, k), g) for k, g in enumerate(e["trained_in"]))
    consumed: Dict[int, Counter] = {}
    for f in Path(record).glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            replica = r.get("replica", -1)
            used = trained.get((r["step"], replica)) if replica >= 0 else committed.get(r["step"])
            if used == r["generation"]:
                consumed.setdefault(r["epoch"], Counter()).update(r["ids"])
    return consumed


def losses(run_dir: Path) -> List[float]:
    """The per-step training losses (needs trainer.log_every=1), in step order."""
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


@pytest.fixture
def write_model(tmp_path):
    """Write a model file from source text; returns its path."""
    def _write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(source)
        return path
    return _write
