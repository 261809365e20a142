"""Optimizer specs and learning-rate schedules (backend-neutral; backends apply the math).

A model file may return a spec under the reserved key ``"optimizer"``:

    >>> from elasticflow import optim
    >>> def model():
    ...     return {"W": np.zeros((4, 2), np.float32), "optimizer": optim.Adam(1e-3)}

Without one, the ``optimizer`` config group decides (``optimizer=adam optimizer.lr=3e-4``).
The semantics are torch.optim's: SGD's and Adam's weight_decay is L2 added to the gradient,
AdamW's is decoupled. Optimizer state is named ``optimizer/<param>/<slot>`` in checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from .errors import ElasticFlowError


@dataclass
class Schedule:
    """How the learning rate moves with ``step`` (optimizer steps, never micro-batches)."""
    kind: str = "constant"          # constant | linear | cosine | step
    warmup_steps: int = 0
    decay_steps: Optional[int] = None
    min_lr: float = 0.0
    step_size: int = 1000
    gamma: float = 0.1


@dataclass
class OptimizerSpec:
    lr: float
    weight_decay: float = 0.0
    schedule: Schedule = field(default_factory=Schedule)
    name: str = ""

    def slots(self) -> Tuple[str, ...]:
        """Names of the per-parameter state tensors this optimizer keeps."""
        return ()


@dataclass
class SGD(OptimizerSpec):
    momentum: float = 0.0
    nesterov: bool = False
    name: str = "sgd"

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 schedule: Optional[Schedule] = None):
        super().__init__(lr=lr, weight_decay=weight_decay, schedule=schedule or Schedule(), name="sgd")
        self.momentum, self.nesterov = momentum, nesterov
        if nesterov and momentum <= 0:
            raise ElasticFlowError("SGD(nesterov=True) needs momentum > 0", "pass e.g. SGD(lr, momentum=0.9, nesterov=True)")

    def slots(self):
        return ("momentum_buffer",) if self.momentum else ()


@dataclass
class Adam(OptimizerSpec):
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    name: str = "adam"

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 schedule: Optional[Schedule] = None):
        super().__init__(lr=lr, weight_decay=weight_decay, schedule=schedule or Schedule(), name=type(self).__name__.lower())
        self.betas, self.eps = (float(betas[0]), float(betas[1])), eps

    def slots(self):
        return ("exp_avg", "exp_avg_sq")


class AdamW(Adam):
    """Adam with decoupled weight decay (torch.optim.AdamW; default weight_decay=0.01)."""

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 schedule: Optional[Schedule] = None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, schedule=schedule)


def from_config(ocfg: Any) -> OptimizerSpec:
    """The spec the ``optimizer`` config group describes."""
    schedule = Schedule(kind=ocfg.schedule, warmup_steps=ocfg.warmup_steps, decay_steps=ocfg.decay_steps,
                        min_lr=ocfg.min_lr, step_size=ocfg.step_size, gamma=ocfg.gamma)
    if ocfg.name == "sgd":
        return SGD(ocfg.lr, momentum=ocfg.momentum, nesterov=ocfg.nesterov, weight_decay=ocfg.weight_decay,
                   schedule=schedule)
    cls = {"adam": Adam, "adamw": AdamW}[ocfg.name]
    return cls(ocfg.lr, betas=tuple(ocfg.betas), eps=ocfg.eps, weight_decay=ocfg.weight_decay, schedule=schedule)


def lr_at(spec: OptimizerSpec, step: int, total_steps: Optional[int]) -> float:
    """Learning rate for the update that turns ``step`` completed steps into ``step + 1``."""
    s = spec.schedule
    base = spec.lr
    if s.warmup_steps and step < s.warmup_steps:
        return base * (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return base
    if s.kind == "step":
        return base * s.gamma ** ((step - s.warmup_steps) // s.step_size)
    horizon = (s.decay_steps or total_steps or 0) - s.warmup_steps
    if horizon <= 0:
        return base
    progress = min(max(step - s.warmup_steps, 0) / horizon, 1.0)
    if s.kind == "linear":
        return s.min_lr + (base - s.min_lr) * (1.0 - progress)
    return s.min_lr + (base - s.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def describe(spec: OptimizerSpec) -> str:
    extra: Dict[str, Any] = {}
    if isinstance(spec, SGD):
        extra = {"momentum": spec.momentum, "nesterov": spec.nesterov}
    elif isinstance(spec, Adam):
        extra = {"betas": spec.betas, "eps": spec.eps}
    parts = ", ".join(f"{k}={v}" for k, v in {"lr": spec.lr, **extra, "weight_decay": spec.weight_decay}.items())
    sched = "" if spec.schedule.kind == "constant" and not spec.schedule.warmup_steps else f", schedule={spec.schedule.kind}"
    return f"{spec.name}({parts}{sched})"
