"""What makes a model's result depend on how a global batch is cut, for the start banner's warning.

A dropout mask is drawn per micro-batch (seeded by its place in the global order: ``data.micro_seed``) and
BatchNorm's statistics are taken over one. With ``trainer.micro_batch_size`` the micro-batches are the
same for any number of workers; without it each worker's share is one micro-batch, so the masks and the
statistics -- and the result -- depend on the number of workers, silently. :func:`warning` says so and
what to set.

Imports no framework: a model is recognised by its classes' names and attributes (duck typing), so
describing a Keras model never imports torch, nor the reverse.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

# Calls of elasticflow.ops.dropout with a rate that may be above 0, counted by ops.dropout: a dict-of-arrays
# model has no layers to look at, so the trainer compares the count around forward()'s start-up probe.
ops_draws = 0

# torch modules that draw in training whatever their attributes say (RReLU: a random negative slope).
_RANDOM_CLASSES = ("RReLU",)
# Keras layers' rates: Dropout and its kin (rate), GaussianNoise (stddev), RNNs and attention (dropout, ...).
_KERAS_RATES = ("rate", "stddev", "dropout", "recurrent_dropout")


def count_dropout(rate: Any) -> None:
    """Called by ``ops.dropout``: count a call that may draw (a rate above 0, or a tensor rate)."""
    global ops_draws
    if not isinstance(rate, (int, float)) or rate > 0:
        ops_draws += 1


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _torch_modules(model: Any) -> Iterator[Tuple[str, Any]]:
    named = getattr(model, "named_modules", None)
    if callable(named) and type(model).__module__.split(".")[0] != "keras":
        yield from named()


def _keras_layers(model: Any) -> Iterator[Tuple[str, Any]]:
    flatten = getattr(model, "_flatten_layers", None)  # keras 3 (backends/tensorflow/native.py reads it too)
    if callable(flatten):
        for layer in flatten(include_self=True):
            yield getattr(layer, "name", type(layer).__name__), layer


def _torch_draws(module: Any) -> bool:
    cls = type(module).__name__
    if cls in _RANDOM_CLASSES:
        return True
    if "Dropout" in cls or "DropPath" in cls:  # nn.Dropout*, nn.AlphaDropout, timm's DropPath
        return any(_positive(getattr(module, a, None)) for a in ("p", "drop_prob"))
    # A probability kept as a float by a module that calls F.dropout itself: nn.MultiheadAttention.dropout,
    # nn.LSTM/GRU.dropout, transformers' attention modules (attention_dropout) and LayerDrop (layerdrop).
    # transformers' configs are not read: GPT-2's has summary_first_dropout=0.1 with every pdrop at 0.
    return any("drop" in k and isinstance(v, float) and 0 < v <= 1 for k, v in vars(module).items())


def _keras_draws(layer: Any) -> bool:
    rates = [getattr(layer, a, None) for a in _KERAS_RATES if hasattr(layer, a)]
    if any(_positive(r) for r in rates):
        return True
    # A layer with seed generators and no rate to read (RandomFlip, RandomCrop ...) draws in training.
    return not rates and bool(getattr(layer, "_seed_generators", None))


def sources(model: Any, forward_drew: bool = False) -> List[str]:
    """What draws random numbers in training in ``model`` (what ``model()`` returned): the names of its
    torch modules or Keras layers that do, and ``ops.dropout`` when ``forward_drew`` (forward() called it
    with a rate above 0 in the start-up probe)."""
    found: List[str] = []
    try:
        found += [name or type(m).__name__ for name, m in _torch_modules(model) if _torch_draws(m)]
        found += [name for name, layer in _keras_layers(model) if _keras_draws(layer)]
    except Exception:  # noqa: BLE001 - an exotic model must not stop the run over a warning
        pass
    if forward_drew:
        found.append("ops.dropout in forward()")
    return found


def suggested_micro_batch(global_batch: int, workers: int) -> int:
    """The largest divisor of ``global_batch`` that gives each of ``workers`` at least one micro-batch:
    micro-batches of equal size, and as few per worker (as little accumulation) as that allows."""
    most = max(1, -(-global_batch // max(1, workers)))
    return max(d for d in range(1, most + 1) if global_batch % d == 0)


def warning(drawn: List[str], batch_statistics: bool, global_batch: int, workers: int,
            precision: Optional[str] = None) -> Optional[str]:
    """The banner's line when the result depends on the number of workers (``trainer.micro_batch_size``
    unset), else None. ``workers``: the most this job may have (its micro-batches should serve them all).
    ``precision``: the compute dtype under autocast (bf16, float16): each worker's share of a step is summed
    in it, so the rounding depends on how the global batch is cut."""
    what = []
    if precision is not None:
        what.append(f"the {precision} rounding of each worker's share")
    if drawn:
        more = f" and {len(drawn) - 2} more" if len(drawn) > 2 else ""
        what.append(f"the random draws (dropout) of {', '.join(drawn[:2])}{more}")
    if batch_statistics:
        what.append("BatchNorm's batch statistics")
    if not what:
        return None
    n = suggested_micro_batch(global_batch, workers)
    count = global_batch // n
    return (f"  warning: without trainer.micro_batch_size each worker's share of a step is one micro-batch, so "
            f"{' and '.join(what)} depend on the number of workers; set trainer.micro_batch_size={n} "
            f"(global batch {global_batch} = {count} micro-batch{'es' if count != 1 else ''} of {n}) for the "
            "result one worker would train, whatever the number")
