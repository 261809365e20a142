"""Silent corruption (``elastic.fingerprint``; docs/elastic-training.md#silent-corruption): replicas that should
hold the same bits, compared every step.

Data-parallel members apply the same summed gradient to the same parameters, so their parameters are the same
bits after every step (topology=local_sgd|diloco aside: their replicas differ between rounds by design). A bit
flipped in one member's memory would go unseen: the job trains on diverged replicas, and its checkpoints hold
whichever rank wrote each shard. So every step each member adds a checksum of its whole flat parameter vector
and of a quarter of each optimizer slot (a different quarter each step: every byte every ``TURNS`` steps; the 32-bit
words summed modulo the prime 2^31 - 1: any one flipped bit changes it) to its slots of the step's
reduction, before the update, in two 16-bit halves (the step's scalars may travel in float32, exact only below
2^24: a whole checksum there hid a flip of a low bit), and every member reads all of them:

- all equal: nothing happens (the cost: one integer sum over the parameters, ~1 ms per 2M on a CPU core);
- a strict majority agrees: each odd member leaves (exit code ``protocol.EXIT_CORRUPT``), the others regroup
  without it and redo the step (its gradient was computed from corrupted parameters), and a replacement joins
  with the majority's state where ``launcher.restart_failed`` is set (the join path). A ``corruption`` event
  names the rank, the worker, the tensor (a second, per-tensor comparison) and the step;
- no majority (two members, or a tie): nobody can tell which is right, so every member falls back to the newest
  checkpoint saved before the last step on which all agreed, and the steps since are redone.

Sharded state (``trainer.shard``; ``Fingerprints.held``): under stages 1 and 2 the parameters are whole on every
member at a step's start, so they are compared as above; each range of the optimizer state (and under stage 3,
of the parameters too) is held twice, by its owner and by the next rank (its buddy, ``elastic.shard_replicas=1``),
and the two copies are compared. Two copies have no majority: a mismatch falls back to the checkpoint. This
holds because a buddy's copy is computed from its owner's sums (shard_scatter.py). Not compared:
topology=parameter_server's aggregators' shards, TensorFlow's optimizer slots (not flat) and the buffers.

`elasticflow inject RUN --bitflip R [--bit B] [--tensor NAME]` flips one bit of a parameter or an optimizer slot
in that rank's replica (``Flips``, read at a step like ``--slow``), to rehearse this.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._util.fileio import append_event
from ..distributed import protocol
from ..distributed.agent.inject import flip_key
from ..errors import ElasticFlowError

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
    majority agrees (else nobody can tell which is right); ``copies``: the owners whose range's two copies differ
    (sharded state), empty where the parameters did."""

    def __init__(self, odd: List[int], majority: bool, copies: Sequence[int] = ()):
        self.odd, self.majority, self.copies = odd, majority, list(copies)


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


def compare_copies(own: Sequence[int], buddy: Sequence[int]) -> Optional[Verdict]:
    """Each owner's checksum of its range (``own``, by rank) against its buddy's copy (``buddy[r + 1]``: rank r + 1
    holds rank r's range): None when every pair reported agrees. Two copies: no majority."""
    world = len(own)
    owners = [r for r in range(world) if world > 1 and own[r] and buddy[(r + 1) % world]
              and own[r] != buddy[(r + 1) % world]]
    if not owners:
        return None
    return Verdict(sorted({x for r in owners for x in (r, (r + 1) % world)}), False, owners)


def spans(layout: Sequence[Tuple[str, Tuple[int, ...]]]) -> Dict[str, Tuple[int, int]]:
    """Each tensor's [start, end) in the flat vector ``layout`` (the engine's ``flat_layout``) describes."""
    out, at = {}, 0
    for name, shape in layout:
        n = int(np.prod(shape, dtype=np.int64))  # a scalar's () is 1
        out[name], at = (at, at + n), at + n
    return out


class Fingerprints:
    """This member's fingerprints for a step (``WIDTH`` checksums, sent as ``halves``) and the step's verdict.

    Args:
        engine: the backend engine (``flat_params``); shards: the ``ShardedState`` under trainer.shard, else None.
    """

    WIDTH = 3  # checksums per member: its parameters, its own range's copy, its copy of its buddy's range
    TURNS = 4  # replicated optimizer slots: a quarter of each a step, every byte every 4 steps (a quarter's cost)

    def __init__(self, engine: Any, shards: Any):
        self.engine, self.shards = engine, shards
        # Stage 3 holds no whole vector: only its ranges' copies are compared
        self.whole = shards is None or shards.paged is None

    def slots(self, step: int) -> List[float]:
        """This member's ``2 * WIDTH`` numbers of the step's sums (``step``: the committed steps, which picks the
        slots' quarter): each checksum's ``halves`` (0, 0: none)."""
        sums = [self._whole(step) if self.whole else 0, *self.held()]
        return [x for v in sums for x in (halves(v) if v else (0, 0))]

    def _quarter(self, n: int, step: int) -> Tuple[int, int]:
        part = -(-n // self.TURNS)
        return step % self.TURNS * part, min(n, (step % self.TURNS + 1) * part)

    def _whole(self, step: int) -> int:
        """The parameters' checksum and this step's quarter of each replicated slot's (a sum per buffer: per
        tensor would cost a call per tensor, ``tensor_sums`` does that only once they differed)."""
        total = checksum(self.engine.flat_params())
        for _, values in sorted(self.engine.flat_slots().items()):
            lo, hi = self._quarter(int(values.numel()), step)
            total += checksum(values[lo:hi])
        return total % PRIME + 1

    def tensor_sums(self, step: int) -> Tuple[List[str], List[int]]:
        """The whole check's parts, tensor by tensor: each parameter's checksum, then (replicated state) each
        slot's this step's quarter, cut by tensor (``optimizer/<tensor>/<slot>``)."""
        flat, where = self.engine.flat_params(), spans(self.engine.flat_layout())
        names, sums = list(where), [checksum(flat[lo:hi]) for lo, hi in where.values()]
        for slot, values in sorted(self.engine.flat_slots().items()):
            lo, hi = self._quarter(int(values.numel()), step)
            for name, (a, b) in where.items():
                if max(a, lo) < min(b, hi):
                    names.append(f"optimizer/{name}/{slot}")
                    sums.append(checksum(values[max(a, lo):min(b, hi)]))
        return names, sums

    def held(self) -> Tuple[int, int]:
        """Checksums of this member's own range and of its copy of the previous rank's (its buddy's): the optimizer
        slots, and under stage 3 the parameters of the range too. (0, 0) where no range is held twice."""
        sh = self.shards
        if sh is None or sh.serves() or not sh.replicas or sh.world < 2:
            return 0, 0
        from ..replica.shard_plan import owned

        return tuple(self._range(*owned(sh.n, sh.world, r)) for r in (sh.rank, (sh.rank - 1) % sh.world))

    def _range(self, lo: int, hi: int) -> int:
        sh, total = self.shards, 0
        for (a, b), slots in sh.held.items():
            if a <= lo and hi <= b:
                for name in sorted(slots):
                    total += checksum(slots[name][lo - a:hi - a])
                break
        if sh.paged is not None:
            total += checksum(sh.params[lo:hi])
        return total % PRIME + 1

    def compare(self, prints: Sequence[float], world: int) -> Optional[Verdict]:
        """The step's verdict from every member's ``slots`` (``prints``, member by member): the parameters by
        majority, then each range's two copies."""
        rows = np.asarray(prints, dtype=np.float64).reshape(world, 2 * self.WIDTH)
        sums = [joined(rows[:, 2 * i:2 * i + 2].reshape(-1)) for i in range(self.WIDTH)]
        return compare(sums[0]) or compare_copies(sums[1], sums[2])


    def act(self, verdict: Verdict, rank: int, world: int, step: int, replica: Any, step_log: Any) -> None:
        """The members' state differs (``verdict``, the same on every member) at optimizer step ``step + 1``: which
        tensor (every member's ``tensor_sums``, a second sum), an event by the first member that agrees with the
        majority, then the odd members leave and the others redo the step without them (a failed step's path), or
        with no majority all fall back to a checkpoint (``replica.diverged``, read by regroup.fall_back)."""
        sane, names = [r for r in range(world) if r not in verdict.odd], []
        if sane and not verdict.copies:  # the same on every member, as is the verdict: all enter this sum or none
            tensors, sums = self.tensor_sums(step)
            rows = np.zeros(world * len(tensors))
            rows[rank * len(tensors):(rank + 1) * len(tensors)] = sums
            table = np.asarray(replica.reduce_sum(rows.tolist())).reshape(world, len(tensors))
            names = sorted({tensors[t] for r in verdict.odd for t in range(len(tensors))
                            if table[r, t] != table[sane[0], t]})
        workers = replica.data_workers
        odd = ", ".join(f"{r} (worker {workers[r]})" for r in verdict.odd)
        held = "optimizer state" if self.whole else "parameters and optimizer state"
        which = "optimizer state" if names and all(n.startswith("optimizer/") for n in names) else "parameters"
        what = (f"the {which} of rank(s) {odd} differ from the majority's at step {step + 1}"
                + (f" (tensor {', '.join(names)})" if names else "") if verdict.majority else
                f"the two copies of rank(s) {verdict.copies}'s range of the {held} differ at step {step + 1} "
                f"(held by ranks {odd}: no majority)" if verdict.copies else
                f"the members' parameters differ at step {step + 1} with no majority (ranks {odd})")
        if rank == (sane[0] if sane else 0):
            log.warning("silent corruption: %s: %s", what, "the odd member(s) leave and the step is redone"
                        if verdict.majority else "every member falls back to the last checkpoint they agreed on")
            step_log.run_log.event("corruption", step=step + 1, ranks=verdict.odd,
                                   workers=[workers[r] for r in verdict.odd], tensors=names, copies=verdict.copies,
                                   action="evict" if verdict.majority else "fall_back")
        if rank in verdict.odd and verdict.majority:
            step_log.flush()
            raise ElasticFlowError(f"evicted: {what}", "a replacement joins with the majority's state where "
                                   "launcher.restart_failed=true", exit_code=protocol.EXIT_CORRUPT)
        if not verdict.majority:  # the newest checkpoint before the last step all agreed on (regroup.fall_back)
            replica.diverged = (what, step - 1)
        raise protocol.CommError(f"silent corruption: {what}")


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

    def flip(self, engine: Any, shards: Any, record: dict, rank: int, step: int) -> None:
        """Flip bit ``record['bit']`` of the first element this member holds of ``record['tensor']``, in place: a
        parameter ('' : the first held), or an optimizer slot as ``optimizer/<parameter>/<slot>`` (a sharded slot in
        this member's own range first, then its buddy copy). ``shards``: the ``ShardedState``, else None."""
        import torch

        where = spans(engine.flat_layout())
        n = sum(b - a for a, b in where.values())
        name = record.get("tensor") or ""
        param, slot = (name[len("optimizer/"):].rsplit("/", 1) + [""])[:2] if name.startswith("optimizer/") else (
            name, None)
        # (lo, hi, the vector holding [lo, hi), the flat index of its element 0): own range first
        order = [] if shards is None else sorted(shards.held, key=lambda r: r != shards.own_range())
        if slot is None:
            paged = shards is not None and shards.paged is not None
            places = [(a, b, engine.flat_params(), 0) for a, b in (order if paged else [(0, n)])]
        elif shards is None:
            places = [(0, n, v, 0) for v in [engine.flat_slots().get(slot)] if v is not None]
        else:
            places = [(a, b, shards.held[(a, b)][slot], a) for a, b in order if slot in shards.held[(a, b)]]
        param = param or next((t for t, (a, b) in where.items() for lo, hi, _, _ in places[:1]
                               if max(a, lo) < min(b, hi)), "")
        span = where.get(param)
        hit = next(((max(span[0], lo), vec, base) for lo, hi, vec, base in places
                    if span and max(span[0], lo) < min(span[1], hi)), None)
        if hit is None:
            log.warning("inject: nothing named %r to flip a bit of on rank %d (a parameter such as %s, or "
                        "optimizer/<parameter>/<slot>; under trainer.shard a range this rank holds)", name, rank,
                        ", ".join(list(where)[:4]))
            return
        at, vec, base = hit
        bit, label = int(record.get("bit", 22)), param if slot is None else f"optimizer/{param}/{slot}"
        before = float(vec[at - base])
        vec.view(torch.int32)[at - base] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
        after, element = float(vec[at - base]), at - span[0]
        if slot is None:
            engine.params_written()
        log.warning("inject: flipped bit %d of %s[%d] on worker %s (rank %d): %r -> %r", bit, label, element,
                    self.m.worker_id, rank, before, after)
        events = getattr(self.m, "events", None)
        if events is not None:
            append_event(events, "bitflip", "worker", worker=self.m.worker_id, rank=rank, step=step + 1, tensor=label,
                         element=element, bit=bit, before=before, after=after)
