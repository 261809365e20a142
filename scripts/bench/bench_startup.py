"""What forking workers from the zygote saves (launchers/zygote.py): a short job with several workers, started
with launcher.fork_workers=true and =false in alternation, and a job that replaces a killed worker.

    .venv/bin/python scripts/bench/bench_startup.py                  # ~2 min on 2 idle cores
    .venv/bin/python scripts/bench/bench_startup.py --workers 4 --rounds 5

Each round runs both forms once, in alternating order, and prints for each the wall time of the whole command
and the CPU seconds of it and every process under it (the agent waits for the zygote, the zygote for its
workers, so their CPU time is counted), then the medians and the ratio fork / fresh. On a shared machine
single runs are noisy: the medians over rounds in the same run are the figure. Every subprocess has a timeout.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "digits_mlp.py"
PROBE = REPO / "tests" / "models" / "digits_probe.py"


def run_once(run: Path, fork: bool, workers: int, steps: int, kill: bool) -> tuple:
    """(wall seconds, CPU seconds of the command and its descendants) of one job."""
    model = PROBE if kill else MODEL
    args = [sys.executable, "-m", "elasticflow.cli", "train", str(model), f"hydra.run.dir={run}",
            f"launcher.workers={workers}", f"trainer.max_steps={steps}", "trainer.progress=false",
            "trainer.loggers=[]", f"launcher.fork_workers={str(fork).lower()}"]
    env = {**os.environ}
    if kill:  # worker 1 kills itself at step 10; restart_failed forks (or starts) a replacement
        args += ["launcher.restart_failed=true"]
        env["EF_PROBE_KILL"] = "1:10:forward"
    return timed(args, env)


def alternating(rounds: int, run, label) -> dict:
    """Each round runs both arms (True, then False, or the reverse in odd rounds) once: ``run(round, arm)`` ->
    (wall, cpu), each printed after ``label(round, arm)``. Returns {arm: (median wall, median cpu)}."""
    got = {True: [], False: []}
    for r in range(rounds):
        for arm in ((True, False) if r % 2 == 0 else (False, True)):
            wall, cpu = run(r, arm)
            got[arm].append((wall, cpu))
            print(f"  {label(r, arm)} wall {wall:6.2f} s  cpu {cpu:6.2f} s", flush=True)
    return {a: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for a, v in got.items()}


def timed(args: list, env: dict) -> tuple:
    """(wall seconds, CPU seconds of the command and every process under it) of one command, run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"error: the job exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.workers < 2 or args.rounds < 1 or args.steps < 12:
        ap.error("--workers must be 2 or more, --rounds 1 or more, --steps 12 or more (the kill is at step 10)")
    print(f"load average {os.getloadavg()[0]:.2f}; {args.workers} workers, {args.steps} steps, {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        for kill in (False, True):
            med = alternating(args.rounds, lambda r, fork: run_once(Path(tmp) / f"k{kill}-r{r}-f{fork}", fork,
                                                                       args.workers, args.steps, kill),
                              lambda r, fork: f"{'kill+restart' if kill else 'plain':12} round {r} "
                                              f"fork={str(fork).lower():5}")
            print(f"{'kill+restart' if kill else 'plain'}: fork wall {med[True][0]:.2f} s, cpu {med[True][1]:.2f} s; "
                  f"fresh wall {med[False][0]:.2f} s, cpu {med[False][1]:.2f} s; ratio fork/fresh: wall "
                  f"{med[True][0] / med[False][0]:.2f}x, cpu {med[True][1] / med[False][1]:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
