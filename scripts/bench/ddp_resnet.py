"""The CNN baseline for scripts/bench_elastic.py: models/small_resnet.py trained with plain torchrun + DDP.

    torchrun --nproc_per_node=2 --standalone scripts/bench/ddp_resnet.py --steps 120 --out t.json

Hand-written the way a user would: gloo, one intra-op thread per process, the global batch split in
two contiguous halves, each rank's half in one forward pass, SGD, ``loss.item()`` every step. Plain
``DDP(model)`` with its BatchNorm layers as they are: each rank normalises with its own half's
statistics, and DDP broadcasts rank 0's buffers (running statistics) before every forward
(``broadcast_buffers=True``, the default), so the ranks' running statistics are rank 0's, not the
global batch's. Not SyncBatchNorm (one more collective per BatchNorm layer, in forward and backward).
Rank 0 writes JSON {"ends": [time.time(), ...], "cpu": [time.process_time(), ...]} to ``--out``.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "models"))
import small_resnet  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    torch.set_num_threads(1)  # what elasticflow picks for 2 workers on 2 cores (cores // local workers)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = (torch.from_numpy(a) for a in small_resnet.images())
    model = DDP(small_resnet.build(seed=0))
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
        loss.backward()  # DDP allreduces the gradient (one bucket: 0.3 MB) here
        opt.step()
        loss.item()
        ends.append(time.time())
        cpu.append(time.process_time())
    dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"ends": ends, "cpu": cpu, "world": world}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
