"""The TensorFlow backend's optimizer updates, written out with torch.optim's formulas.

SGD (momentum, nesterov, weight decay), Adam (L2 weight decay) and AdamW (decoupled), with torch's
slot names (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``) and its float32 rounding of the
scalars, so a checkpoint moves between backends and both take the same steps.

Parameter groups (``optimizer.groups``, ``optimizer.no_decay``) are torch.optim's: each group's lr and
weight decay in its own row of scalars. ``Groups`` orders the parameters so a group is contiguous in the
flat vector; a variable (a native model's) takes its group's row, the one flat variable of a dict model
is updated run by run (``apply_runs``) and assigned once. A keras optimizer that model() returns is
not read (``spec_from_native`` is None: model file loading refuses it with a hint to use elasticflow.optim).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from ... import optim
from ...errors import ElasticFlowError
from ...optim import SGD, AdamW, Hyper, OptimizerSpec


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

    def row(self, name: str) -> int:
        return self.settings.index(self.hyper[name])

    def runs(self, sizes: Sequence[int]) -> List[Tuple[int, int, Hyper]]:
        """[(lo, hi, hyper)] of the flat vector of ``order`` (``sizes`` elements each)."""
        return optim.runs(self.order, sizes, self.hyper)

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
                  [self.settings[r].weight_decay != 0 for r in chosen])
            return
        runs = self.runs(sizes)
        chosen = [self.settings.index(h) for _, _, h in runs]
        apply_runs(self.spec, [rows[r] for r in chosen], params[0], grads[0], slots, [hi - lo for lo, hi, _ in runs],
                   [h.weight_decay != 0 for _, _, h in runs])


def scalars(spec: OptimizerSpec, lr: float, step: int, weight_decay: float = None) -> tuple:
    """The update's scalars for optimizer step ``step`` (1-based), in Python doubles.

    They are rounded to float32 once, as torch does with its Python-number arguments; the
    compiled update reads them from a variable, so a new lr or bias correction is no retrace.
    ``weight_decay``: a group's (None: the spec's).
    """
    wd = spec.weight_decay if weight_decay is None else weight_decay
    if isinstance(spec, SGD):
        return (lr, wd, spec.momentum)
    b1, b2 = spec.betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    return (lr / bc1, bc2 ** 0.5, spec.eps, 1 - b1, b2, 1 - b2, wd, 1 - lr * wd)


def update(spec: OptimizerSpec, k: Sequence[tf.Tensor], w: tf.Tensor, g: tf.Tensor, slots: Dict[str, tf.Tensor],
           decay: bool) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """One step of ``w`` (with gradient ``g`` and optimizer state ``slots``): (new w, new slots).
    ``k``: ``scalars(...)`` as tensors; ``decay``: whether the weight decay is not zero (known at trace time)."""
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


def apply(spec: OptimizerSpec, ks: Sequence[Sequence[tf.Tensor]], params: List[tf.Variable], grads: List[tf.Tensor],
          slots: Dict[str, List[tf.Variable]], decays: Sequence[bool]) -> None:
    """Update ``params`` in place from ``grads`` (same shapes); ``ks[i]``/``decays[i]``: the scalars of
    ``params[i]``'s group as tensors, and whether it decays."""
    for i, (p, g) in enumerate(zip(params, grads)):
        w, new = update(spec, ks[i], tf.convert_to_tensor(p), g,
                        {s: tf.convert_to_tensor(v[i]) for s, v in slots.items()}, decays[i])
        for s, value in new.items():
            slots[s][i].assign(value)
        p.assign(w)


def apply_runs(spec: OptimizerSpec, ks: Sequence[Sequence[tf.Tensor]], param: tf.Variable, grad: tf.Tensor,
               slots: Dict[str, List[tf.Variable]], sizes: Sequence[int], decays: Sequence[bool]) -> None:
    """Update the one flat variable ``param`` (and its one slot variable each) cut into runs of ``sizes``
    elements, run ``j`` with ``ks[j]``/``decays[j]``: one assign per variable, a few ops per run."""
    if len(sizes) == 1:
        return apply(spec, ks, [param], [grad], slots, decays)
    parts = zip(tf.split(tf.convert_to_tensor(param), sizes), tf.split(grad, sizes),
                *(tf.split(tf.convert_to_tensor(v[0]), sizes) for v in slots.values()))
    done = [update(spec, k, w, g, dict(zip(slots, pieces)), decay)
            for k, decay, (w, g, *pieces) in zip(ks, decays, parts)]
    for s, v in slots.items():
        v[0].assign(tf.concat([new[s] for _, new in done], 0))
    param.assign(tf.concat([w for w, _ in done], 0))


def spec_from_native(opt: Any) -> Optional[OptimizerSpec]:
    """A framework optimizer's spec: none here. A keras optimizer is refused in one line (see
    ``refuse_keras_optimizer``); anything else is not an optimizer this backend knows (None)."""
    if is_keras_optimizer(opt):
        refuse_keras_optimizer(opt, "model()['optimizer'] is")
    return None


def is_keras_optimizer(opt: Any) -> bool:
    return any(cls.__name__ == "Optimizer" and cls.__module__.startswith(("keras", "tf_keras"))
               for cls in type(opt).__mro__)


def refuse_keras_optimizer(opt: Any, what: str) -> None:
    """One line instead of training with another optimizer than the user's: ElasticFlow's updates are
    torch.optim's formulas, and Keras's differ (its Adam adds epsilon to the bias-corrected root, ~1e-3 apart
    after a few steps), so a keras optimizer is neither replaced silently nor approximated."""
    try:
        lr = f"(learning_rate={float(opt.learning_rate):g})"
    except (TypeError, ValueError, AttributeError):  # a schedule: no single number
        lr = ""
    name = type(opt).__name__
    choice = name.lower() if name.lower() in ("sgd", "adam", "adamw") else "adam"
    raise ElasticFlowError(f"{what} a keras {name}{lr}: ElasticFlow trains with its own optimizer (torch.optim's "
                           "formulas), never a keras one", f"drop it (model.compile() without an optimizer, or no "
                           f"compile) and choose it in the config, e.g. optimizer={choice} optimizer.lr=...; "
                           "Keras's own update formulas are not reproduced")
