"""What one random sample costs to fetch from a jsonl shard in the page cache, by the two ways a reader has
(issue #45's read-throughput bound, docs/benchmarks.md#sharded-corpora): a ``pread`` per sample (what
``elasticflow.data.Shards`` does, called from C through ``map``) against slicing a read-only mapping of the file
(``MADV_RANDOM``: no fault-around), whose pages are dropped after each batch (``MADV_DONTNEED``) to keep the
resident set flat. Batches of 256 sorted random lines of one shard; the cost per sample in microseconds and the
mapping's peak resident set. Parsing is left out: both ways hand the same bytes to the same parser.

    python scripts/bench/bench_sample_access.py              # a 200 MB corpus in /tmp, 3 alternating rounds
    python scripts/bench/bench_sample_access.py --mb 600 --rounds 5
"""
from __future__ import annotations

import argparse
import itertools
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shards import make_corpus  # noqa: E402

BATCH = 256


def rss_mib() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=200, help="corpus size (64 shards)")
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_access_") as tmp:
        files = make_corpus(Path(tmp), args.mb * 1_000_000)[:8]
        spans = []
        for path in files:  # each line's [start, end) with its newline, as Shards' index holds them
            ends = np.flatnonzero(np.frombuffer(Path(path).read_bytes(), np.uint8) == 10) + 1
            spans.append(np.stack([np.r_[0, ends[:-1]], ends], 1))
        rng = np.random.default_rng(0)
        rows = min(len(s) for s in spans)
        batches = [(int(rng.integers(0, len(files))), np.sort(rng.choice(rows, BATCH, replace=False)))
                   for _ in range(args.batches)]
        fds = [os.open(path, os.O_RDONLY) for path in files]
        maps = [mmap.mmap(fd, 0, prot=mmap.PROT_READ) for fd in fds]
        for m in maps:
            m.madvise(mmap.MADV_RANDOM)
        for path in files:  # the page cache warm for both
            Path(path).read_bytes()

        def by_pread() -> int:
            for f, r in batches:
                s = spans[f][r]
                list(map(os.pread, itertools.repeat(fds[f], len(s)), (s[:, 1] - s[:, 0]).tolist(), s[:, 0].tolist()))
            return 0

        def by_mapping() -> int:
            peak = 0
            for f, r in batches:
                s, m = spans[f][r], maps[f]
                [m[a:b] for a, b in zip(s[:, 0].tolist(), s[:, 1].tolist())]
                peak = max(peak, rss_mib())
                m.madvise(mmap.MADV_DONTNEED)
            return peak

        samples = args.batches * BATCH
        base = rss_mib()
        for k in range(args.rounds):
            out = []
            for name, fn in (("pread", by_pread), ("mapping", by_mapping))[::1 if k % 2 == 0 else -1]:
                t = time.perf_counter()
                peak = fn()
                out.append(f"{name} {(time.perf_counter() - t) / samples * 1e6:.2f} us/sample"
                           + (f" (peak RSS +{peak - base} MiB)" if peak else ""))
            print(f"round {k + 1}: " + ", ".join(sorted(out, reverse=True)), flush=True)


if __name__ == "__main__":
    main()
