"""RUN_DIR/tensorboard/, read back with TensorBoard's own reader (EventAccumulator)."""
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness import ELASTICFLOW, metrics, train

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

PROBE = Path(__file__).parent / "models" / "digits_probe.py"


def board(run: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_equal_the_metrics_records(tmp_path):
    run = tmp_path / "run"
    train("digits_mlp.py", run, "trainer.max_steps=25", "trainer.log_every=5", "trainer.eval_every=10",
          "trainer.grad_clip=5.0")
    acc = board(run)
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/accuracy", "train/grad_norm", "train/skipped", "speed/samples_per_s",
            "speed/step_time_s", "elastic/world_size", "elastic/generation", "eval/loss",
            "eval/accuracy", "memory/worker_0_mib"} <= tags, tags
    assert all(e.value > 50 for e in acc.Scalars("memory/worker_0_mib"))  # a process with torch loaded: MiB
    steps = [r for r in metrics(run) if "loss" in r]
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in steps] == [5, 10, 15, 20, 25]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in steps], rtol=1e-6)
    evals = [r for r in metrics(run) if "eval_loss" in r]
    assert [e.step for e in acc.Scalars("eval/loss")] == [r["step"] for r in evals] and evals
    assert {e.value for e in acc.Scalars("elastic/world_size")} == {1.0}


def test_off_writes_nothing(tmp_path):
    run = tmp_path / "run"
    train("digits_mlp.py", run, "trainer.max_steps=5", "trainer.loggers=[]")
    assert not (run / "tensorboard").exists()


def test_a_kill_shows_as_a_membership_event_and_the_world_size_drops(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(ELASTICFLOW + ["train", str(PROBE), f"hydra.run.dir={run}", "trainer.progress=false",
                                         "trainer.max_steps=40", "trainer.log_every=1", "launcher.workers=3",
                                         "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5"],
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "EF_PROBE_KILL": "1:15:forward",
                               "EF_PROBE_SLEEP": "0.05"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = board(run)
    world = {e.step: e.value for e in acc.Scalars("elastic/world_size")}
    assert world[1] == 3.0 and world[40] == 2.0
    left = acc.Tensors("events/left")
    assert left and b"left" in left[0].tensor_proto.string_val[0]
    assert "events/recovered" in acc.Tags()["tensors"]
    # Each worker's resident memory, by worker id: worker 1's series ends at the kill, the others go on.
    memory = {w: acc.Scalars(f"memory/worker_{w}_mib") for w in (0, 1, 2)}
    assert all(e.value > 50 for series in memory.values() for e in series)
    assert max(e.step for e in memory[1]) < 16 and max(e.step for e in memory[0]) == max(e.step for e in memory[2]) == 40


def test_the_sidecar_follows_below_the_trainers_priority_and_ends_at_it(tmp_path):
    # On a machine whose cores the workers fill, the follower thread must not take their time slices; the
    # process (its opening and its last drain, issue 68) stays at the trainer's priority.
    import sys
    import time

    def nice(stat: str) -> int:
        with open(stat) as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])

    proc = subprocess.Popen([sys.executable, "-m", "elasticflow.observability.sidecar", str(tmp_path), "--parent",
                             str(os.getpid())], stdin=subprocess.PIPE)
    try:
        deadline, niced = time.monotonic() + 60, []
        while not niced and time.monotonic() < deadline:  # the follower thread, once it has set its nice value
            time.sleep(0.05)
            niced = [t for t in os.listdir(f"/proc/{proc.pid}/task")
                     if nice(f"/proc/{proc.pid}/task/{t}/stat") == os.nice(0) + 10]
        assert niced and nice(f"/proc/{proc.pid}/stat") == os.nice(0)
    finally:
        proc.stdin.close()
        proc.wait(30)


def test_the_sidecar_exits_quietly_when_its_run_directory_is_removed(tmp_path):
    # A run in a temporary directory (a notebook, a benchmark) may remove it while the follower polls.
    import shutil
    import sys
    import time

    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "elasticflow.observability.sidecar", str(run), "--parent",
                             str(os.getpid())], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (run / ".elasticflow" / "trackers.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5, "time": 1.0}\n')
        shutil.rmtree(run)
        assert proc.wait(30) == 0
        assert proc.stderr.read().decode() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
