"""One worker at a quarter of its speed among 3 (issue 66's measure): the median step against the same run without
the straggler, with equal shares (elastic.straggler=off) and with shares by speed (rebalance, the default).

    .venv/bin/python scripts/bench/bench_straggler.py               # ~2 min on 2 cores
    .venv/bin/python scripts/bench/bench_straggler.py --rounds 2 --steps 200

Each run: 3 workers of tests/models/digits_probe.py, 64 samples a step in micro-batches of 4 (16 a step), every
micro-batch burning 15 ms of CPU (EF_PROBE_SPIN: the digits MLP alone is too small to be worth balancing). At
step 10, `elasticflow inject RUN --slow 1 --factor 4` makes rank 1 sleep 3x its compute in each step, before the
reduction, as a device at a quarter of its speed would. The median step is taken over the steps after 40 (shares
have settled). The three runs alternate within each round, and each ratio is to the same round's baseline.

The worker that sleeps frees its core: on 2 cores shared by 3 workers the others then run faster than in the
baseline, so "rebalance" can come out below what a dedicated device per worker would show; "off" shows what
the straggler costs with equal shares.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runfiles import jsonl  # noqa: E402 - a leaf beside this script (skips a line torn by a SIGKILL)

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "models" / "digits_probe.py"
ELASTICFLOW = [sys.executable, "-m", "elasticflow.cli"]


def run_once(root: Path, name: str, steps: int, slow: bool, straggler: str) -> float:
    run = root / name
    cmd = ELASTICFLOW + ["train", str(PROBE), f"hydra.run.dir={run}", "launcher.workers=3",
                         "trainer.global_batch_size=64", "trainer.micro_batch_size=4", f"trainer.max_steps={steps}",
                         "trainer.log_every=1", "trainer.progress=false", "checkpoint.interval.steps=null",
                         f"elastic.straggler={straggler}", "backend.threads=1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", "EF_PROBE_SPIN": "0.015"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if slow:
            deadline = time.monotonic() + 120
            while _logged(run) < 10:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"error: {name} did not reach step 10")
                time.sleep(0.05)
            subprocess.run(ELASTICFLOW + ["inject", str(run), "--slow", "1", "--factor", "4"], cwd=REPO, check=True,
                           stdout=subprocess.DEVNULL, timeout=60)
        proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"error: {name} exited {proc.returncode}: see {run}/train.log")
    times = [r["time"] for r in _records(run) if "loss" in r and r["step"] > 40]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def _records(run: Path) -> list:
    path = run / "metrics.jsonl"
    return list(jsonl(path)) if path.is_file() else []


def _logged(run: Path) -> int:
    return max((r.get("step", 0) for r in _records(run)), default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=160)
    args = ap.parse_args()
    kinds = [("baseline", False, "rebalance"), ("straggler, equal shares", True, "off"),
             ("straggler, rebalanced", True, "rebalance")]
    ratios = {k[0]: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench_straggler_") as tmp:
        for r in range(args.rounds):
            got = {name: run_once(Path(tmp), f"r{r}-{i}", args.steps, slow, mode)
                   for i, (name, slow, mode) in enumerate(kinds)}
            for name in got:
                ratios[name].append(got[name] / got["baseline"])
            print(f"round {r + 1}: " + ", ".join(f"{n} {got[n] * 1e3:.1f} ms" for n in got)
                  + f"  (load {os.getloadavg()[0]:.2f})", flush=True)
    for name, values in ratios.items():
        print(f"{name:<26} median step {statistics.median(values):.2f}x the baseline's")


if __name__ == "__main__":
    main()
