"""The TensorFlow backend's ``Engine``: GradientTape, the flat gradient buffer, and the steps that run them.

Gradients accumulate into one flat float32 variable, so a distributed reduction is one call on
one buffer (``Engine.grad_view()`` hands it to torch.distributed without a copy). The
per-micro-batch gradient step is a ``tf.function`` (called through its flat entry point:
``compiled.py``), and the optimizer update runs inside the next step's call (one dispatch
per step, like a hand-written loop). ``backend.jit=false`` runs both eagerly for debugging.

Mixed precision (``trainer.precision=bf16|16``) keeps float32 variables and optimizer slots and
computes forward() and its backward in the low dtype: a keras model through keras's mixed policy,
a params dict by casting the parameters and the inputs' floats inside the step.

The Engine owns three collaborators: ``variables.Variables`` (the model's variables in the flat order and
their views by name), ``optim.FlatOptimizer`` (slots, update count, the update's scalars) and
``devices.Precision`` (the compute dtype and the loss scale). What stays here is the step: forward()
under the tape, the gradient buffer, and when the deferred update runs.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf  # imported quietly already: tensorflow/__init__.py imports it before this module

from ..buffers import Rule
from ...config.devices import Placement
from ...config.optim import Hyper, OptimizerSpec
from ..common import (WEIGHT, WholeParameters, activate, buckets, check_loss, check_trainable, set_training,
                      state_names, training)
from . import ops as tf_ops
from . import optim as tf_optim
from .compiled import Compiled
from .data import _on_rows, _split
from .devices import Precision
from .native import reseed, seed_generators, with_model_losses
from .ops import _generator
from .variables import Variables

# What an Engine activates for elasticflow.ops: the backend package, which is importing this module now
# (looked up, not imported: an import of the package from here would be a cycle).
_SELF = sys.modules[__package__]


def _size(x: Any) -> Optional[int]:
    """check_loss's test: the number of elements of a TF tensor (-1 while a dimension is unknown),
    None for anything else."""
    if not tf.is_tensor(x):
        return None
    n = x.shape.num_elements()
    return -1 if n is None else n


def _check_loss(out: Any, where: str):
    """forward()'s output as (scalar loss, {metric: float32 scalar}); see ``common.check_loss``."""
    loss, metrics = check_loss(out, where, _size, "tensorflow")
    return tf.reshape(loss, []), {k: tf.reshape(tf.cast(v, tf.float32), []) for k, v in metrics.items()}


class Engine(WholeParameters):
    """GradientTape, the flat gradient buffer and the compiled steps of one worker, over its variables and optimizer.

    Args:
        model: what ``model(cfg)`` returned, without the "optimizer" key: a (nested) dict of
            arrays, or a keras model / ``tf.Module`` (its forward() calls
            ``params(x, training=ops.training())``).
        forward: the user's ``forward(*batch, params)``.
        spec: the optimizer spec.
        jit: compile the gradient step and the update with ``tf.function``.
        placement: device and precision (``devices.Placement``); None: the CPU in float32.

    A dict model's float arrays live in ONE flat variable (``Variables``); forward() receives a dict
    of views of it, sliced inside the compiled step, and its gradient arrives flat. A native model's
    variables stay its own: its gradients are concatenated into the flat buffer.

    A keras model trains as ``fit()`` trains it: its own losses (regularizers, ``add_loss``) join
    forward()'s loss, weighted with it, and in the loss reported; a weight with ``trainable=False``
    is state (checkpointed, restored) outside the gradient, the optimizer and the reconciliation of
    buffers. Parameter groups (``optimizer.groups``/``no_decay``) give each parameter its group's lr
    and weight decay; the flat order keeps each group contiguous (``flat_runs()``).

    In bf16/16 the variables and slots stay float32 and forward() computes in the low dtype; the loss
    enters the backward as float32, times ``grad_scale`` (float16's loss scaling): see ``Precision``.

    Note: under jit, forward() is traced once per micro-batch shape, training flag and
    first-or-later micro-batch of a step, not run on every call: Python control flow on tensor
    values and Python side effects need ``backend.jit=false``. In bf16/16 a dict model's float
    inputs are rounded to the compute dtype (float targets of a regression included), and TF does
    not promote dtypes: a float32 tensor forward() makes itself needs ``ops.cast(t, "float32")``,
    which then means the compute dtype. A ``tf.Module`` computes in its variables' dtype: float32 only.
    """
    EXACT_SQRT = True  # a sharded update (replica/flat_update.py) takes Adam's root correctly rounded, as optim.py

    def __init__(self, model: Any, forward, spec: OptimizerSpec, jit: bool = True,
                 placement: Placement = None):
        self.forward = forward
        self.spec = spec
        self.jit = jit
        self.placement = placement or Placement()
        self.grad_scale = 1.0  # the backward runs on loss * grad_scale (float16 loss scaling)
        self.compiling = False  # tf.function traces in about a second: nothing to announce
        _generator()
        self.precision = Precision(self.placement, model)
        self._seed, self._seed_generators = 0, seed_generators(model)
        self.variables = v = Variables(model, spec)
        # The names the layers above and the tests read, as the variables hold them.
        self.native, self.buffers, self.frozen = v.native, v.buffers, v.frozen
        self.param_names, self.num_params = v.names, v.num_params
        self.flat_grad = tf.Variable(tf.zeros([self.num_params], tf.float32), trainable=False)
        self.optimizer = tf_optim.FlatOptimizer(v, self.flat_grad)
        self._zero_pending = False  # zero_grad() is folded into the next accumulate (one op fewer per step)
        self._pending_update = False  # apply() ran; its update runs in the next compiled call
        # The micro-batch weight lives in a variable the compiled step reads, as the update's scalars do
        # (optim.FlatOptimizer.k): every argument of a tf.function call costs its own share of the
        # call's dispatch, so the step's only argument is the batch (or just its row indices).
        self._metric_names: List[str] = []  # forward()'s metrics, in the order the step returns them
        self._weight_value = 1.0
        self._weight = tf.Variable(1.0, trainable=False)
        # Variants are separate functions, not Python arguments: binding a Python value costs
        # as much per call as a small step. The training flag is read at trace time.
        # key: (training, first micro-batch, runs the update, id of the resident tensors or None)
        self._grad_fns: Dict[Tuple[bool, bool, bool, Optional[int]], Any] = {}
        self._eval_fns: Dict[Tuple[bool, Optional[int]], Any] = {}
        # Not XLA: on its own an XLA update is faster (one fused sweep instead of one per op), but
        # it runs inside the next step's call, where an XLA cluster's launch and variable copies
        # cost more than they save (measured: +8% per step at 300k parameters, +9% at 5k).
        # Takes no argument, so the public call: it runs only when something reads the state early.
        self._apply_fn = self._compile_update()
        self._reached = np.ones(len(self.param_names), dtype=bool)  # took_part(): known once a step is traced

    def _compile(self, step):
        """``step(batch)`` as the compiled function the Engine calls, or as it is without jit."""
        return Compiled(step) if self.jit else step

    def _compile_update(self):
        """The optimizer's update on its own (when something reads the state before the next step's call)."""
        update = self.optimizer.update
        return tf.function(update, autograph=False) if self.jit else update

    # -- one step
    def train_mode(self, training: bool) -> None:
        set_training(training)

    def zero_grad(self) -> None:
        # Deferred: the next accumulate() assigns instead of adding. Whatever reads the buffer
        # first (_settle) zeroes it if no micro-batch came (a worker with an empty share).
        self._zero_pending = True

    def _flush(self) -> None:
        """Run a deferred update now: something is about to read the parameters or the gradient."""
        if self._pending_update:
            self._pending_update = False
            self._apply_fn()

    def _settle(self) -> None:
        self._flush()
        if self._zero_pending:
            # A fresh zeros tensor, not a kept constant: the variable would alias the constant
            # and the next write would copy on write.
            self.flat_grad.assign(tf.zeros([self.num_params], tf.float32))
            self._zero_pending = False

    def accumulate(self, batch, weight: float):
        """Add the gradient of ``weight * loss`` of one micro-batch to the flat buffer; returns weighted (loss, metrics).

        ``batch``: a tuple of tensors, or ``Rows`` (from ``gather``), gathered inside the compiled step.
        """
        fresh, update = self._zero_pending, self._pending_update
        if update and not fresh:  # not the trainer's order; keep it correct anyway
            self._flush()
            update = False
        if self.precision.set_scale(self.grad_scale):  # scaling outside float16: the steps are traced again
            self._grad_fns.clear()
        source, inputs = _split(batch)
        key = (training(), fresh, update, None if source is None else id(source))
        fn = self._grad_fns.get(key)
        if fn is None:
            step = _on_rows(lambda b: self._grad_step(b, fresh, update), source)
            fn = self._grad_fns[key] = self._compile(functools.partial(self._seeded, step, source is not None))
        if weight != self._weight_value:  # one micro-batch per step (weight 1): never
            self._weight.assign(weight)
            self._weight_value = weight
        self._zero_pending, self._pending_update = False, False
        # The micro-batch's seed rides in as an input (~10 us to make the tensor); assigning it to a
        # variable from Python instead would be an eager op of its own (~150 us here).
        seed = tf.constant(self._seed, tf.int64)
        out = fn((seed, inputs) if source is not None else (seed, *inputs))
        # numpy scalars, not tensors: the trainer sums them, and on TF's eager runtime each sum of
        # two tensors is an op dispatch (tens of microseconds); float32 numpy keeps torch's rounding.
        # One tensor for all of them: one conversion instead of one each.
        values = out.numpy()
        return values[0], dict(zip(self._metric_names, values[1:]))

    def _seeded(self, step, rows: bool, packed):
        """Reseed every generator forward() draws from with ``packed[0]``, then ``step`` on the batch."""
        reseed(packed[0], self._seed_generators)
        return step(packed[1] if rows else tuple(packed[1:]))

    def _grad_step(self, batch, fresh: bool, update: bool):
        activate(_SELF)  # forward()'s elasticflow.ops calls come here (at trace time), whichever backend ran last
        if update:
            # The previous step's update, then this step's gradient, in one call: the update reads
            # the gradient buffer before the assign below overwrites it (TF orders the two uses of
            # the variable as written).
            self.optimizer.update()
        weight = tf.convert_to_tensor(self._weight)
        with tf.GradientTape() as tape:
            loss, metrics = self._forward(batch, "for a micro-batch")
            own = metrics.pop(WEIGHT, None)  # forward()'s weight (target tokens) replaces the sample share
            weight = weight if own is None else tf.stop_gradient(tf.cast(own, tf.float32))
            weighted = loss * weight  # differentiate the weighted loss, as torch's (loss * weight).backward()
            scaled = self.precision.scaled(weighted)
        # Which parameters the loss reaches (Keras skips a None gradient), known at trace time: a dict model's
        targets = self.variables.targets
        pieces = self.variables.pieces if self.native is None else []  # ... asked of its pieces, in the same pass
        grads = tape.gradient(scaled, targets + pieces, unconnected_gradients=tf.UnconnectedGradients.NONE)
        self._reached = np.array([g is not None for g in (grads[len(targets):] or grads)])
        grads = [tf.zeros_like(t) if g is None else g for t, g in zip(targets, grads)]
        tf_optim.note_sparse(self.spec, [n for n, g in zip(self.param_names, grads) if isinstance(g, tf.IndexedSlices)])
        # convert_to_tensor: a native embedding's gradient arrives as IndexedSlices.
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads], 0)
        if fresh:  # the step's first micro-batch overwrites: zero_grad() costs nothing
            self.flat_grad.assign(flat)
        else:
            self.flat_grad.assign_add(flat)
        # At trace time: the order of the values returned; forward()'s weight last, as it is (the trainer divides).
        self._metric_names = names = sorted(metrics) + ([WEIGHT] if own is not None else [])
        return tf.stack([weighted] + [weight if k == WEIGHT else tf.cast(metrics[k], tf.float32) * weight
                                      for k in names])

    def grad_norm(self) -> float:
        self._settle()
        return float(tf.norm(self.flat_grad))

    def grad_finite(self) -> bool:
        self._settle()  # the sum, not a mask of is_finite: one read of the gradient and no temporary
        return bool(tf.math.is_finite(tf.reduce_sum(self.flat_grad)))

    def scale_grad(self, factor: float) -> None:
        self._settle()
        self.flat_grad.assign(self.flat_grad * tf.constant(factor, tf.float32))

    def grad_view(self):
        """The accumulated flat gradient as a 1-D float32 ``torch.Tensor`` sharing its memory (DLPack).

        Call it after the micro-batches and before ``apply()``: an in-place edit (an allreduce)
        is what ``apply()`` then uses. The layout is torch's: parameters in model() order.

        Note: the view is valid for this step only. TF copies a variable on its next write while
        another reference to its buffer lives, so after zero_grad(), accumulate() or
        scale_grad() the old view no longer aliases the gradient; take a new one each step.
        """
        import torch  # only the distributed path pays for torch under backend=tensorflow

        self._settle()
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(self.flat_grad.value()))

    def buckets(self, bucket_bytes: int) -> List[Tuple[int, int]]:
        """The flat gradient's buckets (``common.buckets``), for ``comm.bucket_mb``.

        Note: ``GradientTape.gradient`` returns every gradient at once, with no callback per
        variable, so the buckets all start when the step's gradient is complete, not during backward.
        """
        return buckets(self.variables.sizes, bucket_bytes)  # per parameter, also of a dict model's one flat variable

    def arm(self, ranges: List[Tuple[int, int]], on_ready: Optional[Any]) -> None:
        """Nothing to arm: no bucket ever reports during backward (see ``buckets``), so the caller
        starts every bucket once the step's gradient is complete."""

    def fold_buffer(self, extra: int) -> None:
        """None: no room is kept after the flat gradient (a variable, handed out through DLPack),
        so the caller reduces the step's scalars beside the gradient, not folded into it."""
        return None

    def took_part(self) -> np.ndarray:
        """Per parameter (flat order): whether the loss reaches it. Static here (the traced graph's), where
        torch tells it per backward: a keras layer or an array that forward() never uses has no gradient."""
        return self._reached

    def apply(self, lr: float, took_part: Optional[np.ndarray] = None, sat_out: Optional[np.ndarray] = None) -> None:
        """One optimizer update from the flat gradient, with torch.optim's formulas; ``took_part``,
        ``sat_out``: as the torch Engine's (what takes no part is left alone). The scalars (lr, bias
        corrections, ...) are computed in Python doubles and rounded to float32 once, as torch does.

        Note: the update runs at the start of the next accumulate()'s compiled call (one call
        per step instead of two: each costs ~0.1 ms of dispatch), or as soon as anything reads
        parameters, gradient or state (evaluate, state, grad_*); nothing can observe the delay.
        """
        self._settle()
        if self.optimizer.step(lr, took_part, sat_out):  # the update is traced into the steps: trace again
            self._grad_fns.clear()
            self._apply_fn = self._compile_update()
        self._pending_update = True

    def evaluate(self, batch) -> Dict[str, float]:
        self._flush()
        source, inputs = _split(batch)
        key = (training(), None if source is None else id(source))
        fn = self._eval_fns.get(key)
        if fn is None:
            fn = self._eval_fns[key] = self._compile(_on_rows(self._eval_step, source))
        loss, metrics = fn(inputs)
        return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}}

    def _eval_step(self, batch):
        activate(_SELF)
        return self._forward(batch, "in evaluation")

    def _forward(self, batch, where: str):
        """forward() on ``batch`` as (float32 scalar loss, float32 metrics), in the compute dtype."""
        compute = self.precision.compute
        if compute is None:
            loss, metrics = _check_loss(self.forward(*batch, params=self.variables.params(None)), where)
            return with_model_losses(self.native, loss), metrics  # keras's regularizers, as fit() adds them
        if self.native is None:
            batch = self.precision.inputs(batch)
        with tf_ops.computing(compute):
            loss, metrics = _check_loss(self.forward(*batch, params=self.variables.params(compute)), where)
        return with_model_losses(self.native, tf.cast(loss, tf.float32)), metrics

    # -- state, by name, as numpy (backend-neutral checkpoints)
    def state(self, copy: bool = True) -> Dict[str, np.ndarray]:
        """Parameters, buffers and optimizer slots by name, as numpy arrays (see the torch Engine).

        ``copy=False`` returns views of the variables' current buffers, without a copy. They stay
        as they are: a variable whose buffer is still referenced copies it before its next
        in-place update (TensorFlow's copy-on-write), so the views are a snapshot.
        """
        self._flush()
        return {**self.variables.state(copy), **self.optimizer.state(copy)}

    def load_state(self, state: Dict[str, np.ndarray], optimizer_steps: int) -> None:
        # A parameter without saved slots was frozen when they were saved. SGD starts its momentum
        # afresh (zeros), as torch does; Adam's bias correction counts one step for the whole
        # model, so the resumed run would not be the one torch trains: refused, as the torch Engine does.
        check_trainable(state, self.param_names, self.spec.slots(), optimizer_steps)
        self._pending_update = False  # overwritten below in any case
        self.variables.load(state)
        self.optimizer.load(state, optimizer_steps)

    def state_names(self) -> List[str]:
        return state_names(self.param_names, [*self.buffers, *self.frozen], self.spec.slots())

    # -- sharded optimizer state (elasticflow/replica/shard.py)
    def flat_slots(self) -> Dict[str, Any]:
        """None flat: the slots are a variable per parameter, and reading one copies it (elastic.fingerprint
        compares the parameters only here)."""
        return {}

    def flat_params(self):
        """The parameters as one flat float32 torch tensor, in the flat gradient's order, read from the
        variables now. A copy (a variable cannot be written through DLPack): whoever writes it calls
        ``params_written()``. The same tensor every call."""
        self._flush()
        return self.variables.flat_params()

    def params_written(self) -> None:
        """Assign ``flat_params()``'s tensor back to the variables (one assign per variable)."""
        self.variables.params_written()

    def flat_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of each parameter, in the flat order (each optimizer group contiguous)."""
        return self.variables.layout()

    def flat_runs(self) -> List[Tuple[int, int, Hyper]]:
        """[(lo, hi, hyper)]: the flat gradient cut into stretches of equal lr scale and weight decay, in
        ``flat_layout()``'s order (one stretch without groups); a sharded update applies them."""
        return self.optimizer.groups.runs(self.variables.sizes)

    def reset_optimizer(self) -> None:
        """Start the optimizer afresh: zero slots, no updates counted (train/local_sgd.py: each round's inner optimizer)."""
        self.optimizer.reset()

    def release_optimizer(self) -> None:
        """Drop the whole-model slot variables: a sharded update (trainer.shard) replaces ``apply``."""
        self.optimizer.release()

    # -- the same result for any number of workers: randomness per micro-batch, buffers reconciled
    def seed(self, value: int) -> None:
        """The seed of the next micro-batch's generators (``ops.dropout``'s and keras layers'); it enters
        the compiled step as an input, which reseeds them in-graph."""
        self._seed = value

    def buffer_rules(self) -> Dict[str, Rule]:
        """A native model's buffers by their rule (keras BatchNormalization: its moving statistics).
        A dict model's integer arrays are constants forward() never changes: none."""
        return self.variables.buffer_rules()

    def buffer_arrays(self) -> Dict[str, np.ndarray]:
        return self.variables.buffer_arrays()

    def set_buffers(self, values: Dict[str, np.ndarray]) -> None:
        self.variables.set_buffers(values)
