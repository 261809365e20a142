"""Gradient buckets reduced while backward runs (comm.bucket_mb), 2 or more workers, against torchrun + DDP.

    .venv/bin/python scripts/bench/bench_overlap.py                       # GPT-style, 6 layers x 384, vocab 8192
    .venv/bin/python scripts/bench/bench_overlap.py --rounds 3 --buckets 25 4 null
    .venv/bin/python scripts/bench/bench_overlap.py --workers 4 --buckets null   # 4 workers (processes) on the cores
    .venv/bin/python scripts/bench/bench_overlap.py --backend tensorflow --buckets 25 null   # buckets vs one reduction

Three rows, measured in the same run and alternating in order each round: elasticflow with
comm.bucket_mb=25 (buckets start from autograd hooks during backward), elasticflow with
comm.bucket_mb=null (one reduction after backward), and a hand-written torchrun + DDP loop
(scripts/bench/baselines/ddp_gpt.py: DDP's default 25 MiB buckets). Same model file (models/tiny_gpt.py), initial
weights, sample order, global batch, SGD. A step's time is the gap between consecutive step ends
(metrics.jsonl's ``time``; the DDP loop's wall clock); the first ``--warmup`` steps are left out;
the figure is the median over steps, then over rounds, and the throughput ratio to DDP.

``--backend tensorflow`` runs models/char_transformer.py (elasticflow.ops, so it runs on either backend)
at the same width and depth (vocabulary 38, 32-character windows, its own Adam) under backend=tensorflow, with no DDP
row: the ratios are to the one-reduction row (comm.bucket_mb=null), which must then be among --buckets.
TensorFlow's tape gives every gradient at once, so there the buckets all start after backward.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def step_gaps(ends: list, warmup: int) -> list:
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]


def model_overrides(args) -> list:
    """The model file and its size: tiny_gpt on torch, char_transformer (ops only) on TensorFlow."""
    if args.backend == "tensorflow":
        return [str(REPO / "models" / "char_transformer.py"), "backend=tensorflow",
                f"+model_args.d_model={args.width}", f"+model_args.layers={args.layers}"]
    return [str(REPO / "models" / "tiny_gpt.py"), f"+model_args.vocab={args.vocab}", f"+model_args.width={args.width}",
            f"+model_args.layers={args.layers}", f"+model_args.heads={args.heads}"]


def elasticflow(run: Path, args, bucket: str) -> list:
    model, *sized = model_overrides(args)
    cmd = [PY, "-m", "elasticflow.cli", "train", model, *sized, f"hydra.run.dir={run}",
           f"launcher.workers={args.workers}", f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.global_batch}",
           "trainer.log_every=1", "trainer.progress=false", "checkpoint.interval.steps=null", "optimizer.lr=1e-4", "trainer.on_nonfinite=skip",
           f"comm.bucket_mb={bucket}", "elastic.timeout_s=120",
           "elastic.heartbeat_timeout_s=60"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"elasticflow exited {done.returncode}:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["time"] for r in records if "loss" in r]


def ddp(out: Path, args) -> list:
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc_per_node={args.workers}", "--standalone",
           str(REPO / "scripts" / "bench" / "baselines" / "ddp_gpt.py"), "--steps", str(args.steps), "--global-batch",
           str(args.global_batch), "--vocab", str(args.vocab), "--width", str(args.width), "--layers",
           str(args.layers), "--heads", str(args.heads), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1200, cwd=REPO,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())["ends"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--workers", type=int, default=2, help="elasticflow workers and torchrun processes")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--buckets", nargs="+", default=["25", "null"], help="comm.bucket_mb values, one row each")
    p.add_argument("--backend", choices=["torch", "tensorflow"], default="torch")
    args = p.parse_args()
    tf = args.backend == "tensorflow"
    if tf and "null" not in args.buckets:
        p.error("--backend tensorflow compares with the one-reduction row: add null to --buckets")
    vocab, name = (38, "char_transformer") if tf else (args.vocab, "tiny_gpt")
    embeddings = (2 * vocab + 34) * args.width + vocab if tf else (vocab + 64) * args.width  # tf: untied head, 32 places
    params = embeddings + args.layers * (12 * args.width ** 2 + 13 * args.width)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {args.backend}, "
          f"{name} {args.layers}x{args.width}, vocab {vocab}: ~{params / 1e6:.1f}M parameters "
          f"({params * 4 / 2**20:.0f} MiB of gradient), {args.workers} workers, global batch {args.global_batch}")
    baseline = "elasticflow comm.bucket_mb=null" if tf else "DDP (torchrun, 25 MiB buckets)"
    rows = {**({} if tf else {baseline: []}), **{f"elasticflow comm.bucket_mb={b}": [] for b in args.buckets}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(args.rounds):
            order = list(rows) if r % 2 == 0 else list(reversed(rows))
            for name in order:
                if name.startswith("DDP"):
                    ends = ddp(tmp / f"ddp{r}.json", args)
                else:
                    bucket = name.split("=")[1]
                    ends = elasticflow(tmp / f"bucket-{bucket}-{r}", args, bucket)
                rows[name].append(statistics.median(step_gaps(ends, args.warmup)))
                print(f"  round {r + 1}: {name:34s} {rows[name][-1] * 1e3:7.1f} ms/step", flush=True)
    base = statistics.median(rows[baseline])
    print(f"median over rounds (throughput ratio to {'one reduction' if tf else 'DDP'}):")
    for name, values in rows.items():
        t = statistics.median(values)
        print(f"  {name:34s} {t * 1e3:7.1f} ms/step   {base / t:5.2f}x")


if __name__ == "__main__":
    main()
