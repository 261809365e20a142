"""What the replica's calls return: the members' agreement at a step boundary (``Agreed``), a step's reduction in
flight (``Reduction``), how a worker entered the job (``Joined``) and what a recovery did (``Recovery``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, NamedTuple, Optional, Tuple

import numpy as np


class Agreed(NamedTuple):
    """What every member decided at a step boundary (the same everywhere: they summed the same votes)."""
    membership: bool = False   # a newer generation is published: regroup now
    interrupt: bool = False    # some member was asked to stop (Ctrl-C, SIGUSR1): checkpoint and exit
    agent_lost: bool = False   # some member lost the agent: checkpoint and exit
    finish: bool = False       # some member's rank-0 callback asked to stop (train/callbacks.py): finish the run


def agreed(summed: Any, generation: int, world: int) -> Agreed:
    """What the ``world`` members of ``generation`` agreed, from the sums of their ``Replica.votes``."""
    return Agreed(summed[0] != generation * world, summed[1] > 0, summed[2] > 0, summed[3] > 0)


@dataclass
class Reduction:
    """A step's reduction between ``Replica.start_reduce`` and ``finish_reduce``."""
    result: Optional[Tuple[List[float], Agreed, Optional[np.ndarray]]] = None  # known at once (world 1)
    generation: int = 0
    world: int = 1
    n: int = 0                       # votes: the scalars, then four flags
    k: int = 0                       # scalars
    buffers: bool = False            # the buffers' contributions follow the votes in ``tail``
    tail: Any = None                 # reduced votes (and buffers) once finished
    works: List[Any] = field(default_factory=list)  # collectives in flight, waited for in order
    copy_back: Any = None            # (gradient, its reduced copy) when the fold could not reduce it in place
    mine: Any = None                 # stage 2 (trainer.shard=gradients): the reduce-scatter's output
    push: Any = None                 # parameter servers: the gradient, pushed before the votes' sum


@dataclass
class Joined:
    """How a worker entered the job (the trainer logs it when the worker joined a running job)."""
    generation: int
    world: int
    admit_s: float      # from asking to join until the agent admitted this worker
    rebuild_s: float    # from admission until the group of the first generation was built
    transfer_s: float   # receiving the state from the most advanced member
    state_received: bool
    failure: Optional[str] = None  # what failed in the first state sync (then ``recover`` follows), else None


@dataclass
class Recovery:
    """What a recovery did; ``stop`` says why the worker must now stop (None: train on).

    ``stop`` is one of ``"below_min"`` (the agent stopped the job: fewer than launcher.min_workers),
    ``"agent_lost"`` (the store stopped answering), ``"removed"`` (the agent retired this worker) or
    ``"cut_out"`` (the agent cut it out: silent past elastic.heartbeat_timeout_s, e.g. its host was cut off).
    """
    previous_generation: int
    previous_world: int
    rolled_forward: bool       # a member had committed the failed step; the rest adopted its state
    recovery_s: float          # from the call until the state is in sync (every attempt) ...
    transfer_s: float = 0.0    # ... of which comparing progress and sending the state (sync_state)
    stop: Optional[str] = None
    stop_reason: str = ""
    committed: bool = False    # trainer.shard: the failed attempt had committed its step (its allgather failed)
