"""Issue #13's scenario, repeated: a 2-worker job scaled to 4 at a random step must reach 4 workers
and end with the 1-worker run's parameters, every time.

    .venv/bin/python scripts/bench/bench_scale.py              # 20 repetitions of 600 steps of ~40 ms
    .venv/bin/python scripts/bench/bench_scale.py --reps 5 --steps 300

Each repetition: ``elasticflow train tests/models/digits_probe.py launcher.workers=2
launcher.max_workers=4`` (EF_PROBE_SLEEP=0.04 in every forward), then ``elasticflow scale RUN_DIR
--workers 4`` once a random step in [10, 60] is logged. A repetition passes when `scale` said the
target was reached, the job exited 0, its last steps ran on 4 workers and its final parameters equal
the 1-worker run's (per tensor ||got - want|| / ||want|| <= 1e-5, SGD). Printed: the count of passes, and the slowest
time from the `scale` command to the agent's "formed" event of the 4-worker generation (events.jsonl).

Note: this is a correctness count with one timing; on a shared 2-core machine the time is noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "models" / "digits_probe.py"
CLI = [sys.executable, "-m", "elasticflow.cli"]
RTOL = 1e-5


def common(steps: int):
    return ["trainer.global_batch_size=64", f"trainer.max_steps={steps}", "trainer.log_every=1",
            "trainer.progress=false", "optimizer.lr=0.1", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5",
            "elastic.wait_s=30"]


def final_params(run: Path) -> dict:
    import elasticflow.checkpoint as ckpt

    state = ckpt.load(ckpt.latest(run / "checkpoints"))
    return {k: np.asarray(v) for k, v in state.items() if not k.startswith("rng/")}


def max_rel_diff(got: dict, want: dict) -> float:
    """max over tensors of ||got - want|| / ||want||: float32 sums in another order differ in the last
    bits of single elements (an element near zero has no useful relative error), not in the tensor."""
    return max(float(np.linalg.norm(got[k] - w) / max(np.linalg.norm(w), 1e-12))
               for k, w in want.items() if w.dtype.kind == "f")


def logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(x).get("step", 0) for x in lines if x.strip().endswith("}")]
    return max(steps or [0])


def events(run: Path) -> list:
    path = run / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def one(run: Path, steps: int, at_step: int, reference: dict, env: dict) -> dict:
    # Output to a file: a pipe read only at the end fills (64 KiB of step lines) and blocks every writer.
    output = run.parent / f"{run.name}.log"
    with open(output, "w") as sink:
        proc = subprocess.Popen(CLI + ["train", str(PROBE), f"hydra.run.dir={run}", *common(steps),
                                       "launcher.workers=2", "launcher.max_workers=4"],
                                env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while logged_step(run) < at_step and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        asked = time.time()
        try:
            scaled = subprocess.run(CLI + ["scale", str(run), "--workers", "4", "--wait", "120"], env=env,
                                    capture_output=True, text=True, timeout=200)
            proc.wait(timeout=600)
            out = output.read_text()
        except subprocess.TimeoutExpired as exc:  # a hung repetition is a failed one, not the end of the bench
            scaled = subprocess.CompletedProcess(exc.cmd, 124, "", f"timed out after {exc.timeout}s")
            out = f"timed out: {exc.cmd}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    formed = [e for e in events(run) if e["event"] == "formed" and e.get("world") == 4]
    worlds = [json.loads(x).get("world_size") for x in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x]
    diff = max_rel_diff(final_params(run), reference) if proc.returncode == 0 else float("inf")
    ok = (scaled.returncode == 0 and "4 workers" in scaled.stdout and proc.returncode == 0
          and worlds and worlds[-1] == 4 and diff <= RTOL)
    return {"ok": ok, "at_step": at_step, "scale_s": (formed[0]["time"] - asked) if formed else None,
            "rel_diff": diff, "scale_out": (scaled.stdout + scaled.stderr).strip()[-300:],
            "tail": "" if ok else out[-3000:], "superseded": sum(e["event"] == "superseded" for e in events(run))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--sleep", type=float, default=0.04, help="seconds per forward (EF_PROBE_SLEEP)")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EF_PROBE_SLEEP": str(args.sleep),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        ref_run = root / "reference"
        subprocess.run(CLI + ["train", str(PROBE), f"hydra.run.dir={ref_run}", *common(args.steps)], env=env,
                       check=True, capture_output=True, timeout=900)
        reference = final_params(ref_run)
        results = []
        for i in range(args.reps):
            r = one(root / f"rep{i}", args.steps, rng.randint(10, 60), reference, env)
            results.append(r)
            print(f"rep {i}: {'ok' if r['ok'] else 'FAILED'}  scale at step {r['at_step']}  "
                  f"scale->4-worker generation {r['scale_s'] if r['scale_s'] is None else round(r['scale_s'], 2)}s  "
                  f"superseded {r['superseded']}  max rel diff {r['rel_diff']:.2e}  [{r['scale_out']}]", flush=True)
            if not r["ok"]:
                print(r["tail"], flush=True)
    times = [r["scale_s"] for r in results if r["scale_s"] is not None]
    print(f"reached 4 workers with the 1-worker parameters: {sum(r['ok'] for r in results)}/{len(results)}; "
          f"slowest scale -> 4-worker generation formed: {max(times) if times else float('nan'):.2f}s "
          f"(median {sorted(times)[len(times) // 2] if times else float('nan'):.2f}s)")


if __name__ == "__main__":
    main()
