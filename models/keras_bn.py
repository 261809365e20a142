"""A native keras model with BatchNormalization on scikit-learn's 8x8 digits (backend=tensorflow only).

    elasticflow train models/keras_bn.py backend=tensorflow trainer.epochs=5

model() returns the keras model itself: its trainable variables are the parameters, and its
non-trainable ones (BatchNorm's moving mean and variance) are state, saved in every checkpoint
under the variable's path ("bn/moving_mean"). forward() passes ``training=ops.training()`` so
BatchNorm normalises with batch statistics while training and with the moving ones in evaluation.

Layers are named by hand: keras numbers unnamed layers process-wide (dense, dense_1, ...), and
the names are the checkpoint's tensor names.
"""
from elasticflow import ops

import _digits


def model(cfg):
    """64 -> hidden (BatchNorm, ReLU) -> 10; ``model_args.hidden`` sets the width (default 64)."""
    import keras  # here, not at the top: loading the file must not import TensorFlow by itself

    keras.utils.set_random_seed(cfg.seed)
    hidden = int(cfg.model_args.get("hidden", 64))
    return keras.Sequential([
        keras.Input((_digits.PIXELS,)),
        keras.layers.Dense(hidden, use_bias=False, name="hidden"),  # BatchNorm's beta is the bias
        keras.layers.BatchNormalization(momentum=0.9, name="bn"),
        keras.layers.ReLU(name="relu"),
        keras.layers.Dense(_digits.CLASSES, name="out"),
    ], name="keras_bn")


def forward(x, y, params):
    logits = params(x, training=ops.training())
    return {"loss": ops.cross_entropy(logits, y), "accuracy": ops.accuracy(logits, y)}


def data(cfg):
    return _digits.train_split()


def eval_data(cfg):
    return _digits.test_split()
