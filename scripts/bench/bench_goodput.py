"""How close the goodput ledger's measured costs come to what they stand for (tests/test_goodput.py checks the
ledger's arithmetic exactly; these are timings, so they are printed here, never asserted):

    .venv/bin/python scripts/bench/bench_goodput.py            # ~2 min on 2 idle cores
    .venv/bin/python scripts/bench/bench_goodput.py --keep runs/goodput

1. A SIGKILL at step 15 of 3 workers whose forwards sleep 20 ms (tests/models/digits_probe.py): the redone
   step booked, against the killed attempt's compute (20 ms in forward; 420 ms when killed in the reduction,
   where the probe holds the others 0.4 s more), and against a median step's productive seconds.
2. 2 workers, launcher.min_workers=2, worker 1 killed at step 12, elastic.wait_s=1: the agent's wait below
   min_workers against elastic.wait_s, and the part of it booked as below_min.
3. A run stopped by Ctrl-C at step 10 and resumed: each job's productive seconds against the sum of its own
   steps' step_time_s (the ratio is the loop's cost around the steps), and the second job's startup.

Each figure is printed as a ratio to its baseline in the same run, with the load average: on a shared
machine single runs are noisy. Every subprocess has a timeout and is reaped.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "models" / "digits_probe.py"
COMMON = ["trainer.global_batch_size=64", "trainer.max_steps=40", "trainer.log_every=1", "trainer.progress=false",
          "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5"]


def launch(run: Path, *overrides: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "elasticflow.cli", "train", str(PROBE), f"hydra.run.dir={run}",
                             *COMMON, *overrides], env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SystemExit(f"error: a run did not finish in {timeout} s")


def jsonl(path: Path) -> list:
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def events(run: Path, kind: str) -> list:
    return [e for e in jsonl(run / "events.jsonl") if e.get("event") == kind]


def steps(run: Path) -> list:
    return [r for r in jsonl(run / "metrics.jsonl") if "loss" in r]


def ledger(run: Path) -> dict:
    return json.loads((run / "goodput.json").read_text())


def kill(root: Path) -> None:
    for where, attempt in (("forward", 0.02), ("reduction", 0.42)):
        run = root / f"kill-{where}"
        victim = "1" if where == "forward" else "0"
        code = finish(launch(run, "launcher.workers=3",
                             env={"EF_PROBE_KILL": f"{victim}:15:{where}", "EF_PROBE_SLEEP": "0.02"}))
        if code != 0:
            raise SystemExit(f"error: the run killed in {where} exited {code}; see {run}")
        redone = ledger(run)["seconds"]["redone"]
        per_step = sorted(r["train_s"] for r in steps(run))[len(steps(run)) // 2]
        print(f"kill in {where:<9}  redone {redone:.3f} s = {redone / attempt:.2f}x the attempt's compute "
              f"({attempt:.2f} s), {redone / per_step:.2f}x a median step ({per_step:.3f} s)")


def below_min(root: Path) -> None:
    run = root / "below-min"
    code = finish(launch(run, "launcher.workers=2", "launcher.min_workers=2", "elastic.wait_s=1",
                         env={"EF_PROBE_KILL": "1:12:forward"}))
    if code != 3:
        raise SystemExit(f"error: the run below min_workers exited {code}, not 3; see {run}")
    waited = events(run, "below_min")[0]["waited_s"]
    booked = ledger(run)["seconds"]["below_min"]
    print(f"below min_workers   waited {waited:.3f} s = {waited / 1.0:.2f}x elastic.wait_s; booked {booked:.3f} s "
          f"= {booked / waited:.3f} of the wait; rebuild left {ledger(run)['seconds']['rebuild']:.3f} s")


def resume(root: Path) -> None:
    run = root / "resume"
    first = launch(run, env={"EF_PROBE_SLEEP": "0.05"})
    deadline = time.monotonic() + 120
    while not any(r["step"] >= 10 for r in steps(run)):
        if time.monotonic() > deadline or first.poll() is not None:
            first.kill()
            raise SystemExit(f"error: job 1 did not reach step 10; see {run}")
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    if finish(first) != 130:
        raise SystemExit(f"error: job 1 did not stop on Ctrl-C; see {run}")
    if finish(launch(run, env={"EF_PROBE_SLEEP": "0.05"})) != 0:
        raise SystemExit(f"error: job 2 failed; see {run}")
    led, resumed = ledger(run), events(run, "ready")[1]["step"]
    mine = {0: steps(run)[:resumed], 1: steps(run)[resumed:]}
    for k, job in enumerate(led["jobs"]):
        stepping = sum(r["step_time_s"] for r in mine[k])
        print(f"job {k + 1} ({job['outcome']:<11})  productive {job['seconds']['productive']:.3f} s = "
              f"{job['seconds']['productive'] / stepping:.2f}x its steps' step_time_s ({stepping:.3f} s); "
              f"startup {job['seconds']['startup']:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="keep the runs in this (new) directory")
    ns = parser.parse_args()
    root = ns.keep or Path(tempfile.mkdtemp(prefix="bench_goodput-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; runs in {root}")
    kill(root)
    below_min(root)
    resume(root)
    if ns.keep is None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
