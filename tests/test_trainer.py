"""ElasticTrainer as a library: metrics.jsonl records, evaluation, the hand-written loop, fit()'s summary."""
import json

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.trainer import ElasticTrainer

CLASSIFIER = '''
import numpy as np
from elasticflow import ops


def model(cfg):
    return {"W": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}


def forward(x, y, params):
    logits = x @ params["W"] + params["b"]
    return {"loss": ops.cross_entropy(logits, y), "accuracy": ops.accuracy(logits, y)}


def _points(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2)).astype(np.float32)
    return x, (x[:, 0] > x[:, 1] + 0.3).astype(np.int64)


def data(cfg):
    return _points(120, 1)


def eval_data(cfg):
    return _points(50, 2)
'''


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trainer_for(path, run_dir, *overrides):
    cfg = compose(str(path), ["trainer.global_batch_size=32", "trainer.progress=false", "optimizer.lr=0.5",
                              *overrides])
    return ElasticTrainer(str(path), cfg, run_dir=str(run_dir))


def eval_by_hand(state, seed=2, n=50):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2)).astype(np.float32)
    y = (x[:, 0] > x[:, 1] + 0.3).astype(np.int64)
    logits = x.astype(np.float64) @ state["W"] + state["b"]
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -logp[np.arange(n), y].mean(), (logits.argmax(axis=1) == y).mean()


@pytest.fixture
def classifier(write_model):
    return write_model(CLASSIFIER)


def test_log_every_and_the_last_step(classifier, tmp_path):
    trainer_for(classifier, tmp_path, "trainer.max_steps=7", "trainer.log_every=3").fit()
    train = [r for r in records(tmp_path) if "loss" in r]
    assert [r["step"] for r in train] == [3, 6, 7]
    assert [r["samples_seen"] for r in train] == [96, 184, 216]  # 120 = 32 * 3 + 24 per epoch
    assert [r["epoch"] for r in train] == [0, 1, 1]
    assert all("accuracy" in r and 0 <= r["accuracy"] <= 1 for r in train)


def test_eval_every_writes_eval_records_with_the_right_numbers(classifier, tmp_path):
    summary = trainer_for(classifier, tmp_path, "trainer.max_steps=6", "trainer.log_every=1",
                          "trainer.eval_every=2", "checkpoint.interval.steps=2", "checkpoint.keep=null").fit()
    evals = [r for r in records(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    for r in evals:
        state = ckpt.load(next((tmp_path / "checkpoints").rglob(f"step_{r['step']}")))
        loss, accuracy = eval_by_hand(state)
        assert r["eval_loss"] == pytest.approx(loss, rel=1e-5)
        assert r["eval_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it learns
    assert summary["eval_loss"] == evals[-1]["eval_loss"] and summary["step"] == 6


def test_without_eval_every_it_evaluates_once_at_the_end(classifier, tmp_path):
    trainer_for(classifier, tmp_path, "trainer.max_steps=5", "trainer.micro_batch_size=7").fit()
    evals = [r for r in records(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [5]
    loss, accuracy = eval_by_hand(ckpt.load(ckpt.latest(tmp_path / "checkpoints")))
    assert evals[0]["eval_loss"] == pytest.approx(loss, rel=1e-5)  # 50 in chunks of 7: a weighted mean
    assert evals[0]["eval_accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_the_hand_written_loop_equals_fit(classifier, tmp_path):
    trainer_for(classifier, tmp_path / "fit", "trainer.max_steps=9").fit()
    trainer = trainer_for(classifier, tmp_path / "loop", "trainer.max_steps=9")
    trainer.prepare()
    seen_epochs = []
    for epoch in trainer.epoch_range():
        seen_epochs.append(epoch)
        with trainer.epoch(epoch):
            for batch in trainer.batches():
                with trainer.step():
                    trainer.train_step(batch)
    summary = trainer.finish()
    assert seen_epochs == [0, 1, 2] and summary["step"] == 9
    a = ckpt.load(ckpt.latest(tmp_path / "fit" / "checkpoints"))
    b = ckpt.load(ckpt.latest(tmp_path / "loop" / "checkpoints"))
    for name in ("W", "b"):
        assert np.array_equal(a[name], b[name])
    assert not np.array_equal(a["W"], np.zeros((2, 2), np.float32))


def test_fit_summary(classifier, tmp_path):
    summary = trainer_for(classifier, tmp_path, "trainer.epochs=2").fit()
    assert summary["step"] == 8 and summary["epochs_completed"] == 2 and summary["samples_seen"] == 240
    assert summary["checkpoint"] == str(ckpt.latest(tmp_path / "checkpoints"))
    assert ckpt.read_metadata(summary["checkpoint"])["step"] == 8
    assert np.isfinite(summary["loss"]) and "eval_accuracy" in summary


INF_AT_STEP_3 = '''
import numpy as np
from elasticflow import data as ef_data, ops


def model(cfg):
    return {"W": np.zeros((3, 1), np.float32)}


def forward(x, y, params):
    return ops.mse(x @ params["W"], y)


def data(cfg):
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    order = ef_data.permutation(64, cfg.seed, 0)
    x[next(int(i) for i in order[16:24] if i > 1), 1] = np.inf
    return x, x[:, :1] * 2
'''


def test_inf_loss_stops_with_an_error_naming_the_step(write_model, tmp_path):
    path = write_model(INF_AT_STEP_3)
    trainer = trainer_for(path, tmp_path, "trainer.global_batch_size=8", "trainer.log_every=1")
    with pytest.raises(ElasticFlowError, match=r"loss is inf at step 3 \(epoch 0\)") as info:
        trainer.fit()
    assert info.value.exit_code == 1 and "on_nonfinite=skip" in info.value.hint
    assert trainer.step_count == 2
    assert [r["step"] for r in records(tmp_path)] == [1, 2]


def test_data_must_hold_one_global_batch(classifier, tmp_path):
    with pytest.raises(ElasticFlowError, match="120 samples, fewer than one global batch of 121"):
        trainer_for(classifier, tmp_path, "trainer.global_batch_size=121").prepare()


def test_two_workers_write_each_record_once_in_step_order_with_evaluations_after_their_step(tmp_path):
    # With workers, rank 0 writes a step's record during the next step's reduction; an evaluation, a
    # checkpoint and the end write it first, so the file still reads in the order things happened.
    from harness import REPO, metrics, train

    train(REPO / "models" / "digits_mlp.py", tmp_path, "launcher.workers=2", "trainer.max_steps=9",
          "trainer.log_every=1", "trainer.eval_every=4", "trainer.global_batch_size=64")
    got = [("eval", r["step"]) if "eval_loss" in r else ("step", r["step"]) for r in metrics(tmp_path)]
    want = [("step", s) for s in range(1, 10)]
    want[4:4] = [("eval", 4)]
    want[9:9] = [("eval", 8)]
    assert got == want + [("eval", 9)]
