"""A worker's default intra-op threads on a host that other work keeps busy, against ``backend.threads=1``.

Starts ``--hogs`` CPU hogs (``python -c "while True: pass"``), then alternates 1-worker runs of ``--model`` for
``--steps`` steps: at the default threads (which count the cores other processes keep busy:
elasticflow/_util/affinity.py), at ``backend.threads=1``, and at ``backend.threads=N`` with N the host's cores (the
default before it counted the busy ones, when nothing else ran). Each run's figure is its median step interval
(metrics.jsonl's ``time``, ``trainer.log_every=1``, the first ``--skip`` steps left out); prints the median of
each and the ratios to ``backend.threads=1`` (target: the default within 1.3x). The hogs are stopped at the end.

    .venv/bin/python scripts/bench/bench_threads.py                 # 2 hogs, 3 rounds, digits CNN, 40 steps
    .venv/bin/python scripts/bench/bench_threads.py --hogs 0        # an idle host: the default should use every core
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(model: Path, run_dir: Path, steps: int, skip: int, overrides: list) -> tuple:
    """One run: (median ms per step, the banner's threads line)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "elasticflow.cli", "train", str(model), f"hydra.run.dir={run_dir}",
           f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.progress=false",
           *overrides]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: a run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1:])]
    said = re.search(r"^\s*(\d+ intra-op threads? per worker.*)$", done.stdout + done.stderr, re.M)
    return statistics.median(gaps) * 1e3, said.group(1) if said else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hogs", type=int, default=2, help="CPU hogs running throughout")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each setting, alternating")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5, help="steps left out at the start (warm-up)")
    ap.add_argument("--model", type=Path, default=REPO / "models" / "digits_cnn.py")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    settings = {"default": [], "backend.threads=1": ["backend.threads=1"],
                f"backend.threads={cores} (all cores)": [f"backend.threads={cores}"]}
    ms = {name: [] for name in settings}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    said = set()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                order = list(settings) if r % 2 == 0 else list(settings)[::-1]
                for name in order:
                    value, line = run(args.model, Path(tmp) / "run", args.steps, args.skip, settings[name])
                    ms[name].append(value)
                    if name == "default":
                        said.add(line)
                    print(f"round {r + 1} {name}: {value:.2f} ms/step", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    base = statistics.median(ms["backend.threads=1"])
    print(f"\n{args.model.name}, {args.steps} steps, {args.hogs} CPU hogs on {cores} cores, {args.rounds} rounds")
    print("the default chose: " + " | ".join(sorted(said)))
    for name, values in ms.items():
        med = statistics.median(values)
        print(f"  {name:<28} median {med:8.2f} ms/step  {med / base:6.2f}x backend.threads=1  "
              f"(runs: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
