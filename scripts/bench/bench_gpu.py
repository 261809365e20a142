"""ElasticFlow on one GPU against the baselines #16 names, each measured in the same run.

1. Throughput: 1 worker training models/tiny_gpt.py (a GPT-2-shaped decoder, >= 10M parameters) in
   bf16 with AdamW, against a hand-written torch loop with autocast on the same GPU: same weights,
   data (resident on the GPU), sample order, optimizer. Chunks of steps alternate between the two;
   the GPU is synchronised at each chunk's ends only (the hand-written loop queues ahead freely).
2. Recovery: 2 workers sharing the GPU (gloo, staged through pinned memory), one SIGKILLed
   mid-training: the time from the kill to the survivor's next step, from the run's own records.
3. Checkpoint stall: the time an asynchronous save holds training (the snapshot from the GPU into
   pinned host memory) against ``torch.save`` of the same model and optimizer state from the GPU.

    python scripts/bench/bench_gpu.py                      # all three; prints the ratios
    python scripts/bench/bench_gpu.py --parts 1 --width 768 --layers 8
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "models"))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_elastic import PY, BenchError, Proc, Tail, jsonl, train_records, wait_until  # noqa: E402

MODEL = REPO / "models" / "tiny_gpt.py"


def overrides(args, steps: int) -> List[str]:
    return [f"+model_args.vocab={args.vocab}", f"+model_args.width={args.width}", f"+model_args.layers={args.layers}",
            f"+model_args.heads={args.heads}", f"+model_args.samples={args.samples}", "optimizer=adamw",
            "optimizer.lr=3e-4", f"trainer.device={args.device}", f"trainer.precision={args.precision}",
            f"trainer.global_batch_size={args.batch}", f"trainer.max_steps={steps}", "trainer.log_every=10",
            "trainer.progress=false", "checkpoint.interval.steps=1000000000", "resume=none"]


# ---------------------------------------------------------------- 1. throughput
def handwritten(args, total: int) -> Iterator[None]:
    """What a user writes for one GPU: resident data, autocast around forward, AdamW (fused where torch has it)."""
    import torch
    from omegaconf import OmegaConf

    import tiny_gpt
    from elasticflow.data.order import permutation

    cfg = OmegaConf.create({"seed": 0, "model_args": model_args(args)})
    dev = torch.device(args.device)
    net = tiny_gpt.model(cfg).to(dev)
    x, y = (torch.from_numpy(a).to(dev) for a in tiny_gpt.data(cfg))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.0)
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(args.precision)
    step, epoch, n, b = 0, 0, len(x), args.batch
    while True:
        order = torch.from_numpy(permutation(n, 0, epoch)).to(dev)
        for start in range(0, n - b + 1, b):
            idx = order[start:start + b]
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                loss = tiny_gpt.forward(x.index_select(0, idx), y.index_select(0, idx), net)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            step += 1
            if step % 10 == 0:
                last = loss.item()  # noqa: F841 - as a user logs every 10 steps: a sync point
            yield
            if step == total:
                return
        epoch += 1


def model_args(args) -> Dict[str, int]:
    return {"vocab": args.vocab, "width": args.width, "layers": args.layers, "heads": args.heads,
            "samples": args.samples}


def elasticflow_loop(args, total: int) -> Iterator[None]:
    from elasticflow.config.schema import compose
    from elasticflow.trainer import ElasticTrainer

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose(str(MODEL), overrides(args, total) + ["trainer.drop_last=true"])
        t = ElasticTrainer(str(MODEL), cfg, run_dir=run_dir)
        t.prepare()
        print(f"  elasticflow: {t.engine.num_params / 1e6:.1f}M parameters, {t.placement.describe()}", flush=True)
        try:
            for epoch in t.epoch_range():
                with t.epoch(epoch):
                    for batch in t.batches():
                        with t.step():
                            t.train_step(batch)
                        yield
        finally:  # the bench leaves the loop mid-run: end the readers and the job folder's lease before its folder goes
            t.prefetch.close()
            t.checkpoints.close()


def sync(args) -> None:
    import torch

    if args.device == "cuda":
        torch.cuda.synchronize()


def throughput(args) -> None:
    import torch

    rows = {"hand-written torch + autocast": handwritten, "elasticflow": elasticflow_loop}
    total = args.warmup + args.chunks * args.chunk_steps
    loops = {name: row(args, total) for name, row in rows.items()}
    for loop in loops.values():
        for _ in range(args.warmup):
            next(loop)
    times: Dict[str, List[float]] = {name: [] for name in rows}
    for k in range(args.chunks):
        for name in (list(rows) if k % 2 == 0 else list(reversed(rows))):
            sync(args)
            t0 = time.perf_counter()
            for _ in range(args.chunk_steps):
                next(loops[name])
            sync(args)
            times[name].append((time.perf_counter() - t0) / args.chunk_steps)
    for loop in loops.values():
        for _ in loop:
            pass
    base = statistics.median(times[next(iter(rows))])
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"1. throughput, {args.precision}, batch {args.batch} x 64 tokens, {where}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:<32} median {m * 1e3:8.3f} ms/step  min {min(ts) * 1e3:8.3f}  ratio {m / base:.3f}")


# ---------------------------------------------------------------- 2. recovery
def recovery(args, tmp: Path) -> None:
    latencies = []
    for i in range(args.kills):
        run = tmp / f"kill-{i}"
        at, steps = 30 + 5 * i, 90 + 5 * i
        cmd = [PY, "-m", "elasticflow.cli", "train", str(MODEL), f"hydra.run.dir={run}", "launcher.workers=2",
               *overrides(args, steps), "trainer.log_every=1"]
        proc = Proc(cmd, tmp / f"kill-{i}.log")
        try:
            tail = Tail(run / "metrics.jsonl")
            wait_until(lambda: tail() >= at, 300, f"step {at}", proc)
            members = json.loads((run / "workers.json").read_text())["members"]
            proc.children = [m["pid"] for m in members]
            killed_at = time.time()
            os.kill(members[1]["pid"], signal.SIGKILL)
            rc = proc.wait(300)
        except BenchError as exc:
            print(f"  kill {i}: {exc}")
            continue
        finally:
            proc.close()
        recs = train_records(run)
        after = [r["time"] for r in recs if r["time"] > killed_at and r["world_size"] == 1]
        rec = [e for e in jsonl(run / "events.jsonl") if e["event"] == "recovered"]
        if rc != 0 or sorted(r["step"] for r in recs) != list(range(1, steps + 1)) or not after:
            print(f"  kill {i}: exit {rc}, {len(recs)} step records; log tail {proc.tail(300)!r}")
            continue
        latencies.append(min(after) - killed_at)
        print(f"  kill {i} at step ~{at}: next step after {latencies[-1]:.3f} s "
              f"(recovery_s {rec[0]['recovery_s'] if rec else 'n/a'})")
    if latencies:
        print(f"2. recovery, 2 workers on one GPU (gloo): kill -> next step median {statistics.median(latencies):.3f} s, "
              f"max {max(latencies):.3f} s over {len(latencies)}/{args.kills} kills")


# ---------------------------------------------------------------- 3. checkpoint stall
def checkpoint_stall(args, tmp: Path) -> None:
    import torch

    from elasticflow.config.schema import compose
    from elasticflow.trainer import ElasticTrainer

    cfg = compose(str(MODEL), overrides(args, 10_000) + ["checkpoint.async_save=true",
                                                           f"checkpoint.dir={tmp / 'ckpt'}"])
    t = ElasticTrainer(str(MODEL), cfg, run_dir=str(tmp / "stall"))
    t.prepare()
    steps = iter(t.batches())
    with t.epoch(0):
        for _ in range(3):  # Adam's slots exist after the first step
            with t.step():
                t.train_step(next(steps))
    engine = t.engine
    opt_state = {n: {k: v for k, v in engine.optimizer.state.get(p, {}).items()}
                 for n, p in engine.params.items()}
    gpu_state = {"model": engine.module.state_dict(), "optimizer": opt_state}
    mb = sum(a.nbytes for a in engine.state(copy=True).values()) / 1e6
    saves, stalls = [], []
    for i in range(args.repeat):
        sync(args)
        t0 = time.perf_counter()
        torch.save(gpu_state, tmp / f"torch_save_{i}.pt")
        saves.append(time.perf_counter() - t0)
        sync(args)
        t0 = time.perf_counter()
        t.save_checkpoint(f"bench_{i}", wait=False)
        stalls.append(time.perf_counter() - t0)
        t.checkpoints.checkpointer.wait()
    s, w = statistics.median(saves), statistics.median(stalls)
    print(f"3. checkpoint of {mb:.0f} MB (model + AdamW state) from the GPU: torch.save {s * 1e3:.1f} ms, "
          f"elasticflow async stall {w * 1e3:.1f} ms, ratio {w / s:.3f}")
    t.checkpoints.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="sequences of 64 tokens per step")
    p.add_argument("--samples", type=int, default=8192, help="sequences in the dataset")
    p.add_argument("--precision", default="bf16", choices=["32", "bf16", "16"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the script")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--chunk-steps", type=int, default=20)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        if 1 in args.parts:
            throughput(args)
        if 2 in args.parts:
            recovery(args, Path(tmp))
        if 3 in args.parts:
            checkpoint_stall(args, Path(tmp))


if __name__ == "__main__":
    main()
