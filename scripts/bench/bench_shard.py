"""Sharded optimizer state (trainer.shard, issue #19): its memory, its step time and its recovery.

1. Optimizer-state bytes per worker at W = 1, 2, 4 (Adam: two slots), read from each worker's log line
   "sharded optimizer state: B bytes ..." (``trainer._entered_generation``), as a ratio of the replicated
   optimizer state (what every worker holds with trainer.shard=none): about 1/W for the own slice, 2/W
   with the buddy copy (elastic.shard_replicas=1), 1/W with shard_replicas=0.
2. Step time at W = 2: trainer.shard=optimizer and =gradients against trainer.shard=none, measured in the
   same rounds, alternating (the median of each run's per-step times after a warm-up; then the median of
   the per-round ratios).
3. Recovery with a lost slice: 3 workers train a 100 MB model (scripts/bench/models/wide_linear.py, Adam,
   trainer.shard=optimizer); one is SIGKILLed; from the survivors' "recovered" event: recovery_s (from the
   failed collective until the state is in sync again: the new generation, the ranges moved from the
   buddies, the parameters all-gathered) and its transfer_s part.
4. trainer.shard=parameters (stage 3, issue #46): each worker's peak resident set (VmHWM) with 4 workers on a
   deep MLP (scripts/bench/models/deep_mlp.py, 154M parameters by default, Adam), against trainer.shard=none and torch's
   FSDP2 on gloo with the same units (scripts/bench/baselines/fsdp2_mlp.py), and the median step time of each. Minutes.
   ``--world 2``: the same at 2 workers. ``--frozen 10``: the first 10 blocks frozen (a base with no gradient or
   optimizer state, as under LoRA), without the FSDP2 arm.
5. A model bigger than one worker: each worker of the deep MLP in a memory cgroup of its own (cgroup v1, root)
   limited to ``--limit-mb`` MiB from model() on. One worker with shard=none (the parameters, the gradient and
   Adam's two moments: 2.5 GB at 154M parameters) is OOM-killed; 4 workers with trainer.shard=parameters and
   elastic.shard_replicas=0 train under the same limit each. Prints each arm's exit, the OOM kills and the peaks
   the cgroups recorded.

    .venv/bin/python scripts/bench/bench_shard.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))
from runfiles import jsonl, stop  # noqa: E402

CLI = [sys.executable, "-m", "elasticflow.cli"]
MLP = str(REPO / "models" / "digits_mlp.py")
WIDE = str(REPO / "scripts" / "bench" / "models" / "wide_linear.py")
DEEP = str(REPO / "scripts" / "bench" / "models" / "deep_mlp.py")
BYTES_RE = re.compile(r"sharded optimizer state: (\d+) bytes in (\d+) range\(s\) \(replicated: (\d+)\) at world (\d+)")
COMMON = ["trainer.progress=false", "trainer.loggers=[]", "optimizer=adam", "optimizer.lr=0.001",
          "elastic.timeout_s=60", "elastic.heartbeat_timeout_s=20"]


def train(run: Path, model: str, *overrides: str, timeout: float = 600, env: Optional[dict] = None) -> None:
    cmd = CLI + ["train", model, f"hydra.run.dir={run}", *COMMON, *overrides]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}")


def held_bytes(run: Path) -> list:
    """(bytes, replicated bytes) of each worker's last "sharded optimizer state" line."""
    logs = sorted((run / "logs").glob("worker-*.log")) or [run / "train.log"]
    out = []
    for log in logs:
        found = BYTES_RE.findall(log.read_text())
        if found:
            b, _, rep, _ = found[-1]
            out.append((int(b), int(rep)))
    return out


def memory_part(tmp: Path, hidden: int) -> None:
    print(f"\n1. Optimizer-state bytes per worker, Adam, digits MLP hidden {hidden}", flush=True)
    print("   W  shard_replicas  bytes/worker (max)  replicated  ratio  (1/W)")
    for world in (1, 2, 4):
        for replicas in ((0, 1) if world > 1 else (1,)):
            run = tmp / f"mem-{world}-{replicas}"
            train(run, MLP, f"launcher.workers={world}", "trainer.shard=optimizer", "trainer.max_steps=5",
                  f"elastic.shard_replicas={replicas}", f"+model_args.hidden={hidden}")
            held = held_bytes(run)
            most, rep = max(b for b, _ in held), held[0][1]
            print(f"   {world}  {replicas:14d}  {most:18d}  {rep:10d}  {most / rep:.3f}  ({1 / world:.3f})", flush=True)


def stage3_part(tmp: Path, width: int, depth: int, steps: int, world: int = 4, frozen: int = 0) -> None:
    """4. trainer.shard=parameters: each worker's peak resident set against shard=none's and torch FSDP2's
    (``frozen``: the first blocks frozen, a base; FSDP2 is not run then)."""
    params = depth * (width * width + width) + width + 1
    print(f"\n4. Peak RSS per worker (VmHWM), {world} workers, deep MLP {depth} x {width} ({params / 1e6:.0f}M "
          f"parameters{f', the first {frozen} blocks frozen' if frozen else ''}), Adam, global batch 16, {steps} "
          "steps; ratio to shard=none", flush=True)
    args = [f"+model_args.width={width}", f"+model_args.depth={depth}", "trainer.global_batch_size=16",
            f"trainer.max_steps={steps}", f"launcher.workers={world}", "elastic.timeout_s=600",
            "elastic.heartbeat_timeout_s=300", "checkpoint.interval.steps=null", f"+model_args.frozen={frozen}"]
    peaks, training, times = {}, {}, {}
    for label, extra in (("shard=none", ["trainer.shard=none"]),
                         ("shard=parameters, shard_replicas=0", ["trainer.shard=parameters", "elastic.shard_replicas=0"]),
                         ("shard=parameters, shard_replicas=1", ["trainer.shard=parameters"])):
        hwm = tmp / f"hwm-{len(peaks)}"
        hwm.mkdir()
        run = tmp / f"deep-{len(peaks)}"
        train(run, DEEP, *args, *extra, timeout=3600, env={"EF_BENCH_HWM": str(hwm)})
        read = [[int(v) for v in f.read_text().split()] for f in hwm.iterdir()]
        peaks[label] = max(r[0] for r in read) / 1024
        training[label] = max(r[-1] for r in read) / 1024
        times[label] = statistics.median(r["step_time_s"] for r in jsonl(run / "metrics.jsonl") if "loss" in r)
    proc = None if frozen else subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench" / "baselines" / "fsdp2_mlp.py"), "--world", str(world),
         "--width", str(width), "--depth", str(depth), "--steps", str(steps)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    if proc is None:
        pass
    elif proc.returncode == 0:
        fsdp = json.loads(proc.stdout.strip().splitlines()[-1])
        peaks["torch FSDP2 (gloo)"] = max(fsdp["hwm_kib"]) / 1024
        times["torch FSDP2 (gloo)"] = statistics.median(t for rank in fsdp["step_s"] for t in rank[1:])
    else:
        print(f"   torch FSDP2 failed: {proc.stdout[-1500:]}")
    base, trained = peaks["shard=none"], training.get("shard=none")
    for label, mib in peaks.items():
        after = "" if label not in training else \
            f"   training only {training[label]:6.0f} MiB  {training[label] / trained:.3f}x"
        print(f"   {label:38s} {mib:8.0f} MiB  {mib / base:.3f}x{after}   step {times[label]:.2f} s", flush=True)


def cgroup_parent() -> Path:
    """This process's cgroup-v1 memory directory: the bench's per-worker cgroups go under it."""
    line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in ln)
    parent = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/") / "bench_shard"
    parent.mkdir(exist_ok=True)
    return parent


def limit_part(tmp: Path, width: int, depth: int, steps: int, limit_mb: int) -> None:
    """5. The deep MLP under a per-worker memory limit: 1 worker replicated, then 4 workers with stage 3."""
    params = depth * (width * width + width) + width + 1
    print(f"\n5. Each worker limited to {limit_mb} MiB from model() on (its own memory cgroup): deep MLP {depth} x "
          f"{width} ({params / 1e6:.0f}M parameters, {params * 16 / 2 ** 30:.2f} GiB of parameters, gradient and "
          f"Adam's moments), {steps} steps", flush=True)
    parent = cgroup_parent()
    args = [f"+model_args.width={width}", f"+model_args.depth={depth}", "trainer.global_batch_size=16",
            f"trainer.max_steps={steps}", "elastic.timeout_s=600", "elastic.heartbeat_timeout_s=300",
            "checkpoint.interval.steps=null", "elastic.wait_s=5", "trainer.log_every=1"]
    env = {"EF_BENCH_CGROUP": str(parent), "EF_BENCH_LIMIT_MB": str(limit_mb)}
    for label, extra in (("1 worker, shard=none", ["launcher.workers=1", "trainer.shard=none"]),
                         ("4 workers, shard=parameters, shard_replicas=0",
                          ["launcher.workers=4", "trainer.shard=parameters", "elastic.shard_replicas=0"])):
        for old in parent.glob("ef-*"):
            old.rmdir()
        run = tmp / f"limit-{label[0]}"
        cmd = CLI + ["train", DEEP, f"hydra.run.dir={run}", *COMMON, *args, *extra]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600,
                              env={**os.environ, **env})
        groups = sorted(parent.glob("ef-*"))
        kills = sum(int(re.search(r"oom_kill (\d+)", (g / "memory.oom_control").read_text()).group(1))
                    for g in groups)
        peaks = [int((g / "memory.max_usage_in_bytes").read_text()) >> 20 for g in groups]
        logged = run / "metrics.jsonl"
        steps_done = len([r for r in jsonl(logged) if "loss" in r]) if logged.exists() else 0
        left = [e for e in jsonl(run / "events.jsonl") if e["event"] == "left"] if (run / "events.jsonl").exists() \
            else []
        print(f"   {label:46s} exit {proc.returncode}, {steps_done} steps logged, OOM kills {kills}, "
              f"workers lost {len(left)}, cgroup peaks {peaks} MiB", flush=True)
    for old in parent.glob("ef-*"):
        old.rmdir()


def step_ms(run: Path, warmup: int) -> float:
    times = [r["step_time_s"] for r in jsonl(run / "metrics.jsonl") if "loss" in r][warmup:]
    return 1e3 * statistics.median(times)


VARIANTS = [("none", 1), ("optimizer", 1), ("gradients", 1), ("optimizer", 0), ("gradients", 0)]


def step_part(tmp: Path, rounds: int, rows: list) -> None:
    print("\n2. Step time at W = 2 against replicated state (trainer.shard=none), same rounds, order alternating."
          "\n   With a buddy copy at W = 2 every worker holds both slices (memory 1.0x) and computes the whole "
          "update:\n   no allgather. shard_replicas=0 holds 0.5x and all-gathers the parameters every step.",
          flush=True)
    for label, model, extra, steps, warmup in rows:
        ms = {v: [] for v in VARIANTS}
        ratios = {v: [] for v in VARIANTS[1:]}
        for i in range(rounds):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            got = {}
            for shard, replicas in order:
                run = tmp / f"step-{label}-{shard}-{replicas}-{i}".replace(" ", "_")
                train(run, model, "launcher.workers=2", f"trainer.shard={shard}", f"trainer.max_steps={steps}",
                      f"elastic.shard_replicas={replicas}", "trainer.log_every=1", *extra)
                got[(shard, replicas)] = step_ms(run, warmup)
                ms[(shard, replicas)].append(got[(shard, replicas)])
            for v in ratios:
                ratios[v].append(got[v] / got[("none", 1)])
        print(f"   {label}: shard=none {statistics.median(ms[('none', 1)]):.2f} ms/step", flush=True)
        for (shard, replicas), rs in ratios.items():
            print(f"     shard={shard} shard_replicas={replicas}: {statistics.median(ms[(shard, replicas)]):.2f} "
                  f"ms/step, {statistics.median(rs):.3f}x (rounds {', '.join(f'{r:.2f}' for r in rs)})", flush=True)


def recovery_part(tmp: Path, kills: int) -> None:
    print("\n3. Recovery with a lost slice: 3 workers, 100 MB model (Adam), shard=optimizer, SIGKILL one", flush=True)
    for i in range(kills):
        run = tmp / f"kill-{i}"
        cmd = CLI + ["train", WIDE, f"hydra.run.dir={run}", *COMMON, "launcher.workers=3", "trainer.shard=optimizer",
                     "trainer.max_steps=100000", "trainer.log_every=1", "checkpoint.interval.steps=null"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while len([r for r in jsonl(run / "metrics.jsonl") if "loss" in r]) < 3:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the 3-worker run did not reach step 3")
                time.sleep(0.1)
            victim = json.loads((run / "workers.json").read_text())["members"][1]["pid"]
            os.kill(victim, signal.SIGKILL)
            while not [e for e in jsonl(run / "events.jsonl") if e["event"] == "recovered"]:
                if time.monotonic() > deadline:
                    raise RuntimeError("no recovery within 300 s")
                time.sleep(0.1)
            e = [e for e in jsonl(run / "events.jsonl") if e["event"] == "recovered"][0]
            fell = [e for e in jsonl(run / "events.jsonl") if e["event"] == "fell_back"]
            print(f"   kill {i}: recovery {e['recovery_s']:.3f} s (of which redistribution + sync {e['transfer_s']:.3f} s), "
                  f"{e.get('shard_elements_moved', 0) * 12 / 1e6:.0f} MB moved (parameters and Adam's two slots), "
                  f"detection {e['detect_s']:.3f} s, fell back to a checkpoint: {bool(fell)}", flush=True)
        finally:
            stop(proc, 120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3],
                   help="4: stage 3's memory, 5: under a memory limit (minutes each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024, help="MLP width for parts 1 and 2")
    p.add_argument("--steps", type=int, default=200, help="steps per MLP run in part 2")
    p.add_argument("--wide-steps", type=int, default=12, help="steps per 100 MB-model run in part 2 (0: skip)")
    p.add_argument("--deep", default="3584x12", help="part 4's MLP, WIDTHxDEPTH (3584x12: 154M parameters)")
    p.add_argument("--deep-steps", type=int, default=6, help="steps per run in parts 4 and 5")
    p.add_argument("--world", type=int, default=4, help="workers in part 4")
    p.add_argument("--frozen", type=int, default=0, help="part 4: freeze the first this many blocks (a base)")
    p.add_argument("--limit-mb", type=int, default=2048, help="part 5's memory limit per worker (MiB)")
    args = p.parse_args(argv)
    print(f"bench_shard {' '.join(argv or sys.argv[1:])}; load average {os.getloadavg()[0]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_shard-") as d:
        tmp = Path(d)
        if 1 in args.parts:
            memory_part(tmp, args.hidden)
        if 2 in args.parts:
            rows = [(f"digits MLP hidden {args.hidden}", MLP, [f"+model_args.hidden={args.hidden}"], args.steps, 20)]
            if args.wide_steps:
                rows.append(("100 MB linear model", WIDE, ["trainer.global_batch_size=64"], args.wide_steps, 3))
            step_part(tmp, args.rounds, rows)
        if 3 in args.parts:
            recovery_part(tmp, args.kills)
        if 4 in args.parts:
            width, depth = (int(v) for v in args.deep.split("x"))
            stage3_part(tmp, width, depth, args.deep_steps, args.world, args.frozen)
        if 5 in args.parts:
            width, depth = (int(v) for v in args.deep.split("x"))
            limit_part(tmp, width, depth, args.deep_steps, args.limit_mb)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
