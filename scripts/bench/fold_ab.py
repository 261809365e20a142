"""What the per-step second allreduce costs: an A/B inside ONE elasticflow run, so machine load hits both.

    .venv/bin/python scripts/bench/fold_ab.py --hidden 64 1024 --steps 1500

Every worker's ``Replica.start_reduce`` is wrapped (through a sitecustomize on PYTHONPATH): on even
steps it reduces the gradient and the step's scalars in two allreduces, on odd steps in ONE (the
scalars ride in float32 after the gradient), whatever ``step_reduction.FOLD_MAX`` would choose. Both workers
pick by the step number, so they always agree. Prints the median gap between consecutive
metrics.jsonl records for each half: the difference is the cost of the second collective.
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

from elasticflow.distributed.protocol import ENV_WORKER_ID

REPO = Path(__file__).resolve().parents[2]

# Its first line names the variable the agent sets in workers only: every other Python process started
# with this PYTHONPATH (the CLI, the agent) skips the patch without importing elasticflow.
SITECUSTOMIZE = f"WORKER_ENV = {ENV_WORKER_ID!r}\n" + '''
import os, sys
if os.environ.get(WORKER_ENV) is not None:
    sys.path.insert(0, os.getcwd())
    import elasticflow.replica.replica as replica
    import elasticflow.replica.step_reduction as step_reduction  # FOLD_MAX: where the collectives are chosen

    installed = replica.Replica.start_reduce
    calls = [0]

    def ab(self, *args, **kwargs):
        # Call k reduces step k (no failures here); step_count = k - 1 picks the path on both workers alike.
        calls[0] += 1
        saved = step_reduction.FOLD_MAX
        step_reduction.FOLD_MAX = (1 << 62) if (calls[0] - 1) % 2 else 0  # odd: one folded allreduce; even: two
        try:
            return installed(self, *args, **kwargs)
        finally:
            step_reduction.FOLD_MAX = saved

    replica.Replica.start_reduce = ab
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=50)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fold_ab_") as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(REPO)]), "PYTHONUNBUFFERED": "1"}
        for hidden in args.hidden:
            run = Path(tmp) / f"h{hidden}"
            cmd = [sys.executable, "-m", "elasticflow.cli", "train", "models/digits_mlp.py", f"hydra.run.dir={run}",
                   "launcher.workers=2", f"trainer.max_steps={args.steps}", "trainer.drop_last=true",
                   "trainer.log_every=1", "trainer.progress=false", f"+model_args.hidden={hidden}"]
            subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
            gaps = {0: [], 1: []}  # by the step count at the reduction (record step - 1): even = two, odd = folded
            for a, b in zip(recs, recs[1:]):
                if b["step"] > args.warmup:
                    gaps[(b["step"] - 1) % 2].append((b["time"] - a["time"]) * 1e3)
            two, folded = statistics.median(gaps[0]), statistics.median(gaps[1])
            print(f"hidden {hidden:5d}: two allreduces {two:.3f} ms/step, one folded allreduce "
                  f"{folded:.3f} ms/step: {two - folded:+.3f} ms ({(two - folded) / two:+.0%})", flush=True)


if __name__ == "__main__":
    main()
