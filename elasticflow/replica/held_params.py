"""``ShardedState``'s part for ``trainer.shard=parameters`` (ZeRO stage 3): the parameters outside a member's held
ranges given back, brought in per unit (``param_units.py`` decides when), and each unit's gradient sent to its
owners. The flat vector's memory is a ``PagedVector`` (``_util/pages.py``); ``frozen_shards.py`` reuses this for
the frozen parameters' vector."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .exact_sum import ReproducibleSum
from .shard_plan import Range, chunk, covers, needed, owned


class HeldParameters:
    """``ShardedState``'s part for stage 3: the parameters outside the held ranges given back, and fetched per unit.
    Uses the state's ``n``, ``world``, ``rank``, ``replicas``, ``held``, ``group``, ``paged``, ``_fetches``,
    ``reproducible`` and ``exact``."""

    def holds_all(self) -> bool:
        return covers(list(self.held), self.n)

    def give_back(self, spans: Sequence[Range]) -> None:
        """Stage 3: return the memory of ``spans`` outside the held ranges (whole pages only; ``PagedVector``)."""
        if self.paged is None:
            return
        held = sorted(self.held)
        for lo, hi in spans:
            at = lo
            for a, b in held:
                if b <= at or a >= hi:
                    continue
                if a > at:
                    self.paged.drop(at, a)
                at = max(at, b)
            if at < hi:
                self.paged.drop(at, hi)

    def fetch(self, spans: Sequence[Range]) -> None:
        """Stage 3: bring ``spans`` of the parameters in: each owner sends its piece to every member not holding
        it, point to point. Written through the vector's alias (``PagedVector``): not an in-place change of
        the parameters autograd saved. Raises CommError when a member fails (the step is redone)."""
        if self.world == 1 or self.holds_all():
            return
        for lo, hi in spans:  # given back, a GPU's memory is unmapped: mapped (zeros) before it is written
            self.paged.ensure(lo, hi)
        group, sends, recvs = self.group, [], []
        holders = [needed(self.n, self.world, m, self.replicas) for m in range(self.world)]
        for r, a, b, tag in self._pieces(spans):
            if r == self.rank:
                sends += [(self.paged.alias[a:b], m, tag) for m in range(self.world)
                          if m != r and not any(x <= a and b <= y for x, y in holders[m])]
            elif not any(x <= a and b <= y for x, y in self.held):
                recvs.append((self.paged.alias[a:b], r, tag))
        group.exchange(sends, recvs)

    def _pieces(self, spans: Sequence[Range]) -> List[Tuple[int, int, int, int]]:
        """(owner, lo, hi, tag) of each owner's piece of each span; a tag per span, the same on every member (gloo
        matches a message by its source and tag; every member makes the same calls in the same order)."""
        out = []
        for lo, hi in spans:
            for r in range(self.world):
                a, b = owned(self.n, self.world, r)
                if min(b, hi) > max(a, lo):
                    out.append((r, max(a, lo), min(b, hi), self._fetches % (1 << 30)))
            self._fetches += 1
        return out

    def reduced_in_backward(self) -> bool:
        """Stage 3 when the step scatters: each unit's gradient went to its owners during backward."""
        return self.paged is not None and self.scatters()

    def start_step(self) -> None:
        """Stage 3: the step's sums of this member's own range (``acc``; ``exact`` under ``trainer.reproducible``)
        start at zero."""
        if self.reduced_in_backward():
            self.acc = self._buffer("own", chunk(self.n, self.world))
            if not self.reproducible:
                self.acc.zero_()
            elif self.exact is None or self.exact.n != self.acc.numel():
                self.exact = ReproducibleSum(self.acc.numel(), self.acc.device)
            else:
                self.exact.clear()

    def settle_reproducible(self) -> torch.Tensor:
        """Stage 3 under ``trainer.reproducible``: ``acc`` from the exact sums, each rounded once to float32."""
        self.exact.values_into(self.acc)
        return self.acc

    def reduce_grad(self, spans: Sequence[Range]) -> None:
        """Stage 3: this micro-batch's gradient of ``spans`` to the owners, point to point; each owner adds every
        member's piece (in rank order) into ``acc``, or, under ``trainer.reproducible``, into its exact sums (any
        order: the same bits as one worker's sums of the same micro-batches). The local gradient there is then
        given back (its pages go: backward never holds a whole gradient). Raises CommError when a member fails
        (the step is redone)."""
        grad, lo_own = self.engine.grad_view(), owned(self.n, self.world, self.rank)[0]
        for lo, hi in spans:  # a unit no forward used: its gradient's memory may be given back (read as zeros)
            self.engine.grad_in(lo, hi)
        sends, recvs, sums = [], [], []
        for r, a, b, tag in self._pieces(spans):
            if r == self.rank:
                # Fresh: freed once summed (scratch kept from unit to unit would hold W - 1 units' worth for good)
                pieces = [grad[a:b] if m == r else torch.empty(b - a, device=grad.device) for m in range(self.world)]
                recvs += [(pieces[m], m, tag) for m in range(self.world) if m != r]
                sums.append((a, b, pieces))
            else:
                sends.append((grad[a:b], r, tag))
        self.group.exchange(sends, recvs)
        for a, b, pieces in sums:
            for piece in pieces:
                if self.reproducible:
                    self.exact.add(piece, at=a - lo_own)
                else:
                    self.acc[a - lo_own:b - lo_own].add_(piece)
        for lo, hi in spans:
            self.engine.zero_grad_range(lo, hi)

    def gather_whole(self) -> None:
        """Stage 3: every parameter in (evaluation); ``give_back([(0, n)])`` returns them."""
        if self.world > 1 and not self.holds_all():
            self.paged.ensure(0, self.n)
            self.group.allgather_flat(self.paged.alias, chunk(self.n, self.world))
