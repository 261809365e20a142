"""One `elasticflow train` command timed under two trees, run after run in alternating order: is a change neutral?

Each run trains with this repository's model file (so both trees train the same thing) and elasticflow imported
from its tree; the figure is the mean step time over the run's step records after ``--skip`` steps (the time field
of metrics.jsonl, with ``trainer.log_every=1``). The order alternates (this, base; base, this; ...), so a
machine that slows during the session slows both alike. Prints the median of each and their ratio.
``--wall``: the figure is the whole command's wall time instead (start-up and exit included: a short job).

    git worktree add /tmp/before HEAD~1
    .venv/bin/python scripts/bench/bench_trees.py --base /tmp/before --runs 6 -- launcher.workers=2 backend.threads=1 \
        +model_args.hidden=1024
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def step_ms(tree: Path, model: Path, run: Path, steps: int, skip: int, overrides: list, wall: bool = False) -> float:
    """One run of MODEL under TREE's elasticflow; its mean ms/step after ``skip`` steps (``wall``: the command's
    seconds)."""
    shutil.rmtree(run, ignore_errors=True)
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "elasticflow.cli", "train", str(model), f"hydra.run.dir={run}",
           f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.progress=false", *overrides]
    done = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: a run under {tree} failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    if wall:
        return time.perf_counter() - started
    times = [json.loads(line)["time"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return (times[-1] - times[skip]) / (len(times) - 1 - skip) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the tree to compare with (a git worktree or archive)")
    ap.add_argument("--model", type=Path, default=REPO / "models" / "digits_mlp.py")
    ap.add_argument("--runs", type=int, default=6, help="runs per tree")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--skip", type=int, default=200, help="steps left out at the start (warm-up)")
    ap.add_argument("--wall", action="store_true", help="time the whole command (seconds), not the steps")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (after --)")
    args = ap.parse_args()
    if not (args.base / "elasticflow").is_dir():
        raise SystemExit(f"error: --base {args.base}: no elasticflow/ package there (hint: git worktree add DIR REV)")
    trees = {"this tree": REPO, "base": args.base.resolve()}
    unit = "s (wall)" if args.wall else "ms/step"
    times = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                times[name].append(step_ms(trees[name], args.model.resolve(), Path(tmp) / "run", args.steps, args.skip,
                                           args.overrides, args.wall))
                print(f"  run {r} {name:9}: {times[name][-1]:.3f} {unit}", flush=True)
    mine, base = (statistics.median(times[n]) for n in trees)
    print(f"median {unit}: this tree {mine:.3f}, base {base:.3f}; this tree / base = {mine / base:.3f}")


if __name__ == "__main__":
    main()
