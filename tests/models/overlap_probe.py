"""A 4-layer torch MLP (141k parameters, 552 KiB of gradient) whose backward can be cut short by a
SIGKILL, for tests/test_overlap.py: with comm.bucket_mb=0.1 its gradient reduces in three buckets.

Environment:
    EF_OVERLAP_KILL  "worker:step:layer": that worker SIGKILLs itself at that step (generation 0) when
                     backward reaches Linear layer `layer` (0..3; 3 is reached first), or "reduction":
                     150 ms after backward, while the last bucket reduces (the others are slowed
                     there, so the victim is the one waiting).
"""
import os
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

import elasticflow
from elasticflow.distributed.protocol import ENV_WORKER_ID

WORKER = int(os.environ.get(ENV_WORKER_ID, "0"))
KILL = os.environ.get("EF_OVERLAP_KILL", "").split(":") if os.environ.get("EF_OVERLAP_KILL") else None


def _kill():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _armed(ctx) -> bool:
    return KILL is not None and ctx.step == int(KILL[1]) and ctx.generation == 0


def model(cfg):
    torch.manual_seed(cfg.seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                              torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    if KILL and KILL[2] != "reduction" and int(KILL[0]) == WORKER:
        layer = net[2 * int(KILL[2])]
        layer.register_full_backward_hook(lambda *_: _kill() if _armed(elasticflow.context()) else None)
    return net


def forward(x, y, net):
    ctx = elasticflow.context()
    if KILL and KILL[2] == "reduction" and _armed(ctx) and torch.is_grad_enabled():
        if int(KILL[0]) == WORKER:
            threading.Timer(0.15, _kill).start()
        else:
            time.sleep(0.4)
    return F.cross_entropy(net(x), y)


def data(cfg):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(768, 32)).astype(np.float32)
    y = (np.abs(x[:, :4]).argmax(axis=1)).astype(np.int64)
    return x, y
