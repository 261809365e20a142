"""SGD, Adam and AdamW as one update over flat buffers: torch.optim's formulas, a handful of calls a step.

torch.optim's optimizers on CPU run their single-tensor loop (foreach is the default only on CUDA): SGD
with momentum makes three tensor calls per parameter tensor, Adam about ten, so a GPT-2 block (12 tensors)
costs ~120 dispatches a step whatever its size, and ``exp_avg_sq.sqrt()`` allocates a fresh tensor per
parameter per step; on a small model, torch.optim.SGD's Python (its wrapper, profiler hooks, the group
walk) costs more than the update itself. The Engine keeps the gradient and the parameters in one flat
buffer each, so the same formulas run once over the whole model: 1 to 3 calls a step for SGD, 8 for Adam,
and no allocation.

The arithmetic is torch.optim's single-tensor branch (``sgd._single_tensor_sgd``;
``adam._single_tensor_adam``, non-capturable), op for op and with the same Python-float scalars, so each
element sees the same float32 operations: SGD's updates are bit-identical; Adam's can differ only in the
split between vectorised body and scalar tail of a kernel, which tests/test_optim.py bounds.
State is per parameter to the outside (``state[p]["exp_avg"]`` is a view of the flat slot), so
checkpoints keep the ``optimizer/<param>/<slot>`` layout and load from torch.optim runs and back.
Parameter groups are stretches of the flat buffers (the Engine puts each group's parameters together,
``optim.grouped_order``): the formulas run once per stretch with its own lr and weight decay, which is
torch.optim's per-group update elementwise.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..._util import pages
from ...errors import ElasticFlowError
from ...config.optim import SGD, Adam, AdamW, Group, Hyper, OptimizerSpec, Schedule, Stretch

Run = Tuple[int, int, Hyper]  # a stretch [lo, hi) of the flat buffers and its group's hyperparameters


def zero_slot(flat_param: torch.Tensor) -> torch.Tensor:
    """A fresh optimizer slot like ``flat_param``. On the host, a long one's pages are mapped only where
    written (``pages.zeros``): with ``trainer.shard`` a worker updates only its slices, and ``torch.zeros`` would
    write (and keep resident, until the replica releases the slots) every slot of the whole model at start-up:
    at 154M parameters with Adam, 1.2 GB, which was stage 3's peak."""
    if flat_param.device.type != "cpu":
        return torch.zeros_like(flat_param)
    return pages.zeros(flat_param.numel())


class _Flat:
    """What FlatSGD and FlatAdam share: ``param_groups[0]["lr"]`` (read by ``step()``), and ``state``, which
    maps a parameter to views of its slots once the first step ran (empty before, as torch.optim's).
    ``load_slots`` replaces ``state[p] = ...``: the slots are copied into the flat buffers, which must stay
    single buffers."""

    def __init__(self, lr: float, flat_param: torch.Tensor, flat_grad: torch.Tensor, params: List[torch.Tensor],
                 slots: Dict[str, torch.Tensor], runs: Sequence[Run]):
        self.param_groups = [{"lr": lr}]  # the schedule's lr; a group's is lr * its lr_scale
        self.runs = list(runs)
        self.flat_param, self.flat_grad = flat_param, flat_grad
        self.steps = 0
        self.state: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        self.flat_slots = dict(slots)  # each slot one flat buffer in the flat order (Engine.flat_slots)
        self._views: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        offset = 0
        for p in params:
            n = p.numel()
            self._views[p] = {name: flat[offset:offset + n].view_as(p) for name, flat in slots.items()}
            offset += n

    def _views_by_run(self, *flats: Optional[torch.Tensor]) -> List[Tuple[Hyper, Tuple[Optional[torch.Tensor], ...]]]:
        """Each run's hyperparameters and its views of ``flats`` (None stays None), made once: the buffers
        never move, and slicing six tensors a step is a few microseconds on a millisecond step."""
        return [(h, tuple(None if f is None else f[lo:hi] for f in flats)) for lo, hi, h in self.runs]

    @torch.no_grad()
    def load_slots(self, p: torch.Tensor, slots: Dict[str, torch.Tensor], steps: int) -> None:
        """Copy a checkpoint's slots of ``p`` into the flat slots; the step count becomes ``steps``."""
        for name, value in slots.items():
            if name in self._views[p]:
                self._views[p][name].copy_(value)
        self.steps = int(steps)
        self.state.update(self._views)

    @torch.no_grad()
    def reset(self) -> None:
        """Fresh slots and step count, as a newly built optimizer (a local SGD / DiLoCo round's start)."""
        for views in self._views.values():
            for view in views.values():
                view.zero_()
        self.steps = 0
        self.state.clear()


class FlatSGD(_Flat):
    """torch.optim.SGD (momentum, Nesterov, weight decay) over flat param/grad buffers; see ``_Flat``."""

    def __init__(self, spec: SGD, flat_param: torch.Tensor, flat_grad: torch.Tensor, params: List[torch.Tensor],
                 runs: Sequence[Run]):
        self.momentum, self.nesterov = spec.momentum, spec.nesterov
        self.momentum_buffer = zero_slot(flat_param) if spec.momentum else None
        # Scratch for grad + wd * param and Nesterov's grad + momentum * buf (torch.optim allocates both
        # per parameter per step); the reduced gradient itself stays what was reduced.
        decays = any(h.weight_decay for _, _, h in runs)
        self._scratch = torch.empty_like(flat_param) if decays or spec.nesterov else None
        super().__init__(spec.lr, flat_param, flat_grad, params,
                         {"momentum_buffer": self.momentum_buffer} if spec.momentum else {}, runs)
        self._stretches = self._views_by_run(flat_param, flat_grad, self.momentum_buffer, self._scratch)

    @torch.no_grad()
    def step(self, plan: Optional[Sequence[Stretch]] = None) -> None:
        """One update of every parameter, or of ``plan``'s stretches only (``optim.stretches``: parameters
        with no gradient sit the step out, as torch.optim's skip of a None ``.grad``)."""
        first = not self.state  # no momentum yet: neither a step taken nor slots loaded
        if first and self.momentum:
            self.state.update(self._views)
        lr = self.param_groups[0]["lr"]
        if plan is None:
            for h, (param, grad, buf, scratch) in self._stretches:
                sgd_update(param, grad, buf, lr * h.lr_scale, self.momentum, self.nesterov, h.weight_decay,
                           first=first, scratch=scratch)
        else:
            for lo, hi, h, own in plan:
                # A parameter's first own step: its buffer was never written, and takes the gradient itself.
                sgd_update(self.flat_param[lo:hi], self.flat_grad[lo:hi],
                           None if self.momentum_buffer is None else self.momentum_buffer[lo:hi], lr * h.lr_scale,
                           self.momentum, self.nesterov, h.weight_decay, first=own == 1,
                           scratch=None if self._scratch is None else self._scratch[lo:hi])
        self.steps += 1


class FlatAdam(_Flat):
    """torch.optim.Adam / AdamW (``decoupled`` by the spec's class) over flat param/grad buffers; see ``_Flat``.

    Args:
        spec: the Adam or AdamW spec (betas, eps, weight_decay).
        flat_param, flat_grad: 1-D float32 buffers; ``params[i]`` and its ``.grad`` are views of them,
            laid out in order.
    """

    def __init__(self, spec: Adam, flat_param: torch.Tensor, flat_grad: torch.Tensor, params: List[torch.Tensor],
                 runs: Sequence[Run]):
        self.decoupled = isinstance(spec, AdamW)
        self.beta1, self.beta2 = spec.betas
        self.eps = spec.eps
        self.exp_avg = zero_slot(flat_param)
        self.exp_avg_sq = zero_slot(flat_param)
        # Scratch for the denominator (torch.optim allocates it per parameter per step: for a large
        # embedding that is a fresh multi-MB block, page faults included, every step).
        self._denom = torch.empty_like(flat_param)
        # Adam's L2 term makes grad + wd * param without touching the gradient buffer (the reduced
        # gradient stays what was reduced); one more model-sized buffer, only when used.
        l2 = not self.decoupled and any(h.weight_decay for _, _, h in runs)
        self._l2 = torch.empty_like(flat_param) if l2 else None
        super().__init__(spec.lr, flat_param, flat_grad, params,
                         {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}, runs)
        self._stretches = self._views_by_run(flat_param, flat_grad, self.exp_avg, self.exp_avg_sq, self._denom,
                                             self._l2)

    @torch.no_grad()
    def step(self, plan: Optional[Sequence[Stretch]] = None) -> None:
        """One update of every parameter, or of ``plan``'s stretches only, each with its own step count
        (``optim.stretches``: torch.optim counts steps per parameter, and skips one whose ``.grad`` is None)."""
        if not self.state:
            self.state.update(self._views)
        self.steps += 1
        lr = self.param_groups[0]["lr"]
        if plan is None:
            for h, (param, grad, exp_avg, exp_avg_sq, denom, l2) in self._stretches:
                adam_update(param, grad, exp_avg, exp_avg_sq, denom, lr * h.lr_scale, (self.beta1, self.beta2),
                            self.eps, h.weight_decay, self.decoupled, self.steps, l2)
            return
        for lo, hi, h, own in plan:
            adam_update(self.flat_param[lo:hi], self.flat_grad[lo:hi], self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi],
                        self._denom[lo:hi], lr * h.lr_scale, (self.beta1, self.beta2), self.eps, h.weight_decay,
                        self.decoupled, own, None if self._l2 is None else self._l2[lo:hi])


@torch.no_grad()
def sgd_update(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor], lr: float,
               momentum: float, nesterov: bool, weight_decay: float, first: bool, scratch=None) -> None:
    """One SGD update of flat (or sliced: elementwise) buffers in place, torch.optim.SGD's single-tensor
    step op for op. ``first``: the momentum buffer is empty and takes the gradient itself, as torch.optim's
    first step clones it (a zeroed buffer would turn a -0.0 gradient into +0.0). ``scratch``: param's size,
    for weight decay's and Nesterov's temporaries."""
    if weight_decay != 0:
        grad = torch.add(grad, param, alpha=weight_decay, out=scratch)
    if momentum != 0:
        if first:
            momentum_buffer.copy_(grad)
        else:
            momentum_buffer.mul_(momentum).add_(grad, alpha=1)
        grad = torch.add(grad, momentum_buffer, alpha=momentum, out=scratch) if nesterov else momentum_buffer
    param.add_(grad, alpha=-lr)


@torch.no_grad()
def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                denom: torch.Tensor, lr: float, betas, eps: float, weight_decay: float, decoupled: bool,
                steps: int, l2_out=None, exact_sqrt: bool = False) -> None:
    """One Adam/AdamW update of flat (or sliced: elementwise, so any range alone gets the same values)
    buffers in place. ``denom``: scratch of param's size; ``l2_out``: scratch for Adam's L2 term.
    ``exact_sqrt``: the square root correctly rounded (through float64), as TensorFlow's update takes it, for a
    TensorFlow engine's sharded update; torch's own float32 sqrt on a CPU is an ulp off in ~20% of elements."""
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
    if exact_sqrt:
        denom = denom.copy_(exp_avg_sq.double().sqrt_()).div_(bias_correction2_sqrt).add_(eps)
    else:
        denom = torch.sqrt(exp_avg_sq, out=denom).div_(bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def weight_decay_is_l2(spec: Adam, runs: Sequence[Run] = ()) -> bool:
    """Whether Adam's weight decay is an L2 term (not AdamW's decoupled one) for some parameter."""
    decays = any(h.weight_decay for _, _, h in runs) if runs else spec.weight_decay != 0
    return decays and not isinstance(spec, AdamW)


_NATIVE = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}
_PER_GROUP = ("lr", "weight_decay")  # what a group may change; other per-group settings are refused


def spec_from_native(opt: Any, scheduler: Any = None) -> Optional[OptimizerSpec]:
    """The spec of a ``torch.optim`` SGD, Adam or AdamW that model() built (its param groups become
    ``Group``s of the tensors), driven by ``scheduler`` (a ``torch.optim.lr_scheduler`` on it, model()'s
    ``"lr_scheduler"``) where one is given; None for anything that is not a torch optimizer.

    Example (model() of a fine-tune, the Hugging Face habit):
        >>> decay = [p for n, p in net.named_parameters() if not n.endswith("bias")]
        >>> rest = [p for n, p in net.named_parameters() if n.endswith("bias")]
        >>> opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
        ...                          {"params": rest, "weight_decay": 0.0}], lr=1e-3)
        >>> return {"net": net, "optimizer": opt, "lr_scheduler": CosineAnnealingLR(opt, T_max=1000)}

    Note: the scheduler is translated into the spec's ``Schedule`` (``schedule_from_native``), stepped once per
    optimizer step; a scheduler it cannot compute, or one built on the optimizer and not returned, is refused.
    """
    if not isinstance(opt, torch.optim.Optimizer):
        if scheduler is not None:
            raise ElasticFlowError(f"model()['lr_scheduler'] is given beside model()['optimizer'], a "
                                   f"{type(opt).__name__}: a torch scheduler needs the torch.optim optimizer it "
                                   "was built on",
                                   "return {'optimizer': opt, 'lr_scheduler': sched} with sched built on that "
                                   "torch.optim optimizer, or set optimizer.schedule in the config")
        return None
    kind = type(opt).__name__
    d = opt.defaults
    if kind not in _NATIVE or any(d.get(k) for k in ("amsgrad", "maximize", "dampening", "differentiable")):
        raise ElasticFlowError(f"model()['optimizer'] is a torch.optim.{kind}"
                               f"{' with ' + ', '.join(k for k in ('amsgrad', 'maximize', 'dampening') if d.get(k)) if kind in _NATIVE else ''}, "
                               "which the flat update does not compute",
                               "use torch.optim.SGD, Adam or AdamW with their default options, or elasticflow.optim")
    if kind == "Adam" and d.get("decoupled_weight_decay"):
        kind = "AdamW"
    # A scheduler's constructor set each group's "lr" to its first value and kept the group's own in "initial_lr".
    base_lrs = [float(g.get("initial_lr", g["lr"])) for g in opt.param_groups]
    lr, wd = float(d["lr"]), float(d.get("weight_decay", 0.0))
    # First: a scheduler that moves more than the lr (OneCycleLR's momentum) is refused as a scheduler.
    schedule = None if scheduler is None else schedule_from_native(scheduler, opt, lr, base_lrs)
    for i, g in enumerate(opt.param_groups):
        other = [k for k, v in g.items() if k not in ("params", *_PER_GROUP) and k in d and _differs(v, d[k])]
        if other:
            raise ElasticFlowError(f"torch.optim.{kind} param group {i} sets its own {', '.join(other)}",
                                   "a group may change lr and weight_decay; set the others on the optimizer")
    if scheduler is None and any("initial_lr" in g for g in opt.param_groups):
        raise ElasticFlowError(f"model()'s torch.optim.{kind} has a learning-rate scheduler built on it that "
                               "model() did not return: it would train at the scheduler's first lr "
                               f"({float(opt.param_groups[0]['lr']):g}) for every step",
                               "return it beside the optimizer: {'optimizer': opt, 'lr_scheduler': sched}, or "
                               "build no scheduler and set optimizer.schedule in the config")
    groups = [Group(tuple(g["params"]), lr=lr, weight_decay=float(g["weight_decay"]))
              for g, lr in zip(opt.param_groups, base_lrs)]
    if kind == "SGD":
        return SGD(lr, momentum=float(d.get("momentum", 0.0)), nesterov=bool(d.get("nesterov")), weight_decay=wd,
                   groups=groups, schedule=schedule)
    return _NATIVE[kind](lr, betas=tuple(float(b) for b in d["betas"]), eps=float(d["eps"]), weight_decay=wd,
                         groups=groups, schedule=schedule)


SCHEDULERS_HINT = ("return a CosineAnnealingLR, LinearLR, StepLR, ExponentialLR, PolynomialLR(power=1) or LambdaLR, "
                   "or a SequentialLR of a LinearLR warmup and one of them; or return none and set "
                   "optimizer.schedule=linear|cosine|step with optimizer.warmup_steps in the config")


def schedule_from_native(sched: Any, opt: Any, lr: float, base_lrs: Sequence[float]) -> Schedule:
    """The ``Schedule`` that gives each update the lr ``sched`` would (stepped once after each optimizer step,
    from its first value: torch's closed forms), for the spec's ``lr`` (the optimizer's default) and the groups'
    own ``base_lrs``, which the engine scales in proportion as torch's schedulers do.

    Translated: CosineAnnealingLR (``periodic``: past T_max it climbs back, as torch's), LinearLR (a warmup
    when end_factor is 1, a linear decay when start_factor is 1), StepLR, ExponentialLR, PolynomialLR of power 1,
    LambdaLR (its function, called with the step: one function for every group), and SequentialLR of a LinearLR
    warmup followed by one of these. Anything else is refused in one line (``SCHEDULERS_HINT``)."""
    from torch.optim import lr_scheduler as L

    name = type(sched).__name__
    if not isinstance(sched, L.LRScheduler if hasattr(L, "LRScheduler") else L._LRScheduler):
        what = "ReduceLROnPlateau (it follows a metric, not the step)" if name == "ReduceLROnPlateau" else \
            f"a {name}, not a torch.optim.lr_scheduler"
        raise ElasticFlowError(f"model()['lr_scheduler'] is {what}, which ElasticFlow cannot compute from the step",
                               SCHEDULERS_HINT)
    if getattr(sched, "optimizer", None) is not opt:
        raise ElasticFlowError(f"model()['lr_scheduler'] ({name}) was built on another optimizer than "
                               "model()['optimizer']", "build the scheduler on the optimizer model() returns")
    if getattr(sched, "last_epoch", 0) != 0:
        raise ElasticFlowError(f"model()['lr_scheduler'] ({name}) has been stepped {sched.last_epoch} time(s) "
                               "already; ElasticFlow steps it from the start", "return a freshly built scheduler")

    def refuse(why: str) -> ElasticFlowError:
        return ElasticFlowError(f"model()['lr_scheduler'] is a {why}, which ElasticFlow cannot compute",
                                SCHEDULERS_HINT)

    def one(s: Any) -> Schedule:
        kind = type(s).__name__
        if isinstance(s, L.CosineAnnealingLR):
            if s.eta_min and len(set(base_lrs)) > 1:  # torch: eta_min + (lr_g - eta_min) * c, not in proportion
                raise refuse(f"CosineAnnealingLR with eta_min={s.eta_min:g} over param groups of different lr")
            return Schedule("cosine", decay_steps=int(s.T_max), min_lr=float(s.eta_min) * lr / base_lrs[0],
                            periodic=True)
        if isinstance(s, L.LinearLR):
            start, end, iters = float(s.start_factor), float(s.end_factor), int(s.total_iters)
            if end == 1.0:
                return Schedule("constant", warmup_steps=iters, warmup_start=start, warmup_ramp=iters)
            if start == 1.0:
                return Schedule("linear", decay_steps=iters, min_lr=end * lr)
            raise refuse(f"LinearLR from {start:g} to {end:g} (neither a warmup to 1 nor a decay from 1)")
        if isinstance(s, L.StepLR):
            return Schedule("step", step_size=int(s.step_size), gamma=float(s.gamma))
        if isinstance(s, L.ExponentialLR):
            return Schedule("step", step_size=1, gamma=float(s.gamma))
        if isinstance(s, L.PolynomialLR) and float(s.power) == 1.0:
            return Schedule("linear", decay_steps=int(s.total_iters), min_lr=0.0)
        if isinstance(s, L.LambdaLR):
            fns = {id(f): f for f in s.lr_lambdas}
            if len(fns) > 1:
                raise refuse("LambdaLR with a function per param group")
            fn = s.lr_lambdas[0]
            return Schedule("function", fn=lambda step: lr * fn(step), label=f"LambdaLR({_named(fn)})")
        if kind == "ReduceLROnPlateau":
            raise refuse("ReduceLROnPlateau (it follows a metric, not the step)")
        if kind == "PolynomialLR":
            raise refuse(f"PolynomialLR of power {float(s.power):g}")
        raise refuse(kind)

    if isinstance(sched, L.SequentialLR):
        children, milestones = list(sched._schedulers), list(sched._milestones)
        if len(children) != 2 or not isinstance(children[0], L.LinearLR) or float(children[0].end_factor) != 1.0:
            raise refuse(f"SequentialLR of {', '.join(type(c).__name__ for c in children)}")
        warm, main = one(children[0]), one(children[1])
        at = int(milestones[0])
        if warm.warmup_ramp > at or main.warmup_steps or main.fn is not None:
            raise refuse(f"SequentialLR of {', '.join(type(c).__name__ for c in children)} at step {at}")
        main.warmup_steps, main.warmup_start, main.warmup_ramp = at, warm.warmup_start, warm.warmup_ramp
        if main.decay_steps is not None:
            main.decay_steps += at  # the config's decay_steps count from step 0, the warmup's included
        main.label = f"SequentialLR({', '.join(type(c).__name__ for c in children)})"
        return main
    out = one(sched)
    out.label = out.label or name
    return out


def _named(fn: Any) -> str:
    """A LambdaLR's function by its name, and a functools.partial's keywords (Hugging Face's schedules)."""
    keywords = getattr(fn, "keywords", None)
    inner = getattr(fn, "func", fn)
    name = getattr(inner, "__name__", type(inner).__name__)
    return f"{name}({', '.join(f'{k}={v}' for k, v in keywords.items())})" if keywords else name


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except RuntimeError:  # tensors (a tensor lr or betas): compare their values
        return bool(torch.as_tensor(a).ne(torch.as_tensor(b)).any())


def make_optimizer(spec: OptimizerSpec, params: List[torch.Tensor], flat_param: torch.Tensor,
                   flat_grad: torch.Tensor, runs: Sequence[Run]):
    """The flat update of ``spec`` over the Engine's buffers (``params[i]`` are views of ``flat_param``)."""
    if spec.formulas != "torch":
        raise ElasticFlowError(f"the torch backend computes torch.optim's formulas, not {spec.formulas}'s "
                               f"({spec.name})", "use elasticflow.optim.SGD, Adam or AdamW, or backend=tensorflow")
    if isinstance(spec, SGD):
        return FlatSGD(spec, flat_param, flat_grad, params, runs)
    if isinstance(spec, Adam):
        return FlatAdam(spec, flat_param, flat_grad, params, runs)
    raise ElasticFlowError(f"the torch backend has no optimizer for {type(spec).__name__}",
                           "use elasticflow.optim.SGD, Adam or AdamW")


class Released:
    """The optimizer's place once ``release_optimizer`` ran: no slots, and no update of its own."""

    def __init__(self):
        self.state: Dict[Any, Any] = {}
        self.param_groups: List[Dict[str, Any]] = [{}]
        self.flat_slots: Dict[str, Any] = {}

    def step(self, plan: Any = None) -> None:
        raise RuntimeError("this engine's optimizer was released for a sharded update (trainer.shard)")

    def load_slots(self, p: Any, slots: Dict[str, Any], steps: int) -> None:
        self.state[p] = slots
