"""A worker process as a model file meets it: user code and libraries log at any moment of start-up, in
every worker, and nothing fails; `status` of the job once it ended."""
from __future__ import annotations

import pytest

from harness import run_cli, train

# Logs at import, in model() and in data() (INFO and WARNING), before this worker has a rank, and uses a
# Hugging Face datasets.Dataset, whose import logs at INFO. Before, the console's rank filter read the
# trainer's rank before the replica existed: AttributeError, and every worker of a 2-worker run died.
LOGGING = '''
import logging

import numpy as np
from elasticflow import ops

log = logging.getLogger("mylib")
log.info("mylib: imported")


def model(cfg):
    log.info("mylib: building the model")
    return {"W": np.zeros((4, 1), np.float32)}


def forward(x, y, params):
    return ops.mse(x @ params["W"], y)


def data(cfg):
    log.info("mylib: loading data")
    log.warning("mylib: a warning from data()")
    import datasets

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return datasets.Dataset.from_dict({"x": x, "y": x[:, :1] * 2})
'''


@pytest.mark.timeout(120)
def test_a_data_function_that_logs_and_imports_datasets_trains_on_two_workers(write_model, tmp_path):
    pytest.importorskip("datasets")
    run = tmp_path / "run"
    proc = train(write_model(LOGGING), run, "launcher.workers=2", "trainer.max_steps=3",
                 "trainer.global_batch_size=16", timeout=120)
    assert proc.returncode == 0 and "done: step=3" in proc.stdout
    # Info before a rank exists shows once (worker 0's, the first generation's rank 0); warnings from each.
    assert proc.stderr.count("mylib: loading data") == 1 and proc.stderr.count("mylib: imported") == 1
    assert proc.stderr.count("mylib: a warning from data()") == 2
    for worker in (0, 1):  # every line is in each worker's own log
        assert "mylib: building the model" in (run / "logs" / f"worker-{worker}.log").read_text()
    # train.log holds what the console showed (it once held the agent's one line): rank 0's, once, and warnings
    shown = (run / "train.log").read_text()
    assert shown.count("mylib: loading data") == 1 and shown.count("mylib: a warning from data()") == 2, shown
    assert shown.count("][INFO] step 3/3 epoch") == 1 and "elasticflow | backend torch" in shown, shown

    # `status` of the ended job: its members finished (it listed them as still training).
    lines = run_cli(["status", run], check=True).stdout.splitlines()
    assert lines[0].endswith(": not running")
    members = lines[lines.index(next(line for line in lines if line.strip().startswith("rank"))) + 1:][:2]
    assert [line.split()[-1] for line in members] == ["finished", "finished"], lines
