"""Training efficiency at a failure rate (issue 66's measure, torchft's figure): 4 workers, a SIGKILL of a random
member every 60 s and every 15 s, a replacement started as the dead worker's slot frees (launcher.restart_failed),
against the same run without failures.

    .venv/bin/python scripts/bench/bench_failure_rate.py                  # 3 runs of 10 minutes: ~32 min
    .venv/bin/python scripts/bench/bench_failure_rate.py --minutes 2      # a quick look

Each run: 4 workers of tests/models/digits_probe.py, 64 samples a step in micro-batches of 4 (16 a step, 4 a
worker), every micro-batch's forward sleeping 15 ms (EF_PROBE_DEVICE: a device's compute, which leaves the host's
CPU free, so that 4 workers on 2 cores behave as 4 devices: a step of ~70 ms with 4, and a member lost makes the
other 3 compute its micro-batches until its replacement joins), a checkpoint every 200 steps. The window starts at step 20 (the workers warm) and lasts
``--minutes``; the useful samples are the steps committed in it times the global batch, each sample once: a step
redone after a kill counts once. Efficiency is the failure run's useful samples per second over the failure-free
run's. A kill picks a random member from workers.json (never the same pid twice) and SIGKILLs it; the agent starts
a replacement, which joins at a step boundary.

Also printed per failure run, from the events: the steps redone, the survivors' recovery (detection to the first
step of the new generation, the step redone included), and a replacement's start (spawned to ready: Python, torch,
the model) and admission (waiting for a step boundary, and the state's transfer), which is what a failure still
costs here.

On this 2-core machine the host's CPU is shared: a replacement's start (forked from the zygote, which has torch
imported) takes CPU from the members for its first moments, which a dedicated host per worker would not.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from runfiles import jsonl, stop  # noqa: E402 - a leaf beside this script (skips a line torn by a SIGKILL)

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "models" / "digits_probe.py"
ELASTICFLOW = [sys.executable, "-m", "elasticflow.cli"]
BATCH = 64
WARM = 20  # steps before the window opens


def _records(run: Path, kind: str) -> list:
    path = run / kind
    return list(jsonl(path)) if path.is_file() else []


def _logged(run: Path) -> int:
    return max((r.get("step", 0) for r in _records(run, "metrics.jsonl") if "loss" in r), default=0)


def _members(run: Path) -> List[dict]:
    try:
        return json.loads((run / "workers.json").read_text())["members"]
    except (FileNotFoundError, ValueError, KeyError):
        return []


def run_once(root: Path, name: str, seconds: float, every: float, seed: int) -> Dict[str, float]:
    """One run: steps committed per second in its window, and what its failures cost."""
    run, rng = root / name, random.Random(seed)
    cmd = ELASTICFLOW + ["train", str(PROBE), f"hydra.run.dir={run}", "launcher.workers=4",
                         "launcher.restart_failed=true", "launcher.max_restarts=10000",
                         f"trainer.global_batch_size={BATCH}",
                         "trainer.micro_batch_size=4", "trainer.max_steps=1000000", "trainer.log_every=1",
                         "trainer.progress=false", "checkpoint.interval.steps=200", "backend.threads=1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", "EF_PROBE_DEVICE": "0.015"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed, kills = set(), 0
    try:
        deadline = time.monotonic() + 300
        while _logged(run) < WARM:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: {name} did not reach step {WARM}: see {run}/train.log")
            time.sleep(0.05)
        t0 = time.time()
        next_kill = t0 + every if every else float("inf")
        while time.time() < t0 + seconds:
            if proc.poll() is not None:
                raise SystemExit(f"error: {name} exited {proc.returncode} in its window: see {run}/train.log")
            if time.time() >= next_kill:
                live = [m for m in _members(run) if m.get("pid") and m["pid"] not in killed]
                if live:
                    victim = rng.choice(live)
                    try:
                        os.kill(victim["pid"], signal.SIGKILL)
                        killed.add(victim["pid"])
                        kills += 1
                    except ProcessLookupError:
                        pass
                next_kill += every
            time.sleep(0.05)
        t1 = time.time()
    finally:
        stop(proc, 120)
    steps = [r for r in _records(run, "metrics.jsonl") if "loss" in r and t0 <= r["time"] < t1]
    events = [e for e in _records(run, "events.jsonl") if t0 <= e["time"] < t1]
    recovered = [e for e in events if e["event"] == "recovered" and e.get("world_size", 0) < e.get(
        "previous_world_size", 0)]
    joins = [e for e in events if e["event"] == "joined"]
    full = sum(1 for r in steps if r.get("world_size") == 4) / max(1, len(steps))
    return {"steps": len({r["step"] for r in steps}), "seconds": t1 - t0, "kills": kills, "full": full,
            "redone": sum(e.get("steps_redone", 0) for e in recovered),
            "recovery_s": statistics.median([e.get("recovery_s", 0) + e.get("redone_s", 0) for e in recovered])
            if recovered else 0.0,
            "start_s": statistics.median([e.get("start_s", 0) for e in joins]) if joins else float("nan"),
            "admit_s": statistics.median([e.get("admit_s", 0) + e.get("transfer_s", 0) for e in joins])
            if joins else float("nan"),
            "joins": len(joins)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="each run's window (default 10)")
    ap.add_argument("--every", default="60,15", help="seconds between kills, one run each (default 60,15)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", metavar="DIR", help="run in DIR and keep the runs (default: a temporary folder)")
    args = ap.parse_args()
    seconds = args.minutes * 60
    try:
        periods = [float(x) for x in args.every.split(",") if x.strip()]
    except ValueError:
        raise SystemExit("error: --every takes seconds separated by commas, e.g. --every 60,15")
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="bench_failure_rate_")
          ) as tmp:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        base = run_once(Path(tmp), "baseline", seconds, 0.0, args.seed)
        rate = base["steps"] * BATCH / base["seconds"]
        print(f"no failures: {rate:.1f} samples/s ({base['steps']} steps in {base['seconds']:.0f} s, load "
              f"{os.getloadavg()[0]:.2f})", flush=True)
        for every in periods:
            got = run_once(Path(tmp), f"every{every:g}", seconds, every, args.seed)
            got_rate = got["steps"] * BATCH / got["seconds"]
            print(f"a kill every {every:g} s: {got_rate:.1f} samples/s, efficiency {got_rate / rate:.1%} "
                  f"({got['kills']} kills, {got['joins']} joins, {got['full']:.1%} of the steps at 4 workers, "
                  f"{got['redone']} steps redone, survivors' recovery "
                  f"{got['recovery_s']:.2f} s, a replacement's start {got['start_s']:.1f} s and admission with its "
                  f"state {got['admit_s']:.2f} s, medians; load "
                  f"{os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
