"""The torch pieces ``param_units.ParamUnits`` puts on a model for ``trainer.shard=parameters``: a unit's
``forward`` wrapped so a call that bypasses ``__call__`` still brings it in, the identity on a unit's inputs whose
backward says that its backward is done, the tensors of a forward's output (their hooks start the unit's
backward), and the check for a ``fullgraph`` compile, which cannot trace those hooks. ``units`` here is a
``ParamUnits`` (not imported: it imports this module)."""
from __future__ import annotations

import functools
import types
import weakref
from typing import Any, List

import torch


def fullgraph(*models: Any) -> bool:
    """Whether ``torch.compile(..., fullgraph=True)`` compiled any of ``models`` (a module, a dict of them) or a
    submodule: its wrapper (``OptimizedModule``) or an ``nn.Module.compile`` in place (its compiled ``__call__``
    holds the compile's settings)."""
    for model in models:
        if isinstance(model, dict):
            if fullgraph(*model.values()):
                return True
            continue
        if not isinstance(model, torch.nn.Module):
            continue
        for sub in model.modules():
            ctx = getattr(sub, "dynamo_ctx", None)
            call = sub.__dict__.get("_compiled_call_impl")
            cells = [c.cell_contents for c in getattr(call, "__closure__", None) or () if _filled(c)]
            if any(getattr(x, "fullgraph", False) is True for x in [ctx, *cells]):
                return True
    return False


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def tensors(out: Any) -> List[torch.Tensor]:
    """The tensors in a forward's output: a tensor, or tuples, lists and dicts of them (a ModelOutput is a dict)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors(o)]
    return []


def wrap_forward(module: torch.nn.Module, units: Any, u: int) -> None:
    """Replace the unit's ``forward`` (an instance attribute, as ``module.forward = ...`` is) with one that brings
    the unit in when called without ``__call__``: ``checkpoint(unit.forward, h)`` runs no hook, in forward nor in
    its recompute. ``__call__`` goes through it too (its pre-hook already brought the unit in: nothing to do).
    Note: a copy of the module (``copy.deepcopy``) calls the original forward, without fetching."""
    inner = module.__dict__.get("forward")  # an instance's own forward (a user's wrapper), else the class's
    original = inner if inner is not None else type(module).forward
    target = weakref.ref(module)

    def forward(self, *args, **kwargs):
        call = inner if inner is not None else functools.partial(original, self)
        return units.direct_forward(u, call, args, kwargs) if self is target() else call(*args, **kwargs)

    if inner is None:  # inspect.signature(module.forward) still names its arguments (transformers reads them)
        functools.update_wrapper(forward, original)
    module.forward = types.MethodType(forward, module)


class AfterBackward(torch.autograd.Function):
    """The identity on a unit's inputs; its backward runs once their gradients are all computed
    (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx, units: Any, u: int, *inputs: torch.Tensor):
        ctx.units, ctx.u = units, u
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.units.inputs_done(ctx.u)
        return (None, None, *grads)
