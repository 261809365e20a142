"""A linear model with a 100 MB parameter (5000 x 5000 float32) for join and transfer benchmarks.

$EF_WIDE_N sets the side (scripts/bench/bench_topology.py: 3200, a 10.2M-parameter, 41 MB gradient)."""
import os

import numpy as np

from elasticflow import ops

N = int(os.environ.get("EF_WIDE_N", "5000"))


def model(cfg):
    rng = np.random.default_rng(cfg.seed)
    return {"W": (rng.standard_normal((N, N), dtype=np.float32) * 0.01)}


def forward(x, y, params):
    return ops.mse(x @ params["W"], y)


def data(cfg):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, N), dtype=np.float32)
    return x, x[:, :N] * 0.5
