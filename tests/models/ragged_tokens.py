"""masked_tokens.py's sequences without their padding (a ragged data set), padded per micro-batch by
``collate``: to the micro-batch's longest sequence, so shapes differ from one micro-batch to the next.
Padding contributes nothing (its mask is 0): the model is masked_tokens.py's, to float32 rounding.
"""
import numpy as np

import masked_tokens
from masked_tokens import forward, model  # noqa: F401 - the model file's functions

__all__ = ["model", "forward", "data", "collate"]


def data(cfg):
    x, y, mask = masked_tokens.data(cfg)
    lengths = mask.sum(axis=1).astype(int)
    return [x[i, :n] for i, n in enumerate(lengths)], [y[i, :n] for i, n in enumerate(lengths)]


def collate(samples):
    longest = max(len(x) for x, _ in samples)
    x = np.zeros((len(samples), longest, masked_tokens.FEATURES), np.float32)
    y = np.zeros((len(samples), longest), np.float32)
    mask = np.zeros((len(samples), longest), np.float32)
    for i, (xi, yi) in enumerate(samples):
        x[i, :len(xi)], y[i, :len(yi)], mask[i, :len(xi)] = xi, yi, 1.0
    return x, y, mask
