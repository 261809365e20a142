"""PyTorch backend: the ops of ``elasticflow.ops`` and the ``Engine`` that trains with autograd.

Gradients accumulate into one flat buffer (each parameter's ``.grad`` is a view of it), so a
distributed reduction is a single call on one tensor and zeroing is one ``zero_()``.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from . import common
from .common import activate, check_loss, flatten, host_array, rebuild, state_names
from .common import set_training, training  # noqa: F401 - names every backend module provides
from ..errors import ElasticFlowError
from ..buffers import Rule, default_rule
from ..optim import SGD, Adam, OptimizerSpec
from .torch_adam import FlatAdam

NAME = "torch"
_SELF = sys.modules[__name__]  # what an Engine activates for elasticflow.ops


def setup(threads: Optional[int], seed: int) -> None:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)


def is_native(obj: Any) -> bool:
    """A model object this backend trains as-is (forward() receives it instead of a params dict)."""
    return isinstance(obj, torch.nn.Module)


def native_kind(obj: Any) -> Optional[str]:
    """A description of ``obj`` when it is a framework-native model this backend cannot train."""
    return None if isinstance(obj, torch.nn.Module) else _foreign_kind(obj)


def _foreign_kind(obj: Any) -> Optional[str]:
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] in ("keras", "tf_keras", "tensorflow"):
            return f"a TensorFlow model ({type(obj).__module__}.{type(obj).__name__})"
    return None


# ---------------------------------------------------------------- ops
matmul = torch.matmul
relu = torch.relu
tanh = torch.tanh
sigmoid = torch.sigmoid
exp = torch.exp
log = torch.log
sqrt = torch.sqrt
square = torch.square
abs = torch.abs  # noqa: A001
maximum = torch.maximum
stop_gradient = torch.Tensor.detach


def gelu(x):
    return F.gelu(x)


def _dims(axis):
    return tuple(axis) if isinstance(axis, (tuple, list)) else axis


def mean(x, axis=None, keepdims=False):
    return torch.mean(x) if axis is None and not keepdims else torch.mean(x, dim=_dims(axis), keepdim=keepdims)


def sum(x, axis=None, keepdims=False):  # noqa: A001
    return torch.sum(x) if axis is None and not keepdims else torch.sum(x, dim=_dims(axis), keepdim=keepdims)


def reshape(x, shape):
    return torch.reshape(x, shape)


def transpose(x, perm=None):
    return x.permute(*(perm if perm is not None else range(x.dim() - 1, -1, -1)))


def concat(xs, axis=0):
    return torch.cat(xs, dim=axis)


def softmax(x, axis=-1):
    return torch.softmax(x, dim=axis)


def log_softmax(x, axis=-1):
    return torch.log_softmax(x, dim=axis)


def one_hot(ids, num_classes):
    return F.one_hot(ids.long(), num_classes).to(torch.float32)


def cross_entropy(logits, labels):
    return F.cross_entropy(logits, labels.long())


def mse(pred, target):
    return F.mse_loss(pred, target)


def accuracy(logits, labels):
    # No torch.no_grad() (~5 us a call): argmax's integer output already cuts the graph.
    return (logits.argmax(dim=-1) == labels.long()).to(torch.float32).mean()


def argmax(x, axis=-1):
    return torch.argmax(x, dim=axis)


def conv2d(x, w, b, stride, padding):
    return F.conv2d(x, w, b, stride=stride, padding=padding)


def max_pool2d(x, size, stride):
    return F.max_pool2d(x, size, stride)


def layer_norm(x, gamma, beta, eps):
    return F.layer_norm(x, x.shape[-1:], gamma, beta, eps)


def embedding(table, ids):
    return F.embedding(ids.long(), table)


def dropout(x, rate):
    return F.dropout(x, rate, training=common._training) if rate else x


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}


def cast(x, dtype):
    return x.to(_DTYPES[dtype])


# ---------------------------------------------------------------- data
def to_tensor(array: np.ndarray) -> torch.Tensor:
    """float64 becomes float32 (the framework's parameter dtype); other dtypes keep theirs."""
    array = np.asarray(array)
    if array.dtype != np.float64 and (not array.flags.writeable or not array.flags.c_contiguous):
        array = np.ascontiguousarray(array).copy()  # from_numpy shares memory: a read-only array warns
    return torch.from_numpy(host_array(array))


resident = functools.partial(common.resident, to_tensor)


def index(positions: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(positions)


def gather(tensors: Tuple[torch.Tensor, ...], idx: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    return tuple(t.index_select(0, idx) for t in tensors)


def to_numpy(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


# ---------------------------------------------------------------- engine
def _size(x: Any) -> Optional[int]:
    """check_loss's test: the number of elements of a torch tensor, None for anything else."""
    return x.numel() if isinstance(x, torch.Tensor) else None


def _check_loss(out: Any, where: str):
    """forward()'s output as (scalar loss, {metric: scalar}); see ``common.check_loss``."""
    loss, metrics = check_loss(out, where, _size, NAME)
    return loss.reshape(()), metrics


class Engine:
    """Parameters, autograd, the flat gradient buffer and the optimizer of one worker.

    Args:
        model: what ``model(cfg)`` returned, without the "optimizer" key: a (nested) dict of
            arrays/tensors, or a ``torch.nn.Module``.
        forward: the user's ``forward(*batch, params)``.
        spec: the optimizer spec.
    """

    def __init__(self, model: Any, forward, spec: OptimizerSpec, jit: bool = True):
        self.forward = forward
        self.spec = spec
        self.module: Optional[torch.nn.Module] = None
        if isinstance(model, torch.nn.Module):
            self.module = model
            self.params = dict(model.named_parameters())
            self.buffers = dict(model.named_buffers())
            self.view = model
        else:
            leaves: Dict[str, torch.Tensor] = {}
            self.params, self.buffers = {}, {}
            for name, value in flatten(model):
                t = value.detach().clone() if isinstance(value, torch.Tensor) else to_tensor(np.array(value))
                if t.is_floating_point():
                    t = t.to(torch.float32).requires_grad_(True)
                    self.params[name] = t
                else:
                    self.buffers[name] = t
                leaves[name] = t
            self.view = rebuild(model, leaves)
        if not self.params:
            raise ElasticFlowError("model() returned no floating-point parameters to train",
                                   "return a dict of float arrays, e.g. {'W': np.zeros((64, 10), np.float32)}")
        plist = list(self.params.values())
        self.num_params = int(np.sum([p.numel() for p in plist]))
        self.flat_grad = torch.zeros(self.num_params, dtype=torch.float32)
        self.flat_param: Optional[torch.Tensor] = None
        if isinstance(spec, Adam):
            # Parameters become views of one flat buffer too, so Adam runs once over the model
            # (torch_adam.py). A copy of the model's values at start-up; the Parameter objects stay
            # the module's own, only their storage moves (as .data, which autograd allows on leaves).
            self.flat_param = torch.empty(self.num_params, dtype=torch.float32)
        offset = 0
        for p in plist:
            n = p.numel()
            if self.flat_param is not None:
                view = self.flat_param[offset:offset + n].view_as(p)
                view.copy_(p.detach())
                p.data = view
            p.grad = self.flat_grad[offset:offset + n].view_as(p)
            offset += n
        self.optimizer = _make_optimizer(spec, plist, self.flat_param, self.flat_grad)
        self._buffer_views: Optional[Dict[str, np.ndarray]] = None  # buffer_arrays(), made at first use
        self._checked = False

    # -- one step
    def train_mode(self, training: bool) -> None:
        set_training(training)
        if self.module is not None:
            self.module.train(training)

    def zero_grad(self) -> None:
        self.flat_grad.zero_()

    def accumulate(self, batch: Tuple[torch.Tensor, ...], weight: float):
        """Backprop ``weight * loss`` of one micro-batch into the flat buffer; returns weighted (loss, metrics)."""
        # forward()'s elasticflow.ops calls come here, whichever backend another trainer chose since.
        # Set, not set-and-restored around forward(): one assignment per micro-batch instead of two
        # and a try/finally, and ops stays on this backend after the step, as ops.use(NAME) left it.
        activate(_SELF)
        loss, metrics = _check_loss(self.forward(*batch, params=self.view), "for a micro-batch")
        if weight != 1.0:  # one micro-batch per step (weight 1) is the common case: skip three tensor ops
            loss = loss * weight
            metrics = {k: v * weight for k, v in metrics.items()}
        loss.backward()
        if not self._checked:
            self._check_grad_views()
        return loss.detach(), {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}

    def _check_grad_views(self) -> None:
        # Autograd accumulates in place into an existing .grad; verify once that it kept our views.
        base = self.flat_grad.data_ptr()
        end = base + self.flat_grad.numel() * 4
        for name, p in self.params.items():
            if p.grad is None or not (base <= p.grad.data_ptr() < end):
                raise RuntimeError(f"gradient of {name!r} left the flat buffer; do not replace .grad in forward()")
        self._checked = True

    def grad_view(self) -> torch.Tensor:
        """The accumulated flat gradient (1-D float32); in-place edits (an allreduce) are what apply() uses."""
        return self.flat_grad

    def grad_norm(self) -> float:
        return float(torch.linalg.vector_norm(self.flat_grad))

    def scale_grad(self, factor: float) -> None:
        self.flat_grad.mul_(factor)

    def apply(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    @torch.no_grad()
    def evaluate(self, batch: Tuple[torch.Tensor, ...]) -> Dict[str, float]:
        activate(_SELF)
        loss, metrics = _check_loss(self.forward(*batch, params=self.view), "in evaluation")
        return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}}

    # -- state, by name, as numpy (backend-neutral checkpoints)
    def state(self, copy: bool = True) -> Dict[str, np.ndarray]:
        """Parameters, buffers and optimizer slots by name, as numpy arrays.

        ``copy=False`` returns views of the live tensors (no copy, so no stall proportional to the
        model): they change with the next ``apply``/``load_state``, so read them before that (a
        checkpoint snapshot, a state transfer) and never write to them.
        """
        take = (lambda t: to_numpy(t).copy()) if copy else to_numpy
        out = {n: take(p) for n, p in self.params.items()}
        out.update({n: take(b) for n, b in self.buffers.items()})
        for n, p in self.params.items():
            slots = self.optimizer.state.get(p, {})
            for slot in self.spec.slots():
                if slot in slots and slots[slot] is not None:
                    out[f"optimizer/{n}/{slot}"] = take(slots[slot])
        return out

    @torch.no_grad()
    def load_state(self, state: Dict[str, np.ndarray], optimizer_steps: int) -> None:
        for n, t in list(self.params.items()) + list(self.buffers.items()):
            t.copy_(torch.from_numpy(np.asarray(state[n])).to(t.dtype).reshape(t.shape))
        for n, p in self.params.items():
            slots = {s: torch.from_numpy(np.array(state[f"optimizer/{n}/{s}"], dtype=np.float32)).reshape(p.shape)
                     for s in self.spec.slots() if f"optimizer/{n}/{s}" in state}
            if slots and isinstance(self.optimizer, FlatAdam):
                self.optimizer.load_slots(p, slots, optimizer_steps)
            elif slots:
                self.optimizer.state[p] = slots

    def state_names(self) -> List[str]:
        return state_names(self.params, self.buffers, self.spec.slots())


    # -- the same result for any number of workers: randomness per micro-batch, buffers reconciled
    def seed(self, value: int) -> None:
        """Seed the generator behind dropout (``ops.dropout``, ``nn.Dropout``, ``F.dropout``, attention
        dropout) for the next micro-batch. The default generator's own seeding (~2 us), not
        ``torch.manual_seed`` (~350 us: it visits every device's generator)."""
        torch.default_generator.manual_seed(value)

    def buffer_rules(self) -> Dict[str, Rule]:
        """How each buffer combines across workers (``elasticflow.buffers``): BatchNorm's running
        statistics by its momentum (or cumulative average), its counter by sum, other persistent buffers
        by the default rule. Non-persistent buffers (causal masks, position ids) are not state: skipped."""
        rules: Dict[str, Rule] = {}
        if self.module is not None:
            persistent = set(self.module.state_dict())
            for prefix, layer in self.module.named_modules():
                if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and layer.running_mean is not None:
                    at = f"{prefix}." if prefix else ""
                    stat = (Rule("cma", counter=f"{at}num_batches_tracked") if layer.momentum is None
                            else Rule("ema", momentum=float(layer.momentum)))
                    rules[f"{at}running_mean"] = rules[f"{at}running_var"] = stat
                    rules[f"{at}num_batches_tracked"] = Rule("count")
            names = [n for n in self.buffers if n in persistent]
        else:
            names = list(self.buffers)
        for name in names:
            rules.setdefault(name, default_rule(to_numpy(self.buffers[name])))
        return rules

    def buffer_arrays(self) -> Dict[str, np.ndarray]:
        """Every buffer by name, as numpy views of the live tensors (made once: BatchNorm, load_state and
        set_buffers all write in place, so the views stay the buffers' own)."""
        if self._buffer_views is None:
            self._buffer_views = {n: b.detach().numpy() for n, b in self.buffers.items()}
        return self._buffer_views

    def set_buffers(self, values: Dict[str, np.ndarray]) -> None:
        views = self.buffer_arrays()
        for name, value in values.items():
            np.copyto(views[name], np.reshape(value, views[name].shape), casting="unsafe")


def _make_optimizer(spec: OptimizerSpec, params: List[torch.Tensor], flat_param: Optional[torch.Tensor],
                    flat_grad: torch.Tensor):
    if isinstance(spec, SGD):
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                               weight_decay=spec.weight_decay)
    if isinstance(spec, Adam):
        return FlatAdam(spec, flat_param, flat_grad, params)
    raise ElasticFlowError(f"the torch backend has no optimizer for {type(spec).__name__}",
                           "use elasticflow.optim.SGD, Adam or AdamW")
