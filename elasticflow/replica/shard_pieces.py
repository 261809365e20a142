"""What a checkpoint takes from ``ShardedState``: how its tensors split by owner (``sharding``) and this worker's
own pieces of them (``partials``). A mixin: it reads the state's ``n``, ``world``, ``rank``, ``held``, ``params``,
``param_at``, ``slot_names``, ``paged``, ``frozen`` and, for parameter servers, ``layout``.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

from ..checkpoint.format import Partial, Sharded
from .shard_plan import owned


class CheckpointPieces:
    """``ShardedState``'s side of a checkpoint: each owner writes its own range, nothing is gathered."""

    def sharding(self) -> Sharded:
        """How a checkpoint splits the optimizer's tensors: each owner writes its own range."""
        names = {f"optimizer/{p}/{s}": at for p, (at, _) in self.param_at.items() for s in self.slot_names}
        if self.paged is not None:  # stage 3: the parameters too (no worker holds them whole)
            names.update((p, at) for p, (at, _) in self.param_at.items())
        if self.serves():  # the primaries write their shards; the trainers and standbys nothing
            return Sharded(self.n, names, self.layout.holders[:self.layout.shards])
        return Sharded(self.n, names, frozen=None if self.frozen is None else self.frozen.sharding())

    def sharded_names(self) -> set:
        """The state's names that travel with the ranges at a membership change, not in a state transfer."""
        return {*self.param_at, *(self.frozen.param_at if self.frozen is not None else ())}

    def partials(self) -> Dict[str, Partial]:
        """This worker's own range of every slot tensor, by name (views: read them before the next step); with
        stage 3 of the parameters and the frozen parameters too."""
        frozen = {} if self.frozen is None else self.frozen.partials()
        return {**self._own_partials(), **frozen}

    def _own_partials(self) -> Dict[str, Partial]:
        lo, hi = owned(self.n, self.world, self.rank)
        if self.serves():
            lo, hi = owned(self.n, self.layout.shards, self.layout.holders.index(self.rank)) \
                if self.layout.is_primary(self.rank) else (0, 0)
        found = next(((r, v) for r, v in self.held.items() if r[0] <= lo and hi <= r[1]), None)
        if hi <= lo or found is None:  # none of its own (a trainer; a range lost, before the fallback's load)
            empty = {p: Partial(np.zeros(0, np.float32), 0, shape) for p, (_, shape) in self.param_at.items()}
            return {**({} if self.paged is None else empty),
                    **{f"optimizer/{p}/{s}": v for p, v in empty.items() for s in self.slot_names}}
        (a, _), slots = found
        out: Dict[str, Partial] = {}
        for p, (at, shape) in self.param_at.items():
            if self.paged is not None:  # stage 3: the parameters' own range too
                out[p] = own_piece(self.params, lo, hi, at, shape)
            for s in self.slot_names:
                out[f"optimizer/{p}/{s}"] = own_piece(slots[s], lo, hi, at, shape, base=a)
        return out


def own_piece(vector: Any, lo: int, hi: int, at: int, shape: Tuple[int, ...], base: int = 0) -> Partial:
    """Elements [lo, hi) of a flat vector that lie in the tensor at offset ``at`` of ``shape``, as that tensor's
    ``Partial`` (a view: read it before the next step); ``vector`` holds the flat vector's elements from ``base``."""
    start, end = max(lo, at), min(hi, at + int(np.prod(shape, dtype=np.int64)))
    if end <= start:
        return Partial(np.zeros(0, np.float32), 0, shape)
    # .cpu(): a GPU's copied to the host (on the host, the view itself)
    return Partial(vector[start - base:end - base].detach().cpu().numpy(), start - at, shape)
