"""Where a run's metrics and events go besides metrics.jsonl and events.jsonl: ``trainer.loggers``.

    tensorboard  RUN_DIR/tensorboard/ (scalars, and the membership events as text)
    csv          RUN_DIR/metrics.csv, one row per logged step or evaluation (Lightning's CSVLogger's layout)
    mlflow       an MLflow run: $MLFLOW_TRACKING_URI, else a sqlite store at RUN_DIR/mlflow.db
    wandb        a Weights & Biases run under RUN_DIR/wandb/, offline unless $WANDB_MODE says otherwise

Each is written by the sidecar (observability/sidecar.py) from the run's own records, never by the training
thread, and each library is imported only when named. Every tracker records the config as parameters (its
``optimizer.*`` replaced by the optimizer and schedule that train: ``optim.summary``), each
step's scalars by step (loss, lr, eval metrics, samples/s, world size, generation, memory), and the elastic
events (a worker left or joined, a recovery and what it cost) as metrics under ``event/<kind>/<field>``.

A resumed run, or a new rank 0 after a kill, continues the same tracker run: its id is kept in
RUN_DIR/.elasticflow/ (``mlflow_run``, ``wandb_run``; MLflow's store in ``mlflow_uri``).
"""
from __future__ import annotations

import csv
import os
import secrets
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

from .._util.fileio import write_atomic

INSTALL = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


class Tracker:
    """One destination. ``scalars`` takes a step's numbers; ``event`` one membership event's fields.

    ``durable``: what ``flush`` returned from is kept, even if the sidecar is killed next; where not, a record
    counts as had only once ``close`` returned (the backlog's offsets: observability/backlog.py)."""

    name = ""
    durable = True

    def scalars(self, step: int, values: Dict[str, float], wall: float) -> None:
        raise NotImplementedError

    def event(self, step: int, kind: str, fields: Dict[str, Any], wall: float) -> None:
        numbers = {f"event/{kind}/{k}": float(v) for k, v in fields.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.scalars(step, {f"event/{kind}/count": 1.0, **numbers}, wall)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_trackers(names: List[str], run_dir: Path, params: Dict[str, Any]) -> List[Tracker]:
    """The trackers of ``names`` for ``run_dir``; one whose library is missing, or that cannot start (a server
    that refuses), is left out with a warning (what it misses is listed in the run's backlog: backlog.py)."""
    out = []
    for name in names:
        try:
            out.append({"tensorboard": TensorBoardTracker, "csv": CsvTracker, "mlflow": MlflowTracker,
                        "wandb": WandbTracker}[name](Path(run_dir), params))
        except ImportError:
            print(f"warning: trainer.loggers names {name}, which is not installed: nothing is written to it "
                  f"(pip install {INSTALL[name]}, or leave {name} out of trainer.loggers)", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - one tracker that cannot start is not the others' end
            print(f"warning: the {name} logger could not start ({type(exc).__name__}: {str(exc)[:300]}): nothing is "
                  f"written to it in this job (`elasticflow sync RUN_DIR` hands it the run's records later)",
                  file=sys.stderr)
    return out


def params_of(cfg: Any, optimizer: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The config as flat ``{"optimizer.lr": 0.1, ...}``, what trackers record as a run's parameters.

    ``optimizer``: the optimizer that trains (``optim.summary``), which replaces the config's ``optimizer.*``:
    where model() gives the optimizer, the config group's settings (sgd, lr 0.1) never train and are not shown."""
    from omegaconf import OmegaConf

    out: Dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node if isinstance(node, (int, float, str, bool)) or node is None else str(node)

    walk(OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg), "")
    if optimizer:
        out = {k: v for k, v in out.items() if not k.startswith("optimizer.")}
        for k, v in optimizer.items():
            out[f"optimizer.{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


def _kept(run_dir: Path, name: str) -> Optional[str]:
    try:
        return (run_dir / ".elasticflow" / name).read_text().strip() or None
    except OSError:
        return None


def _without_password(uri: str) -> str:
    """``uri`` without the user and password of ``https://user:secret@host`` (MLflow takes those from
    $MLFLOW_TRACKING_USERNAME and $MLFLOW_TRACKING_PASSWORD as well)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def _run_id(run_dir: Path, name: str, new) -> str:
    """The id of this run's tracker run, kept in RUN_DIR/.elasticflow/<name>: a resume continues it."""
    path = run_dir / ".elasticflow" / name
    try:
        return path.read_text().strip()
    except OSError:
        run_id = new()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, run_id)
        return run_id


# ---------------------------------------------------------------------------------------------- TensorBoard
class TensorBoardTracker(Tracker):
    """TensorBoard's own ``EventFileWriter`` and protos (no torch or TF summary API: both backends log alike)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, params: Dict[str, Any]):
        # Without this module TensorBoard imports TensorFlow for its file API (2-3 s, ~500 MB) in a torch run.
        if "tensorflow" not in sys.modules:
            sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.dir = run_dir / "tensorboard"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(self.dir), filename_suffix=f".{os.getpid()}")

    def scalars(self, step: int, values: Dict[str, float], wall: float) -> None:
        self.writer.add_event(_scalar_event(step, values, wall))

    def event(self, step: int, kind: str, fields: Dict[str, Any], wall: float) -> None:
        text = ", ".join(f"{k}={v}" for k, v in fields.items())
        self.writer.add_event(_text_event(step, f"events/{kind}", f"{kind}: {text}", wall))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _scalar_event(step: int, values: Dict[str, float], wall: float):
    from tensorboard.compat.proto import event_pb2, summary_pb2

    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
    return event_pb2.Event(wall_time=wall, step=step, summary=summary)


def _text_event(step: int, tag: str, text: str, wall: float):
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

    # The text plugin's format: a string tensor with the plugin named in the metadata.
    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()],
                                    tensor_shape=tensor_shape_pb2.TensorShapeProto(
                                        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)])
    return event_pb2.Event(wall_time=wall, step=step, summary=summary)


# ---------------------------------------------------------------------------------------------- CSV
class CsvTracker(Tracker):
    """RUN_DIR/metrics.csv: a ``step`` and ``time`` column, then one per metric, in the order first seen. A
    metric first seen later (the first evaluation's) rewrites the file with the wider header, as Lightning's
    CSVLogger does; membership events are left to events.jsonl. A row already in the file (same step, time and
    metrics: records handed on again after a sidecar was cut off between its flush and saving how far it was)
    is skipped."""

    name = "csv"

    def __init__(self, run_dir: Path, params: Dict[str, Any]):
        self.path = run_dir / "metrics.csv"
        self.rows: List[Dict[str, Any]] = []
        self.columns: List[str] = ["step", "time"]
        if self.path.is_file():  # a resumed run goes on in the same file
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or self.columns)
                self.rows = list(reader)
        self._have = {_row_key(row) for row in self.rows}
        self._pending: List[Dict[str, Any]] = []
        self._widened = False

    def scalars(self, step: int, values: Dict[str, float], wall: float) -> None:
        key = _row_key({"step": step, "time": round(wall, 3), **values})
        if key in self._have:
            return
        self._have.add(key)
        new = [k for k in values if k not in self.columns]
        if new:
            self.columns += new
            self._widened = True
        row = {"step": step, "time": round(wall, 3), **values}
        self.rows.append(row)
        self._pending.append(row)

    def event(self, step: int, kind: str, fields: Dict[str, Any], wall: float) -> None:
        pass

    def flush(self) -> None:
        if self._widened or not self.path.is_file():
            with open(self.path, "w", newline="") as f:
                writer = csv.DictWriter(f, self.columns)
                writer.writeheader()
                writer.writerows(self.rows)
        elif self._pending:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.columns).writerows(self._pending)
        self._pending, self._widened = [], False


def _row_key(row: Dict[str, Any]) -> tuple:
    """A row by its step, time and the metrics it has (an evaluation may share a step's millisecond)."""
    return (str(row.get("step")), str(row.get("time")),
            frozenset(k for k, v in row.items() if k not in ("step", "time") and v not in ("", None)))


# ---------------------------------------------------------------------------------------------- MLflow
class MlflowTracker(Tracker):
    """An MLflow run in experiment ``elasticflow`` ($MLFLOW_EXPERIMENT_NAME), named after the run directory."""

    name = "mlflow"

    def __init__(self, run_dir: Path, params: Dict[str, Any]):
        import mlflow
        from mlflow.tracking import MlflowClient

        # The store this run's MLflow run is in, kept (without a password the URI may carry: a file in the run
        # directory is no place for one): `elasticflow sync` from a shell without the variable finds it.
        uri = os.environ.get("MLFLOW_TRACKING_URI") or _kept(run_dir, "mlflow_uri") \
            or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        _run_id(run_dir, "mlflow_uri", lambda: _without_password(uri))
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "elasticflow")
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = _run_id(run_dir, "mlflow_run", lambda: self.client.create_run(
            experiment_id, run_name=run_dir.name, tags={"elasticflow.run_dir": str(run_dir)}).info.run_id)
        self.client.update_run(self.run_id, status="RUNNING")
        self._params(params)
        self._mlflow, self.batch = mlflow, []

    def _params(self, params: Dict[str, Any]) -> None:
        logged = self.client.get_run(self.run_id).data.params
        from mlflow.entities import Param

        fresh = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in logged]
        for i in range(0, len(fresh), 100):  # the store takes 100 params a batch
            self.client.log_batch(self.run_id, params=fresh[i:i + 100])

    def scalars(self, step: int, values: Dict[str, float], wall: float) -> None:
        from mlflow.entities import Metric

        self.batch += [Metric(k, v, int(wall * 1000), step) for k, v in values.items()]

    def flush(self) -> None:
        while self.batch:  # up to 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=self.batch[:1000])
            self.batch = self.batch[1000:]

    def close(self) -> None:
        self.flush()
        self.client.update_run(self.run_id, status="FINISHED")


# ---------------------------------------------------------------------------------------------- W&B
class WandbTracker(Tracker):
    """A W&B run in project ``elasticflow`` ($WANDB_PROJECT), offline by default: nothing leaves the machine
    and no API key is needed (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later)."""

    name = "wandb"
    # W&B's own process writes its file after log() returns, and holds a step's row open until a later step:
    # a sidecar killed at trainer.loggers_wait_s lost the last ~45 of 2,000 steps it had handed on (tried).
    # finish() (close) writes everything: only then does W&B count as having the records.
    durable = False

    def __init__(self, run_dir: Path, params: Dict[str, Any]):
        import wandb

        run_id = _run_id(run_dir, "wandb_run", lambda: secrets.token_hex(4))
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "elasticflow"), dir=str(run_dir),
                              id=run_id, resume="allow", name=run_dir.name, config=params,
                              mode=os.environ.get("WANDB_MODE", "offline"), settings=wandb.Settings(silent=True))
        self.step: Optional[int] = None

    def scalars(self, step: int, values: Dict[str, float], wall: float) -> None:
        step = max(step, self.step or 0)  # W&B takes steps in order only: an event lands on the newest step
        self.run.log(values, step=step)
        self.step = step

    def close(self) -> None:
        self.run.finish()
