"""The price of ``trainer.reproducible`` (exact sums): step time against the default float32 reduction.

Each row trains one model with W workers twice, ``trainer.reproducible=false`` (the baseline) and ``true``,
with the same ``backend.threads`` (cores // workers, at least 1: what the default picks) so the ratio is the
exact sums' cost alone, not a thread count. The arms alternate within each round, the order flipping every
round, so load from other processes hits both alike. A figure is the median step time (``step_time_s`` of
metrics.jsonl, every step logged) after ``--warmup`` steps, the median over rounds; the ratio is exact over
default (above 1: the mode is slower). Bytes: what one step's sum holds per worker (the flat gradient and the
step's scalars: 4 bytes an element by default, 17 in the mode: two int64 bins and an int8 window).

    .venv/bin/python scripts/bench_exact.py                        # GPT-style decoder and wide MLP, 1/2/4 workers
    .venv/bin/python scripts/bench_exact.py --models mlp --workers 2 --rounds 3 --steps 60
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {  # name -> (model file, its model_args, global batch, micro-batch)
    "gpt": ("models/tiny_gpt.py", {"vocab": 2048, "width": 192, "layers": 4, "heads": 4, "samples": 1024}, 16, 4),
    "mlp": ("models/digits_mlp.py", {"hidden": 4096}, 64, 16),
}


def run(model: str, workers: int, exact: bool, steps: int, threads: int, folder: Path) -> float:
    """One training run; the median step time (seconds) after the warm-up."""
    path, args, batch, micro = MODELS[model]
    out = folder / f"{model}-{workers}-{exact}"
    cmd = [sys.executable, "-m", "elasticflow.cli", "train", str(REPO / path), f"launcher.workers={workers}",
           f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={micro}", f"trainer.max_steps={steps}",
           "trainer.log_every=1", "trainer.progress=false", "trainer.loggers=[]", "optimizer=adamw",
           f"backend.threads={threads}", f"trainer.reproducible={str(exact).lower()}",
           "checkpoint.interval.steps=100000", f"hydra.run.dir={out}",
           *[f"+model_args.{k}={v}" for k, v in args.items()]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > WARMUP]
    return statistics.median(times)


def elements(model: str) -> int:
    """The flat gradient's elements (from a 1-step run's checkpoint: its parameters)."""
    import numpy as np

    import elasticflow.checkpoint as ckpt

    folder = Path(tempfile.mkdtemp(prefix="bench_exact_size_"))
    run(model, 1, False, WARMUP + 1, 1, folder)
    state = ckpt.load(ckpt.latest(folder / f"{model}-1-False" / "checkpoints"))
    return int(sum(np.size(v) for k, v in state.items() if not k.startswith(("optimizer/", "rng/"))))


def main() -> None:
    global WARMUP
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "mlp"], choices=list(MODELS))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    a = parser.parse_args()
    WARMUP = a.warmup
    folder = Path(tempfile.mkdtemp(prefix="bench_exact_"))
    print(f"| model | workers | default ms/step | exact ms/step | ratio | bytes summed per step (default / exact) |")
    print("|---|---|---|---|---|---|")
    for model in a.models:
        n = elements(model)
        for workers in a.workers:
            threads = max(1, (os.cpu_count() or 1) // workers)
            times = {False: [], True: []}
            for r in range(a.rounds):
                for exact in ((False, True) if r % 2 == 0 else (True, False)):
                    times[exact].append(run(model, workers, exact, a.steps, threads, folder))
            base, exact = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {model} ({n / 1e6:.2f}M) | {workers} | {base * 1e3:.1f} | {exact * 1e3:.1f} | "
                  f"**{exact / base:.2f}x** | {4 * n / 2**20:.1f} / {17 * n / 2**20:.1f} MiB |", flush=True)


WARMUP = 10

if __name__ == "__main__":
    main()
