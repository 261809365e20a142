"""Linear regression on synthetic data: the smallest complete model file.

Reaches a loss of about 0.01 (the noise floor, 0.1**2) within 200 steps on 2 CPU cores in under a second
of training; tests/test_models.py checks it.
"""
import numpy as np

from elasticflow import ops

FEATURES, OUTPUTS, SAMPLES = 8, 2, 1024


def model(cfg):
    rng = np.random.default_rng(cfg.seed)
    return {"W": rng.normal(0, 0.1, (FEATURES, OUTPUTS)).astype(np.float32),
            "b": np.zeros(OUTPUTS, np.float32)}


def forward(x, y, params):
    return ops.mse(x @ params["W"] + params["b"], y)


def data(cfg):
    rng = np.random.default_rng(1234)  # fixed: the data set does not change with the training seed
    x = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
    true_w = rng.normal(size=(FEATURES, OUTPUTS)).astype(np.float32)
    y = x @ true_w + 0.5 + rng.normal(0, 0.1, size=(SAMPLES, OUTPUTS)).astype(np.float32)
    return x, y
