"""What making a 1-worker run growable costs: the same short job trained in-process (launcher.workers=1, the
default) and as an agent's job of one worker that `elasticflow scale` can grow (launcher.max_workers=3), run in
alternating order.

    .venv/bin/python scripts/bench/bench_growable.py                 # ~1 min on 2 idle cores
    .venv/bin/python scripts/bench/bench_growable.py --rounds 7 --steps 200

Prints each run's wall time and CPU seconds (the command and every process under it), then the medians and the
ratio growable / in-process. On a shared machine single runs are noisy: the medians of the same run are the figure.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench_startup import alternating, timed  # scripts/bench/ is the script's own directory, first on sys.path

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "digits_mlp.py"


def run_once(run: Path, growable: bool, steps: int) -> tuple:
    """(wall seconds, CPU seconds of the command and its descendants) of one job."""
    args = [sys.executable, "-m", "elasticflow.cli", "train", str(MODEL), f"hydra.run.dir={run}",
            f"trainer.max_steps={steps}", "trainer.progress=false", "trainer.loggers=[]"]
    if growable:
        args.append("launcher.max_workers=3")
    return timed(args, dict(os.environ))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be 1 or more")
    print(f"load average {os.getloadavg()[0]:.2f}; {args.steps} steps, {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        med = alternating(args.rounds, lambda r, growable: run_once(Path(tmp) / f"r{r}-g{growable}", growable,
                                                                   args.steps),
                          lambda r, growable: f"round {r} {'growable  ' if growable else 'in-process'}")
    print(f"in-process: wall {med[False][0]:.2f} s, cpu {med[False][1]:.2f} s; growable: wall {med[True][0]:.2f} s, "
          f"cpu {med[True][1]:.2f} s; ratio growable/in-process: wall {med[True][0] / med[False][0]:.2f}x, "
          f"cpu {med[True][1] / med[False][1]:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
