"""The CNN baseline for scripts/bench/bench_elastic.py: models/small_resnet.py trained with plain torchrun + DDP.

    torchrun --nproc_per_node=2 --standalone scripts/bench/baselines/ddp_resnet.py --steps 120 --out t.json

Hand-written the way a user would: gloo, one intra-op thread per process, the global batch split in
two contiguous halves, each rank's half in one forward pass, SGD, ``loss.item()`` every step. Plain
``DDP(model)`` with its BatchNorm layers as they are: each rank normalises with its own half's
statistics, and DDP broadcasts rank 0's buffers (running statistics) before every forward
(``broadcast_buffers=True``, the default), so the ranks' running statistics are rank 0's, not the
global batch's. Not SyncBatchNorm (one more collective per BatchNorm layer, in forward and backward).
Rank 0 writes JSON {"ends": [time.time(), ...], "cpu": [time.process_time(), ...]} to ``--out``.
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "models"))
import small_resnet  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_digits  # noqa: E402  (its training loop: the same hand-written DDP step for every baseline)


def main() -> None:
    args = ddp_digits.arguments(steps=120).parse_args()
    rank, world = ddp_digits.join_group()
    x, y = (torch.from_numpy(a) for a in small_resnet.images())
    ends, cpu = ddp_digits.train_model(DDP(small_resnet.build(seed=0)), x, y, rank, world, args)
    dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"ends": ends, "cpu": cpu, "world": world}))
    ddp_digits.leave_group()


if __name__ == "__main__":
    main()
