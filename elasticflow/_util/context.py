"""``elasticflow.context()``: where this process is in training, for data sources and hooks.

Its own module (not named context.py: that would shadow the function ``elasticflow.context``), below
``state`` and ``data``: both the trainer (which sets it) and ``data.sample_seed``
(which reads it) import it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Context:
    """Where training is right now, for data sources and logging hooks (``elasticflow.context()``).

    ``step`` is the optimizer step being computed (completed steps + 1 inside a train step).
    """
    rank: int = 0
    world_size: int = 1
    generation: int = 0
    step: int = 0
    epoch: int = 0
    seed: int = 0       # the run's seed (``seed=`` in the config): data.sample_seed derives from it
    replica: int = -1   # topology=local_sgd|diloco: the model replica being trained (train/local_sgd.py); -1 otherwise


_context = Context()


def context() -> Context:
    """The calling process's current rank, world size, generation, step, epoch and seed."""
    return _context
