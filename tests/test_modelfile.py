"""The model-file contract as users write it: forward()'s last argument receives the model, whatever its name."""
import pytest

from elasticflow.train import model_file
from elasticflow.errors import ElasticFlowError

from harness import losses, train

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
        model_file.load(str(path))


def test_the_adapter_passes_the_model_last_by_position(write_model):
    path = write_model("def model(cfg):\n    return {}\n\ndef forward(a, b, m):\n    return (a, b, m)\n\n"
                       "def data(cfg):\n    return ()\n")
    assert model_file.load(str(path)).forward(1, 2, params="M") == (1, 2, "M")


TWO_FIELDS = '''
import numpy as np
import torch


def model(cfg):
    return torch.nn.Linear(4, 1)


def forward({signature}):
    return {loss}


def data(cfg):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return x, x[:, :1] * 2
'''


def prepare(path, tmp_path, *overrides):
    from elasticflow.config.schema import compose
    from elasticflow.trainer import ElasticTrainer

    cfg = compose(str(path), ["trainer.progress=false", "trainer.tensorboard=false", *overrides])
    return ElasticTrainer(str(path), cfg, run_dir=str(tmp_path / "run")).prepare()


def test_forward_that_does_not_fit_the_data_fields_is_one_line_naming_both(write_model, tmp_path):
    """forward(x, net) given (x, y) was a bare TypeError from inside torch."""
    path = write_model(TWO_FIELDS.format(signature="x, net", loss="((net(x) - 1) ** 2).mean()"))
    with pytest.raises(ElasticFlowError) as info:
        prepare(path, tmp_path)
    assert info.value.message == (f"forward(x, net) in '{path}' takes 1 data field(s) and the model, but data() "
                                  "yields 2 field(s) per sample")
    assert "def forward(x0, x1, params)" in info.value.hint


def test_a_non_scalar_loss_at_start_up_says_it_came_from_the_probe(write_model, tmp_path):
    """It said "in evaluation" in a model file that has no eval_data()."""
    path = write_model(TWO_FIELDS.format(signature="x, y, net", loss="(net(x) - y) ** 2"))
    with pytest.raises(ElasticFlowError) as info:
        prepare(path, tmp_path)
    assert info.value.message == ("forward() returned a non-scalar loss of shape (2, 1) in the start-up probe "
                                  "(forward() on data()'s first samples, before the first step)")
    assert "in evaluation" not in str(info.value)


def test_eval_every_without_eval_data_is_refused_before_anything_runs(write_model, tmp_path):
    """It was silently ignored."""
    path = write_model(TWO_FIELDS.format(signature="x, y, net", loss="((net(x) - y) ** 2).mean()"))
    with pytest.raises(ElasticFlowError) as info:
        prepare(path, tmp_path, "trainer.eval_every=5")
    assert info.value.message == (f"trainer.eval_every=5 is set, but model file '{path}' defines no eval_data() "
                                  "to evaluate on")
    assert "define eval_data(cfg)" in info.value.hint and "drop trainer.eval_every" in info.value.hint
    assert not (tmp_path / "run" / "checkpoints").exists()
