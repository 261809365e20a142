"""The TensorFlow backend's optimizer updates: torch.optim's formulas, or a compiled keras optimizer's.

SGD (momentum, nesterov, weight decay), Adam (L2 weight decay) and AdamW (decoupled), with torch's
slot names (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``) and its float32 rounding of the
scalars, so a checkpoint moves between backends and both take the same steps.

A keras SGD, Adam or AdamW that model() returns (a model compiled with it, or under ``"optimizer"``) trains
with keras's own formulas instead, as ``model.fit`` would (``KerasSGD``, ``KerasAdam``): keras's Adam adds
epsilon to the root of the uncorrected second moment and folds both bias corrections into the step size, its
momentum holds ``lr * gradient``, and its weight decay (any optimizer's) is decoupled. Other keras optimizers
and options (clipping, EMA, a schedule, amsgrad) are refused in one line, never approximated.

Parameter groups (``optimizer.groups``, ``optimizer.no_decay``) are torch.optim's: each group's lr and
weight decay in its own row of scalars. ``Groups`` orders the parameters so a group is contiguous in the
flat vector; a variable (a native model's) takes its group's row, the one flat variable of a dict model
is updated run by run (``apply_runs``) and assigned once.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from ... import optim
from ...errors import ElasticFlowError
from ...optim import SGD, Adam, AdamW, Hyper, OptimizerSpec

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
    if spec.formulas == "keras":  # (step size, momentum or eps, [1 - b1, 1 - b2,] lr * wd)
        if isinstance(spec, SGD):
            return (lr, spec.momentum, lr * wd)
        b1, b2 = spec.betas
        return (lr * (1 - b2 ** step) ** 0.5 / (1 - b1 ** step), spec.eps, 1 - b1, 1 - b2, lr * wd)
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
            g = g + k[1] * w
        if spec.momentum:
            buf = slots["momentum_buffer"] * k[2] + g  # torch: buf.mul_(momentum).add_(g)
            new["momentum_buffer"] = buf
            g = g + k[2] * buf if spec.nesterov else buf
        return w - k[0] * g, new  # the rounding of torch's in-place param.add_(g, alpha=-lr)
    if decay:
        if isinstance(spec, AdamW):
            w = w * k[7]  # decoupled: param *= 1 - lr * weight_decay
        else:
            g = g + k[6] * w
    m, v = slots["exp_avg"], slots["exp_avg_sq"]
    m_new = m + k[3] * (g - m)                 # torch: exp_avg.lerp_(grad, 1 - beta1)
    v_new = v * k[4] + k[5] * g * g            # torch: exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
    denom = tf.math.sqrt(v_new) / k[1] + k[2]  # sqrt(v) / sqrt(bias_correction2) + eps
    return w - k[0] * (m_new / denom), {"exp_avg": m_new, "exp_avg_sq": v_new}  # step_size = lr / bias_correction1


def _keras_update(spec: OptimizerSpec, k: Sequence[tf.Tensor], w: tf.Tensor, g: tf.Tensor, slots: Dict[str, tf.Tensor],
                  decay: bool) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """``update`` with keras's formulas (keras/src/optimizers: sgd.py, adam.py, base_optimizer's weight decay)."""
    if decay:
        w = w - w * k[-1]  # keras: variable - variable * wd * lr, before the step
    if isinstance(spec, SGD):
        if not spec.momentum:
            return w - g * k[0], {}
        m = slots["momentum"] * k[1] - g * k[0]
        return w + (m * k[1] - g * k[0] if spec.nesterov else m), {"momentum": m}
    m = slots["exp_avg"] + (g - slots["exp_avg"]) * k[2]
    v = slots["exp_avg_sq"] + (g * g - slots["exp_avg_sq"]) * k[3]
    return w - (m * k[0]) / (tf.math.sqrt(v) + k[1]), {"exp_avg": m, "exp_avg_sq": v}


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


def spec_from_native(opt: Any) -> Optional[OptimizerSpec]:
    """The spec of a keras SGD, Adam or AdamW, given itself or a keras model compiled with it (``KerasSGD``,
    ``KerasAdam``: keras's formulas); None for anything else. Another keras optimizer, or an option the update
    does not compute (clipping, EMA, a learning-rate schedule, amsgrad, weight-decay exclusions), is refused in
    one line."""
    if not is_keras_optimizer(opt):
        opt = getattr(opt, "optimizer", None) if _is_keras_model(opt) else None
        if opt is None or not is_keras_optimizer(opt):
            return None
    cfg, kind = opt.get_config(), type(opt).__name__
    options = [k for k in ("clipnorm", "global_clipnorm", "clipvalue", "use_ema", "loss_scale_factor",
                           "gradient_accumulation_steps", "amsgrad") if cfg.get(k)]
    if getattr(opt, "_exclude_from_weight_decay", None) or getattr(opt, "_exclude_from_weight_decay_pattern", None):
        options.append("exclude_from_weight_decay")
    # learning_rate is a schedule's value at the current iteration; the optimizer keeps the schedule itself here.
    kept = getattr(opt, "_learning_rate", None)
    if callable(kept) or any(c.__name__ == "LearningRateSchedule" for c in type(kept).__mro__):
        options.append("a learning-rate schedule")
    lr = float(opt.learning_rate)
    if kind not in ("SGD", "Adam", "AdamW") or options:
        refuse_keras_optimizer(opt, options)
    wd = float(cfg.get("weight_decay") or 0.0)
    if kind == "SGD":
        spec: OptimizerSpec = KerasSGD(lr, momentum=float(cfg["momentum"]), nesterov=bool(cfg["nesterov"]),
                                       weight_decay=wd)
    else:
        spec = KerasAdam(lr, betas=(float(cfg["beta_1"]), float(cfg["beta_2"])), eps=float(cfg["epsilon"]),
                         weight_decay=wd)
    spec.name = f"keras_{kind.lower()}"
    return spec


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
    lr = "" if "a learning-rate schedule" in options else f"(learning_rate={float(opt.learning_rate):g})"
    name = type(opt).__name__
    what = f"with {', '.join(options)}" if options else "(ElasticFlow computes keras's SGD, Adam and AdamW)"
    choice = name.lower() if name.lower() in ("sgd", "adam", "adamw") else "adam"
    raise ElasticFlowError(f"model() gives a keras {name}{lr} {what}, which ElasticFlow's update does not compute",
                           f"compile with keras.optimizers.SGD, Adam or AdamW and no such option (gradient clipping: "
                           f"trainer.grad_clip), or choose the optimizer in the config, e.g. optimizer={choice}")
