"""Gradient accumulation and clipping: how a global batch is cut into micro-batches never changes the update.

One global batch of 64 = 1 micro-batch of 64 = 4 of 16 = 24 + 24 + 16 (micro_batch_size=24), to 1e-6,
after one step and after several; clipping uses the global norm of the accumulated gradient,
exactly as torch.nn.utils.clip_grad_norm_ on the full batch.
"""
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import elasticflow.checkpoint as ckpt
from elasticflow.data import order as data
from elasticflow.config.schema import compose
from elasticflow.train.model_file import load as load_model_file
from elasticflow.trainer import ElasticTrainer

SAMPLES, BATCH = 192, 64

MLP = '''
import numpy as np
from elasticflow import ops


def model(cfg):
    rng = np.random.default_rng(3)
    return {"W1": rng.normal(0, 0.5, (6, 8)).astype(np.float32), "b1": np.zeros(8, np.float32),
            "W2": rng.normal(0, 0.5, (8, 2)).astype(np.float32), "b2": np.zeros(2, np.float32)}


def forward(x, y, params):
    h = ops.tanh(x @ params["W1"] + params["b1"])
    return ops.mse(h @ params["W2"] + params["b2"], y)


def data(cfg):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(%d, 6)).astype(np.float32)
    y = np.stack([x[:, 0] * x[:, 1], np.cos(x[:, 2]) + x[:, 5]], axis=1).astype(np.float32)
    return x, y
''' % SAMPLES


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("accum") / "mlp.py"
    path.write_text(MLP)
    return path


def fit(model_path, run_dir, steps, *overrides):
    cfg = compose(str(model_path), [f"trainer.global_batch_size={BATCH}", f"trainer.max_steps={steps}",
                                    "trainer.log_every=1", "trainer.progress=false", "optimizer.lr=0.1",
                                    "optimizer.momentum=0.9", *overrides])
    ElasticTrainer(str(model_path), cfg, run_dir=str(run_dir)).fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return ckpt.load(ckpt.latest(run_dir / "checkpoints")), [r for r in records if "loss" in r]


@pytest.fixture(scope="module")
def runs(model_path, tmp_path_factory):
    """{(micro_batch_size, steps): (state, records)} for whole-batch, 4 x 16 and 24 + 24 + 16."""
    out = {}
    for micro in ("null", 16, 24):
        for steps in (1, 3):
            run_dir = tmp_path_factory.mktemp(f"micro{micro}_steps{steps}")
            out[micro, steps] = fit(model_path, run_dir, steps, f"trainer.micro_batch_size={micro}")
    return out


@pytest.mark.parametrize("micro", [16, 24])
@pytest.mark.parametrize("steps", [1, 3])
def test_micro_batches_give_the_whole_batch_update(runs, micro, steps):
    whole, _ = runs["null", steps]
    split, _ = runs[micro, steps]
    assert sorted(whole) == sorted(split)  # parameters and momentum buffers
    for name in whole:
        np.testing.assert_allclose(split[name], whole[name], rtol=0, atol=1e-6, err_msg=name)
    initial_w1 = np.random.default_rng(3).normal(0, 0.5, (6, 8)).astype(np.float32)  # the model file's init
    assert np.abs(whole["W1"] - initial_w1).max() > 1e-3


@pytest.mark.parametrize("micro, per_step", [("null", 1), (16, 4), (24, 3)])
def test_micro_step_counts_micro_batches_and_loss_is_the_global_mean(runs, micro, per_step):
    _, records = runs[micro, 3]
    _, whole = runs["null", 3]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["micro_step"] for r in records] == [per_step, 2 * per_step, 3 * per_step]
    assert [r["samples_seen"] for r in records] == [64, 128, 192]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in whole], rel=1e-6)


def reference_clipped(model_path, clip, steps):
    """Full-batch SGD(momentum) with clip_grad_norm_ by hand; returns (params, pre-clip norms)."""
    cfg = OmegaConf.create({"seed": 0, "model_args": {}})
    mf = load_model_file(str(model_path))
    params = {k: torch.tensor(v, requires_grad=True) for k, v in mf.model(cfg).items()}
    x, y = mf.data(cfg)
    opt = torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.9)
    norms = []
    for step in range(steps):
        idx = data.permutation(SAMPLES, 0, 0)[step * BATCH:(step + 1) * BATCH]
        opt.zero_grad()
        mf.forward(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]), params=params).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), clip)))
        opt.step()
    return {k: v.detach().numpy() for k, v in params.items()}, norms


@pytest.mark.parametrize("micro", ["null", 16])
def test_grad_clip_matches_clip_grad_norm(model_path, tmp_path, micro):
    clip = 0.05
    state, records = fit(model_path, tmp_path / "run", 3, f"trainer.grad_clip={clip}",
                         f"trainer.micro_batch_size={micro}")
    expected, norms = reference_clipped(model_path, clip, 3)
    assert min(norms) > 2 * clip  # clipping really happened on every step
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-5)
    for name, want in expected.items():
        np.testing.assert_allclose(state[name], want, rtol=0, atol=1e-6, err_msg=name)
    # ...and it is not the unclipped update
    unclipped, _ = reference_clipped(model_path, 1e9, 3)
    assert max(np.abs(unclipped[n] - expected[n]).max() for n in expected) > 1e-3


def test_grad_clip_above_the_norm_changes_nothing(model_path, runs, tmp_path):
    state, records = fit(model_path, tmp_path / "run", 3, "trainer.grad_clip=1000")
    whole, _ = runs["null", 3]
    for name in whole:
        np.testing.assert_allclose(state[name], whole[name], rtol=0, atol=1e-7, err_msg=name)
    assert all(0 < r["grad_norm"] < 1000 for r in records)
