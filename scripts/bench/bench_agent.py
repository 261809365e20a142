"""The agent's own CPU while a job trains: the share of a core the job master takes from the workers.

    .venv/bin/python scripts/bench/bench_agent.py --baseline-tree /tmp/before    # another checkout, same rounds

A 2-worker job of the digits probe paced at ``--step-sleep`` seconds a step (so every run lasts as long)
runs ``--steps`` steps; the agent is the `elasticflow train` process itself, and its user + system CPU
seconds (/proc/PID/stat) over the wall seconds from the first logged step to its last reading before it
exits is the figure (start-up, imports and spawns, left out). On 2 cores every
percent the agent burns is taken from the two workers. With ``--baseline-tree`` the same job runs from
that checkout in alternating rounds, and the ratio of the medians is printed.
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
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> Optional[float]:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def one_run(tree: Path, run_dir: Path, steps: int, step_sleep: float) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "EF_PROBE_SLEEP": str(step_sleep), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "elasticflow.cli", "train", str(tree / "tests" / "models" / "digits_probe.py"),
           f"hydra.run.dir={run_dir}", "launcher.workers=2", f"trainer.max_steps={steps}", "trainer.progress=false"]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tree)
        first = last = None  # (monotonic, cpu seconds) once training runs: start-up (imports, spawns) left out
        while proc.poll() is None:
            cpu = cpu_seconds(proc.pid)
            if cpu is not None and (run_dir / "metrics.jsonl").is_file():
                last = (time.monotonic(), cpu)
                first = first or last
            time.sleep(0.1)
    if proc.returncode != 0 or first is None or last[0] - first[0] < 1.0:
        raise SystemExit(f"error: the job in {run_dir} exited {proc.returncode} or trained under a second; see "
                         f"{run_dir}.log")
    return (last[1] - first[1]) / (last[0] - first[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-sleep", type=float, default=0.05, help="seconds per step in forward (default 0.05)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-tree", type=Path, help="a checkout to time in the same rounds")
    args = ap.parse_args()
    if args.baseline_tree is not None and not (args.baseline_tree / "elasticflow").is_dir():
        print(f"error: --baseline-tree {args.baseline_tree} holds no elasticflow package\nhint: e.g. "
              "git archive COMMIT | tar -x -C /tmp/before", file=sys.stderr)
        return 2
    trees = {"this tree": REPO, **({"baseline": args.baseline_tree} if args.baseline_tree else {})}
    shares = {name: [] for name in trees}
    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    for r in range(args.rounds):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
            share = one_run(tree, tmp / f"{name.replace(' ', '_')}-{r}", args.steps, args.step_sleep)
            shares[name].append(share)
            print(f"round {r}: {name}: agent CPU {100 * share:.2f}% of a core", flush=True)
    for name, values in shares.items():
        print(f"{name}: median {100 * statistics.median(values):.2f}% of a core ({', '.join(f'{100 * v:.2f}' for v in values)})")
    if args.baseline_tree:
        print(f"ratio this tree / baseline: {statistics.median(shares['this tree']) / statistics.median(shares['baseline']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
