"""Models with cross-sample state and randomness, for the exactness tests, with digits_probe's fault injection.

``model_args.kind`` picks the model:
    torch_bn     a torch CNN: BatchNorm2d (momentum 0.1), BatchNorm2d (momentum=None: a cumulative
                 average), Dropout -- a native torch.nn.Module, forward(x, y, net); +model_args.freeze=1
                 freezes its first convolution
    keras_bn     the same layers in keras (BatchNormalization, Dropout) -- backend=tensorflow
    dict_dropout a dict of arrays using ops.dropout -- either backend

EF_PROBE_DUMP (a directory): when forward runs in evaluation after training (finish() evaluates eval_data), each worker
writes its model's buffers to <dir>/<pid>.npz -- what every replica holds at the end.
"""
import os
import sys
from pathlib import Path

import numpy as np

import elasticflow
from elasticflow import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import _digits  # noqa: E402
import digits_probe  # noqa: E402

DUMP = os.environ.get("EF_PROBE_DUMP")


def model(cfg):
    kind = cfg.model_args.kind
    if kind == "torch_bn":
        import torch

        torch.manual_seed(cfg.seed)
        net = torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)),
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8, momentum=None), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Dropout(0.3), torch.nn.Linear(128, 10))
        if cfg.model_args.get("freeze"):  # the first convolution frozen, as a fine-tuner freezes a stem
            net[1].requires_grad_(False)
        return net
    if kind == "keras_bn":
        import keras

        keras.utils.set_random_seed(cfg.seed)
        return keras.Sequential([
            keras.Input((_digits.PIXELS,)),
            keras.layers.Dense(32, use_bias=False, name="hidden"),
            keras.layers.BatchNormalization(momentum=0.9, name="bn"),
            keras.layers.ReLU(name="relu"),
            keras.layers.Dropout(0.3, name="drop"),
            keras.layers.Dense(_digits.CLASSES, name="out"),
        ], name="keras_bn")
    rng = np.random.default_rng(cfg.seed)
    return {"W1": rng.normal(0, 0.1, (_digits.PIXELS, 32)).astype(np.float32), "b1": np.zeros(32, np.float32),
            "W2": rng.normal(0, 0.1, (32, _digits.CLASSES)).astype(np.float32),
            "b2": np.zeros(_digits.CLASSES, np.float32)}


def _save(arrays):
    np.savez(Path(DUMP) / f"{os.getpid()}.npz", **arrays)


def _dump(net):
    if hasattr(net, "named_buffers"):
        _save({n: b.detach().cpu().numpy() for n, b in net.named_buffers()})
        return
    import tensorflow as tf

    held = [v for v in net.non_trainable_variables if "seed_generator" not in v.path]  # reseeded, not state
    names = [v.path for v in held]
    if tf.executing_eagerly():
        _save({n: np.asarray(v) for n, v in zip(names, held)})
    else:  # traced (tf.function): save when the compiled evaluation runs, not when it is traced
        tf.numpy_function(lambda *values: _save(dict(zip(names, values))) or np.int64(0),
                          [tf.convert_to_tensor(v) for v in held], tf.int64, stateful=True)


def forward(x, y, net):
    digits_probe._inject(elasticflow.context())
    if isinstance(net, dict):
        hidden = ops.dropout(ops.relu(x @ net["W1"] + net["b1"]), 0.3)
        logits = hidden @ net["W2"] + net["b2"]
    else:
        training = ops.training()
        if DUMP and not training and elasticflow.context().step > 0:  # not the start-up probe: the final eval
            _dump(net)
        logits = net(x, training=training) if hasattr(net, "non_trainable_variables") else net(x)
    return ops.cross_entropy(logits, y)


data = digits_probe.data  # the digits training split (recording fetches under EF_PROBE_RECORD)


def eval_data(cfg):
    return _digits.test_split()
