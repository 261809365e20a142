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

    cfg = compose(str(path), ["trainer.progress=false", "trainer.loggers=[]", *overrides])
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


def test_forward_that_takes_the_model_first_is_one_line_naming_the_order(write_model):
    """forward(net, x, y) was "'Tensor' object is not callable" from inside the model."""
    path = write_model(TWO_FIELDS.format(signature="net, x, y", loss="((net(x) - y) ** 2).mean()"))
    with pytest.raises(ElasticFlowError) as info:
        model_file.load(str(path))
    assert info.value.message == f"forward(net, x, y) in '{path}' takes the model first"
    assert info.value.hint == "the model comes last, after the data fields: def forward(x, y, net)"


def test_data_as_a_list_of_samples_is_one_line_naming_the_fix(write_model, tmp_path):
    """A list of (x, y) tuples was numpy's "setting an array element with a sequence"."""
    source = TWO_FIELDS.format(signature="x, y, net", loss="((net(x) - y) ** 2).mean()").replace(
        "return x, x[:, :1] * 2", "return [(row, row[:1] * 2) for row in x]")
    with pytest.raises(ElasticFlowError) as info:
        prepare(write_model(source), tmp_path)
    assert info.value.message == ("data() returned a list of 64 samples; it returns the fields, each an array "
                                  "with one row per sample (or a list of samples with collate(samples) in the model "
                                  "file)")
    assert "np.stack(field) for field in zip(*samples)" in info.value.hint
    ragged = TWO_FIELDS.format(signature="x, y, net", loss="((net(x) - y) ** 2).mean()").replace(
        "return x, x[:, :1] * 2", "return [[1.0, 2.0], [3.0]], [0.0, 1.0]")
    with pytest.raises(ElasticFlowError) as info:
        prepare(write_model(ragged, "ragged.py"), tmp_path)
    assert info.value.message == "data() returned field #0 with rows of different lengths (ragged)"
    assert info.value.hint.startswith("define collate(samples) in the model file to pad each micro-batch")


HF_OUTPUT = '''
import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def model(cfg):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def forward(ids, net):
    return net(input_ids=ids, labels={labels})


def data(cfg):
    return (np.random.default_rng(0).integers(0, 32, (64, 8)),)
'''


def test_forward_may_return_a_hugging_face_output_whose_loss_trains(write_model, tmp_path):
    """A CausalLMOutput was "metric 'logits' is not a scalar"; the HF Trainer takes its .loss."""
    run = tmp_path / "run"
    train(write_model(HF_OUTPUT.format(labels="ids")), run, "trainer.max_steps=8", "trainer.log_every=1",
          "optimizer=adam", "optimizer.lr=0.01")
    steps = losses(run)
    assert len(steps) == 8 and steps[-1] < steps[0]
    with pytest.raises(ElasticFlowError) as info:
        prepare(write_model(HF_OUTPUT.format(labels="None"), "nolabels.py"), tmp_path / "nolabels")
    assert info.value.message.startswith("forward() returned a CausalLMOutputWithCrossAttentions without a loss")
    assert "labels" in info.value.hint


def test_a_dict_that_mixes_a_module_with_arrays_is_one_line(write_model, tmp_path):
    """{"net": module, "scale": array} was a numpy conversion error from inside the Engine."""
    source = TWO_FIELDS.format(signature="x, y, net", loss="((net['net'](x) * net['scale'] - y) ** 2).mean()").replace(
        "return torch.nn.Linear(4, 1)", "return {'net': torch.nn.Linear(4, 1), 'scale': np.ones(1, np.float32)}")
    with pytest.raises(ElasticFlowError) as info:
        prepare(write_model(source), tmp_path)
    assert info.value.message == "model() returned a dict that mixes a torch model ('net') with other entries"
    assert "modules only" in info.value.hint


SCHEDULED = '''
import numpy as np
import torch
from elasticflow import optim


def model(cfg):
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if cfg.model_args.get("alone"):
        return {"net": net, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2)}
    return {"net": net, "optimizer": optim.AdamW(3e-3)}


def forward(x, y, net):
    return ((net["net"](x) - y) ** 2).mean()


def data(cfg):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return x, x[:, :1] * 2
'''


def test_an_lr_scheduler_without_its_optimizer_is_one_line(write_model, tmp_path):
    with pytest.raises(ElasticFlowError) as info:
        prepare(write_model(SCHEDULED), tmp_path, "+model_args.alone=true")
    assert info.value.message == "model() returns an 'lr_scheduler' without the 'optimizer' it steps"


def test_the_configs_schedule_drives_an_optimizer_spec_from_model(write_model, tmp_path):
    """optim.AdamW(3e-3) from model() and optimizer.schedule=cosine: the schedule applies to the model's lr (it was
    dropped), and the config's optimizer.min_lr is checked against that lr, not the config's unused 0.1."""
    from elasticflow import optim

    trainer = prepare(write_model(SCHEDULED), tmp_path, "optimizer.schedule=cosine", "optimizer.warmup_steps=2",
                      "optimizer.decay_steps=10")
    assert (trainer.spec.name, trainer.spec.schedule.kind, trainer.spec.schedule.warmup_steps) == ("adamw", "cosine", 2)
    assert optim.lr_at(trainer.spec, 0, 10) == pytest.approx(1.5e-3) and optim.lr_at(trainer.spec, 10, 10) == 0.0
    with pytest.raises(ElasticFlowError) as info:
        prepare(write_model(SCHEDULED), tmp_path, "optimizer.schedule=cosine", "optimizer.min_lr=0.01")
    assert info.value.message == "optimizer.min_lr=0.01 is more than the lr of model()'s optimizer (0.003)"


@pytest.mark.parametrize("overrides, said", [
    (["optimizer=adamw"], "optimizer=adamw"),
    (["optimizer.lr=0.5", "optimizer.groups=[{params:[weight],lr:0.01}]"],
     "optimizer.lr=0.5, optimizer.groups=[{'params': ['weight'], 'lr': 0.01, 'weight_decay': None}]"),
])
def test_config_optimizer_settings_beside_models_own_optimizer_are_refused_not_dropped(write_model, tmp_path,
                                                                                      overrides, said):
    """model() returns its optimizer: the config's optimizer group (but for its schedule) would go unused. A user
    who set it meant it: one line, not a run with another optimizer than the one asked for."""
    with pytest.raises(ElasticFlowError) as info:
        prepare(write_model(SCHEDULED), tmp_path, *overrides)
    assert info.value.message == f"model() returns its own optimizer, so {said} would not be used"
    assert "optimizer.schedule applies to either" in info.value.hint
    prepare(write_model(SCHEDULED), tmp_path / "plain", "optimizer.lr=0.1")  # the default, said or not: taken
