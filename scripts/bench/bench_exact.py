"""The price of ``trainer.reproducible`` (reproducible sums): step time against the default float32 reduction.

Each row trains one model with W workers twice, ``trainer.reproducible=false`` (the baseline) and ``true``,
with the same ``backend.threads`` (cores // workers, at least 1: what the default picks) so the ratio is the
reproducible sums' cost alone, not a thread count. The arms alternate within each round, the order flipping every
round, so load from other processes hits both alike. A figure is the median step time (``step_time_s`` of
metrics.jsonl, every step logged) after ``--warmup`` steps, the median over rounds; the ratio is reproducible
over default (above 1: the mode is slower). Bytes: what one step's sum holds per worker (the flat gradient and the
step's scalars: 4 bytes an element by default, 9 in the mode: the int8 window's MAX and one int64 SUM, or 17
where a sum has more than 2^11 terms: both int64 bins).

    .venv/bin/python scripts/bench/bench_exact.py                        # GPT-style decoder and wide MLP, 1/2/4 workers
    .venv/bin/python scripts/bench/bench_exact.py --models mlp --workers 2 --rounds 3 --steps 60

``--join``: stalls instead of the steady state. Each arm trains the wide MLP with 2 workers, grows to 3 after
step ``--join-at`` (``elasticflow scale``) and is stopped (Ctrl-C) ``--after`` steps with 3 later. Printed per
arm: the first step, the first step with 3 workers and the slowest step, each in ms and as a ratio to the run's
median step (the target: the slowest <= 10x), then the mode's first and join steps against the default's;
medians over rounds. ``--cold`` gives every run a fresh compiler cache (TORCHINDUCTOR_CACHE_DIR), so the mode's
kernels are built in the background during the run.

    .venv/bin/python scripts/bench/bench_exact.py --join --rounds 3
    .venv/bin/python scripts/bench/bench_exact.py --join --cold --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = {  # name -> (model file, its model_args, global batch, micro-batch)
    "gpt": ("models/tiny_gpt.py", {"vocab": 2048, "width": 192, "layers": 4, "heads": 4, "samples": 1024}, 16, 4),
    "mlp": ("models/digits_mlp.py", {"hidden": 4096}, 64, 16),
}


def command(model: str, workers: int, exact: bool, steps: int, threads: int, out: Path) -> list:
    path, args, batch, micro = MODELS[model]
    return [sys.executable, "-m", "elasticflow.cli", "train", str(REPO / path), f"launcher.workers={workers}",
            f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={micro}", f"trainer.max_steps={steps}",
            "trainer.log_every=1", "trainer.progress=false", "trainer.loggers=[]", "optimizer=adamw",
            f"backend.threads={threads}", f"trainer.reproducible={str(exact).lower()}",
            "checkpoint.interval.steps=100000", f"hydra.run.dir={out}",
            *[f"+model_args.{k}={v}" for k, v in args.items()]]


def records(out: Path) -> list:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def run(model: str, workers: int, exact: bool, steps: int, threads: int, folder: Path) -> float:
    """One training run; the median step time (seconds) after the warm-up."""
    out = folder / f"{model}-{workers}-{exact}"
    cmd = command(model, workers, exact, steps, threads, out)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    times = [r["step_time_s"] for r in records(out) if "step_time_s" in r and r["step"] > WARMUP]
    return statistics.median(times)


def grown(exact: bool, join_at: int, after: int, folder: Path, tag: str, env: dict) -> dict:
    """The wide MLP with 2 workers, scaled to 3 once step ``join_at`` is logged and stopped (Ctrl-C) ``after``
    steps with 3 later; its step times (seconds): the first, the first with 3 workers, the slowest and the median,
    over every step."""
    out = folder / f"join-{exact}-{tag}"
    cmd = command("mlp", 2, exact, 1_000_000, 1, out) + ["launcher.max_workers=3"]

    def logged(world: int = 0) -> int:
        return sum(1 for r in records(out) if "loss" in r and r.get("world_size", 0) >= world)

    def wait(what: str, done) -> None:
        deadline = time.time() + 600
        while not done():
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{' '.join(cmd)}: no {what} (see {log.name})")
            time.sleep(0.1)  # polling a file a benchmark waits for, not a test's synchronisation

    with open(folder / f"join-{exact}-{tag}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **env})
        try:
            wait(f"step {join_at}", lambda: logged() >= join_at)
            scaled = subprocess.run([sys.executable, "-m", "elasticflow.cli", "scale", str(out), "--workers", "3",
                                     "--wait", "0"], capture_output=True, text=True, cwd=REPO, timeout=120)
            if scaled.returncode != 0:
                raise SystemExit(f"elasticflow scale {out} failed: {scaled.stderr[-2000:]}")
            wait(f"{after} steps with 3 workers", lambda: logged(3) >= after)
            proc.send_signal(signal.SIGINT)  # Ctrl-C: the step ends, a checkpoint is written, exit 130
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode not in (0, 130):
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode} (see {log.name})")
    steps = [r for r in records(out) if "step_time_s" in r and "loss" in r]
    times = [r["step_time_s"] for r in steps]
    joined = next(r["step_time_s"] for r in steps if r["world_size"] == 3)
    return {"first": times[0], "join": joined, "slowest": max(times), "median": statistics.median(times)}


def join_main(a: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bench_exact_join_"))
    got = {False: [], True: []}
    for r in range(a.rounds):
        for exact in ((False, True) if r % 2 == 0 else (True, False)):
            env = {"TORCHINDUCTOR_CACHE_DIR": str(folder / f"cache-{r}-{exact}")} if a.cold else {}
            got[exact].append(grown(exact, a.join_at, a.after, folder, str(r), env))
            print(f"  round {r} {'reproducible' if exact else 'default'}: " +
                  ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in got[exact][-1].items()), flush=True)
    med = {e: {k: statistics.median(x[k] for x in got[e]) for k in got[e][0]} for e in got}
    print("| arm | median ms/step | first step | first step with 3 workers | slowest step | slowest / median |")
    print("|---|---|---|---|---|---|")
    for exact in (False, True):
        m = med[exact]
        print(f"| {'reproducible' if exact else 'default'} | {m['median'] * 1e3:.1f} | {m['first'] * 1e3:.0f} ms "
              f"({m['first'] / m['median']:.1f}x) | {m['join'] * 1e3:.0f} ms ({m['join'] / m['median']:.1f}x) | "
              f"{m['slowest'] * 1e3:.0f} ms | **{m['slowest'] / m['median']:.1f}x** |")
    print(f"reproducible / default: first step {med[True]['first'] / med[False]['first']:.2f}x, first step with 3 "
          f"workers {med[True]['join'] / med[False]['join']:.2f}x, median step "
          f"{med[True]['median'] / med[False]['median']:.2f}x ({a.rounds} rounds, medians; "
          f"{'cold' if a.cold else 'warm'} compiler cache)")


def elements(model: str) -> int:
    """The flat gradient's elements (from a 1-step run's checkpoint: its parameters)."""
    import numpy as np

    import elasticflow.checkpoint as ckpt

    folder = Path(tempfile.mkdtemp(prefix="bench_exact_size_"))
    run(model, 1, False, WARMUP + 1, 1, folder)
    state = ckpt.load(ckpt.latest(folder / f"{model}-1-False" / "checkpoints"))
    return int(sum(np.size(v) for k, v in state.items() if not k.startswith(("optimizer/", "rng/"))))


def main() -> None:
    global WARMUP
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "mlp"], choices=list(MODELS))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--join", action="store_true", help="the stalls of a 2 -> 3 join, not the steady state")
    parser.add_argument("--join-at", type=int, default=20, help="--join: the step after which the third joins")
    parser.add_argument("--after", type=int, default=60, help="--join: steps with 3 workers before the stop")
    parser.add_argument("--cold", action="store_true", help="--join: a fresh compiler cache for every run")
    a = parser.parse_args()
    WARMUP = a.warmup
    if a.join:
        return join_main(a)
    folder = Path(tempfile.mkdtemp(prefix="bench_exact_"))
    print("| model | workers | default ms/step | reproducible ms/step | ratio | bytes summed per step (default / "
          "reproducible) |")
    print("|---|---|---|---|---|---|")
    for model in a.models:
        n = elements(model)
        for workers in a.workers:
            threads = max(1, (os.cpu_count() or 1) // workers)
            times = {False: [], True: []}
            for r in range(a.rounds):
                for exact in ((False, True) if r % 2 == 0 else (True, False)):
                    times[exact].append(run(model, workers, exact, a.steps, threads, folder))
            base, exact = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {model} ({n / 1e6:.2f}M) | {workers} | {base * 1e3:.1f} | {exact * 1e3:.1f} | "
                  f"**{exact / base:.2f}x** | {4 * n / 2**20:.1f} / {9 * n / 2**20:.1f} MiB |", flush=True)


WARMUP = 10

if __name__ == "__main__":
    main()
