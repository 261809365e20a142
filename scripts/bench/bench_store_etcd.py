"""etcd with mutual TLS against the job's token store and the TCPStore (issue #42 asks the token store's choice
to be justified against etcd by measurement): a call, a new connection, and gloo's rendezvous of N processes
(the store's part of a generation's formation) through each, at 2, 4 and 16 processes, in one run.

    .venv/bin/python scripts/bench/bench_store_etcd.py                 # needs etcd (Debian: etcd-server) and openssl
    .venv/bin/python scripts/bench/bench_store_etcd.py --sizes 2 4 --rounds 3

etcd runs here as a one-member cluster on loopback, its data directory on this machine's disk (each write is
fsynced, as in production), clients authenticated by certificates made with openssl for the run (a CA, a server
certificate for 127.0.0.1, a client certificate): ``--client-cert-auth``. The client is the job's own
(``elasticflow.distributed.etcd_store.EtcdStore``, launcher.store=etcd): a ``torch.distributed.Store`` over
etcd's v3 HTTP/JSON gateway (one keep-alive HTTPS connection per client, ``compare_set`` and ``add`` as
transactions, ``get``/``wait`` polling every 5 ms, since a watch stream over the gateway is a second connection
per waiter; the figures on the benchmarks page before 2026-12-04 polled every 2 ms). gloo rendezvouses through
it as through the others.

Printed: medians per store and size, and each store / tcp. On a shared 2-core machine 16 processes contend for
the cores: read the ratios.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from bench_store import print_round_trips, time_calls

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
TOKEN = "bench" * 8


def EtcdStore(url: str, certs: dict, timeout: datetime.timedelta) -> dist.Store:
    """The job's own etcd client (elasticflow/distributed/store/etcd.py: launcher.store=etcd) on this run's files."""
    from elasticflow.distributed.store.dist_store import EtcdStore as Client  # a worker's: gloo's PrefixStore over it
    from elasticflow.distributed.store.etcd import address

    return Client(address([url], "bench/", certs["ca"], certs["client"], certs["client_key"]), timeout)


# ---------------------------------------------------------------- etcd, its certificates, the clients
def make_certs(folder: Path) -> dict:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, by openssl."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=bench-ca")
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf")
    return {"ca": str(folder / "ca.pem"), "server": str(folder / "server.pem"),
            "server_key": str(folder / "server.key"), "client": str(folder / "client.pem"),
            "client_key": str(folder / "client.key")}


def start_etcd(folder: Path, certs: dict) -> "tuple[subprocess.Popen, str]":
    url = "https://127.0.0.1:23790"
    proc = subprocess.Popen(["etcd", "--data-dir", str(folder / "data"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", "http://127.0.0.1:23800",
                             "--initial-advertise-peer-urls", "http://127.0.0.1:23800",
                             "--initial-cluster", "default=http://127.0.0.1:23800",
                             "--cert-file", certs["server"], "--key-file", certs["server_key"],
                             "--trusted-ca-file", certs["ca"], "--client-cert-auth"],
                            stdout=subprocess.DEVNULL, stderr=open(folder / "etcd.log", "w"))
    deadline = time.monotonic() + 30
    while True:
        try:
            EtcdStore(url, certs, datetime.timedelta(seconds=5)).set("up", "1")
            return proc, url
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"etcd did not start: {(folder / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.2)


def client(kind: str, address: str, certs: dict) -> dist.Store:
    if kind == "etcd":
        return EtcdStore(address, certs, datetime.timedelta(seconds=120))
    from elasticflow.distributed.store import stores
    return stores.connect(address, 120.0, TOKEN)


# ---------------------------------------------------------------- the measurements
def round_trip_us(kind: str, address: str, certs: dict, n: int = 500, connections: int = 50) -> tuple:
    """(us per call, us per new connection and one call): bench_store.py's measure, on this script's clients."""

    return time_calls(lambda: client(kind, address, certs), n, connections)


MEMBER = r'''
import datetime, json, sys, time, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/scripts/bench")
from bench_store_etcd import client
kind, address, certs, prefix = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[7]
rank, world = int(sys.argv[5]), int(sys.argv[6])
store = client(kind, address, certs)
store.add(prefix + "ready", 1)
store.wait([prefix + "go"])
t = time.perf_counter()
opts = dist.ProcessGroupGloo._Options(); opts._timeout = datetime.timedelta(seconds=120)
opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, opts)
x = torch.ones(1); pg.allreduce([x]).wait()
print(json.dumps({"s": time.perf_counter() - t, "sum": x.item()}), flush=True)
import os; os._exit(0)
'''


def rendezvous_s(kind: str, address: str, certs: dict, world: int, tag: str) -> float:
    """Seconds from 'go' until the last of ``world`` processes has a gloo group and one allreduce through it."""
    prefix = f"rdv/{tag}/"
    procs = [subprocess.Popen([sys.executable, "-c", MEMBER, str(REPO), kind, address, json.dumps(certs), str(r),
                               str(world), prefix], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    control = client(kind, address, certs)
    control.wait([prefix + "ready"])
    while int(control.add(prefix + "ready", 0)) < world:
        time.sleep(0.01)
    control.set(prefix + "go", "1")
    outs = [p.communicate(timeout=300) for p in procs]
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert all(g["sum"] == world for g in got), outs
    return max(g["s"] for g in got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 16])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not shutil.which("etcd") or not shutil.which("openssl"):
        sys.exit("error: needs etcd and openssl on PATH (Debian: apt install etcd-server openssl)")
    from elasticflow.distributed.store import stores
    load = os.getloadavg()[0]
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M} {os.cpu_count()} cores, load {load:.1f}; sizes {args.sizes}, "
          f"{args.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        certs = make_certs(root)
        etcd, url = start_etcd(root, certs)
        served = {"tcp": stores.serve("tcp", "127.0.0.1", 0, root, 120.0, TOKEN),
                  "token": stores.serve("token", "127.0.0.1", 0, root, 120.0, TOKEN)}
        addresses = {"tcp": served["tcp"][1], "token": served["token"][1], "etcd": url}
        kinds = list(addresses)
        try:
            trips = {k: [round_trip_us(k, addresses[k], certs) for _ in range(3)] for k in kinds}
            print_round_trips(trips)
            results = {(n, k): [] for n in args.sizes for k in kinds}
            for r in range(args.rounds):
                for n in args.sizes:
                    for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                        results[n, kind].append(rendezvous_s(kind, addresses[kind], certs, n, f"{r}-{n}"))
            print("\n| processes | gloo rendezvous + one allreduce | " + " | ".join(kinds) + " |")
            print("|---|---|" + "---|" * len(kinds))
            for n in args.sizes:
                m = {k: statistics.median(results[n, k]) for k in kinds}
                print(f"| {n} | median of {args.rounds} | " +
                      " | ".join(f"{m[k] * 1e3:.0f} ms ({m[k] / m['tcp']:.2f}x)" for k in kinds) + " |", flush=True)
        finally:
            for _store, _address, close in served.values():
                close()
            etcd.terminate()
            etcd.wait(timeout=30)


if __name__ == "__main__":
    main()
