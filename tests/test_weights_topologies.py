"""forward()'s ``weight`` under every way a step is cut and reduced: micro-batches over workers (padded per
micro-batch by a collate, on both backends), stage 2's reduce-scatter, parameter servers. tests/models/masked_tokens.py's reference is one worker with the
whole global batch as one micro-batch, where the weighted mean is the plain mean over the batch's tokens.
"""
from pathlib import Path

import pytest

from harness import assert_equivalent, metrics, train_in_process, train_ok

MODEL = Path(__file__).parent / "models" / "masked_tokens.py"
COMMON = ["trainer.global_batch_size=32", "trainer.max_steps=8", "trainer.log_every=1", "trainer.progress=false",
          "optimizer.lr=0.1", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5"]


@pytest.fixture(scope="module")
def whole_batch(one_worker):
    return one_worker(model=MODEL, common=COMMON, here=True)


# Micro-batches over workers on each backend: test_ragged_samples_padded_per_micro_batch_train_the_padded_model.
@pytest.mark.parametrize("how", [
    ["launcher.workers=3", "trainer.shard=gradients"],
    ["launcher.workers=3", "topology=parameter_server"],
], ids=["shard-gradients", "parameter-server"])
def test_a_weighted_step_is_the_token_mean_over_the_global_batch(tmp_path, whole_batch, how):
    train_ok(tmp_path, "trainer.micro_batch_size=5", *how, model=MODEL, common=COMMON)
    assert_equivalent(tmp_path, whole_batch)
    records = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["weight"] for r in records] == [r["weight"] for r in metrics(whole_batch) if "loss" in r]


def test_local_sgd_logs_the_global_batchs_token_mean(tmp_path, whole_batch):
    """Each replica's inner step is its own token mean; the logged loss of step 1 (every replica starting from the
    same parameters) is the global batch's, as one worker with the whole batch logs it, and so is its weight."""
    train_ok(tmp_path, "trainer.micro_batch_size=5", "launcher.workers=2", "topology=local_sgd", "trainer.max_steps=2",
             model=MODEL, common=COMMON)
    got, want = [r for r in metrics(tmp_path) if "loss" in r][0], [r for r in metrics(whole_batch) if "loss" in r][0]
    assert got["weight"] == want["weight"] and got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_weighted_by_samples_the_same_cut_is_another_model(tmp_path, whole_batch):
    train_ok(tmp_path, "trainer.micro_batch_size=5", "+model_args.weighted=0", model=MODEL, common=COMMON)
    with pytest.raises(AssertionError, match="relative difference"):
        assert_equivalent(tmp_path, whole_batch, records=False)


# ---------------------------------------------------------------- ragged samples, padded per micro-batch
RAGGED = Path(__file__).parent / "models" / "ragged_tokens.py"


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_ragged_samples_padded_per_micro_batch_train_the_padded_model(tmp_path, whole_batch, backend):
    """tests/models/ragged_tokens.py: the same sequences kept ragged, padded by collate() to each micro-batch's
    longest (shapes change every micro-batch), on two workers: masked_tokens.py's model, padded in full."""
    train_ok(tmp_path, "trainer.micro_batch_size=5", "launcher.workers=2", f"backend={backend}", model=RAGGED,
             common=COMMON)
    assert_equivalent(tmp_path, whole_batch)
    assert [r["weight"] for r in metrics(tmp_path) if "loss" in r] == \
        [r["weight"] for r in metrics(whole_batch) if "loss" in r]


RAGGED_HF = '''
import numpy as np, torch
from datasets import Dataset

def model(cfg):
    torch.manual_seed(0)
    return torch.nn.Embedding(10, 1)

def forward(ids, net):
    return net(ids).mean()

def data(cfg):
    return Dataset.from_dict({"ids": [[1, 2, 3], [4, 5], [6], [7, 8, 9, 1]] * 8})
'''


def test_a_ragged_column_without_collate_is_one_line_naming_the_column_and_the_fix(tmp_path):
    path = tmp_path / "ragged_hf.py"
    path.write_text(RAGGED_HF)
    out = train_in_process(path, tmp_path / "run", "trainer.global_batch_size=8", "trainer.max_steps=1")
    assert out.returncode != 0
    line = [x for x in out.stderr.splitlines() if x.startswith("error")]
    assert line == ["error: column 'ids' holds rows of different lengths (samples [0, 1])"], out.stderr
    assert "hint: define collate(samples) in the model file to pad each micro-batch" in out.stderr
    assert "Traceback" not in out.stderr
    # With a collate it trains.
    path.write_text(RAGGED_HF + '''
def collate(samples):
    longest = max(len(s["ids"]) for s in samples)
    return (np.array([s["ids"] + [0] * (longest - len(s["ids"])) for s in samples]),)
''')
    out = train_in_process(path, tmp_path / "run", "trainer.global_batch_size=8", "trainer.max_steps=2")
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------- mistakes, each one line
LINEAR = '''
import numpy as np, torch
from elasticflow import ops

def model(cfg):
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)

def data(cfg):
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 3)).astype(np.float32), rng.normal(size=(64, 1)).astype(np.float32)

def forward(x, y, net):
    loss = ((net(x) - y) ** 2).mean()
    return {WEIGHTED}
'''


@pytest.mark.parametrize("weighted,message", [
    ('{"loss": loss, "weight": 4} if ops.training() else loss',
     "forward() returned a 'weight' in a training micro-batch but not in the start-up probe"),
    ('{"loss": loss, "weight": -float(len(x))}', "forward()'s weights sum to -32 over the global batch of step 1"),
], ids=["only-in-training", "negative"])
def test_a_weight_that_cannot_be_divided_by_is_one_line(tmp_path, weighted, message):
    """A weight only in training would go unreduced (the probe runs in evaluation mode) and a negative total
    would reverse the update: both trained silently wrong before."""
    path = tmp_path / "weights.py"
    path.write_text(LINEAR.replace("{WEIGHTED}", weighted))
    out = train_in_process(path, tmp_path / "run", "trainer.global_batch_size=32", "trainer.max_steps=2")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {message}"), out.stderr
    assert out.returncode != 0 and "Traceback" not in out.stderr
