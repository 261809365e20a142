"""A worker process: `python -m elasticflow.launchers.worker` (``COMMAND``), started by the agent through
its launcher's ``launch`` (local.py, slurm.py).

Reads the run's config from RUN_DIR/.elasticflow/config.yaml (through descriptors, from the run directory the
agent checked: ``_read_config``), joins the membership and trains.
Errors go to RUN_DIR/.elasticflow/error-<id>.json for the agent to report as one line.

Here, above the trainer (it builds one), not in distributed/: the agent there only starts the command.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from ..checkpoint import jobdir
from .._util.console import DetachedConsole
from ..distributed import protocol
from .._util.fileio import append_event, open_append, write_atomic
from .exits import user_frame

COMMAND = [sys.executable, "-m", "elasticflow.launchers.worker"]  # what a launcher runs to start one worker


class _LogFile(logging.FileHandler):
    """A worker's log file, opened for appending never through a symlink planted where it goes."""

    def _open(self):
        return open_append(Path(self.baseFilename))


class _RankFilter(logging.Filter):
    """Console: info from whoever is rank 0 now; warnings from every worker.

    Before this worker has a rank (the model file's ``model()``/``data()``, a library imported there, the
    join), info shows from worker 0 only: the first generation ranks by worker id, so it becomes rank 0.
    A record logged with ``extra={"console": False}`` goes to the worker's log file only.

    Note: a filter runs inside whatever logging call the user's code or a library made, at any moment of
    start-up; one that raised (it read ``trainer.rank`` before the replica existed) killed every worker
    of a multi-worker run whose ``data()`` logged, or that imported ``datasets``. It never raises.
    """

    def __init__(self, trainer_ref, worker_id: Optional[int]):
        super().__init__()
        self.trainer_ref, self.worker_id = trainer_ref, worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "console", True) is False:
            return False
        if record.levelno >= logging.WARNING:
            return True
        try:
            replica = getattr(self.trainer_ref(), "replica", None)  # set late in prepare()
            rank = -1 if replica is None else replica.rank
        except Exception:  # noqa: BLE001 - a half-built trainer must not break the caller's log call
            rank = -1
        return rank == 0 or (rank < 0 and self.worker_id == 0)


def _setup_logging(run_dir: Path, worker_id: int, trainer_ref) -> DetachedConsole:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(message)s"))
    console.addFilter(_RankFilter(trainer_ref, worker_id))
    file = _LogFile(logs / f"worker-{worker_id}.log")
    file.setFormatter(logging.Formatter(f"[%(asctime)s][worker {worker_id}][%(levelname)s] %(message)s"))
    # RUN_DIR/train.log holds what the console showed (the agent's lines go there through Hydra's job log): the
    # lines of whoever is rank 0, and every worker's warnings, in the agent's format.
    shown = _LogFile(run_dir / "train.log")
    shown.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] %(message)s"))
    shown.addFilter(_RankFilter(trainer_ref, worker_id))
    root.addHandler(console)
    root.addHandler(file)
    root.addHandler(shown)
    return DetachedConsole(root)  # a console nobody reads must not stop training (console.py)


def bind_address(interface) -> str:
    """Where this worker's gloo listens: $ELASTICFLOW_BIND, else 127.0.0.1 for local runs, else
    ``launcher.interface`` (a name like eth0 or an address), else this host's address on the route to the
    agent's store: the one the other hosts' workers reach (netif.address_toward), never a loopback one."""
    explicit = os.environ.get(protocol.ENV_BIND)
    if explicit and explicit != "auto":
        return explicit
    if explicit != "auto":
        return "127.0.0.1"
    from ..distributed.comm.netif import address_toward

    from ..distributed.store.stores import host_of

    return address_toward(host_of(os.environ[protocol.ENV_STORE]), interface)


def _write_error(run_dir: Path, holder: dict, worker_id, message: str, hint: str) -> None:
    """RUN_DIR/.elasticflow/error-<id>.json: the agent reports it as the job's one error line."""
    trainer = holder["trainer"]
    if trainer is not None and trainer.membership is not None and trainer.membership.worker_id is not None:
        worker_id = trainer.membership.worker_id
    (run_dir / ".elasticflow" / f"error-{worker_id}.json").write_text(json.dumps({"message": message, "hint": hint}))


def _record_exit(holder: dict, code: int) -> None:
    """Tell the agent this worker's exit code (protocol.exit_key): the only proof of a clean exit behind srun,
    whose own code is 0 also when this worker's node failed."""
    trainer = holder["trainer"]
    membership = getattr(trainer, "membership", None)
    if membership is None or membership.worker_id is None or not membership.sealer.job:
        return  # never admitted: no record of ours would verify (the agent learns the code from the process)
    try:
        protocol.put(membership.store, membership.sealer, protocol.exit_key(membership.worker_id), str(code))
    except Exception:  # noqa: BLE001 - the agent is gone: nobody to tell
        pass


def _settle(holder: dict) -> None:
    """Let a checkpoint still being written commit before this process ends: ``os._exit`` (below) and a
    SIGTERM would stop its writer thread mid-file (``CheckpointManager.settle``: bounded, never raises)."""
    checkpoints = getattr(holder["trainer"], "checkpoints", None)
    if checkpoints is not None:
        checkpoints.settle()


def _finish_save_on_sigterm(holder: dict) -> None:
    """SIGTERM (the agent stopping the job after another worker's error; SLURM or Kubernetes ending it): let a
    checkpoint being written commit first, then die by SIGTERM as before. Best effort: it runs between two
    Python instructions of the training thread, and whoever sent it may SIGKILL after a grace period."""
    def handle(signum, frame) -> None:
        _settle(holder)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handle)


def _read_config(run_dir: Path, worker_id: Optional[int]) -> str:
    """RUN_DIR/.elasticflow/config.yaml (it names the model file this worker imports), read through descriptors
    opened one below the other from the run directory the agent, or the node agent that started it, checked
    ($ELASTICFLOW_RUN_DIR_ID; where the agent started it, .elasticflow/ and the file must be yours alone too), so
    that a run directory renamed away and replaced since, or a symlink planted in it, is refused rather than read
    (paths.read_beneath). A refusal is one line on stderr and exit 1, and nothing is written there: not a log,
    not the error record the agent would read."""
    from ..errors import ElasticFlowError
    from .._util.envnames import ENV_NODE, ENV_RUN_DIR_ID
    from .._util.paths import read_beneath

    checked = os.environ.get(ENV_RUN_DIR_ID)  # as the agent, or the node agent that started this worker, saw it
    # Not who owns the files where a node agent started it (another host, a pod): a Kubernetes volume's owner and
    # modes are its fsGroup's, an NFS export may map owners to others.
    owned = checked is not None and ENV_NODE not in os.environ and not checked.startswith("*:")  # "*:": srun's
    try:
        return read_beneath(run_dir, (".elasticflow", "config.yaml"), checked, owned=owned).decode()
    except ElasticFlowError as exc:
        message, hint = exc.message, exc.hint
    except OSError as exc:
        message, hint = f"cannot read {run_dir}/.elasticflow/config.yaml ({exc.strerror})", \
            "workers are started by the agent of a run, which writes it"
    print(f"error: worker {worker_id}: {message}\nhint: {hint}", file=sys.stderr, flush=True)
    os._exit(1)


def main() -> None:
    from omegaconf import OmegaConf

    from ..config.schema import Config
    from ..errors import ElasticFlowError, RunDirectoryMoved, TrainingInterrupted
    from ..distributed.comm import nccl
    from ..distributed.membership.membership import AgentLost, Membership, Refused, Removed
    from torch.distributed import DistNetworkError

    from ..config.topology import this_workers_group, validate as validate_topology
    from ..trainer import ElasticTrainer

    run_dir = Path(os.environ[protocol.ENV_RUN_DIR])
    worker_id = int(os.environ[protocol.ENV_WORKER_ID]) if os.environ.get(protocol.ENV_WORKER_ID) else None
    config = _read_config(run_dir, worker_id)  # first: nothing is written into a run directory put in its place
    holder = {"trainer": None}
    console = _setup_logging(run_dir, worker_id, lambda: holder["trainer"])
    replaced = nccl.environment()  # before any NCCL group reads it: an NCCL error raises into the recovery
    if replaced.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        logging.getLogger("elasticflow").info("TORCH_NCCL_ASYNC_ERROR_HANDLING=%s replaced by 2 (see docs/gpus.md)",
                                              replaced["TORCH_NCCL_ASYNC_ERROR_HANDLING"], extra={"console": False})
    _finish_save_on_sigterm(holder)
    code = protocol.EXIT_OK
    # Forged store records this worker refused: once per kind into events.jsonl (the intruder test reads them).
    protocol.REFUSED.on_first = lambda kind, detail: append_event(
        run_dir / "events.jsonl", "forged", "worker", worker=worker_id, record=kind, detail=detail)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(config))
        membership = Membership(os.environ[protocol.ENV_STORE], worker_id, cfg.elastic.timeout_s, cfg.elastic.wait_s,
                                os.environ.get(protocol.ENV_TOKEN), host=bind_address(cfg.launcher.interface),
                                node=os.environ.get(protocol.ENV_NODE))
        membership.check_token()
        topology = validate_topology(cfg.topology)
        if topology.kind == "hierarchical":  # this worker's group: sums go through the groups' leaders
            membership.group_tag = this_workers_group(topology, os.environ.get(protocol.ENV_LOCAL_SLOT))
        membership.events = run_dir / "events.jsonl"
        trainer = ElasticTrainer(cfg.model, cfg, run_dir=str(run_dir), membership=membership)
        holder["trainer"] = trainer
        summary = trainer.fit()
        if trainer.rank == 0:
            # Atomic: a worker killed mid-write must not leave the agent a torn result to read.
            write_atomic(run_dir / "summary.json", json.dumps(summary))
    except TrainingInterrupted:
        code = protocol.EXIT_INTERRUPTED
    except Refused as exc:
        print(f"error: the agent refused this worker: {exc}\nhint: workers must be started by the agent, "
              f"or carry the job token from RUN_DIR/.elasticflow/token in ${protocol.ENV_TOKEN}", file=sys.stderr)
        code = protocol.EXIT_REFUSED
    except Removed as exc:  # a joiner whose job ended before it entered: nothing to do, a clean exit
        logging.getLogger("elasticflow").info("worker %s: %s", worker_id, exc)
        code = protocol.EXIT_REMOVED
    except (AgentLost, DistNetworkError) as exc:
        # DistNetworkError: the store closed under a call outside membership (a worker that started as the job
        # ended, and asked for the checkpoint folder): the agent is gone, as for AgentLost.
        what = str(exc) if isinstance(exc, AgentLost) else \
            f"the agent at {os.environ[protocol.ENV_STORE]} is gone ({str(exc).splitlines()[0][:160]})"
        print(f"error: {what}\nhint: is the job still running? see RUN_DIR/workers.json", file=sys.stderr)
        code = protocol.EXIT_AGENT_LOST
    except RunDirectoryMoved as exc:  # nothing is written into the directory now at its path, not even the record
        print(f"error: worker {worker_id}: {exc.message}\nhint: {exc.hint}", file=sys.stderr, flush=True)
        code = exc.exit_code
    except ElasticFlowError as exc:
        code = exc.exit_code
        if code == protocol.EXIT_REMOVED:
            logging.getLogger("elasticflow").info("worker %s: %s", worker_id, exc.message)
        else:
            if code not in (protocol.EXIT_BELOW_MIN, protocol.EXIT_AGENT_LOST, protocol.EXIT_CUT_OUT,
                            protocol.EXIT_STRAGGLER, protocol.EXIT_CORRUPT, protocol.EXIT_MISCOMPUTE):
                _write_error(run_dir, holder, worker_id, exc.message, exc.hint)
            logging.getLogger("elasticflow").warning("worker %s: %s", worker_id, exc.message)
    except BaseException as exc:  # noqa: BLE001 - report any failure to the agent as one line
        import traceback

        logging.getLogger("elasticflow").error("worker %s failed:\n%s", worker_id, traceback.format_exc())
        where = user_frame(exc)  # the user's line, not the library's frame the error was raised in
        _write_error(run_dir, holder, worker_id, f"worker {worker_id}: {type(exc).__name__}: {exc}{where}",
                     f"see {run_dir}/logs/worker-{worker_id}.log for the traceback")
        code = 1
    if code != protocol.EXIT_OK:  # an error exit: an interval save in flight commits first
        _settle(holder)
    _record_exit(holder, code)
    jobdir.release_all()  # os._exit below skips atexit: free the checkpoint folder's lease now
    # A process whose gloo group failed can abort in its exit handlers: flush, then leave at once.
    console.close(timeout_s=5.0)  # bounded: the agent waits for this exit
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
