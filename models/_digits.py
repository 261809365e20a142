"""scikit-learn's 8x8 handwritten digits (1797 images, shipped with sklearn: no download), split once.

The split is fixed and independent of the training seed: a shuffle with seed 0, then the first
1437 rows train and the last 360 test (80/20). Pixels are scaled from 0..16 to [0, 1].
"""
import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Tuple

import numpy as np

TRAIN_ROWS = 1437
CLASSES = 10
PIXELS = 64  # 8 x 8


def _load_digits() -> Tuple[np.ndarray, np.ndarray]:
    """``sklearn.datasets.load_digits()``'s (data, target), read from the CSV file sklearn ships, as it reads
    it, without importing sklearn: its import (scipy, pandas) costs ~1.5 s of CPU in every process that
    trains on digits, 30x the read (tests/test_models.py checks the arrays are load_digits' own)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits models need scikit-learn, which ships the data: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


@lru_cache(maxsize=1)
def _split() -> Tuple[Tuple[np.ndarray, np.ndarray], Tuple[np.ndarray, np.ndarray]]:
    data, target = _load_digits()
    x = (data / 16.0).astype(np.float32)
    y = target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:TRAIN_ROWS], order[TRAIN_ROWS:]
    return (x[train], y[train]), (x[test], y[test])


def train_split() -> Tuple[np.ndarray, np.ndarray]:
    """(x, y): x float32 (1437, 64) in [0, 1], y int64 (1437,) in 0..9."""
    return _split()[0]


def test_split() -> Tuple[np.ndarray, np.ndarray]:
    """(x, y): the 360 held-out rows, same layout as train_split()."""
    return _split()[1]
