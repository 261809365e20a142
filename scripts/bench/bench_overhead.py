"""Per-step cost of elasticflow's loop against a hand-written PyTorch loop on the same model and data.

Every row trains models/digits_mlp.py from the same initial arrays, with the same global batch, the
same per-step sample order (``elasticflow.data.permutation``), SGD with the same lr and momentum and
the same torch thread count, in one process. The rows run interleaved: chunk k of every row runs
before chunk k+1 of any, the order alternating, so load from other processes hits all rows alike.
The first ``--warmup`` steps are excluded (torch.optim imports torch._dynamo on its first step).
Figures are the median and the minimum over chunks of the per-step wall time and of this process's
CPU time, each with its ratio to the first row (on a shared machine the minima are the steadier).

Checkpointing is off while timing (``checkpoint.interval.steps`` is huge; ``finish()``, which writes
the final checkpoint, runs after the clock stops) and ``trainer.log_every`` keeps its default, its
step lines going to a log file as under the CLI.

    .venv/bin/python scripts/bench/bench_overhead.py                       # hidden 64 and 4096, 1 thread
    .venv/bin/python scripts/bench/bench_overhead.py --hidden 1024 --threads 2 --chunks 60

The TensorFlow group does the same against a hand-written ``tf.function`` + ``GradientTape`` loop
(the same update, torch's SGD-momentum formula, in one compiled step). elasticflow calls its compiled
step through the concrete function's flat entry point, which skips ~150 us of tf.function's Python
dispatch per call; a second hand-written row calls its step that way too, so elasticflow's ratio to
it is the cost of elasticflow's own loop alone. A last table times
elasticflow itself on both backends for every example model (interleaved too; ratio TF/torch).

    .venv/bin/python scripts/bench/bench_overhead.py --backends tensorflow --hidden 4096
    .venv/bin/python scripts/bench/bench_overhead.py --hidden --models digits_cnn.py   # only the per-model table

A row is a generator ``row(setup, total_steps)`` that yields after every optimizer step; add one to
a group in GROUPS and it is timed and compared against the group's first row.
"""
from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "digits_mlp.py"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "models"))  # the hand-written row imports digits_mlp, which imports _digits


@dataclass
class Setup:
    """What every row trains with."""
    hidden: int
    threads: int
    global_batch: int = 64
    lr: float = 0.1
    momentum: float = 0.9
    seed: int = 0
    log_every: int = 10  # elasticflow's default trainer.log_every; the hand-written loop logs as often
    log_file: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench_overhead_")) / "train.log")

    def overrides(self) -> List[str]:
        return [f"+model_args.hidden={self.hidden}", f"backend.threads={self.threads}", f"seed={self.seed}",
                f"trainer.global_batch_size={self.global_batch}", f"optimizer.lr={self.lr}",
                f"optimizer.momentum={self.momentum}", "checkpoint.interval.steps=1000000000",
                "trainer.progress=false", "resume=none"]


def _logger(setup: Setup) -> logging.Logger:
    """The 'elasticflow' logger writing to a file, as under the CLI (a console would time the terminal)."""
    log = logging.getLogger("elasticflow")
    if not log.handlers:
        handler = logging.FileHandler(setup.log_file)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


# ---------------------------------------------------------------- rows
Row = Callable[[Setup, int], Iterator[None]]


def batch_order(n: int, global_batch: int, seed: int, total_steps: int) -> Iterator[Tuple[int, "np.ndarray"]]:
    """(step, sample positions) of the first ``total_steps`` global batches in elasticflow's order: each
    epoch's ``data.permutation`` cut into global batches, the short last one kept. What every hand-written
    row (here and in bench_models.py) trains on."""
    from elasticflow.data.order import permutation

    step, epoch = 0, 0
    while True:
        order = permutation(n, seed, epoch)
        for start in range(0, n, global_batch):
            if step == total_steps:
                return
            step += 1
            yield step, order[start:start + global_batch]
        epoch += 1


def elasticflow_row(backend: str, model: Path = MODEL) -> Row:
    """The documented custom loop of ElasticTrainer (what ``fit()`` runs, without the progress bar)."""
    def row(setup: Setup, total_steps: int) -> Iterator[None]:
        from elasticflow.config.schema import compose
        from elasticflow.trainer import ElasticTrainer

        _logger(setup)
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = compose(str(model), setup.overrides() + [f"backend={backend}", f"trainer.max_steps={total_steps}"])
            t = ElasticTrainer(str(model), cfg, run_dir=run_dir)
            t.prepare()
            for epoch in t.epoch_range():
                with t.epoch(epoch):
                    for batch in t.batches():
                        with t.step():
                            t.train_step(batch)
                        yield
            t.finish()
    return row


def handwritten_torch(setup: Setup, total_steps: int) -> Iterator[None]:
    """What a user would write by hand: resident tensors, index_select, forward/backward/step/zero_grad."""
    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    import digits_mlp

    log = _logger(setup)
    torch.set_num_threads(setup.threads)
    torch.manual_seed(setup.seed)
    init = digits_mlp.model(OmegaConf.create({"seed": setup.seed, "model_args": {"hidden": setup.hidden}}))
    w1, b1, w2, b2 = (torch.tensor(a, requires_grad=True) for a in
                      (init["hidden"]["W"], init["hidden"]["b"], init["out"]["W"], init["out"]["b"]))
    x, y = (torch.from_numpy(a) for a in digits_mlp.data(None))
    opt = torch.optim.SGD([w1, b1, w2, b2], lr=setup.lr, momentum=setup.momentum)
    for step, positions in batch_order(len(x), setup.global_batch, setup.seed, total_steps):
        idx = torch.from_numpy(positions)
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        logits = torch.relu(xb @ w1 + b1) @ w2 + b2
        loss = F.cross_entropy(logits, yb)
        accuracy = (logits.argmax(-1) == yb).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % setup.log_every == 0:
            log.info("step %d loss %.5g accuracy %.4g", step, loss.item(), accuracy.item())
        yield


def handwritten_tensorflow(setup: Setup, total_steps: int, flat_call: bool = False) -> Iterator[None]:
    """The same by hand in TensorFlow: resident tensors, and one tf.function per step that gathers the
    batch, runs forward and GradientTape, and applies torch's SGD-momentum update to tf.Variables.

    ``flat_call``: call the step the way elasticflow's Engine does (``backends/tensorflow/compiled.py``:
    the concrete function's flat entry point, skipping tf.function's Python dispatch), so that the
    ratio of elasticflow to this row is the cost of elasticflow's own loop alone.
    """
    import tensorflow as tf
    from omegaconf import OmegaConf

    import digits_mlp

    log = _logger(setup)
    for setter, value in ((tf.config.threading.set_intra_op_parallelism_threads, setup.threads),
                          (tf.config.threading.set_inter_op_parallelism_threads, 1)):  # as elasticflow's setup()
        try:
            setter(value)
        except RuntimeError:  # fixed by whichever row ran TF first; the same values
            pass
    init = digits_mlp.model(OmegaConf.create({"seed": setup.seed, "model_args": {"hidden": setup.hidden}}))
    params = [tf.Variable(a) for a in (init["hidden"]["W"], init["hidden"]["b"], init["out"]["W"], init["out"]["b"])]
    w1, b1, w2, b2 = params
    buffers = [tf.Variable(tf.zeros_like(p)) for p in params]
    x, y = (tf.constant(a) for a in digits_mlp.data(None))
    lr, momentum = setup.lr, setup.momentum

    def train_step(idx):
        xb, yb = tf.gather(x, idx), tf.gather(y, idx)
        with tf.GradientTape() as tape:
            logits = tf.nn.relu(xb @ w1 + b1) @ w2 + b2
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1), yb), tf.float32))
        for p, g, buf in zip(params, tape.gradient(loss, params), buffers):
            buf.assign(buf * momentum + g)
            p.assign_sub(lr * buf)
        return loss, accuracy

    if flat_call:
        from elasticflow.backends.tensorflow.compiled import Compiled
        train_step = Compiled(train_step)
    else:
        train_step = tf.function(train_step)
    for step, positions in batch_order(len(x), setup.global_batch, setup.seed, total_steps):
        loss, accuracy = train_step(tf.constant(positions))
        if step % setup.log_every == 0:
            log.info("step %d loss %.5g accuracy %.4g", step, float(loss), float(accuracy))
        yield


# One group per backend, each timed on its own and compared against its first (hand-written) row.
GROUPS: Dict[str, Dict[str, Row]] = {
    "torch": {"hand-written torch": handwritten_torch, "elasticflow torch": elasticflow_row("torch")},
    "tensorflow": {"hand-written tensorflow": handwritten_tensorflow,
                   "hand-written, flat call": functools.partial(handwritten_tensorflow, flat_call=True),
                   "elasticflow tensorflow": elasticflow_row("tensorflow")},
}
ROWS: Dict[str, Row] = GROUPS["torch"]
EXAMPLE_MODELS = ["linear.py", "digits_mlp.py", "digits_cnn.py", "char_transformer.py"]


# ---------------------------------------------------------------- driver
@dataclass
class Timing:
    """Seconds per step over one chunk: wall clock, and this process's CPU time."""
    wall: float
    cpu: float


def bench(setup: Setup, warmup: int, chunks: int, chunk_steps: int, rows: Dict[str, Row] = None
          ) -> Dict[str, List[Timing]]:
    rows = ROWS if rows is None else rows
    total = warmup + chunks * chunk_steps
    loops = {name: row(setup, total) for name, row in rows.items()}
    for loop in loops.values():  # prepare() and the first steps (lazy imports, allocations), untimed
        for _ in range(warmup):
            next(loop)
    times: Dict[str, List[Timing]] = {name: [] for name in rows}
    for k in range(chunks):
        for name in (list(rows) if k % 2 == 0 else list(reversed(rows))):
            loop = loops[name]
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(chunk_steps):
                next(loop)
            times[name].append(Timing((time.perf_counter() - wall) / chunk_steps,
                                      (time.process_time() - cpu) / chunk_steps))
    for loop in loops.values():  # runs finish(): the final evaluation and checkpoint, untimed
        for _ in loop:
            pass
    return times


def report(times: Dict[str, List[Timing]]) -> None:
    """Median and minimum per-step wall and CPU time of each row, with ratios to the first row.

    The minimum is what a row costs when nothing else disturbs it (other load only adds time), so
    on a shared machine its ratio is the steadier figure; on an idle one the two agree.
    """
    def stats(ts: List[Timing]):
        return (statistics.median(t.wall for t in ts), min(t.wall for t in ts),
                statistics.median(t.cpu for t in ts), min(t.cpu for t in ts))

    base = stats(next(iter(times.values())))
    heads = ("wall median", "wall min", "cpu median", "cpu min")
    print(f"  {'ms/step (ratio)':<22}" + "".join(f"{h:>18}" for h in heads))
    for name, ts in times.items():
        cells = "".join(f"{v * 1e3:10.3f} ({v / b:5.3f})" for v, b in zip(stats(ts), base))
        print(f"  {name:<22}{cells}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="*", default=[64, 4096], help="MLP widths to time (none: skip)")
    p.add_argument("--backends", nargs="+", default=list(GROUPS), choices=list(GROUPS),
                   help="row groups for the MLP tables")
    p.add_argument("--models", nargs="*", default=EXAMPLE_MODELS,
                   help="example models for the torch-vs-tensorflow table (none: skip)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for every row (torch and TF)")
    p.add_argument("--warmup", type=int, default=30, help="untimed steps at the start of every row")
    p.add_argument("--chunks", type=int, default=40, help="timed chunks per row (the median is over these)")
    p.add_argument("--chunk-steps", type=int, default=10, help="steps per timed chunk")
    p.add_argument("--model-chunks", type=int, default=10, help="timed chunks per row in the per-model table")
    args = p.parse_args(argv)

    print(f"digits MLP, global batch 64, SGD(lr=0.1, momentum=0.9), {args.threads} thread(s); "
          f"{args.chunks} interleaved chunks of {args.chunk_steps} steps after {args.warmup} warm-up steps; "
          f"ratios to the first row")
    for hidden in args.hidden:
        for backend in args.backends:
            print(f"hidden={hidden} ({backend})")
            report(bench(Setup(hidden=hidden, threads=args.threads), args.warmup, args.chunks, args.chunk_steps,
                         GROUPS[backend]))
    if args.models:
        # Both backends in one process, interleaved: each Engine routes elasticflow.ops to its own backend.
        print(f"elasticflow per example model, global batch 64, SGD(lr=0.1, momentum=0.9) unless the model file "
              f"sets its optimizer; {args.model_chunks} chunks; ratio to torch")
        for model in args.models:
            print(f"{model}")
            rows = {f"elasticflow {b}": elasticflow_row(b, REPO / "models" / model) for b in GROUPS}
            report(bench(Setup(hidden=64, threads=args.threads), args.warmup, args.model_chunks, args.chunk_steps,
                         rows))


if __name__ == "__main__":
    main()
