"""One worker's replica of the training state, kept identical to every other member's through failures.

The trainer calls in; the replica never calls back (torchft's Manager is the model): it is built from
the membership, the engine and two accessors of the state, and returns what happened.

- ``reduce_step``: the per-step reduction, one allreduce: the gradient (one flat buffer) followed by
  the loss, the metrics, three agreement flags and the buffers' contributions, so every member decides the same thing at the
  same step: a newer generation is waiting, a stop was asked (Ctrl-C, SIGUSR1), the agent is gone.
  With ``comm.bucket_mb`` the gradient goes in buckets instead, each started during backward
  (``begin_backward``; on TensorFlow, all as soon as the gradient is complete), the last one carrying
  the scalars and flags. Which collectives a step takes is the replica's ``StepReduction``'s
  (``step_reduction.py``); the replica adds the votes and the single-member case.
- ``recover``: after a failed collective, drop the group, enter the agent's next generation and
  ``sync_state``: the members compare how many samples each has committed, and if one is ahead
  (it finished the step's reduction before the peer died) its full state is sent to the members
  behind. So no member diverges and at most one step is redone.

A single-process run has a replica too (no membership, world 1): every call is then a no-op, and the
trainer has one code path.

With ``trainer.shard`` the replica also drives the sharded optimizer state (``shard.ShardedState``): the
update of the ranges this member holds (``update``), the parameters' allgather (``gather``), stage 2's
reduce-scatter, and the redistribution of the ranges at every membership change (``sync_state``; a
retiring member hands its ranges over first, ``shard_handover.py``; members one step behind first roll
forward with the step a member ahead kept, ``shard.ShardedState.keep_step``). When a range has no holder
left, ``lost`` says which and the trainer falls back to the newest checkpoint.

With ``topology=parameter_server`` the sharded state is the aggregators' shards (``replica/parameter_server.py``): the step's
gradient is pushed to them before the votes' sum, the trainers alone consume data (``data_rank``), and each
member publishes its role so that a scale-down retires trainers first.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from .._util.envnames import ENV_DEBUG
from .outcomes import Agreed, Joined, Recovery, Reduction, agreed
from .exact_sum import ReproducibleSum
from .shard_handover import hand_over, redistribute
from .step_reduction import StepReduction
from ..distributed import protocol

log = logging.getLogger("elasticflow")

StateDict = Callable[[], Tuple[Dict[str, Any], Dict[str, Any]]]   # () -> (arrays by name, progress)
LoadStateDict = Callable[[Dict[str, Any], Dict[str, Any]], None]  # (arrays, progress) -> None


class Replica:
    """This worker's place in the group: reductions, state sync, recovery.

    Args:
        membership: a ``distributed.membership.membership.Membership``; None for a single-process run.
        engine: the backend Engine (its flat gradient is what ``reduce_step`` sums).
        state_dict: returns (arrays, progress) of this replica: the engine's state and the TrainState.
        load_state_dict: takes (arrays, progress) from the most advanced member.
    """

    def __init__(self, membership: Any, engine: Any, state_dict: StateDict, load_state_dict: LoadStateDict,
                 bucket_mb: Optional[float] = None, shards: Any = None):
        self.membership, self.engine = membership, engine
        self.shards = shards                 # a shard.ShardedState with trainer.shard, else None
        self.lost: List[Tuple[int, int]] = []  # ranges the last redistribution found no holder for
        # (what, newest step to trust) when the members' parameters differed with no majority (train/fingerprint.py)
        self.diverged: Optional[Tuple[str, int]] = None
        self.shard_moved = 0                   # elements of sharded state the last redistribution sent
        self.finish_asked = False              # a rank-0 callback's stop, voted in the next step's reduction
        self.state_dict, self.load_state_dict = state_dict, load_state_dict
        self.reduction = StepReduction(engine, shards, bucket_mb)  # the step's collectives, its buckets

    @property
    def rank(self) -> int:
        m = self.membership
        if m is None:
            return 0
        return m.rank if m.generation >= 0 else -1  # no rank before entering a generation: never logs

    @property
    def world(self) -> int:
        return 1 if self.membership is None else self.membership.world

    @property
    def generation(self) -> int:
        return 0 if self.membership is None else max(0, self.membership.generation)

    @property
    def worker_id(self) -> Optional[int]:
        return None if self.membership is None else self.membership.worker_id

    @property
    def data_rank(self) -> Optional[int]:
        """This member's place among the members that consume data: its rank, but for parameter servers
        its place among the trainers (None: an aggregator, which consumes none)."""
        if self.shards is None or not self.shards.serves():
            return self.rank
        trainers = self.shards.layout.trainers
        return trainers.index(self.rank) if self.rank in trainers else None

    @property
    def data_world(self) -> int:
        """How many members consume data (``data_rank``)."""
        return self.world if self.shards is None or not self.shards.serves() else len(self.shards.layout.trainers)

    @property
    def data_workers(self) -> List[Optional[int]]:
        """The worker id of each ``data_rank`` (None: one worker in-process)."""
        if self.membership is None:
            return [None]
        members = self.membership.members
        if self.shards is None or not self.shards.serves():
            return list(members)
        return [members[r] for r in self.shards.layout.trainers]

    def sharding(self) -> Any:
        """How a checkpoint splits the sharded tensors (``checkpoint.format.Sharded``); None: replicated."""
        return None if self.shards is None else self.shards.sharding()

    def coordinated(self) -> bool:
        """Whether the members can still coordinate a save through the agent's store."""
        from ..checkpoint import store_alive

        m = self.membership
        return m is None or self.world == 1 or (not m.agent_lost and store_alive(m.store))

    # ------------------------------------------------------------------ entering the job
    def join(self, samples_seen: int) -> Optional[Joined]:
        """Ask the agent to admit this worker, enter its generation and take the most advanced state.

        ``samples_seen`` is this worker's own progress (a resumed checkpoint's). Returns None for a
        single-process run. A first sync that failed is not raised: ``Joined.failure`` says what failed, and the
        caller enters the next generation through ``recover`` as after any failed collective.
        """
        m = self.membership
        if m is None:
            return None
        ready_at = time.time()
        m.join()
        joined_at = time.time()
        moved, failure = False, None
        try:
            moved = self.sync_state(samples_seen)
        except protocol.CommError as exc:  # a member died, or a stranger held a gloo connection (issue #65)
            failure = str(exc)  # the caller regroups, as after a failed step (``recover``), outside this block
        return Joined(generation=self.generation, world=self.world, admit_s=m.admitted_at - ready_at,
                      rebuild_s=joined_at - m.admitted_at, transfer_s=time.time() - joined_at, state_received=moved,
                      failure=failure)

    # ------------------------------------------------------------------ every step
    def begin_backward(self) -> None:
        """Before this worker's last backward of the step: each gradient bucket starts its allreduce as soon
        as backward has finished it (``comm.bucket_mb``; ``bucketing.Buckets``)."""
        m = self.membership
        self.reduction.begin_backward(None if m is None else m.group, self.world)

    def reduce_step(self, scalars: List[float], interrupt: bool,
                    buffers: Optional[np.ndarray] = None) -> Tuple[List[float], Agreed, Optional[np.ndarray]]:
        """Sum the gradient, ``scalars`` and ``buffers`` (the buffers' contributions, ``buffers.Reconciler``)
        over the members, and vote on the flags.

        ``interrupt``: this worker was asked to stop. Returns (summed scalars, what all agreed, summed buffers).
        ``start_reduce`` and ``finish_reduce`` are the same in two halves, with the reduction in flight between.
        """
        return self.finish_reduce(self.start_reduce(scalars, interrupt, buffers))

    def start_reduce(self, scalars: List[float], interrupt: bool, buffers: Optional[np.ndarray] = None) -> "Reduction":
        """Start ``reduce_step``'s reduction; ``finish_reduce`` waits for it and reads the sums. In between the
        caller may do host work that touches neither the gradient nor the group (the transfer runs on gloo's
        threads, without the GIL). Host gradients only; a GPU's reduce here, at once."""
        m = self.membership
        if m is None:
            return Reduction(result=(scalars, Agreed(interrupt=interrupt, finish=self.finish_asked), buffers))
        generation = self.generation
        if self.world == 1:
            return Reduction(result=(scalars, agreed(self.votes(interrupt), generation, 1), buffers))
        return self.reduction.start(m.group, scalars + self.votes(interrupt), len(scalars), generation, self.world,
                                    buffers)

    def finish_reduce(self, r: "Reduction") -> Tuple[List[float], Agreed, Optional[np.ndarray]]:
        """Wait for ``start_reduce``'s reduction (a ``CommError`` if a member failed) and return what
        ``reduce_step`` returns."""
        if r.result is not None:
            return r.result
        return self.reduction.finish(self.membership.group, r)

    def votes(self, interrupt: bool) -> List[float]:
        """This member's votes at a step boundary, for the members to sum (``agreed`` reads the sums): the newest
        generation it has seen, whether it was asked to stop (``interrupt``), whether it lost the agent, whether a
        callback asked to finish (``finish_asked``, set by the trainer)."""
        m = self.membership
        # The poller may lag behind a generation this worker already entered through a recovery.
        return [float(max(m.latest_generation, self.generation)), float(interrupt), float(m.agent_lost),
                float(self.finish_asked)]

    # ------------------------------------------------------------------ trainer.reproducible's step
    def exact_head(self) -> int:
        """How many of the step's exact sums are the gradient's (``StepReduction.exact_head``)."""
        return self.reduction.exact_head()

    def exact_sum(self, scalars: int, buffers: int) -> ReproducibleSum:
        """The step's exact sums, cleared, laid out as ``start_exact`` reads them: the flat gradient
        (``exact_head``), ``scalars`` (loss, metrics, per-parameter flags), four votes, ``buffers``."""
        return self.reduction.exact_sums(scalars, buffers)

    def start_exact(self, sums: ReproducibleSum, scalars: int, interrupt: bool, buffers: bool) -> "Reduction":
        """``start_reduce`` over the exact sums the step filled (``exact_sum``): the votes added, summed over the
        members, the gradient written back in float32. Done at once: its result is in the returned Reduction,
        for ``finish_reduce``."""
        m = self.membership
        votes = None if m is None else self.votes(interrupt)
        tail = self.reduction.finish_exact(None if m is None else m.group, sums, scalars, votes, self.world)
        said = tail[scalars:scalars + 4].tolist()
        agreement = Agreed(interrupt=interrupt, finish=self.finish_asked) if m is None else \
            agreed(said, self.generation, self.world)
        return Reduction(result=(tail[:scalars].tolist(), agreement, tail[scalars + 4:].numpy() if buffers else None))

    # ------------------------------------------------------------------ other sums over the members
    def allreduce_exact(self, sums: ReproducibleSum) -> ReproducibleSum:
        """``sums`` (a ``ReproducibleSum``) added over the members, in place; returned."""
        if self.membership is not None and self.world > 1:
            sums.allreduce(self.membership.group)
        return sums

    def sum_exactly(self, rows: List[List[float]], width: int) -> List[float]:
        """The exact sum over the members of every row of every member (``width`` values each): the same bits
        however the rows are spread (trainer.reproducible's evaluation)."""
        sums = ReproducibleSum(width)
        sums.add_rows(np.asarray(rows, np.float64).reshape(-1, width))
        return self.allreduce_exact(sums).values().tolist()

    def reduce_sum(self, values: List[float]) -> List[float]:
        """Sum ``values`` over the members (float64)."""
        if self.membership is None or self.world == 1:
            return values
        import torch

        vec = torch.tensor(values, dtype=torch.float64)
        self.membership.group.allreduce_(vec)
        return vec.tolist()

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the members."""
        if self.membership is None or self.world == 1:
            return value
        import torch

        vec = torch.tensor([value], dtype=torch.int64)
        self.membership.group.allreduce_(vec, op="min")
        return int(vec[0])

    # ------------------------------------------------------------------ sharded state
    def update(self, lr: float, step: int, samples_seen: int, took_part: Optional[np.ndarray] = None,
               sat_out: Optional[np.ndarray] = None) -> None:
        """trainer.shard: update the ranges this member holds (no communication); ``step`` is the optimizer
        step this is (1-based), ``samples_seen`` the progress it commits; ``took_part``/``sat_out``: as
        ``Engine.apply`` takes them."""
        self.shards.update(self.engine.grad_view(), lr, step, samples_seen, took_part, sat_out)

    def gather(self) -> None:
        """trainer.shard: all-gather the owners' parameters after the step was committed (a CommError if a
        member failed: the recovery rebuilds the parameters from the ranges held)."""
        if self.membership is not None:
            self.shards.gather(self.membership.group)

    @contextlib.contextmanager
    def whole_params(self) -> Iterator[None]:
        """trainer.shard=parameters: every parameter in for the block (evaluation), given back after; a CommError
        if a member fails. Elsewhere nothing to do."""
        units = None if self.shards is None else self.shards.units
        if units is None or self.membership is None:
            yield
            return
        frozen = self.shards.frozen
        self.shards.gather_whole()
        if frozen is not None:
            frozen.gather_whole()
        units.whole = True
        try:
            yield
        finally:
            units.whole = False
            self.shards.give_back([(0, self.shards.n)])
            if frozen is not None:
                frozen.give_back([(0, frozen.n)])

    # ------------------------------------------------------------------ state
    def sync_state(self, samples_seen: int) -> bool:
        """Make every member's state equal to the most advanced member's; True if any state moved.

        ``samples_seen``: this member's committed progress, the measure of who is ahead. With sharded
        state the ranges are redistributed first (``lost`` is set if some range has no holder: then
        nothing else moves, and the caller falls back to a checkpoint).
        """
        if self.membership is None:
            return False
        if self.shards is not None:
            self.lost, self.shard_moved = redistribute(self.membership, self.shards, samples_seen, self.rank,
                                                       self.generation)
            if self.lost:
                return False
        if self.world == 1:
            return False
        import torch

        group, rank = self.membership.group, self.rank
        progress = torch.zeros(self.world, dtype=torch.float64)
        progress[rank] = samples_seen
        group.allreduce_(progress)
        best = progress.max()
        if bool((progress == best).all()):
            return False
        src = int((progress == best).nonzero()[0])
        behind = (progress < best).nonzero().flatten().tolist()
        if rank == src:
            arrays, meta = self.state_dict()
            if self.shards is not None:  # the parameters and slots moved with the ranges: the rest only
                moved = self.shards.sharded_names()
                arrays = {k: v for k, v in arrays.items() if k not in moved and not k.startswith("optimizer/")}
            group.share_state(arrays, meta, src, behind)  # views: sent before anything changes
        elif rank in behind:
            self.load_state_dict(*group.share_state({}, {}, src, behind))
        return True

    def recover(self, failure: Optional[str], samples_seen: int) -> Recovery:
        """Enter the agent's next generation: after a failed collective (``failure`` says what failed),
        or a change agreed at a step boundary (``failure`` None).

        ``samples_seen``: this worker's committed progress (a failed step committed nothing, so it is the
        same on every retry).
        """
        from ..distributed.membership.membership import AgentLost, Removed, StopRequested

        m = self.membership
        failed_at = time.time()
        # A member behind may need the step this one applied (shard_plan's note).
        committed = self.shards is not None and self.shards.keep_step()
        self.engine.zero_grad()  # a partial step's gradient is discarded
        previous_generation, previous_world = self.generation, self.world
        if failure is not None:
            m.report_failure()
        elif self.shards is not None and self.world > 1:
            hand_over(m, self.shards, self.generation, self.world, samples_seen)
        stop, stop_reason, moved, transfer_s = None, "", False, 0.0
        while True:
            try:
                try:
                    m.rebuild(after=self.generation)
                except StopRequested as exc:
                    stop, stop_reason = "below_min", exc.reason
                synced = time.time()
                try:
                    moved = self.sync_state(samples_seen)
                finally:
                    transfer_s += time.time() - synced
                break
            except protocol.CommError as exc:
                log.warning("recovery in generation %d failed (%s); waiting for the next", self.generation, exc,
                            extra={"console": os.environ.get(ENV_DEBUG) == "1"})  # gloo's text: console with --debug
                m.report_failure()
                stop, stop_reason = None, ""
            except AgentLost as exc:
                stop, stop_reason = "agent_lost", str(exc)
                break
            except Removed as exc:
                stop, stop_reason = "cut_out" if exc.cut else "removed", str(exc)
                break
        return Recovery(previous_generation=previous_generation, previous_world=previous_world,
                        rolled_forward=moved, recovery_s=time.time() - failed_at, transfer_s=transfer_s, stop=stop,
                        stop_reason=stop_reason, committed=committed)
