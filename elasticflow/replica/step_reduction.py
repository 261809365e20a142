"""How one step's gradient, scalars and votes are summed over the members: the collectives each setting takes.

``Replica`` owns one ``StepReduction`` and calls it only with a group of two or more members (a single
member's step needs no collective). The caller passes what changes with the membership (the group, the
generation, the world size) on each call. In the order ``start`` tries them:

- parameter servers (``topology=parameter_server``): the gradient is pushed to the aggregators in ``finish``,
  then the votes go in a small allreduce of their own;
- stage 3 (``trainer.shard=parameters``): each unit's gradient went to its owners during backward; the votes
  go in a small allreduce, and ``finish`` hands each owner's sums to its buddy;
- stage 2 (``trainer.shard=gradients``): one reduce-scatter, the votes folded in when the gradient is small;
- buckets (``comm.bucket_mb``, ``bucketing.Buckets``): started during backward, the last one carrying the votes;
- a small gradient (up to ``FOLD_MAX`` elements): ONE allreduce, the votes in float32 after the gradient;
- a large one: two allreduces, the gradient, then the votes in float64.

``trainer.reproducible`` takes none of these: the step's exact sums (``exact_sums``), filled by the stepper, are
summed whole (``finish_exact``).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from .bucketing import Buckets
from .exact_sum import ReproducibleSum
from .outcomes import Agreed, Reduction, agreed

FOLD_MAX = 1 << 20  # gradients up to 4 MiB (float32) carry the step's scalars in the same allreduce


class StepReduction:
    """The collectives of this worker's step reductions, and what they keep between steps.

    Args:
        engine: the backend Engine (its flat gradient is what is summed).
        shards: a ``shard.ShardedState`` with trainer.shard or parameter servers, else None.
        bucket_mb: ``comm.bucket_mb`` (None or 0: the gradient whole).
    """

    def __init__(self, engine: Any, shards: Any, bucket_mb: Optional[float]):
        self.engine, self.shards = engine, shards
        self.buckets = Buckets(engine, int(bucket_mb * (1 << 20)) if bucket_mb else 0)
        self._exact: Optional[ReproducibleSum] = None  # trainer.reproducible: the step's sums, kept between steps

    def scatters(self) -> bool:
        """Stage 2 reduce-scatters the gradient in one piece: no buckets."""
        return self.shards is not None and self.shards.scatters()

    def begin_backward(self, group: Any, world: int) -> None:
        """Before the last backward of the step: each bucket starts its allreduce as backward finishes it."""
        self.buckets.begin_backward(group, world, self.scatters())

    def start(self, group: Any, votes: List[float], k: int, generation: int, world: int,
              buffers: Optional[np.ndarray]) -> Reduction:
        """Start summing the gradient, ``votes`` (the ``k`` scalars, then the four flags) and ``buffers`` over the
        ``world`` members of ``generation``; ``finish`` waits for it."""
        import torch

        grad = self.engine.grad_view()
        n = len(votes)
        r = Reduction(generation=generation, world=world, n=n, k=k, buffers=buffers is not None)
        ranges = self.buckets.plan(world, self.scatters())
        if self.shards is not None and self.shards.serves():  # finish pushes, then sums the votes
            r.push = grad
            r.tail = _tail(votes, buffers)
        elif self.shards is not None and self.shards.reduced_in_backward():
            # Stage 3: each unit's gradient went to its owners as its backward ended (param_units.py): the votes
            # (and buffers) in a small allreduce; finish hands each owner's sums to its buddy.
            r.tail = _tail(votes, buffers)
            _start(r, group, r.tail)
            r.mine = (self.shards.acc, False)
        elif self.shards is not None and self.shards.scatters():
            # Stage 2: each member receives the sums of its own chunk and its buddy's only. A small gradient
            # carries the votes (and buffers) in the same collective, in float32 as the fold below; a large
            # one sends them in a small float64 allreduce queued behind it.
            tail = _tail(votes, buffers)
            small = grad.numel() <= FOLD_MAX
            work, r.mine = self.shards.start_reduce_scatter(group, grad, tail.to(torch.float32) if small else None)
            r.works.append(work)
            if not small:
                _start(r, group, tail)
                r.tail = tail
        elif ranges:
            self.buckets.reduce(r, group, grad, ranges, votes, buffers)
        elif grad.numel() <= FOLD_MAX:
            # One collective, not two: each is a round trip every member must be scheduled for, which on
            # a small model costs more than the step's compute. The scalars (and buffer contributions) ride
            # in float32 after the gradient (exact for the flags and generations): written into the slots
            # the engine keeps after its flat gradient, so the gradient is reduced where it lies.
            head = grad.numel()
            extra = n + (0 if buffers is None else buffers.size)
            buf = self.engine.fold_buffer(extra)
            if buf is not None:
                buf[head:head + n].copy_(torch.tensor(votes, dtype=buf.dtype))
                if buffers is not None:
                    buf[head + n:].copy_(torch.from_numpy(buffers))  # float64 -> float32, as the copy below
            else:  # no room after the gradient (a TF engine): copy it into a concatenation and back
                parts = [grad, torch.tensor(votes, dtype=grad.dtype).to(grad.device)]
                if buffers is not None:
                    parts.append(torch.from_numpy(buffers).to(grad.device, grad.dtype))
                buf = torch.cat(parts)
                r.copy_back = (grad, buf[:head])
            _start(r, group, buf)
            r.tail = buf[head:]
        else:  # bandwidth-bound: a second, small round trip is noise beside the gradient's, and keeps the
            # scalars in float64 (an engine whose fold_buffer is None would also copy a big gradient twice)
            tail = torch.tensor(votes, dtype=torch.float64)
            if buffers is not None:
                tail = torch.cat([tail, torch.from_numpy(buffers)])
            _start(r, group, grad)
            _start(r, group, tail)  # the same order on every member: gloo matches collectives by sequence
            r.tail = tail
        return r

    def finish(self, group: Any, r: Reduction) -> Tuple[List[float], Agreed, Optional[np.ndarray]]:
        """Wait for ``start``'s reduction (a ``CommError`` if a member failed): (summed scalars, what all agreed,
        summed buffers)."""
        import torch

        if r.push is not None:  # parameter servers: every sum in place before any member can commit
            self.shards.push(group, r.push)
            _start(r, group, r.tail)
        for work in r.works:
            group.wait(work)
        if r.mine is not None:
            folded = self.shards.finish_reduce_scatter(group, r.mine)
            if folded is not None:
                r.tail = folded
        if r.copy_back is not None:
            r.copy_back[0].copy_(r.copy_back[1])
        tail, n, k = r.tail, r.n, r.k
        out = tail[:n].tolist()  # on a GPU: the sync point of the reduction
        # Every member summed the same numbers, so every member reaches the same verdict.
        buffers = tail[n:].to("cpu", torch.float64).numpy() if r.buffers else None
        return out[:k], agreed(out[k:], r.generation, r.world), buffers

    # ------------------------------------------------------------------ trainer.reproducible
    def exact_head(self) -> int:
        """How many of the step's exact sums are the gradient's: none with stage 3, whose owners summed each
        micro-batch's gradient of their ranges exactly during backward (``reduce_grad``)."""
        return 0 if self.shards is not None and self.shards.reduced_in_backward() else self.engine.num_params

    def exact_sums(self, scalars: int, buffers: int) -> ReproducibleSum:
        """The step's exact sums, cleared, laid out as ``finish_exact`` reads them: the flat gradient
        (``exact_head``), ``scalars`` (loss, metrics, per-parameter flags), four votes, ``buffers``."""
        grad = self.engine.grad_view()
        n = self.exact_head() + scalars + 4 + buffers
        if self._exact is None or self._exact.n != n:
            self._exact = ReproducibleSum(n, grad.device)
        else:
            self._exact.clear()
        return self._exact

    def finish_exact(self, group: Any, sums: ReproducibleSum, scalars: int, votes: Optional[List[float]],
                     world: int) -> Any:
        """``votes`` (None: no membership) added to ``sums``, summed over the ``world`` members, the gradient written
        back in float32 (rounded once); returns the rest of the sums (scalars, votes, buffers) on the host."""
        head = self.exact_head()
        if votes is not None:
            sums.add(np.asarray(votes), at=head + scalars)
            if world > 1:
                sums.allreduce(group)  # a CommError: recover() zeroes the gradient, the step is redone
        if head:
            self.engine.grad_in(0, head)  # stage 3 on one member (or two holding all): zero_grad gave it back
            sums.values_into(self.engine.grad_view())  # rounded to float64, then float32
        else:  # stage 3: each owner's exact sums, rounded once, and the buddy's copy of them
            self.shards.finish_reduce_scatter(group, (self.shards.settle_reproducible(), False))
        return sums.values(head).cpu()


def _start(r: Reduction, group: Any, tensor: Any) -> None:
    if tensor.is_cuda:  # NCCL or a pinned staging buffer: reduced (and ordered on its stream) now
        group.allreduce_(tensor)
    else:
        r.works.append(group.allreduce_start(tensor))


def _tail(votes: List[float], buffers: Optional[np.ndarray]) -> Any:
    """The step's votes (and buffer contributions) as one float64 tensor, for a small allreduce of their own."""
    import torch

    tail = torch.tensor(votes, dtype=torch.float64)
    return tail if buffers is None else torch.cat([tail, torch.from_numpy(buffers)])
