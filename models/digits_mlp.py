"""A two-layer MLP on scikit-learn's 8x8 digits: the main demo (offline, seconds on a laptop).

    elasticflow train models/digits_mlp.py trainer.epochs=10

reaches eval_accuracy 0.944 (eval_loss 0.283) on the 360 held-out digits after 230 steps (torch,
seed 0, the default SGD lr=0.1, global batch 64); tests/test_models.py checks it. On 2 CPU cores the
command takes about 5.5 s, nearly all of it start-up (imports); the 230 steps, the evaluation and the
checkpoint take 0.2 s.
Without overrides the run is one epoch (23 steps, eval_accuracy 0.647); adding
``optimizer.momentum=0.9`` to the command above reaches 0.981. ``+model_args.hidden=N`` sets the width.
The data split is models/_digits.py's.
"""
import numpy as np

from elasticflow import ops

import _digits


def model(cfg):
    """64 -> hidden (ReLU) -> 10, He-initialised; ``model_args.hidden`` sets the width (default 64)."""
    hidden = int(cfg.model_args.get("hidden", 64))
    rng = np.random.default_rng(cfg.seed)
    return {
        "hidden": {"W": rng.normal(0, np.sqrt(2 / _digits.PIXELS), (_digits.PIXELS, hidden)).astype(np.float32),
                   "b": np.zeros(hidden, np.float32)},
        "out": {"W": rng.normal(0, np.sqrt(1 / hidden), (hidden, _digits.CLASSES)).astype(np.float32),
                "b": np.zeros(_digits.CLASSES, np.float32)},
    }


def forward(x, y, params):
    h = ops.relu(x @ params["hidden"]["W"] + params["hidden"]["b"])
    logits = h @ params["out"]["W"] + params["out"]["b"]
    return {"loss": ops.cross_entropy(logits, y), "accuracy": ops.accuracy(logits, y)}


def data(cfg):
    return _digits.train_split()


def eval_data(cfg):
    return _digits.test_split()
