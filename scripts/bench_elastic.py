"""Elastic training against torchrun + DDP: steady-state speed and recovery from a SIGKILLed worker.

    .venv/bin/python scripts/bench_elastic.py             # 5 min of CPU: ~4 min on 2 idle cores, 9 at load 7
    .venv/bin/python scripts/bench_elastic.py --quick     # 1 round, 2 kills, 1 restart: a smoke run
    .venv/bin/python scripts/bench_elastic.py --parts 2 3 --kills 9 --keep runs/bench   # recovery only

Every comparison is against a baseline measured in the same run, on the same machine:

1. Throughput. ``elasticflow train models/digits_mlp.py launcher.workers=2`` against
   ``torchrun --nproc_per_node=2 --standalone scripts/bench/ddp_digits.py`` (gloo, DDP, one thread per
   process, as elasticflow picks for 2 workers on 2 cores): same MLP and initial weights, global batch
   64 (32 per worker, short last batch dropped), SGD lr 0.1. A step's time is the gap between
   consecutive steps' wall-clock ``time`` in RUN_DIR/metrics.jsonl (trainer.log_every=1) and between
   consecutive loop iterations in the DDP script; start-up and the first ``--warmup`` steps are left
   out. Rounds alternate which goes first; the figure is the median over steps, then over rounds.
   Also the CPU time per step and process (all threads; /proc for elasticflow's workers,
   time.process_time() in the DDP script), which a busy machine disturbs far less than wall time.
   1-process elasticflow (cores // 1 threads) is printed for reference.
2. Recovery. 3 elasticflow workers; once step ``--kill-at`` (+ an offset that walks through a
   checkpoint interval) is logged, SIGKILL one worker by its pid from RUN_DIR/workers.json (the
   victim's rank rotates 1, 2, 0, ...). Latency: from the SIGKILL to the first metrics.jsonl record
   written after it by the survivors (``world_size`` 2). Steps redone and roll-forward: the
   "recovered" event in RUN_DIR/events.jsonl (whose steps_redone is 1 for every unplanned failure,
   also when the survivors rolled forward and redid nothing: an upper bound).
3. The same kill under torchrun's restart-based recovery (scripts/bench/torchrun_restart.py: DDP,
   torch.save every 10 steps, resume on restart; ``--max-restarts=3``, c10d rendezvous on
   127.0.0.1). Latency: from the SIGKILL to the first step past the highest step completed before
   it. Steps redone: that highest step minus the checkpoint step the restart resumed from.

Note: on a shared machine single runs are noisy: every figure is a median, and the load average
is printed. Every subprocess has a timeout and is reaped; the temp dir is removed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from bench.runfiles import jsonl  # scripts/bench/runfiles.py (this file's folder, scripts/, is on sys.path)

REPO = Path(__file__).resolve().parents[1]
MODEL = "models/digits_mlp.py"
DDP_SCRIPT = "scripts/bench/ddp_digits.py"
RESTART_SCRIPT = "scripts/bench/torchrun_restart.py"
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]  # what the `torchrun` entry point runs
GLOBAL_BATCH = 64
CKPT_EVERY = 10           # torchrun baseline's checkpoint interval (steps)
RUN_TIMEOUT_S = 150       # any one run; a hung run is killed and reported, not waited on
RESTART_TIMEOUT_S = 90    # a torchrun run, from the kill to its end (restarts included)
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    pass


# ---------------------------------------------------------------- processes
def _env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EF_PROBE_", "ELASTICFLOW_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _stat(pid: int) -> List[str]:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ...]; [] if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _descendants(pid: int) -> List[int]:
    """Every live descendant of ``pid`` (the agent's workers and torchrun's run in their own sessions)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if len(fields) > 1:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Proc:
    """A child in its own session, output to a file; ``close()`` kills it and all it started, by pid."""

    def __init__(self, cmd: List[str], log: Path):
        self.cmd, self.log = cmd, log
        self._out = open(log, "w")
        self.p = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=self._out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self.children: List[int] = []  # pids read from the run's files, in case they outlive their parent

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise BenchError(f"{' '.join(self.cmd[2:5])} ... did not finish in {timeout:.0f}s; killed "
                             f"(log tail: {self.tail()!r})")

    def tail(self, n: int = 400) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.is_file() else ""

    def close(self) -> None:
        if self.p.poll() is None:
            self.children += _descendants(self.p.pid)
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        for pid in self.children:
            if _stat(pid) and _stat(pid)[0] != "Z":
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._out.close()


def run_to_end(cmd: List[str], log: Path, timeout: float = RUN_TIMEOUT_S) -> None:
    proc = Proc(cmd, log)
    try:
        rc = proc.wait(timeout)
    finally:
        proc.close()
    if rc != 0:
        raise BenchError(f"{' '.join(cmd[2:6])} ... exited {rc}: {proc.tail()}")


def wait_until(predicate, timeout: float, what: str, proc: Proc, poll_s: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.p.poll() is not None:
            raise BenchError(f"the run exited ({proc.p.returncode}) before {what}: {proc.tail()!r}")
        time.sleep(poll_s)
    raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- reading what runs wrote
def train_records(run_dir: Path) -> List[dict]:
    return [r for r in jsonl(run_dir / "metrics.jsonl") if "loss" in r and "time" in r]


class Tail:
    """The highest step in a growing metrics.jsonl, read incrementally (the kill trigger polls it)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.step, self.partial = path, 0, 0, ""

    def __call__(self) -> int:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return 0
        *lines, self.partial = (self.partial + chunk).split("\n")
        for line in lines:
            if '"loss"' in line:
                self.step = max(self.step, json.loads(line)["step"])
        return self.step


def step_gaps_ms(times: List[float], warmup: int) -> List[float]:
    t = times[warmup:]
    return [(b - a) * 1e3 for a, b in zip(t, t[1:])]


def med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------- 1. throughput
def ef_cmd(run_dir: Path, workers: int, *overrides: str) -> List[str]:
    return [PY, "-m", "elasticflow.cli", "train", MODEL, f"hydra.run.dir={run_dir}", f"launcher.workers={workers}",
            f"trainer.global_batch_size={GLOBAL_BATCH}", "optimizer.lr=0.1", "trainer.log_every=1",
            "trainer.progress=false", *overrides]


def cpu_seconds(pids: List[int]) -> float:
    """User + system CPU time of ``pids`` (every thread), or NaN if one has exited."""
    total = 0.0
    for pid in pids:
        fields = _stat(pid)
        if len(fields) < 13 or fields[0] == "Z":
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def ef_throughput(tmp: Path, name: str, workers: int, hidden: int, args) -> dict:
    run = tmp / name
    # drop_last: every step has 64 samples, as in the DDP script (the digits' last batch has 29)
    proc = Proc(ef_cmd(run, workers, f"trainer.max_steps={args.steps}", "trainer.drop_last=true",
                       *([] if hidden == 64 else [f"+model_args.hidden={hidden}"])), tmp / f"{name}.log")
    try:
        tail = Tail(run / "metrics.jsonl")
        wait_until(lambda: tail() >= args.warmup, RUN_TIMEOUT_S, f"step {args.warmup}", proc)
        # 1 worker trains inside the CLI process; more are the agent's children, listed in workers.json
        pids = [m["pid"] for m in json.loads((run / "workers.json").read_text())["members"]] if workers > 1 \
            else [proc.p.pid]
        proc.children = pids
        cpu0, step0 = cpu_seconds(pids), tail()
        # CPU time is sampled while the workers still train: the last steps are left out
        wait_until(lambda: tail() >= args.steps - 40, RUN_TIMEOUT_S, f"step {args.steps - 40}", proc)
        cpu1, step1 = cpu_seconds(pids), tail()
        rc = proc.wait(RUN_TIMEOUT_S)
    finally:
        proc.close()
    if rc != 0:
        raise BenchError(f"{name}: exited {rc}: {proc.tail()}")
    recs = train_records(run)
    if [r["step"] for r in recs] != list(range(1, args.steps + 1)):
        raise BenchError(f"{name}: expected steps 1..{args.steps} in metrics.jsonl")
    gaps = step_gaps_ms([r["time"] for r in recs], args.warmup)
    inside = [r["step_time_s"] * 1e3 for r in recs[args.warmup:] if "step_time_s" in r]
    return {"ms": med(gaps), "mean_ms": statistics.fmean(gaps), "inside_ms": med(inside),
            "cpu_ms": (cpu1 - cpu0) * 1e3 / max(1, step1 - step0) / len(pids)}


def ddp_cmd(hidden: List[int], steps: int, out: Path) -> List[str]:
    return TORCHRUN + ["--nproc_per_node=2", "--standalone", DDP_SCRIPT, "--hidden", *map(str, hidden),
                       "--steps", str(steps), "--global-batch", str(GLOBAL_BATCH), "--out", str(out)]


def ddp_throughput(tmp: Path, name: str, args) -> Dict[int, dict]:
    """Every width in one torchrun (one start-up): {width: {"ms", "mean_ms"}}."""
    out = tmp / f"{name}.json"
    run_to_end(ddp_cmd(args.hidden, args.steps, out), tmp / f"{name}.log")
    data = json.loads(out.read_text())
    results = {}
    for hidden in args.hidden:
        ends, cpu = data["ends"][str(hidden)], data["cpu"][str(hidden)]
        gaps = step_gaps_ms(ends, args.warmup)
        last = len(cpu) - 40  # the same window as elasticflow's CPU sample
        results[hidden] = {"ms": med(gaps), "mean_ms": statistics.fmean(gaps),
                           "cpu_ms": (cpu[last] - cpu[args.warmup]) * 1e3 / (last - args.warmup)}
    return results


def throughput(tmp: Path, args) -> Dict[int, dict]:
    ef: Dict[int, List[dict]] = {h: [] for h in args.hidden}
    ddp: Dict[int, List[dict]] = {h: [] for h in args.hidden}
    for r in range(args.rounds):
        # Alternate which goes first, so a change in the machine's load hits both.
        for kind in (("ef", "ddp") if r % 2 == 0 else ("ddp", "ef")):
            if kind == "ddp":
                for hidden, res in ddp_throughput(tmp, f"ddp-r{r}", args).items():
                    ddp[hidden].append(res)
                    print(f"  round {r} hidden {hidden:5d}: torchrun+DDP, 2 processes {res['ms']:6.2f} ms/step "
                          f"(mean {res['mean_ms']:.2f}; CPU {res['cpu_ms']:.2f} ms/step/process)", flush=True)
                continue
            for hidden in args.hidden:
                res = ef_throughput(tmp, f"ef2-h{hidden}-r{r}", 2, hidden, args)
                ef[hidden].append(res)
                print(f"  round {r} hidden {hidden:5d}: elasticflow, 2 workers  {res['ms']:6.2f} ms/step "
                      f"(mean {res['mean_ms']:.2f}; CPU {res['cpu_ms']:.2f} ms/step/process; inside train_step "
                      f"{res['inside_ms']:.2f})", flush=True)
    first = args.hidden[0]
    one = ef_throughput(tmp, f"ef1-h{first}", 1, first, args)
    print(f"  hidden {first:5d}: elasticflow, 1 process, {os.cpu_count()} threads {one['ms']:6.2f} ms/step", flush=True)
    return {h: {"ef": med([x["ms"] for x in ef[h]]), "ddp": med([x["ms"] for x in ddp[h]]),
                "ef_cpu": med([x["cpu_ms"] for x in ef[h]]), "ddp_cpu": med([x["cpu_ms"] for x in ddp[h]]),
                "ef1": one["ms"] if h == first else None} for h in args.hidden}


# ---------------------------------------------------------------- 2. elasticflow recovery
@dataclass
class Kill:
    ok: bool
    latency_s: float = float("nan")      # SIGKILL -> the survivors' first completed step
    steps_redone: float = float("nan")
    note: str = ""
    extra: dict = field(default_factory=dict)


def kill_step(i: int, n: int, args) -> int:
    """Where kill ``i`` of ``n`` lands: offsets spread evenly over one checkpoint interval, so the
    torchrun baseline's redone steps are its average, not a lucky or unlucky phase."""
    return args.kill_at + int((i + 0.5) * CKPT_EVERY / n)


def ef_kill(tmp: Path, i: int, args) -> Kill:
    run = tmp / f"kill-{i}"
    at = kill_step(i, args.kills, args)
    steps = at + args.after_kill
    proc = Proc(ef_cmd(run, 3, f"trainer.max_steps={steps}"), tmp / f"kill-{i}.log")
    try:
        tail = Tail(run / "metrics.jsonl")
        wait_until(lambda: tail() >= at, RUN_TIMEOUT_S, f"step {at}", proc)
        members = json.loads((run / "workers.json").read_text())["members"]
        proc.children = [m["pid"] for m in members]
        victim = members[[1, 2, 0][i % 3]]
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        rc = proc.wait(RUN_TIMEOUT_S)
    except BenchError as exc:  # a run that hangs or dies is a result to report, not the end of the benchmark
        return Kill(False, note=str(exc))
    finally:
        proc.close()
    if rc != 0:
        return Kill(False, note=f"exit {rc}: {proc.tail(300)!r}")
    recs = train_records(run)
    if sorted(r["step"] for r in recs) != list(range(1, steps + 1)):
        return Kill(False, note="metrics.jsonl does not hold every step exactly once")
    after = [r for r in recs if r["time"] > killed_at and r["world_size"] == 2]
    before = max((r["step"] for r in recs if r["time"] <= killed_at), default=0)
    events = jsonl(run / "events.jsonl")
    rec = [e for e in events if e["event"] == "recovered" and e["time"] > killed_at]
    if not after or not rec:
        return Kill(False, note="no step by the survivors, or no 'recovered' event, after the kill")
    left = [e["time"] - killed_at for e in events if e["event"] == "left" and e.get("pid") == victim["pid"]]
    first = min(after, key=lambda r: r["time"])
    return Kill(True, latency_s=first["time"] - killed_at, steps_redone=rec[0]["steps_redone"],
                extra={"rank": victim["rank"], "before": before, "noticed_s": left[0] if left else float("nan"),
                       "recovery_s": rec[0]["recovery_s"], "rolled_forward": bool(rec[0]["rolled_forward"])})


# ---------------------------------------------------------------- 3. torchrun restart recovery
def restart_cmd(port: int, i: int, out: Path, steps: int) -> List[str]:
    return TORCHRUN + ["--nproc_per_node=2", "--max-restarts=3", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench{i}", RESTART_SCRIPT,
                       "--dir", str(out), "--steps", str(steps), "--ckpt-every", str(CKPT_EVERY)]


def step_lines(out: Path) -> List[tuple]:
    """(kind, step, wall time, restart) from every rank's log; kind is "step" or "resume"."""
    lines = []
    for log in out.glob("log-*.txt"):
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                lines.append((parts[0], int(parts[1]), float(parts[2]), int(parts[3])))
    return lines


def torchrun_kill(tmp: Path, i: int, args) -> Kill:
    out = tmp / f"restart-{i}"
    out.mkdir()
    at = kill_step(i, args.restarts, args)
    steps = at + args.after_kill
    proc = Proc(restart_cmd(free_port(), i, out, steps), tmp / f"restart-{i}.log")
    rc, hung = None, ""
    try:
        def progress() -> int:
            return max((s for kind, s, _, _ in step_lines(out) if kind == "step"), default=0)
        try:
            wait_until(lambda: progress() >= at, RUN_TIMEOUT_S, f"step {at}", proc, poll_s=0.01)
        except BenchError as exc:
            return Kill(False, note=f"before the kill: {exc}", extra={"restarts": 0, "refused": 0})
        victim = int((out / "pid-0-1").read_text())
        proc.children = [victim, int((out / "pid-0-0").read_text())]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        try:
            rc = proc.wait(RESTART_TIMEOUT_S)
        except BenchError:  # a restart that never trains again is a result, not a crash of the benchmark
            hung = f"not finished {RESTART_TIMEOUT_S}s after the kill"
    finally:
        proc.close()
    text = proc.log.read_text(errors="replace")
    restarts = max(int(p.name.split("-")[1]) for p in out.glob("pid-*"))
    extra = {"restarts": restarts, "refused": text.count("Connection refused")}
    lines = step_lines(out)
    # Whatever the first attempt logged, it completed before the kill took effect.
    before = max(s for kind, s, _, r in lines if kind == "step" and r == 0)
    new = sorted((t, s, r) for kind, s, t, r in lines if kind == "step" and s > before and r > 0)
    if hung or rc != 0 or not new:
        return Kill(False, note=hung or (f"torchrun exit {rc}" if rc else "no step after the kill"), extra=extra)
    t_new, _, restart = new[0]
    resumed = min(s for kind, s, _, r in lines if kind == "resume" and r == restart)
    return Kill(True, latency_s=t_new - killed_at, steps_redone=before - resumed, extra={**extra, "before": before})


# ---------------------------------------------------------------- report
def summarize(kills: List[Kill]) -> dict:
    ok = [k for k in kills if k.ok]
    lat, redone = [k.latency_s for k in ok], [k.steps_redone for k in ok]
    return {"n": len(kills), "ok": len(ok), "lat_med": med(lat), "lat_max": max(lat, default=float("nan")),
            "redone_med": med(redone), "redone_max": max(redone, default=float("nan"))}


def report(argv: List[str], elapsed: float, loads, tp: Dict[int, dict], ef_kills: List[Kill],
           tr_kills: List[Kill]) -> None:
    """Print the markdown summary and whether elasticflow met its targets."""
    import torch

    ef, tr = summarize(ef_kills), summarize(tr_kills)
    print("\n## Summary\n")
    print(f"`{shlex.join(['.venv/bin/python', 'scripts/bench_elastic.py', *argv])}`: {elapsed:.0f} s, torch "
          f"{torch.__version__}, {os.cpu_count()} cores, load average {loads[0]:.1f} at start, {loads[1]:.1f} at "
          f"the end. Medians over steps and rounds; on a shared machine read the ratios, not the absolutes.\n")
    print("| measure | elasticflow | torchrun + DDP | elasticflow vs torchrun |")
    print("|---|---|---|---|")
    met = []
    for hidden, r in tp.items():
        met.append(r["ddp"] / r["ef"] >= 1.0)
        print(f"| ms/step, digits MLP (hidden {hidden}), 2 workers, batch 64 | {r['ef']:.2f} | {r['ddp']:.2f} | "
              f"throughput x{r['ddp'] / r['ef']:.2f} |")
        print(f"| CPU ms/step per process, hidden {hidden} | {r['ef_cpu']:.2f} | {r['ddp_cpu']:.2f} | "
              f"x{r['ef_cpu'] / r['ddp_cpu']:.2f} the CPU |")
        if r["ef1"] is not None:
            print(f"| ms/step, hidden {hidden}, 1 process (reference) | {r['ef1']:.2f} | | |")
    if ef_kills or tr_kills:
        met += [ef["lat_max"] <= 0.5, ef["redone_max"] <= 1, ef["ok"] == ef["n"]]
        print(f"| SIGKILL one worker -> next new step, s (median / max) | {ef['lat_med']:.2f} / {ef['lat_max']:.2f} "
              f"| {tr['lat_med']:.2f} / {tr['lat_max']:.2f} | "
              + (f"x{tr['lat_med'] / ef['lat_med']:.0f} sooner |" if tr["ok"] and ef["ok"] else "n/a |"))
        print(f"| steps redone (median / max) | {ef['redone_med']:g} / {ef['redone_max']:g} | "
              f"{tr['redone_med']:g} / {tr['redone_max']:g} | |")
        first_failed = sum(k.extra.get("restarts", 0) > 1 or not k.ok for k in tr_kills)
        print(f"| recoveries completed | {ef['ok']}/{ef['n']} (3 -> 2 workers, in-process) | {tr['ok']}/{tr['n']} "
              f"(restart of 2 workers; first restart failed in {first_failed}/{len(tr_kills)}) | |")
    print("\nTargets: throughput x >= 1.0; recovery <= 0.5 s and <= 1 step redone, every time.")
    print("Met." if all(met) else "NOT met: see the rows above.")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 1024], help="MLP widths for the throughput part")
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds (elasticflow and DDP alternate)")
    p.add_argument("--steps", type=int, default=600, help="steps per throughput run")
    p.add_argument("--warmup", type=int, default=50, help="steps left out at the start of each throughput run")
    p.add_argument("--kills", type=int, default=5, help="elasticflow runs, one SIGKILL each")
    p.add_argument("--restarts", type=int, default=3, help="torchrun runs, one SIGKILL each")
    p.add_argument("--kill-at", type=int, default=100, help="kill after this step (+ an offset < 10)")
    p.add_argument("--after-kill", type=int, default=100, help="steps to train after the kill step")
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4], choices=[1, 2, 3, 4],
                   help="which parts to run (4: a join of a 100 MB model, and a hung worker's detection)")
    p.add_argument("--joins", type=int, default=3, help="part 4: scale-ups measured (and joins - 1 hangs)")
    p.add_argument("--quick", action="store_true", help="1 round, 2 kills, 1 restart")
    p.add_argument("--keep", metavar="DIR", help="write the runs under DIR and keep them (default: a temp dir)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.kills, args.restarts = 1, 2, 1
    import torch

    started, load0 = time.monotonic(), os.getloadavg()[0]
    print(f"bench_elastic: torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} cores, "
          f"load average {load0:.1f}", flush=True)
    tp, ef_kills, tr_kills = {}, [], []
    with tempfile.TemporaryDirectory(prefix="bench_elastic_") as tmp_name:
        tmp = Path(args.keep or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        if 1 in args.parts:
            print("\n1. Throughput: median ms/step after warm-up", flush=True)
            try:
                tp = throughput(tmp, args)
            except BenchError as exc:
                print(f"  FAILED: {exc}", flush=True)
            print(f"   ({time.monotonic() - started:.0f} s so far)", flush=True)
        if 2 in args.parts:
            print("\n2. elasticflow, 3 workers: SIGKILL one by its pid from workers.json", flush=True)
            for i in range(args.kills):
                k = ef_kill(tmp, i, args)
                ef_kills.append(k)
                x = k.extra
                print(f"  kill {i}: " + (f"rank {x['rank']} after step {x['before']}: next step {k.latency_s:.3f} s "
                                         f"after the kill (agent noticed at {x['noticed_s']:.3f} s; event: "
                                         f"recovery_s {x['recovery_s']:.3f}, steps_redone {k.steps_redone:g}, "
                                         f"rolled_forward {x['rolled_forward']})" if k.ok else f"FAILED: {k.note}"),
                      flush=True)
            print(f"   ({time.monotonic() - started:.0f} s so far)", flush=True)
        if 3 in args.parts:
            print(f"\n3. torchrun, 2 workers, --max-restarts=3, checkpoint every {CKPT_EVERY} steps: SIGKILL local "
                  f"rank 1", flush=True)
            for i in range(args.restarts):
                k = torchrun_kill(tmp, i, args)
                tr_kills.append(k)
                refused = k.extra["refused"]
                print(f"  kill {i}: " + (f"after step {k.extra['before']}: next new step {k.latency_s:.3f} s after "
                                         f"the kill, {k.steps_redone:g} steps redone" if k.ok
                                         else f"FAILED: {k.note}")
                      + f"; {k.extra['restarts']} restart(s)"
                      + (f", 'Connection refused' x{refused} in its log" if refused else ""), flush=True)
        if 4 in args.parts:
            from bench.join import report as join_report  # scripts/bench/join.py

            print("\n4. Joining (scale 2 -> 3 workers, 100 MB model) and a SIGSTOPped worker", flush=True)
            print(join_report(1 if args.quick else args.joins), flush=True)
    report(argv, time.monotonic() - started, (load0, os.getloadavg()[0]), tp, ef_kills, tr_kills)
    return 0 if all(k.ok for k in ef_kills) else 1  # a target missed is a finding; a failed recovery is a bug


if __name__ == "__main__":
    sys.exit(main())
