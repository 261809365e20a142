"""trainer.loggers beyond TensorBoard: csv, mlflow and wandb (offline), from a real 3-worker run with a worker
killed, each read back through its own library or format; a resumed run continues each tracker's run; a run
whose end cuts the trackers off says so, and `elasticflow sync` (or the next start) catches them up."""
import csv
import glob
import json
import os
import struct
import subprocess
import sys

from elasticflow.observability import backlog
from harness import COMMON, finish, held, logged_step, metrics, reap, run_cli, start, wait_for

LOGGERS = "trainer.loggers=[tensorboard,csv,mlflow,wandb]"


def _wandb_history(path: str) -> list:
    """The history rows of a W&B offline run file (``run-<id>.wandb``): LevelDB's log format (32 KiB blocks of
    records, each a 7-byte header: checksum, length, kind) holding wandb_internal_pb2.Record messages, after a
    7-byte ``:W&B`` file header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    rows, at, block, parts = [], 7, 32768, b""
    while at + 7 <= len(data):
        left = block - at % block
        if left < 7:  # a block's tail too short for a header is padding
            at += left
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        if kind == 0 and length == 0:
            at += left
            continue
        parts += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_csv_mlflow_and_wandb_get_every_step_the_world_size_and_the_events_and_a_resume_continues(tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    proc = start(run, "launcher.workers=3", LOGGERS, env={"EF_PROBE_KILL": "1:15:forward"})
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    steps = {r["step"]: r for r in metrics(run) if "loss" in r}
    assert sorted(steps) == list(range(1, 61)) and {r["world_size"] for r in steps.values()} == {3, 2}

    # MLflow: the sqlite store in the run directory, read back as MLflow's users do.
    mlflow.set_tracking_uri(f"sqlite:///{run / 'mlflow.db'}")
    found = mlflow.search_runs(experiment_names=["elasticflow"], output_format="list")
    assert len(found) == 1 and found[0].info.status == "FINISHED" and found[0].info.run_name == "run"
    client, run_id = MlflowClient(), found[0].info.run_id
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert losses == {s: float(r["loss"]) for s, r in steps.items()}  # every logged step's loss, as logged
    world = {m.step: m.value for m in client.get_metric_history(run_id, "elastic/world_size")}
    assert world == {s: float(r["world_size"]) for s, r in steps.items()}
    assert found[0].data.params["optimizer.lr"] == "0.1" and found[0].data.params["launcher.workers"] == "3"
    assert client.get_metric_history(run_id, "event/left/count")
    assert "event/recovered/recovery_s" in found[0].data.metrics

    # CSV: one row per logged step and evaluation, Lightning's layout.
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["train/loss"]] == list(range(1, 61))
    assert float(rows[0]["train/loss"]) == steps[1]["loss"] and "elastic/world_size" in rows[0]

    # W&B, offline: the run file parsed, every step's loss and the world size by step.
    files = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    history = [row for row in _wandb_history(files[0]) if "train/loss" in row]
    assert [row["_step"] for row in history] == list(range(1, 61))
    assert [row["elastic/world_size"] for row in history] == [steps[s]["world_size"] for s in range(1, 61)]

    # A resume to step 80 continues the same MLflow run, the same W&B run id and the same CSV; issue 68: its steps
    # and its end run on a loaded machine (twice as many busy processes as cores, from once the trackers are
    # open), and every step still reaches each tracker: the end's bounded wait catches up, or a warning lists
    # what is behind and `elasticflow sync` catches it up.
    limit, offsets = tmp_path / "limit", run / ".elasticflow" / "trackers.json"
    limit.write_text("62")  # step 61 starts the sidecar (rank 0's first record); the next one waits for the load
    before = offsets.stat().st_ino
    again = start(run, "launcher.workers=2", LOGGERS, common=[*COMMON, "trainer.max_steps=80"],
                  env={"EF_PROBE_LIMIT": str(limit)})
    hogs = []
    try:  # the sidecar saves how far it is (a new file) once it has opened the trackers and handed a batch on
        wait_for(lambda: len(held(limit)) == 2 and logged_step(run) == 61 and offsets.stat().st_ino != before, 120,
                 "the workers at step 62 and the trackers open", proc=again)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(len(os.sched_getaffinity(0)))]  # one per core: the other tests beside it still run
        limit.unlink()
        out = finish(again)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        reap(again)
    assert again.returncode == 0, out[-3000:]
    if "warning: the trackers are behind this run" in out:
        assert f"elasticflow sync {run}" in out, out[-3000:]
        synced = run_cli(["sync", run], timeout=120, check=True)
        assert "synced: " in synced.stdout, synced.stdout
    assert not (run / "trackers-backlog.json").exists(), out[-3000:]
    found = mlflow.search_runs(experiment_names=["elasticflow"], output_format="list")
    assert [r.info.run_id for r in found] == [run_id]
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(1, 81))
    files = sorted(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) >= 2 and len({f.rsplit("run-", 1)[1] for f in files}) == 1  # two jobs (and a sync), one id
    resumed = [row["_step"] for f in files[1:] for row in _wandb_history(f) if "train/loss" in row]
    # (After a sync W&B may hold a step twice: it counts records as had only once its run is finished.)
    assert resumed == list(range(61, 81)) or len(files) > 2 and sorted(set(resumed)) == list(range(61, 81))
    with open(run / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r["train/loss"]] == list(range(1, 81))

    # Issue 68 item 9: a job whose end cuts the trackers off (a bound of 0 s: deterministic, as a loaded machine
    # or a slow server is not) warns and lists what they lack; `elasticflow sync` hands them every step.
    cut = start(run, "launcher.workers=1", "trainer.loggers=[csv,mlflow,wandb]", "trainer.loggers_wait_s=0",
                common=[*COMMON, "trainer.max_steps=90"])
    out = finish(cut)
    assert cut.returncode == 0, out[-3000:]
    assert "warning: the trackers are behind this run (cut off after trainer.loggers_wait_s=0 s)" in out, out[-3000:]
    assert f"elasticflow sync {run}" in out
    listed = json.loads((run / "trackers-backlog.json").read_text())
    assert set(listed["trackers"]) == {"csv", "mlflow", "wandb"} and listed["trackers"]["mlflow"]["of"] > 90
    synced = run_cli(["sync", run], timeout=120, check=True)
    assert "synced: CSV has all" in synced.stdout and "MLflow has all" in synced.stdout, synced.stdout
    assert "W&B has all" in synced.stdout, synced.stdout
    assert not (run / "trackers-backlog.json").exists()
    found = mlflow.search_runs(experiment_names=["elasticflow"], output_format="list")
    assert [(r.info.run_id, r.info.status) for r in found] == [(run_id, "FINISHED")]
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert losses == {r["step"]: float(r["loss"]) for r in metrics(run) if "loss" in r}
    assert sorted(losses) == list(range(1, 91))
    with open(run / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r["train/loss"]] == list(range(1, 91))
    from elasticflow.observability.backlog import behind

    files = sorted(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert {row["_step"] for f in files for row in _wandb_history(f) if "train/loss" in row} == set(range(1, 91))
    assert behind(run, ["csv", "mlflow", "wandb"]) == {}  # a second `sync` has nothing to do


def test_the_trackers_params_name_the_optimizer_that_trains_not_the_configs_defaults():
    """model() gave AdamW 3e-3 with a cosine schedule: optimizer.* is that optimizer's (MLflow and W&B take
    these params), and none of the config group's unused sgd settings is left beside it."""
    import torch

    from elasticflow import optim
    from elasticflow.backends.torch.optim import spec_from_native
    from elasticflow.config.schema import compose
    from elasticflow.observability.trackers import params_of
    from harness import PROBE

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-3)
    spec = optim.with_schedule(spec_from_native(opt), optim.Schedule("cosine", warmup_steps=20))
    params = params_of(compose(str(PROBE), []), optim.summary(spec, from_model=True))
    assert {k: v for k, v in params.items() if k.startswith("optimizer.")} == {
        "optimizer.name": "adamw", "optimizer.lr": 3e-3, "optimizer.weight_decay": 0.01,
        "optimizer.betas": "[0.9, 0.999]", "optimizer.eps": 1e-8, "optimizer.schedule": "cosine",
        "optimizer.warmup_steps": 20, "optimizer.warmup_from_zero": False, "optimizer.decay_steps": None,
        "optimizer.min_lr": 0.0, "optimizer.schedule_detail": "cosine(warmup_steps=20, decay_steps=all, min_lr=0)",
        "optimizer.groups": "[{'lr': 0.003, 'weight_decay': 0.01}]", "optimizer.source": "model file"}
    assert params["launcher.workers"] == 1  # the rest of the config as it was


def _records(run, steps: int = 3) -> None:
    """metrics.jsonl and events.jsonl of a short run, written by hand."""
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 1.0 / s, "time": 1.8e9 + s, "step_time_s": 0.1, "global_batch": 64, "world_size": 1})
        + "\n" for s in range(1, steps + 1)))
    (run / "events.jsonl").write_text(json.dumps({"event": "ready", "time": 1.8e9, "step": 0}) + "\n")


def test_the_end_waits_with_a_progress_line_then_lists_what_the_trackers_lack(tmp_path, monkeypatch, capsys):
    """A sidecar that does not catch up (a stand-in that never exits) is waited for at most trainer.loggers_wait_s,
    with a progress line; then cut off, and what MLflow lacks is written down with a warning that says how to
    catch it up."""
    import subprocess
    import sys

    from elasticflow.observability import sidecar

    _records(tmp_path)
    monkeypatch.setattr(sidecar, "SAY_AFTER_S", 0.0)
    board = sidecar.Sidecar(tmp_path, ["mlflow"])
    board.wait_s = 0.3
    stuck = board.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                          stdin=subprocess.PIPE)
    board.close()
    assert stuck.returncode is not None and board.proc is None
    err = capsys.readouterr().err
    assert "waiting for MLflow to catch up: 0 of 4 records (at most 0 s more: trainer.loggers_wait_s)" in err, err
    assert ("warning: the trackers are behind this run (cut off after trainer.loggers_wait_s=0.3 s): MLflow has 0 "
            f"of 4 records. Nothing is lost") in err and f"elasticflow sync {tmp_path}" in err
    listed = json.loads((tmp_path / "trackers-backlog.json").read_text())
    assert listed["trackers"] == {"mlflow": {"records": 0, "of": 4, "closed": False}}


def test_a_tracker_that_fails_keeps_its_place_and_the_next_start_catches_it_up(tmp_path, capsys):
    """A tracker that fails is given nothing more, and its place stays where its last flush succeeded (the others
    go on); the next start of the run warns, catches it up and removes the backlog."""
    from elasticflow.observability import backlog
    from elasticflow.observability.sidecar import Sidecar, _Follower
    from elasticflow.observability.trackers import Tracker

    class Failing(Tracker):
        name = "csv"  # the CSV tracker, as a full disk would leave it

        def scalars(self, step, values, wall):
            pass

        def flush(self):
            raise OSError("No space left on device")

    _records(tmp_path)
    follower = _Follower(tmp_path, [Failing()])
    follower.poll()
    follower.close()
    assert "warning: the csv logger failed (OSError: No space left on device)" in capsys.readouterr().err
    assert backlog.read_offsets(tmp_path) == {"csv": {"metrics": 0, "events": 0, "closed": False}}
    assert backlog.settle(tmp_path, ["csv"], "a tracker failed").startswith("warning: the trackers are behind")
    assert backlog.pending(tmp_path) == ["csv"]

    board = Sidecar(tmp_path, ["csv"])  # the next job's rank 0
    board.start()
    board.close()
    err = capsys.readouterr().err
    assert "warning: CSV did not have every record when this run last stopped" in err and "catching up now" in err
    assert not (tmp_path / "trackers-backlog.json").exists() and "behind" not in err, err
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3]


def test_sync_refuses_bad_input_and_a_live_run_in_one_line(tmp_path):
    import pytest

    from elasticflow.errors import ElasticFlowError
    from elasticflow.observability import sidecar
    from harness import cli

    proc = cli(["sync", tmp_path / "nope"])
    assert proc.returncode == 2 and "is not a run directory (no metrics.jsonl)" in proc.stderr
    assert "hint: pass the run's hydra.run.dir" in proc.stderr and "Traceback" not in proc.stderr
    _records(tmp_path)
    held = sidecar._lock(tmp_path, wait=False)  # what the run's own sidecar holds while it writes
    try:
        with pytest.raises(ElasticFlowError, match="is writing its trackers now"):
            sidecar.sync(tmp_path)
    finally:
        os.close(held)


def test_a_tracker_that_writes_later_counts_its_records_only_once_closed(tmp_path):
    """W&B's own process writes its file after log() returns (a sidecar killed at the bound lost the last steps it
    had handed on): a tracker not ``durable`` has had nothing until its close, so a cut lists it in the backlog."""
    from elasticflow.observability import backlog
    from elasticflow.observability.sidecar import _Follower
    from elasticflow.observability.trackers import Tracker, WandbTracker

    class Later(Tracker):
        name, durable = "wandb", False

        def scalars(self, step, values, wall):
            pass

    assert WandbTracker.durable is False
    _records(tmp_path)
    follower = _Follower(tmp_path, [Later()])
    follower.poll()
    assert backlog.behind(tmp_path, ["wandb"]) == {"wandb": (0, 4, False)}  # a sidecar cut off here: all listed
    follower.close()
    assert backlog.behind(tmp_path, ["wandb"]) == {}
