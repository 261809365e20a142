"""What reconciling BatchNorm's buffers costs a step: an A/B inside ONE 2-worker run, so machine load hits both.

    .venv/bin/python scripts/bench/bench_buffers.py --steps 400

The model is a BatchNorm CNN on the 8x8 digits (4 conv layers with BatchNorm2d, dropout, a linear head;
``--width`` channels), trained with 2 workers and ``trainer.micro_batch_size`` set. Every worker's
``ElasticTrainer._attempt`` is wrapped (through a sitecustomize on PYTHONPATH): on odd steps the
reconciliation is switched off (the buffers then drift apart: this run is for timing only). Both workers
pick by the step number, so they always agree. Prints the median step time (gap between consecutive
metrics.jsonl records) of each half, and the time the workers spend in the reconciliation itself
(snapshot, contribution, rebuild, write-back; timed inside them), each as a share of the step. The A/B
difference also holds the extra bytes in the step's allreduce and any wait for the slower worker; on a
loaded 2-core machine it is the noisier of the two.
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

MODEL = '''
import sys
import torch
sys.path.insert(0, {models!r})
import _digits


def model(cfg):
    torch.manual_seed(cfg.seed)
    w = int(cfg.model_args.width)
    def block(cin, cout):
        return [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout), torch.nn.ReLU()]
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 8, 8)), *block(1, w), *block(w, w), torch.nn.MaxPool2d(2),
                               *block(w, 2 * w), *block(2 * w, 2 * w), torch.nn.Flatten(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(2 * w * 16, 10))


def forward(x, y, net):
    return torch.nn.functional.cross_entropy(net(x), y)


def data(cfg):
    return _digits.train_split()
'''

# Its first line names the variable the agent sets in workers only: every other Python process started
# with this PYTHONPATH (the CLI, the agent) skips the patch without importing elasticflow.
SITECUSTOMIZE = f"WORKER_ENV = {ENV_WORKER_ID!r}\n" + '''
import os
if os.environ.get(WORKER_ENV) is not None:
    from elasticflow.trainer import ElasticTrainer

    attempt = ElasticTrainer._attempt

    def ab(self, batch):
        if self.state.step % 2 == 0:  # step_count even: as installed (reconciled)
            return attempt(self, batch)
        kept, self.reconciler = self.reconciler, None
        try:
            return attempt(self, batch)
        finally:
            self.reconciler = kept

    ElasticTrainer._attempt = ab

    # Inside the workers: the time the reconciliation itself takes on reconciled steps (snapshot, contribution,
    # rebuild, write-back), written every 50 steps to RECONCILE_LOG/<pid>.json.
    import json, time
    from elasticflow.backends import buffers
    from elasticflow.backends import torch as torch_backend

    spent = {"s": 0.0, "calls": 0}

    def timed(fn, counts=False):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - started
                if counts:
                    spent["calls"] += 1
                    if spent["calls"] % 50 == 0:
                        with open(os.path.join(os.environ["RECONCILE_LOG"], f"{os.getpid()}.json"), "w") as f:
                            json.dump(spent, f)
        return wrapper

    buffers.Reconciler.begin = timed(buffers.Reconciler.begin)
    buffers.Reconciler.contribution = timed(buffers.Reconciler.contribution)
    buffers.Reconciler.finish = timed(buffers.Reconciler.finish)
    torch_backend.Engine.set_buffers = timed(torch_backend.Engine.set_buffers, counts=True)
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--width", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_buffers_") as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        model = Path(tmp) / "bn_cnn.py"
        model.write_text(MODEL.format(models=str(REPO / "models")))
        logs = Path(tmp) / "reconcile"
        logs.mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(REPO)]), "PYTHONUNBUFFERED": "1",
               "RECONCILE_LOG": str(logs)}
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "elasticflow.cli", "train", str(model), f"hydra.run.dir={run}",
               "launcher.workers=2", f"trainer.max_steps={args.steps}", "trainer.global_batch_size=128",
               "trainer.micro_batch_size=32", "trainer.log_every=1", "trainer.progress=false",
               f"+model_args.width={args.width}", "optimizer.lr=0.05"]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=1200, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        gaps = {0: [], 1: []}  # by the step count at the reduction (record step - 1): even = reconciled
        for a, b in zip(recs, recs[1:]):
            if b["step"] > args.warmup:
                gaps[(b["step"] - 1) % 2].append((b["time"] - a["time"]) * 1e3)
        on, off = statistics.median(gaps[0]), statistics.median(gaps[1])
        inside = [json.loads(f.read_text()) for f in logs.glob("*.json")]
        per_step = max(1e3 * d["s"] / d["calls"] for d in inside)
        print(f"BatchNorm CNN (width {args.width}), 2 workers, 4 micro-batches of 32: reconciled {on:.2f} ms/step, "
              f"not reconciled {off:.2f} ms/step: {on - off:+.2f} ms = {(on - off) / off:+.1%} of the step; "
              f"the reconciliation's own work in a worker: {per_step:.3f} ms = {per_step / off:.1%} of the step",
              flush=True)


if __name__ == "__main__":
    main()
