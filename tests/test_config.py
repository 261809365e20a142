"""The config schema: defaults, groups, and validation that fails loudly with a fix in the hint."""
import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from elasticflow import optim
from elasticflow.config import compose
from elasticflow.errors import ElasticFlowError

MODEL = "models/linear.py"


def test_defaults():
    cfg = compose(MODEL)
    assert cfg.model == MODEL
    assert cfg.backend.name == "torch" and cfg.launcher.workers == 1
    assert cfg.trainer.global_batch_size == 64 and cfg.trainer.micro_batch_size is None
    assert cfg.optimizer.name == "sgd" and cfg.optimizer.lr == 0.1
    assert cfg.resume == "auto" and cfg.seed == 0 and cfg.checkpoint.keep == 3


@pytest.mark.parametrize("group, cls, lr, weight_decay", [
    ("sgd", optim.SGD, 0.1, 0.0), ("adam", optim.Adam, 0.001, 0.0), ("adamw", optim.AdamW, 0.001, 0.01)])
def test_optimizer_groups_build_their_spec(group, cls, lr, weight_decay):
    spec = optim.from_config(compose(MODEL, [f"optimizer={group}"]).optimizer)
    assert type(spec) is cls and spec.lr == lr and spec.weight_decay == weight_decay


def test_group_values_can_be_overridden():
    cfg = compose(MODEL, ["optimizer=adam", "optimizer.lr=3e-4", "optimizer.betas=[0.8,0.95]",
                          "optimizer.schedule=cosine", "optimizer.warmup_steps=5"])
    spec = optim.from_config(cfg.optimizer)
    assert spec.lr == 3e-4 and spec.betas == (0.8, 0.95)
    assert spec.schedule.kind == "cosine" and spec.schedule.warmup_steps == 5


@pytest.mark.parametrize("override, message", [
    ("trainer.global_batch_size=0", "trainer.global_batch_size must be a positive integer, got 0"),
    ("trainer.global_batch_size=-3", "trainer.global_batch_size must be a positive integer, got -3"),
    ("trainer.micro_batch_size=0", "trainer.micro_batch_size must be a positive integer"),
    ("trainer.max_steps=0", "trainer.max_steps must be a positive integer"),
    ("trainer.log_every=0", "trainer.log_every must be a positive integer"),
    ("trainer.grad_clip=-1", "trainer.grad_clip must be a positive number"),
    ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite must be 'stop' or 'skip', got 'ignore'"),
    ("backend.name=jax", "unknown backend 'jax'"),
    ("optimizer.name=rmsprop", "unknown optimizer 'rmsprop'"),
    ("optimizer.schedule=exp", "unknown optimizer.schedule 'exp'"),
    ("optimizer.lr=0", "optimizer.lr must be positive"),
    ("checkpoint.keep=0", "checkpoint.keep must be a positive integer"),
    ("launcher.min_workers=2", "launcher.min_workers=2 is more than"),
])
def test_bad_values_fail_with_a_hint(override, message):
    with pytest.raises(ElasticFlowError) as info:
        compose(MODEL, [override])
    assert message in info.value.message
    assert info.value.hint  # every validation error says how to fix it


def test_checkpoint_interval_steps_and_epochs_exclusive():
    with pytest.raises(ElasticFlowError, match="both set"):
        compose(MODEL, ["checkpoint.interval.steps=10", "checkpoint.interval.epochs=1"])
    assert compose(MODEL, ["checkpoint.interval.epochs=2"]).checkpoint.interval.epochs == 2


@pytest.mark.parametrize("override, message, hint", [
    ("trainer.nope=1", "unknown config key trainer.nope", "--cfg job"),
    ("optimizer.lrr=0.1", "unknown config key optimizer.lrr", "did you mean optimizer.lr?"),
    ("trainerr.epochs=2", "unknown config key trainerr", "did you mean trainer?"),
    ("model_args.hidden=32", "unknown config key model_args.hidden", "+model_args.hidden=VALUE"),
    ("trainer.global_batch_size=abc", "could not be converted to Integer", "of the key's type"),
    ("optimizer=rmsprop", "optimizer=rmsprop is not a choice of the config group optimizer", "optimizer=adamw"),
    ("launcher.workers=[2", "cannot parse an override", "quote a value"),
])
def test_unknown_keys_and_wrong_types_are_refused_in_one_line(override, message, hint):
    with pytest.raises(ElasticFlowError) as info:
        compose(MODEL, [override])
    assert message in info.value.message and "\n" not in info.value.message
    assert hint in info.value.hint
    assert isinstance(info.value.__cause__, (HydraException, OmegaConfBaseException))  # --debug shows Hydra's


@pytest.mark.parametrize("override, message, hint", [
    ("+trainer.max_stepz=3", "unknown config key trainer.max_stepz (added with +)", "did you mean trainer.max_steps?"),
    ("++checkpoint.interval.stepz=5", "unknown config key checkpoint.interval.stepz (added with +)",
     "did you mean checkpoint.interval.steps?"),
    ("+verbose=true", "unknown config key verbose (added with +)", "only under model_args"),
])
def test_a_key_added_with_plus_outside_model_args_is_refused(override, message, hint):
    # Hydra would add it, and nothing would ever read it: a typo would leave the default in force unseen.
    with pytest.raises(ElasticFlowError) as info:
        compose(MODEL, [override])
    assert info.value.message == message and hint in info.value.hint
    assert compose(MODEL, ["++trainer.max_steps=3"]).trainer.max_steps == 3  # ++ of a real key: an override


def test_model_args_is_free_form():
    cfg = compose(MODEL, ["+model_args.hidden=32", "+model_args.name=wide"])
    assert cfg.model_args.hidden == 32 and cfg.model_args.name == "wide"


def test_async_save_is_a_plain_key():
    assert compose(MODEL).checkpoint.async_save is True
    assert compose(MODEL, ["checkpoint.async_save=false"]).checkpoint.async_save is False


@pytest.mark.parametrize("override", ["checkpoint.async=false", "+checkpoint.async=false", "++checkpoint.async=false"])
def test_the_old_async_key_names_the_new_one(override):
    with pytest.raises(ElasticFlowError) as info:
        compose(MODEL, [override])
    assert info.value.message == "checkpoint.async was renamed to checkpoint.async_save"
    assert info.value.hint == "pass checkpoint.async_save=false"
