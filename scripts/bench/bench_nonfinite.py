"""What the check of the summed gradient for NaN/inf costs a step: the same training with the check on and
off, interleaved in one process (scripts/bench/bench_overhead.py's driver: chunks alternate, warm-up excluded,
median and minimum per step, ratio to the first row).

The check (``grad_check.check`` -> ``Engine.grad_finite``: one sum over the flat gradient) runs on every
step that neither clips nor scales the loss; with ``trainer.grad_clip`` or float16 the norm already taken is
reused and there is nothing to time. The "off" row replaces its engine's ``grad_finite`` with a constant,
which is what a step did before the check. The model is models/char_transformer.py (written with
elasticflow.ops, so both backends run it) with its Adam; at the defaults, d_model 256 x 4 layers, 3.2M
parameters. A last line times ``grad_finite()`` alone on the trained engine, as a share of the step: the
steadier figure where the step's own noise is larger than the check.

    .venv/bin/python scripts/bench/bench_nonfinite.py
    .venv/bin/python scripts/bench/bench_nonfinite.py --backend tensorflow --chunks 10
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_overhead import _logger, bench, report  # noqa: E402  the same driver and log

MODEL = REPO / "models" / "char_transformer.py"


@dataclass
class Setup:
    backend: str
    d_model: int
    layers: int
    threads: int
    global_batch: int
    seed: int = 0
    engines: List[Any] = field(default_factory=list)  # the "on" row's engine, for the check alone
    log_file: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench_nonfinite_")) / "train.log")

    def overrides(self) -> List[str]:
        return [f"backend={self.backend}", f"+model_args.d_model={self.d_model}", f"+model_args.layers={self.layers}",
                f"backend.threads={self.threads}", f"seed={self.seed}",
                f"trainer.global_batch_size={self.global_batch}", "checkpoint.interval.steps=1000000000",
                "trainer.progress=false", "resume=none"]


def elasticflow_row(check: bool):
    """ElasticTrainer's documented custom loop; ``check=False`` switches the gradient check off."""
    def row(setup: Setup, total_steps: int) -> Iterator[None]:
        from elasticflow.config.schema import compose
        from elasticflow.trainer import ElasticTrainer

        _logger(setup)
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = compose(str(MODEL), setup.overrides() + [f"trainer.max_steps={total_steps}"])
            t = ElasticTrainer(str(MODEL), cfg, run_dir=run_dir)
            t.prepare()
            if check:
                setup.engines.append(t.engine)
            else:
                t.engine.grad_finite = lambda: True  # the instance's, not the class's: the other row keeps it
            for epoch in t.epoch_range():
                with t.epoch(epoch):
                    for batch in t.batches():
                        with t.step():
                            t.train_step(batch)
                        yield
            t.finish()
    return row


def check_alone(engine: Any, repeats: int = 200) -> float:
    """Median seconds of one ``grad_finite()`` on the engine's (last step's) gradient."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.grad_finite()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="torch", choices=["torch", "tensorflow"])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (torch and TF)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of every row")
    p.add_argument("--chunks", type=int, default=16, help="timed chunks per row (the median is over these)")
    p.add_argument("--chunk-steps", type=int, default=5, help="steps per timed chunk")
    args = p.parse_args(argv)

    setup = Setup(args.backend, args.d_model, args.layers, args.threads, args.global_batch)
    rows = {"check off": elasticflow_row(False), "check on": elasticflow_row(True)}
    times = bench(setup, args.warmup, args.chunks, args.chunk_steps, rows)
    engine = setup.engines[0]
    print(f"{MODEL.name} d_model={args.d_model} layers={args.layers} ({engine.num_params / 1e6:.1f}M parameters), "
          f"{args.backend}, global batch {args.global_batch}, {args.threads} thread(s); {args.chunks} interleaved "
          f"chunks of {args.chunk_steps} steps after {args.warmup} warm-up steps; ratios to 'check off'")
    report(times)
    on, off = ({k: statistics.median(getattr(t, k) for t in times[name]) for k in ("wall", "cpu")}
               for name in ("check on", "check off"))
    fastest = min(t.wall for t in times["check off"])  # the step least disturbed by other load
    alone = check_alone(engine)
    print(f"step time, check on / off: {on['wall'] / off['wall']:.3f}x median wall, "
          f"{on['cpu'] / off['cpu']:.3f}x median CPU")
    print(f"the check alone: {alone * 1e3:.3f} ms = {alone / fastest:.2%} of the fastest step ({fastest * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
