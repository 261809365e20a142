"""Silent corruption (``elastic.fingerprint``; docs/elastic-training.md#silent-corruption): replicas that should
hold the same bits, compared every step.

Data-parallel members apply the same summed gradient to the same parameters, so their parameters are the same
bits after every step (topology=local_sgd|diloco aside: their replicas differ between rounds by design). A bit
flipped in one member's memory would go unseen: the job trains on diverged replicas, and its checkpoints hold
whichever rank wrote each shard. So every step each member adds a checksum of its whole flat parameter vector
(the 32-bit words summed modulo the prime 2^31 - 1: any one flipped bit changes it) to its slots of the step's
reduction, before the update, in two 16-bit halves (the step's scalars may travel in float32, exact only below
2^24: a whole checksum there hid a flip of a low bit), and every member reads all of them:

- all equal: nothing happens (the cost: one integer sum over the parameters, ~1 ms per 2M on a CPU core);
- a strict majority agrees: each odd member leaves (exit code ``protocol.EXIT_CORRUPT``), the others regroup
  without it and redo the step (its gradient was computed from corrupted parameters), and a replacement joins
  with the majority's state where ``launcher.restart_failed`` is set (the join path). A ``corruption`` event
  names the rank, the worker, the tensor (a second, per-tensor comparison) and the step;
- no majority (two members, or a tie): nobody can tell which is right, so every member falls back to the newest
  checkpoint saved before the last step on which all agreed, and the steps since are redone.

Only with replicated state (trainer.shard=none). Sharded state is not compared: stage 3 holds no whole vector,
and under stages 1 and 2 with 2 members (each then holding every range, its own and its buddy's) a member
computes its buddy's range from sums that round differently from the owner's, so the replicas differ in the
last bits after such a regroup (measured: tests/test_shard.py's kill at step 23 of 3 workers, the two survivors'
checksums differed from step 24 on; the model stays within float32 rounding of the 1-worker one). The optimizer
state and the buffers are not compared either.

`elasticflow inject RUN --bitflip R [--bit B] [--tensor NAME]` flips one bit of one parameter in that rank's
replica (``Flips``, read at a step like ``--slow``), to rehearse this.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._util.fileio import append_event
from ..distributed import protocol
from ..distributed.agent.inject import flip_key

log = logging.getLogger("elasticflow")
PRIME = (1 << 31) - 1  # 2^b mod PRIME is never 0: a flip of any bit of a 32-bit word moves the sum


def halves(value: int) -> Tuple[int, int]:
    """A checksum as two numbers float32 holds exactly (the step's scalars may travel in float32): its high 16 bits
    plus 1 (0 stays "no report") and its low 16."""
    return (value >> 16) + 1, value & 0xFFFF


def joined(slots: Sequence[float]) -> List[int]:
    """Each member's checksum from its two ``halves`` (0: a member that reported none)."""
    return [int(hi - 1) * 65536 + int(lo) if hi else 0 for hi, lo in zip(slots[0::2], slots[1::2])]


def checksum(flat: Any) -> int:
    """The 32-bit words of ``flat`` (a float32 torch tensor) summed, modulo PRIME, plus 1 (0 is "no report")."""
    import torch

    return int(flat.view(torch.int32).sum(dtype=torch.int64)) % PRIME + 1


class Verdict:
    """A step's fingerprints disagree. ``odd``: the ranks off the majority's value; ``majority``: whether a strict
    majority agrees (else nobody can tell which is right)."""

    def __init__(self, odd: List[int], majority: bool):
        self.odd, self.majority = odd, majority


def compare(prints: Sequence[float]) -> Optional[Verdict]:
    """The members' fingerprints (0: a member that reports none) compared: None when all reported agree."""
    got = {r: int(v) for r, v in enumerate(prints) if v}
    values = sorted(set(got.values()))
    if len(values) <= 1:
        return None
    counts = {v: sum(1 for x in got.values() if x == v) for v in values}
    best = max(values, key=lambda v: counts[v])
    majority = counts[best] * 2 > len(got)
    return Verdict([r for r, v in got.items() if v != best] if majority else sorted(got), majority)


def spans(layout: Sequence[Tuple[str, Tuple[int, ...]]]) -> Dict[str, Tuple[int, int]]:
    """Each tensor's [start, end) in the flat vector ``layout`` (the engine's ``flat_layout``) describes."""
    out, at = {}, 0
    for name, shape in layout:
        n = int(np.prod(shape, dtype=np.int64))  # a scalar's () is 1
        out[name], at = (at, at + n), at + n
    return out


def tensors_of(flat: Any, layout: Sequence[Tuple[str, Tuple[int, ...]]]) -> List[int]:
    """A checksum per tensor of ``layout`` (the flat order): which tensor differs, once the whole vector did."""
    return [checksum(flat[lo:hi]) for lo, hi in spans(layout).values()]


class Flips:
    """`elasticflow inject --bitflip`: at a step, flip the bit the agent's sealed record ``worker/<id>/flip`` names.
    ``drills``: the worker's ``slowdown.Drills`` (read when it says a drill was asked)."""

    def __init__(self, membership: Any, drills: Any):
        self.m, self.drills, self.version, self.nonce = membership, drills, 0, None

    def due(self) -> Optional[dict]:
        """The flip asked for since the last one, if any."""
        if self.drills.changes == self.version:
            return None
        self.version, m = self.drills.changes, self.m
        try:
            record = protocol.fetch_json(m.store, m.sealer, flip_key(m.worker_id), "bitflip")
        except Exception:  # noqa: BLE001 - the agent is gone: the membership's own calls say so
            return None
        if record is None or record.get("nonce") == self.nonce:
            return None
        self.nonce = record.get("nonce")
        return record

    def flip(self, engine: Any, record: dict, rank: int, step: int) -> None:
        """Flip bit ``record['bit']`` of element 0 of parameter ``record['tensor']`` ('' : the first) in place."""
        where = spans(engine.flat_layout())
        name = record.get("tensor") or next(iter(where))
        if name not in where:
            log.warning("inject: no parameter %r to flip a bit of (the parameters: %s)", name,
                        ", ".join(list(where)[:8]))
            return
        import torch

        at = where[name][0]
        flat, bit = engine.flat_params(), int(record.get("bit", 22))
        words = flat.view(torch.int32)
        before = float(flat[at])
        words[at] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
        engine.params_written()
        log.warning("inject: flipped bit %d of %s[0] on worker %s (rank %d): %r -> %r", bit, name, self.m.worker_id,
                    rank, before, float(flat[at]))
        events = getattr(self.m, "events", None)
        if events is not None:
            append_event(events, "bitflip", "worker", worker=self.m.worker_id, rank=rank, step=step + 1, tensor=name,
                         bit=bit, before=before, after=float(flat[at]))
