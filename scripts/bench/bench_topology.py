"""Topologies over a slow link: bytes across hosts and step time, ring against hierarchical, in one run.

    .venv/bin/python scripts/bench/bench_topology.py                  # ~4 min on 2 cores: 2 repeats of each
    .venv/bin/python scripts/bench/bench_topology.py --repeats 1 --steps 6
    .venv/bin/python scripts/bench/bench_topology.py --trainers 4 --topologies ring,hierarchical   # 2 hosts x 4

2 hosts x 2 workers (scripts/ops/hosts.sh through tests/hosts.py: network namespaces h1 and h2, each link to the
bridge limited to 100 Mbit/s both ways by tbf), ``elasticflow train scripts/bench/models/wide_linear.py
launcher=nodes launcher.procs_per_node=2 topology=T`` with EF_WIDE_N=3200: one 3200 x 3200 float32 weight,
10.2M parameters, a 41 MB gradient per step. Workers 0 and 1 are h1's (the agent's host), 2 and 3 h2's,
so the flat ring's order is h1, h1, h2, h2.

Per job: h2's eth0 byte counters (rx + tx, /sys/class/net/eth0/statistics) read when step ``--skip`` is
logged and again at the last step, divided by the steps between; step time from the same two records'
``time``. Every byte h2 sends or receives crosses the limited link (its workers' traffic with each other
stays on its loopback). The topologies alternate which goes first in each repeat; figures are medians.

What to expect: the flat ring sends 2 (W - 1) / W = 1.5 gradients each way across per step; the
hierarchical sum sends the leaders' allreduce, 2 (H - 1) / H = 1 gradient each way. parameter_server runs 3
processes per host (2 trainers and an aggregator holding one of 2 shards): a host's trainers sum onto one,
which pushes the other host's shard across once, and that shard's parameters come back once, so 1 gradient
crosses each way, as for hierarchical. ps_standby adds topology.replica=2 (4 processes per host): each
primary's sum also goes to its standby on the other host, half a gradient more each way. ``--trainers 4``:
4 per host, so the ring sends 2 (8 - 1) / 8 = 1.75 gradients each way and the hierarchical sum still 1.
Needs root.

    .venv/bin/python scripts/bench/bench_topology.py --diloco        # DiLoCo (H=16) against the ring

``--diloco``: ``topology=diloco topology.sync_every=16 topology.replicas=4`` (one replica per worker) against the
flat ring at an equal number of samples (``--steps`` 48: three rounds of 16, across the 512-sample epochs),
bytes counted from the end of the first round (step 16) to the last step; and the loss of each at the end:
the mean of the last 16 steps' losses. DiLoCo sends one model's worth per round (the Δ allreduce) instead of
one gradient per step. Measured ~10 min on 2 cores with 2 repeats.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from hosts import Hosts  # noqa: E402 - tests/hosts.py: the namespace hosts

MODEL = REPO / "scripts" / "bench" / "models" / "wide_linear.py"
TOKEN = "7d2e0c4b9a1f4e6d8c3b5a7f9e1d2c4b"


def counters(net: Hosts, host: str) -> int:
    out = net.run(host, ["cat", "/sys/class/net/eth0/statistics/rx_bytes", "/sys/class/net/eth0/statistics/tx_bytes"])
    return sum(int(v) for v in out.stdout.split())


def records(run: Path) -> list:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


# name: (topology, aggregators per host beside the trainers, overrides). parameter_server: an aggregator per
# host (two shards, one per host), so the trainers are the same as the others'. ps_standby: the same with
# topology.replica=2, 2 aggregators per host (each host has one shard's primary and the other's standby).
SETUPS = {"parameter_server": ("parameter_server", 1, ("topology.aggregators=2",)),
          "ps_standby": ("parameter_server", 2, ("topology.aggregators=2", "topology.replica=2"))}


def one_job(topology: str, steps: int, skip: int, rate: str, side: int, extra: tuple = (), trainers: int = 2) -> dict:
    net = Hosts(2)
    run = Path(tempfile.mkdtemp(prefix=f"bench-topology-{topology}-"))
    try:
        for h in ("h1", "h2"):
            net.rate(h, rate)
        endpoint = f"{net.addr('h1')}:29400"
        kind, beside, more = SETUPS.get(topology, (topology, 0, ()))
        procs_per_node, extra = trainers + beside, (*more, *extra)
        overrides = ["launcher=nodes", f"launcher.endpoint={endpoint}", f"launcher.procs_per_node={procs_per_node}",
                     "launcher.nodes=2", f"topology={kind}", f"trainer.max_steps={steps}",
                     "trainer.global_batch_size=64", "trainer.log_every=1", "optimizer.lr=0.01",
                     "checkpoint.interval.steps=null", "elastic.timeout_s=120", "elastic.heartbeat_timeout_s=60",
                     "trainer.loggers=[]", *extra]
        env = {"ELASTICFLOW_JOB_TOKEN": TOKEN, "EF_WIDE_N": str(side)}
        procs = [net.train(h, MODEL, run, *overrides, env=env) for h in ("h1", "h2")]
        deadline = time.monotonic() + 900
        marks = {}
        while time.monotonic() < deadline:
            done = {r["step"]: r for r in records(run)}
            for mark in (skip, steps):
                if mark in done and mark not in marks:
                    marks[mark] = (counters(net, "h2"), done[mark]["time"], done[mark]["world_size"])
            if len(marks) == 2 or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        outs = [p.communicate(timeout=120)[0] for p in procs]
        if len(marks) != 2 or any(p.returncode for p in procs):
            raise RuntimeError(f"{topology}: the job failed or stalled (exit codes "
                               f"{[p.returncode for p in procs]}):\n{outs[0][-3000:]}\n{outs[1][-2000:]}")
        (b0, t0, w0), (b1, t1, w1) = marks[skip], marks[steps]
        assert w0 == w1 == 2 * procs_per_node, (w0, w1)
        n = steps - skip
        losses = [r["loss"] for r in records(run)][-16:]
        return {"topology": topology, "bytes_per_step": (b1 - b0) / n, "step_s": (t1 - t0) / n,
                "loss": statistics.mean(losses)}
    finally:
        net.down()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="steps left out at the start (group building, warm-up)")
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--side", type=int, default=3200, help="the weight's side: side^2 float32 parameters")
    ap.add_argument("--topologies", default="ring,hierarchical,parameter_server,ps_standby")
    ap.add_argument("--trainers", type=int, default=2, help="trainers per host (the global batch stays 64)")
    ap.add_argument("--diloco", action="store_true", help="DiLoCo (sync_every 16) against the ring, 48 steps")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("error: needs root (network namespaces)\nhint: run it as root, as CI does")
    if args.diloco:
        return diloco(args)
    names = args.topologies.split(",")
    results = {t: [] for t in names}
    for rep in range(args.repeats):
        for t in (names if rep % 2 == 0 else names[::-1]):
            r = one_job(t, args.steps, args.skip, args.rate, args.side, trainers=args.trainers)
            results[t].append(r)
            print(f"  repeat {rep + 1} {t}: {r['bytes_per_step'] / 1e6:.1f} MB across per step, {r['step_s']:.2f} s/step",
                  flush=True)
    grad_mb = args.side ** 2 * 4 / 1e6
    print(f"\n{datetime.date.today()} {platform.node()} ({os.cpu_count()} cores); 2 hosts x {args.trainers} "
          f"trainers, link {args.rate}, {args.side ** 2 / 1e6:.1f}M parameters ({grad_mb:.0f} MB gradient), "
          f"medians of {args.repeats}")
    print(f"{'topology':<16}{'MB across/step':>16}{'x gradient':>12}{'s/step':>10}")
    base = None
    for t in names:
        mb = statistics.median(r["bytes_per_step"] for r in results[t]) / 1e6
        s = statistics.median(r["step_s"] for r in results[t])
        base = base or (mb, s)
        print(f"{t:<16}{mb:>16.1f}{mb / grad_mb:>12.2f}{s:>10.2f}")
    for t in names[1:]:
        mb = statistics.median(r["bytes_per_step"] for r in results[t]) / 1e6
        s = statistics.median(r["step_s"] for r in results[t])
        # The bytes ratio bounds the step ratio, less what each arm spends off the link: a step takes at least
        # its bytes' time on the link, and the same time off it in both arms moves the ratio toward 1.
        print(f"{t} vs {names[0]}: {base[0] / mb:.2f}x fewer bytes across, {base[1] / s:.2f}x faster steps "
              f"({base[1] / s / (base[0] / mb):.0%} of the bytes ratio)")


def diloco(args) -> None:
    """DiLoCo with H = 16 against synchronous training (the ring) at an equal number of samples."""
    steps = max(args.steps, 48)
    jobs = {"ring": ("ring", ()), "diloco": ("diloco", ("topology.sync_every=16", "topology.replicas=4"))}
    results = {t: [] for t in jobs}
    for rep in range(args.repeats):
        for t in (list(jobs) if rep % 2 == 0 else list(jobs)[::-1]):
            r = one_job(jobs[t][0], steps, 16, args.rate, args.side, jobs[t][1])
            results[t].append(r)
            print(f"  repeat {rep + 1} {t}: {r['bytes_per_step'] / 1e6:.2f} MB across per step, "
                  f"{r['step_s']:.2f} s/step, loss {r['loss']:.5g}", flush=True)
    print(f"\n{datetime.date.today()} {platform.node()} ({os.cpu_count()} cores); 2 hosts x 2 workers, link {args.rate}, "
          f"{args.side ** 2 / 1e6:.1f}M parameters, steps 17-{steps} ({(steps - 16) * 64} samples), medians of "
          f"{args.repeats}")
    print(f"{'topology':<16}{'MB across/step':>16}{'s/step':>10}{'final loss':>14}")
    med = {t: {k: statistics.median(r[k] for r in results[t]) for k in ("bytes_per_step", "step_s", "loss")}
           for t in jobs}
    for t, m in med.items():
        print(f"{t:<16}{m['bytes_per_step'] / 1e6:>16.2f}{m['step_s']:>10.2f}{m['loss']:>14.5g}")
    ring, dl = med["ring"], med["diloco"]
    print(f"diloco vs ring: {ring['bytes_per_step'] / dl['bytes_per_step']:.1f}x fewer bytes across, "
          f"{ring['step_s'] / dl['step_s']:.2f}x faster steps, final loss {dl['loss']:.5g} vs {ring['loss']:.5g}")


if __name__ == "__main__":
    main()
