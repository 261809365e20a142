"""A linear regression with one outlier target, for float16 loss scaling (tests/test_precision.py).

At the default loss scale the gradient of the micro-batch holding the outlier overflows float16 in
backward; the others' do not. So with several workers only one member overflows locally, and every
member must still skip the same steps.
"""
import numpy as np
import torch

OUTLIER = 37  # the sample whose target is far out of range


def model(cfg):
    torch.manual_seed(cfg.seed)
    return torch.nn.Linear(4, 1)


def forward(x, y, net):
    return torch.nn.functional.mse_loss(net(x).squeeze(-1), y)


def data(cfg):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    y[OUTLIER] = 3e4
    return x, y
