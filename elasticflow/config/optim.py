"""Optimizer specs and learning-rate schedules (backend-neutral; backends apply the math).

A model file may return a spec under the reserved key ``"optimizer"``:

    >>> from elasticflow import optim
    >>> def model():
    ...     return {"W": np.zeros((4, 2), np.float32), "optimizer": optim.Adam(1e-3)}

Without one, the ``optimizer`` config group decides (``optimizer=adam optimizer.lr=3e-4``).
The semantics are torch.optim's: SGD's and Adam's weight_decay is L2 added to the gradient,
AdamW's is decoupled. Optimizer state is named ``optimizer/<param>/<slot>`` in checkpoints.

Parameter groups (torch.optim's ``param_groups``) are chosen by name: ``no_decay`` patterns take weight
decay off (``optimizer.no_decay=[bias,norm]``), and each ``Group`` gives the parameters it matches
their own ``lr`` and ``weight_decay``:

    >>> optim.AdamW(1e-3, weight_decay=0.1, no_decay=("bias", "norm"),
    ...             groups=[optim.Group(["classifier"], lr=1e-2)])

A pattern with ``*``, ``?`` or ``[`` is a glob over the whole name (``encoder.*.bias``); any other
pattern matches a name that contains it, or the class of the module that owns the parameter
(``norm`` matches ``ln_f.weight`` of a ``LayerNorm``), case-insensitively. The first group that
matches a parameter wins. A native torch module may also list the tensors themselves
(``Group([model.head.weight])``), or return a ``torch.optim`` optimizer built on its groups.
Parameters that do not train (``requires_grad=False``, keras ``trainable=False``) are in no group.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import ElasticFlowError


@dataclass
class Schedule:
    """How the learning rate moves with ``step`` (optimizer steps, never micro-batches).

    The config's ``optimizer.schedule`` fills the first seven fields; the rest describe a scheduler that model()
    returned (``torch.optim.lr_scheduler``, a keras ``LearningRateSchedule``), translated by the backend's
    ``spec_from_native``. Either way the learning rate is a function of ``step`` alone, so a checkpoint's step
    and a joining worker's own model() call are all its state.
    """
    kind: str = "constant"          # constant | linear | cosine | step | function
    warmup_steps: int = 0
    warmup_from_zero: bool = False  # Hugging Face's warmup: step s at lr * s / warmup_steps (the first at 0)
    decay_steps: Optional[int] = None
    min_lr: float = 0.0
    step_size: int = 1000
    gamma: float = 0.1
    # torch's LinearLR(start_factor, total_iters=warmup_ramp) as the warmup: lr * (warmup_start + (1 -
    # warmup_start) * min(s, warmup_ramp) / warmup_ramp) while s < warmup_steps. None: warmup_from_zero's rule.
    warmup_start: Optional[float] = None
    warmup_ramp: Optional[int] = None
    periodic: bool = False          # cosine past decay_steps goes on (torch's CosineAnnealingLR climbs back)
    fn: Optional[Callable[[int], float]] = None  # kind=function: the spec lr's value after s steps (a LambdaLR's)
    label: str = ""                 # what the scheduler was, for the banner and the trackers

    def is_constant(self) -> bool:
        """No schedule at all: the optimizer's lr at every step."""
        return self.kind == "constant" and not self.warmup_steps and self.fn is None


@dataclass
class Group:
    """Other hyperparameters for some parameters (torch.optim's parameter group).

    Args:
        params: name patterns (see the module's docstring), or a native model's tensors themselves.
        lr: the group's learning rate (None: the optimizer's); a schedule moves it in proportion.
        weight_decay: the group's weight decay (None: the optimizer's, or 0 where ``no_decay`` matches).
    """
    params: Tuple[Any, ...]
    lr: Optional[float] = None
    weight_decay: Optional[float] = None

    def __post_init__(self):
        self.params = (self.params,) if isinstance(self.params, str) else tuple(self.params)


@dataclass(frozen=True)
class Hyper:
    """One parameter's hyperparameters: its lr as a multiple of the schedule's, and its weight decay."""
    lr_scale: float
    weight_decay: float


@dataclass
class OptimizerSpec:
    # Whose update formulas: "torch" (torch.optim's, every spec here) or "keras" (a keras optimizer's, which the
    # TensorFlow backend reads from a compiled model: backends/tensorflow/optim.py). A class attribute, not a field.
    formulas = "torch"
    lr: float
    weight_decay: float = 0.0
    schedule: Schedule = field(default_factory=Schedule)
    name: str = ""
    groups: Tuple[Group, ...] = ()
    no_decay: Tuple[str, ...] = ()

    def _set_groups(self, groups: Optional[Sequence[Any]], no_decay: Sequence[str]) -> None:
        self.groups = tuple(g if isinstance(g, Group) else Group(**dict(g)) for g in (groups or ()))
        self.no_decay = (no_decay,) if isinstance(no_decay, str) else tuple(no_decay or ())
        for g in self.groups:
            if g.lr is not None and g.lr <= 0:
                raise ElasticFlowError(f"a parameter group's lr must be positive, got {g.lr!r}",
                                       "pass e.g. Group(['head'], lr=1e-3)")

    def slots(self) -> Tuple[str, ...]:
        """Names of the per-parameter state tensors this optimizer keeps."""
        return ()


@dataclass
class SGD(OptimizerSpec):
    momentum: float = 0.0
    nesterov: bool = False
    name: str = "sgd"

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 schedule: Optional[Schedule] = None, groups: Optional[Sequence[Any]] = None,
                 no_decay: Sequence[str] = ()):
        super().__init__(lr=lr, weight_decay=weight_decay, schedule=schedule or Schedule(), name="sgd")
        self.momentum, self.nesterov = momentum, nesterov
        self._set_groups(groups, no_decay)
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
                 schedule: Optional[Schedule] = None, groups: Optional[Sequence[Any]] = None,
                 no_decay: Sequence[str] = ()):
        super().__init__(lr=lr, weight_decay=weight_decay, schedule=schedule or Schedule(), name=type(self).__name__.lower())
        self.betas, self.eps = (float(betas[0]), float(betas[1])), eps
        self._set_groups(groups, no_decay)

    def slots(self):
        return ("exp_avg", "exp_avg_sq")


class AdamW(Adam):
    """Adam with decoupled weight decay (torch.optim.AdamW; default weight_decay=0.01)."""

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 schedule: Optional[Schedule] = None, groups: Optional[Sequence[Any]] = None,
                 no_decay: Sequence[str] = ()):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, schedule=schedule,
                         groups=groups, no_decay=no_decay)


def from_config(ocfg: Any) -> OptimizerSpec:
    """The spec the ``optimizer`` config group describes."""
    schedule = Schedule(kind=ocfg.schedule, warmup_steps=ocfg.warmup_steps,
                        warmup_from_zero=ocfg.warmup_from_zero, decay_steps=ocfg.decay_steps,
                        min_lr=ocfg.min_lr, step_size=ocfg.step_size, gamma=ocfg.gamma)
    groups = [Group(tuple(g.params), lr=g.lr, weight_decay=g.weight_decay) for g in ocfg.groups]
    if ocfg.name == "sgd":
        return SGD(ocfg.lr, momentum=ocfg.momentum, nesterov=ocfg.nesterov, weight_decay=ocfg.weight_decay,
                   schedule=schedule, groups=groups, no_decay=tuple(ocfg.no_decay))
    cls = {"adam": Adam, "adamw": AdamW}[ocfg.name]
    return cls(ocfg.lr, betas=tuple(ocfg.betas), eps=ocfg.eps, weight_decay=ocfg.weight_decay, schedule=schedule,
               groups=groups, no_decay=tuple(ocfg.no_decay))


def matches(pattern: str, name: str, owner: str = "") -> bool:
    """Whether name pattern ``pattern`` picks parameter ``name`` (owned by a module of class ``owner``)."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    p = pattern.lower()
    return p in name.lower() or (bool(owner) and p in owner.lower())


def hypers(spec: OptimizerSpec, names: Sequence[str], owners: Mapping[str, str] = {},
           by_identity: Mapping[int, str] = {}) -> Dict[str, Hyper]:
    """Each trainable parameter's hyperparameters under ``spec``'s groups and ``no_decay``.

    Args:
        names: the parameters that train, in the engine's order.
        owners: parameter name -> class name of the module that owns it (native models; for patterns).
        by_identity: ``id(tensor)`` -> name, for groups that list a native model's tensors.

    Raises ElasticFlowError for a group pattern that matches no parameter (a typo would otherwise
    change nothing, silently) and for a tensor that is not one of the model's trainable parameters.
    """
    chosen: Dict[str, Group] = {}
    for i, g in enumerate(spec.groups):
        picked = []
        for item in g.params:
            if isinstance(item, str):
                hit = [n for n in names if matches(item, n, owners.get(n, ""))]
                if not hit:
                    raise ElasticFlowError(
                        f"optimizer group {i} pattern {item!r} matches no trainable parameter",
                        f"parameters are named like {', '.join(repr(n) for n in list(names)[:3])}; "
                        "a pattern is a part of a name or of its module's class, or a glob")
            else:
                name = by_identity.get(id(item))
                if name is None:
                    raise ElasticFlowError(f"optimizer group {i} lists a tensor of shape "
                                           f"{tuple(getattr(item, 'shape', ()))} that is not a trainable "
                                           "parameter of the model", "list the model's own parameters "
                                           "(model.named_parameters()), or name them by pattern")
                hit = [name]
            picked += hit
        for n in picked:
            chosen.setdefault(n, g)
    out: Dict[str, Hyper] = {}
    for n in names:
        g = chosen.get(n)
        scale = 1.0 if g is None or g.lr is None else g.lr / spec.lr
        if g is not None and g.weight_decay is not None:
            wd = float(g.weight_decay)
        elif any(matches(p, n, owners.get(n, "")) for p in spec.no_decay):
            wd = 0.0
        else:
            wd = float(spec.weight_decay)
        out[n] = Hyper(scale, wd)
    return out


def runs(order: Sequence[str], sizes: Sequence[int], hyper: Mapping[str, Hyper]) -> List[Tuple[int, int, Hyper]]:
    """[(lo, hi, hyper)]: the flat vector of parameters ``order`` (of ``sizes`` elements each), cut into
    the longest stretches that share their hyperparameters; what a flat update runs over, once each."""
    out: List[Tuple[int, int, Hyper]] = []
    at = 0
    for name, size in zip(order, sizes):
        h = hyper[name]
        if out and out[-1][2] == h and out[-1][1] == at:
            out[-1] = (out[-1][0], at + size, h)
        else:
            out.append((at, at + size, h))
        at += size
    return out


Stretch = Tuple[int, int, Hyper, int]  # [lo, hi) of the flat vector, its hyperparameters, the step it takes (1-based)


def stretches(runs: Sequence[Tuple[int, int, Hyper]], sizes: Sequence[int], step: int,
              took_part: Optional[Sequence[bool]] = None, sat_out: Optional[Sequence[int]] = None) -> List[Stretch]:
    """What a flat update of optimizer step ``step`` (1-based) runs over: ``runs`` (``runs()``'s stretches of
    parameters of ``sizes`` elements each, in the flat order), each with the step it takes.

    torch.optim's rule for a parameter whose ``.grad`` is None: no update at all (no weight decay, no change of
    its slots) and no step counted, so its own step count (Adam's bias correction) falls behind. ``took_part[i]``:
    parameter i had a gradient somewhere in the global batch (None: all did); ``sat_out[i]``: the steps it sat
    out before this one (None: none). Parameters that take no part are cut out of the runs, and a run is cut
    where the step its parameters take changes.

    Example: the second of three parameters sat out, once before and now again:
        >>> stretches([(0, 9, h)], [2, 3, 4], step=5, took_part=[True, False, True], sat_out=[0, 1, 0])
        [(0, 2, h, 5), (5, 9, h, 5)]
    """
    if took_part is None and sat_out is None:
        return [(lo, hi, h, step) for lo, hi, h in runs]
    out: List[Stretch] = []
    at, r = 0, 0
    for i, size in enumerate(sizes):
        if size == 0:  # nothing to update, and no run to find
            continue
        while runs[r][1] <= at:  # the run that holds parameter i (a parameter never spans two)
            r += 1
        h = runs[r][2]
        own = step - (int(sat_out[i]) if sat_out is not None else 0)
        if took_part is None or took_part[i]:
            if out and out[-1][1] == at and out[-1][2] == h and out[-1][3] == own:
                out[-1] = (out[-1][0], at + size, h, own)
            else:
                out.append((at, at + size, h, own))
        at += size
    return out


def grouped_order(names: Sequence[str], hyper: Mapping[str, Hyper]) -> List[str]:
    """``names`` with the parameters of equal hyperparameters next to each other (stably, in the order
    each setting first appears), so that a flat update has one stretch per group, not one per tensor."""
    first: Dict[Hyper, int] = {}
    for n in names:
        first.setdefault(hyper[n], len(first))
    return sorted(names, key=lambda n: first[hyper[n]])


def lr_at(spec: OptimizerSpec, step: int, total_steps: Optional[int]) -> float:
    """Learning rate for the update that turns ``step`` completed steps into ``step + 1``.

    With W warmup steps, the update after ``step`` steps uses ``lr * (step + 1) / W`` while ``step < W``
    (the first at lr / W, the W-th at lr), or ``lr * step / W`` with ``warmup_from_zero`` (Hugging Face's
    ``get_*_schedule_with_warmup``: the first update at 0). Then, over ``horizon = (decay_steps or total
    steps) - W`` and ``progress = min((step - W) / horizon, 1)``: linear ``min_lr + (lr - min_lr) * (1 -
    progress)``, cosine ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2``, step ``lr * gamma **
    ((step - W) // step_size)``: with ``min_lr=0``, Hugging Face's linear and cosine schedules.

    A translated scheduler (``Schedule``'s last fields): ``warmup_start`` rises as torch's LinearLR, ``periodic``
    lets cosine's progress pass 1 (torch's CosineAnnealingLR), and ``fn`` is the value itself (a LambdaLR's
    ``lr * lambda(step)``, a keras schedule's ``schedule(step)``)."""
    s = spec.schedule
    base = spec.lr
    if s.fn is not None:
        return float(s.fn(step))
    if s.warmup_steps and step < s.warmup_steps:
        if s.warmup_start is None:
            return base * (step + (0 if s.warmup_from_zero else 1)) / s.warmup_steps
        ramp = s.warmup_ramp or s.warmup_steps
        return base * (s.warmup_start + (1.0 - s.warmup_start) * min(step, ramp) / ramp)
    if s.kind == "constant":
        return base
    if s.kind == "step":
        return base * s.gamma ** ((step - s.warmup_steps) // s.step_size)
    horizon = (s.decay_steps or total_steps or 0) - s.warmup_steps
    if horizon <= 0:
        return base
    progress = max(step - s.warmup_steps, 0) / horizon
    if not (s.periodic and s.kind == "cosine"):
        progress = min(progress, 1.0)
    if s.kind == "linear":
        return s.min_lr + (base - s.min_lr) * (1.0 - progress)
    return s.min_lr + (base - s.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def with_schedule(spec: OptimizerSpec, schedule: Schedule) -> OptimizerSpec:
    """``spec`` (an optimizer model() returned) driven by the config's ``schedule`` as well, where one says
    anything: the two cannot both hold, so a second schedule is refused in one line, never one of them dropped.
    The config's ``min_lr`` is of ``spec.lr``; each parameter group's lr moves in proportion (torch's
    schedulers scale each group's own lr alike)."""
    if schedule.is_constant() or schedule == spec.schedule:
        return spec
    if not spec.schedule.is_constant():
        raise ElasticFlowError(
            f"model() gives its optimizer a schedule ({describe_schedule(spec.schedule)}) and the config asks for "
            f"optimizer.schedule={describe_schedule(schedule)}: only one can set the learning rate",
            "keep one: leave optimizer.schedule and optimizer.warmup_steps at their defaults, or return no "
            "lr_scheduler (and no keras LearningRateSchedule) from model()")
    if schedule.kind in ("linear", "cosine") and schedule.min_lr > spec.lr:
        raise ElasticFlowError(f"optimizer.min_lr={schedule.min_lr:g} is more than the lr of model()'s optimizer "
                               f"({spec.lr:g})", "the schedule decays from the optimizer's lr down to "
                               "optimizer.min_lr: lower optimizer.min_lr, e.g. optimizer.min_lr=0")
    spec.schedule = schedule
    return spec


def describe_schedule(s: Schedule) -> str:
    """``cosine(warmup_steps=20, decay_steps=all, min_lr=0)``: what the banner, the trackers and status say."""
    if s.fn is not None:
        return s.label or "function"
    parts: List[str] = []
    if s.warmup_steps:
        parts.append(f"warmup_steps={s.warmup_steps}")
        if s.warmup_start is not None:
            parts.append(f"warmup_start={s.warmup_start:g}, warmup_ramp={s.warmup_ramp or s.warmup_steps}")
        elif s.warmup_from_zero:
            parts.append("warmup_from_zero=True")
    if s.kind in ("linear", "cosine"):
        parts.append(f"decay_steps={s.decay_steps if s.decay_steps is not None else 'all'}, min_lr={s.min_lr:g}")
        if s.periodic and s.kind == "cosine":
            parts.append("periodic=True")
    elif s.kind == "step":
        parts.append(f"step_size={s.step_size}, gamma={s.gamma:g}")
    return f"{s.kind}({', '.join(parts)})" if parts else s.kind


def summary(spec: OptimizerSpec, from_model: bool = False) -> Dict[str, Any]:
    """The optimizer that trains, as flat plain values (``{"name": "adamw", "lr": 0.003, "schedule":
    "cosine", ...}``): what the trackers record as ``optimizer.*`` in place of the config's, and `status` shows.
    ``from_model``: model() gave the optimizer (the config group's own settings then do not train)."""
    out: Dict[str, Any] = {"name": spec.name, "lr": spec.lr, "weight_decay": spec.weight_decay}
    if isinstance(spec, SGD):
        out.update(momentum=spec.momentum, nesterov=spec.nesterov)
    elif isinstance(spec, Adam):
        out.update(betas=list(spec.betas), eps=spec.eps)
    s = spec.schedule
    out["schedule"] = s.label if s.fn is not None else s.kind
    if s.fn is None:
        out["warmup_steps"] = s.warmup_steps
        if s.warmup_steps:
            out["warmup_from_zero"] = s.warmup_from_zero
            if s.warmup_start is not None:
                out.update(warmup_start=s.warmup_start, warmup_ramp=s.warmup_ramp or s.warmup_steps)
        if s.kind in ("linear", "cosine"):
            out.update(decay_steps=s.decay_steps, min_lr=s.min_lr)
        elif s.kind == "step":
            out.update(step_size=s.step_size, gamma=s.gamma)
    out["schedule_detail"] = describe_schedule(s)
    if spec.no_decay:
        out["no_decay"] = list(spec.no_decay)
    if spec.groups:
        out["groups"] = [{"lr": g.lr if g.lr is not None else spec.lr,
                          "weight_decay": g.weight_decay if g.weight_decay is not None else spec.weight_decay}
                         for g in spec.groups]
    out["source"] = "model file" if from_model else "config"
    return out


def describe(spec: OptimizerSpec) -> str:
    extra: Dict[str, Any] = {}
    if isinstance(spec, SGD):
        extra = {"momentum": spec.momentum, "nesterov": spec.nesterov}
    elif isinstance(spec, Adam):
        extra = {"betas": spec.betas, "eps": spec.eps}
    parts = ", ".join(f"{k}={v}" for k, v in {"lr": spec.lr, **extra, "weight_decay": spec.weight_decay}.items())
    sched = "" if spec.schedule.is_constant() else f", schedule={describe_schedule(spec.schedule)}"
    if spec.no_decay:
        sched += f", no_decay={list(spec.no_decay)}"
    if spec.groups:
        sched += f", {len(spec.groups)} group(s)"
    return f"{spec.name}({parts}{sched})"
