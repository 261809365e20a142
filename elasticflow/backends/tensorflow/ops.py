"""The TensorFlow backend's ops: ``elasticflow.ops`` with torch's semantics and layouts.

``tensorflow/__init__.py`` exports these under the names ``elasticflow.ops`` dispatches to. They take
more code than their torch twins: images are NCHW and conv weights OIHW at the API (TF's CPU
convolution only takes NHWC, so conv2d and max_pool2d transpose inside), ``maximum`` splits a tie's
gradient as torch does, and dropout draws from a generator whose state is checkpointed.

Under mixed precision (an Engine with precision bf16/16 traces forward() inside ``computing``) the
ops torch's autocast keeps in float32 do so here too: softmax, log_softmax and layer_norm compute in
float32 and hand back the input's dtype (TF does not promote, so the next matmul needs it), the
losses return float32, and "float32" in ``cast``/``one_hot`` means the compute dtype.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import tensorflow as tf

from .. import common

_rng: Optional[tf.random.Generator] = None  # dropout's randomness; its state is checkpointed
_compute: Optional[tf.DType] = None  # the low dtype while a mixed-precision Engine traces forward()
_LOW = (tf.bfloat16, tf.float16)


@contextlib.contextmanager
def computing(dtype: Optional[tf.DType]) -> Iterator[None]:
    """forward()'s ops compute in ``dtype`` (None: as given) inside the block; read at trace time."""
    global _compute
    previous, _compute = _compute, dtype
    try:
        yield
    finally:
        _compute = previous


def _wide(x):
    """``x`` as float32 when it is bfloat16/float16: the ops autocast keeps in float32 (a sum of exps
    in bfloat16 keeps 8 bits), the cost of a cast each way."""
    return tf.cast(x, tf.float32) if tf.is_tensor(x) and x.dtype in _LOW else x  # numpy: as before


def _float32_dtype() -> tf.DType:
    """What "float32" means in forward(): the compute dtype under mixed precision. A float32 mask added
    to bfloat16 scores would be a dtype error in TF (torch promotes instead)."""
    return _compute or tf.float32


def _generator() -> tf.random.Generator:
    # Created once, eagerly: a tf.function may not create variables after its first trace,
    # and compiled steps keep a reference to this object (so reseed it, never replace it).
    global _rng
    if _rng is None:
        _rng = tf.random.Generator.from_seed(0, alg="philox")
    return _rng


relu = tf.nn.relu
tanh = tf.math.tanh
sigmoid = tf.math.sigmoid
exp = tf.math.exp
log = tf.math.log
sqrt = tf.math.sqrt
square = tf.math.square
abs = tf.math.abs  # noqa: A001
stop_gradient = tf.stop_gradient


def matmul(a, b):
    """torch.matmul's rules: batch dims broadcast, a 1-D operand is a row (a) or column (b) vector."""
    a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
    row, col = a.shape.rank == 1, b.shape.rank == 1
    out = tf.linalg.matmul(a[None, :] if row else a, b[:, None] if col else b)
    if col:
        out = out[..., 0]
    if row:
        out = out[..., 0] if col else tf.squeeze(out, -2)
    return out


@tf.custom_gradient
def _maximum(a, b):
    out = tf.math.maximum(a, b)

    def grad(g):
        # torch's rule: a tie splits the gradient in half (TF's own gives it all to `a`).
        tie = tf.cast(tf.equal(a, b), g.dtype)
        ga = g * (tf.cast(a > b, g.dtype) + 0.5 * tie)
        gb = g * (tf.cast(b > a, g.dtype) + 0.5 * tie)
        ra, rb = tf.raw_ops.BroadcastGradientArgs(s0=tf.shape(a), s1=tf.shape(b))
        return (tf.reshape(tf.reduce_sum(ga, ra), tf.shape(a)), tf.reshape(tf.reduce_sum(gb, rb), tf.shape(b)))

    return out, grad


def maximum(a, b):
    a = tf.convert_to_tensor(a)
    return _maximum(a, tf.convert_to_tensor(b, dtype=a.dtype))


def gelu(x):
    return tf.nn.gelu(x, approximate=False)


def _axes(axis):
    return list(axis) if isinstance(axis, (tuple, list)) else axis


def mean(x, axis=None, keepdims=False):
    return tf.math.reduce_mean(x, axis=_axes(axis), keepdims=keepdims)


def sum(x, axis=None, keepdims=False):  # noqa: A001
    return tf.math.reduce_sum(x, axis=_axes(axis), keepdims=keepdims)


def reshape(x, shape):
    return tf.reshape(x, shape)


def transpose(x, perm=None):
    return tf.transpose(x, perm)


def concat(xs, axis=0):
    return tf.concat(xs, axis)


def softmax(x, axis=-1):
    x = tf.convert_to_tensor(x)
    return tf.cast(tf.nn.softmax(_wide(x), axis=axis), x.dtype) if x.dtype in _LOW else tf.nn.softmax(x, axis=axis)


def log_softmax(x, axis=-1):
    x = tf.convert_to_tensor(x)
    if x.dtype in _LOW:
        return tf.cast(tf.nn.log_softmax(_wide(x), axis=axis), x.dtype)
    return tf.nn.log_softmax(x, axis=axis)


def one_hot(ids, num_classes):
    return tf.one_hot(tf.cast(ids, tf.int64), num_classes, dtype=_float32_dtype())


def cross_entropy(logits, labels):
    """Mean cross-entropy, in float32 whatever the logits' dtype."""
    return tf.math.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(labels, tf.int64), logits=_wide(logits)))


def mse(pred, target):
    """Mean squared error, in float32 whatever the operands' dtypes."""
    return tf.math.reduce_mean(tf.math.square(_wide(pred) - _wide(target)))


def accuracy(logits, labels):
    hit = tf.equal(tf.argmax(tf.stop_gradient(logits), axis=-1), tf.cast(labels, tf.int64))
    return tf.math.reduce_mean(tf.cast(hit, tf.float32))


def argmax(x, axis=-1):
    return tf.argmax(x, axis=axis)


_NCHW_TO_NHWC, _NHWC_TO_NCHW = (0, 2, 3, 1), (0, 3, 1, 2)


def conv2d(x, w, b, stride, padding):
    if padding == "valid" or padding == 0:
        pad: Any = "VALID"
    elif padding == "same":
        if stride != 1:  # torch refuses it too: 'same' is only symmetric-by-definition at stride 1
            raise ValueError("padding='same' is not supported for strided convolutions")
        pad = "SAME"  # (k-1)//2 before, the rest after: torch's split for even kernels as well
    elif isinstance(padding, int) and not isinstance(padding, bool) and padding > 0:
        pad = [[0, 0], [padding, padding], [padding, padding], [0, 0]]
    else:
        raise ValueError(f"conv2d padding must be 'valid', 'same' or a non-negative int, got {padding!r}")
    # A transpose each way (a copy each): TF's CPU Conv2D kernel only takes NHWC.
    y = tf.nn.conv2d(tf.transpose(x, _NCHW_TO_NHWC), tf.transpose(w, (2, 3, 1, 0)), strides=stride, padding=pad)
    if b is not None:
        y = y + b
    return tf.transpose(y, _NHWC_TO_NCHW)


def max_pool2d(x, size, stride):
    y = tf.nn.max_pool2d(tf.transpose(x, _NCHW_TO_NHWC), ksize=size, strides=stride, padding="VALID")
    return tf.transpose(y, _NHWC_TO_NCHW)


def layer_norm(x, gamma, beta, eps):
    x = tf.convert_to_tensor(x)
    if x.dtype in _LOW:  # the statistics in float32, the affine part in the input's dtype
        return _affine(tf.cast(_normalise(_wide(x), eps), x.dtype), gamma, beta)
    return _affine(_normalise(x, eps), gamma, beta)


def _normalise(x, eps):
    mu = tf.math.reduce_mean(x, axis=-1, keepdims=True)
    centred = x - mu
    var = tf.math.reduce_mean(tf.math.square(centred), axis=-1, keepdims=True)  # biased, as torch
    return centred * tf.math.rsqrt(var + eps)


def _affine(y, gamma, beta):
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y


def embedding(table, ids):
    return tf.gather(table, tf.cast(ids, tf.int64))


def dropout(x, rate):
    if not rate or not common._training:  # the process's training flag (common.set_training)
        return x
    x = tf.convert_to_tensor(x)
    if rate >= 1:
        return tf.zeros_like(x)
    keep = tf.cast(_generator().uniform(tf.shape(x)) >= rate, x.dtype)
    return x * (keep / tf.constant(1.0 - rate, x.dtype))  # torch scales the mask, then multiplies


_DTYPES = {"float32": tf.float32, "float64": tf.float64, "int32": tf.int32, "int64": tf.int64}


def cast(x, dtype):
    return tf.cast(x, _float32_dtype() if dtype == "float32" else _DTYPES[dtype])
