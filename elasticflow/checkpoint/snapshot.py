"""The snapshot of a save: this rank's slice of the state, copied into one buffer that every save
reuses. Taking it is the only part of an asynchronous save that stalls training (step 1 in save.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from .._util.fileio import aligned
from .format import Piece, take


def layout(pieces: List[Piece]) -> Tuple[List[int], int]:
    """Where each piece starts in the snapshot buffer, and the buffer's size."""
    offsets, need = [], 0
    for p in pieces:
        offsets.append(need)
        need += aligned(p.nbytes)  # each piece at a multiple of 64 bytes: a cache line, aligned for any dtype
    return offsets, need


class SnapshotBuffer:
    """One buffer, reused across saves, so that only one of them (or ``Checkpointer.reserve``) pays
    for a fresh buffer's first-touch page faults, which cost more than the copy into it.

    Note: one user at a time. The checkpointer takes a snapshot only once the previous save, whose
    writer thread reads the last one, has finished.
    """

    def __init__(self):
        self.buffer: Optional[np.ndarray] = None

    def reserve(self, need: int, touch: bool = False) -> None:
        """Make the buffer hold ``need`` bytes; a new one when it is smaller, or over twice as large
        (a slice that shrank, after a change of world size, gives the memory back).

        Args:
            touch: fault every page in now (``Checkpointer.reserve`` does, in its writer thread: numpy
                lets go of the GIL); else the first snapshot's copy does, on the training thread.
        """
        if self.buffer is None or not need <= self.buffer.nbytes <= 2 * need + (1 << 20):
            self.buffer = None  # the old one goes first: never both in memory
            buffer = np.empty(max(need, 1), np.uint8)
            if touch:
                np.copyto(buffer, 0)
            self.buffer = buffer

    def take(self, state: Dict[str, np.ndarray], pieces: List[Piece], copy: bool) -> List[np.ndarray]:
        """The 1-D arrays of ``pieces`` (file order) as they are now.

        Args:
            copy: True: copies into the buffer (``state`` holds views of live tensors); False:
                ``state`` is a private copy already, and its slices are used as they are.
        """
        if not copy:
            return [np.ascontiguousarray(take(state[p.name], p.start, p.end)) for p in pieces]
        offsets, need = layout(pieces)
        self.reserve(need)
        views = []
        for p, at in zip(pieces, offsets):
            src = take(state[p.name], p.start, p.end)  # a Partial: this rank's own slice of a sharded tensor
            dst = self.buffer[at:at + p.nbytes].view(src.dtype)
            np.copyto(dst, src)
            views.append(dst)
        return views
