"""The model-file contract as users write it: forward()'s last argument receives the model, whatever its name."""
import pytest

from elasticflow import modelfile
from elasticflow.errors import ElasticFlowError

from conftest import losses, train

NATIVE = '''
import numpy as np
import torch


def model(cfg):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Flatten(), torch.nn.Linear(32, 16))


def forward({signature}):
    {take_ids}
    logits = {model_arg}(ids)
    return torch.nn.functional.cross_entropy(logits, ids[:, 0])


def data(cfg):
    rng = np.random.default_rng(0)
    return {data}
'''


@pytest.mark.parametrize("signature, take_ids, model_arg, data", [
    ("x, y, net", "ids = x", "net", "(rng.integers(0, 16, (64, 4)), rng.integers(0, 16, 64))"),
    ("ids, model", "pass", "model", "(rng.integers(0, 16, (64, 4)),)"),
    ("*batch, params", "ids = batch[0]", "params", "(rng.integers(0, 16, (64, 4)),)"),
])
def test_a_native_model_trains_whatever_forward_calls_it(write_model, tmp_path, signature, take_ids, model_arg, data):
    source = NATIVE.format(signature=signature, take_ids=take_ids, model_arg=model_arg, data=data)
    run = tmp_path / "run"
    train(write_model(source), run, "trainer.max_steps=20", "trainer.log_every=1", "optimizer.lr=0.5")
    steps = losses(run)
    assert len(steps) == 20 and steps[-1] < steps[0]


def test_forward_with_no_argument_for_the_model_is_refused(write_model):
    path = write_model("def model(cfg):\n    return {}\n\ndef forward():\n    return 0\n\ndef data(cfg):\n    return ()\n")
    with pytest.raises(ElasticFlowError, match="takes no argument for the model"):
        modelfile.load(str(path))


def test_the_adapter_passes_the_model_last_by_position(write_model):
    path = write_model("def model(cfg):\n    return {}\n\ndef forward(a, b, m):\n    return (a, b, m)\n\n"
                       "def data(cfg):\n    return ()\n")
    assert modelfile.load(str(path)).forward(1, 2, params="M") == (1, 2, "M")
