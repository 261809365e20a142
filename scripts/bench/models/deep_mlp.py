"""A deep MLP whose state dominates its worker, for trainer.shard=parameters' memory (bench_shard.py --parts 4):
``model_args.depth`` blocks of Linear(width, width) + ReLU as an nn.Sequential (each Linear a unit), a scalar
regression head, Adam's state beside. At width 3584 and depth 12: 154M parameters, 2.5 GB of parameters,
gradient and Adam state replicated. ``model_args.frozen=K`` freezes the first K blocks (a frozen base, as under
LoRA: no gradient, no optimizer state). With EF_BENCH_HWM set to a folder, every forward writes the process's peak
resident set so far (VmHWM) to <folder>/<pid>, and after it the peak since the first forward (training without
the start-up, which builds the whole model in every worker): the last one read is the run's peak but for its
last backward.
With EF_BENCH_CGROUP (a cgroup-v1 memory directory) and EF_BENCH_LIMIT_MB set, model() first moves its worker into a
cgroup of its own under it, limited to that many MiB: everything the worker allocates from there on (the model, its
state, the training) counts against it, and the kernel's OOM killer ends a worker past it (bench_shard.py --parts 5).
"""
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

import elasticflow

HWM = os.environ.get("EF_BENCH_HWM")


def limit_this_worker(parent: str, mib: int) -> None:
    """This process into a fresh memory cgroup under ``parent`` limited to ``mib`` MiB (no swap here)."""
    group = Path(parent, f"ef-{os.getpid()}")
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(mib << 20))
    (group / "cgroup.procs").write_text(str(os.getpid()))


def model(cfg):
    if os.environ.get("EF_BENCH_CGROUP"):
        limit_this_worker(os.environ["EF_BENCH_CGROUP"], int(os.environ["EF_BENCH_LIMIT_MB"]))
    torch.manual_seed(cfg.seed)
    width, depth = int(cfg.model_args.get("width", 3584)), int(cfg.model_args.get("depth", 12))
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(width, 1))
    for block in layers[:2 * int(cfg.model_args.get("frozen", 0))]:  # a frozen base: its first blocks
        for p in block.parameters():
            p.requires_grad_(False)
    return net


_start_peak = []  # VmHWM at step 1's first forward: building the model and its state (the start-up's peak)


def forward(x, y, net):
    if HWM:
        peak = int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1])
        if not _start_peak and elasticflow.context().step >= 1:  # past the start-up probe and the first layout:
            _start_peak.append(peak)  # from here VmHWM counts training only ("5" resets it: proc(5), clear_refs)
            Path("/proc/self/clear_refs").write_text("5")
        Path(HWM, str(os.getpid())).write_text(f"{max(peak, _start_peak[0] if _start_peak else 0)} {peak}")
    return {"loss": nn.functional.mse_loss(net(x).squeeze(-1), y)}


def data(cfg):
    width, samples = int(cfg.model_args.get("width", 3584)), int(cfg.model_args.get("samples", 512))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, width), dtype=np.float32)
    return x, (x[:, :8].sum(1) / 8).astype(np.float32)
