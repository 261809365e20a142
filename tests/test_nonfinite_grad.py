"""A NaN gradient under a finite loss, end to end: the summed gradient is checked on every step, and
``trainer.on_nonfinite`` decides (skip the update, or stop the run naming the step), on both backends,
with 1 and 2 workers.

The model is linear regression plus 0.01 * mean(sqrt(pred^2 * z)), z a data column that is 1 except on one
sample of global step 15, where it is 0: there the term is sqrt(0) = 0 (the loss stays finite) and its
derivative is inf * 0 = NaN. Without the check that step's update was applied and every weight turned NaN.
"""
import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from elasticflow.data.order import permutation

from harness import metrics, train

SAMPLES, BATCH, BAD_STEP, STEPS, LR, TERM = 256, 8, 15, 20, 0.1, 0.01

MODEL = f'''
import numpy as np
from elasticflow import data as ef_data, ops


def model(cfg):
    return {{"W": np.random.default_rng(cfg.seed).normal(0, 0.5, (3, 1)).astype(np.float32)}}


def forward(x, y, params):
    pred = x[:, :3] @ params["W"]
    return ops.mse(pred, y) + {TERM} * ops.mean(ops.sqrt(ops.square(pred) * x[:, 3:4]))


def data(cfg):
    x, y = dataset(cfg.seed)
    return x, y


def dataset(seed):
    rng = np.random.default_rng(0)
    x = rng.normal(size=({SAMPLES}, 4)).astype(np.float32)
    x[:, 3] = 1.0
    order = ef_data.permutation({SAMPLES}, seed, 0)
    x[order[({BAD_STEP} - 1) * {BATCH} + 3], 3] = 0.0  # one sample of global step {BAD_STEP}
    return x, (x[:, :1] * 3).astype(np.float32)
'''

ARGS = [f"trainer.global_batch_size={BATCH}", "trainer.log_every=1", f"trainer.max_steps={STEPS}", "seed=0",
        "checkpoint.interval.steps=5"]
CASES = [("torch", 1), ("torch", 2), ("tensorflow", 1), ("tensorflow", 2)]


def _expected_weights(namespace: dict) -> np.ndarray:
    """SGD in float64 by hand over the same global batches, skipping step 15's update: what skip means."""
    x, y = (a.astype(np.float64) for a in namespace["dataset"](0))
    order = permutation(SAMPLES, 0, 0)
    w = np.random.default_rng(0).normal(0, 0.5, (3, 1)).astype(np.float32).astype(np.float64)
    applied, k = 0, 0
    while applied < STEPS:
        idx = order[k * BATCH:(k + 1) * BATCH]
        k += 1
        if k == BAD_STEP:
            continue
        xb, yb, z = x[idx, :3], y[idx], x[idx, 3:4]
        pred = xb @ w
        grad = xb.T @ (2 * (pred - yb) + TERM * np.sign(pred) * z) / BATCH
        w -= LR * grad
        applied += 1
    return w


@pytest.fixture
def model_path(write_model):
    return write_model(MODEL)


@pytest.mark.parametrize("backend,workers", CASES, ids=[f"{b}-{w}w" for b, w in CASES])
def test_skip_drops_the_nan_step_and_trains_on(model_path, tmp_path, backend, workers):
    run = tmp_path / "run"
    proc = train(model_path, run, *ARGS, f"backend={backend}", f"launcher.workers={workers}",
                 "trainer.on_nonfinite=skip", check=False, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "the summed gradient has NaN or inf values (the loss, " in proc.stderr
    assert f"is finite) at step {BAD_STEP}; skipping the update" in proc.stderr
    records = [r for r in metrics(run) if "loss" in r]
    assert [r["samples_seen"] for r in records if r.get("skipped")] == [BAD_STEP * BATCH]  # one, everywhere
    assert [r["step"] for r in records if not r.get("skipped")] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in records)
    latest = ckpt.latest(run / "checkpoints")
    assert ckpt.read_metadata(latest)["step"] == STEPS
    namespace: dict = {}
    exec(MODEL, namespace)
    np.testing.assert_allclose(ckpt.load(latest)["W"], _expected_weights(namespace), rtol=1e-4, atol=1e-5)


# The stop path is the same code in every case the skip test covers: one of each backend and world size here.
STOP_CASES = [("torch", 2), ("tensorflow", 1)]


@pytest.mark.parametrize("backend,workers", STOP_CASES, ids=[f"{b}-{w}w" for b, w in STOP_CASES])
def test_stop_names_the_step_and_keeps_only_finite_checkpoints(model_path, tmp_path, backend, workers):
    run = tmp_path / "run"
    # Synchronous saves: an error exit does not wait for a save still in flight (step 10's, five fast steps
    # before the NaN), and which saves exist is what this test reads.
    proc = train(model_path, run, *ARGS, f"backend={backend}", f"launcher.workers={workers}",
                 "checkpoint.async_save=false", check=False, timeout=240)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "NaN or inf values" in errors[0] and f"at step {BAD_STEP} " in errors[0], \
        proc.stderr
    assert "hint: look in forward() for an op whose derivative is not finite" in proc.stderr
    assert [r["step"] for r in metrics(run) if "loss" in r] == list(range(1, BAD_STEP))
    latest = ckpt.latest(run / "checkpoints")
    assert latest.name == "step_10" and np.isfinite(ckpt.load(latest)["W"]).all()


def test_sharded_gradients_agree_on_the_nan_step(model_path, tmp_path):
    """trainer.shard=gradients without a buddy copy: no member holds the whole summed gradient, each judges
    its own ranges and one small sum makes the verdict common (grad_check.ScatteredSums)."""
    run = tmp_path / "run"
    proc = train(model_path, run, *ARGS, "launcher.workers=2", "trainer.shard=gradients",
                 "elastic.shard_replicas=0", "trainer.on_nonfinite=skip", check=False, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert f"at step {BAD_STEP}; skipping the update" in proc.stderr
    records = [r for r in metrics(run) if "loss" in r]
    assert [r["samples_seen"] for r in records if r.get("skipped")] == [BAD_STEP * BATCH]
    namespace: dict = {}
    exec(MODEL, namespace)
    latest = ckpt.latest(run / "checkpoints")
    np.testing.assert_allclose(ckpt.load(latest)["W"], _expected_weights(namespace), rtol=1e-4, atol=1e-5)
