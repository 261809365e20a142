"""A long run in ``trainer.reproducible``: a model trained N steps on 1 worker and on 3, one of the 3 SIGKILLed
half-way, must end on the same bits (every tensor of the final checkpoint and every step's loss ``==``).

    .venv/bin/python scripts/soak/long_exact.py                                   # transformers ResNet, 2,000 steps
    .venv/bin/python scripts/soak/long_exact.py --model tests/models/ragged_gpt2.py --steps 2000 --batch 24 --micro 4 \\
        --args dropout=0.1 optimizer=adamw

The kill: once the 3-worker job has logged half its steps, the member with the highest rank (from workers.json) is
SIGKILLed; the job goes on with 2 (elastic.timeout_s bounds the survivors' wait). Exit 0 when the bits are equal.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from elasticflow._util.fileio import read_jsonl  # noqa: E402


def train(run: Path, a, workers: int, kill_at: int = 0) -> None:
    cmd = [sys.executable, "-m", "elasticflow.cli", "train", str(REPO / a.model), f"hydra.run.dir={run}",
           f"launcher.workers={workers}", f"trainer.global_batch_size={a.batch}", f"trainer.micro_batch_size={a.micro}",
           f"trainer.max_steps={a.steps}", "trainer.log_every=1", "trainer.progress=false", "trainer.loggers=[]",
           "trainer.reproducible=true", "optimizer=adamw", "optimizer.lr=0.01", "elastic.timeout_s=20",
           "elastic.heartbeat_timeout_s=10", *[f"+model_args.{kv}" for kv in a.args]]
    with open(run.parent / f"{run.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        killed = False
        while proc.poll() is None:
            time.sleep(0.5)
            if kill_at and not killed and len(read_jsonl(run / "metrics.jsonl")) >= kill_at:
                members = json.loads((run / "workers.json").read_text())["members"]
                victim = max(members, key=lambda w: w["rank"])
                os.kill(victim["pid"], signal.SIGKILL)
                print(f"  SIGKILLed worker {victim['worker_id']} (rank {victim['rank']}) at step ~{kill_at}",
                      flush=True)
                killed = True
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: see {run.parent / (run.name + '.log')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tests/models/hf_resnet.py")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--args", nargs="*", default=[], help="model_args as key=value")
    a = ap.parse_args()
    import elasticflow.checkpoint as ckpt

    root = Path(tempfile.mkdtemp(prefix="long_exact_"))
    began = time.monotonic()
    print(f"{a.model}, {a.steps} steps: 1 worker, then 3 with one killed at step {a.steps // 2}; in {root}")
    train(root / "one", a, 1)
    train(root / "three", a, 3, kill_at=a.steps // 2)
    want, got = (ckpt.load(ckpt.latest(root / r / "checkpoints")) for r in ("one", "three"))
    unequal = [k for k in want if not k.startswith("rng/") and not np.array_equal(want[k], got.get(k))]
    losses = [{r["step"]: r["loss"] for r in read_jsonl(root / r / "metrics.jsonl") if "loss" in r}
              for r in ("one", "three")]
    off = [s for s in losses[0] if losses[1].get(s) != losses[0][s]]
    sizes = sorted({r["world_size"] for r in read_jsonl(root / "three" / "metrics.jsonl") if "loss" in r})
    print(f"world sizes {sizes}; tensors not equal: {len(unequal)} of {len(want)}; steps whose loss differs: "
          f"{len(off)} of {len(losses[0])}; final loss {losses[0][a.steps]:.6g}; {time.monotonic() - began:.0f} s")
    return 0 if not unequal and not off and sizes == [2, 3] else 1


if __name__ == "__main__":
    sys.exit(main())
