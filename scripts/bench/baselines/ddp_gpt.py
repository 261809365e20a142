"""The baseline for scripts/bench/bench_overlap.py: models/tiny_gpt.py trained with plain torchrun + DDP.

    torchrun --nproc_per_node=2 --standalone scripts/bench/baselines/ddp_gpt.py --width 384 --layers 6 --steps 40 --out t.json

Hand-written the way a user would: gloo, one intra-op thread per process, DDP's default 25 MiB
buckets (allreduces launched from autograd hooks while backward runs), the global batch split in
contiguous halves in elasticflow's sample order, SGD, ``loss.item()`` every step. Rank 0 writes the
wall-clock at the end of every step to ``--out`` as JSON {"ends": [...]}.
"""
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "models"))
import tiny_gpt  # noqa: E402
from elasticflow.data.order import permutation  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_digits  # noqa: E402  (the options and group set-up of every DDP baseline)


def main() -> None:
    p = ddp_digits.arguments(steps=40, global_batch=8, lr=1e-4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    args = p.parse_args()
    rank, world = ddp_digits.join_group()
    cfg = SimpleNamespace(seed=0, model_args={"vocab": args.vocab, "width": args.width, "layers": args.layers,
                                              "heads": args.heads}, get=lambda k, d=None: getattr(cfg, k, d))
    model = DDP(tiny_gpt.model(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = (torch.from_numpy(a) for a in tiny_gpt.data(cfg))
    b, share = args.global_batch, args.global_batch // world
    order, pos, epoch, ends = torch.from_numpy(permutation(len(x), 0, 0)), 0, 0, []
    for _ in range(args.steps):
        if pos + b > len(x):
            epoch += 1
            order, pos = torch.from_numpy(permutation(len(x), 0, epoch)), 0
        idx = order[pos + rank * share: pos + (rank + 1) * share]
        pos += b
        opt.zero_grad(set_to_none=False)
        loss = tiny_gpt.forward(x.index_select(0, idx), y.index_select(0, idx), model)
        loss.backward()
        opt.step()
        loss.item()
        ends.append(time.time())
    dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"ends": ends}))
    ddp_digits.leave_group()


if __name__ == "__main__":
    main()
