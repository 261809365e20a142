"""A per-token linear regression in float16 whose forward() returns the token count as its ``weight``
(tests/test_precision.py). Targets of ~0.3 over ~400 tokens a micro-batch: at the first loss scale (2^16) the
backward of a loss multiplied by its token count overflows float16, and that of a share of the batch does not.
"""
import numpy as np
import torch

SAMPLES, LENGTH, FEATURES = 128, 64, 8


def model(cfg):
    torch.manual_seed(cfg.seed)
    return torch.nn.Linear(FEATURES, 1)


def forward(x, y, mask, net):
    err = (net(x).squeeze(-1) - y) * mask
    tokens = mask.sum()
    return {"loss": (err.float() ** 2).sum() / tokens, "weight": tokens}


def data(cfg):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(SAMPLES, LENGTH, FEATURES)).astype(np.float32)
    y = (x @ rng.normal(size=FEATURES) * 0.1 + 0.3).astype(np.float32)
    lengths = rng.integers(LENGTH // 2, LENGTH + 1, size=SAMPLES)
    mask = (np.arange(LENGTH) < lengths[:, None]).astype(np.float32)
    return x, y * mask, mask
