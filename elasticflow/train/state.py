"""Where training is: ``TrainState``, the progress every replica shares and every checkpoint keeps
(this process's view of it, for data sources and hooks, is ``context.Context``: ``elasticflow.context()``).

Counters, never mixed: ``step`` counts optimizer steps, ``micro_step`` micro-batches,
``cursor.samples_seen`` samples, ``generation`` (in Context) membership changes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from ..data.order import Cursor
from .loss_scale import INIT as LOSS_SCALE_INIT


@dataclass
class TrainState:
    """The replicated progress of a run: what a checkpoint saves beside the tensors, and what a worker
    that falls behind adopts from the most advanced one.

    A new counter is one new field here: ``state_dict()``/``load_state_dict()`` walk the fields, so
    checkpoints and the replicas' state transfer carry it without another change. Give it a default:
    a checkpoint written before it existed loads with that default.

    Example:
        >>> s = TrainState(step=3)
        >>> TrainState().load_state_dict(s.state_dict()) or s.step
        3
    """
    step: int = 0                  # optimizer steps completed
    micro_step: int = 0            # micro-batches processed (forward + backward calls)
    skipped_steps: int = 0         # steps dropped: trainer.on_nonfinite=skip, or a float16 overflow
    loss_scale: float = LOSS_SCALE_INIT  # trainer.precision=16: the dynamic loss scale (loss_scale.py) ...
    loss_scale_good_steps: int = 0  # ... and the steps without overflow since it last changed
    cursor: Cursor = field(default_factory=Cursor)  # the next sample of the global order
    last_saved_step: Optional[int] = None   # the step of the newest checkpoint saved (None: none)
    last_metrics: Dict[str, Any] = field(default_factory=dict)  # the newest step record (for logging)
    # Optimizer steps a parameter sat out: it had no gradient anywhere in the step's global batch (an expert no
    # token reached), so, as torch.optim skips a None .grad, it was not updated and counts fewer steps of its own
    # (Adam's bias correction: ``optim.stretches``). Only parameters that sat out some step are listed.
    sat_out: Dict[str, int] = field(default_factory=dict)
    # The callbacks' own state by "<position>:<class>" (train/callbacks.py): early stopping's patience, the best-k list
    callbacks: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    @property
    def epochs_completed(self) -> int:
        return self.cursor.epoch  # the cursor moves to epoch e + 1 exactly when epoch e completes

    def state_dict(self) -> Dict[str, Any]:
        """The fields as plain JSON-able values (the cursor as a dict)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["cursor"] = self.cursor.as_dict()
        out["last_metrics"] = dict(self.last_metrics)
        out["sat_out"] = dict(self.sat_out)
        out["callbacks"] = {k: dict(v) for k, v in self.callbacks.items()}
        return out

    def load_state_dict(self, values: Dict[str, Any]) -> None:
        """Take the fields found in ``values`` (other keys, such as a checkpoint's metadata, are ignored);
        a field missing from ``values`` keeps its default."""
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = values.get(f.name, default)
            if f.name == "cursor":
                value = Cursor(**value) if isinstance(value, dict) else Cursor()
            elif f.name == "last_metrics":
                value = dict(value or {})
            elif f.name == "sat_out":
                value = {str(k): count(v) for k, v in dict(value or {}).items()}
            elif f.name == "callbacks":  # a crafted record (not a dict of dicts): ValueError, a corrupt checkpoint
                if not isinstance(value or {}, dict) or not all(isinstance(v, dict) for v in (value or {}).values()):
                    raise ValueError(f"the callbacks' state must map names to dicts, got {value!r:.80}")
                value = {str(k): dict(v) for k, v in (value or {}).items()}
            elif isinstance(default, int) and value is not None:
                value = int(value)
            setattr(self, f.name, value)


def count(value: Any) -> int:
    """A count read from a checkpoint's progress (a step count, a callback's): a non-negative integer, else
    ValueError (a crafted record)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a count must be a non-negative integer, got {value!r}")
    return value
