"""The sum of squares of a slice of the flat gradient, the same wherever the vector is cut (gradient clipping's
norm with ``trainer.shard=gradients|parameters``, where each member holds its own range of the sums).

A float32 norm of a whole vector and the norms of its pieces, squared and added, round differently: its partial
sums in float32 over millions of elements are good to a few 1e-6, and a clipping factor off by that much moved a
3-worker run 2e-5 away from the 1-worker model. Here the vector is cut into blocks at fixed multiples of
``BLOCK`` of its global offsets; each block's float32 norm is taken in one vectorised call, and the squares are
added in float64. A block two members split is the only part that rounds differently: at most two per member.
"""
from __future__ import annotations

import torch

BLOCK = 1 << 16  # elements: small enough that a block's float32 norm rounds at ~1e-7, large enough to vectorise


PRECISE_ROWS = 16  # blocks converted to float64 at a time (8 MiB) by sum_squares(precise=True)


def sum_squares(t: torch.Tensor, at: int = 0, precise: bool = False) -> float:
    """The sum of the squares of the 1-D float tensor ``t``, whose first element is element ``at`` of the whole
    vector (the blocks are cut at multiples of BLOCK of that vector's offsets). A sync point on a GPU.

    ``precise``: each block's norm in float64, so a cut vector gives the whole one's sum to ~1e-16, not ~1e-9
    (float16's loss scaling: its casts turn a clipping factor's last float32 bit into whole float16 steps of
    some weights, and a run drifts from the 1-worker one). Costs ~6x the float32 blocks (~2 ms per million
    elements on one core)."""
    n = t.numel()
    head = min(n, -at % BLOCK)
    body = (n - head) // BLOCK * BLOCK
    parts = [t[:head], t[head + body:]]
    wide = (lambda x: x.double()) if precise else (lambda x: x)
    total = sum(float(torch.linalg.vector_norm(wide(p))) ** 2 for p in parts if p.numel())
    if body:
        blocks = t[head:head + body].view(-1, BLOCK)
        rows = PRECISE_ROWS if precise else blocks.shape[0]
        for i in range(0, blocks.shape[0], rows):
            total += float(torch.linalg.vector_norm(wide(blocks[i:i + rows]), dim=1).double().square().sum())
    return total
