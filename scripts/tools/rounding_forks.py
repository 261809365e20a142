"""How far float32 rounding alone can move the chaos soak's model: replay its training in plain torch with
tiny relative noise on each step's gradient and count the replays that end more than 1e-5 away.

    .venv/bin/python scripts/tools/rounding_forks.py --lr 0.1 --steps 1200 --runs 40    # 10 of 40 end 1.95e-4 away
    .venv/bin/python scripts/tools/rounding_forks.py --lr 0.05 --steps 1200 --runs 40   # 0 of 40

The model and data are the soak's (tests/models/digits_probe.py: the digits MLP, hidden 64, seed 0, global
batch 64, SGD, the epochs' sample order from elasticflow.data.permutation). Any other order of summing a
step's gradient (more workers, micro-batches) perturbs it by about 1e-7 relative; where the trajectory
has a fork (a ReLU unit at its threshold), that perturbation picks the branch, and the final parameters
land on one of a few neighbouring points. A check against the 1-worker run with a tolerance below that
distance then fails with no fault anywhere (docs/benchmarks/history.md, "Rounding forks and the chaos soak").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "models")]

import _digits  # noqa: E402
import digits_mlp  # noqa: E402
from elasticflow.data.order import permutation  # noqa: E402

NAMES = ["hidden/W", "hidden/b", "out/W", "out/b"]


def initial(hidden: int = 64, seed: int = 0):
    """The soak's initial parameters, from digits_mlp.model itself, in NAMES order."""
    params = digits_mlp.model(SimpleNamespace(model_args={"hidden": hidden}, seed=seed))
    return [params[layer][name] for layer, name in (n.split("/") for n in NAMES)]


def replay(lr: float, steps: int, noise: float, seed: int, batch: int = 64):
    """The soak's training, each step's gradient times (1 + noise * N(0, 1)) elementwise; final parameters."""
    x, y = (torch.from_numpy(a) for a in _digits.train_split())
    gen = torch.Generator().manual_seed(seed)
    params = [torch.tensor(a, requires_grad=True) for a in initial()]
    step, epoch = 0, 0
    while step < steps:
        order = permutation(len(x), 0, epoch)
        for start in range(0, len(x), batch):
            if step == steps:
                break
            idx = order[start:start + batch]
            h = torch.relu(x[idx] @ params[0] + params[1])
            loss = torch.nn.functional.cross_entropy(h @ params[2] + params[3], y[idx])
            with torch.no_grad():
                for p, g in zip(params, torch.autograd.grad(loss, params)):
                    p -= lr * (g * (1 + noise * torch.randn(g.shape, generator=gen)) if noise else g)
            step += 1
        epoch += 1
    return [p.detach().numpy() for p in params]


def distance(got, want) -> float:
    """The soak's measure: the largest per-tensor ||got - want|| / ||want||."""
    return max(float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(got, want))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--runs", type=int, default=40, help="noisy replays (default 40)")
    ap.add_argument("--noise", type=float, default=1e-7, help="relative noise per gradient element (default 1e-7)")
    args = ap.parse_args()
    if args.runs < 1 or args.steps < 1 or not args.lr > 0 or args.noise < 0:
        print("error: --runs and --steps must be at least 1, --lr positive and --noise not negative\n"
              "hint: e.g. scripts/tools/rounding_forks.py --lr 0.05 --steps 1200 --runs 40", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    exact = replay(args.lr, args.steps, 0.0, 0)
    found = sorted(distance(replay(args.lr, args.steps, args.noise, s), exact) for s in range(args.runs))
    over = [d for d in found if d > 1e-5]
    print(f"lr {args.lr:g}, {args.steps} steps, noise {args.noise:g}: {len(over)} of {args.runs} replays end more "
          f"than 1e-5 from the noise-free one (largest {found[-1]:.2e}; the others within "
          f"{max([d for d in found if d <= 1e-5] or [0]):.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
