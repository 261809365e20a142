"""torch's FSDP2 (``fully_shard``) on gloo, the baseline of bench_shard.py --parts 4: the same deep MLP as
scripts/bench/models/deep_mlp.py (each Linear its own unit, then the root), Adam, WORLD processes each on its share of a
global batch, for STEPS steps. Prints one JSON line: each rank's peak resident set (VmHWM, KiB) and step times.

    python scripts/bench/baselines/fsdp2_mlp.py --world 4 --width 3584 --depth 12 --batch 16 --steps 6
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def hwm_kib() -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1])


def run(rank: int, args, port: int, out) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(args.width, 1))
    for m in net:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    share = args.batch // args.world
    times = []
    for _ in range(args.steps):
        x = torch.randn(share, args.width, generator=gen)
        y = x[:, :8].sum(1) / 8
        t = time.perf_counter()
        loss = nn.functional.mse_loss(net(x).squeeze(-1), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    out.put((rank, hwm_kib(), times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--width", type=int, default=3584)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 2000
    procs = [ctx.Process(target=run, args=(r, args, port, out)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    rows = sorted(out.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    print(json.dumps({"hwm_kib": [h for _, h, _ in rows], "step_s": [t for _, _, t in rows]}))
    sys.exit(0 if all(proc.exitcode == 0 for proc in procs) else 1)


if __name__ == "__main__":
    main()
