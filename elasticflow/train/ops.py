"""Backend-neutral ops: one model file runs on every backend.

Each function is a thin dispatch to the active backend (``elasticflow.backends.torch`` or
``elasticflow.backends.tensorflow``), which define the same names with the same semantics.
Python operators (``@ + - * /``) work on parameters and batches directly.

Layouts: images are NCHW (batch, channels, height, width); conv2d weights are OIHW
(out_channels, in_channels, kh, kw) -- PyTorch's convention. Reductions take ``axis`` (int,
tuple or None for all). ``cross_entropy`` and ``mse`` return the mean over the batch.

Note: the backend is chosen by the trainer before the model file runs; outside a trainer the
first op call activates ``torch`` (or call ``elasticflow.ops.use("tensorflow")``).

Which backend is active is kept in ``elasticflow.backends.common`` (``active()``/``activate()``),
not here: an Engine activates its own backend before it runs forward() (another trainer in the
process may have switched since) without importing this module, so backends never import ops.
"""
from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, Iterator, Optional, Sequence

from .. import backends
from . import randomness as _randomness
from ..backends import common as _registry


def use(name: str) -> None:
    """Route every op to backend ``name`` ('torch' or 'tensorflow'), importing it the first time."""
    impl = _registry._active
    if impl is not None and impl.NAME == name:  # model files call it freely: keep the common case cheap
        return
    _registry.activate(backends.load(name))


def current() -> ModuleType:
    """The active backend module (``elasticflow.backends.torch`` or ``.tensorflow``); torch if none was chosen.

        >>> ops.use("tensorflow"); ops.current().NAME
        'tensorflow'
    """
    return _registry._active or _activate_default()


@contextlib.contextmanager
def using(name: Optional[str] = None) -> Iterator[Optional[ModuleType]]:
    """Route ops to backend ``name`` inside the block; the backend active before (or none) comes back after.

    ``name=None`` changes nothing on entry: the block may choose (a trainer's prepare() calls ``use``),
    and the previous choice still comes back. Yields the active backend module (None if none yet).

        >>> with ops.using("tensorflow") as tfb:
        ...     x = tfb.to_tensor(np.ones(3))
    """
    previous = _registry.active()
    if name is not None:
        use(name)
    try:
        yield _registry._active
    finally:
        _registry.activate(previous)


def _activate_default() -> ModuleType:
    use("torch")
    return _registry._active


def _b() -> ModuleType:
    # Every op calls this: one global and one attribute lookup in the common case.
    return _registry._active or _activate_default()


def backend_name() -> str:
    return _b().NAME


def training() -> bool:
    """True while training, False in evaluation (the flag dropout reads).

    Native models take it as their training argument, so BatchNorm and dropout layers switch
    with the trainer's evaluation:

        >>> def forward(x, y, params):          # params is the keras model model() returned
        ...     return ops.cross_entropy(params(x, training=ops.training()), y)
    """
    return _b().training()


def matmul(a, b):
    return _b().matmul(a, b)


def relu(x):
    return _b().relu(x)


def tanh(x):
    return _b().tanh(x)


def sigmoid(x):
    return _b().sigmoid(x)


def gelu(x):
    """Exact (erf) GELU, as torch's default and ``tf.nn.gelu(approximate=False)``."""
    return _b().gelu(x)


def exp(x):
    return _b().exp(x)


def log(x):
    return _b().log(x)


def sqrt(x):
    return _b().sqrt(x)


def square(x):
    return _b().square(x)


def abs(x):  # noqa: A001 - mirrors numpy's name
    return _b().abs(x)


def maximum(a, b):
    return _b().maximum(a, b)


def mean(x, axis=None, keepdims: bool = False):
    return _b().mean(x, axis, keepdims)


def sum(x, axis=None, keepdims: bool = False):  # noqa: A001 - mirrors numpy's name
    return _b().sum(x, axis, keepdims)


def reshape(x, shape: Sequence[int]):
    return _b().reshape(x, tuple(shape))


def transpose(x, perm: Optional[Sequence[int]] = None):
    """Permute axes (reverse them when ``perm`` is None), as numpy.transpose."""
    return _b().transpose(x, perm)


def concat(xs: Sequence[Any], axis: int = 0):
    return _b().concat(list(xs), axis)


def softmax(x, axis: int = -1):
    return _b().softmax(x, axis)


def log_softmax(x, axis: int = -1):
    return _b().log_softmax(x, axis)


def one_hot(ids, num_classes: int):
    """float32 one-hot rows for integer ``ids``."""
    return _b().one_hot(ids, num_classes)


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy of ``logits`` (N, C) against integer ``labels`` (N,)."""
    return _b().cross_entropy(logits, labels)


def mse(pred, target):
    """Mean squared error over all elements."""
    return _b().mse(pred, target)


def accuracy(logits, labels):
    """Fraction of rows whose argmax equals the integer label (a metric; no gradient)."""
    return _b().accuracy(logits, labels)


def argmax(x, axis: int = -1):
    return _b().argmax(x, axis)


def conv2d(x, w, b=None, stride: int = 1, padding="valid"):
    """2-D convolution. x: NCHW, w: OIHW, b: (O,) or None; padding 'valid', 'same' or an int."""
    return _b().conv2d(x, w, b, stride, padding)


def max_pool2d(x, size: int = 2, stride: Optional[int] = None):
    """Max pooling over NCHW windows of ``size`` (stride defaults to size; no padding)."""
    return _b().max_pool2d(x, size, stride or size)


def layer_norm(x, gamma=None, beta=None, eps: float = 1e-5):
    """Normalize over the last axis, then scale by gamma and shift by beta (each optional)."""
    return _b().layer_norm(x, gamma, beta, eps)


def embedding(table, ids):
    """Rows of ``table`` (V, D) at integer ``ids`` (any shape) -> ids.shape + (D,)."""
    return _b().embedding(table, ids)


def dropout(x, rate: float):
    """Zero a fraction ``rate`` of elements and scale the rest by 1/(1-rate) while training;
    the identity in evaluation. Randomness comes from the backend's seeded generator."""
    _randomness.count_dropout(rate)  # the start banner warns when masks depend on the number of workers
    return _b().dropout(x, rate)


def stop_gradient(x):
    return _b().stop_gradient(x)


def cast(x, dtype: str):
    """Cast to 'float32', 'float64', 'int32' or 'int64'."""
    return _b().cast(x, dtype)
