"""The TensorFlow backend's data path: numpy to tensors, the resident dataset, and ``Rows`` -- a batch the
Engine gathers inside its compiled step -- plus the one no-copy view of a variable and its numpy dtype.

On a GPU (``setup`` made only the placement's GPU visible, so TF calls it "/GPU:0") the resident
dataset is copied to it once; a batch needs no copy of its own (``to_device``).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Tuple

import numpy as np
import tensorflow as tf

from .. import common
from ..common import host_array
from ...config.devices import Placement

_placement = Placement()  # what setup() recorded: the default of resident() and to_device()


def record(placement: Optional[Placement]) -> None:
    global _placement
    _placement = placement or Placement()


def _gpu(placement: Optional[Placement]) -> Optional[str]:
    """The TF device name of ``placement``'s GPU, None on the CPU. setup() left that one GPU visible
    alone, so it is the first logical GPU whatever its CUDA index."""
    return "/GPU:0" if (placement or _placement).kind == "cuda" else None


def to_tensor(array: np.ndarray) -> tf.Tensor:
    """float64 becomes float32 (the framework's parameter dtype); other dtypes keep theirs."""
    return tf.constant(host_array(array))


def resident(arrays: Iterable[np.ndarray], placement: Optional[Placement] = None) -> Tuple[tf.Tensor, ...]:
    """The whole dataset as tensors, converted once, on ``placement``'s device (None: setup()'s)."""
    gpu = _gpu(placement)
    if gpu is None:
        return common.resident(to_tensor, arrays)
    with tf.device(gpu):  # identity: a constant made from numpy may stay in host memory
        return tuple(tf.identity(t) for t in common.resident(to_tensor, arrays))


def to_device(batch: tuple, placement: Optional[Placement] = None) -> tuple:
    """``batch`` where the step computes: as it is, on any device.

    A compiled step copies its inputs to the device its ops run on, so an eager copy here would
    be one op dispatch more per tensor for the same copy. (Rows of a resident dataset are on the
    GPU already: resident() put them there.)
    """
    return batch


def index(positions: np.ndarray) -> tf.Tensor:
    return tf.constant(np.asarray(positions, dtype=np.int64))


class Rows:
    """Rows ``idx`` of the resident tensors ``source``: a batch the Engine gathers inside its
    compiled step. Gathered eagerly, each tensor would be an op dispatch of its own per step (tens
    of microseconds each, a large share of a small step). Indexing or iterating gathers eagerly.
    """
    __slots__ = ("source", "idx")

    def __init__(self, source: Tuple[tf.Tensor, ...], idx: tf.Tensor):
        self.source, self.idx = source, idx

    def tensors(self) -> Tuple[tf.Tensor, ...]:
        return _gather(self.source, self.idx)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i):
        return self.tensors()[i]


def gather(tensors: Tuple[tf.Tensor, ...], idx: tf.Tensor) -> Rows:
    return Rows(tuple(tensors), idx)


def _gather(tensors: Tuple[tf.Tensor, ...], idx: tf.Tensor) -> Tuple[tf.Tensor, ...]:
    return tuple(tf.gather(t, idx) for t in tensors)


def _split(batch) -> Tuple[Optional[Tuple[tf.Tensor, ...]], Any]:
    """(the resident tensors, or None; what the compiled step is called with: row indices, or the tensors)."""
    if isinstance(batch, Rows):
        return batch.source, batch.idx
    return None, tuple(batch)


def _on_rows(step, source: Optional[Tuple[tf.Tensor, ...]]):
    """``step(batch)`` taking what ``_split`` gives: it gathers the rows of ``source`` first, if set.
    The closure keeps ``source`` alive, so the ``id(source)`` in a compiled-function key stays its own."""
    return step if source is None else (lambda idx: step(_gather(source, idx)))


def to_numpy(t: Any) -> np.ndarray:
    return np.asarray(t.numpy()) if hasattr(t, "numpy") else np.asarray(t)


def np_dtype(var: Any) -> np.dtype:
    """A variable's dtype as numpy's (a tf.DType, or keras's dtype string)."""
    return np.dtype(getattr(var.dtype, "as_numpy_dtype", var.dtype))


def _view(variable: Any) -> np.ndarray:
    """A read-only numpy view of a CPU variable's current value: ``.numpy()`` would copy it."""
    # convert_to_tensor reads tf and keras variables alike; _numpy() is private, but the one
    # no-copy path from an eager tensor to numpy (a 0-d tensor gives a numpy scalar: a copy).
    array = np.asarray(tf.convert_to_tensor(variable)._numpy())
    array.flags.writeable = False
    return array
