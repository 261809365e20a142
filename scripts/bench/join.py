"""Issue-5 figures for scripts/bench/bench_elastic.py: what a join costs, and how fast a hung worker is cut out.

- join: 2 workers train a 100 MB model; `elasticflow scale RUN --workers 3`; from the joiner's "joined"
  event: process start (Python, torch, model and data), admission, the wait for the survivors to finish
  the step they are in, group rebuild (from that step boundary) and state transfer, and the survivors'
  stall ("regrouped" event: rebuild + transfer as they see it); plus seconds from the scale command to
  the first step with 3.
- hang: 3 workers, one SIGSTOPped; seconds until the agent's "hung" event, against elastic.timeout_s.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runfiles import jsonl, stop  # scripts/bench/runfiles.py (this file's folder is on sys.path)

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "elasticflow.cli"]


def _wait(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(what)


def _start(run: Path, model: Path, *overrides: str, env=None) -> subprocess.Popen:
    cmd = CLI + ["train", str(model), f"hydra.run.dir={run}", "trainer.progress=false", "trainer.log_every=1",
                 *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})


def join_once(tmp: Path) -> dict:
    run = tmp / f"join-{time.monotonic_ns()}"
    proc = _start(run, REPO / "scripts/bench/models/wide_linear.py", "launcher.workers=2", "launcher.max_workers=3",
                  "trainer.global_batch_size=64", "trainer.max_steps=100000", "checkpoint.interval.steps=null",
                  "elastic.timeout_s=60", "elastic.heartbeat_timeout_s=20", "optimizer.lr=0.001")
    try:
        _wait(lambda: len([r for r in jsonl(run / "metrics.jsonl") if "loss" in r]) >= 3, 300, "first steps")
        asked = time.time()
        subprocess.run(CLI + ["scale", str(run), "--workers", "3", "--wait", "0"], check=True,
                       stdout=subprocess.DEVNULL, timeout=120)
        joined = _wait(lambda: [e for e in jsonl(run / "events.jsonl") if e["event"] == "joined"], 300, "join")[0]
        first = _wait(lambda: [r for r in jsonl(run / "metrics.jsonl") if r.get("world_size") == 3], 300,
                      "a step with 3 workers")[0]
        regrouped = _wait(lambda: [e for e in jsonl(run / "events.jsonl") if e["event"] == "regrouped"], 60,
                          "the survivors' regrouped event")[0]
        # The joiner is admitted mid-step; the survivors leave training at the step's end (the boundary,
        # regrouped's time - recovery_s). Until then the joiner's group build just waits for them.
        boundary = regrouped["time"] - regrouped["recovery_s"]
        group_ready = joined["time"] - joined["transfer_s"]
        admitted = group_ready - joined["rebuild_s"]
        return {"start_s": joined["start_s"], "admit_s": joined["admit_s"],
                "wait_for_step_boundary_s": max(0.0, boundary - admitted),
                "rebuild_s": group_ready - max(boundary, admitted), "transfer_s": joined["transfer_s"],
                "survivor_stall_s": regrouped["recovery_s"], "scale_to_first_step_s": first["time"] - asked}
    finally:
        stop(proc, 60)


def hang_once(tmp: Path, timeout_s: float = 10.0, heartbeat_s: float = 3.0) -> dict:
    run = tmp / f"hang-{time.monotonic_ns()}"
    proc = _start(run, REPO / "models/digits_mlp.py", "launcher.workers=3", "trainer.max_steps=100000",
                  f"elastic.timeout_s={timeout_s}", f"elastic.heartbeat_timeout_s={heartbeat_s}",
                  "checkpoint.interval.steps=null")
    try:
        _wait(lambda: len([r for r in jsonl(run / "metrics.jsonl") if "loss" in r]) >= 20, 300, "first steps")
        victim = json.loads((run / "workers.json").read_text())["members"][1]["pid"]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.time()
        hung = _wait(lambda: [e for e in jsonl(run / "events.jsonl") if e["event"] == "hung"], 120, "hung")[0]
        resumed = _wait(lambda: [r for r in jsonl(run / "metrics.jsonl")
                                 if r.get("world_size") == 2 and r["time"] > stopped], 120, "resumed")[0]
        return {"timeout_s": timeout_s, "heartbeat_timeout_s": heartbeat_s, "detect_s": hung["time"] - stopped,
                "stop_to_next_step_s": resumed["time"] - stopped}
    finally:
        stop(proc, 60)


def report(repeats: int = 3) -> str:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        joins = [join_once(tmp) for _ in range(repeats)]
        hangs = [hang_once(tmp) for _ in range(max(1, repeats - 1))]
    med = lambda rows, k: statistics.median(r[k] for r in rows if r[k] is not None)  # noqa: E731
    lines = ["| join of a 100 MB model (median of %d) | seconds |" % repeats, "|---|---|"]
    for k in ("start_s", "admit_s", "wait_for_step_boundary_s", "rebuild_s", "transfer_s", "survivor_stall_s",
              "scale_to_first_step_s"):
        lines.append(f"| {k} | {med(joins, k):.3f} |")
    lines.append(f"| rebuild + transfer (target <= 0.5) | {med(joins, 'rebuild_s') + med(joins, 'transfer_s'):.3f} |")
    lines += ["", "| hung worker (SIGSTOP) | seconds |", "|---|---|",
              f"| elastic.timeout_s / heartbeat_timeout_s | {hangs[0]['timeout_s']:g} / {hangs[0]['heartbeat_timeout_s']:g} |",
              f"| SIGSTOP -> cut out (median) | {med(hangs, 'detect_s'):.2f} |",
              f"| SIGSTOP -> survivors' next step (median) | {med(hangs, 'stop_to_next_step_s'):.2f} |"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
