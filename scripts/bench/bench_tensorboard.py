"""The step-time cost of TensorBoard logging: trainer.loggers=[tensorboard] vs [], trainer.log_every=1.

    .venv/bin/python scripts/bench/bench_tensorboard.py                 # digits MLP, 5 rounds of 4000 steps
    .venv/bin/python scripts/bench/bench_tensorboard.py --rounds 9 --hidden 1024

Both rows train models/digits_mlp.py in this process (1 worker, 1 thread) with every step logged
(metrics.jsonl, and with TensorBoard on, its event file). A row's figure is the median of
metrics.jsonl's ``step_time_s`` after ``--warmup`` steps; rounds alternate which row goes first; the
ratio is on/off of the medians over rounds. Target: <= 1.02. The sidecar process starts with the first
logged step (~0.5 s of CPU: Python and tensorboard's imports), so a run of a few hundred 0.3 ms steps
measures its start-up beside training, not its steady cost: hence the default of 4000 steps, 1000 left out.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def run(run_dir: Path, board: bool, steps: int, hidden: int, warmup: int) -> float:
    from elasticflow.config.schema import compose
    from elasticflow.trainer import ElasticTrainer

    model = str(REPO / "models" / "digits_mlp.py")
    cfg = compose(model, [f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.progress=false",
                          f"trainer.loggers={'[tensorboard]' if board else '[]'}", "backend.threads=1",
                          "checkpoint.interval.steps=null", f"+model_args.hidden={hidden}"])
    ElasticTrainer(model, cfg, run_dir=str(run_dir)).fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["step_time_s"] for r in records if "step_time_s" in r][warmup:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=64)
    args = p.parse_args()
    logging.getLogger("elasticflow").setLevel(logging.WARNING)
    rows = {"tensorboard off": [], "tensorboard on": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for name in (list(rows) if r % 2 == 0 else list(reversed(rows))):
                rows[name].append(run(Path(d) / f"{name[-3:].strip()}{r}", name.endswith("on"), args.steps,
                                      args.hidden, args.warmup))
    off = statistics.median(rows["tensorboard off"])
    print(f"{time.strftime('%Y-%m-%d')}: digits MLP hidden {args.hidden}, log_every=1, {args.steps} steps x "
          f"{args.rounds} rounds, median step time")
    for name, values in rows.items():
        t = statistics.median(values)
        print(f"  {name:16s} {t * 1e3:7.3f} ms   {t / off:5.3f}x   (rounds: {', '.join(f'{v * 1e3:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
