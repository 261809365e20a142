"""PyTorch backend: the ops of ``elasticflow.ops`` and the ``Engine`` that trains with autograd.

This package is what ``backends.load("torch")`` returns and what ``elasticflow.ops`` dispatches to:
the names below are the ones every backend package provides. The modules behind them have the same
names in ``backends/tensorflow/``:

- ``ops.py``: the ops (torch's own functions, mostly; the reference semantics);
- ``data.py``: numpy to tensors, the resident dataset, a batch on the device, rows by index;
- ``devices.py``: ``setup`` (threads, seed, this worker's GPU), ``gpus``, ``bf16_supported``;
- ``native.py``: ``torch.nn.Module`` models (and refusing a TensorFlow one), BatchNorm's buffer rules;
- ``optim.py``: SGD, Adam and AdamW as one update over the flat buffers (torch.optim's formulas),
  and reading a ``torch.optim`` optimizer that model() returned (``spec_from_native``);
- ``variables.py``: the parameters, buffers and frozen parameters as views of flat float32 vectors
  (``Variables``), and their paged memory for trainer.shard=parameters;
- ``engine.py``: the ``Engine`` (``backends/engine.py``'s contract).

Torch only: ``device_pages.py`` (a GPU's flat vector whose memory is given back a granule at a time).
"""
from __future__ import annotations

from ..common import set_training, training  # noqa: F401 - the process's training flag, shared
from .data import gather, index, resident, to_device, to_numpy, to_tensor  # noqa: F401
from .devices import bf16_supported, gpus, setup  # noqa: F401
from .engine import Engine  # noqa: F401
from .native import is_native, modules_only, native_kind, unwrapped  # noqa: F401
from .optim import spec_from_native  # noqa: F401 - modelfile.build asks every backend
# The ops, under the names elasticflow.ops calls (this package is the backend it dispatches to).
from .ops import (  # noqa: F401
    abs, accuracy, argmax, cast, concat, conv2d, cross_entropy, dropout, embedding, exp, gelu, layer_norm, log,
    log_softmax, matmul, max_pool2d, maximum, mean, mse, one_hot, relu, reshape, sigmoid, softmax, sqrt, square,
    stop_gradient, sum, tanh, transpose)

NAME = "torch"
