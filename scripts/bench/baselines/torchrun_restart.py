"""torchrun's restart-based recovery, for scripts/bench/bench_elastic.py: DDP on the digits MLP that
checkpoints every ``--ckpt-every`` steps and resumes from the newest checkpoint when torchrun restarts it.

    torchrun --nproc_per_node=2 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT \
        scripts/bench/baselines/torchrun_restart.py --dir DIR --steps 400

Writes, under DIR: ``pid-<restart>-<rank>`` (this process's pid, for the benchmark to kill) and
``log-<rank>.txt`` lines ``step <n> <wall time> <restart>`` after every step, ``resume <step>
<wall time> <restart>`` when it starts (step 0 = a fresh start). The checkpoint is rank 0's
``torch.save`` of the model and optimizer, written to a temporary name and renamed (atomic).
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_digits  # noqa: E402  (the same model and data as the throughput baseline)

_digits = ddp_digits._digits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    out = Path(args.dir)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    (out / f"pid-{restart}-{rank}").write_text(str(os.getpid()))

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    x, y = (torch.from_numpy(a) for a in _digits.train_split())
    model = DDP(ddp_digits.mlp(args.hidden, 0))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ckpt = out / "ckpt.pt"
    start = 0
    if ckpt.is_file():
        saved = torch.load(ckpt)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    log = open(out / f"log-{rank}.txt", "a", buffering=1)
    log.write(f"resume {start} {time.time()} {restart}\n")

    b, n = args.global_batch, len(x)
    share = b // world
    per_epoch = n // b  # drop the short last batch: the order depends only on the step number
    order_epoch, order = -1, None
    for step in range(start, args.steps):
        epoch, pos = divmod(step, per_epoch)
        if epoch != order_epoch:
            order_epoch, order = epoch, torch.from_numpy(np.random.default_rng(epoch).permutation(n))
        idx = order[pos * b + rank * share: pos * b + (rank + 1) * share]
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        loss.item()
        log.write(f"step {step + 1} {time.time()} {restart}\n")
        if (step + 1) % args.ckpt_every == 0 and rank == 0:
            tmp = out / "ckpt.pt.tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
