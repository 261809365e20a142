"""The TensorFlow backend's native models: recognising a keras model or ``tf.Module``, refusing a
torch one in one line, and naming their variables stably for checkpoints.

A native model's variables stay its own (the Engine does not copy them into its flat variable),
so their names are what a checkpoint holds and must not depend on the order layers were built.
What keras's ``fit()`` does beyond the gradient of the loss is here too: its own losses (regularizers,
``add_loss``) join forward()'s loss, and frozen (``trainable=False``) weights are state, not parameters.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import tensorflow as tf

from ..buffers import Rule, default_rule
from ...errors import ElasticFlowError
from .data import np_dtype
from .ops import _generator

POLICIES = {"bf16": "mixed_bfloat16", "16": "mixed_float16"}  # keras's mixed policies by trainer.precision


def _is_keras(obj: Any) -> bool:
    keras = sys.modules.get("keras")  # a keras model means keras is imported already
    return keras is not None and isinstance(obj, keras.Layer) and keras.backend.backend() == "tensorflow"


def _refuse_keras_elsewhere(obj: Any) -> None:
    """A keras model built on another backend (keras 3 reads KERAS_BACKEND once, as it is first imported): its
    layers call that framework's ops, which fail deep inside a TF graph; refused in one line before training."""
    keras = sys.modules.get("keras")
    if keras is None:
        return
    on = keras.backend.backend()
    values = obj.values() if isinstance(obj, dict) else (obj,)
    if on != "tensorflow" and any(isinstance(v, keras.Layer) for v in values):
        raise ElasticFlowError(f"model() returned a Keras model built with KERAS_BACKEND={on}, which backend="
                               "tensorflow cannot train (keras runs one backend per process)",
                               "unset KERAS_BACKEND or set KERAS_BACKEND=tensorflow where you run elasticflow"
                               + (", or train it with backend=torch (a keras model on torch is a torch module)"
                                  if on == "torch" else ""))


def is_native(obj: Any) -> bool:
    """A model object this backend trains as-is (forward() receives it instead of a params dict)."""
    return isinstance(obj, tf.Module) or _is_keras(obj)


def unwrapped(model: Any) -> Any:
    """The model whose names state uses: a TensorFlow model is its own (torch's is not under torch.compile)."""
    return model


def native_kind(obj: Any) -> Optional[str]:
    """A description of ``obj`` when it is a framework-native model this backend cannot train.

    Checks class module names only: describing a torch model must not import torch. A keras model on another
    keras backend (``KERAS_BACKEND=torch``) is refused here, naming it.
    """
    if is_native(obj):
        return None
    _refuse_keras_elsewhere(obj)
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "torch":
            return f"a PyTorch model (torch.nn.Module subclass {type(obj).__qualname__!r})"
    return None


def native_variables(model: Any) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """(trainable, buffers, frozen) variables of a keras model or tf.Module, by stable unique name.

    Frozen: a keras weight made non-trainable after it was created (``layer.trainable = False``), as
    opposed to one created non-trainable (BatchNormalization's moving statistics, a buffer). Frozen
    weights are state (checkpointed, restored) that nothing changes: no gradient, no optimizer, no
    reconciliation across workers. A tf.Module's non-trainable variables are all buffers.

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
    declared = {id(v) for layer in model._flatten_layers(include_self=True)
                for v in getattr(layer, "_trainable_variables", ())} if _is_keras(model) else set()
    params: Dict[str, Any] = {}
    buffers: Dict[str, Any] = {}
    frozen: Dict[str, Any] = {}
    seen, taken = set(), set()
    for name, var, trainable in found:
        if id(var) in seen:  # a shared layer's variable reached twice
            continue
        seen.add(id(var))
        unique, n = name, 1
        while unique in taken:
            unique, n = f"{name}_{n}", n + 1
        taken.add(unique)
        (params if trainable else frozen if id(var) in declared else buffers)[unique] = var
    return params, buffers, frozen


def owners(model: Any, params: Dict[str, Any]) -> Dict[str, str]:
    """Parameter name -> class name of the keras layer that owns it (``norm`` then matches a
    LayerNormalization's gamma and beta in ``optimizer.no_decay``); {} for a tf.Module."""
    if not _is_keras(model):
        return {}
    name_of = {id(v): n for n, v in params.items()}
    found: Dict[str, str] = {}
    for layer in model._flatten_layers(include_self=True):
        for v in getattr(layer, "_trainable_variables", ()):
            if id(v) in name_of:
                found.setdefault(name_of[id(v)], type(layer).__name__)
    return found


def with_model_losses(model: Any, loss: tf.Tensor) -> tf.Tensor:
    """forward()'s float32 ``loss`` plus a keras model's own losses (weight regularizers, ``add_loss``,
    activity regularizers), each summed and added as ``keras.Model.fit()`` adds them; ``loss`` itself
    for anything else. Called after forward(), inside the tape: the regularizers are computed from
    the variables there, and ``add_loss`` terms are those of the model's last call.

    Note: the Engine weights the total like the loss (by the micro-batch's share of the global batch),
    so over a step the regularization counts once, as in one ``fit()`` batch. A term that grows with
    the batch (a sum over rows, not a mean) would count once per micro-batch share instead. The eval
    loss includes them too, as ``keras.Model.evaluate()``'s does.
    """
    extra = model.losses if _is_keras(model) else ()
    if not extra:
        return loss
    return tf.reduce_sum(tf.stack([loss] + [tf.reduce_sum(tf.cast(x, tf.float32)) for x in extra]))


def mixed_native(model: Any, precision: str) -> None:
    """A native model computing in ``precision``'s keras mixed policy; its variables stay float32.

    A model built under the mixed global policy (setup() sets it before model()) is left as built,
    float32 layers the user asked for included (a final softmax, as keras's guide advises). One built
    in float32 (an Engine made without setup()) has each layer's policy switched: keras reads a
    layer's policy at every call, and variables created in float32 stay float32.
    """
    if not _is_keras(model):
        raise ElasticFlowError(
            f"trainer.precision={precision} needs a keras model or a params dict; a tf.Module computes in its "
            "variables' dtype", "pass trainer.precision=32, or build the model with keras")
    layers = list(model._flatten_layers(include_self=True))
    if any(layer.dtype_policy.name == POLICIES[precision] for layer in layers):
        return
    for layer in layers:
        if layer.dtype_policy.name == "float32":
            layer.dtype_policy = POLICIES[precision]


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
        rules.setdefault(name, default_rule(np.zeros((), np_dtype(var))))
    return rules


def modules_only(model: Any) -> bool:
    """Whether ``model`` is a dict of native models this backend trains as one: never here (a keras model is
    returned as itself; torch takes ``{"net": module}``)."""
    return False


def reseed(seed: Any, generators: List[Any]) -> None:
    """Inside a compiled step: reseed the generator ``elasticflow.ops`` draws from, and each keras layer's own
    (``generators``: Dropout's, GaussianNoise's ...), from one int64 ``seed``."""
    # Philox's state is a 128-bit counter and a 64-bit key: the seed is the key, the counter starts at 0.
    zero = tf.zeros([], tf.int64)
    _generator().state.assign(tf.stack([zero, zero, seed]))
    for i, generator in enumerate(generators):  # one seed each
        salted = tf.bitwise.bitwise_xor(seed, tf.constant((i + 1) * 0x9E3779B97F4A7C1 % (1 << 62), tf.int64))
        generator.state.assign(tf.cast(tf.stack([salted, zero]), generator.state.dtype))
