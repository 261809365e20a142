"""scikit-learn's 8x8 handwritten digits (1797 images, shipped with sklearn: no download), split once.

The split is fixed and independent of the training seed: a shuffle with seed 0, then the first
1437 rows train and the last 360 test (80/20). Pixels are scaled from 0..16 to [0, 1].
"""
from functools import lru_cache
from typing import Tuple

import numpy as np

TRAIN_ROWS = 1437
CLASSES = 10
PIXELS = 64  # 8 x 8


@lru_cache(maxsize=1)
def _split() -> Tuple[Tuple[np.ndarray, np.ndarray], Tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits  # imported here: sklearn costs ~1.5 s, only the digits models pay it

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:TRAIN_ROWS], order[TRAIN_ROWS:]
    return (x[train], y[train]), (x[test], y[test])


def train_split() -> Tuple[np.ndarray, np.ndarray]:
    """(x, y): x float32 (1437, 64) in [0, 1], y int64 (1437,) in 0..9."""
    return _split()[0]


def test_split() -> Tuple[np.ndarray, np.ndarray]:
    """(x, y): the 360 held-out rows, same layout as train_split()."""
    return _split()[1]
