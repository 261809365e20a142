"""Stage 2's step (``trainer.shard=gradients``): the gradient reduce-scattered, each member receiving the sums of
its own chunk, and its buddy's from the buddy. A mixin of ``ShardedState``: it reads the state's ``n``, ``world``, ``rank``,
``replicas``, ``device`` and ``_buffers``, and writes ``reduced``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .shard_plan import chunk, owned


class ScatteredGradient:
    """``ShardedState``'s reduce-scatter of the gradient (stage 2), and the scratch it keeps for it."""

    def _chunk_into(self, dst: torch.Tensor, grad: torch.Tensor, r: int) -> None:
        lo, hi = owned(self.n, self.world, r)
        dst[:hi - lo].copy_(grad[lo:hi])
        dst[hi - lo:].zero_()

    def start_reduce_scatter(self, group: Any, grad: torch.Tensor, tail: Optional[torch.Tensor] = None) -> Any:
        """Stage 2: start the reduce-scatter of ``grad``; ``finish_reduce_scatter`` completes it.

        ``tail`` (float32, small gradients): folded in, so one collective carries the votes too: piece r is
        [chunk r | tail], and each member receives its own chunk and the summed tail; this costs a copy of the
        gradient into the pieces, which a small model pays gladly for the round trip it saves. Without ``tail``
        the pieces are the gradient's own chunks (no copy). Either way the buddy's chunk travels after, from
        its owner (``finish_reduce_scatter``): a buddy's copy must hold its owner's bits, and a reduce-scatter
        sums each piece in an order of its own (a buddy's chunk folded in as a second piece differed from the
        owner's sums in the last bits, so after a regroup to 2 members, each holding every range, the members'
        Adam moments and then parameters differed: found by elastic.fingerprint).
        Returns (work, what ``finish_reduce_scatter`` takes).
        """
        c, w = chunk(self.n, self.world), self.world
        if tail is None:
            pieces = [grad[r * c:(r + 1) * c] for r in range(w)]
            if pieces[-1].numel() < c:  # the last chunk is short: padded in a scratch copy
                pad = self._buffer("pad", c)
                self._chunk_into(pad, grad, w - 1)
                pieces[-1] = pad
            out = self._buffer("own", c)
        else:
            width = c + tail.numel()
            pieces = [self._buffer(f"piece{r}", width) for r in range(w)]
            for r, piece in enumerate(pieces):
                self._chunk_into(piece[:c], grad, r)
                piece[c:].copy_(tail)
            out = self._buffer("out", width)
        return group.reduce_scatter_start(pieces, out), (out, tail is not None)

    def finish_reduce_scatter(self, group: Any, started: Any) -> Optional[torch.Tensor]:
        """Stage 2, once the reduce-scatter finished: this step's reduced ranges (own, buddy's): the own chunk goes
        to the buddy and the previous rank's comes in. Folded, returns the summed tail."""
        out, folded = started
        c = chunk(self.n, self.world)
        own = owned(self.n, self.world, self.rank)
        self.reduced = {own: out[:own[1] - own[0]]}
        if self.replicas and self.world > 1:
            prev = owned(self.n, self.world, (self.rank - 1) % self.world)
            theirs = self._buffer("buddy", c)[:prev[1] - prev[0]]
            group.exchange([(self.reduced[own], (self.rank + 1) % self.world, 0)],
                           [(theirs, (self.rank - 1) % self.world, 0)])
            self.reduced[prev] = theirs
        return out[c:] if folded else None

    def _buffer(self, what: str, size: int) -> torch.Tensor:
        """A float32 scratch of ``size`` kept from step to step (a fresh one would fault its pages in)."""
        t = self._buffers.get(what)
        if t is None or t.numel() != size:
            t = self._buffers[what] = torch.empty(size, dtype=torch.float32, device=self.device)
        return t
