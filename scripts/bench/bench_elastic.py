"""Elastic training against torchrun + DDP: steady-state speed and recovery from a SIGKILLed worker.

    .venv/bin/python scripts/bench/bench_elastic.py             # 5 min of CPU: ~4 min on 2 idle cores, 9 at load 7
    .venv/bin/python scripts/bench/bench_elastic.py --quick     # 1 round, 2 kills, 1 restart: a smoke run
    .venv/bin/python scripts/bench/bench_elastic.py --parts 2 3 --kills 9 --keep runs/bench   # recovery only
    .venv/bin/python scripts/bench/bench_elastic.py --parts 1 --rounds 3 --baseline-tree /tmp/before   # before/after

Every comparison is against a baseline measured in the same run, on the same machine:

1. Throughput. ``elasticflow train models/digits_mlp.py launcher.workers=2`` against
   ``torchrun --nproc_per_node=2 --standalone scripts/bench/baselines/ddp_digits.py`` (gloo, DDP, one thread per
   process, as elasticflow picks for 2 workers on 2 cores): same MLP and initial weights, global batch
   64 (32 per worker, short last batch dropped), SGD lr 0.1. elasticflow runs with its defaults
   (trainer.log_every=10, the TensorBoard sidecar on); a step's time is the mean over the window
   between two consecutive records' wall-clock ``time`` in RUN_DIR/metrics.jsonl, and over the same
   windows of the DDP script's loop iterations (``--log-every 1``: every step, with a record and an
   event for each, as measured before 2026-11-25); start-up and the first ``--warmup`` steps are left
   out. Rounds alternate which goes first; the figure is the median over windows, then over rounds.
   Also the CPU time per step and process (all threads; /proc for elasticflow's workers,
   time.process_time() in the DDP script), which a busy machine disturbs far less than wall time.
   1-process elasticflow (cores // 1 threads) is printed for reference.
   More rows (``--rows``; cnn and mlp4 by default): ``cnn``, models/small_resnet.py (ResNet-8 with 9 BatchNorm
   layers on 32x32x3 images, 78k parameters) with ``trainer.micro_batch_size=32`` against
   scripts/bench/baselines/ddp_resnet.py (plain DDP with BatchNorm: each rank's statistics over its 32 samples,
   rank 0's buffers broadcast every forward; not SyncBatchNorm); ``cnn4``, the same with 4 workers and
   micro-batches of 16 (DDP: 4 processes); ``mlp4``, 4 workers (torchrun: 4
   processes) on the first MLP width, more processes than cores.
   ``--baseline-tree DIR`` times elasticflow imported from DIR as well (e.g. ``git archive`` of an older
   commit), alternating with the rest in every round: a before/after against the same DDP runs.
2. Recovery. 3 elasticflow workers; once step ``--kill-at`` (+ an offset that walks through a
   checkpoint interval) is logged, SIGKILL one worker by its pid from RUN_DIR/workers.json (the
   victim's rank rotates 1, 2, 0, ...); ``--bucket-mb`` runs them with gradient buckets reduced while
   backward runs, so kills land with bucket reductions in flight. Latency: from the SIGKILL to the first metrics.jsonl record
   written after it by the survivors (``world_size`` 2). Steps redone and roll-forward: the
   "recovered" event in RUN_DIR/events.jsonl (whose steps_redone is 1 for every unplanned failure,
   also when the survivors rolled forward and redid nothing: an upper bound).
3. The same kill under torchrun's restart-based recovery (scripts/bench/baselines/torchrun_restart.py: DDP,
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

from runfiles import jsonl  # scripts/bench/runfiles.py (this file's folder, scripts/bench/, is on sys.path)

REPO = Path(__file__).resolve().parents[2]
MODEL = "models/digits_mlp.py"
DDP_SCRIPT = "scripts/bench/baselines/ddp_digits.py"
CNN_MODEL = "models/small_resnet.py"
CNN_DDP_SCRIPT = "scripts/bench/baselines/ddp_resnet.py"
RESTART_SCRIPT = "scripts/bench/baselines/torchrun_restart.py"
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
def _env(tree: Optional[str] = None) -> Dict[str, str]:
    """The children's environment: elasticflow imported from this repository, or from ``tree`` (another
    checkout, ``--baseline-tree``: its elasticflow package, with this repository's models and scripts).

    Note: PYTHONPATH alone does not choose the tree: ``python -m`` puts its working directory first on
    sys.path, so a child started in this repository imports this repository's elasticflow whatever
    PYTHONPATH says (until 2026-11-25 every --baseline-tree run timed this code twice). A child of
    the tree runs in the tree (``Proc``), and ``check_tree`` proves which package it imports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EF_PROBE_", "ELASTICFLOW_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, str(REPO), env.get("PYTHONPATH")) if p)
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

    def __init__(self, cmd: List[str], log: Path, tree: Optional[str] = None):
        self.cmd, self.log = cmd, log
        self._out = open(log, "w")
        self.p = subprocess.Popen(cmd, cwd=tree or REPO, env=_env(tree), stdout=self._out, stderr=subprocess.STDOUT,
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


def check_tree(tree: str) -> None:
    """Fail unless a child started as ``Proc`` starts one for ``tree`` imports elasticflow from ``tree``."""
    if not Path(tree, "elasticflow", "__init__.py").is_file():
        raise BenchError(f"--baseline-tree {tree}: no elasticflow/ package there; make one with "
                         f"`git archive COMMIT elasticflow conf | tar -x -C {tree}`")
    found = subprocess.run([PY, "-c", "import elasticflow; print(elasticflow.__file__)"], cwd=tree, env=_env(tree),
                           capture_output=True, text=True, timeout=120)
    where = Path(found.stdout.strip() or "?").resolve()
    if found.returncode != 0 or Path(tree).resolve() not in where.parents:
        raise BenchError(f"--baseline-tree {tree}: a child imports elasticflow from {where}, not from the tree "
                         f"({found.stderr.strip()[-300:]}); give a directory holding an elasticflow/ package "
                         f"(e.g. `git archive COMMIT elasticflow conf | tar -x -C DIR`)")


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


def window_ms(times: List[float], warmup: int, every: int) -> List[float]:
    """Mean ms/step over each window of ``every`` steps after ``warmup``; ``times[i]`` is step i + 1's end."""
    return [(times[i + every] - times[i]) * 1e3 / every for i in range(warmup - 1, len(times) - every, every)]


def med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------- 1. throughput
@dataclass
class Row:
    """One throughput comparison: elasticflow with ``workers`` workers on ``model`` against torchrun + DDP."""
    key: str
    label: str              # the summary's words for it
    workers: int
    model: str
    overrides: List[str]
    steps: int
    warmup: int
    ddp: List[str]          # the DDP script and its arguments (torchrun's --nproc_per_node is ``workers``)


def rows_of(args) -> List[Row]:
    rows = [Row(f"mlp{h}", f"digits MLP (hidden {h}), 2 workers, batch 64", 2, MODEL,
                [] if h == 64 else [f"+model_args.hidden={h}"], args.steps, args.warmup, [DDP_SCRIPT, "--hidden", str(h)])
            for h in args.hidden]
    if "cnn" in args.rows:
        # micro_batch_size = each worker's share: one forward of 32 per worker per step, as DDP's ranks run,
        # and BatchNorm's statistics are those of fixed micro-batches of 32 (the same for any number of workers)
        rows.append(Row("cnn", "ResNet-8 with BatchNorm (models/small_resnet.py, 32x32x3), 2 workers, batch 64, "
                               "micro-batch 32 (DDP: plain BatchNorm, buffers broadcast from rank 0)", 2, CNN_MODEL,
                        ["trainer.micro_batch_size=32"], args.cnn_steps, args.cnn_warmup,
                        [CNN_DDP_SCRIPT]))
    if "cnn4" in args.rows:  # the same with 4 workers (4 processes on the machine's cores): micro-batches of 16
        rows.append(Row("cnn4", f"ResNet-8 with BatchNorm, 4 workers on {os.cpu_count()} cores, batch 64, micro-batch "
                                "16 (DDP: plain BatchNorm over each rank's 16)", 4, CNN_MODEL,
                        ["trainer.micro_batch_size=16"], args.cnn_steps, args.cnn_warmup, [CNN_DDP_SCRIPT]))
    if "mlp4" in args.rows:
        h = args.hidden[0]
        rows.append(Row(f"mlp{h}x4", f"digits MLP (hidden {h}), 4 workers on {os.cpu_count()} cores, batch 64", 4, MODEL,
                        [] if h == 64 else [f"+model_args.hidden={h}"], args.steps, args.warmup,
                        [DDP_SCRIPT, "--hidden", str(h)]))
    return rows


def ef_cmd(run_dir: Path, workers: int, *overrides: str, model: str = MODEL, log_every: int = 1) -> List[str]:
    # REPO / model: a baseline tree's run starts in the tree (``Proc``), which holds no models/
    return [PY, "-m", "elasticflow.cli", "train", str(REPO / model), f"hydra.run.dir={run_dir}", f"launcher.workers={workers}",
            f"trainer.global_batch_size={GLOBAL_BATCH}", "optimizer.lr=0.1", f"trainer.log_every={log_every}",
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


def ef_throughput(tmp: Path, name: str, row: Row, workers: int, every: int, tree: Optional[str] = None) -> dict:
    """One elasticflow run of ``row``, logging every ``every`` steps; ``tree``: import elasticflow from that
    directory (the baseline tree)."""
    run = tmp / name
    # drop_last: every step has 64 samples, as in the DDP script (the digits' last batch has 29)
    proc = Proc(ef_cmd(run, workers, f"trainer.max_steps={row.steps}", "trainer.drop_last=true", *row.overrides,
                       model=row.model, log_every=every), tmp / f"{name}.log", tree=tree)
    skip = min(40, (row.steps - row.warmup) // 4)  # CPU time is sampled while the workers still train
    try:
        tail = Tail(run / "metrics.jsonl")
        wait_until(lambda: tail() >= row.warmup, RUN_TIMEOUT_S, f"step {row.warmup}", proc)
        # 1 worker trains inside the CLI process; more are the agent's children, listed in workers.json
        pids = [m["pid"] for m in json.loads((run / "workers.json").read_text())["members"]] if workers > 1 \
            else [proc.p.pid]
        proc.children = pids
        cpu0, step0 = cpu_seconds(pids), tail()
        wait_until(lambda: tail() >= row.steps - skip, RUN_TIMEOUT_S, f"step {row.steps - skip}", proc)
        cpu1, step1 = cpu_seconds(pids), tail()
        rc = proc.wait(RUN_TIMEOUT_S)
    finally:
        proc.close()
    if rc != 0:
        raise BenchError(f"{name}: exited {rc}: {proc.tail()}")
    recs = train_records(run)
    if [r["step"] for r in recs] != sorted(set(range(every, row.steps + 1, every)) | {row.steps}):
        raise BenchError(f"{name}: expected every {every}th step of 1..{row.steps} in metrics.jsonl")
    times = {r["step"]: r["time"] for r in recs}
    gaps = [(times[b] - times[a]) * 1e3 / (b - a) for a, b in zip(sorted(times), sorted(times)[1:])
            if a >= row.warmup and b - a == every]
    inside = [r["step_time_s"] * 1e3 for r in recs if r["step"] > row.warmup and "step_time_s" in r]
    return {"ms": med(gaps), "mean_ms": statistics.fmean(gaps), "inside_ms": med(inside),
            "cpu_ms": (cpu1 - cpu0) * 1e3 / max(1, step1 - step0) / len(pids)}


def ddp_throughput(tmp: Path, name: str, rows: List[Row], every: int) -> Dict[str, dict]:
    """``rows`` that share a DDP script and a process count in one torchrun (one start-up): {key: {"ms", ...}}.
    The digits script trains its widths one after the other and keys its output by width."""
    row = rows[0]
    out = tmp / f"{name}.json"
    extra = ["--hidden", *(r.ddp[2] for r in rows)] if row.ddp[0] == DDP_SCRIPT else row.ddp[1:]
    cmd = TORCHRUN + [f"--nproc_per_node={row.workers}", "--standalone", row.ddp[0], *extra,
                      "--steps", str(row.steps), "--global-batch", str(GLOBAL_BATCH), "--out", str(out)]
    run_to_end(cmd, tmp / f"{name}.log")
    data = json.loads(out.read_text())
    results = {}
    for r in rows:
        ends, cpu = (data["ends"][r.ddp[2]], data["cpu"][r.ddp[2]]) if row.ddp[0] == DDP_SCRIPT \
            else (data["ends"], data["cpu"])
        gaps = window_ms(ends, max(r.warmup, every), every)  # the windows elasticflow's records give
        last = len(cpu) - min(40, (r.steps - r.warmup) // 4)  # the same window as elasticflow's CPU sample
        results[r.key] = {"ms": med(gaps), "mean_ms": statistics.fmean(gaps),
                          "cpu_ms": (cpu[last] - cpu[r.warmup]) * 1e3 / (last - r.warmup)}
    return results


def throughput(tmp: Path, args) -> Dict[str, dict]:
    """Every row, ``args.rounds`` times: elasticflow (and the baseline tree's, with ``--baseline-tree``) and
    DDP alternate which goes first, so a change in the machine's load hits all."""
    rows = rows_of(args)
    kinds = ["ef", "ddp"] + (["base"] if args.baseline_tree else [])
    got: Dict[str, Dict[str, List[dict]]] = {k: {r.key: [] for r in rows} for k in kinds}
    names = {"ef": "elasticflow", "base": "elasticflow (baseline tree)", "ddp": "torchrun+DDP"}
    for i in range(args.rounds):
        order = kinds if i % 2 == 0 else kinds[::-1]
        for kind in order:
            if kind == "ddp":
                groups: Dict[tuple, List[Row]] = {}
                for r in rows:
                    groups.setdefault((r.ddp[0], r.workers, r.steps), []).append(r)
                for g, group in enumerate(groups.values()):
                    try:
                        results = ddp_throughput(tmp, f"ddp-{g}-r{i}", group, args.log_every)
                    except BenchError as exc:  # one failed run costs its rows this round, not the benchmark
                        print(f"  round {i} {', '.join(r.key for r in group)}: torchrun+DDP FAILED: "
                              f"{str(exc)[-300:]!r}", flush=True)
                        continue
                    for key, res in results.items():
                        got["ddp"][key].append({**res, "round": i})
                        print(f"  round {i} {key:9s}: {names[kind]:28s} {res['ms']:7.2f} ms/step (mean "
                              f"{res['mean_ms']:.2f}; CPU {res['cpu_ms']:.2f} ms/step/process)", flush=True)
                continue
            for r in rows:
                try:
                    res = ef_throughput(tmp, f"{kind}-{r.key}-r{i}", r, r.workers, args.log_every,
                                        args.baseline_tree if kind == "base" else None)
                except BenchError as exc:
                    print(f"  round {i} {r.key:9s}: {names[kind]} FAILED: {str(exc)[-300:]!r}", flush=True)
                    continue
                got[kind][r.key].append({**res, "round": i})
                print(f"  round {i} {r.key:9s}: {names[kind]:28s} {res['ms']:7.2f} ms/step (mean {res['mean_ms']:.2f}; "
                      f"CPU {res['cpu_ms']:.2f} ms/step/process; inside train_step {res['inside_ms']:.2f})", flush=True)
    first = rows[0]
    try:
        one = ef_throughput(tmp, f"ef1-{first.key}", first, 1, args.log_every)
        print(f"  {first.key}: elasticflow, 1 process, {os.cpu_count()} threads {one['ms']:6.2f} ms/step", flush=True)
    except BenchError as exc:
        one = {"ms": float("nan")}
        print(f"  {first.key}: elasticflow, 1 process FAILED: {str(exc)[-300:]!r}", flush=True)
    out = {}
    for r in rows:
        if not all(got[k][r.key] for k in kinds):
            print(f"  {r.key}: left out of the summary (a run failed in every round)", flush=True)
            continue
        out[r.key] = {"label": r.label, "ef1": one["ms"] if r is first else None,
                      "rounds": {k: {x["round"]: x["ms"] for x in got[k][r.key]} for k in kinds}}
        for k in kinds:
            out[r.key][k] = med([x["ms"] for x in got[k][r.key]])
            out[r.key][f"{k}_cpu"] = med([x["cpu_ms"] for x in got[k][r.key]])
    return out


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
    overlap = [] if args.bucket_mb is None else [f"comm.bucket_mb={args.bucket_mb}"]
    proc = Proc(ef_cmd(run, 3, f"trainer.max_steps={steps}", *overlap), tmp / f"kill-{i}.log")
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


def per_round(row: dict, kind: str) -> str:
    """Each round's throughput ratio against the DDP run of the same round."""
    got, ddp = row["rounds"][kind], row["rounds"]["ddp"]
    return ", ".join(f"{ddp[i] / got[i]:.2f}" for i in sorted(got) if i in ddp)


def report(argv: List[str], elapsed: float, loads, tp: Dict[str, dict], ef_kills: List[Kill],
           tr_kills: List[Kill], parts: List[int]) -> None:
    """Print the markdown summary and whether elasticflow met its targets."""
    import torch

    ef, tr = summarize(ef_kills), summarize(tr_kills)
    print("\n## Summary\n")
    print(f"`{shlex.join(['.venv/bin/python', 'scripts/bench/bench_elastic.py', *argv])}`: {elapsed:.0f} s, torch "
          f"{torch.__version__}, {os.cpu_count()} cores, load average {loads[0]:.1f} at start, {loads[1]:.1f} at "
          f"the end. Medians over steps and rounds; on a shared machine read the ratios, not the absolutes.\n")
    base = any("base" in r for r in tp.values())
    print("| measure | elasticflow | torchrun + DDP | elasticflow vs torchrun |"
          + (" baseline tree | baseline tree vs torchrun |" if base else ""))
    print("|---|---|---|---|" + ("---|---|" if base else ""))
    met = []
    for key, r in tp.items():
        met.append(r["ddp"] / r["ef"] >= 1.0)
        more = f" {r['base']:.2f} | throughput x{r['ddp'] / r['base']:.2f} |" if base else ""
        print(f"| ms/step, {r['label']} | {r['ef']:.2f} | {r['ddp']:.2f} | throughput x{r['ddp'] / r['ef']:.2f} |{more}")
        ratios = per_round(r, "ef")
        more = f" {per_round(r, 'base')} | |" if base else ""
        print(f"| throughput vs DDP, each round, {key} | {ratios} | | |{more}")
        more = f" {r['base_cpu']:.2f} | |" if base else ""
        print(f"| CPU ms/step per process, {key} | {r['ef_cpu']:.2f} | {r['ddp_cpu']:.2f} | "
              f"x{r['ef_cpu'] / r['ddp_cpu']:.2f} the CPU |{more}")
        if r["ef1"] is not None:
            print(f"| ms/step, {key}, 1 process (reference) | {r['ef1']:.2f} | | |")
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
    if 1 in parts and not tp:
        met.append(False)  # part 1 ran and measured nothing
    print("\nTargets: throughput x >= 1.0; recovery <= 0.5 s and <= 1 step redone, every time.")
    print("Met." if all(met) else "NOT met: see the rows above.")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 1024], help="MLP widths for the throughput part")
    p.add_argument("--rows", nargs="*", default=["cnn", "mlp4"], choices=["cnn", "cnn4", "mlp4"],
                   help="throughput rows besides the 2-worker MLPs: the BatchNorm ResNet with 2 workers (cnn) and "
                        "with 4 (cnn4), 4 workers on the first MLP width (mlp4)")
    p.add_argument("--log-every", type=int, default=10,
                   help="part 1: elasticflow's trainer.log_every (its default, 10: what a user gets); the step time is "
                        "the mean over each window between two records, for DDP over the same windows; 1 times "
                        "every step, with rank 0 writing a record (and the TensorBoard sidecar an event) each")
    p.add_argument("--cnn-steps", type=int, default=100, help="steps per throughput run of the CNN")
    p.add_argument("--cnn-warmup", type=int, default=10, help="CNN steps left out at the start of each run")
    p.add_argument("--baseline-tree", metavar="DIR",
                   help="also time elasticflow imported from DIR (e.g. `git archive` of an older commit) in every "
                        "round, alternating: a before/after against the same DDP runs")
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds (elasticflow and DDP alternate)")
    p.add_argument("--steps", type=int, default=600, help="steps per throughput run")
    p.add_argument("--warmup", type=int, default=50, help="steps left out at the start of each throughput run")
    p.add_argument("--kills", type=int, default=5, help="elasticflow runs, one SIGKILL each")
    p.add_argument("--restarts", type=int, default=3, help="torchrun runs, one SIGKILL each")
    p.add_argument("--kill-at", type=int, default=100, help="kill after this step (+ an offset < 10)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="part 2: comm.bucket_mb for the killed runs (e.g. 0.005: the MLP's gradient in 4 buckets, "
                        "reduced while backward runs); default: one reduction after backward")
    p.add_argument("--after-kill", type=int, default=100, help="steps to train after the kill step")
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4], choices=[1, 2, 3, 4],
                   help="which parts to run (4: a join of a 100 MB model, and a hung worker's detection)")
    p.add_argument("--joins", type=int, default=3, help="part 4: scale-ups measured (and joins - 1 hangs)")
    p.add_argument("--quick", action="store_true", help="1 round, 2 kills, 1 restart")
    p.add_argument("--keep", metavar="DIR", help="write the runs under DIR and keep them (default: a temp dir)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.kills, args.restarts = 1, 2, 1
    if args.baseline_tree:
        args.baseline_tree = str(Path(args.baseline_tree).resolve())
        try:
            check_tree(args.baseline_tree)
        except BenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
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
            from join import report as join_report  # scripts/bench/join.py

            print("\n4. Joining (scale 2 -> 3 workers, 100 MB model) and a SIGSTOPped worker", flush=True)
            print(join_report(1 if args.quick else args.joins), flush=True)
    report(argv, time.monotonic() - started, (load0, os.getloadavg()[0]), tp, ef_kills, tr_kills, args.parts)
    return 0 if all(k.ok for k in ef_kills) else 1  # a target missed is a finding; a failed recovery is a bug


if __name__ == "__main__":
    sys.exit(main())
