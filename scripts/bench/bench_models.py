"""elasticflow's 1-worker step against a hand-written loop on real architectures, with SGD, Adam or AdamW.

Rows train ``--model``: models/tiny_gpt.py (a plain-torch GPT-2-shaped decoder, tied embedding) or
models/small_resnet.py (a CIFAR-style ResNet with BatchNorm), from the same initial weights on the same
data, with the same global batch, per-step sample order (``elasticflow.data.permutation``), optimizer
hyper-parameters and torch thread count, in one process. The hand-written row is what a user would
write: resident tensors, index_select, forward/backward/step/zero_grad with torch.optim. The timing
driver is scripts/bench/bench_overhead.py's: rows interleaved chunk by chunk, the order alternating, warm-up
steps excluded, median and minimum of wall and CPU time per step with the ratio to the first
(hand-written) row.

    .venv/bin/python scripts/bench/bench_models.py                            # tiny_gpt, AdamW, vocab 1000 and 50257
    .venv/bin/python scripts/bench/bench_models.py --optimizer adam --vocab 1000 --chunks 30
    .venv/bin/python scripts/bench/bench_models.py --model small_resnet --optimizer sgd --global-batch 64
    .venv/bin/python scripts/bench/bench_models.py --update-only              # the optimizer update alone
    .venv/bin/python scripts/bench/bench_models.py --no-decay bias norm       # two parameter groups (both rows)
    .venv/bin/python scripts/bench/bench_models.py --profile                  # torch.profiler tables, no timing
"""
from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "models"))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_overhead import (_logger, batch_order, bench, elasticflow_row, report)  # noqa: E402  the same driver, rows, log


# model name -> its model_args as command-line options, with their defaults
MODEL_ARGS = {"tiny_gpt": {"vocab": 1000, "width": 64, "layers": 2, "heads": 2},
              "small_resnet": {"width": 16, "blocks": 1, "samples": 2048}}


@dataclass
class Setup:
    model: str
    optimizer: str
    args: dict
    threads: int
    global_batch: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    log_every: int = 10  # elasticflow's default trainer.log_every; the hand-written loop logs as often
    no_decay: tuple = ()  # name patterns without weight decay: parameter groups in both rows
    log_file: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench_models_")) / "train.log")

    def model_args(self):
        return dict(self.args)

    def path(self) -> Path:
        return REPO / "models" / f"{self.model}.py"

    def module(self):
        """The model file, imported (models/ is on sys.path)."""
        return importlib.import_module(self.model)

    def overrides(self) -> List[str]:
        return ([f"+model_args.{k}={v}" for k, v in self.model_args().items()] +
                [f"optimizer={self.optimizer}", f"backend.threads={self.threads}", f"seed={self.seed}",
                 f"trainer.global_batch_size={self.global_batch}", f"optimizer.lr={self.lr}",
                 f"optimizer.weight_decay={self.weight_decay}", "checkpoint.interval.steps=1000000000",
                 *(["optimizer.momentum=0.9"] if self.optimizer == "sgd" else []),
                 *([f"optimizer.no_decay=[{','.join(self.no_decay)}]"] if self.no_decay else []),
                 "trainer.progress=false", "resume=none"])


def handwritten_torch(setup: Setup, total_steps: int) -> Iterator[None]:
    """What a user would write: resident tensors, index_select, forward/backward/step/zero_grad."""
    import torch
    from omegaconf import OmegaConf

    log = _logger(setup)
    torch.set_num_threads(setup.threads)
    cfg = OmegaConf.create({"seed": setup.seed, "model_args": setup.model_args()})
    mod = setup.module()
    net = mod.model(cfg)
    x, y = (torch.from_numpy(a) for a in mod.data(cfg))
    opt = _torch_optimizer(setup, _groups(setup, net))
    for step, positions in batch_order(len(x), setup.global_batch, setup.seed, total_steps):
        idx = torch.from_numpy(positions)
        loss = mod.forward(x.index_select(0, idx), y.index_select(0, idx), net)
        loss = loss["loss"] if isinstance(loss, dict) else loss  # small_resnet's forward adds an accuracy
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % setup.log_every == 0:
            log.info("step %d loss %.5g", step, loss.item())
        yield


def _groups(setup: Setup, net):
    """torch.optim's param groups for ``--no-decay``, picked by the rule optimizer.no_decay uses (a pattern
    in the name or the owning module's class): what a user writes by hand, the Hugging Face habit."""
    from elasticflow.optim import matches

    if not setup.no_decay:
        return list(net.parameters())
    owners = {f"{m_name}.{n}" if m_name else n: type(m).__name__
              for m_name, m in net.named_modules() for n, _ in m.named_parameters(recurse=False)}
    plain = [(n, p) for n, p in net.named_parameters()]
    off = {n for n, _ in plain if any(matches(pat, n, owners.get(n, "")) for pat in setup.no_decay)}
    return [{"params": [p for n, p in plain if n not in off]},
            {"params": [p for n, p in plain if n in off], "weight_decay": 0.0}]


def _torch_optimizer(setup: Setup, params):
    import torch

    if setup.optimizer == "sgd":  # the same row for SGD with momentum 0.9 (--optimizer sgd)
        return torch.optim.SGD(params, lr=setup.lr, momentum=0.9, weight_decay=setup.weight_decay)
    cls = torch.optim.AdamW if setup.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=setup.lr, weight_decay=setup.weight_decay)


def rows(setup: Setup):
    return {"hand-written torch": handwritten_torch, "elasticflow torch": elasticflow_row("torch", setup.path())}


def _gradients(setup: Setup):
    """The model and one fixed gradient per parameter (from one real backward), for the update-only rows."""
    import torch
    from omegaconf import OmegaConf

    from elasticflow.backends.common import split_output

    cfg = OmegaConf.create({"seed": setup.seed, "model_args": setup.model_args()})
    mod = setup.module()
    net = mod.model(cfg)
    x, y = (torch.from_numpy(a[:setup.global_batch]) for a in mod.data(cfg))
    split_output(mod.forward(x, y, net))[0].backward()  # small_resnet's forward adds an accuracy
    return mod, net, [p.grad.clone() for p in net.parameters()]


def torch_optim_update(setup: Setup, total_steps: int) -> Iterator[None]:
    """torch.optim's step alone on fixed gradients: the update a hand-written loop pays."""
    import torch

    torch.set_num_threads(setup.threads)
    _, net, grads = _gradients(setup)
    for p, g in zip(net.parameters(), grads):
        p.grad = g
    opt = _torch_optimizer(setup, _groups(setup, net))
    for _ in range(total_steps):
        opt.step()
        yield


def engine_update(setup: Setup, total_steps: int) -> Iterator[None]:
    """elasticflow's Engine.apply alone on the same fixed gradients."""
    import torch

    from elasticflow import optim
    from elasticflow.backends.torch import Engine

    torch.set_num_threads(setup.threads)
    mod, net, grads = _gradients(setup)
    if setup.optimizer == "sgd":  # as _torch_optimizer's
        spec = optim.SGD(setup.lr, momentum=0.9, weight_decay=setup.weight_decay, no_decay=setup.no_decay)
    else:
        cls = optim.AdamW if setup.optimizer == "adamw" else optim.Adam
        spec = cls(setup.lr, weight_decay=setup.weight_decay, no_decay=setup.no_decay)
    engine = Engine(net, mod.forward, spec)
    by_name = {n: g for (n, _), g in zip(net.named_parameters(), grads)}  # the engine's order: grouped
    engine.grad_view().copy_(torch.cat([by_name[n].reshape(-1) for n, _ in engine.flat_layout()]))
    for _ in range(total_steps):
        engine.apply(setup.lr)
        yield


UPDATE_ROWS = {"torch.optim step": torch_optim_update, "elasticflow apply": engine_update}


def profile(setup: Setup, steps: int = 30) -> None:
    """torch.profiler's table for each row over ``steps`` steps after 20 warm-up steps."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for name, row in rows(setup).items():
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
    p.add_argument("--model", default="tiny_gpt", choices=sorted(MODEL_ARGS))
    names = dict.fromkeys(k for d in MODEL_ARGS.values() for k in d if k != "vocab")
    for name in names:  # each model's default where not given
        p.add_argument(f"--{name}", type=int, default=None,
                       help="default " + ", ".join(f"{m}: {d[name]}" for m, d in MODEL_ARGS.items() if name in d))
    p.add_argument("--vocab", type=int, nargs="+", default=[1000, 50257], help="tiny_gpt's; one run each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--chunk-steps", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="print torch.profiler tables instead of timing")
    p.add_argument("--no-decay", nargs="*", default=[], metavar="PATTERN",
                   help="parameters without weight decay (optimizer.no_decay): two parameter groups in every row")
    p.add_argument("--update-only", action="store_true",
                   help="time the optimizer update alone (fixed gradients), torch.optim against Engine.apply")
    args = p.parse_args(argv)
    defaults = MODEL_ARGS[args.model]
    for vocab in args.vocab if "vocab" in defaults else [None]:
        model_args = {k: (vocab if k == "vocab" else getattr(args, k) if getattr(args, k) is not None else d)
                      for k, d in defaults.items()}
        setup = Setup(args.model, args.optimizer, model_args, args.threads, args.global_batch,
                      no_decay=tuple(args.no_decay))
        print(f"{args.model} {' '.join(f'{k}={v}' for k, v in model_args.items())}, global batch "
              f"{setup.global_batch}, {args.optimizer}(lr={setup.lr}, weight_decay={setup.weight_decay}"
              f"{', no_decay=' + str(list(setup.no_decay)) if setup.no_decay else ''}), "
              f"{args.threads} thread(s); {args.chunks} interleaved chunks of {args.chunk_steps} steps after "
              f"{args.warmup} warm-up steps; ratios to the first row")
        if args.profile:
            profile(setup)
        elif args.update_only:
            print("  the update alone")
            report(bench(setup, args.warmup, args.chunks, args.chunk_steps, UPDATE_ROWS))
        else:
            report(bench(setup, args.warmup, args.chunks, args.chunk_steps, rows(setup)))


if __name__ == "__main__":
    main()
