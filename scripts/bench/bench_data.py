"""Data at scale, each figure a ratio against a baseline measured in the same run (1 worker, CPU).

    .venv/bin/python scripts/bench/bench_data.py                 # all three
    .venv/bin/python scripts/bench/bench_data.py --only slow     # slow | decode | mmap | shards

slow    A source that sleeps 10 ms per batch read, under a model whose step computes ~10 ms:
        median step time with data.prefetch=2 (and =0) over the same model on arrays held in memory
        (compute alone). Target: <= 1.1x.
decode  A map-style dataset whose __getitem__ decodes an image-like record in Python (per-pixel-row
        work under the GIL, a crop and a flip from elasticflow.data.sample_rng): samples/s of
        elasticflow with data.worker_type=process data.workers=2 over a hand-written loop on
        torch.utils.data.DataLoader(num_workers=2, pin_memory=True), same model, batch and optimizer.
        Target: >= 1.0x. The loop runs at torch's default intra-op threads (the cores); elasticflow at
        its own default (the cores less its 2 loaders), and rows at the other's count show what the
        threads alone do. The same work per step but for a metrics.jsonl line (each step's end time,
        read here; the loop takes a perf_counter): no TensorBoard sidecar (trainer.tensorboard=false:
        the loop has none, and the sidecar's start-up fell in the timed span, 2-9% of the loaders' CPU).
mmap    A 2 GiB float32 .npy on disk, opened with np.load(mmap_mode="r") and trained on for 40 steps
        in a fresh process: its peak resident set over the file's size.
shards  elasticflow.data.Shards over a jsonl corpus written to disk (--corpus-gb, default 2: 64 shards of ~1 KB
        token-id lines; not run by default, being minutes of disk writes). Bytes read: 3 worker processes each read
        their micro-batches (order.deal, by position) of 50 global batches of 256 in Shards.order(0, 0), rchar
        from /proc/self/io over the bytes of their samples' lines; target <= 1.2x that share + one window's bytes.
        Peak RSS (VmHWM) of a fresh process reading 50 global batches over 1/10 of the corpus and over all of
        it: target within +-10%. Read throughput of an epoch in window order over a sequential pass (each file's
        lines read and json.loads'ed), page cache dropped (where root may) and warm: target >= 0.9x; with
        mosaicml-streaming's StreamingDataset on an MDS copy of the same samples beside it, where
        BENCH_MDS_PYTHON (default /tmp/msvenv/bin/python) has it (its own venv: it pins another torch).
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

import numpy as np

REPO = Path(__file__).resolve().parents[2]
WARMUP = 5  # steps left out of steady-state figures (loader start-up, first allocations)
sys.path.insert(0, str(REPO))

MODEL = '''
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import elasticflow

A = {}
SIDE, CLASSES = 32, 10


def net(hidden, features):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))


class Slow:
    """Rows read by index, 10 ms per read (a file system, a decoder elsewhere)."""

    def __init__(self, x, y, sleep_s):
        self.x, self.y, self.sleep_s = x, y, sleep_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, indices):
        time.sleep(self.sleep_s)
        return self.x[indices], self.y[indices]


class Encoded(torch.utils.data.Dataset):
    """Image-like records stored as bytes, decoded in Python per item."""

    def __init__(self, n, seed=0):
        rng = np.random.default_rng(seed)
        self.records = [rng.integers(0, 256, size=(SIDE, SIDE, 3), dtype=np.uint8).tobytes() for _ in range(n)]
        self.labels = rng.integers(0, CLASSES, size=n)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        img = np.frombuffer(self.records[i], np.uint8).reshape(SIDE, SIDE, 3)
        rows = [img[r].astype(np.float32) * (1.0 / 255.0) for r in range(SIDE)]  # a row-by-row decoder
        img = np.stack([(row - row.mean()) for row in rows])
        rng = elasticflow.data.sample_rng(i) if elasticflow.context().seed >= 0 else np.random.default_rng(i)
        dy, dx = rng.integers(0, 5, size=2)
        img = np.pad(img, ((2, 2), (2, 2), (0, 0)))[dy:dy + SIDE, dx:dx + SIDE]
        if rng.random() < 0.5:
            img = img[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(img).reshape(-1)), torch.tensor(self.labels[i])


def data(cfg):
    A.update({k: cfg.model_args[k] for k in cfg.model_args})
    if A["form"] == "decode":
        return Encoded(int(A["n"]))
    if A["form"] == "mmap":
        return np.load(A["path"], mmap_mode="r"), np.load(A["labels"], mmap_mode="r")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(int(A["n"]), int(A["features"]))).astype(np.float32)
    y = rng.integers(0, CLASSES, size=int(A["n"]))
    return (x, y) if A["form"] == "arrays" else Slow(x, y, float(A["sleep_s"]))


def model(cfg):
    a = cfg.model_args
    return net(int(a["hidden"]), int(a["features"]))


def forward(x, y, params):
    return F.cross_entropy(params(x), y)
'''


def write_model(tmp: Path) -> Path:
    path = tmp / "bench_data_model.py"
    path.write_text(MODEL)
    return path


def fit(model: Path, run_dir: Path, *overrides: str) -> list:
    """Train in this process; the per-step records (step_time_s) of metrics.jsonl."""
    from elasticflow.config.schema import compose
    from elasticflow.trainer import ElasticTrainer

    cfg = compose(str(model), ["trainer.log_every=1", "trainer.progress=false", "checkpoint.interval.steps=null",
                               "optimizer.lr=0.01", *overrides])
    ElasticTrainer(str(model), cfg, run_dir=str(run_dir)).fit()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step_time_s" in r]


def median_step(records: list, warmup: int = 5) -> float:
    return statistics.median(r["step_time_s"] for r in records[warmup:])


def bench_slow(model: Path, tmp: Path, rounds: int) -> None:
    common = ["+model_args.n=20000", "+model_args.features=512", "+model_args.hidden=1024", "+model_args.sleep_s=0.01",
              "trainer.global_batch_size=256", "trainer.max_steps=60"]
    times = {"arrays (compute alone)": [], "slow, data.prefetch=0": [], "slow, data.prefetch=2": []}
    for r in range(rounds):  # interleaved, so drift in the machine's load hits every row alike
        times["arrays (compute alone)"].append(median_step(fit(model, tmp / f"a{r}", *common, "+model_args.form=arrays")))
        times["slow, data.prefetch=0"].append(median_step(fit(model, tmp / f"s{r}", *common, "+model_args.form=slow",
                                                              "data.prefetch=0")))
        times["slow, data.prefetch=2"].append(median_step(fit(model, tmp / f"p{r}", *common, "+model_args.form=slow",
                                                              "data.prefetch=2")))
    base = statistics.median(times["arrays (compute alone)"])
    print(f"\nslow source (10 ms per read), 1 worker, median step time over {rounds} rounds:")
    for name, values in times.items():
        t = statistics.median(values)
        print(f"  {name:28s} {t * 1e3:7.2f} ms   {t / base:5.2f}x")


def bench_decode(model: Path, tmp: Path, rounds: int, steps: int = 60, batch: int = 128) -> None:
    import torch
    import torch.nn.functional as F

    n = steps * batch
    common = [f"+model_args.n={n}", "+model_args.features=3072", "+model_args.hidden=256", "+model_args.form=decode",
              f"trainer.global_batch_size={batch}", f"trainer.max_steps={steps}"]
    threads = max(1, (os.cpu_count() or 1))
    spec = {}
    exec(compile(MODEL, "bench_data_model", "exec"), spec)  # the same dataset and network classes

    def handwritten(threads: int) -> float:
        torch.set_num_threads(threads)
        dataset, net = spec["Encoded"](n), spec["net"](256, 3072)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=2, pin_memory=True,
                                             generator=torch.Generator().manual_seed(0))
        stamps = []
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
            stamps.append(time.perf_counter())
        return batch * (len(stamps) - 1 - WARMUP) / (stamps[-1] - stamps[WARMUP])

    def ours(run: Path, *extra: str) -> float:  # the same span: step WARMUP+1's end to the last step's end
        ends = [r["time"] for r in fit(model, run, *common, "trainer.loggers=[]", *extra)]
        return batch * (len(ends) - 1 - WARMUP) / (ends[-1] - ends[WARMUP])

    loop = f"DataLoader(num_workers=2, pin_memory) loop, {threads} threads"
    runs = {loop: lambda r: handwritten(threads),
            "DataLoader loop, 1 thread": lambda r: handwritten(1),
            "elasticflow processes=2": lambda r: ours(tmp / f"d{r}", "data.worker_type=process", "data.workers=2",
                                                      "data.prefetch=4"),
            f"elasticflow processes=2, backend.threads={threads}": lambda r: ours(
                tmp / f"e{r}", "data.worker_type=process", "data.workers=2", "data.prefetch=4",
                f"backend.threads={threads}"),
            "elasticflow threads=2": lambda r: ours(tmp / f"t{r}", "data.workers=2", "data.prefetch=4")}
    rows = {name: [] for name in runs}
    for r in range(rounds):  # the order alternates: no row always follows the same one
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            rows[name].append(runs[name](r))
    def loaders_only(kind: str) -> float:  # the readers alone, nothing trained: batches per second read
        if kind == "DataLoader":
            loader = torch.utils.data.DataLoader(spec["Encoded"](n), batch_size=batch, shuffle=True, num_workers=2)
            stamps = [time.perf_counter() for _ in loader]
        else:
            from elasticflow.data import order as data
            from elasticflow.backends import torch as backend
            from elasticflow.data.prefetch import Prefetcher

            reader = Prefetcher(data.Source(data.Dataset(spec["Encoded"](n)), backend), 0, 4, 2, "process")
            keys = [(0, k * batch, (k + 1) * batch) for k in range(steps)]
            stamps = []
            for i, k in enumerate(keys):
                reader.take(k, keys[i + 1:])
                stamps.append(time.perf_counter())
            reader.close()
        return batch * (len(stamps) - 1 - WARMUP) / (stamps[-1] - stamps[WARMUP])

    for r in range(rounds):
        for kind in (("DataLoader", "elasticflow") if r % 2 == 0 else ("elasticflow", "DataLoader")):
            rows.setdefault(f"loaders only, no training: {kind}", []).append(loaders_only(kind))
    base = statistics.median(rows[loop])
    print(f"\nPython-decoded 3x32x32 records, 1 worker, {steps} steps of {batch}, samples/s over {rounds} rounds "
          f"(steady state: after {WARMUP + 1} steps):")
    for name, values in rows.items():
        v = statistics.median(values)
        ref = base if not name.startswith("loaders") else statistics.median(rows["loaders only, no training: DataLoader"])
        print(f"  {name:52s} {v:8.0f}/s   {v / ref:5.2f}x   rounds: {', '.join(f'{x:.0f}' for x in values)}")


def bench_mmap(model: Path, tmp: Path) -> None:
    rows, features = 2 ** 19, 1024  # 512 Ki rows of 4 KiB: 2 GiB
    path, labels = tmp / "x.npy", tmp / "y.npy"
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, features))
    for lo in range(0, rows, 2 ** 15):
        x[lo:lo + 2 ** 15] = np.random.default_rng(lo).normal(size=(min(2 ** 15, rows - lo), features))
    x.flush()
    del x
    np.save(labels, np.random.default_rng(0).integers(0, 10, size=rows))
    size = path.stat().st_size
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r});"
            f"from bench_data import fit; from pathlib import Path;"
            f"fit(Path({str(model)!r}), Path({str(tmp / 'm')!r}), '+model_args.form=mmap', '+model_args.path={path}',"
            f"'+model_args.labels={labels}', '+model_args.features={features}', '+model_args.hidden=256',"
            f"'trainer.global_batch_size=256', 'trainer.max_steps=40');"
            # VmHWM: this process's own peak (ru_maxrss would carry over the parent's, which wrote the file)
            f"print([int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak = int(out.stdout.strip().splitlines()[-1])
    print(f"\n2 GiB .npy on disk (np.load mmap_mode='r'), 40 steps of 256: peak RSS (VmHWM, torch included) {peak / 2**20:.0f} MiB = "
          f"{peak / size:.3f}x the file ({size / 2**30:.2f} GiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("slow", "decode", "mmap", "shards"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--corpus-gb", type=float, default=2.0, help="--only shards: the corpus's size on disk")
    args = parser.parse_args()
    import logging

    logging.getLogger("elasticflow").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = write_model(tmp)
        print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, torch CPU")
        if args.only in (None, "slow"):
            bench_slow(model, tmp, args.rounds)
        if args.only in (None, "decode"):
            bench_decode(model, tmp, args.rounds)
        if args.only in (None, "mmap"):
            bench_mmap(model, tmp)
        if args.only == "shards":
            from bench_shards import bench_shards

            bench_shards(tmp, args.corpus_gb, args.rounds)


if __name__ == "__main__":
    main()
