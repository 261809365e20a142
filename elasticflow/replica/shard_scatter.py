"""Stage 2's step (``trainer.shard=gradients``): the gradient reduce-scattered, each member receiving the sums of
its own chunk and its buddy's. A mixin of ``ShardedState``: it reads the state's ``n``, ``world``, ``rank``,
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

        ``tail`` (float32, small gradients): folded in, so one collective does it all: piece r is
        [chunk r | chunk r - 1 | tail], and each member receives its own chunk, its buddy's and the
        summed tail (the votes); this costs a copy of the gradient into the pieces, which a small model
        pays gladly for the round trips it saves (each is a scheduling of every member). Without
        ``tail`` the pieces are the gradient's own chunks (no copy) and the buddy's chunk travels after.
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
            width = c * (2 if self.replicas else 1) + tail.numel()
            pieces = [self._buffer(f"piece{r}", width) for r in range(w)]
            for r, piece in enumerate(pieces):
                self._chunk_into(piece[:c], grad, r)
                if self.replicas:
                    self._chunk_into(piece[c:2 * c], grad, (r - 1) % w)
                piece[width - tail.numel():].copy_(tail)
            out = self._buffer("out", width)
        return group.reduce_scatter_start(pieces, out), (out, tail is not None)

    def finish_reduce_scatter(self, group: Any, started: Any) -> Optional[torch.Tensor]:
        """Stage 2, once the reduce-scatter finished: this step's reduced ranges (own, buddy's). Unfolded,
        the own chunk goes to the buddy and the previous rank's comes in; folded, returns the summed tail."""
        out, folded = started
        c = chunk(self.n, self.world)
        own = owned(self.n, self.world, self.rank)
        self.reduced = {own: out[:own[1] - own[0]]}
        if not (self.replicas and self.world > 1):
            return out[c:] if folded else None
        prev = owned(self.n, self.world, (self.rank - 1) % self.world)
        if folded:
            self.reduced[prev] = out[c:c + prev[1] - prev[0]]
            return out[2 * c:]
        theirs = self._buffer("buddy", c)[:prev[1] - prev[0]]
        group.exchange([(self.reduced[own], (self.rank + 1) % self.world, 0)],
                       [(theirs, (self.rank - 1) % self.world, 0)])
        self.reduced[prev] = theirs
        return None

    def _buffer(self, what: str, size: int) -> torch.Tensor:
        """A float32 scratch of ``size`` kept from step to step (a fresh one would fault its pages in)."""
        t = self._buffers.get(what)
        if t is None or t.numel() != size:
            t = self._buffers[what] = torch.empty(size, dtype=torch.float32, device=self.device)
        return t
