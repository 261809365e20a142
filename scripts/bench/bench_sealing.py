"""What sealing the store's records costs (_util/sealing.py): per record, per generation round, and per step.

    .venv/bin/python scripts/bench/bench_sealing.py [--rounds 2000]

Prints three figures, each against a baseline measured in the same run:
  1. seal + open of one record (an HMAC-SHA256 each) against a json.dumps + json.loads of the same record;
  2. a generation's store round on a real TCPStore over loopback -- the agent publishes gen/<g> and gen/current,
     a worker reads both and marks its arrival, the agent reads the arrival -- sealed against plain set/get;
  3. the share of a membership thread's 50 ms poll that its sealed heartbeat and gen/current read take beyond
     the plain ones. The training thread reads no store record per step (it reads the poller's attribute),
     so a step pays nothing: this share is all there is, on another thread.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.distributed import TCPStore  # noqa: E402

from elasticflow.distributed import protocol  # noqa: E402
from elasticflow.distributed.membership.membership import POLL_S  # noqa: E402
from elasticflow.distributed.store.listen import listening_store  # noqa: E402
from elasticflow._util.sealing import Sealer  # noqa: E402


def per_record(n: int, sealer: Sealer) -> tuple:
    record = protocol.encode(list(range(64)), "train", "", [])
    t = time.perf_counter()
    for i in range(n):
        json.loads(json.dumps(record))
    plain = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for i in range(n):
        sealer.open("gen/7", sealer.seal("gen/7", record))
    sealed = (time.perf_counter() - t) / n
    return plain, sealed


def generation_rounds(rounds: int, agent: TCPStore, worker: TCPStore, sealer: Sealer, sealed: bool) -> float:
    """Median seconds of one publish-read-arrive round."""
    times = []
    for g in range(rounds):
        record = protocol.encode([0, 1, 2], "train", "", [])
        t = time.perf_counter()
        if sealed:
            protocol.put(agent, sealer, f"gen/{g}", record)
            protocol.put(agent, sealer, "gen/current", str(g))
            int(protocol.fetch(worker, sealer, "gen/current", "gen/current"))
            protocol.fetch_json(worker, sealer, f"gen/{g}", "generation")
            protocol.put(worker, sealer, f"gen/{g}/arrived/1", "1")
            protocol.fetch(agent, sealer, f"gen/{g}/arrived/1", "arrival")
        else:
            agent.set(f"gen/{g}", record)
            agent.set("gen/current", str(g))
            int(worker.get("gen/current")) if worker.check(["gen/current"]) else None
            json.loads(worker.get(f"gen/{g}")) if worker.check([f"gen/{g}"]) else None
            worker.set(f"gen/{g}/arrived/1", "1")
            agent.get(f"gen/{g}/arrived/1") if agent.check([f"gen/{g}/arrived/1"]) else None
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    sealer = Sealer("x" * 64, "bench")
    plain, sealed = per_record(20000, sealer)
    print(f"record (64 members): seal+open {sealed * 1e6:.1f} us, json round trip {plain * 1e6:.1f} us "
          f"(sealed/plain {sealed / plain:.2f}x)")

    store, listener = listening_store("127.0.0.1", 10.0)
    worker = TCPStore("127.0.0.1", store.port, None, False, timeout=datetime.timedelta(seconds=10))
    try:
        generation_rounds(200, store, worker, sealer, True)  # warm up both paths
        generation_rounds(200, store, worker, sealer, False)
        base = generation_rounds(args.rounds, store, worker, sealer, False)
        with_seal = generation_rounds(args.rounds, store, worker, sealer, True)
        print(f"generation round on loopback: sealed {with_seal * 1e3:.3f} ms, plain {base * 1e3:.3f} ms "
              f"(sealed/plain {with_seal / base:.2f}x, +{(with_seal - base) * 1e3:.3f} ms per generation)")
    finally:
        listener.close()
    extra = sealed  # a poll seals one heartbeat and opens gen/current: one seal and one open
    print(f"membership poll: +{extra * 1e6:.1f} us of sealing per {POLL_S * 1e3:.0f} ms poll "
          f"({extra / POLL_S * 100:.3f}% of one core, on the membership thread; per training step: 0 store reads)")


if __name__ == "__main__":
    main()
