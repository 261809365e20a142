"""The torch backend's data path: numpy to tensors, the resident dataset, a batch on the device, rows by index."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch

from .. import common
from ..common import host_array
from ...config.devices import Placement


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """float64 becomes float32 (the framework's parameter dtype); other dtypes keep theirs."""
    array = np.asarray(array)
    if array.dtype != np.float64 and (not array.flags.writeable or not array.flags.c_contiguous):
        array = np.ascontiguousarray(array).copy()  # from_numpy shares memory: a read-only array warns
    return torch.from_numpy(host_array(array))


def resident(arrays, placement: Optional[Placement] = None) -> Tuple[torch.Tensor, ...]:
    """The whole dataset as tensors, converted once: on ``placement``'s device, else on the host."""
    tensors = common.resident(to_tensor, arrays)
    if placement is None or placement.kind == "cpu":
        return tensors
    return tuple(t.to(placement.device) for t in tensors)


def to_device(batch: Tuple[torch.Tensor, ...], placement: Optional[Placement] = None) -> Tuple[torch.Tensor, ...]:
    """A host batch on ``placement``'s device: through pinned memory, so the copy runs beside the
    GPU's queued work instead of stalling for it (the copy is ordered before the step's kernels)."""
    if placement is None or placement.kind == "cpu":
        return batch
    return tuple(t.pin_memory().to(placement.device, non_blocking=True) for t in batch)


def index(positions: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(positions)


def gather(tensors: Tuple[torch.Tensor, ...], idx: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    if tensors and tensors[0].is_cuda:  # a resident dataset on the GPU: the positions go there (small)
        idx = idx.to(tensors[0].device, non_blocking=True)
    return tuple(t.index_select(0, idx) for t in tensors)


def to_numpy(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
