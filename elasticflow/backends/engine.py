"""The Engine contract: what the trainer, replica sync, sharded state, evaluation and checkpoints call
on a backend's ``Engine``.

Every backend package's ``Engine`` class satisfies ``Engine`` below (tests/test_backends.py checks
each member and its signature), so the layers above never ask which backend they hold.
The backends do not subclass it: a subclass would inherit these stubs and hide a missing method.

Gradients live in one flat float32 buffer in parameter order; state is exchanged by name, as
numpy arrays, so a checkpoint written by one backend loads on the other.

Every member is declared, so no caller asks an engine what it has (no ``hasattr``): where a backend has
nothing to do, its method is a no-op with the same signature (TensorFlow's ``arm`` never reports and its
``fold_buffer`` is None; torch's ``params_written`` does nothing, its flat parameters ARE the model).

Parameters that do not train (torch ``requires_grad=False``, keras ``trainable=False``) are in ``state()``
and ``load_state()`` by name, but not in the flat gradient, the flat parameters or the optimizer.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from .buffers import Rule
from ..config.optim import Hyper, OptimizerSpec


@runtime_checkable
class Engine(Protocol):
    """Parameters, autodiff, the flat gradient buffer and the optimizer of one worker.

    Typical step (``train.stepper.Stepper.attempt``): ``train_mode(True)``, ``zero_grad()``,
    ``accumulate()`` per micro-batch, reduce ``grad_view()`` in place across workers, optionally
    ``grad_norm()``/``scale_grad()`` or ``grad_finite()``, then ``apply(lr)``.
    """

    num_params: int
    """Number of trainable scalars: the length of ``grad_view()``."""

    grad_scale: float  # multiplies the loss before backward (float16's loss scale); 1.0 otherwise

    placement: Any  # the devices.Placement it computes on (evaluation builds its batches there)

    compiling: bool  # forward() is compiled at its first call (torch.compile): the banner says the wait is expected

    EXACT_SQRT: bool  # its Adam takes the root correctly rounded (TensorFlow), not torch's float32 sqrt: a sharded
    # update (replica/flat_update.py) takes it the same way

    def __init__(self, model: Any, forward: Callable[..., Any], spec: OptimizerSpec, jit: bool = True,
                 placement: Any = None) -> None:
        """Build from what ``model(cfg)`` returned (params dict or native model), ``forward`` and the optimizer
        spec, on ``placement``'s device and precision (a ``devices.Placement``; None: the CPU in float32)."""

    def train_mode(self, training: bool) -> None:
        """Switch training (dropout on, BatchNorm updates) or evaluation behaviour for what follows."""

    def zero_grad(self) -> None:
        """Clear the flat gradient buffer before a step's first micro-batch."""

    def accumulate(self, batch: Any, weight: float) -> Tuple[Any, Dict[str, Any]]:
        """Add the gradient of ``weight * loss`` of one micro-batch; returns the weighted (loss, metrics)."""

    def grad_view(self) -> Any:
        """The accumulated flat gradient as a 1-D float32 torch.Tensor; in-place edits are what ``apply`` uses."""

    def grad_norm(self) -> float:
        """L2 norm of the accumulated flat gradient (a sync point)."""

    def grad_finite(self) -> bool:
        """Whether every element of the accumulated flat gradient is finite (a sync point).

        Note: one read of the gradient (its sum, NaN or inf when any element is), no norm: every step pays
        it (``grad_check``). A sum past float32's range (elements near 1e38) also reads as not finite."""

    def scale_grad(self, factor: float) -> None:
        """Multiply the accumulated gradient by ``factor`` in place (gradient clipping)."""

    def took_part(self) -> np.ndarray:
        """Per parameter (flat order), whether backward gave it a gradient since ``zero_grad()``: the flags the
        members sum in the step's reduction, so that one with no gradient anywhere sits the step out."""

    def apply(self, lr: float, took_part: Optional[np.ndarray] = None, sat_out: Optional[np.ndarray] = None) -> None:
        """One optimizer update with learning rate ``lr`` from the accumulated gradient.

        ``took_part``: per parameter, whether it had a gradient anywhere in the global batch (None: all had);
        one that had none is not updated and counts no step, as torch.optim skips a None ``.grad``.
        ``sat_out``: per parameter, the steps it sat out before (its own step count: ``optim.stretches``)."""

    def evaluate(self, batch: Any) -> Dict[str, float]:
        """forward() on ``batch`` without gradients: {"loss": ..., metric: ...} as Python floats."""

    def state(self, copy: bool = True) -> Dict[str, np.ndarray]:
        """Parameters, buffers and optimizer slots by name as numpy (``copy=False``: views, read them at once)."""

    def load_state(self, state: Dict[str, np.ndarray], optimizer_steps: int) -> None:
        """Overwrite parameters, buffers and slots from ``state``; ``optimizer_steps`` drives bias correction."""

    def state_names(self) -> List[str]:
        """The names ``state()`` returns once the optimizer has stepped (its slots included)."""

    # The same result for any number of workers (no random generator state is kept between steps: every
    # micro-batch is seeded from its place in the global order).
    def seed(self, value: int) -> None:
        """Seed every generator forward() draws from (dropout) for the next micro-batch."""

    def buffer_rules(self) -> Dict[str, Rule]:
        """How each buffer that is state combines across workers (``elasticflow.backends.buffers``); {} if none."""

    def buffer_arrays(self) -> Dict[str, np.ndarray]:
        """The buffers named by ``buffer_rules()``, as numpy (views: read them before the next step)."""

    def set_buffers(self, values: Dict[str, np.ndarray]) -> None:
        """Overwrite the named buffers (the reconciled ones, or a failed step's starting values)."""

    # -- gradient buckets (``comm.bucket_mb``): reductions started while backward still runs (replica/bucketing.py)
    def buckets(self, bucket_bytes: int) -> List[Tuple[int, int]]:
        """Ranges [lo, hi) of the flat gradient, whole parameters each, in the order backward finishes
        them (``common.buckets``): the last parameters first."""

    def arm(self, ranges: List[Tuple[int, int]], on_ready: Optional[Callable[[int], None]]) -> None:
        """Call ``on_ready(k)`` during the next backward as soon as bucket k (``ranges[k]``) is complete;
        None disarms. A bucket that never reports (a parameter outside the forward pass, or a backend
        without per-parameter callbacks: TensorFlow's arm does nothing) is the caller's to start after
        backward."""

    def fold_buffer(self, extra: int) -> Optional[Any]:
        """The flat gradient followed by ``extra`` free float32 slots, as one contiguous 1-D torch tensor
        whose head IS the gradient (reducing it in place reduces the gradient): the step's scalars ride
        with it. None when there is no such room (TensorFlow's, always): the caller copies instead."""

    # -- sharded optimizer state (``trainer.shard``, elasticflow/replica/shard.py)
    def flat_slots(self) -> Dict[str, Any]:
        """The optimizer's slots by name, each one flat float32 tensor in the flat order (live, not copies): what
        ``elastic.fingerprint`` compares. {} where there are none, or where they are not flat (TensorFlow's)."""

    def flat_params(self) -> Any:
        """The trainable parameters as one flat float32 torch tensor, in the flat gradient's order. torch's
        IS the parameters; TensorFlow's is a copy, written back by ``params_written()``."""

    def params_written(self) -> None:
        """``flat_params()``'s tensor was written: make the model's parameters hold it (a no-op where
        the tensor is the parameters)."""

    def flat_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of each trainable parameter, in the flat order (each parameter group contiguous)."""

    def flat_runs(self) -> List[Tuple[int, int, Hyper]]:
        """[(lo, hi, hyper)]: each parameter group's stretch of the flat order, its lr scale and weight decay."""

    def reset_optimizer(self) -> None:
        """Zero the optimizer's slots and its step count, as if just built (each local SGD / DiLoCo round)."""

    def page_params(self) -> Any:
        """trainer.shard=parameters: the flat parameters in memory whose pages can be given back (a
        ``_util.pages.PagedVector`` over ``flat_params()``, a GPU's ``backends/torch/device_pages.DeviceVector``:
        the same methods); an engine that cannot keep them so raises
        ElasticFlowError with a hint (the config refuses such a run first)."""

    def parameter_units(self) -> Tuple[Any, List[Any]]:
        """(the framework's module being trained, None for a dict of arrays; the trainable parameters as the
        framework's tensors, in the flat order): what trainer.shard=parameters cuts into units and hooks
        (``replica/param_units.py``)."""

    frozen_pages: Any
    """trainer.shard=parameters: the float32 frozen parameters (``requires_grad=False``) as one flat vector in pages
    that can be given back (a ``_util.pages.PagedVector``; ``replica/frozen_shards.py``); None where there are none
    or the engine keeps them whole."""

    def frozen_units(self) -> List[Any]:
        """The frozen parameters in ``frozen_pages``, as the framework's tensors, in its order ([] without it)."""

    def frozen_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of each frozen parameter in ``frozen_pages``, in its order ([] without it)."""

    def zero_grad_range(self, lo: int, hi: int) -> None:
        """Zero elements [lo, hi) of the flat gradient; where the engine keeps it in pages that can be given
        back (trainer.shard=parameters), their pages go instead of being written."""

    def grad_in(self, lo: int, hi: int) -> None:
        """trainer.shard=parameters: map the flat gradient's memory over [lo, hi) before backward writes there
        (a GPU's given-back memory is unmapped; host pages need nothing)."""

    def release_optimizer(self) -> None:
        """Drop the engine's own whole-model optimizer slots: a sharded update replaces ``apply``."""
