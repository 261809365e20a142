"""Every example in models/ reaches the result its docstring promises, through the real CLI.

The commands are the ones the docstrings document, plus ``backend.threads=1``: these models are too
small to gain from a second thread, and on a busy machine intra-op threads that spin waiting for a
core multiplied the run time (the transformer run took 200 s instead of 6 s at load 8 on 2 cores).
The thresholds leave room for thread-count and platform noise but fail if a model stops learning.
"""
import importlib.util

from harness import MODELS, losses, metrics
from harness import train as _train


def train(model, run_dir, *overrides):
    return _train(model, run_dir, "backend.threads=1", *overrides)


def _final_eval(run_dir):
    records = [r for r in metrics(run_dir) if "eval_loss" in r]
    assert records, f"no eval record in {run_dir / 'metrics.jsonl'}"
    return records[-1]


def _train_records(run_dir):
    return [r for r in metrics(run_dir) if "loss" in r]


def test_linear_reaches_the_noise_floor(tmp_path):
    run = tmp_path / "run"
    train("linear.py", run, "trainer.max_steps=200")
    assert losses(run)[-1] < 0.02  # the noise floor is 0.1**2 = 0.01


def test_digits_mlp_reaches_90_percent(tmp_path):
    run = tmp_path / "run"
    proc = train("digits_mlp.py", run, "trainer.epochs=10")
    final = _final_eval(run)
    assert final["step"] == 230  # 10 epochs of ceil(1437 / 64) steps
    assert final["eval_accuracy"] >= 0.9, final
    assert "eval_accuracy=" in proc.stdout  # the `done:` summary shows the result


def test_the_digits_are_scikit_learns_without_importing_it():
    """models/_digits.py reads the CSV file sklearn ships instead of importing sklearn (~1.5 s a process)."""
    import subprocess
    import sys

    import numpy as np
    from sklearn.datasets import load_digits

    spec = importlib.util.spec_from_file_location("_digits", MODELS / "_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data, target = module._load_digits()
    digits = load_digits()
    assert np.array_equal(data, digits.data) and data.dtype == digits.data.dtype
    assert np.array_equal(target, digits.target)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import _digits; _digits.train_split(); "
             "print('sklearn' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe, str(MODELS)], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_digits_cnn_reaches_90_percent(tmp_path):
    run = tmp_path / "run"
    train("digits_cnn.py", run, "trainer.epochs=10")
    final = _final_eval(run)
    assert final["step"] == 230
    assert final["eval_accuracy"] >= 0.9, final


def test_char_transformer_beats_the_unigram_model(tmp_path):
    spec = importlib.util.spec_from_file_location("char_transformer_for_test", MODELS / "char_transformer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    unigram = module.unigram_entropy()  # 2.88 nats: what a model that ignores the context can reach
    run = tmp_path / "run"
    train("char_transformer.py", run, "trainer.epochs=4")
    records = _train_records(run)
    assert records[-1]["step"] == 216  # 4 epochs of ceil(3426 / 64) steps
    assert records[-1]["loss"] < 1.6 < unigram, records[-1]
    assert _final_eval(run)["eval_loss"] < unigram - 0.6  # held-out text: it generalises, not only memorises
