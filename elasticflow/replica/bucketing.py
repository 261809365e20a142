"""The step's gradient in buckets (``comm.bucket_mb``): each bucket's allreduce starts as soon as backward
has finished it, while backward goes on with the next. ``replica.Replica`` inherits these; its docstring says
where they sit in the step's reduction.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ..distributed import protocol


class Buckets:
    """The bucketed half of ``replica.Replica`` (which sets every attribute read here)."""

    def begin_backward(self) -> None:
        """Before this worker's last backward of the step: from here on each gradient bucket starts its
        allreduce as soon as backward has finished it, while backward goes on (``comm.bucket_mb``)."""
        self._reset_buckets()
        ranges = self._buckets()
        if ranges:  # TensorFlow's arm never reports: its tape has no per-variable callback
            self.engine.arm(ranges, self._bucket_ready)

    def _buckets(self) -> Optional[List[Tuple[int, int]]]:
        """The buckets, when the step reduces in more than one (the same answer on every member: it
        depends on the model and the settings only). Host gradients only: a GPU's go over NCCL whole."""
        if not self.bucket_bytes or self.membership is None or self.world == 1:
            return None
        if self.shards is not None and self.shards.scatters():
            return None  # stage 2 reduce-scatters the gradient in one piece
        if self._ranges is None:
            self._ranges = [] if self.engine.grad_view().is_cuda else self.engine.buckets(self.bucket_bytes)
        return self._ranges if len(self._ranges) > 1 else None

    def _reset_buckets(self) -> None:
        self._started, self._ready, self._next, self._start_error = [], set(), 0, None

    def _bucket_ready(self, k: int) -> None:  # called from backward (a hook): never raise into autograd
        self._ready.add(k)
        self._start_ready(len(self._ranges) - 1)

    def _start_ready(self, upto: int) -> None:
        """Start buckets ``_next .. upto - 1`` in order, as far as they are ready."""
        grad, group = self.engine.grad_view(), self.membership.group
        while self._next < upto and self._next in self._ready and self._start_error is None:
            lo, hi = self._ranges[self._next]
            try:
                self._started.append(group.allreduce_start(grad[lo:hi]))
            except protocol.CommError as exc:
                self._start_error = exc
                return
            self._next += 1

    def _reduce_buckets(self, r, grad, ranges: List[Tuple[int, int]], votes: List[float],
                        buffers) -> None:
        """Start what backward did not (every bucket on an engine without backward hooks, TensorFlow's;
        unused parameters; an empty share), then the last bucket (the first parameters, which backward
        finishes last) with the votes and buffers folded in; ``finish_reduce`` waits for them all."""
        import torch

        try:
            self.engine.arm(ranges, None)
            last = len(ranges) - 1
            self._ready.update(range(last))
            self._start_ready(last)
            if self._start_error is not None:
                raise self._start_error
            lo, hi = ranges[last]
            parts = [grad[lo:hi], torch.tensor(votes, dtype=grad.dtype)]
            if buffers is not None:
                parts.append(torch.from_numpy(buffers).to(grad.dtype))
            buf = torch.cat(parts)  # a copy of the bucket: the votes ride in it, not in a round trip of their own
            r.works += self._started
            r.works.append(self.membership.group.allreduce_start(buf))
        finally:
            self._reset_buckets()
        r.copy_back = (grad[lo:hi], buf[:hi - lo])
        r.tail = buf[hi - lo:]

