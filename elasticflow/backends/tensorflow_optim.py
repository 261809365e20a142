"""The TensorFlow backend's optimizer updates, written out with torch.optim's formulas.

SGD (momentum, nesterov, weight decay), Adam (L2 weight decay) and AdamW (decoupled), with torch's
slot names (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``) and its float32 rounding of the
scalars, so a checkpoint moves between backends and both take the same steps.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import tensorflow as tf

from ..optim import SGD, AdamW, OptimizerSpec


def scalars(spec: OptimizerSpec, lr: float, step: int) -> tuple:
    """The update's scalars for optimizer step ``step`` (1-based), in Python doubles.

    They are rounded to float32 once, as torch does with its Python-number arguments; the
    compiled update reads them from a variable, so a new lr or bias correction is no retrace.
    """
    if isinstance(spec, SGD):
        return (lr, spec.weight_decay, spec.momentum)
    b1, b2 = spec.betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    return (lr / bc1, bc2 ** 0.5, spec.eps, 1 - b1, b2, 1 - b2, spec.weight_decay, 1 - lr * spec.weight_decay)


def apply(spec: OptimizerSpec, k: Sequence[tf.Tensor], params: List[tf.Variable], grads: List[tf.Tensor],
          slots: Dict[str, List[tf.Variable]]) -> None:
    """Update ``params`` in place from ``grads`` (same shapes); ``k`` is ``scalars(...)`` as tensors."""
    for i, (p, g) in enumerate(zip(params, grads)):
        w = tf.convert_to_tensor(p)
        if isinstance(spec, SGD):
            if spec.weight_decay:
                g = g + k[1] * w
            if spec.momentum:
                buf = slots["momentum_buffer"][i]
                new = tf.convert_to_tensor(buf) * k[2] + g  # torch: buf.mul_(momentum).add_(g)
                buf.assign(new)
                g = g + k[2] * new if spec.nesterov else new
            p.assign_sub(k[0] * g)  # in place, as torch; the same rounding as w - lr * g
            continue
        if spec.weight_decay:
            if isinstance(spec, AdamW):
                w = w * k[7]  # decoupled: param *= 1 - lr * weight_decay
            else:
                g = g + k[6] * w
        m_var, v_var = slots["exp_avg"][i], slots["exp_avg_sq"][i]
        m, v = tf.convert_to_tensor(m_var), tf.convert_to_tensor(v_var)
        m_new = m + k[3] * (g - m)                 # torch: exp_avg.lerp_(grad, 1 - beta1)
        v_new = v * k[4] + k[5] * g * g            # torch: exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
        m_var.assign(m_new)
        v_var.assign(v_new)
        denom = tf.math.sqrt(v_new) / k[1] + k[2]  # sqrt(v) / sqrt(bias_correction2) + eps
        p.assign(w - k[0] * (m_new / denom))       # step_size = lr / bias_correction1
