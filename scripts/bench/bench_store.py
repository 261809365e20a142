"""What the job's own stores cost against the TCPStore (issue #42): the private one (a Unix socket) and the token
one (TCP behind a token handshake), each against ``launcher.store=tcp``: a round trip, a generation's formation,
a join, and a training step, at 2, 4 and 16 workers on one host, measured in the same run, stores in turn.

    .venv/bin/python scripts/bench/bench_store.py                  # 2 rounds of 2, 4 and 16 workers
    .venv/bin/python scripts/bench/bench_store.py --sizes 2 4 --rounds 3

Each job: ``elasticflow train tests/models/digits_probe.py launcher.workers=N launcher.max_workers=N+1
launcher.store=S`` (EF_PROBE_SLEEP in every forward, so steps are paced alike), then ``elasticflow scale RUN_DIR
--workers N+1`` once step 3 is logged, and SIGINT once the joiner's generation formed. From events.jsonl: the
first generation's ``formed_s`` (published -> every member in one gloo group: the workers' arrival and gloo's
rendezvous, both through the store) and the join's (the generation with N+1 members). From metrics.jsonl: the
median step time after the join. Printed: medians per store and size, and each store / tcp.

The round trip: one process, 2,000 ``set`` + ``compare_set`` pairs on a client of each store; and a connection
(with the token store's handshake), 200 of each.

Note: on a shared 2-core machine 16 workers contend for the cores: read the ratios, not the seconds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "models" / "digits_probe.py"
CLI = [sys.executable, "-m", "elasticflow.cli"]
STORES = ("tcp", "private", "token")
TOKEN = "bench" * 8


def time_calls(connect, n: int = 2000, connections: int = 200) -> tuple:
    """(us per call, us per new connection and one call) on the store ``connect()`` gives a client of: ``n``
    ``set`` + ``compare_set`` pairs on one client, then ``connections`` new clients making one call each."""
    client = connect()
    t = time.perf_counter()
    for i in range(n):
        client.set("k", str(i))
        client.compare_set("k", "x", "y")
    call = (time.perf_counter() - t) / (2 * n) * 1e6
    t = time.perf_counter()
    for _ in range(connections):
        connect().check(["k"])
    return call, (time.perf_counter() - t) / connections * 1e6


def print_round_trips(trips: dict) -> None:
    """The medians of ``time_calls``' figures per store (``trips``: store -> [(call, connection)...]), against
    the TCPStore's (``trips["tcp"]``)."""
    for i, what in enumerate(("a call (set or compare_set)", "a new connection and one call")):
        rt = {k: statistics.median(t[i] for t in v) for k, v in trips.items()}
        print(f"{what}: " + ", ".join(f"{k} {rt[k]:.1f} us ({rt[k] / rt['tcp']:.2f}x)" for k in trips), flush=True)


def round_trip_us(kind: str, state_dir: Path, n: int = 2000, connections: int = 200) -> tuple:
    """(us per call, us per new connection) on a store of ``kind``."""
    from elasticflow.distributed.store import stores

    store, address, close = stores.serve(kind, "127.0.0.1", 0, state_dir, 10.0, TOKEN)
    try:
        return time_calls(lambda: stores.connect(address, 10.0, TOKEN), n, connections)
    finally:
        close()


def _events(run: Path) -> list:
    path = run / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _steps(run: Path) -> list:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if '"loss"' in x] if path.is_file() else []


def _until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def one_job(run: Path, n: int, kind: str, env: dict) -> dict:
    log = run.parent / f"{run.name}.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(CLI + ["train", str(PROBE), f"hydra.run.dir={run}", "trainer.global_batch_size=64",
                                       "trainer.max_steps=100000", "trainer.log_every=1", "trainer.progress=false",
                                       f"launcher.workers={n}", f"launcher.max_workers={n + 1}",
                                       f"launcher.store={kind}", "elastic.wait_s=60", "checkpoint.interval.steps=null"],
                                env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        _until(lambda: len(_steps(run)) >= 3, 300, f"step 3 of {run}")
        subprocess.run(CLI + ["scale", str(run), "--workers", str(n + 1), "--wait", "120"], env=env,
                       capture_output=True, check=True, timeout=200)
        joined = lambda: [e for e in _events(run) if e["event"] == "formed" and e.get("world") == n + 1]  # noqa
        _until(joined, 120, f"the {n + 1}-worker generation of {run}")
        _until(lambda: sum(s.get("world_size") == n + 1 for s in _steps(run)) >= 10, 120, "10 steps after the join")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    formed = [e for e in _events(run) if e["event"] == "formed"]
    after = [s for s in _steps(run) if s.get("world_size") == n + 1][2:]
    return {"formation_s": formed[0]["formed_s"], "join_s": [e for e in formed if e["world"] == n + 1][0]["formed_s"],
            "step_ms": 1000 * statistics.median(s["step_time_s"] for s in after) if after else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.05, help="seconds per forward (EF_PROBE_SLEEP)")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EF_PROBE_SLEEP": str(args.sleep),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    print(f"# {datetime.date.today()} {os.cpu_count()} cores; sizes {args.sizes}, {args.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trips = {k: [] for k in STORES}
        for r in range(5):
            for kind in STORES:
                state = root / f"rt-{kind}-{r}"
                state.mkdir()
                trips[kind].append(round_trip_us(kind, state))
        print_round_trips(trips)
        results = {(n, k): [] for n in args.sizes for k in STORES}
        for r in range(args.rounds):
            for n in args.sizes:
                for kind in (STORES if r % 2 == 0 else STORES[::-1]):  # in turn, the order reversed each round
                    got = one_job(root / f"r{r}-n{n}-{kind}", n, kind, env)
                    results[n, kind].append(got)
                    print(f"round {r} {n:>2} workers {kind:>7}: formation {got['formation_s']:.3f} s, "
                          f"join {got['join_s']:.3f} s, step {got['step_ms']:.1f} ms", flush=True)
    print("\n| workers | what | " + " | ".join(STORES) + " |")
    print("|---|---|" + "---|" * len(STORES))
    for n in args.sizes:
        for f, what, unit, scale in (("formation_s", "formation", "s", 1), ("join_s", "join", "s", 1),
                                     ("step_ms", "step", "ms", 1)):
            m = {k: statistics.median(x[f] for x in results[n, k]) * scale for k in STORES}
            print(f"| {n} | {what} | " + " | ".join(f"{m[k]:.3f} {unit} ({m[k] / m['tcp']:.2f}x)" for k in STORES)
                  + " |")


if __name__ == "__main__":
    main()
