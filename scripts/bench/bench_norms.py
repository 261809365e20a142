"""What clipping's gradient norm costs by kind (elasticflow/_util/norms.py, elasticflow/replica/exact_sum.py), in the
same run: float32 blocks (the default), float64 blocks (``precise``: float16's loss scaling, a cut vector gives
the whole one's sum to ~1e-16) and the exact sum of squares (``trainer.reproducible``). One thread.

    .venv/bin/python scripts/bench/bench_norms.py                  # 1M, 10M and 50M elements, median of 5
    .venv/bin/python scripts/bench/bench_norms.py --sizes 3200000 --repeats 9

Prints one line per size: each kind's median milliseconds and its ratio to the float32 blocks.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from elasticflow._util.norms import sum_squares  # noqa: E402
from elasticflow.replica.exact_sum import sum_squares_reproducibly  # noqa: E402

KINDS = {
    "float32 blocks": lambda t: sum_squares(t),
    "float64 blocks": lambda t: sum_squares(t, 0, precise=True),
    "exact": lambda t: float(sum_squares_reproducibly(t).values()[0]),
}


def median_ms(fn, t: torch.Tensor, repeats: int) -> float:
    fn(t)  # warm: allocations, a first-call path
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(t)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000, 50_000_000])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for n in args.sizes:
        t = torch.randn(n, generator=torch.Generator().manual_seed(0))
        ms = {name: median_ms(fn, t, args.repeats) for name, fn in KINDS.items()}
        base = ms["float32 blocks"]
        print(f"{n:>11,} elements: " + ", ".join(f"{name} {v:.1f} ms ({v / base:.1f}x)" for name, v in ms.items()))


if __name__ == "__main__":
    main()
