"""Per-step cost of elasticflow's AdamW/Adam path against torch.optim in a hand-written loop.

Both rows train models/tiny_gpt.py (a plain-torch GPT-2-shaped decoder, tied embedding) from the
same initial weights on the same random tokens, with the same global batch, per-step sample order
(``elasticflow.data.permutation``), optimizer hyper-parameters and torch thread count, in one
process. The timing driver is scripts/bench_overhead.py's: rows interleaved chunk by chunk, the
order alternating, warm-up steps excluded, median and minimum of wall and CPU time per step with
the ratio to the first (hand-written) row.

    .venv/bin/python scripts/bench_adam.py                                  # AdamW, vocab 1000 and 50257
    .venv/bin/python scripts/bench_adam.py --optimizer adam --vocab 1000 --chunks 30
    .venv/bin/python scripts/bench_adam.py --update-only                    # the optimizer update alone
    .venv/bin/python scripts/bench_adam.py --profile                        # torch.profiler tables, no timing
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "tiny_gpt.py"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "models"))
sys.path.insert(0, str(REPO / "scripts"))

from bench_overhead import _logger, bench, elasticflow_row, report  # noqa: E402  the same driver, rows, log


@dataclass
class Setup:
    optimizer: str
    vocab: int
    width: int
    layers: int
    threads: int
    global_batch: int = 16
    heads: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    log_every: int = 10  # elasticflow's default trainer.log_every; the hand-written loop logs as often
    log_file: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench_adam_")) / "train.log")

    def model_args(self):
        return {"vocab": self.vocab, "width": self.width, "layers": self.layers, "heads": self.heads}

    def overrides(self) -> List[str]:
        return ([f"+model_args.{k}={v}" for k, v in self.model_args().items()] +
                [f"optimizer={self.optimizer}", f"backend.threads={self.threads}", f"seed={self.seed}",
                 f"trainer.global_batch_size={self.global_batch}", f"optimizer.lr={self.lr}",
                 f"optimizer.weight_decay={self.weight_decay}", "checkpoint.interval.steps=1000000000",
                 *(["optimizer.momentum=0.9"] if self.optimizer == "sgd" else []),
                 "trainer.progress=false", "resume=none"])


def handwritten_torch(setup: Setup, total_steps: int) -> Iterator[None]:
    """What a user would write: resident tensors, index_select, forward/backward/step/zero_grad."""
    import torch
    from omegaconf import OmegaConf

    import tiny_gpt
    from elasticflow.data import permutation

    log = _logger(setup)
    torch.set_num_threads(setup.threads)
    cfg = OmegaConf.create({"seed": setup.seed, "model_args": setup.model_args()})
    net = tiny_gpt.model(cfg)
    x, y = (torch.from_numpy(a) for a in tiny_gpt.data(cfg))
    opt = _torch_optimizer(setup, net.parameters())
    n, b = len(x), setup.global_batch
    step, epoch = 0, 0
    while step < total_steps:
        order = torch.from_numpy(permutation(n, setup.seed, epoch))
        for start in range(0, n, b):
            idx = order[start:start + b]
            loss = tiny_gpt.forward(x.index_select(0, idx), y.index_select(0, idx), net)
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if step % setup.log_every == 0:
                log.info("step %d loss %.5g", step, loss.item())
            yield
            if step == total_steps:
                return
        epoch += 1


def _torch_optimizer(setup: Setup, params):
    import torch

    if setup.optimizer == "sgd":  # the same row for SGD with momentum 0.9 (--optimizer sgd)
        return torch.optim.SGD(params, lr=setup.lr, momentum=0.9, weight_decay=setup.weight_decay)
    cls = torch.optim.AdamW if setup.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=setup.lr, weight_decay=setup.weight_decay)


ROWS = {"hand-written torch": handwritten_torch, "elasticflow torch": elasticflow_row("torch", MODEL)}


def _gradients(setup: Setup):
    """The model and one fixed gradient per parameter (from one real backward), for the update-only rows."""
    import torch
    from omegaconf import OmegaConf

    import tiny_gpt

    cfg = OmegaConf.create({"seed": setup.seed, "model_args": setup.model_args()})
    net = tiny_gpt.model(cfg)
    x, y = (torch.from_numpy(a[:setup.global_batch]) for a in tiny_gpt.data(cfg))
    tiny_gpt.forward(x, y, net).backward()
    return tiny_gpt, net, [p.grad.clone() for p in net.parameters()]


def torch_optim_update(setup: Setup, total_steps: int) -> Iterator[None]:
    """torch.optim's step alone on fixed gradients: the update a hand-written loop pays."""
    import torch

    torch.set_num_threads(setup.threads)
    _, net, grads = _gradients(setup)
    for p, g in zip(net.parameters(), grads):
        p.grad = g
    cls = torch.optim.AdamW if setup.optimizer == "adamw" else torch.optim.Adam
    opt = cls(net.parameters(), lr=setup.lr, weight_decay=setup.weight_decay)
    for _ in range(total_steps):
        opt.step()
        yield


def engine_update(setup: Setup, total_steps: int) -> Iterator[None]:
    """elasticflow's Engine.apply alone on the same fixed gradients."""
    import torch

    from elasticflow import optim
    from elasticflow.backends.torch import Engine

    torch.set_num_threads(setup.threads)
    tiny_gpt, net, grads = _gradients(setup)
    cls = optim.AdamW if setup.optimizer == "adamw" else optim.Adam
    engine = Engine(net, tiny_gpt.forward, cls(setup.lr, weight_decay=setup.weight_decay))
    engine.grad_view().copy_(torch.cat([g.reshape(-1) for g in grads]))
    for _ in range(total_steps):
        engine.apply(setup.lr)
        yield


UPDATE_ROWS = {"torch.optim step": torch_optim_update, "elasticflow apply": engine_update}


def profile(setup: Setup, steps: int = 30) -> None:
    """torch.profiler's table for each row over ``steps`` steps after 20 warm-up steps."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for name, row in ROWS.items():
        loop = row(setup, 20 + steps + 1)
        for _ in range(20):
            next(loop)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                next(loop)
        print(f"== {name}: {steps} steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        for _ in loop:
            pass


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"],
                   help="sgd: with momentum 0.9, on both rows (not with --update-only)")
    p.add_argument("--vocab", type=int, nargs="+", default=[1000, 50257])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--chunk-steps", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="print torch.profiler tables instead of timing")
    p.add_argument("--update-only", action="store_true",
                   help="time the optimizer update alone (fixed gradients), torch.optim against Engine.apply")
    args = p.parse_args(argv)
    for vocab in args.vocab:
        setup = Setup(args.optimizer, vocab, args.width, args.layers, args.threads, args.global_batch, heads=args.heads)
        print(f"tiny_gpt vocab={vocab} width={args.width} layers={args.layers} heads={args.heads} seq=64, global batch "
              f"{setup.global_batch}, {args.optimizer}(lr={setup.lr}, weight_decay={setup.weight_decay}), "
              f"{args.threads} thread(s); {args.chunks} interleaved chunks of {args.chunk_steps} steps after "
              f"{args.warmup} warm-up steps; ratios to the first row")
        if args.profile:
            profile(setup)
        elif args.update_only:
            print("  the update alone")
            report(bench(setup, args.warmup, args.chunks, args.chunk_steps, UPDATE_ROWS))
        else:
            report(bench(setup, args.warmup, args.chunks, args.chunk_steps, ROWS))


if __name__ == "__main__":
    main()
