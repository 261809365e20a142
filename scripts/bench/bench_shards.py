"""``bench_data.py --only shards``: elasticflow.data.Shards over a jsonl corpus generated on disk (see bench_data's
docstring for the figures and their targets). Each measurement runs in a fresh Python process, which prints one JSON
line; ``python scripts/bench/bench_shards.py ROLE JSON`` is that process (roles: worker, rss, seq, shards).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SHARDS, WINDOW, SEED, BATCH, MICRO, BATCHES, WORLD = 64, 4, 0, 256, 32, 50, 3
MDS_PYTHON = os.environ.get("BENCH_MDS_PYTHON", "/tmp/msvenv/bin/python")  # a venv with mosaicml-streaming


# ---------------------------------------------------------------- the corpus
def make_corpus(folder: Path, total_bytes: int, shards: int = SHARDS) -> list:
    """``shards`` jsonl files of {"id", "tokens": [~140 token ids]} lines (~1 KB each), ``total_bytes`` in all."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pool = [json.dumps(rng.integers(0, 50257, size=int(n)).tolist()) for n in rng.integers(100, 180, size=4096)]
    per_shard, sample = total_bytes // shards, 0
    paths = []
    for s in range(shards):
        path, written = folder / f"train-{s:05d}.jsonl", 0
        picks = np.random.default_rng([1, s]).integers(0, len(pool), size=per_shard // 500)
        with open(path, "w") as f:
            for lo in range(0, len(picks), 256):
                block = "".join(f'{{"id": {sample + i}, "tokens": {pool[p]}}}\n'
                                for i, p in enumerate(picks[lo:lo + 256].tolist()))
                sample += block.count("\n")
                f.write(block)
                written += len(block)
                if written >= per_shard:
                    break
        paths.append(str(path))
    return paths


def drop_caches() -> bool:
    """Empty the page cache (root); False where this machine does not allow it."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def spawn(role: str, python: str = sys.executable, **spec) -> dict:
    """Run this file as ``role`` in a fresh interpreter; its last stdout line, parsed."""
    out = subprocess.run([python, __file__, role, json.dumps(spec)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{role} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the roles (each in its own process)
def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def _spread(steps: int, n: int) -> list:
    """n global batch numbers spread evenly over an epoch of ``steps`` (window edges included)."""
    return sorted({int(k) for k in np.linspace(0, steps - 1, min(n, steps))})


def role_worker(spec: dict) -> dict:
    """One worker's share of ``batches`` global batches: the bytes it reads (rchar) against its samples' bytes."""
    import numpy.ma  # noqa: F401 - np.unique imports it on first use: 0.4 MB of .pyc, not data, kept out of rchar
    from elasticflow.data.order import deal
    from elasticflow.data.shards import Shards

    before_open = _rchar()
    shards = Shards(spec["files"], window=WINDOW)
    opened = _rchar()
    order = shards.order(SEED, 0)
    micro = [order[a:b] for k in _spread(len(shards) // BATCH, spec["batches"])
             for a, b in deal((k * BATCH, (k + 1) * BATCH), spec["rank"], WORLD, MICRO).micro]
    share = 0
    for ids in micro:  # the bytes of its samples' lines (newline included), from the index read apart from Shards'
        which = np.searchsorted(shards.offsets, ids, side="right") - 1
        for s in np.unique(which):
            spans, rows = shards.shards[s].index["spans"], ids[which == s] - shards.offsets[s]
            got = spans.read(rows) if hasattr(spans, "read") else spans[rows]  # an index on disk (DiskRows)
            share += int((got[:, 1] - got[:, 0] + 1).sum())
    windows = [sum(os.path.getsize(shards.paths[s]) for s in w) for w in order.windows]
    start = _rchar()
    n = sum(len(shards.samples(ids)) for ids in micro)
    read = _rchar() - start
    return {"read": read, "share": share, "samples": n, "open": opened - before_open, "window": max(windows)}


def role_rss(spec: dict) -> dict:
    """Peak RSS of a fresh process that opens Shards over ``files`` and reads ``batches`` global batches."""
    if spec["torch"]:
        import torch  # noqa: F401 - as in a training worker
    from elasticflow.data.shards import Shards

    imported = _status("VmRSS")
    shards = Shards(spec["files"], window=WINDOW)
    order = shards.order(SEED, 0)
    for k in _spread(len(shards) // BATCH, spec["batches"]):
        shards.samples(order[k * BATCH:(k + 1) * BATCH])
    peak = _status("VmHWM")  # this process's own: ru_maxrss carries over the parent's peak across exec
    return {"peak": peak, "imported": imported, "samples": len(shards)}


def role_seq(spec: dict) -> dict:
    """The baseline: each file opened in turn, its lines read and parsed with json.loads."""
    t, cpu, n = time.perf_counter(), time.process_time(), 0
    for path in spec["files"]:
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    json.loads(line)
                    n += 1
    return {"seconds": time.perf_counter() - t, "cpu": time.process_time() - cpu, "samples": n}


def role_shards(spec: dict) -> dict:
    """An epoch of global batches read through Shards in its window order (the index exists already)."""
    from elasticflow.data.shards import Shards

    t, cpu = time.perf_counter(), time.process_time()
    shards = Shards(spec["files"], window=WINDOW)
    order, n = shards.order(SEED, 0), 0
    for lo in range(0, len(shards), BATCH):
        n += len(shards.samples(order[lo:lo + BATCH]))
    return {"seconds": time.perf_counter() - t, "cpu": time.process_time() - cpu, "samples": n}


MDS_CODE = r'''
import json, sys, time, types
# streaming/__init__ imports streaming.vision, whose torchvision (PyPI's, built for CUDA torch) fails beside a CPU
# torch: "operator torchvision::nms does not exist". This benchmark uses none of it.
sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")
from streaming import MDSWriter, StreamingDataset
spec = json.loads(sys.argv[1])
if spec["convert"]:
    t = time.perf_counter()
    with MDSWriter(out=spec["dir"], columns={"id": "int64", "tokens": "json"}, size_limit=1 << 26) as w:
        for path in spec["files"]:
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        w.write(json.loads(line))
    print(json.dumps({"seconds": time.perf_counter() - t}))
else:
    from streaming.base.util import clean_stale_shared_memory
    clean_stale_shared_memory()
    t, n = time.perf_counter(), 0
    ds = StreamingDataset(local=spec["dir"], shuffle=True, shuffle_seed=1, batch_size=spec["batch"])
    it = iter(ds)
    next(it)
    first, n = time.perf_counter() - t, 1
    for sample in it:
        n += 1
    print(json.dumps({"seconds": time.perf_counter() - t, "samples": n, "first": first}))
'''


def mds(python: str, **spec) -> dict:
    out = subprocess.run([python, "-c", MDS_CODE, json.dumps(spec)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"mosaicml-streaming failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the benchmark
def machine() -> str:
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2**20
    load = os.getloadavg()[0]
    return f"{time.strftime('%Y-%m-%d %H:%M')}, nproc {os.cpu_count()}, {mem:.1f} GiB memory, load average {load:.1f}"


def bench_shards(tmp: Path, corpus_gb: float, rounds: int) -> None:
    from elasticflow.data.shards import Shards

    print(f"\nShards over jsonl on disk: {machine()}")
    t = time.perf_counter()
    files = make_corpus(tmp / "corpus", int(corpus_gb * 1e9))
    size = sum(map(os.path.getsize, files))
    made = time.perf_counter() - t
    t = time.perf_counter()
    total = len(Shards(files, window=WINDOW))  # builds the index, outside every measurement
    print(f"  corpus: {len(files)} jsonl shards, {size / 1e9:.2f} GB, {total} samples ({size / total:.0f} B each); "
          f"written in {made:.0f} s, indexed in {time.perf_counter() - t:.1f} s")

    # 1. bytes read per worker
    workers = [spawn("worker", files=files, rank=r, batches=BATCHES) for r in range(WORLD)]
    print(f"  bytes read per worker, {WORLD} processes, {BATCHES} global batches of {BATCH} spread over the epoch, "
          f"micro-batches of {MICRO} dealt by position (rchar; target <= 1.2x share + one window):")
    for r, w in enumerate(workers):
        bound = 1.2 * w["share"] + w["window"]
        print(f"    worker {r}: read {w['read'] / 1e6:.3f} MB for a share of {w['share'] / 1e6:.3f} MB "
              f"({w['samples']} samples): {w['read'] / w['share']:.3f}x share; bound {bound / 1e6:.1f} MB "
              f"(window {w['window'] / 1e6:.0f} MB): {'ok' if w['read'] <= bound else 'MISSED'}; "
              f"opening Shards (the index) read {w['open'] / 1e6:.1f} MB more")

    # 2. peak RSS, 1/10 of the corpus against all of it
    small = files[:max(1, round(len(files) / 10))]
    small_size = sum(map(os.path.getsize, small))
    print(f"  peak RSS (VmHWM), fresh process, {BATCHES} global batches of {BATCH} read "
          f"(target: within +-10%):")
    for torch in (False, True):
        a = spawn("rss", files=small, batches=BATCHES, torch=torch)
        b = spawn("rss", files=files, batches=BATCHES, torch=torch)
        ratio = b["peak"] / a["peak"]
        print(f"    {'with torch imported' if torch else 'elasticflow.data alone':22s} "
              f"{small_size / 1e6:.0f} MB corpus {a['peak'] / 2**20:6.1f} MiB "
              f"(+{(a['peak'] - a['imported']) / 2**20:.1f} over the imports), "
              f"{size / 1e9:.2f} GB corpus {b['peak'] / 2**20:6.1f} MiB "
              f"(+{(b['peak'] - b['imported']) / 2**20:.1f}): {ratio:.3f}x "
              f"{'ok' if abs(ratio - 1) <= 0.1 else 'MISSED'}")

    # 3 and 4. read throughput against a sequential json.loads pass over the same files
    arms = {"sequential read + json.loads (baseline)": lambda: spawn("seq", files=files),
            f"Shards, window order, batches of {BATCH}": lambda: spawn("shards", files=files)}
    mds_dir = tmp / "mds"
    if Path(MDS_PYTHON).exists():
        t = time.perf_counter()
        mds(MDS_PYTHON, convert=True, dir=str(mds_dir), files=files)
        mds_size = sum(p.stat().st_size for p in mds_dir.iterdir())
        print(f"  MDS copy for mosaicml-streaming: {mds_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s")
        arms["mosaicml-streaming StreamingDataset (MDS, local, shuffle)"] = lambda: mds(
            MDS_PYTHON, convert=False, dir=str(mds_dir), batch=BATCH)
    else:
        print(f"  mosaicml-streaming: no {MDS_PYTHON} (set BENCH_MDS_PYTHON to a venv's python that has it): "
              "row left out")
    cold = drop_caches()
    variants = (["cold"] if cold else []) + ["warm"]
    results = {(v, name): [] for v in variants for name in arms}
    cpu_s = {(v, name): [] for v in variants for name in arms}  # user + system seconds of the reading process
    for r in range(rounds):  # the order alternates: no arm always follows the same one
        names = list(arms) if r % 2 == 0 else list(reversed(arms))
        for v in variants:
            if v == "cold" and r > 0:
                continue  # one cold round: each cold pass is a full read of the corpus from disk
            for name in names:
                if v == "cold":
                    drop_caches()
                out = arms[name]()
                assert out["samples"] == total, (name, out["samples"], total)
                results[(v, name)].append(out["seconds"])
                cpu_s[(v, name)].append(out.get("cpu", float("nan")))  # MDS's reader runs in other processes
    for v in variants:
        how = "page cache dropped before each pass, 1 round" if v == "cold" else f"page cache warm, {rounds} rounds"
        print(f"  read throughput, one process, the whole corpus ({how}; target: Shards >= 0.9x baseline):")
        base = np.median(results[(v, next(iter(arms)))])
        base_cpu = np.median(cpu_s[(v, next(iter(arms)))])
        for name in arms:
            sec = results[(v, name)]
            s, cpu = float(np.median(sec)), float(np.median(cpu_s[(v, name)]))
            print(f"    {name:54s} {total / s:8.0f} samples/s {size / s / 1e6:6.1f} MB/s  {base / s:5.2f}x   "
                  f"rounds (s): {', '.join(f'{x:.1f}' for x in sec)}; CPU {cpu:.1f} s, {base_cpu / cpu:.2f}x")
        print("    (CPU: the reading process's user + system seconds, which a noisy neighbour moves less than wall "
              "time; the target is on wall time)")
    if not cold:
        print("  (the page cache could not be dropped here: every throughput figure is warm-cache)")


ROLES = {"worker": role_worker, "rss": role_rss, "seq": role_seq, "shards": role_shards}

if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(ROLES[sys.argv[1]](json.loads(sys.argv[2]))))
