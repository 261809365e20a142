"""Adam and AdamW as one update over flat buffers: torch.optim's formulas, a handful of calls a step.

torch.optim.Adam/AdamW on CPU run their single-tensor loop (foreach is the default only on CUDA):
about ten tensor calls per parameter tensor, so a GPT-2 block (12 tensors) costs ~120 dispatches a
step whatever its size, and ``exp_avg_sq.sqrt()`` allocates a fresh tensor per parameter per step.
The Engine already keeps the gradient in one flat buffer; when the parameters are views of one flat
buffer too, the same formulas run once over the whole model: 8 calls a step and no allocation.

The arithmetic is ``torch.optim.adam._single_tensor_adam``'s (non-capturable branch), op for op and
with the same Python-float scalars, so each element sees the same float32 operations; only the split
between vectorised body and scalar tail of each kernel can differ, which tests/test_optim.py bounds.
State is per parameter to the outside (``state[p]["exp_avg"]`` is a view of the flat moment), so
checkpoints keep the ``optimizer/<param>/exp_avg`` layout and load from torch.optim runs and back.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..optim import Adam, AdamW


class FlatAdam:
    """torch.optim.Adam / AdamW (``decoupled`` by the spec's class) over flat param/grad buffers.

    Args:
        spec: the Adam or AdamW spec (betas, eps, weight_decay).
        flat_param, flat_grad: 1-D float32 buffers; ``params[i]`` and its ``.grad`` are views of them,
            laid out in order.

    Mirrors the parts of ``torch.optim.Optimizer`` the Engine uses: ``param_groups[0]["lr"]`` is read
    by ``step()``, and ``state`` maps a parameter to its slot views once the first step ran (empty
    before, as torch.optim's). ``load_slots`` replaces ``state[p] = ...``: the slots are copied into
    the flat moments, which must stay single buffers.
    """

    def __init__(self, spec: Adam, flat_param: torch.Tensor, flat_grad: torch.Tensor, params: List[torch.Tensor]):
        self.decoupled = isinstance(spec, AdamW)
        self.beta1, self.beta2 = spec.betas
        self.eps, self.weight_decay = spec.eps, spec.weight_decay
        self.param_groups = [{"lr": spec.lr}]
        self.flat_param, self.flat_grad = flat_param, flat_grad
        self.exp_avg = torch.zeros_like(flat_param)
        self.exp_avg_sq = torch.zeros_like(flat_param)
        # Scratch for the denominator (torch.optim allocates it per parameter per step: for a large
        # embedding that is a fresh multi-MB block, page faults included, every step).
        self._denom = torch.empty_like(flat_param)
        # Adam's L2 term makes grad + wd * param without touching the gradient buffer (the reduced
        # gradient stays what was reduced); one more model-sized buffer, only when used.
        self._l2 = torch.empty_like(flat_param) if weight_decay_is_l2(spec) else None
        self.steps = 0
        self.state: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        self._views: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        offset = 0
        for p in params:
            n = p.numel()
            self._views[p] = {"exp_avg": self.exp_avg[offset:offset + n].view_as(p),
                              "exp_avg_sq": self.exp_avg_sq[offset:offset + n].view_as(p)}
            offset += n

    @torch.no_grad()
    def step(self) -> None:
        if not self.state:
            self.state.update(self._views)
        self.steps += 1
        adam_update(self.flat_param, self.flat_grad, self.exp_avg, self.exp_avg_sq, self._denom,
                    self.param_groups[0]["lr"], (self.beta1, self.beta2), self.eps, self.weight_decay,
                    self.decoupled, self.steps, self._l2)

    @torch.no_grad()
    def load_slots(self, p: torch.Tensor, slots: Dict[str, torch.Tensor], steps: int) -> None:
        """Copy a checkpoint's slots of ``p`` into the flat moments; the step count becomes ``steps``."""
        for name, value in slots.items():
            if name in self._views[p]:
                self._views[p][name].copy_(value)
        self.steps = int(steps)
        self.state.update(self._views)


@torch.no_grad()
def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                denom: torch.Tensor, lr: float, betas, eps: float, weight_decay: float, decoupled: bool,
                steps: int, l2_out=None) -> None:
    """One Adam/AdamW update of flat (or sliced: elementwise, so any range alone gets the same values)
    buffers in place. ``denom``: scratch of param's size; ``l2_out``: scratch for Adam's L2 term."""
    beta1, beta2 = betas
    step = float(steps)  # torch.optim keeps a float32 tensor and reads it back: the same value below 2**24
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = torch.add(grad, param, alpha=weight_decay, out=l2_out)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = torch.sqrt(exp_avg_sq, out=denom).div_(bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def weight_decay_is_l2(spec: Adam) -> bool:
    return spec.weight_decay != 0 and not isinstance(spec, AdamW)
