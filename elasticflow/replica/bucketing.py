"""The step's gradient in buckets (``comm.bucket_mb``): each bucket's allreduce starts as soon as backward
has finished it, while backward goes on with the next. ``step_reduction.StepReduction`` owns one ``Buckets``; its
docstring says where they sit in the step's reduction.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ..distributed import protocol


class Buckets:
    """This worker's gradient buckets and the allreduces of the step's buckets in flight.

    Args:
        engine: the backend Engine (its flat gradient, its per-parameter ``buckets`` and backward hooks).
        bucket_bytes: the smallest bucket (``comm.bucket_mb`` in bytes); 0 reduces the gradient whole.

    The caller passes what changes with the membership (the group, the world size, whether stage 2 scatters)
    on each call: a bucket plan is the same on every member, and the in-flight state lives one step.
    """

    def __init__(self, engine: Any, bucket_bytes: int):
        self.engine, self.bucket_bytes = engine, bucket_bytes
        self.ranges: Optional[List[Tuple[int, int]]] = None  # the gradient's buckets (engine.buckets)
        self.group: Any = None               # the generation's group the step's buckets go to
        self._started: List[Any] = []        # this step's bucket allreduces, in flight
        self._ready: set = set()             # buckets whose gradients backward has finished
        self._next = 0                       # buckets are started in index order, on every member alike
        self._start_error: Optional[Exception] = None

    def begin_backward(self, group: Any, world: int, scatters: bool) -> None:
        """Before this worker's last backward of the step: from here on each gradient bucket starts its
        allreduce on ``group`` as soon as backward has finished it, while backward goes on."""
        self._reset()
        self.group = group
        ranges = self.plan(world, scatters)
        if ranges:  # TensorFlow's arm never reports: its tape has no per-variable callback
            self.engine.arm(ranges, self._bucket_ready)

    def plan(self, world: int, scatters: bool) -> Optional[List[Tuple[int, int]]]:
        """The buckets, when the step reduces in more than one (the same answer on every member: it
        depends on the model and the settings only). Host gradients only: a GPU's go over NCCL whole.
        ``world``: 1 (or no group) reduces nothing; ``scatters``: stage 2 reduce-scatters in one piece."""
        if not self.bucket_bytes or world == 1 or scatters:
            return None
        if self.ranges is None:
            self.ranges = [] if self.engine.grad_view().is_cuda else self.engine.buckets(self.bucket_bytes)
        return self.ranges if len(self.ranges) > 1 else None

    def _reset(self) -> None:
        self._started, self._ready, self._next, self._start_error = [], set(), 0, None

    def _bucket_ready(self, k: int) -> None:  # called from backward (a hook): never raise into autograd
        self._ready.add(k)
        self._start_ready(len(self.ranges) - 1)

    def _start_ready(self, upto: int) -> None:
        """Start buckets ``_next .. upto - 1`` in order, as far as they are ready."""
        grad = self.engine.grad_view()
        while self._next < upto and self._next in self._ready and self._start_error is None:
            lo, hi = self.ranges[self._next]
            try:
                self._started.append(self.group.allreduce_start(grad[lo:hi]))
            except protocol.CommError as exc:
                self._start_error = exc
                return
            self._next += 1

    def reduce(self, r, group: Any, grad, ranges: List[Tuple[int, int]], votes: List[float], buffers) -> None:
        """Start what backward did not (every bucket on an engine without backward hooks, TensorFlow's;
        unused parameters; an empty share), then the last bucket (the first parameters, which backward
        finishes last) with the votes and buffers folded in; ``Replica.finish_reduce`` waits for them all."""
        import torch

        self.group = group
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
            r.works.append(group.allreduce_start(buf))
        finally:
            self._reset()
        r.copy_back = (grad[lo:hi], buf[:hi - lo])
        r.tail = buf[hi - lo:]
