"""Where a worker computes: the device it binds, the precision it computes in, how it communicates.

Resolved once per worker, from ``trainer.device``, ``trainer.precision``, ``comm.backend`` and what the
host has (``choose`` is the pure decision, ``resolve`` asks the backend what the host has). Each worker
binds one GPU: its slot on the host picks among the visible devices. Under SLURM each worker's step is
started with ``--gpus-per-task=1``, so it sees exactly its own GPU; locally the agent gives each worker
the lowest slot no live worker on the host holds (``ELASTICFLOW_LOCAL_SLOT``), so a replacement takes
the GPU of the worker it replaces.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from .._util.envnames import ENV_LOCAL_SLOT
from ..errors import ElasticFlowError

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("32", "bf16", "16")
COMM_BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Placement:
    """One worker's device, precision and collective backend."""
    device: str = "cpu"        # "cpu" or "cuda:N" (N among the devices this process sees)
    precision: str = "32"      # "32" | "bf16" | "16"
    comm: str = "gloo"         # "gloo" | "nccl" (only where every worker has a GPU)
    device_name: str = "cpu"   # what the banner and `elasticflow status` show: "NVIDIA H100 80GB HBM3"

    @property
    def kind(self) -> str:
        return self.device.split(":")[0]

    @property
    def index(self) -> Optional[int]:
        return int(self.device.split(":")[1]) if ":" in self.device else None

    @property
    def compute_dtype(self) -> Optional[str]:
        """The autocast dtype; None in full precision."""
        return {"32": None, "bf16": "bfloat16", "16": "float16"}[self.precision]

    @property
    def loss_scaling(self) -> bool:
        """float16's narrow exponent needs dynamic loss scaling; bfloat16's does not."""
        return self.precision == "16"

    def describe(self) -> str:
        where = self.device if self.kind == "cpu" else f"{self.device} ({self.device_name})"
        precision = {"32": "float32", "bf16": "bf16 mixed", "16": "float16 mixed, loss scaling"}[self.precision]
        return f"{where}, {precision}, {self.comm}"


def precision_name(value: Any) -> str:
    """``trainer.precision`` as one of PRECISIONS (Hydra reads ``precision=16`` as the int 16)."""
    text = str(value).strip().lower()
    return {"32": "32", "fp32": "32", "float32": "32", "bf16": "bf16", "bfloat16": "bf16",
            "16": "16", "fp16": "16", "float16": "16"}.get(text, text)


def intra_op_threads(cores: int, local_workers: int, loader_processes: int) -> int:
    """``backend.threads=null``: this worker's share of the host's cores, less one per forked data loader.

    A loader process (``data.worker_type=process``) decodes on a core of its own. Counted as the
    trainer's too, the cores were oversubscribed: OpenMP's intra-op threads spin-wait after each
    parallel op, and when a loader holds a thread's core its partner spins for it, burning the CPU the
    loaders need. 2 cores, 2 loaders, decode-bound, other processes running: the training process used
    1.0-7.1 CPU-s for 54 steps with 2 threads, 0.44-0.54 with 1; samples/s with 2 threads 0.29x and
    0.30x of 1 thread's (two runs, scripts/bench/bench_data.py decode). It costs a compute-bound run whose
    loaders idle those cores: set ``backend.threads`` there.
    """
    return max(1, cores // max(1, local_workers) - loader_processes)


def local_slot(env: Mapping[str, str] = os.environ) -> int:
    """This worker's slot on its host: the agent's, else SLURM's local task id, else 0."""
    for key in (ENV_LOCAL_SLOT, "SLURM_LOCALID"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


def choose(device: str, precision: str, comm: str, gpus: Sequence[str], slot: int, local_workers: int,
           bf16_ok: bool = True) -> Placement:
    """The placement of the worker in ``slot`` of a host whose process sees ``gpus`` (their names).

    Args:
        local_workers: the workers this host runs at most (NCCL cannot put two on one GPU).
        bf16_ok: the GPU computes in bfloat16 (compute capability 8.0 or newer).

    Raises ElasticFlowError for a setting the host cannot honour.
    """
    precision = precision_name(precision)
    if device == "cuda" and not gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ElasticFlowError(
            "trainer.device=cuda but this worker sees no CUDA device"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""),
            "pass trainer.device=auto to use a GPU only where there is one, or trainer.device=cpu")
    on_gpu = bool(gpus) and device in ("auto", "cuda")
    if comm == "nccl" and not on_gpu:
        raise ElasticFlowError(f"comm.backend=nccl needs a GPU per worker, but this worker computes on the CPU"
                               f" (trainer.device={device}, {len(gpus)} GPUs visible)",
                               "pass comm.backend=auto (NCCL where every worker has a GPU, else gloo)")
    if comm == "nccl" and local_workers > len(gpus):
        raise ElasticFlowError(
            f"comm.backend=nccl with up to {local_workers} workers on this host but only {len(gpus)} GPUs: "
            f"NCCL cannot put two workers on one GPU",
            f"lower launcher.workers (and launcher.max_workers) to {len(gpus)}, or pass comm.backend=gloo to "
            f"let workers share GPUs")
    if not on_gpu:
        return Placement("cpu", precision, "gloo", "cpu")
    if precision == "bf16" and not bf16_ok:
        raise ElasticFlowError(f"trainer.precision=bf16 but {gpus[0]} has no bfloat16 arithmetic "
                               "(it needs compute capability 8.0, Ampere, or newer)",
                               "pass trainer.precision=16 (float16 with loss scaling) or 32")
    index = slot % len(gpus)  # more workers than GPUs (gloo only): they share, round robin
    # auto: NCCL only where no two workers share a GPU. The decision must be the same on every worker
    # of a job, so it depends on the job's shape (workers per host, GPUs per host), not on the slot.
    chosen = comm if comm != "auto" else ("nccl" if local_workers <= len(gpus) else "gloo")
    return Placement(f"cuda:{index}", precision, chosen, gpus[index])


def resolve(cfg: Any, backend: Any, local_workers: int, env: Mapping[str, str] = os.environ) -> Placement:
    """``choose`` for this process: the backend says which GPUs it sees (``backend.gpus()``).

    ``local_workers``: the workers on this host. An srun step (the SLURM launcher's workers) was given
    its own GPU (``--gpus-per-task=1``), so it shares the GPUs it sees with no other worker.
    """
    device = str(cfg.trainer.device)
    gpus = backend.gpus() if device != "cpu" else []
    sharing = 1 if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_STEP_GPUS") else local_workers
    return choose(device, cfg.trainer.precision, str(cfg.comm.backend), gpus, local_slot(env), sharing,
                  bf16_ok=backend.bf16_supported() if gpus else True)
