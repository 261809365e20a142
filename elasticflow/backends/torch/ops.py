"""The torch backend's ops: ``elasticflow.ops``'s names, mostly torch's own functions.

The reference semantics every other backend matches (NCHW images, OIHW conv weights, torch's
rounding); ``torch/__init__.py`` exports them under the names ``elasticflow.ops`` dispatches to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import common

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
