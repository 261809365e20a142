"""Cost of elasticflow's sharded asynchronous checkpoints against plain torch.save, in one run.

A ~200 MB float32 state (the parameters of a torch backend Engine, saved as the trainer saves them:
``engine.state(copy=False)`` views, of which the checkpointer snapshots this rank's slice) is
checkpointed in the directory given by --dir (default: a temporary directory under the repo, so on
the same disk the runs write to). Each figure is the median of --repeat runs, and each is
compared with a baseline measured in the same run:

  stall      training blocked per async save (the trainer's path: engine.state(copy=False), then a
             snapshot of this rank's slice into a reused buffer; W=1, so the whole state),
             vs a synchronous torch.save + fsync of the full state by one rank       target <= 20%
             (also shown: a W=4 rank's stall, and a full copy of the state, which the trainer made
             before engine.state() had copy=False)
  slowdown   mean step time of a matmul loop (the "training", --threads torch threads) while a
             background write runs, vs the same loop with no write                   target <= 1.3x
  write      bytes per second of a W=1 save's write (header, data, xxh3_64, fsync, metadata, rename)
             vs one raw sequential write + fsync of the same bytes                   target >= 70%
  load       N=4 -> any M: one rank reading the full state (every data-parallel rank does) with
             checksums, and a 1/3 subset by name, vs torch.load of the torch.save file

The files were just written, so loads read from the page cache, for both sides alike.

    .venv/bin/python scripts/bench/bench_checkpoint.py                  # 200 MB, 5 repeats, 1 torch thread
    .venv/bin/python scripts/bench/bench_checkpoint.py --mb 400 --threads 2 --repeat 3
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import elasticflow.checkpoint as ckpt  # noqa: E402
from elasticflow.backends import load as load_backend  # noqa: E402
from elasticflow.optim import SGD  # noqa: E402

INFO = {"step": 1, "epoch": 0, "cursor": {"epoch": 0, "samples_in_epoch": 0, "samples_seen": 0}}


def make_state(mb: int) -> dict:
    """Tensors of mixed sizes (a few large, many small) adding up to ``mb`` MiB of float32."""
    g = torch.Generator().manual_seed(0)
    sizes, left = [], mb * 2**20 // 4
    big = left // 8
    while left > 0:
        n = min(left, big if len(sizes) % 4 == 0 else max(1024, big // 16))
        sizes.append(n)
        left -= n
    return {f"layer{i:03d}/w": torch.randn(n, generator=g) for i, n in enumerate(sizes)}


def median_time(fn, repeat: int, before=None) -> float:
    out = []
    for _ in range(repeat):
        if before:
            before()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def torch_save(state, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def raw_write(views, path: Path) -> None:
    with open(path, "wb", buffering=0) as f:
        for v in views:
            mv = memoryview(v).cast("B")
            while mv:
                mv = mv[f.write(mv):]
        os.fsync(f.fileno())


def matmul_steps(a: torch.Tensor, stop, times: list, max_steps: int) -> None:
    for _ in range(max_steps):
        t = time.perf_counter()
        for _ in range(4):
            (a @ a).sum()
        times.append(time.perf_counter() - t)
        if stop():
            break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the matmul 'training' loop")
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    logging.getLogger("elasticflow").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix=".bench_checkpoint_", dir=args.dir or REPO))
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def trainer_state(engine) -> dict:
    """What ElasticTrainer.save_checkpoint hands the checkpointer."""
    return engine.state(copy=False)


def run(args, root: Path) -> None:
    state = make_state(args.mb)
    engine = load_backend("torch").Engine(state, forward=None, spec=SGD(lr=0.1))
    live = {k: v.numpy() for k, v in state.items()}  # the same bytes, for the baselines
    nbytes = sum(v.nbytes for v in live.values())
    gb = nbytes / 1e9
    load_before = os.getloadavg()[0]
    pt, raw = root / "state.pt", root / "raw.bin"
    job = root / "job_20250101-000000"
    ck = ckpt.Checkpointer(job)  # keep=None: pruning (an rm) stays out of the timed writes
    a = torch.randn(384, 384)
    matmul_steps(a, lambda: False, [], 10)  # warm-up
    reserve = time.perf_counter()
    ck.reserve(trainer_state(engine))  # as the trainer does at start: the writer thread faults the buffer in
    ck.wait()
    reserve = time.perf_counter() - reserve
    first = time.perf_counter()
    ck.save("step_0", trainer_state(engine), INFO)
    first = time.perf_counter() - first
    ck.wait()

    # Every repetition measures a baseline and elasticflow back to back, so that load from other
    # processes hits both alike; the ratios are medians of the per-repetition ratios.
    m = {k: [] for k in ("torch", "stall", "stall4", "fresh", "raw", "write", "base", "busy")}
    ck4 = ckpt.Checkpointer(root / "rank1of4_20250101-000000", coordinator=ckpt.LocalCoordinator(), token="r1")
    for i in range(1, args.repeat + 1):
        shutil.rmtree(job / f"step_{i - 1}", ignore_errors=True)
        t = time.perf_counter()
        torch_save(state, pt)
        m["torch"].append(time.perf_counter() - t)
        t = time.perf_counter()
        fresh = engine.state()  # a full private copy
        m["fresh"].append(time.perf_counter() - t)
        del fresh
        raw.unlink(missing_ok=True)
        t = time.perf_counter()
        raw_write(list(live.values()), raw)
        m["raw"].append(time.perf_counter() - t)
        raw.unlink()
        base: list = []
        matmul_steps(a, lambda: len(base) >= 30, base, 30)
        t = time.perf_counter()
        ck.save(f"step_{i}", trainer_state(engine), {**INFO, "step": i})
        m["stall"].append(time.perf_counter() - t)
        pending, busy, t = ck._pending, [], time.perf_counter()
        matmul_steps(a, pending.done, busy, 10**6)  # "training" while the write runs
        ck.wait()
        m["write"].append(time.perf_counter() - t)
        m["base"].append(statistics.median(base))
        m["busy"].append(statistics.mean(busy[:-1] or busy))
        t = time.perf_counter()  # rank 1 of 4: its quarter only (never committed: there are no other ranks)
        ck4.save(f"step_{i}", trainer_state(engine), {**INFO, "step": i}, rank=1, world=4)
        m["stall4"].append(time.perf_counter() - t)
        ck4.wait()
    ck.close()
    ck4.close()

    def ratio(x: str, y: str) -> float:
        return statistics.median(p / q for p, q in zip(m[x], m[y]))

    med = {k: statistics.median(v) for k, v in m.items()}

    # -- the write alone (no training beside it), to compare with the raw write on equal terms
    alone, raw_alone = [], []
    ck = ckpt.Checkpointer(job)
    for i in range(args.repeat):
        shutil.rmtree(job, ignore_errors=True)
        raw.unlink(missing_ok=True)
        t = time.perf_counter()
        raw_write(list(live.values()), raw)
        raw_alone.append(time.perf_counter() - t)
        ck.save(f"step_{i}", live, {**INFO, "step": i})
        t = time.perf_counter()
        ck.wait()
        alone.append(time.perf_counter() - t)
    ck.close()
    raw.unlink(missing_ok=True)
    write_ratio = statistics.median(r / w for r, w in zip(raw_alone, alone))

    # -- N=4 writers (threads in this process, one disk), then loads
    shutil.rmtree(job, ignore_errors=True)
    coord = ckpt.LocalCoordinator()
    writers = [ckpt.Checkpointer(root / "job4_20250101-000000", coordinator=coord, token="b4") for _ in range(4)]
    t = time.perf_counter()
    threads = [threading.Thread(target=w.save, args=("step_1", live, INFO, r, 4)) for r, w in enumerate(writers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    path4 = [w.close() for w in writers][0]
    t_write4 = time.perf_counter() - t
    loads, tloads, subsets = [], [], []
    subset = sorted(live)[::3]
    for _ in range(args.repeat):
        t = time.perf_counter()
        ckpt.load(path4)
        loads.append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.load(pt, weights_only=True)
        tloads.append(time.perf_counter() - t)
        t = time.perf_counter()
        ckpt.load(path4, names=subset)
        subsets.append(time.perf_counter() - t)
    loaded = ckpt.load(path4)
    assert all(np.array_equal(loaded[k], live[k]) for k in live)
    t_load, t_tload, t_subset = (statistics.median(x) for x in (loads, tloads, subsets))

    rows = [
        ("stall per async save (snapshot into the reused buffer)", f"{med['stall'] * 1e3:.0f} ms",
         f"torch.save + fsync {med['torch'] * 1e3:.0f} ms", f"{ratio('stall', 'torch'):.0%}", "<= 20%"),
        ("  first save (its buffer reserved at start-up)", f"{first * 1e3:.0f} ms", "",
         f"{first / med['torch']:.0%}", ""),
        ("  that reservation, in the writer thread while training runs", f"{reserve * 1e3:.0f} ms", "", "", ""),
        ("  one rank of W=4 (its quarter of the state)", f"{med['stall4'] * 1e3:.0f} ms", "",
         f"{ratio('stall4', 'torch'):.0%}", ""),
        ("  for scale: a full copy of the state (engine.state())", f"{med['fresh'] * 1e3:.0f} ms", "",
         f"{ratio('fresh', 'torch'):.0%}", ""),
        (f"step time while a background write runs ({args.threads} torch thread(s))", f"{med['busy'] * 1e3:.1f} ms",
         f"no write {med['base'] * 1e3:.1f} ms", f"{ratio('busy', 'base'):.2f}x", "<= 1.3x"),
        ("  that background write (checksums, fsync, commit)", f"{gb / med['write']:.2f} GB/s", "", "", ""),
        ("write throughput, W=1 (xxh3_64, fsync, commit), alone", f"{gb / statistics.median(alone):.2f} GB/s",
         f"raw write + fsync {gb / statistics.median(raw_alone):.2f} GB/s", f"{write_ratio:.0%}", ">= 70%"),
        ("  W=4 writers (threads, one disk)", f"{gb / t_write4:.2f} GB/s", "", "", ""),
        ("load N=4 -> M: the full state, one rank (verified)", f"{t_load * 1e3:.0f} ms",
         f"torch.load {t_tload * 1e3:.0f} ms", f"{t_load / t_tload:.2f}x", ""),
        ("  a third of the tensors by name", f"{t_subset * 1e3:.0f} ms", "", f"{t_subset / t_tload:.2f}x", ""),
    ]
    print(f"# checkpoint bench: {nbytes / 2**20:.0f} MiB in {len(live)} float32 tensors, median of {args.repeat}, "
          f"{os.cpu_count()} cores, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}\n")
    print("| measure | elasticflow | baseline (same run) | ratio | target |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\ncommand: .venv/bin/python scripts/bench/bench_checkpoint.py --mb {args.mb} --repeat {args.repeat} "
          f"--threads {args.threads}" + (f" --dir {args.dir}" if args.dir else ""))


if __name__ == "__main__":
    main()
