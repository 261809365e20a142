"""The torch backend's devices and start-up: threads, the seed, binding this worker's GPU, what the GPUs can do."""
from __future__ import annotations

import os
from typing import List, Optional

import torch

from ...config.devices import Placement


def setup(threads: Optional[int], seed: int, placement: Optional[Placement] = None,
          deterministic: bool = False) -> None:
    """Threads, the GPU and the seed; ``deterministic`` (trainer.reproducible): kernels that give the same bits
    every run (torch.use_deterministic_algorithms; on a GPU cuBLAS's fixed workspace, set before its first use)."""
    if threads:
        torch.set_num_threads(threads)
    if deterministic:
        if placement is not None and placement.kind == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if placement is not None and placement.kind == "cuda":
        # Before anything allocates: otherwise a context (~500 MB) lands on GPU 0 for every worker.
        torch.cuda.set_device(placement.index)
    torch.manual_seed(seed)


def gpus() -> List[str]:
    """The names of the GPUs this process sees ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def bf16_supported() -> bool:
    """Whether the visible GPUs compute in bfloat16 (True without a GPU: the CPU does).

    Compute capability 8.0 (Ampere) or newer. Not ``torch.cuda.is_bf16_supported()``: it counts
    emulation as support, and may allocate on GPU 0 before this worker has bound its own GPU.
    """
    return all(torch.cuda.get_device_properties(i).major >= 8 for i in range(torch.cuda.device_count()))
