"""The TensorFlow backend's native models: recognising a keras model or ``tf.Module``, refusing a
torch one in one line, and naming their variables stably for checkpoints.

A native model's variables stay its own (the Engine does not copy them into its flat variable),
so their names are what a checkpoint holds and must not depend on the order layers were built.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import tensorflow as tf

from ..buffers import Rule, default_rule


def _is_keras(obj: Any) -> bool:
    keras = sys.modules.get("keras")  # a keras model means keras is imported already
    return keras is not None and isinstance(obj, keras.Layer)


def is_native(obj: Any) -> bool:
    """A model object this backend trains as-is (forward() receives it instead of a params dict)."""
    return isinstance(obj, tf.Module) or _is_keras(obj)


def native_kind(obj: Any) -> Optional[str]:
    """A description of ``obj`` when it is a framework-native model this backend cannot train.

    Checks class module names only: describing a torch model must not import torch.
    """
    if is_native(obj):
        return None
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "torch":
            return f"a PyTorch model (torch.nn.Module subclass {type(obj).__qualname__!r})"
    return None


def native_variables(model: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(trainable, non-trainable) variables of a keras model or tf.Module, by stable unique name.

    Keras: the variable path without the model's own name ("dense/kernel",
    "batch_normalization/moving_mean"). tf.Module: the attribute path ("layers/0/w").
    Note: keras numbers auto-named layers process-wide (dense, dense_1, ...); a model file that
    builds other models first, or a keras model named by hand differently, changes the names a
    checkpoint holds. Name layers explicitly (``Dense(10, name="out")``) for names that never move.
    """
    if _is_keras(model):
        prefix = model.name + "/"
        reseeded = {id(g.state) for g in seed_generators(model)}  # not state: set at every micro-batch
        found = [(v.path[len(prefix):] if v.path.startswith(prefix) else v.path, v, v.trainable)
                 for v in model.trainable_variables + model.non_trainable_variables if id(v) not in reseeded]
    else:
        found = [("/".join(map(str, path)), v, v.trainable)
                 for path, v in model._flatten(with_path=True, predicate=lambda x: isinstance(x, tf.Variable))]
    params: Dict[str, Any] = {}
    buffers: Dict[str, Any] = {}
    seen, taken = set(), set()
    for name, var, trainable in found:
        if id(var) in seen:  # a shared layer's variable reached twice
            continue
        seen.add(id(var))
        unique, n = name, 1
        while unique in taken:
            unique, n = f"{name}_{n}", n + 1
        taken.add(unique)
        (params if trainable else buffers)[unique] = var
    return params, buffers


def seed_generators(model: Any) -> List[Any]:
    """The keras SeedGenerators of a model's layers (Dropout, GaussianNoise, ...), each once."""
    if not _is_keras(model):
        return []
    found: Dict[int, Any] = {}
    for layer in model._flatten_layers(include_self=True):
        for generator in getattr(layer, "_seed_generators", []):
            found.setdefault(id(generator), generator)
    return list(found.values())


def buffer_rules(model: Any, buffers: Dict[str, Any]) -> Dict[str, Rule]:
    """How a native model's buffers combine across workers: keras BatchNormalization's moving statistics
    are an exponential average with weight ``1 - momentum`` per batch; others take the default rule."""
    rules: Dict[str, Rule] = {}
    if _is_keras(model):
        import keras

        name_of = {id(v): n for n, v in buffers.items()}
        for layer in model._flatten_layers(include_self=False):
            if isinstance(layer, keras.layers.BatchNormalization):
                for var in (layer.moving_mean, layer.moving_variance):
                    if id(var) in name_of:
                        rules[name_of[id(var)]] = Rule("ema", momentum=1.0 - float(layer.momentum))
    for name, var in buffers.items():
        rules.setdefault(name, default_rule(np.zeros((), np.dtype(getattr(var.dtype, "as_numpy_dtype", var.dtype)))))
    return rules
