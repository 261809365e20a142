"""The config schema: defaults, groups, and validation that fails loudly with a fix in the hint."""
import dataclasses
import re
import shlex
import typing
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from elasticflow import optim
from elasticflow.config.schema import Config, compose
from elasticflow.config.ranges import RANGES
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
    ("trainer.grad_clip=-1", "trainer.grad_clip must be a finite number > 0, got -1.0"),
    ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite must be 'stop' or 'skip', got 'ignore'"),
    ("backend.name=jax", "unknown backend 'jax'"),
    ("optimizer.name=rmsprop", "unknown optimizer 'rmsprop'"),
    ("optimizer.schedule=exp", "unknown optimizer.schedule 'exp'"),
    ("optimizer.lr=0", "optimizer.lr must be a finite number > 0, got 0.0"),
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


# ---------------------------------------------------------------- ranges (elasticflow/config/ranges.py)
SLURM = ["launcher=slurm"]
STEPS_RANGE = "(allowed: 1 to 2147483647)"
ONE_LINE = ("launcher=slurm writes it into job.sbatch, where a newline would start a shell line of "
            "its own: pass the value on one line")


@pytest.mark.parametrize("overrides, message, hint", [
    (["optimizer.lr=inf"], "optimizer.lr must be a finite number > 0, got inf", "pass e.g. optimizer.lr=0.01"),
    (["optimizer.lr=nan"], "optimizer.lr must be a finite number > 0, got nan", "pass e.g. optimizer.lr=0.01"),
    (["optimizer.momentum=-5"], "optimizer.momentum must be a number in [0, 1), got -5.0",
     "pass e.g. optimizer.momentum=0.9 (0: none; 1 or more never forgets a gradient and diverges)"),
    (["optimizer.momentum=1"], "optimizer.momentum must be a number in [0, 1), got 1.0",
     "pass e.g. optimizer.momentum=0.9 (0: none; 1 or more never forgets a gradient and diverges)"),
    (["optimizer=adam", "optimizer.betas=[2,-1]"], "optimizer.betas must be two numbers in [0, 1), got [2.0, -1.0]",
     "pass e.g. optimizer.betas=[0.9,0.999] (decay rates of the two moments)"),
    (["optimizer=adam", "optimizer.betas=[0.9]"], "optimizer.betas must be two numbers in [0, 1), got [0.9]",
     "pass e.g. optimizer.betas=[0.9,0.999] (decay rates of the two moments)"),
    (["optimizer=adam", "optimizer.eps=0"], "optimizer.eps must be a finite number > 0, got 0.0",
     "pass e.g. optimizer.eps=1e-8 (0 divides by zero where a gradient is 0)"),
    (["optimizer.schedule=step", "optimizer.gamma=nan"], "optimizer.gamma must be a number in (0, 1], got nan",
     "pass e.g. optimizer.gamma=0.1 (each step_size steps multiply the rate by it)"),
    (["optimizer.warmup_steps=-3"], "optimizer.warmup_steps must be an integer >= 0, got -3 (allowed: 0 to 2147483647)",
     "pass e.g. optimizer.warmup_steps=100, or 0 for no warmup"),
    (["optimizer.schedule=step", "optimizer.step_size=0"],
     f"optimizer.step_size must be a positive integer, got 0 {STEPS_RANGE}", "pass e.g. optimizer.step_size=1000"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay must be a finite number >= 0, got -0.1",
     "pass e.g. optimizer.weight_decay=0.01 (0: none)"),
    (["optimizer.min_lr=0.5"], "optimizer.min_lr=0.5 is more than optimizer.lr=0.1",
     "the schedule decays from optimizer.lr down to optimizer.min_lr: lower optimizer.min_lr, e.g. optimizer.min_lr=0"),
    (["optimizer.groups=[{params:[head],lr:-1}]"], "optimizer.groups[0].lr must be a finite number > 0, got -1.0",
     "pass a positive lr in the group, e.g. {params:[head],lr:1e-2}, or leave it out for optimizer.lr"),
    (["backend.threads=-1"], "backend.threads must be a positive integer, got -1 (allowed: 1 to 1024)",
     "pass e.g. backend.threads=4, or null for the host's cores divided among its workers"),
    (["data.prefetch=1000000000"], "data.prefetch must be at most 1024, got 1000000000 (allowed: 0 to 1024)",
     "pass e.g. data.prefetch=2 (micro-batches read ahead), or 0 to read on demand"),
    (["data.workers=100000"], "data.workers must be at most 1024, got 100000 (allowed: 1 to 1024)",
     "pass e.g. data.workers=2 (readers beyond the host's cores only contend for them)"),
    (["checkpoint.interval.steps=0"], f"checkpoint.interval.steps must be a positive integer, got 0 {STEPS_RANGE}",
     "pass e.g. checkpoint.interval.steps=100, or null not to save by steps"),
    (["checkpoint.job_name=../../../escape"],
     "checkpoint.job_name must be a plain name (no '/', '\\', '..' or control characters), got '../../../escape'",
     "it names the directory checkpoint.dir/<job_name>_<timestamp>/: pass e.g. checkpoint.job_name=resnet-run2, "
     "and the location as checkpoint.dir"),
    (["checkpoint.job_name=runs/a"],
     "checkpoint.job_name must be a plain name (no '/', '\\', '..' or control characters), got 'runs/a'",
     "it names the directory checkpoint.dir/<job_name>_<timestamp>/: pass e.g. checkpoint.job_name=resnet-run2, "
     "and the location as checkpoint.dir"),
    ([*SLURM, "launcher.max_workers=-1"],
     "launcher.max_workers must be a positive integer, got -1 (allowed: 1 to 65536)",
     "pass e.g. launcher.max_workers=8, or null for no limit"),
    ([*SLURM, "launcher.gpus_per_node=65"], "launcher.gpus_per_node must be at most 64, got 65 (allowed: 1 to 64)",
     "pass e.g. launcher.gpus_per_node=4, or null for no GPUs"),
    ([*SLURM, "launcher.cpus_per_task=0"], "launcher.cpus_per_task must be a positive integer, got 0 "
     "(allowed: 1 to 1024)", "pass e.g. launcher.cpus_per_task=8, or null for SLURM's default"),
    (["launcher.max_restarts=-1"], "launcher.max_restarts must be an integer >= 0, got -1 (allowed: 0 to 2147483647)",
     "pass e.g. launcher.max_restarts=3 (0: never replace a worker)"),
    ([*SLURM, 'launcher.partition="gpu\nrm -rf ~"'],
     "launcher.partition must be one line without control characters, got 'gpu\\nrm -rf ~'", ONE_LINE),
    ([*SLURM, 'launcher.account="a\tb"'],
     "launcher.account must be one line without control characters, got 'a\\tb'", ONE_LINE),
    ([*SLURM, "launcher.partition='gpu --output=x.out --wrap=id'"],
     "launcher.partition must be one value without spaces or a leading dash, got 'gpu --output=x.out --wrap=id'",
     "pass e.g. launcher.partition=gpu; other sbatch options go in launcher.sbatch_args, one per entry"),
    ([*SLURM, "launcher.account='--wrap=id'"],
     "launcher.account must be one value without spaces or a leading dash, got '--wrap=id'",
     "pass e.g. launcher.account=gpu; other sbatch options go in launcher.sbatch_args, one per entry"),
    ([*SLURM, "launcher.sbatch_args=['--qos=high --wrap=id']"],
     "launcher.sbatch_args[0] must be one sbatch option without spaces, got '--qos=high --wrap=id'",
     "one directive per entry: launcher.sbatch_args=[--qos=high]"),
    ([*SLURM, 'launcher.sbatch_args=["--qos=high","--x\n#SBATCH --y"]'],
     "launcher.sbatch_args[1] must be one line without control characters, got '--x\\n#SBATCH --y'", ONE_LINE),
    (["trainer.loggers=[tensorboard,tensorbord]"],
     "trainer.loggers must be one of tensorboard, csv, mlflow, wandb, got 'tensorbord'",
     "name any of them, e.g. trainer.loggers=[tensorboard,mlflow], or trainer.loggers=[] for none"),
    (["elastic.timeout_s=1e300"], "elastic.timeout_s must be a number in (0, 604800], got 1e+300",
     "pass e.g. elastic.timeout_s=30 (never leave collectives without a timeout)"),
    (["elastic.wait_s=inf"], "elastic.wait_s must be a number in [0, 604800], got inf",
     "pass e.g. elastic.wait_s=60 (seconds), or 0 to stop at once"),
    (["comm.bucket_mb=nan"], "comm.bucket_mb must be a size in MiB >= 0, got nan",
     "pass e.g. comm.bucket_mb=25, or null to reduce the gradient in one piece"),
    (["trainer.max_steps=2147483648"], "trainer.max_steps must be at most 2147483647, got 2147483648 "
     "(allowed: 1 to 2147483647)", "pass e.g. trainer.max_steps=1000, or null"),
    (["seed=-1"], "seed must be an integer >= 0, got -1 (allowed: 0 to 4294967295)",
     "pass e.g. seed=0 (numpy seeds take 0 to 2**32 - 1)"),
    (["elastic.shard_replicas=2"], "elastic.shard_replicas must be 0 or 1, got 2",
     "pass elastic.shard_replicas=1 (a buddy copy of every slice) or 0 (none)"),
])
def test_values_out_of_range_are_refused_in_one_line(overrides, message, hint):
    # Hydra's quoted strings keep a backslash as it is: turn the \n and \t above into real control characters.
    overrides = [o.replace("\\n", "\n").replace("\\t", "\t") for o in overrides]
    with pytest.raises(ElasticFlowError) as info:
        compose(MODEL, overrides)
    assert info.value.message == message and info.value.hint == hint


def test_a_run_directory_with_a_newline_never_reaches_the_batch_script(tmp_path):
    # hydra.run.dir is no config key validate() sees: batch_script refuses it as the last guard.
    from elasticflow.launchers.slurm import batch_script

    cfg = compose(MODEL, SLURM)
    assert "#SBATCH --partition" not in batch_script(cfg, tmp_path)  # a valid config writes its script
    with pytest.raises(ElasticFlowError) as info:
        batch_script(cfg, tmp_path / "a\nrm -rf ~")
    assert info.value.message == (f"the job.sbatch directive '--output={tmp_path}/a\\nrm -rf ~/slurm/job-%j.out' "
                                  "would hold a newline or control character")
    assert info.value.hint == "pass hydra.run.dir and launcher.* values on one line"


def test_a_float_for_an_integer_key_is_refused_by_its_type():
    # data.workers=1e5 never reaches the range: Hydra's type check refuses a float for an int key.
    with pytest.raises(ElasticFlowError, match="data.workers: Value '100000.0' of type 'float' could not be"):
        compose(MODEL, ["data.workers=1e5"])


def _numeric_keys(cls: type, prefix: str = "") -> typing.Iterator[str]:
    """Every key of the schema ``cls`` whose value is a number or a list of numbers (a list of dataclasses
    as ``key[].field``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) is typing.Union:  # Optional[X]
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        key = prefix + f.name
        if typing.get_origin(kind) is list:
            kind, key = typing.get_args(kind)[0], key if typing.get_args(kind)[0] in (int, float) else key + "[]"
        if dataclasses.is_dataclass(kind):
            yield from _numeric_keys(kind, key + ".")
        elif kind in (int, float):
            yield key


def test_every_numeric_key_has_a_range():
    keys = set(_numeric_keys(Config))
    assert {"optimizer.betas", "optimizer.groups[].lr", "checkpoint.interval.steps", "seed"} <= keys
    assert keys == set(RANGES), f"without a range: {sorted(keys - set(RANGES))}; not keys: {sorted(set(RANGES) - keys)}"


def _documented_commands() -> typing.Iterator[typing.Tuple[str, typing.List[str]]]:
    """(where, overrides) of each `elasticflow train` command in README.md and docs/, in code blocks and inline."""
    repo = Path(__file__).resolve().parents[1]
    for page in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        text = page.read_text().replace("\\\n", " ")  # a shell line continued with a backslash
        lines = [m.group(1) for m in re.finditer(r"`(elasticflow train [^`]*)`", text)]
        lines += [line for line in text.splitlines() if "elasticflow train " in line and "`" not in line]
        for line in lines:
            words = shlex.split(line[line.index("elasticflow train "):], comments=True)
            if len(words) < 3 or words[2].startswith("-") or "=" in words[2] or "[key=value" in line:
                continue  # `elasticflow train --help`, `train MODEL.py [key=value ...]`: no command to check
            overrides = [w for w in words[3:] if "=" in w and not w.startswith(("-", "hydra.", "hydra/"))]
            if "-m" in words:  # a sweep: each value on its own; a sweeper's search space (interval(a,b)) is its own
                overrides = [w.split(",")[0] for w in overrides if "(" not in w.partition("=")[2]]
            yield f"{page.name}: {line.strip()}", overrides


# Documented on purpose as commands that fail (docs/configuration.md shows its error, docs/combinations.md a refused
# pair's): each a set of overrides that a command holding them all is.
FAILS_ON_PURPOSE = [{"trainer.max_stepz=100"}, {"trainer.reproducible=true", "trainer.shard=gradients"},
                    {"trainer.accumulate_grad_batches=4"}]


def test_the_defaults_and_every_documented_command_validate():
    compose(MODEL)
    commands = [(where, o) for where, o in _documented_commands() if not any(f <= set(o) for f in FAILS_ON_PURPOSE)]
    assert len(commands) > 20, commands  # the extraction found the pages' commands
    refused = []
    for where, overrides in commands:
        try:
            compose(MODEL, overrides)
        except ElasticFlowError as exc:
            refused.append(f"{where}\n  -> {exc}")
    assert not refused, "documented commands the config refuses:\n" + "\n".join(refused)


# ---------------------------------------------------------------- other trainers' names (config/spellings.py)
@pytest.mark.parametrize("override, name, ours", [
    ("trainer.accumulate_grad_batches=4", "accumulate_grad_batches",  # Lightning's Trainer
     "trainer.global_batch_size and trainer.micro_batch_size"),
    ("trainer.devices=2", "devices", "launcher.workers=N"),  # not difflib's "did you mean trainer.device?"
    ("trainer.mlflow.tracking_uri=sqlite:///m.db", "mlflow", "trainer.loggers=[mlflow]"),
    ("+trainer.val_check_interval=5", "val_check_interval", "trainer.eval_every=N"),
    ("+gradient_accumulation_steps=8", "gradient_accumulation_steps", "trainer.global_batch_size"),  # HF's
    ("+learning_rate=3e-4", "learning_rate", "optimizer.lr"),
    ("trainer.gradient_clip_val=1.0", "gradient_clip_val", "trainer.grad_clip=MAX_NORM"),
])
def test_a_lightning_or_hugging_face_name_gets_elasticflows_spelling(tmp_path, override, name, ours):
    from harness import train_in_process

    out = train_in_process(MODEL, tmp_path / "run", override)
    errors = [line for line in out.stderr.splitlines() if line.startswith(("error:", "hint:"))]
    assert out.returncode == 2 and len(errors) == 2, out.stderr
    assert errors[0].startswith("error: unknown config key ") and name in errors[0]
    assert errors[1].startswith(f"hint: {name} is a ") and ours in errors[1], errors[1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def spellings_markdown() -> str:
    """docs/coming-from-lightning-and-hf.md's table of other trainers' names, from config/spellings.py."""
    from elasticflow.config.spellings import SPELLINGS

    rows = [f"| `{name}` | {whose} | {ours} |" for name, (whose, ours) in sorted(SPELLINGS.items())]
    return "\n".join(["| their name | whose | ElasticFlow |", "|---|---|---|", *rows])


def test_the_coming_from_page_shows_every_spelling():
    page = (Path(__file__).resolve().parents[1] / "docs" / "coming-from-lightning-and-hf.md").read_text()
    start = "<!-- spellings: generated from elasticflow/config/spellings.py by tests/test_config.py -->\n"
    shown = page[page.index(start) + len(start):page.index("\n<!-- spellings: end -->")]
    assert shown == spellings_markdown(), (
        "docs/coming-from-lightning-and-hf.md's table is not config/spellings.py's: "
        "run `.venv/bin/python tests/test_config.py` to write it")


if __name__ == "__main__":  # writes the table into the page
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    page = Path(__file__).resolve().parents[1] / "docs" / "coming-from-lightning-and-hf.md"
    text = page.read_text()
    start = "<!-- spellings: generated from elasticflow/config/spellings.py by tests/test_config.py -->\n"
    head, rest = text.split(start)
    page.write_text(head + start + spellings_markdown() + "\n<!-- spellings: end -->" + rest.split("\n<!-- spellings: end -->")[1])
    print(f"{page}: {spellings_markdown().count(chr(10)) - 1} names")
