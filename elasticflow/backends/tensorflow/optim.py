"""The TensorFlow backend's optimizer updates: torch.optim's formulas, or a compiled keras optimizer's.

SGD (momentum, nesterov, weight decay), Adam (L2 weight decay) and AdamW (decoupled), with torch's
slot names (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``) and its float32 rounding of the
scalars, so a checkpoint moves between backends and both take the same steps.

A keras SGD, Adam or AdamW that model() returns (a model compiled with it, or under ``"optimizer"``) trains
with keras's own formulas instead, as ``model.fit`` would (``KerasSGD``, ``KerasAdam``): keras's Adam adds
epsilon to the root of the uncorrected second moment and folds both bias corrections into the step size, its
momentum holds ``lr * gradient``, and its weight decay (any optimizer's) is decoupled. Other keras optimizers
and options (clipping, EMA, a learning-rate function, amsgrad) are refused in one line, never approximated; a
keras ``LearningRateSchedule`` drives the lr, stepped as keras steps it (``_keras_schedule``).

Parameter groups (``optimizer.groups``, ``optimizer.no_decay``) are torch.optim's: each group's lr and
weight decay in its own row of scalars. ``Groups`` orders the parameters so a group is contiguous in the
flat vector; a variable (a native model's) takes its group's row, the one flat variable of a dict model
is updated run by run (``apply_runs``) and assigned once. ``FlatOptimizer`` holds an Engine's optimizer
state (slots, update count, the update's scalars) over those variables, as torch's ``FlatSGD``/``FlatAdam`` do.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ...config import optim
from ...errors import ElasticFlowError
from ...config.optim import SGD, Adam, AdamW, Hyper, OptimizerSpec

log = logging.getLogger("elasticflow")


class Groups:
    """The optimizer's groups over an Engine's parameters (``optim.hypers``).

    Args:
        names: the parameters that train, in the model's order.
        owners, by_identity: as ``optim.hypers`` takes them (a keras model's layer classes, its variables).

    ``order`` is ``names`` with each group contiguous (the flat order), ``settings`` the distinct
    hyperparameters in that order: setting ``r`` is row ``r`` of ``scalars()``. Without groups, one row.
    """

    def __init__(self, spec: OptimizerSpec, names: Sequence[str], owners: Mapping[str, str] = {},
                 by_identity: Mapping[int, str] = {}):
        self.spec = spec
        self.hyper = optim.hypers(spec, names, owners, by_identity)
        self.order = optim.grouped_order(names, self.hyper)
        self.settings: List[Hyper] = list(dict.fromkeys(self.hyper[n] for n in self.order))
        self.skip: frozenset = frozenset()  # indices into ``order`` that the update leaves alone (no gradient)

    def row(self, name: str) -> int:
        return self.settings.index(self.hyper[name])

    def runs(self, sizes: Sequence[int]) -> List[Tuple[int, int, Hyper]]:
        """[(lo, hi, hyper)] of the flat vector of ``order`` (``sizes`` elements each)."""
        return optim.runs(self.order, sizes, self.hyper)

    def leave_alone(self, took_part: Optional[Sequence[bool]], sat_out: Optional[Sequence[int]]) -> bool:
        """Set ``skip``: the parameters that took no part in the step (``Engine.took_part``); returns whether it
        changed. The set is the traced graph's (static), so the rest take every step: one count for them all,
        which is all this backend keeps; a parameter that sat steps out and takes part now is refused."""
        skip = frozenset() if took_part is None else frozenset(i for i, took in enumerate(took_part) if not took)
        if sat_out is not None and any(n > 0 for i, n in enumerate(sat_out) if i not in skip):
            raise ElasticFlowError("a parameter that sat out optimizer steps (it had no gradient) has one now, "
                                   "and the TensorFlow backend counts one step for every parameter",
                                   "resume this checkpoint with backend=torch, or pass resume=none")
        changed, self.skip = skip != self.skip, skip
        return changed

    def scalars(self, lr: float, step: int) -> tuple:
        """Every row's ``scalars()`` one after the other; a group's lr is ``lr`` times its ``lr_scale``
        (a schedule moves every group in proportion, as torch's schedulers do)."""
        return tuple(x for h in self.settings
                     for x in scalars(self.spec, lr * h.lr_scale, step, h.weight_decay))

    def apply(self, k: tf.Tensor, params: List[tf.Variable], grads: List[tf.Tensor],
              slots: Dict[str, List[tf.Variable]], sizes: Sequence[int]) -> None:
        """Update ``params`` from ``grads``: a variable per name of ``order``, or one flat variable of
        ``order`` (``sizes`` elements each). ``k``: the tensor of ``scalars()``."""
        k = tf.unstack(k)
        n = len(k) // len(self.settings)
        rows = [k[r * n:(r + 1) * n] for r in range(len(self.settings))]
        if len(params) == len(self.order):
            chosen = [self.row(name) for name in self.order]
            apply(self.spec, [rows[r] for r in chosen], params, grads, slots,
                  [self.settings[r].weight_decay != 0 for r in chosen], self.skip)
            return
        segments: List[list] = []  # [(row, skipped), elements]: runs of one group, cut where skipping changes
        for i, (name, size) in enumerate(zip(self.order, sizes)):
            key = (self.row(name), i in self.skip)
            if segments and segments[-1][0] == key:
                segments[-1][1] += size
            else:
                segments.append([key, size])
        apply_runs(self.spec, [rows[r] for (r, _), _ in segments], params[0], grads[0], slots,
                   [size for _, size in segments], [self.settings[r].weight_decay != 0 for (r, _), _ in segments],
                   [skipped for (_, skipped), _ in segments])


class FlatOptimizer:
    """An Engine's optimizer state over its variables: the slots, the updates counted, and the update's scalars.

    Args:
        variables: the Engine's ``Variables`` (the targets it updates, their groups, the by-name views).
        flat_grad: the flat float32 gradient variable the update reads.

    ``update()`` is graph code, traced into the Engine's compiled steps (or a tf.function of its own): the
    scalars (lr, bias corrections...) ride in a variable (``k``), so a new lr is no retrace.
    """

    def __init__(self, variables: Any, flat_grad: tf.Variable):
        self.groups = variables.groups
        self._variables, self._flat_grad = variables, flat_grad
        # Zeros, not torch's "copy of the first gradient" for momentum: momentum * 0 + g == g
        # exactly, so the first update needs no separate compiled function.
        self.slots = {slot: [tf.Variable(tf.zeros(s, tf.float32), trainable=False) for s in variables.target_shapes]
                      for slot in self.groups.spec.slots()}
        self.live = False  # torch creates optimizer state at the first update; state() follows
        self.updates = 0   # updates applied since the optimizer state was fresh (bias correction)
        # The update's scalars live in a variable the compiled step reads: every argument of a tf.function
        # call costs its own share of the call's dispatch.
        self._scalars = ()
        self.k = tf.Variable(tf.zeros([len(self.groups.scalars(0.0, 1))], tf.float32), trainable=False)

    def step(self, lr: float, took_part: Optional[Sequence[bool]], sat_out: Optional[Sequence[int]]) -> bool:
        """Count one update at ``lr`` and set its scalars (in Python doubles, rounded to float32 once, as torch
        does); returns whether the parameters it leaves alone changed, and with them the traced update."""
        changed = self.groups.leave_alone(took_part, sat_out)
        step = self.updates + 1
        scalars = self.groups.scalars(lr, step)
        if scalars != self._scalars:  # constant-lr SGD: the same scalars every step, no eager op
            self.k.assign(np.array(scalars, np.float32))
            self._scalars = scalars
        self.updates = step
        self.live = True
        return changed

    def update(self) -> None:
        """The update's graph: the flat gradient cut per target variable, then ``Groups.apply``."""
        v = self._variables
        grads = tf.split(tf.convert_to_tensor(self._flat_grad), v.target_sizes)
        grads = [tf.reshape(g, shape) for g, shape in zip(grads, v.target_shapes)]
        self.groups.apply(tf.convert_to_tensor(self.k), v.targets, grads, self.slots, v.sizes)

    def state(self, copy: bool = True) -> Dict[str, np.ndarray]:
        """The slots as ``optimizer/{parameter}/{slot}`` arrays; none before the first update."""
        out: Dict[str, np.ndarray] = {}
        if self.live:
            for slot, variables in self.slots.items():
                out.update({f"optimizer/{n}/{slot}": a for n, a in self._variables.by_name(variables, copy).items()})
        return out

    def load(self, state: Dict[str, np.ndarray], steps: int) -> None:
        """Slots from ``state``; a parameter without saved slots (frozen when they were saved) starts at zeros."""
        v = self._variables
        have = {n for n in v.names if all(f"optimizer/{n}/{slot}" in state for slot in self.slots)}
        self.live = bool(self.slots) and bool(have)
        for slot, variables in self.slots.items():
            v.assign_by_name(variables, {n: state[f"optimizer/{n}/{slot}"] if n in have
                                         else np.zeros(shape, np.float32) for n, shape in zip(v.names, v.shapes)})
        self.updates = steps if self.live else 0

    def reset(self) -> None:
        """Zero slots, no updates counted: as just built (each local SGD round's inner optimizer)."""
        for variables in self.slots.values():
            for var in variables:
                var.assign(np.zeros(var.shape, np.float32))
        self.live, self.updates = False, 0

    def release(self) -> None:
        """Drop the whole-model slot variables: a sharded update (trainer.shard) replaces this one."""
        self.slots, self.live = {}, False


class KerasSGD(SGD):
    """keras.optimizers.SGD's update: ``m = momentum * m - lr * g; w += m`` (Nesterov: ``w += momentum * m -
    lr * g``), its momentum slot named ``momentum`` (it holds lr times torch's buffer); decoupled weight decay."""
    formulas = "keras"

    def slots(self):
        return ("momentum",) if self.momentum else ()


class KerasAdam(Adam):
    """keras.optimizers.Adam's (and AdamW's) update: the moments as torch's, then ``w -= m * lr * sqrt(1 - b2^t)
    / (1 - b1^t) / (sqrt(v) + eps)``; weight decay decoupled (``w -= w * wd * lr``, before the update)."""
    formulas = "keras"


def scalars(spec: OptimizerSpec, lr: float, step: int, weight_decay: float = None) -> tuple:
    """The update's scalars for optimizer step ``step`` (1-based), in Python doubles.

    They are rounded to float32 once, as torch does with its Python-number arguments; the
    compiled update reads them from a variable, so a new lr or bias correction is no retrace.
    ``weight_decay``: a group's (None: the spec's).
    """
    wd = spec.weight_decay if weight_decay is None else weight_decay
    if spec.formulas == "keras":  # (lr, momentum or eps, [1 - b1, 1 - b2, step,] wd): _keras_update computes
        # the rest in float32 as keras does (Adam's step size from float32 betas, lr * wd rounded twice)
        if isinstance(spec, SGD):
            return (lr, spec.momentum, wd)
        b1, b2 = spec.betas
        return (lr, spec.eps, 1 - b1, 1 - b2, step, wd)
    if isinstance(spec, SGD):
        return (lr, wd, spec.momentum)
    b1, b2 = spec.betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    return (lr / bc1, bc2 ** 0.5, spec.eps, 1 - b1, b2, 1 - b2, wd, 1 - lr * wd)


def update(spec: OptimizerSpec, k: Sequence[tf.Tensor], w: tf.Tensor, g: tf.Tensor, slots: Dict[str, tf.Tensor],
           decay: bool) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """One step of ``w`` (with gradient ``g`` and optimizer state ``slots``): (new w, new slots).
    ``k``: ``scalars(...)`` as tensors; ``decay``: whether the weight decay is not zero (known at trace time)."""
    if spec.formulas == "keras":
        return _keras_update(spec, k, w, g, slots, decay)
    if isinstance(spec, SGD):
        new: Dict[str, tf.Tensor] = {}
        if decay:
            g = _fused(g, k[1], w)                 # torch: torch.add(g, w, alpha=weight_decay)
        if spec.momentum:
            buf = slots["momentum_buffer"] * k[2] + g  # torch: buf.mul_(momentum).add_(g)
            new["momentum_buffer"] = buf
            g = _fused(g, k[2], buf) if spec.nesterov else buf  # torch: torch.add(g, buf, alpha=momentum)
        return _fused(w, -k[0], g), new           # torch: param.add_(g, alpha=-lr)
    if decay:
        if isinstance(spec, AdamW):
            w = w * k[7]  # decoupled: param *= 1 - lr * weight_decay
        else:
            g = _fused(g, k[6], w)
    m, v = slots["exp_avg"], slots["exp_avg_sq"]
    if 1 - spec.betas[0] < 0.5:                # torch: exp_avg.lerp_(grad, 1 - beta1), from the nearer end
        m_new = _fused(m, k[3], g - m)
    else:
        m_new = _fused(g, k[3] - 1, g - m)
    v_new = _fused(v * k[4], k[5] * g, g)      # torch: exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
    denom = _sqrt(v_new) / k[1] + k[2]         # sqrt(v) / sqrt(bias_correction2) + eps
    return w + (-k[0] * m_new) / denom, {"exp_avg": m_new, "exp_avg_sq": v_new}  # torch: addcdiv_(value=-lr/bc1)


def _sqrt(v: tf.Tensor) -> tf.Tensor:
    """The float32 square root correctly rounded, as torch's: TensorFlow's CPU kernel (Eigen's fast math) is off by
    an ulp for some elements; float64's, rounded to float32, is exact (53 >= 2 * 24 + 2 bits)."""
    return tf.cast(tf.math.sqrt(tf.cast(v, tf.float64)), tf.float32)


def _fused(a: tf.Tensor, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """``a + x * y`` rounded once to float32, as torch's fused CPU kernels round it (``add`` with ``alpha``,
    ``lerp``, ``addcmul``'s last step): the product is exact in float64 and the sum rounds there first, which
    differs from one rounding only where the float64 sum falls exactly halfway between two float32s. Two float32
    roundings (TensorFlow's ``a + x * y``) differ from torch's in ~10% of elements, and a sharded update
    (``replica/flat_update.py``, torch's ops) must give the bits this update gives (tests/test_combinations.py:
    bf16 turned that last bit into 3e-3 in 6 steps)."""
    d = tf.float64
    return tf.cast(tf.cast(a, d) + tf.cast(x, d) * tf.cast(y, d), tf.float32)


def _keras_update(spec: OptimizerSpec, k: Sequence[tf.Tensor], w: tf.Tensor, g: tf.Tensor, slots: Dict[str, tf.Tensor],
                  decay: bool) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """``update`` with keras's formulas (keras/src/optimizers: sgd.py, adam.py, base_optimizer's weight decay)."""
    if decay:
        w = w - w * k[-1] * k[0]  # keras: variable - variable * wd * lr, before the step
    if isinstance(spec, SGD):
        if not spec.momentum:
            return w - g * k[0], {}
        m = slots["momentum"] * k[1] - g * k[0]
        return w + (m * k[1] - g * k[0] if spec.nesterov else m), {"momentum": m}
    m = slots["exp_avg"] + (g - slots["exp_avg"]) * k[2]
    v = slots["exp_avg_sq"] + (g * g - slots["exp_avg_sq"]) * k[3]
    # The step size as keras's graph computes it, from float32 betas: in doubles from the exact betas it is ~6e-6
    # (relative) away in early steps (float32(0.999) is 1.3e-8 off, and 1 - beta_2^t cancels), which Adam carries
    # (issue 63 saw 3e-3 from model.fit). Six scalar ops per variable, as in keras's own update.
    b1, b2 = (tf.constant(b, tf.float32) for b in spec.betas)
    alpha = k[0] * tf.math.sqrt(1 - tf.pow(b2, k[4])) / (1 - tf.pow(b1, k[4]))
    return w - (m * alpha) / (tf.math.sqrt(v) + k[1]), {"exp_avg": m, "exp_avg_sq": v}


def apply(spec: OptimizerSpec, ks: Sequence[Sequence[tf.Tensor]], params: List[tf.Variable], grads: List[tf.Tensor],
          slots: Dict[str, List[tf.Variable]], decays: Sequence[bool], skip: frozenset = frozenset()) -> None:
    """Update ``params`` in place from ``grads`` (same shapes); ``ks[i]``/``decays[i]``: the scalars of
    ``params[i]``'s group as tensors, and whether it decays; ``skip``: indices left alone."""
    for i, (p, g) in enumerate(zip(params, grads)):
        if i in skip:
            continue
        w, new = update(spec, ks[i], tf.convert_to_tensor(p), g,
                        {s: tf.convert_to_tensor(v[i]) for s, v in slots.items()}, decays[i])
        for s, value in new.items():
            slots[s][i].assign(value)
        p.assign(w)


def apply_runs(spec: OptimizerSpec, ks: Sequence[Sequence[tf.Tensor]], param: tf.Variable, grad: tf.Tensor,
               slots: Dict[str, List[tf.Variable]], sizes: Sequence[int], decays: Sequence[bool],
               skipped: Sequence[bool] = ()) -> None:
    """Update the one flat variable ``param`` (and its one slot variable each) cut into runs of ``sizes``
    elements, run ``j`` with ``ks[j]``/``decays[j]`` (or left as it is where ``skipped[j]``): one assign per
    variable, a few ops per run."""
    skipped = list(skipped) or [False] * len(sizes)
    if len(sizes) == 1:
        return None if skipped[0] else apply(spec, ks, [param], [grad], slots, decays)
    parts = zip(tf.split(tf.convert_to_tensor(param), sizes), tf.split(grad, sizes),
                *(tf.split(tf.convert_to_tensor(v[0]), sizes) for v in slots.values()))
    done = [(w, dict(zip(slots, pieces))) if skip else update(spec, k, w, g, dict(zip(slots, pieces)), decay)
            for k, decay, skip, (w, g, *pieces) in zip(ks, decays, skipped, parts)]
    for s, v in slots.items():
        v[0].assign(tf.concat([new[s] for _, new in done], 0))
    param.assign(tf.concat([w for w, _ in done], 0))


def spec_from_native(opt: Any, scheduler: Any = None) -> Optional[OptimizerSpec]:
    """The spec of a keras SGD, Adam or AdamW, given itself or a keras model compiled with it (``KerasSGD``,
    ``KerasAdam``: keras's formulas); None for anything else. Its ``LearningRateSchedule`` drives the lr
    (``schedule(step)`` after ``step`` updates, as keras reads it at ``optimizer.iterations``). Another keras
    optimizer, or an option the update does not compute (clipping, EMA, a learning-rate function, amsgrad,
    weight-decay exclusions), or a torch-style ``scheduler`` beside it, is refused in one line."""
    if not is_keras_optimizer(opt):
        opt = getattr(opt, "optimizer", None) if _is_keras_model(opt) else None
        if opt is None or not is_keras_optimizer(opt):
            if scheduler is not None:
                raise ElasticFlowError("model()['lr_scheduler'] is given beside an optimizer that is not a keras "
                                       "one", "give a keras optimizer its schedule as learning_rate="
                                       "keras.optimizers.schedules..., or set optimizer.schedule in the config")
            return None
    if scheduler is not None:
        raise ElasticFlowError(f"model()['lr_scheduler'] ({type(scheduler).__name__}) is given beside a keras "
                               f"{type(opt).__name__}: keras optimizers take their schedule as learning_rate",
                               f"build it as keras.optimizers.{type(opt).__name__}(learning_rate=keras.optimizers."
                               "schedules.CosineDecay(...)), or set optimizer.schedule in the config")
    if type(opt).__name__ == "LossScaleOptimizer":  # keras's wrap of a model compiled under mixed_float16: the
        opt = opt.inner_optimizer  # update is the inner one's; trainer.precision=16 scales the loss itself
    # learning_rate is a schedule's value at the current iteration; the optimizer keeps the schedule itself here.
    kept = getattr(opt, "_learning_rate", None)
    schedule = None
    if any(c.__name__ == "LearningRateSchedule" for c in type(kept).__mro__):
        schedule = _keras_schedule(kept)
    elif callable(kept):  # a function of nothing: what it returns may change any time (get_config cannot say it)
        refuse_keras_optimizer(opt, ["a learning-rate function"])
    cfg, kind = opt.get_config(), type(opt).__name__
    options = [k for k in ("clipnorm", "global_clipnorm", "clipvalue", "use_ema", "loss_scale_factor",
                           "gradient_accumulation_steps", "amsgrad") if cfg.get(k)]
    if getattr(opt, "_exclude_from_weight_decay", None) or getattr(opt, "_exclude_from_weight_decay_pattern", None):
        options.append("exclude_from_weight_decay")
    if kind not in ("SGD", "Adam", "AdamW") or options:
        refuse_keras_optimizer(opt, options)
    lr = float(opt.learning_rate) if schedule is None else _initial_lr(kept)
    wd = float(cfg.get("weight_decay") or 0.0)
    if kind == "SGD":
        spec: OptimizerSpec = KerasSGD(lr, momentum=float(cfg["momentum"]), nesterov=bool(cfg["nesterov"]),
                                       weight_decay=wd, schedule=schedule)
    else:
        spec = KerasAdam(lr, betas=(float(cfg["beta_1"]), float(cfg["beta_2"])), eps=float(cfg["epsilon"]),
                         weight_decay=wd, schedule=schedule)
    spec.name = f"keras_{kind.lower()}"
    return spec


def _keras_schedule(schedule: Any) -> optim.Schedule:
    """A keras ``LearningRateSchedule`` as the spec's schedule: keras computes each step's lr itself (its own
    float32 arithmetic), called with the count of updates done, a function of the step alone."""
    try:
        float(schedule(0))
    except Exception as exc:  # noqa: BLE001 - a user's schedule class: say which and why in one line
        raise ElasticFlowError(f"the keras learning-rate schedule {type(schedule).__name__} cannot be evaluated at "
                               f"step 0 ({type(exc).__name__}: {exc})",
                               "a LearningRateSchedule's __call__(step) must return the lr for an integer "
                               "step") from None
    try:
        shown = ", ".join(f"{k}={v}" for k, v in schedule.get_config().items() if k != "name" and v is not None)
    except Exception:  # noqa: BLE001 - a subclass without get_config() is still a schedule
        shown = ""
    return optim.Schedule("function", fn=lambda step: float(schedule(step)),
                          label=f"{type(schedule).__name__}({shown})")


def _initial_lr(schedule: Any) -> float:
    """The lr a keras schedule starts from (its ``initial_learning_rate``, else its value at step 0)."""
    try:
        return float(schedule.get_config()["initial_learning_rate"])
    except Exception:  # noqa: BLE001 - not every schedule names one
        return float(schedule(0))


def note_sparse(spec: OptimizerSpec, names: Sequence[str]) -> None:
    """Warn (once) where keras's own Adam would differ from this update: it applies an embedding's sparse
    gradient once per occurrence of a row in the batch, this update to the row's summed gradient."""
    if names and spec.formulas == "keras" and isinstance(spec, Adam) and tuple(names) not in _NOTED:
        _NOTED.add(tuple(names))
        log.warning("keras's %s updates a row of %s once per occurrence in the batch (its sparse path); ElasticFlow "
                    "updates it once with the summed gradient, as keras's dense path and torch.optim do: a batch "
                    "that repeats a row ends away from model.fit", spec.name, ", ".join(names[:3]))


_NOTED: set = set()  # note_sparse's warnings given in this process


def _is_keras_model(obj: Any) -> bool:
    return any(cls.__module__.startswith(("keras", "tf_keras")) and cls.__name__ == "Model"
               for cls in type(obj).__mro__)


def is_keras_optimizer(opt: Any) -> bool:
    return any(cls.__name__ == "Optimizer" and cls.__module__.startswith(("keras", "tf_keras"))
               for cls in type(opt).__mro__)


def refuse_keras_optimizer(opt: Any, options: Sequence[str]) -> None:
    """One line instead of training with another optimizer than the user's: what keras does that the update
    does not compute is neither dropped silently nor approximated."""
    lr = "" if "a learning-rate function" in options else f"(learning_rate={float(opt.learning_rate):g})"
    name = type(opt).__name__
    what = f"with {', '.join(options)}" if options else "(ElasticFlow computes keras's SGD, Adam and AdamW)"
    choice = name.lower() if name.lower() in ("sgd", "adam", "adamw") else "adam"
    schedule = ("; a learning rate that moves: a keras.optimizers.schedules.LearningRateSchedule, or "
                "optimizer.schedule in the config") if "a learning-rate function" in options else ""
    raise ElasticFlowError(f"model() gives a keras {name}{lr} {what}, which ElasticFlow's update does not compute",
                           f"compile with keras.optimizers.SGD, Adam or AdamW and no such option (gradient clipping: "
                           f"trainer.grad_clip), or choose the optimizer in the config, e.g. optimizer={choice}"
                           f"{schedule}")
