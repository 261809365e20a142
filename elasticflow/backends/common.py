"""What every backend shares: the active backend, the training flag, reading forward()'s output,
host arrays, and nested parameter dicts <-> flat names.

Imports no framework (describing a model must not import torch) and not ``elasticflow.ops``:
``ops`` dispatches through ``active()`` here, so the backends below it never import it back.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import CheckpointMismatch, ElasticFlowError

# ---------------------------------------------------------------- the active backend
# The backend module elasticflow.ops dispatches to; None until something chooses one. Here, not in
# ops, so that an Engine can route forward()'s ops calls to its own backend without importing ops.
_active: Optional[ModuleType] = None


def active() -> Optional[ModuleType]:
    """The backend module ``elasticflow.ops`` dispatches to, or None if none was chosen yet."""
    return _active


def activate(module: Optional[ModuleType]) -> None:
    """Route ``elasticflow.ops`` to backend ``module`` (None: to none; the next op picks torch).

    An Engine calls it on every micro-batch, nearly always with the module already active.
    """
    global _active
    if _active is not module:  # the test, not the store: a module-global store costs ~25 ns more (CPython 3.11)
        _active = module


# ---------------------------------------------------------------- the training flag
# One flag for the process, like the active backend: dropout and ops.training() read it, an
# Engine's train_mode() sets it, and the trainer sets it at the start of every step and around
# evaluation, so trainers taking turns in one process (a sweep, bench_overhead) each see their own.
_training = True


def training() -> bool:
    """True while training, False in evaluation (the flag dropout reads)."""
    return _training


def set_training(training: bool) -> None:
    global _training
    _training = training


# ---------------------------------------------------------------- forward()'s output
# forward()'s key for how much a micro-batch counts (a language model's target tokens): not a metric. The
# step's loss, metrics and gradient are then sums weighted by it, divided by the global batch's total.
WEIGHT = "weight"


def split_output(out: Any) -> Tuple[Any, Dict[str, Any]]:
    """forward()'s output as (loss, {metric: value}); ``check_loss`` then checks they are scalars."""
    if not isinstance(out, dict):
        return out, {}
    if type(out) is not dict and _model_output(out):
        # A Hugging Face ModelOutput (a dict of loss, logits, hidden states): its .loss, as the HF Trainer takes.
        if out.get("loss") is None:
            raise ElasticFlowError(f"forward() returned a {type(out).__name__} without a loss",
                                   "pass the labels to the model (net(input_ids=x, labels=y)) or return a loss")
        return out["loss"], {}
    if "loss" not in out:
        raise ElasticFlowError(f"forward() returned a dict without a 'loss' key (keys: {sorted(out)})",
                               "return {'loss': loss, 'accuracy': acc, ...}")
    metrics = dict(out)  # a copy, then pop: 0.5 us less per micro-batch than a dict comprehension
    return metrics.pop("loss"), metrics


def _model_output(out: Any) -> bool:
    """A transformers ``ModelOutput`` (looked up by its class, never imported)."""
    return any(cls.__name__ == "ModelOutput" and cls.__module__.startswith("transformers")
               for cls in type(out).__mro__)


def check_loss(out: Any, where: str, size: Callable[[Any], Optional[int]], framework: str
               ) -> Tuple[Any, Dict[str, Any]]:
    """Split forward()'s output into (loss, {metric: value}); reject what cannot be a loss.

    Args:
        where: the end of the error message ("for a micro-batch", "in evaluation").
        size: the backend's check: the number of elements of one of its tensors, None for
            anything else (a float, a numpy array, another framework's tensor).
        framework: named in the hint ("... with elasticflow.ops (or torch) ...").

    Returns the loss and metrics as forward() gave them; the backend reshapes them to scalars.
    """
    loss, metrics = split_output(out)
    n = size(loss)
    if n is None:
        raise ElasticFlowError(
            f"forward() returned a {type(loss).__name__} as the loss {where}",
            f"compute the loss from params with elasticflow.ops (or {framework}) so gradients flow")
    if n != 1:
        raise ElasticFlowError(f"forward() returned a non-scalar loss of shape {tuple(loss.shape)} {where}",
                               "reduce it to one number, e.g. ops.mean(...) or ops.cross_entropy(logits, y)")
    for k, v in metrics.items():
        if not isinstance(v, (float, int, np.generic)) and size(v) != 1:
            raise ElasticFlowError(f"forward() metric {k!r} is not a scalar",
                                   "every value in forward()'s dict must be a single number")
    return loss, metrics


# ---------------------------------------------------------------- data
def host_array(array: Any) -> np.ndarray:
    """``array`` as numpy; float64 becomes float32 (the framework's parameter dtype), other dtypes keep theirs."""
    array = np.asarray(array)
    return array.astype(np.float32) if array.dtype == np.float64 else array


def resident(to_tensor: Callable[[np.ndarray], Any], arrays: Iterable[np.ndarray]) -> Tuple[Any, ...]:
    """The whole dataset as tensors, converted once; batches are then gathered by index.

    A backend binds its own ``to_tensor``: ``resident = functools.partial(common.resident, to_tensor)``.
    """
    return tuple(to_tensor(a) for a in arrays)


# ---------------------------------------------------------------- names
def flatten(tree: Dict[str, Any], prefix: str = "") -> List[Tuple[str, Any]]:
    """[(name, leaf)] in insertion order; nested dicts join their keys with "/"."""
    items: List[Tuple[str, Any]] = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            items.extend(flatten(value, name + "/"))
        else:
            items.append((name, value))
    return items


def rebuild(tree: Dict[str, Any], leaves: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``tree``'s shape with each leaf replaced by ``leaves[name]``."""
    return {k: rebuild(v, leaves, f"{prefix}{k}/") if isinstance(v, dict) else leaves[f"{prefix}{k}"]
            for k, v in tree.items()}


def state_names(params: Iterable[str], buffers: Iterable[str], slots: Sequence[str]) -> List[str]:
    """The names ``Engine.state()`` returns: parameters, buffers, then ``optimizer/{param}/{slot}``."""
    params = list(params)
    return params + list(buffers) + [f"optimizer/{n}/{s}" for n in params for s in slots]


def buckets(sizes: Sequence[int], bucket_bytes: int) -> List[Tuple[int, int]]:
    """Ranges [lo, hi) of a flat float32 gradient made of parameters of ``sizes`` (in flat order),
    whole parameters each, the last parameters first (the order backward finishes them: it runs from
    the loss towards the inputs), each of at least ``bucket_bytes`` but the last."""
    ends = np.cumsum(sizes).tolist()
    ranges, hi = [], int(ends[-1]) if ends else 0
    for i in range(len(sizes) - 1, -1, -1):
        lo = int(ends[i] - sizes[i])
        if (hi - lo) * 4 >= bucket_bytes or i == 0:
            ranges.append((lo, hi))
            hi = lo
    return ranges


def check_trainable(state: Mapping[str, Any], params: Iterable[str], slots: Sequence[str], steps: int) -> None:
    """Refuse a checkpoint in which a parameter that trains now was frozen (so has no optimizer state)
    under Adam: its bias correction counts the steps of each parameter since it first trained, and the
    flat update keeps one count for all. SGD's momentum may start at zero (0 * m + g == g): accepted.
    A parameter frozen now that trained then just leaves its slots unread, as in torch.optim."""
    if "exp_avg" not in slots or steps == 0 or not any(k.startswith("optimizer/") for k in state):
        return
    missing = [n for n in params if f"optimizer/{n}/exp_avg" not in state and n in state]
    if missing:
        raise CheckpointMismatch(  # not a damaged checkpoint: resume=auto must stop, not start fresh
            f"parameter {missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} trains now "
            "but was frozen when the checkpoint was written, so it has no Adam state to resume",
            "keep it frozen until this run ends, or start a new run from the weights: elasticflow export "
            "CHECKPOINT --to DIR, load them in model(), and pass resume=none")


class WholeParameters:
    """The Engine members of trainer.shard=parameters for a backend that keeps its parameters whole (TensorFlow:
    the config refuses the stage there before any engine is built)."""

    def page_params(self) -> Any:
        raise ElasticFlowError("trainer.shard=parameters is built for backend=torch", "pass trainer.shard=gradients")

    frozen_pages: Any = None  # no frozen parameters kept in pages

    def parameter_units(self) -> Tuple[Any, List[Any]]:
        return None, []

    def frozen_units(self) -> List[Any]:
        return []

    def frozen_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        return []

    def zero_grad_range(self, lo: int, hi: int) -> None:
        self.grad_view()[lo:hi].zero_()

    def grad_in(self, lo: int, hi: int) -> None:
        """Nothing: the gradient is whole, always in memory."""
