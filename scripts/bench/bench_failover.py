"""The agent's host lost, with launcher.store=etcd: from the power-off to the survivors' next step, against the loss
of a host that does not run the agent, in the same run (issue #48).

    .venv/bin/python scripts/bench/bench_failover.py               # ~3 min on 2 cores: 3 repeats of each
    .venv/bin/python scripts/bench/bench_failover.py --repeats 1

Hosts are network namespaces (scripts/ops/hosts.sh through tests/hosts.py); etcd runs one member on each of h1, h2
and h3 with mutual TLS (tests/etcd_cluster.py). The job: `elasticflow train tests/models/digits_probe.py
launcher=nodes launcher.store=etcd` on h1 and h2, 2 workers each, steps held at 0.1 s, with
elastic.heartbeat_timeout_s and launcher.etcd.lease_s as given. Once step 15 is logged, ``hosts.sh off`` powers
off one host: every process on it (its workers, node agent, standby or leading agent, etcd member) is SIGKILLed
at once and nothing is said to its peers.

  leader   the host whose standby holds the leader key (the agent's): the other host's standby must wait out the
           lease (plus etcd's own election when the lost member led etcd), restore the agent from its state in
           etcd, then cut the lost host's workers out after the heartbeat timeout
  other    the host that does not run the agent: the agent cuts its workers out after the heartbeat timeout

Latency: from the power-off command to the survivors' first step record after it (world_size 2). The split for
the leader: "takeover" until the new agent's ``failover`` event, then until the survivors' step. Printed: medians,
and leader / other (what losing the agent adds to losing a host). Both bounded below by the heartbeat timeout.
"""
from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from runfiles import jsonl  # noqa: E402  scripts/bench/runfiles.py (this file's folder is on sys.path)
from etcd_cluster import EtcdCluster  # noqa: E402
from harness import start_on_hosts, wait_for  # noqa: E402
from hosts import Hosts  # noqa: E402


def once(root: Path, lose: str, heartbeat_s: float, lease_s: float) -> dict:
    net = Hosts(3)
    try:
        etcd = EtcdCluster(root / "etcd", {h: net.addr(h) for h in ("h1", "h2", "h3")},
                           start=lambda name, args: net.popen(name, args))
        etcd.start()
        etcd.wait_ready(lambda args: net.run("h3", args, timeout=90))
        run = root / "run"
        procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", "launcher.min_workers=2",
                               "trainer.max_steps=200", f"elastic.heartbeat_timeout_s={heartbeat_s:g}",
                               *etcd.overrides(lease_s=lease_s), env={"EF_PROBE_SLEEP": "0.1"})
        metrics = run / "metrics.jsonl"
        wait_for(lambda: any(r.get("step", 0) >= 15 for r in jsonl(metrics)), 180, "step 15")
        started = next(e for e in jsonl(run / "events.jsonl") if e["event"] == "started")
        leader = next(h for h in ("h1", "h2") if net.addr(h) == started["host"])  # the agent's address
        victim = leader if lose == "leader" else ("h2" if leader == "h1" else "h1")
        t0 = time.time()
        net.off(victim)
        first = wait_for(lambda: next((r for r in jsonl(metrics) if r.get("world_size") == 2 and "loss" in r), None),
                     120, "the survivors' first step")
        took = [e for e in jsonl(run / "events.jsonl") if e["event"] == "failover"]
        out = {"next_step_s": first["time"] - t0}
        if took:
            out["takeover_s"] = took[0]["time"] - t0
        for p in procs.values():
            Hosts.kill(p)
        return out
    finally:
        net.down()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
    ap.add_argument("--lease", type=float, default=2.0)
    args = ap.parse_args()
    results = {"leader": [], "other": []}
    for i in range(args.repeats):
        for lose in (("leader", "other") if i % 2 == 0 else ("other", "leader")):
            root = Path(tempfile.mkdtemp(prefix=f"ef-failover-{lose}-"))
            try:
                results[lose].append(once(root, lose, args.heartbeat_timeout, args.lease))
                print(f"  {lose}: {results[lose][-1]}", flush=True)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r["next_step_s"] for r in v) for k, v in results.items()}
    takeover = statistics.median(r["takeover_s"] for r in results["leader"] if "takeover_s" in r)
    print(f"\nheartbeat_timeout_s={args.heartbeat_timeout:g}, lease_s={args.lease:g}, {args.repeats} repeats, "
          f"{platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"the agent's host lost: next step {med['leader']:.2f} s (takeover at {takeover:.2f} s)")
    print(f"another host lost:     next step {med['other']:.2f} s")
    print(f"ratio leader / other: {med['leader'] / med['other']:.2f}x")


if __name__ == "__main__":
    main()
