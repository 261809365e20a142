"""A linear model whose steps take 0.05 s each (~20 a second): a run that is still training when a test acts
on it (Ctrl-C, a second run beside it, a SIGKILL)."""
import time

import numpy as np

from elasticflow import ops


def model(cfg):
    return {"W": np.zeros((4, 1), np.float32)}


def forward(x, y, params):
    time.sleep(0.05)
    return ops.mse(x @ params["W"], y)


def data(cfg):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    return x, x[:, :1] * 2
