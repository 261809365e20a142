"""What ``trainer.reproducible=true`` forces and what it cannot run with, one line each (docs/exactness.md).

The mode makes the trained model a function of the config, the data and the seed: every sum across
micro-batches and workers is exact (``replica/exact_sum.py``), and each micro-batch computes the same bits
wherever it runs (a fixed thread count, deterministic kernels).
"""
from __future__ import annotations

from typing import Any, Optional

from ..errors import ElasticFlowError

THREADS = 1  # intra-op threads per worker unless backend.threads says: never a function of the world size


def threads(cfg: Any) -> Optional[int]:
    """The intra-op thread count the mode forces (None outside it: the backend's default applies)."""
    if not cfg.trainer.reproducible:
        return None
    return int(cfg.backend.threads or THREADS)


def check(cfg: Any, kind: str) -> None:
    """Refuse, in one line with a hint, what ``trainer.reproducible`` cannot make bitwise (``kind``: the topology)."""
    t = cfg.trainer
    every = cfg.elastic.verify_every
    if every and not t.reproducible:
        raise ElasticFlowError(f"elastic.verify_every={every} compares two workers' gradients of one micro-batch bit "
                               "for bit, which only trainer.reproducible makes equal",
                               "pass trainer.reproducible=true with it, or elastic.verify_every=null")
    if every and t.shard == "parameters":
        raise ElasticFlowError(f"elastic.verify_every={every} computes a micro-batch twice; under "
                               "trainer.shard=parameters its gradient goes to its owners during backward, twice",
                               "pass trainer.shard=optimizer or none with it, or elastic.verify_every=null")
    if not t.reproducible:
        return
    why = "trainer.reproducible sums every micro-batch's gradient exactly"
    if t.micro_batch_size is None:
        raise ElasticFlowError(f"{why}, so it needs trainer.micro_batch_size: without it a worker's share is one "
                               "batch whose size depends on the number of workers",
                               f"pass trainer.micro_batch_size={_divisor(t.global_batch_size)} (any size; the "
                               "same in every run you compare)")
    if cfg.comm.bucket_mb:
        raise ElasticFlowError(f"{why} after each backward; comm.bucket_mb={cfg.comm.bucket_mb:g} would reduce "
                               "buckets during it", "pass comm.bucket_mb=null with trainer.reproducible=true")
    if t.shard == "gradients":  # stage 3's owners sum exactly (param_units.reduce_grad); stage 2's reduce-scatter
        raise ElasticFlowError(f"{why}; trainer.shard=gradients reduce-scatters float32 sums",
                               "pass trainer.shard=parameters, optimizer or none with trainer.reproducible=true")
    if kind in ("parameter_server", "local_sgd", "diloco"):
        raise ElasticFlowError(f"{why}; topology={kind} sums in float32 on its own routes, not yet exactly",
                               "pass topology=ring or topology=hierarchical with trainer.reproducible=true")


def _divisor(batch: int) -> int:
    """A micro-batch size to suggest: the largest of 32, 16, 8, ... that divides ``batch``."""
    size = 32
    while size > 1 and batch % size:
        size //= 2
    return size
