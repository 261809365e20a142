"""trainer.loggers beyond TensorBoard: csv, mlflow and wandb (offline), from a real 3-worker run with a worker
killed, each read back through its own library or format; a resumed run continues each tracker's run."""
import csv
import glob
import json
import struct

from harness import COMMON, finish, metrics, start

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

    # A resume to step 80 continues the same MLflow run, the same W&B run id and the same CSV.
    again = start(run, "launcher.workers=2", LOGGERS, common=[*COMMON, "trainer.max_steps=80"])
    out = finish(again)
    assert again.returncode == 0, out[-3000:]
    found = mlflow.search_runs(experiment_names=["elasticflow"], output_format="list")
    assert [r.info.run_id for r in found] == [run_id]
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(1, 81))
    files = sorted(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and len({f.rsplit("run-", 1)[1] for f in files}) == 1  # two jobs, one W&B run id
    assert [row["_step"] for row in _wandb_history(files[1]) if "train/loss" in row] == list(range(61, 81))
    with open(run / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r["train/loss"]] == list(range(1, 81))


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
