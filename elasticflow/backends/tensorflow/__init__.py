"""TensorFlow backend: the ops of ``elasticflow.ops`` and the ``Engine`` that trains with GradientTape.

The same names, semantics and layouts as ``backends/torch/``, so one model file and its checkpoints
move between backends; this package is what ``backends.load("tensorflow")`` returns. Its modules
have the torch package's names, and take more code where TensorFlow needs more than torch:

- ``ops.py``: the ops with torch's layouts and rules (NCHW convolutions, a tie's gradient, float32
  islands under mixed precision);
- ``data.py``: tensors from numpy, the resident dataset, and ``Rows`` (a batch gathered inside the
  compiled step);
- ``devices.py``: ``setup`` (GPUs, threads, seeds, keras's dtype policy), ``gpus``, ``bf16_supported``, and
  ``Precision`` (an Engine's compute dtype and loss scale);
- ``native.py``: keras models and tf.Modules (stable variable names, frozen weights, keras's own
  losses, seed generators, BatchNormalization's rules);
- ``optim.py``: SGD, Adam and AdamW with torch.optim's formulas, slot names, float32 rounding of the
  scalars and parameter groups, and the Engine's optimizer state (``FlatOptimizer``);
- ``variables.py``: a model's variables in the flat order and by name (``Variables``): a dict model's
  float arrays in ONE flat variable, since a TF variable cannot be a view of another as torch's are;
- ``engine.py``: the ``Engine`` (``backends/engine.py``'s contract).

TensorFlow only: ``compiled.py`` (the cheaper call of a compiled step) and ``quiet.py`` (the first
import of TF without its start-up noise, which this file runs before anything imports TF).
"""
from __future__ import annotations

from .quiet import import_tensorflow

tf = import_tensorflow()  # the process's first import of TF, if it is: without its start-up noise

from ..common import set_training, training  # noqa: E402,F401 - the process's training flag, shared
# The data path, under the names a backend package provides (Rows: a batch gathered inside the compiled step).
from .data import Rows, gather, index, resident, to_device, to_numpy, to_tensor  # noqa: E402,F401
from .devices import bf16_supported, gpus, setup  # noqa: E402,F401
from .engine import Engine  # noqa: E402,F401
from .native import is_native, modules_only, native_kind, unwrapped  # noqa: E402,F401
from .optim import spec_from_native  # noqa: E402,F401 - modelfile.build asks every backend
# The ops, under the names elasticflow.ops calls (this package is the backend it dispatches to).
from .ops import (  # noqa: E402,F401
    abs, accuracy, argmax, cast, concat, conv2d, cross_entropy, dropout, embedding, exp, gelu, layer_norm, log,
    log_softmax, matmul, max_pool2d, maximum, mean, mse, one_hot, relu, reshape, sigmoid, softmax, sqrt, square,
    stop_gradient, sum, tanh, transpose)

NAME = "tensorflow"
