"""backend=tensorflow: the same model file gives the same losses, checkpoints move between backends,
native keras models keep their BatchNorm state, and mismatched native models fail in one line.

The end-to-end runs are batched: one fresh interpreter per backend runs every training in turn
through the public API (a TensorFlow import costs seconds), in three phases so that a checkpoint
written by one backend exists before the other resumes it:

    A (torch, subprocess):      parity runs, torch 15 steps (to resume on TF)
    B (tensorflow, subprocess): parity runs, resume A's 15 steps to 30, TF 15, keras BatchNorm
    C (torch, this process):    resume B's 15 steps to 30

A resumed run is compared with the parity run of its configuration on the backend it resumed on: the same
job, uninterrupted (one run serves both tests; a reference of its own would only repeat it).

Parity tolerances, relative, per step over 30 steps: 1e-4 with SGD, 1e-3 with Adam/AdamW. The
two backends round differently (torch's matmuls are MKL/oneDNN, TF's Eigen/oneDNN with their own
float32 summation orders), and Adam divides by sqrt(v), which in the first steps (v tiny) turns a
last-bit difference in the gradient into a larger one in the update. Measured differences are far
below these (about 2e-7 for every model and optimizer here: see the failure message for the
maximum); a semantic difference in an op shows up as 1e-2 or more.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from harness import MODELS, REPO, metrics, train_in_process

SGD_TOL, ADAM_TOL = 1e-4, 1e-3
STEPS = 30
COMMON = ["trainer.log_every=1", "trainer.progress=false", "backend.threads=1", "resume=none"]

# label: (model file, overrides). char_transformer's optimizer comes from its model file (Adam).
PARITY = {
    "linear-sgd": ("linear.py", ["optimizer=sgd"]),
    "linear-adam": ("linear.py", ["optimizer=adam", "optimizer.lr=0.01"]),
    "digits_mlp-sgd": ("digits_mlp.py", ["optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9",
                                         "optimizer.nesterov=true", "optimizer.weight_decay=0.001"]),
    # micro-batches 24+24+16: the smaller last one is a second trace under tf.function
    "digits_mlp-adam": ("digits_mlp.py", ["optimizer=adam", "optimizer.lr=0.003", "optimizer.weight_decay=0.001",
                                          "trainer.micro_batch_size=24"]),
    "digits_mlp-adamw": ("digits_mlp.py", ["optimizer=adamw", "optimizer.lr=0.003", "optimizer.weight_decay=0.1"]),
    "digits_cnn-sgd": ("digits_cnn.py", ["optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9",
                                         "trainer.grad_clip=0.5"]),
    "digits_cnn-adam": ("digits_cnn.py", ["optimizer=adam", "optimizer.lr=0.003"]),
    "char_transformer-adam": ("char_transformer.py", ["trainer.global_batch_size=32"]),
}
PARITY = {k: v for k, v in PARITY.items() if (MODELS / v[0]).is_file()}  # example models still being written
RESUME_ADAM, RESUME_SGD = "digits_mlp-adam", "digits_mlp-sgd"  # torch -> TF, TF -> torch: parity labels
RESUME_AT = 15  # of STEPS

RUNNER = textwrap.dedent("""
    import json, sys
    from elasticflow.config.schema import compose
    from elasticflow.trainer import ElasticTrainer

    for job in json.loads(sys.argv[1]):
        ElasticTrainer(job["model"], compose(job["model"], job["overrides"]), run_dir=job["run_dir"]).fit()
    print("MODULES " + json.dumps(sorted(m for m in ("torch", "tensorflow", "keras") if m in sys.modules)))
""")


def _job(run_dir: Path, model: str, overrides, backend: str, steps: int, resume: bool = False) -> dict:
    extra = [f"backend={backend}", f"trainer.max_steps={steps}", *COMMON]
    if resume:
        extra[-1] = "resume=auto"
    return {"model": str(MODELS / model), "run_dir": str(run_dir), "overrides": [*overrides, *extra]}


def _run_jobs(jobs, timeout=240) -> list:
    """Every job in one fresh interpreter; returns the framework modules it had imported at the end."""
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={"TF_CPP_MIN_LOG_LEVEL": "2", **os.environ})
    assert proc.returncode == 0, f"runner exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.rsplit("MODULES ", 1)[1])


def _fit_here(job: dict):
    """One job in this process (pytest has both frameworks imported already)."""
    from elasticflow import ops
    from elasticflow.config.schema import compose
    from elasticflow.trainer import ElasticTrainer

    with ops.using():  # the trainer chooses its backend; the one active before comes back after
        return ElasticTrainer(job["model"], compose(job["model"], job["overrides"]), run_dir=job["run_dir"]).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("backends")
    parity = {b: {label: root / f"{b}-{label}" for label in PARITY} for b in ("torch", "tensorflow")}
    # t: torch's first RESUME_AT steps, resumed on TF; f: TF's, resumed on torch; each ends where its parity run
    # on the other backend does, which is its reference
    d = {"t": root / "t", "f": root / "f", "bn": root / "bn", "t_ref": parity["tensorflow"][RESUME_ADAM],
         "f_ref": parity["torch"][RESUME_SGD]}

    phase_a = [_job(parity["torch"][k], m, o, "torch", STEPS) for k, (m, o) in PARITY.items()]
    phase_a += [_job(d["t"], *PARITY[RESUME_ADAM], "torch", RESUME_AT)]
    torch_modules = _run_jobs(phase_a)

    phase_b = [_job(parity["tensorflow"][k], m, o, "tensorflow", STEPS) for k, (m, o) in PARITY.items()]
    phase_b += [_job(d["t"], *PARITY[RESUME_ADAM], "tensorflow", STEPS, resume=True),
                _job(d["f"], *PARITY[RESUME_SGD], "tensorflow", RESUME_AT),
                _job(d["bn"], "keras_bn.py", ["checkpoint.interval.steps=10"], "tensorflow", 20)]
    _run_jobs(phase_b)

    _fit_here(_job(d["f"], *PARITY[RESUME_SGD], "torch", STEPS, resume=True))
    return {"dirs": d, "parity": parity, "torch_modules": torch_modules}


@pytest.fixture
def restore_ops():
    from elasticflow import ops

    with ops.using():
        yield


def _step_losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def _max_rel(a: dict, b: dict, steps) -> tuple:
    rel = {s: abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in steps}
    worst = max(rel, key=rel.get)
    return rel[worst], worst


@pytest.mark.parametrize("label", sorted(PARITY))
def test_same_losses_on_both_backends(runs, label):
    tol = SGD_TOL if label.endswith("-sgd") else ADAM_TOL
    torch_l, tf_l = (_step_losses(runs["parity"][b][label]) for b in ("torch", "tensorflow"))
    assert sorted(torch_l) == sorted(tf_l) == list(range(1, STEPS + 1))
    worst, step = _max_rel(torch_l, tf_l, range(1, STEPS + 1))
    assert worst <= tol, f"{label}: torch {torch_l[step]} vs tensorflow {tf_l[step]} at step {step} (rel {worst:.2e})"
    assert tf_l[STEPS] < tf_l[1]  # and it trains
    print(f"{label}: max relative loss difference {worst:.2e}")


def test_torch_checkpoint_resumes_on_tensorflow(runs):
    d = runs["dirs"]
    resumed, reference = _step_losses(d["t"]), _step_losses(d["t_ref"])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    worst, step = _max_rel(resumed, reference, range(RESUME_AT + 1, STEPS + 1))
    assert worst <= ADAM_TOL, f"step {step}: resumed {resumed[step]} vs uninterrupted {reference[step]}"
    meta = ckpt.read_metadata(ckpt.latest(d["t"] / "checkpoints"))
    assert meta["backend"] == "tensorflow" and meta["step"] == STEPS


def test_tensorflow_checkpoint_resumes_on_torch(runs):
    d = runs["dirs"]
    resumed, reference = _step_losses(d["f"]), _step_losses(d["f_ref"])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    worst, step = _max_rel(resumed, reference, range(RESUME_AT + 1, STEPS + 1))
    assert worst <= SGD_TOL, f"step {step}: resumed {resumed[step]} vs uninterrupted {reference[step]}"
    state = ckpt.load(ckpt.latest(d["f"] / "checkpoints"))
    assert "optimizer/hidden/W/momentum_buffer" in state and not any(n.startswith("rng/") for n in state)


def test_torch_run_never_imports_tensorflow(runs):
    assert "torch" in runs["torch_modules"]
    assert "tensorflow" not in runs["torch_modules"] and "keras" not in runs["torch_modules"]


def test_keras_batchnorm_statistics_survive_a_checkpoint(runs):
    from elasticflow import ops
    from elasticflow.config.schema import compose
    from elasticflow.trainer import ElasticTrainer

    run = runs["dirs"]["bn"]
    final = ckpt.latest(run / "checkpoints")
    assert final.name == "step_20" and (final.parent / "step_10").is_dir()
    saved = ckpt.load(final)
    assert {"bn/moving_mean", "bn/moving_variance", "bn/gamma", "hidden/kernel"} <= set(saved)
    assert not [n for n in saved if n.startswith("optimizer/")]  # plain SGD keeps no state
    # Moved away from keras's initial zeros and ones, so the comparison below means something.
    assert np.abs(saved["bn/moving_mean"]).max() > 1e-3 and np.abs(saved["bn/moving_variance"] - 1).max() > 1e-3
    eval_before = [r for r in metrics(run) if "eval_loss" in r][-1]

    model = str(MODELS / "keras_bn.py")
    with ops.using("tensorflow"):
        trainer = ElasticTrainer(model, compose(model, ["backend=tensorflow", "trainer.max_steps=20"]),
                                 run_dir=str(run)).prepare()
        assert trainer.step_count == 20
        state = trainer.engine.state()
        for name in ("bn/moving_mean", "bn/moving_variance", "bn/gamma", "out/kernel"):
            np.testing.assert_array_equal(state[name], saved[name], err_msg=name)
        # Evaluation uses the moving statistics: it matches the run that wrote them.
        assert trainer.evaluate()["eval_loss"] == pytest.approx(eval_before["eval_loss"], rel=1e-6)


TORCH_MODEL = '''
import numpy as np
import torch


def model(cfg):
    return torch.nn.Linear(4, 2)


def forward(x, y, params):
    return ((params(x) - y) ** 2).mean()


def data(cfg):
    return np.zeros((8, 4), np.float32), np.zeros((8, 2), np.float32)
'''


def _error_lines(proc) -> list:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_torch_model_under_tensorflow_fails_in_one_line(tmp_path, write_model):
    proc = train_in_process(write_model(TORCH_MODEL), tmp_path / "run", "backend=tensorflow")
    assert proc.returncode != 0
    (line,) = _error_lines(proc)
    assert "PyTorch model" in line and "torch.nn.Module" in line and "backend=tensorflow" in line, line
    assert "Traceback" not in proc.stderr


def test_keras_model_under_torch_is_refused(tmp_path, restore_ops):
    # In-process (the CLI's one-line rendering of ElasticFlowError is the test above's business).
    from elasticflow.config.schema import compose
    from elasticflow.errors import ElasticFlowError
    from elasticflow.trainer import ElasticTrainer

    model = str(MODELS / "keras_bn.py")
    with pytest.raises(ElasticFlowError) as info:
        ElasticTrainer(model, compose(model, ["backend=torch"]), run_dir=str(tmp_path)).prepare()
    assert "returned a TensorFlow model (keras." in info.value.message and "backend=torch" in info.value.message


def test_missing_tensorflow_is_one_clear_error(monkeypatch):
    from elasticflow import backends
    from elasticflow.errors import ElasticFlowError

    monkeypatch.setattr(backends, "_loaded", {})
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # what an uninstalled package looks like to import
    with pytest.raises(ElasticFlowError) as info:
        backends.load("tensorflow")
    assert "backend=tensorflow needs the 'tensorflow' package" in info.value.message
    assert "pip install tensorflow-cpu" in info.value.hint


# ---------------------------------------------------------------- the Engine, in-process
def _mlp(seed=0):
    rng = np.random.default_rng(seed)
    return {"l1": {"W": rng.normal(0, 0.5, (4, 6)).astype(np.float32), "b": np.zeros(6, np.float32)},
            "l2": {"W": rng.normal(0, 0.5, (6, 3)).astype(np.float32), "b": rng.normal(0, 0.1, 3).astype(np.float32)},
            "steps": np.zeros(2, np.int64)}


def _mlp_forward(x, y, params):
    from elasticflow import ops

    h = ops.tanh(x @ params["l1"]["W"] + params["l1"]["b"])
    logits = h @ params["l2"]["W"] + params["l2"]["b"]
    return {"loss": ops.cross_entropy(logits, y), "accuracy": ops.accuracy(logits, y)}


def _batches(n=6, size=10):
    rng = np.random.default_rng(3)
    return [(rng.normal(size=(size - (i % 3), 4)).astype(np.float32), rng.integers(0, 3, size - (i % 3)))
            for i in range(n)]


def _engine(name, spec, jit=True):
    from elasticflow import backends, ops

    ops.use(name)
    module = backends.load(name)
    return module, module.Engine(_mlp(), _mlp_forward, spec, jit=jit)


def _train(name, spec, batches, jit=True):
    """Two micro-batches per step (weights 0.6/0.4); returns (engine, per-step weighted losses)."""
    module, engine = _engine(name, spec, jit)
    losses = []
    for i in range(0, len(batches), 2):
        engine.train_mode(True)
        engine.zero_grad()
        total = 0.0
        for w, (x, y) in zip((0.6, 0.4), batches[i:i + 2]):
            loss, _ = engine.accumulate((module.to_tensor(x), module.to_tensor(y)), w)
            total = total + loss
        losses.append(float(total))
        engine.apply(0.05 * (1 + i))  # a changing lr: the compiled update must not bake it in
    return engine, losses


SPECS = {
    "sgd": lambda optim: optim.SGD(0.1),
    "sgd-nesterov-wd": lambda optim: optim.SGD(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam-l2": lambda optim: optim.Adam(0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
    "adamw": lambda optim: optim.AdamW(0.01, weight_decay=0.2),
}


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_engine_updates_and_state_equal_torch(spec, restore_ops):
    from elasticflow import optim

    batches = _batches(12)
    torch_engine, torch_losses = _train("torch", SPECS[spec](optim), batches)
    tf_engine, tf_losses = _train("tensorflow", SPECS[spec](optim), batches)
    np.testing.assert_allclose(tf_losses, torch_losses, rtol=1e-5)
    a, b = torch_engine.state(), tf_engine.state()
    assert sorted(a) == sorted(b)  # same names, slots included: checkpoints are interchangeable
    assert sorted(b) == sorted(tf_engine.state_names())
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_engine_state_round_trips_across_backends(restore_ops):
    """torch state -> TF engine -> one more step on each: the same update (Adam's step count included)."""
    from elasticflow import backends, ops, optim

    batches = _batches(8)
    torch_engine, _ = _train("torch", optim.Adam(0.01), batches[:6])
    _, tf_engine = _engine("tensorflow", optim.Adam(0.01))
    tf_engine.load_state(torch_engine.state(), optimizer_steps=3)
    for name, engine in (("torch", torch_engine), ("tensorflow", tf_engine)):
        ops.use(name)
        module = backends.load(name)
        engine.zero_grad()
        x, y = batches[6]
        engine.accumulate((module.to_tensor(x), module.to_tensor(y)), 1.0)
        engine.apply(0.01)
    a, b = torch_engine.state(), tf_engine.state()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("name", ["torch", "tensorflow"])
def test_state_without_copy_reads_the_live_values(name, restore_ops):
    """state(copy=False) (checkpoint snapshots, state broadcasts) equals state() and copies nothing
    on torch; on TF the views are of the variables' buffers, which copy-on-write keeps as they were."""
    from elasticflow import optim

    module, engine = _engine(name, optim.SGD(0.1, momentum=0.9))
    x, y = _batches(1)[0]
    engine.zero_grad()
    engine.accumulate((module.to_tensor(x), module.to_tensor(y)), 1.0)
    engine.apply(0.1)
    copied, views = engine.state(), engine.state(copy=False)
    assert sorted(views) == sorted(copied) and any(n.startswith("optimizer/") for n in views)
    for n in copied:
        assert np.array_equal(views[n], copied[n]) and not np.shares_memory(views[n], copied[n]), n
    engine.zero_grad()
    engine.accumulate((module.to_tensor(x), module.to_tensor(y)), 1.0)
    engine.apply(0.1)
    after = engine.state()
    moved = [n for n in copied if not np.array_equal(after[n], copied[n])]
    assert moved
    for n in moved:  # torch: views of the live tensors; TF: a snapshot
        assert np.array_equal(views[n], after[n] if name == "torch" else copied[n]), n


@pytest.mark.parametrize("name", ["torch", "tensorflow"])
def test_grad_view_edits_are_what_apply_uses(name, restore_ops):
    import torch

    from elasticflow import optim

    module, engine = _engine(name, optim.SGD(1.0))
    before = engine.state()
    x, y = _batches(1)[0]
    engine.zero_grad()
    engine.accumulate((module.to_tensor(x), module.to_tensor(y)), 1.0)
    view = engine.grad_view()
    assert isinstance(view, torch.Tensor) and view.dtype == torch.float32 and view.shape == (engine.num_params,)
    assert float(view.norm()) == pytest.approx(engine.grad_norm(), rel=1e-6)  # it is the gradient
    view.zero_()          # what an allreduce does: edit in place
    view[0] = 2.0         # d loss / d l1/W[0, 0] := 2
    engine.apply(0.5)
    after = engine.state()
    delta = after["l1/W"] - before["l1/W"]
    assert delta[0, 0] == pytest.approx(-1.0)
    delta[0, 0] = 0
    assert not delta.any() and all(np.array_equal(after[n], before[n]) for n in ("l1/b", "l2/W", "l2/b"))
    # A second step: a fresh view aliases the fresh gradient.
    engine.zero_grad()
    engine.accumulate((module.to_tensor(x), module.to_tensor(y)), 1.0)
    engine.grad_view().mul_(0)
    engine.apply(0.5)
    np.testing.assert_array_equal(engine.state()["l1/W"], after["l1/W"])


def test_jit_and_eager_agree_and_retrace_only_on_new_shapes(restore_ops):
    from elasticflow import optim

    batches = _batches(12)  # micro-batch sizes 10, 9, 8, 10, ...: each size comes first and second in a step
    jit_engine, jit_losses = _train("tensorflow", optim.Adam(0.01), batches, jit=True)
    eager_engine, eager_losses = _train("tensorflow", optim.Adam(0.01), batches, jit=False)
    np.testing.assert_allclose(jit_losses, eager_losses, rtol=1e-6)
    a, b = jit_engine.state(), eager_engine.state()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # Keys: (training, first micro-batch of its step, runs the previous step's update, resident
    # tensors gathered inside: none here). One trace per shape and variant: the very first
    # micro-batch has no update before it.
    counts = {key: fn.experimental_get_tracing_count() for key, fn in jit_engine._grad_fns.items()}
    assert counts == {(True, True, False, None): 1, (True, True, True, None): 3, (True, False, False, None): 3}
    assert jit_engine._apply_fn.experimental_get_tracing_count() == 1  # lr and bias corrections are tensors
    from elasticflow.backends import tensorflow as tfb

    for x, y in batches:  # no new shapes: no new traces
        jit_engine.zero_grad()
        jit_engine.accumulate((tfb.to_tensor(x), tfb.to_tensor(y)), 0.5)
        jit_engine.apply(0.01)
    assert {key: fn.experimental_get_tracing_count() for key, fn in jit_engine._grad_fns.items()} == counts
    assert jit_engine._apply_fn.experimental_get_tracing_count() == 1


def test_zero_grad_without_micro_batches_gives_zeros(restore_ops):
    """A worker with an empty share: zero_grad(), no accumulate(), then the reduction reads zeros."""
    from elasticflow import optim

    engine, _ = _train("tensorflow", optim.SGD(0.1), _batches(2))
    engine.zero_grad()
    assert engine.grad_norm() == 0.0 and float(engine.grad_view().abs().sum()) == 0.0


def test_training_flag_is_not_baked_into_the_compiled_step(restore_ops):
    """Dropout in a tf.function: active in accumulate(), the identity in evaluate(), whichever runs first."""
    from elasticflow import backends, ops, optim

    ops.use("tensorflow")
    module = backends.load("tensorflow")

    def forward(x, params):
        return {"loss": ops.mean(ops.dropout(x * params["w"], 0.5)), "kept": ops.mean(ops.cast(
            ops.dropout(x * params["w"], 0.5) != 0, "float32"))}

    engine = module.Engine({"w": np.ones(1, np.float32)}, forward, optim.SGD(0.1))
    x = module.to_tensor(np.ones((1000,), np.float32))
    engine.train_mode(False)
    assert engine.evaluate((x,)) == {"loss": 1.0, "kept": 1.0}
    engine.train_mode(True)
    _, m = engine.accumulate((x,), 1.0)
    assert 0.4 < float(m["kept"]) < 0.6
    engine.train_mode(False)
    assert engine.evaluate((x,))["kept"] == 1.0


def test_native_kinds_and_names(restore_ops):
    import keras
    import tensorflow as tf
    import torch

    from elasticflow import backends, optim

    tfb, torchb = backends.load("tensorflow"), backends.load("torch")
    kind = tfb.native_kind(torch.nn.Linear(2, 2))
    assert kind.startswith("a PyTorch model") and "torch.nn.Module" in kind and "'Linear'" in kind
    assert tfb.native_kind({"W": np.zeros(2)}) is None
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc")])
    assert tfb.is_native(net) and tfb.native_kind(net) is None and "TensorFlow model" in torchb.native_kind(net)

    class Module(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.ones((3, 2), np.float32))
            self.blocks = [tf.Variable(np.zeros(2, np.float32)), tf.Variable(np.int64(5), trainable=False)]

    engine = tfb.Engine(Module(), lambda x, params: tf.reduce_mean(x @ params.w + params.blocks[0]), optim.SGD(0.1))
    assert sorted(engine.param_names) == ["blocks/0", "w"] and list(engine.buffers) == ["blocks/1"]
    engine.accumulate((tfb.to_tensor(np.ones((4, 3), np.float32)),), 1.0)
    engine.apply(0.1)
    np.testing.assert_allclose(engine.state()["blocks/0"], [-0.05, -0.05])  # d mean / d b = 1/2 each
