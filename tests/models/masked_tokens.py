"""A per-token regression over padded sequences of different true lengths, on every backend (elasticflow.ops):
the loss is the mean over a micro-batch's real tokens and ``weight`` is their count, as a language model's.

With one micro-batch per global batch the step is the plain token mean over the batch, which any cut into
micro-batches, any number of workers and any topology must reproduce.

model_args (optional): weighted: 0 -> forward() returns the loss alone (micro-batches count by samples).
"""
import numpy as np

from elasticflow import ops

SAMPLES, LENGTH, FEATURES = 192, 12, 6
WEIGHTED = True


def model(cfg):
    global WEIGHTED
    WEIGHTED = bool(int(cfg.model_args.get("weighted", 1)))
    rng = np.random.default_rng(cfg.seed)
    return {"W": rng.normal(0, 0.3, (FEATURES, 1)).astype(np.float32), "b": np.zeros(1, np.float32)}


def forward(x, y, mask, params):
    err = ops.sum(x * ops.reshape(params["W"], (FEATURES,)), axis=-1) + params["b"] - y  # (batch, length)
    tokens = ops.sum(mask)
    loss = ops.sum(ops.square(err) * mask) / tokens
    return {"loss": loss, "weight": tokens} if WEIGHTED else loss


def data(cfg):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(SAMPLES, LENGTH, FEATURES)).astype(np.float32)
    y = (x @ rng.normal(size=FEATURES)).astype(np.float32) + 0.3
    # Real lengths from 1 to LENGTH, skewed: micro-batches differ a lot in their number of tokens.
    lengths = np.minimum(LENGTH, 1 + rng.geometric(0.15, SAMPLES))
    mask = (np.arange(LENGTH) < lengths[:, None]).astype(np.float32)
    return x, y * mask, mask
