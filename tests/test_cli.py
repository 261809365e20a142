"""The CLI as a user meets it: config printing, help, sweeps, determinism, and one-line errors.

The cases that train run `python -m elasticflow.cli` in a subprocess (bounded by run_cli's timeout), and so
do one case of each exit code, --debug and a closed pipe; the errors that come before a job starts run the
same entry point in this process (harness.cli).
"""
import json

import numpy as np
import pytest
import yaml

import elasticflow.checkpoint as ckpt
from elasticflow.config.schema import compose
from elasticflow.trainer import ElasticTrainer

from harness import MODELS, cli, losses, metrics, run_cli, train, train_in_process

TINY = '''
import numpy as np
from elasticflow import ops


def model(cfg):
    rng = np.random.default_rng(cfg.seed)
    return {"W1": rng.normal(0, 0.5, (4, 6)).astype(np.float32), "b1": np.zeros(6, np.float32),
            "W2": rng.normal(0, 0.5, (6, 1)).astype(np.float32)}


def forward(x, y, params):
    h = ops.dropout(ops.relu(x @ params["W1"] + params["b1"]), 0.2)
    return ops.mse(h @ params["W2"], y)


def data(cfg):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    return x, (x[:, :1] * 2 - x[:, 1:2]).astype(np.float32)
'''

SMALL = ["trainer.global_batch_size=16", "trainer.log_every=1"]


@pytest.fixture
def tiny(write_model):
    return write_model(TINY)


def test_cfg_job_prints_the_config_without_training(tiny, tmp_path):
    proc = run_cli(["train", tiny, "--cfg", "job", f"hydra.run.dir={tmp_path / 'run'}",
                    "trainer.global_batch_size=48"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "global_batch_size: 48" in proc.stdout and f"model: {tiny}" in proc.stdout
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and "done:" not in proc.stdout


def test_help_lists_groups_and_keys():
    proc = run_cli(["train", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "optimizer: adam, adamw, sgd" in proc.stdout
    assert "global_batch_size: 64" in proc.stdout and "--cfg job" in proc.stdout
    # Each key with its meaning, from the schema's comments (config/schema.py): after it, or above it.
    lines = proc.stdout.splitlines()
    assert "  global_batch_size: 64  # samples per optimizer step, whatever the number of workers" in lines
    assert "  # parameters without weight decay, by name pattern (e.g. [bias,norm]: biases and normalization weights)" \
        in lines[lines.index("  no_decay: []") - 1:]
    assert "backend: tensorflow, torch" in lines  # the group list above the config is left as it was
    top = run_cli(["--help"], timeout=60)
    assert top.returncode == 0 and "elasticflow train MODEL.py" in top.stdout


def test_every_config_key_has_a_meaning_in_the_schema():
    """`train --help` reads each key's meaning from config/schema.py's comments: a key without one is a key
    nobody can look up (add a `# ...` after the field, or comment lines above it)."""
    from omegaconf import OmegaConf

    from elasticflow.config.schema import Config
    from elasticflow.config.help import meanings

    def keys(node, prefix=""):
        for k, v in node.items():
            yield prefix + k
            if isinstance(v, dict) and k != "model_args":
                yield from keys(v, f"{prefix}{k}.")

    found = meanings()
    schema = OmegaConf.to_container(OmegaConf.structured(Config), throw_on_missing=False)
    assert set(keys(schema)) == set(found)
    assert [k for k, m in found.items() if not (m.above or m.trailing)] == []


@pytest.mark.parametrize("command", ["inspect", "status"])
def test_a_reader_that_stops_reading_ends_the_command_quietly(tiny, tmp_path, command):
    """`elasticflow inspect DIR | head` printed `error: BrokenPipeError`."""
    import subprocess
    import sys

    run = tmp_path / "run"
    cfg = compose(str(tiny), [*SMALL, "trainer.max_steps=1", "trainer.progress=false", "trainer.loggers=[]"])
    ElasticTrainer(str(tiny), cfg, run_dir=str(run)).fit()
    target = ckpt.latest(run / "checkpoints") if command == "inspect" else run
    # The reader is gone before the command writes a line (as `| true`, or `| head` once it has its lines).
    proc = subprocess.Popen([sys.executable, "-m", "elasticflow.cli", command, str(target)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 141 and stderr == "", stderr


def test_multirun_sweeps_two_learning_rates(tiny, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(["train", tiny, "-m", "optimizer.lr=0.1,0.01", f"hydra.sweep.dir={sweep}",
                    "trainer.max_steps=3", "trainer.progress=false", *SMALL], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert {r["lr"] for r in metrics(sweep / "0") if "loss" in r} == {0.1}
    assert {r["lr"] for r in metrics(sweep / "1") if "loss" in r} == {0.01}
    assert ckpt.latest(sweep / "0" / "checkpoints").name == ckpt.latest(sweep / "1" / "checkpoints").name == "step_3"


def test_an_optuna_sweep_of_four_trials_minimizes_the_final_eval_loss(tmp_path):
    """Hydra's Optuna sweeper: each trial's objective is the run's final eval_loss (the ``objective`` key), and
    the best trial it reports is the one whose run ended lowest."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    proc = run_cli(["train", MODELS / "digits_mlp.py", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4",
                    "hydra.sweeper.direction=minimize", "hydra.sweeper.sampler.seed=0",
                    "optimizer.lr=interval(0.01,0.5)", f"hydra.sweep.dir={sweep}", "trainer.max_steps=8",
                    "trainer.progress=false", "trainer.loggers=[]"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    finals = {}
    for job in range(4):
        result = json.loads((sweep / str(job) / "result.json").read_text())
        lr = {r["lr"] for r in metrics(sweep / str(job)) if "loss" in r}
        assert len(lr) == 1 and 0.01 <= lr.pop() <= 0.5
        finals[job] = result["eval_loss"]
    assert len(set(finals.values())) == 4  # four different learning rates drawn
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(finals.values()), rel=1e-6)


def test_an_objective_the_run_does_not_produce_is_one_line(tmp_path):
    proc = cli(["train", MODELS / "digits_mlp.py", "objective=eval_acc", "trainer.max_steps=2",
                f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress=false"])
    assert proc.returncode != 0
    assert "error: objective=eval_acc is not in the run's result (it has: " in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("sweep, message, hint", [
    # The form Hydra's own hint suggests: it once trained every job at the default lr, and saved `lrr`.
    ("+optimizer.lrr=0.5,0.01", "job 0 of the sweep (+optimizer.lrr=0.5 {common}): unknown config key optimizer.lrr "
     "(added with +)", "did you mean optimizer.lr?"),
    ("+trainer.max_stepz=2", "job 0 of the sweep (+trainer.max_stepz=2 {common}): unknown config key "
     "trainer.max_stepz (added with +)", "did you mean trainer.max_steps?"),  # once a raw TypeError
    ("trainer.max_steps=2,-3", "job 1 of the sweep (trainer.max_steps=-3 {common}): trainer.max_steps must be",
     "pass e.g."),  # the second job's value: refused before the first job starts
])
def test_every_job_of_a_sweep_is_validated_before_any_runs(tiny, tmp_path, sweep, message, hint):
    sweep_dir = tmp_path / "sweep"
    common = f"hydra.sweep.dir={sweep_dir}"
    proc = cli(["train", tiny, "-m", sweep, common])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: " + message.format(common=common)), lines
    assert lines[1].startswith("hint: ") and hint in lines[1], lines
    assert not sweep_dir.exists()  # no job ran


@pytest.mark.parametrize("override, message, hint", [
    ("trainer.max_stepz=3", "unknown config key trainer.max_stepz", "did you mean trainer.max_steps?"),
    ("trainer.global_batch_size=abc",
     "trainer.global_batch_size: Value 'abc' of type 'str' could not be converted to Integer", "of the key's type"),
    ("optimizer=rmsprop", "optimizer=rmsprop is not a choice of the config group optimizer",
     "use one of: optimizer=adam, optimizer=adamw, optimizer=sgd"),
    ("trainer.epochs=1,2", "Ambiguous value for argument 'trainer.epochs=1,2'", "to sweep over the values add -m"),
    ("trainer.tensorboard=false", "trainer.tensorboard was replaced by trainer.loggers",
     "trainer.loggers=[] no tracker at all"),
])
def test_a_bad_override_is_one_error_line_with_a_hint_and_writes_nothing(tiny, tmp_path, override, message, hint):
    proc = train(tiny, tmp_path / "run", override, check=False, timeout=120)
    assert_one_error(proc, message)
    assert proc.returncode == 2 and hint in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_config_dir_of_the_users_adds_a_group_choice(tiny, tmp_path):
    """--config-dir: Hydra's, not conf/ alone, decides what exists (the one-line check stands aside)."""
    mine = tmp_path / "conf" / "optimizer"
    mine.mkdir(parents=True)
    (mine / "slow.yaml").write_text("name: sgd\nlr: 0.003\nmomentum: 0.0\nnesterov: false\nweight_decay: 0.0\n")
    run = tmp_path / "run"
    train(tiny, run, "--config-dir", str(tmp_path / "conf"), "optimizer=slow", "trainer.max_steps=2", *SMALL,
          timeout=120)
    assert {r["lr"] for r in metrics(run) if "loss" in r} == {0.003}


def test_same_seed_same_losses_other_seed_other_losses(tiny, tmp_path):
    runs = {}
    for name in ("a", "b"):
        train(tiny, tmp_path / name, *SMALL, "trainer.max_steps=12", "seed=0", timeout=120)
        runs[name] = losses(tmp_path / name)
    assert len(runs["a"]) == 12
    assert runs["a"] == runs["b"]  # exact: two processes, bit for bit
    # another seed (in-process: only the difference matters here) changes init, order and dropout
    cfg = compose(str(tiny), [*SMALL, "trainer.max_steps=12", "seed=1", "trainer.progress=false"])
    ElasticTrainer(str(tiny), cfg, run_dir=str(tmp_path / "c")).fit()
    other = losses(tmp_path / "c")
    assert len(other) == 12 and all(x != y for x, y in zip(runs["a"], other))

    # the run dir given by hydra.run.dir holds everything the run wrote
    run = tmp_path / "a"
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "train.log").is_file()
    assert ckpt.latest(run / "checkpoints").name == "step_12"
    records = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("step", "epoch", "loss", "lr", "samples_seen", "world_size", "step_time_s"):
        assert all(key in r for r in records), key
    assert [r["samples_seen"] for r in records] == [16 * k for k in range(1, 13)]
    assert [r["epoch"] for r in records] == [0] * 8 + [1] * 4
    assert {r["world_size"] for r in records} == {1}
    assert all(r["step_time_s"] > 0 for r in records)


# ---------------------------------------------------------------- bad input: one error line, one hint
GOOD_FORWARD = "def forward(x, y, params):\n    return ops.mse(x @ params['W'], y)\n"
GOOD_MODEL = "def model(cfg):\n    return {'W': np.zeros((3, 1), np.float32)}\n"
GOOD_DATA = ("def data(cfg):\n    x = np.ones((100, 3), np.float32)\n    return x, x[:, :1]\n")
HEADER = "import numpy as np\nfrom elasticflow import ops\n\n"

BAD = {
    "no_model": (HEADER + GOOD_FORWARD + GOOD_DATA, [], "has no model() function"),
    "no_data": (HEADER + GOOD_MODEL + GOOD_FORWARD, [], "has no data() function"),
    "forward_not_callable": (HEADER + GOOD_MODEL + "forward = 3\n" + GOOD_DATA, [],
                             "'forward' in model file"),
    "model_not_callable": (HEADER + "model = {'W': 1}\n" + GOOD_FORWARD + GOOD_DATA, [],
                           "'model' in model file"),
    "non_scalar_loss": (HEADER + GOOD_MODEL + "def forward(x, y, params):\n    return x @ params['W'] - y\n"
                        + GOOD_DATA, [], "non-scalar loss"),
    "unequal_arrays": (HEADER + GOOD_MODEL + GOOD_FORWARD
                       + "def data(cfg):\n    return np.ones((100, 3), np.float32), np.ones((99, 1), np.float32)\n",
                       [], "unequal length (#0: 100, #1: 99 rows)"),
    "dataset_too_small": (HEADER + GOOD_MODEL + GOOD_FORWARD + GOOD_DATA, ["trainer.global_batch_size=128"],
                          "has 100 samples, fewer than one global batch of 128"),
    "batch_size_zero": (HEADER + GOOD_MODEL + GOOD_FORWARD + GOOD_DATA, ["trainer.global_batch_size=0"],
                        "trainer.global_batch_size must be a positive integer, got 0"),
    "batch_size_negative": (HEADER + GOOD_MODEL + GOOD_FORWARD + GOOD_DATA, ["trainer.global_batch_size=-3"],
                            "trainer.global_batch_size must be a positive integer, got -3"),
    "etcd_without_nodes": (HEADER + GOOD_MODEL + GOOD_FORWARD + GOOD_DATA, ["launcher.store=etcd"],
                           "launcher.store=etcd runs with launcher=nodes, not launcher=local"),
    "etcd_without_endpoints": (HEADER + GOOD_MODEL + GOOD_FORWARD + GOOD_DATA,
                               ["launcher=nodes", "launcher.store=etcd", "launcher.etcd.endpoints=[10.0.0.1:2379]"],
                               "launcher.etcd.endpoints must list every etcd member's https:// client URL"),
    "etcd_without_its_ca": (HEADER + GOOD_MODEL + GOOD_FORWARD + GOOD_DATA,
                            ["launcher=nodes", "launcher.store=etcd", "launcher.etcd.endpoints=[https://10.0.0.1:2379]"],
                            "launcher.etcd.ca is not set"),
    "etcd_lease_under_a_second": (HEADER + GOOD_MODEL + GOOD_FORWARD + GOOD_DATA,
                                  ["launcher=nodes", "launcher.store=etcd", "launcher.etcd.lease_s=1"],
                                  "launcher.etcd.lease_s"),
}


def assert_one_error(proc, message):
    assert proc.returncode not in (0, None), proc.stdout
    lines = proc.stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert message in lines[errors[0]], proc.stderr
    assert errors[0] + 1 < len(lines) and lines[errors[0] + 1].startswith("hint: "), proc.stderr
    assert len(lines[errors[0] + 1]) > len("hint: ") + 10


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_line_with_a_hint(write_model, tmp_path, case):
    source, overrides, message = BAD[case]
    proc = train_in_process(write_model(source), tmp_path / "run", "trainer.max_steps=2", *overrides)
    assert_one_error(proc, message)
    assert "Traceback" not in proc.stderr


def test_missing_model_file(tmp_path):
    proc = train_in_process(tmp_path / "nope.py", tmp_path / "run")
    assert_one_error(proc, f"model file '{tmp_path / 'nope.py'}' not found")
    assert "Traceback" not in proc.stderr
    proc = train_in_process(tmp_path, tmp_path / "run")
    assert_one_error(proc, "is a directory")


@pytest.mark.parametrize("override", ["checkpoint.async=false", "+checkpoint.async=false", "++checkpoint.async=false"])
def test_the_old_async_key_is_one_error_naming_the_new_one(tiny, tmp_path, override):
    proc = train_in_process(tiny, tmp_path / "run", override)
    assert_one_error(proc, "checkpoint.async was renamed to checkpoint.async_save")
    assert "hint: pass checkpoint.async_save=false" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.returncode == 2 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["no_model", "non_scalar_loss", "batch_size_zero"])
def test_debug_shows_the_traceback(write_model, tmp_path, case):
    source, overrides, message = BAD[case]
    proc = run_cli(["train", write_model(source), f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=2",
                    *overrides, "--debug"], timeout=120)
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr
    assert message in proc.stderr



@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_an_error_in_the_users_forward_names_its_line(write_model, tmp_path, debug):
    source = HEADER + GOOD_MODEL + "def forward(x, y, params):\n    return params['bias']\n" + GOOD_DATA
    model = write_model(source)
    proc = run_cli(["train", model, f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=2",
                    *(["--debug"] if debug else [])], timeout=120)
    assert_one_error(proc, f"KeyError: 'bias' at {model}:")
    assert proc.returncode == 1
    assert ("Traceback (most recent call last)" in proc.stderr) is debug
    assert ("hint: the full traceback is above" if debug else "hint: run with --debug") in proc.stderr

def test_a_shape_error_raised_inside_torch_names_the_users_line(write_model, tmp_path):
    """It named torch/nn/modules/linear.py, where the error was raised, not forward()'s call."""
    source = ("import numpy as np\nimport torch\n\n\ndef model(cfg):\n    return torch.nn.Linear(4, 1)\n\n\n"
              "def forward(x, y, net):\n    return ((net(x[:, :3]) - y) ** 2).mean()\n\n\n" + GOOD_DATA.replace(
                  "(100, 3)", "(100, 4)"))
    model = write_model(source)
    proc = train_in_process(model, tmp_path / "run", "trainer.max_steps=2")
    assert_one_error(proc, "RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert f" at {model}:10\n" in proc.stderr and "linear.py" not in proc.stderr
    assert proc.returncode == 1


# ---------------------------------------------------------------- a loss that turns NaN/inf at step 15
# The sample at position 14*8 + k of epoch 0's order (global step 15) carries NaN (or inf).
NONFINITE = '''
import numpy as np
from elasticflow import data as ef_data, ops


def model(cfg):
    return {"W": np.zeros((3, 1), np.float32)}


def forward(x, y, params):
    return ops.mse(x @ params["W"], y)


def data(cfg):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 3)).astype(np.float32)
    y = x[:, :1] * 3
    order = ef_data.permutation(256, cfg.seed, 0)
    bad = next(int(i) for i in order[14 * 8:15 * 8] if i > 1)
    x[bad, 0] = float("%s")
    return x, y
'''


def test_nan_loss_stops_naming_the_step_and_keeps_what_was_written(write_model, tmp_path):
    run = tmp_path / "run"
    proc = train(write_model(NONFINITE % "nan"), run, "trainer.global_batch_size=8", "trainer.log_every=1",
                 "trainer.max_steps=20", "checkpoint.interval.steps=5", check=False, timeout=120)
    assert_one_error(proc, "loss is nan at step 15")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert [r["step"] for r in metrics(run) if "loss" in r] == list(range(1, 15))
    assert all(np.isfinite(losses(run)))
    assert ckpt.latest(run / "checkpoints").name == "step_10"
    found = [p.name for p in (run / "checkpoints").rglob("*") if p.is_dir() and ckpt.is_complete(p)]
    assert sorted(found) == ["step_10", "step_5"]


def test_inf_loss_is_skipped_with_on_nonfinite_skip(write_model, tmp_path):
    run = tmp_path / "run"
    proc = train(write_model(NONFINITE % "inf"), run, "trainer.global_batch_size=8", "trainer.log_every=1",
                 "trainer.max_steps=20", "trainer.on_nonfinite=skip", check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "loss is inf at step 15; skipping the update" in proc.stderr
    trained = [r for r in metrics(run) if "loss" in r and not r.get("skipped")]
    assert [r["step"] for r in trained] == list(range(1, 21))
    assert all(np.isfinite(r["loss"]) for r in trained)
    assert trained[-1]["samples_seen"] == 21 * 8  # 21 batches consumed, 20 updates applied
    state = ckpt.load(ckpt.latest(run / "checkpoints"))
    assert ckpt.read_metadata(ckpt.latest(run / "checkpoints"))["step"] == 20
    assert np.isfinite(state["W"]).all() and abs(state["W"][0, 0]) > 0.1


def test_hydras_info_and_cfg_pass_through(tiny, tmp_path):
    """Hydra's own flags work as in any Hydra app: --info (its value optional) once took the model file's override
    as its value and argparse refused it; `--info config` and `--cfg job` print and train nothing."""
    bare = cli(["train", tiny, "--info"])
    assert bare.returncode == 0 and "Installed Hydra Plugins" in bare.stdout, bare.stderr
    config = cli(["train", tiny, "trainer.max_steps=3", "--info", "config"])
    assert config.returncode == 0 and "Config search path" in config.stdout, config.stderr
    job = cli(["train", tiny, "--cfg", "job", "trainer.max_steps=7", f"hydra.run.dir={tmp_path / 'run'}"])
    assert job.returncode == 0 and "max_steps: 7" in job.stdout, job.stderr
    assert not (tmp_path / "run").exists()
