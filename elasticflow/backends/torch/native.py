"""The torch backend's native models: recognising a ``torch.nn.Module`` (or a dict of them), refusing a
TensorFlow one in one line, which module class holds each parameter, and how a module's buffers combine.

Checks class module names only for foreign models: describing a keras model must not import TensorFlow.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional

import torch

from ..buffers import Rule, default_rule
from .data import to_numpy


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


def compiled(model: Any) -> bool:
    """``torch.compile(net)``'s wrapper (an ``OptimizedModule``), or a dict of modules holding one. Looked up,
    not imported: torch._dynamo is loaded once the user called torch.compile."""
    if isinstance(model, dict):
        return any(compiled(v) for v in model.values())
    wrapper = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return wrapper is not None and isinstance(model, wrapper)


def unwrapped(model: Any) -> Any:
    """The module itself for ``torch.compile(net)``'s wrapper, whose state_dict names gain ``_orig_mod.``;
    each value unwrapped for a dict of modules; anything else as it is. State, checkpoints and exports use
    the module's own names, so a checkpoint resumes with or without compile and an export loads into ``Net()``;
    forward() still receives the compiled wrapper (it shares the module's parameters)."""
    if isinstance(model, dict):
        return {k: unwrapped(v) for k, v in model.items()}
    return model._orig_mod if compiled(model) else model


def modules_only(model: Any) -> bool:
    """model() returned a dict of modules (``{"net": module}`` beside its optimizer)."""
    return isinstance(model, dict) and bool(model) and all(isinstance(v, torch.nn.Module) for v in model.values())


def owners(module: torch.nn.Module) -> Dict[str, str]:
    """Parameter name -> class name of the module that holds it (``norm`` patterns match a LayerNorm's)."""
    return {f"{prefix}.{n}" if prefix else n: type(m).__name__
            for prefix, m in module.named_modules() for n, _ in m.named_parameters(recurse=False)}


def buffer_rules(module: Optional[torch.nn.Module], buffers: Dict[str, torch.Tensor]) -> Dict[str, Rule]:
    """How each buffer combines across workers (``elasticflow.backends.buffers``): BatchNorm's running
    statistics by its momentum (or cumulative average), its counter by sum, other persistent buffers
    by the default rule. Non-persistent buffers (causal masks, position ids) are not state: skipped.
    ``module`` None: a dict model, whose buffers are all state."""
    rules: Dict[str, Rule] = {}
    if module is not None:
        persistent = set(module.state_dict())
        for prefix, layer in module.named_modules():
            if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and layer.running_mean is not None:
                at = f"{prefix}." if prefix else ""
                stat = (Rule("cma", counter=f"{at}num_batches_tracked") if layer.momentum is None
                        else Rule("ema", momentum=float(layer.momentum)))
                rules[f"{at}running_mean"] = rules[f"{at}running_var"] = stat
                rules[f"{at}num_batches_tracked"] = Rule("count")
        names = [n for n in buffers if n in persistent]
    else:
        names = list(buffers)
    for name in names:
        rules.setdefault(name, default_rule(to_numpy(buffers[name])))
    return rules
