"""What the per-step second allreduce costs: an A/B inside ONE elasticflow run, so machine load hits both.

    .venv/bin/python scripts/bench/fold_ab.py --hidden 64 1024 --steps 1500

Every worker's ``replica.reduce_step`` is wrapped (through a sitecustomize on PYTHONPATH): on even
steps it runs as installed, on odd steps it reduces the gradient and the step's scalars in ONE
allreduce (the scalars ride in float32 after the gradient). Both workers pick by the step number,
so they always agree. Prints the median gap between consecutive metrics.jsonl records for each
half. While replica.reduce_step makes two collectives a step, the difference is their cost.
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
    import torch
    import elasticflow.replica as replica

    installed = replica.reduce_step

    def folded(trainer, scalars):
        m = trainer.membership
        seen = max(m.latest_generation, trainer.generation)
        grad = trainer.engine.grad_view()
        extra = scalars + [float(seen), float(trainer._interrupt_requested), float(m.agent_lost)]
        buf = torch.cat([grad, torch.tensor(extra, dtype=grad.dtype)])
        m.group.allreduce_(buf)
        grad.copy_(buf[:grad.numel()])
        out = buf[grad.numel():].tolist()
        n = len(scalars)
        return out[:n], {"membership": out[n] != trainer.generation * trainer.world,
                         "interrupt": out[n + 1] > 0, "agent_lost": out[n + 2] > 0}

    def ab(trainer, scalars):
        if trainer.membership is None or trainer.world == 1 or trainer.step_count % 2 == 0:
            return installed(trainer, scalars)
        return folded(trainer, scalars)

    replica.reduce_step = ab
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
            gaps = {0: [], 1: []}  # by the step count at the reduction (record step - 1), even = as installed
            for a, b in zip(recs, recs[1:]):
                if b["step"] > args.warmup:
                    gaps[(b["step"] - 1) % 2].append((b["time"] - a["time"]) * 1e3)
            installed, folded = statistics.median(gaps[0]), statistics.median(gaps[1])
            print(f"hidden {hidden:5d}: reduce_step as installed {installed:.3f} ms/step, one folded allreduce "
                  f"{folded:.3f} ms/step: {installed - folded:+.3f} ms ({(installed - folded) / installed:+.0%})",
                  flush=True)


if __name__ == "__main__":
    main()
