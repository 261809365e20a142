"""The baseline for scripts/bench/bench_elastic.py: the digits MLP trained with plain torchrun + DDP.

    torchrun --nproc_per_node=2 --standalone scripts/bench/baselines/ddp_digits.py --hidden 64 1024 --steps 300 --out t.json

Hand-written the way a user would: gloo, one intra-op thread per process, the global batch split
in two contiguous halves, SGD, ``loss.item()`` every step. One model per ``--hidden`` width, trained
one after the other in the same process group (one start-up for all). Rank 0 writes the wall-clock
and its CPU time at the end of every step to ``--out``: JSON {"ends": {width: [time.time(), ...]},
"cpu": {width: [time.process_time(), ...]}}.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "models"))
import _digits  # noqa: E402
import digits_mlp  # noqa: E402


def mlp(hidden: int, seed: int) -> torch.nn.Module:
    """The digits MLP as an nn.Module, initialised from models/digits_mlp.py's model()."""
    params = digits_mlp.model(SimpleNamespace(model_args={"hidden": hidden}, seed=seed))
    net = torch.nn.Sequential(torch.nn.Linear(_digits.PIXELS, hidden), torch.nn.ReLU(),
                              torch.nn.Linear(hidden, _digits.CLASSES))
    with torch.no_grad():
        for layer, name in ((net[0], "hidden"), (net[2], "out")):
            layer.weight.copy_(torch.from_numpy(params[name]["W"]).T)
            layer.bias.copy_(torch.from_numpy(params[name]["b"]))
    return net


def train(hidden: int, x: torch.Tensor, y: torch.Tensor, rank: int, world: int, args) -> tuple:
    """``args.steps`` DDP steps of a fresh model; returns the wall-clock and process CPU time at the end of each."""
    return train_model(DDP(mlp(hidden, 0)), x, y, rank, world, args)


def train_model(model: DDP, x: torch.Tensor, y: torch.Tensor, rank: int, world: int, args) -> tuple:
    """The hand-written DDP loop every baseline here runs (scripts/bench/baselines/ddp_resnet.py too): ``args.steps``
    steps of SGD over contiguous shares of the global batch; (wall-clock, process CPU) at each step's end."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    b, n = args.global_batch, len(x)
    share = b // world
    order, pos, epoch = torch.from_numpy(np.random.default_rng(0).permutation(n)), 0, 0
    ends, cpu = [], []
    for _ in range(args.steps):
        if pos + b > n:  # drop the epoch's short last batch: every step has the same size
            epoch += 1
            order, pos = torch.from_numpy(np.random.default_rng(epoch).permutation(n)), 0
        idx = order[pos + rank * share: pos + (rank + 1) * share]
        pos += b
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        opt.zero_grad(set_to_none=False)
        logits = model(xb)
        loss = F.cross_entropy(logits, yb)
        with torch.no_grad():
            (logits.argmax(-1) == yb).float().mean()  # the model file's accuracy metric
        loss.backward()  # DDP allreduces the gradient here (one bucket for these models: <= 0.3 MB)
        opt.step()
        loss.item()
        ends.append(time.time())
        cpu.append(time.process_time())  # every thread of this process: gloo's and autograd's too
    return ends, cpu


def arguments(steps: int, global_batch: int = 64, lr: float = 0.1) -> argparse.ArgumentParser:
    """The options every DDP baseline here takes (ddp_resnet.py and ddp_gpt.py add theirs)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--global-batch", type=int, default=global_batch)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--out", required=True)
    return p


def join_group() -> tuple:
    """Enter torchrun's gloo group as a user's script would; returns (rank, world)."""
    torch.set_num_threads(1)  # what elasticflow picks for 2 workers on 2 cores (cores // local workers)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def leave_group() -> None:
    """End a baseline once its results are written. Not destroy_process_group(): torch 2.13's gloo teardown
    aborts (SIGABRT, "terminate called without an active exception") in about one run in four here, and
    torchrun then reports the whole run failed; the results are on disk by now, so leave at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    p = arguments(steps=300)
    p.add_argument("--hidden", type=int, nargs="+", default=[64])
    args = p.parse_args()
    rank, world = join_group()
    torch.manual_seed(0)
    x, y = (torch.from_numpy(a) for a in _digits.train_split())
    runs = {hidden: train(hidden, x, y, rank, world, args) for hidden in args.hidden}
    dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"ends": {h: r[0] for h, r in runs.items()},
                                              "cpu": {h: r[1] for h, r in runs.items()},
                                              "world": world, "threads": torch.get_num_threads()}))
    leave_group()


if __name__ == "__main__":
    main()
