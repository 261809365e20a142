"""The torch backend's ``Engine``: autograd over the flat gradient buffer, and the optimizer.

Gradients accumulate into one flat buffer (each parameter's ``.grad`` is a view of it), so a
distributed reduction is a single call on one tensor and zeroing is one ``zero_()``; the parameters
are views of another, so the optimizer's update is a few calls over the whole model (``optim.py``).

The Engine owns two collaborators, as TensorFlow's does: ``variables.Variables`` (the parameters, buffers
and frozen parameters, the flat vectors they are views of, and trainer.shard=parameters' paged memory) and
the optimizer (``optim.py``). What stays here is the step: forward() under autocast, backward, which
parameters took part, the gradient's buckets, and state by name with the optimizer's slots.
"""
from __future__ import annotations

import functools
import math
import sys
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ...config import optim
from ..._util.norms import sum_squares
from ..buffers import Rule
from ...config.devices import Placement
from ...config.optim import OptimizerSpec
from .. import common
from ..common import WEIGHT, activate, check_loss, set_training, split_output, state_names
from . import native
from .data import to_numpy
from .optim import Released, make_optimizer
from .variables import Variables

# What an Engine activates for elasticflow.ops: the backend package, which is importing this module now
# (looked up, not imported: an import of the package from here would be a cycle).
_SELF = sys.modules[__package__]


def _to_float32(x: Any) -> Any:
    """A floating-point tensor cast to float32; anything else as it is."""
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _size(x: Any) -> Optional[int]:
    """check_loss's test: the number of elements of a torch tensor, None for anything else."""
    return x.numel() if isinstance(x, torch.Tensor) else None


def _check_loss(out: Any, where: str):
    """forward()'s output as (scalar loss, {metric: scalar}); see ``common.check_loss``."""
    loss, metrics = check_loss(out, where, _size, "torch")
    return loss.reshape(()), metrics


class Engine:
    """Autograd, the flat gradient buffer and the optimizer of one worker, over its ``Variables``.

    Args:
        model: what ``model(cfg)`` returned, without the "optimizer" key: a (nested) dict of
            arrays/tensors, or a ``torch.nn.Module``.
        forward: the user's ``forward(*batch, params)``.
        spec: the optimizer spec.
        placement: the device and precision (``devices.Placement``; None: the CPU in float32).
            Parameters, the flat gradient, optimizer slots and buffers live on the device, in float32;
            forward() runs under autocast in bf16/float16, backward() outside it (as torch recommends).
        paged_params: trainer.shard=parameters: the flat vectors in memory whose pages can be given back.

    ``grad_scale`` multiplies the loss before backward (float16's loss scale; the trainer sets it and
    unscales the reduced gradient with ``scale_grad``).
    """
    EXACT_SQRT = False  # Adam's root is torch's own float32 sqrt (the flat update and torch.optim's)

    def __init__(self, model: Any, forward, spec: OptimizerSpec, jit: bool = True,
                 placement: Optional[Placement] = None, paged_params: bool = False):
        self.forward = forward
        self.spec = spec
        self.placement = placement = placement or Placement()
        self.device = torch.device(placement.device)
        dtype = placement.compute_dtype
        self.autocast = None if dtype is None else functools.partial(
            torch.autocast, self.device.type, dtype=getattr(torch, dtype))
        self.grad_scale = 1.0
        self.compiling = native.compiled(model)
        self.variables = v = Variables(model, spec, self.device, paged_params)
        # The names the layers above and the tests read, as the variables hold them.
        self.module, self.view, self.params, self.frozen, self.buffers = v.module, v.view, v.params, v.frozen, v.buffers
        self.num_params, self.flat_param, self.flat_grad = v.num_params, v.flat_param, v.flat_grad
        self.paged, self.grad_pages, self.frozen_pages = v.paged, v.grad_pages, v.frozen_pages
        plist = list(self.params.values())
        self.optimizer = make_optimizer(spec, plist, self.flat_param, self.flat_grad, v.runs)
        self._host: Optional[Dict[str, torch.Tensor]] = None  # state(copy=False) on a GPU: pinned mirrors
        self._checked = False
        self._bucket_of: Optional[List[int]] = None  # parameter index -> bucket (arm())
        self._on_ready: Optional[Any] = None
        self._waiting: Counter = Counter()
        # Which parameters received a gradient since zero_grad(): .grad is always a view of the flat buffer, so
        # "None" (torch.optim's skip) is told by autograd's accumulation hook instead. One Python call per
        # parameter per backward (~1 us each).
        self._took_part = np.zeros(len(plist), dtype=bool)
        for i, p in enumerate(plist):
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i))

    # -- one step
    def train_mode(self, training: bool) -> None:
        set_training(training)
        if self.module is not None:
            self.module.train(training)

    def zero_grad(self) -> None:
        self.variables.zero_grad_range(0, self.num_params)
        self._took_part[:] = False

    def took_part(self) -> np.ndarray:
        """Per parameter (flat order): whether backward gave it a gradient since ``zero_grad()``; one that
        took no part in any forward (an expert no token was routed to, an unused head) has none."""
        return self._took_part

    def accumulate(self, batch: Tuple[torch.Tensor, ...], weight: float):
        """Backprop ``weight * loss`` of one micro-batch into the flat buffer; returns weighted (loss, metrics).

        Where forward() returned a ``weight`` (a language model's target tokens), it replaces ``weight`` and
        is returned among the metrics, as it is: the trainer divides the sums by the global batch's total.
        """
        # forward()'s elasticflow.ops calls come here, whichever backend another trainer chose since.
        # Set, not set-and-restored around forward(): one assignment per micro-batch instead of two
        # and a try/finally, and ops stays on this backend after the step, as ops.use(NAME) left it.
        activate(_SELF)
        loss, metrics = _check_loss(self._forward(batch), "for a micro-batch")
        own = metrics.pop(WEIGHT, None)
        if own is not None:
            weight = own.detach().float() if isinstance(own, torch.Tensor) else float(own)
            metrics = {k: v * weight for k, v in metrics.items()}
            metrics[WEIGHT] = weight
            loss = loss * weight
        elif weight != 1.0:  # one micro-batch per step (weight 1) is the common case: skip three tensor ops
            loss = loss * weight
            metrics = {k: v * weight for k, v in metrics.items()}
        (loss * self.grad_scale if self.grad_scale != 1.0 else loss).backward()
        if not self._checked:
            self._check_grad_views()
        return loss.detach(), {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}

    def _forward(self, batch: Tuple[torch.Tensor, ...]):
        if self.autocast is None:
            return self.forward(*batch, params=self.view)
        with self.autocast():
            loss, metrics = split_output(self.forward(*batch, params=self.view))
        # The step's numbers in float32, whatever autocast computed them in (a float16 sum overflows).
        return {"loss": _to_float32(loss), **{k: _to_float32(v) for k, v in metrics.items()}}

    def _check_grad_views(self) -> None:
        # Autograd accumulates in place into an existing .grad; verify once that it kept our views.
        base = self.flat_grad.data_ptr()
        end = base + self.flat_grad.numel() * 4
        for name, p in self.params.items():
            if p.grad is None or not (base <= p.grad.data_ptr() < end):
                raise RuntimeError(f"gradient of {name!r} left the flat buffer; do not replace .grad in forward()")
        self._checked = True

    # -- gradient buckets: reductions that start while backward still runs
    def buckets(self, bucket_bytes: int) -> List[Tuple[int, int]]:
        """The flat gradient's buckets (``common.buckets``): backward finishes them in this order."""
        return common.buckets([p.numel() for p in self.params.values()], bucket_bytes)

    def arm(self, ranges: List[Tuple[int, int]], on_ready: Optional[Any]) -> None:
        """Call ``on_ready(k)`` when every parameter of bucket k (``ranges[k]``) has its gradient
        accumulated in the next backward; None disarms. The hooks are registered once, at the first arm.

        Note: a parameter that takes no part in the forward pass never reports: its bucket is the
        caller's to start after backward.
        """
        if on_ready is not None and self._bucket_of is None:
            starts = np.cumsum([0] + self.variables.sizes)[:-1].tolist()
            self._bucket_of = [next(k for k, (lo, hi) in enumerate(ranges) if lo <= at < hi) for at in starts]
        self._on_ready = on_ready
        if on_ready is not None:
            self._waiting = Counter(self._bucket_of)

    def _accumulated(self, index: int, _param: torch.Tensor) -> None:
        self._took_part[index] = True
        if self._on_ready is None:
            return
        bucket = self._bucket_of[index]
        self._waiting[bucket] -= 1
        if self._waiting[bucket] == 0:
            self._on_ready(bucket)

    def grad_view(self) -> torch.Tensor:
        """The accumulated flat gradient (1-D float32); in-place edits (an allreduce) are what apply() uses."""
        return self.flat_grad

    def fold_buffer(self, extra: int) -> Optional[torch.Tensor]:
        """The flat gradient followed by ``extra`` free float32 slots, as one contiguous tensor whose head
        IS the gradient (the same memory: reducing it in place reduces the gradient); None when ``extra``
        exceeds the room reserved at start-up (``variables.FOLD_SCALARS``, a flag per parameter and the buffers
        that are state). The slots hold garbage until written."""
        return self.variables.fold_buffer(extra)

    def grad_norm(self) -> float:
        # Blocks at fixed offsets, squares added in float64: the norm trainer.shard's owners take of their ranges
        # (_util/norms.py) rounds the same, so a clipped run's factor does not depend on the world size.
        return math.sqrt(sum_squares(self.flat_grad))

    def grad_finite(self) -> bool:
        # The sum, not isfinite().all(): that writes a mask as large as the gradient (~30x slower on a CPU).
        return bool(torch.isfinite(self.flat_grad.sum()))

    def scale_grad(self, factor: float) -> None:
        self.flat_grad.mul_(factor)

    def apply(self, lr: float, took_part: Optional[np.ndarray] = None, sat_out: Optional[np.ndarray] = None) -> None:
        """One optimizer step from the flat gradient. ``took_part``/``sat_out`` (per parameter, flat order):
        whether it had a gradient anywhere in the global batch, and the steps it sat out before; a parameter
        that took no part is left alone and counts no step (``optim.stretches``). None: every one took part."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if took_part is None and sat_out is None:
            self.optimizer.step()
            return
        v = self.variables
        self.optimizer.step(optim.stretches(v.runs, v.sizes, self.optimizer.steps + 1, took_part, sat_out))

    @torch.no_grad()
    def evaluate(self, batch: Tuple[torch.Tensor, ...]) -> Dict[str, float]:
        activate(_SELF)
        loss, metrics = _check_loss(self._forward(batch), "in evaluation")
        return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}}

    # -- state, by name, as numpy (backend-neutral checkpoints)
    def state(self, copy: bool = True) -> Dict[str, np.ndarray]:
        """Parameters, buffers and optimizer slots by name, as numpy arrays.

        ``copy=False`` returns views of the live tensors (no copy, so no stall proportional to the
        model): they change with the next ``apply``/``load_state``, so read them before that (a
        checkpoint snapshot, a state transfer) and never write to them. With ``paged_params`` it leaves out
        the parameters kept in pages (``ShardedState.partials`` has this worker's ranges of them).
        """
        tensors = self.variables.tensors()
        for n, p in self.params.items():
            slots = self.optimizer.state.get(p, {})
            for slot in self.spec.slots():
                if slot in slots and slots[slot] is not None:
                    tensors[f"optimizer/{n}/{slot}"] = slots[slot]
        if self.paged is not None and not copy:
            # trainer.shard=parameters: a worker holds only its ranges of the paged vectors, which ShardedState's
            # partials() give; the rest may be given back (a GPU's mirror copy would read unmapped memory)
            paged = self.variables.in_pages()
            tensors = {n: t for n, t in tensors.items() if n not in paged}
        if self.device.type != "cpu" and not copy:
            return self._mirror(tensors)
        take = (lambda t: to_numpy(t).copy()) if copy else to_numpy
        return {n: take(t) for n, t in tensors.items()}

    def _mirror(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, np.ndarray]:
        """The device's tensors copied into pinned host mirrors, allocated once: every copy is queued
        at once and waited for once (a sync point), so the stall is the transfer at the link's speed,
        not one pageable round trip per tensor."""
        if self._host is None or self._host.keys() != tensors.keys():
            self._host = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for n, t in tensors.items()}
        for n, t in tensors.items():
            self._host[n].copy_(t.detach(), non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return {n: h.numpy() for n, h in self._host.items()}

    @torch.no_grad()
    def load_state(self, state: Dict[str, np.ndarray], optimizer_steps: int) -> None:
        common.check_trainable(state, self.params, self.spec.slots(), optimizer_steps)
        self.variables.load(state)
        for n, p in self.params.items():
            slots = {s: torch.from_numpy(np.array(state[f"optimizer/{n}/{s}"], dtype=np.float32))
                     .reshape(p.shape).to(self.device)
                     for s in self.spec.slots() if f"optimizer/{n}/{s}" in state}
            if slots:
                self.optimizer.load_slots(p, slots, optimizer_steps)

    def state_names(self) -> List[str]:
        stateful = [n for n in self.buffers if self.variables.is_state(n)]
        return state_names(self.params, [*self.frozen, *stateful], self.spec.slots())

    # -- sharded optimizer state (elasticflow/replica/shard.py): the parameters as one flat tensor
    def flat_params(self) -> torch.Tensor:
        """The parameters as one flat float32 tensor, in the flat gradient's order: writing it writes
        the model."""
        return self.flat_param

    def flat_slots(self) -> Dict[str, torch.Tensor]:
        """The flat optimizer's slot buffers (the Engine contract)."""
        return dict(self.optimizer.flat_slots)

    def flat_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of each parameter, in the flat order."""
        return self.variables.layout()

    def flat_runs(self) -> List[Tuple[int, int, optim.Hyper]]:
        """[(lo, hi, hyperparameters)]: the flat order's stretches of one parameter group each."""
        return list(self.variables.runs)

    def reset_optimizer(self) -> None:
        """Start the optimizer afresh: zero slots, no steps taken (train/local_sgd.py: each round's inner optimizer)."""
        self.optimizer.reset()

    def release_optimizer(self) -> None:
        """Drop this engine's own optimizer and its whole-model slots: a sharded update replaces it."""
        self.optimizer = Released()

    # -- trainer.shard=parameters (replica/param_units.py, frozen_shards.py): memory whose pages can be given back
    def page_params(self) -> Any:
        """The flat parameters in host memory whose pages can be given back (``_util.pages``), for
        trainer.shard=parameters: the ``PagedVector`` the engine was built on with ``paged_params=True``."""
        return self.variables.page_params()

    def parameter_units(self) -> Tuple[Optional[torch.nn.Module], List[torch.Tensor]]:
        return self.module, list(self.params.values())

    def frozen_units(self) -> List[torch.Tensor]:
        """The frozen parameters in ``frozen_pages`` (``paged_params=True``), in its order."""
        return self.variables.frozen_units()

    def frozen_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of each frozen parameter in ``frozen_pages``, in its order."""
        return self.variables.frozen_layout()

    def zero_grad_range(self, lo: int, hi: int) -> None:
        self.variables.zero_grad_range(lo, hi)

    def grad_in(self, lo: int, hi: int) -> None:
        """trainer.shard=parameters: the gradient's memory over [lo, hi) mapped before backward writes it (a GPU's
        is unmapped where given back; the host's pages need nothing: ``_util/pages.py``)."""
        self.variables.grad_in(lo, hi)

    def params_written(self) -> None:
        """Nothing to do: ``flat_params()`` IS the parameters, so writing it wrote the model."""

    # -- the same result for any number of workers: randomness per micro-batch, buffers reconciled
    def seed(self, value: int) -> None:
        """Seed the generator behind dropout (``ops.dropout``, ``nn.Dropout``, ``F.dropout``, attention
        dropout) for the next micro-batch. The default generator's own seeding (~2 us), not
        ``torch.manual_seed`` (~350 us: it visits every device's generator). On a GPU, the GPU's
        generator: dropout there draws from it."""
        if self.device.type == "cpu":
            torch.default_generator.manual_seed(value)
        else:
            torch.cuda.default_generators[self.device.index or 0].manual_seed(value)

    def buffer_rules(self) -> Dict[str, Rule]:
        """How each buffer combines across workers (``native.buffer_rules``): BatchNorm's running statistics
        by its momentum, its counter by sum, other persistent buffers by the default rule."""
        return self.variables.buffer_rules()

    def buffer_arrays(self) -> Dict[str, np.ndarray]:
        """Every buffer by name, as numpy views of the live tensors (made once: BatchNorm, load_state and
        set_buffers all write in place, so the views stay the buffers' own). On a GPU, host copies taken
        now (a sync point); ``set_buffers`` copies back."""
        return self.variables.buffer_arrays()

    def set_buffers(self, values: Dict[str, np.ndarray]) -> None:
        self.variables.set_buffers(values)
