"""A real etcd cluster for tests and benchmarks: Debian's etcd (3.4), one member per host, mutual TLS with
certificates made by openssl for the run (a CA, a server certificate naming every member's address, a client
certificate).

    cluster = EtcdCluster(tmp_path / "etcd", {"h1": "10.231.0.1", ...}, start=lambda name, args: net.popen(name, args))
    cluster.start(); cluster.wait_ready(); ... cluster.endpoints, cluster.tls

``start(name, args)`` runs one member's command (on a namespace host: ``Hosts.popen``; on this machine:
``subprocess.Popen``). Skips with one line where etcd or openssl is missing, unless ETCD_REQUIRED is set (CI
installs etcd: .ci/run).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, Tuple

import pytest

CLIENT_PORT, PEER_PORT = 2379, 2380
ETCD_LOCAL = Path(__file__).resolve().parents[1] / "scripts" / "ops" / "etcd-local.sh"
READY = """
import datetime, json, sys, time
from elasticflow.distributed.store.etcd import EtcdStore, address
tls = json.loads(sys.argv[2])
store = EtcdStore(address([sys.argv[1]], "ready/", tls["ca"], tls["cert"], tls["key"]), datetime.timedelta(seconds=5))
deadline = time.monotonic() + float(sys.argv[3])
while True:
    try:
        store.set("up", "1")
        break
    except Exception as exc:
        if time.monotonic() > deadline:
            sys.exit(f"no quorum through {sys.argv[1]}: {exc}")
        time.sleep(0.3)
"""

# Another job's client (any certificate of the CA): it lists every key of the cluster, finds each job's leader
# key, and puts its own over it with no lease (so that it never expires). Prints the keys it overwrote.
DEPOSE = """
import base64, datetime, json, sys
from elasticflow.distributed.store.etcd import EtcdStore, address
tls = json.loads(sys.argv[2])
store = EtcdStore(address([sys.argv[1]], "other-job/", tls["ca"], tls["cert"], tls["key"]),
                  datetime.timedelta(seconds=10))
b64 = lambda data: base64.b64encode(data).decode()
kvs = store.post("/v3/kv/range", {"key": b64(b"\\0"), "range_end": b64(b"\\0"), "keys_only": True}).get("kvs", [])
leaders = [base64.b64decode(kv["key"]) for kv in kvs if base64.b64decode(kv["key"]).endswith(b"agent/leader")]
for key in leaders:
    store.post("/v3/kv/put", {"key": b64(key), "value": b64(b"other-job:1:0000")})
print(json.dumps([k.decode() for k in leaders]))
"""


def require_etcd() -> None:
    if shutil.which("etcd") and shutil.which("openssl"):
        return
    if os.environ.get("ETCD_REQUIRED"):
        pytest.fail("etcd or openssl is missing, and ETCD_REQUIRED is set (apt install etcd-server openssl)")
    pytest.skip("needs etcd and openssl (Debian: apt install etcd-server openssl)")


def make_certs(folder: Path, ips) -> Dict[str, str]:
    """A CA, a server certificate for ``ips`` (and 127.0.0.1), a client certificate; keys readable by the owner."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=elasticflow-test-ca")
    names = ",".join(f"IP:{ip}" for ip in ["127.0.0.1", *ips])
    (folder / "san.cnf").write_text(f"subjectAltName={names}\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf")
    for key in folder.glob("*.key"):
        key.chmod(0o600)
    return {n: str(folder / f) for n, f in (("ca", "ca.pem"), ("server", "server.pem"), ("server_key", "server.key"),
                                             ("cert", "client.pem"), ("key", "client.key"))}


class EtcdCluster:
    """Members by name -> address; ``endpoints``: their client URLs; ``tls``: the client's files."""

    def __init__(self, folder: Path, members: Dict[str, str], start: Callable[[str, list], subprocess.Popen]):
        require_etcd()
        self.folder, self.members, self._start = Path(folder), dict(members), start
        self.tls = make_certs(self.folder / "certs", members.values())
        self.endpoints = [f"https://{ip}:{CLIENT_PORT}" for ip in members.values()]
        self.procs: Dict[str, subprocess.Popen] = {}

    def args(self, name: str) -> list:
        ip, t = self.members[name], self.tls
        cluster = ",".join(f"{n}=http://{a}:{PEER_PORT}" for n, a in self.members.items())
        return ["etcd", "--name", name, "--data-dir", str(self.folder / f"data-{name}"),
                "--listen-client-urls", f"https://{ip}:{CLIENT_PORT}", "--advertise-client-urls",
                f"https://{ip}:{CLIENT_PORT}", "--listen-peer-urls", f"http://{ip}:{PEER_PORT}",
                "--initial-advertise-peer-urls", f"http://{ip}:{PEER_PORT}", "--initial-cluster", cluster,
                "--initial-cluster-state", "new", "--initial-cluster-token", "elasticflow-test",
                "--cert-file", t["server"], "--key-file", t["server_key"], "--trusted-ca-file", t["ca"],
                "--client-cert-auth", "--logger", "zap", "--log-outputs", str(self.folder / f"etcd-{name}.log")]

    def start(self) -> None:
        for name in self.members:
            self.procs[name] = self._start(name, self.args(name))

    def wait_ready(self, run: Callable[[list], subprocess.CompletedProcess], timeout_s: float = 60) -> None:
        """Until every member answers a write through the cluster (a quorum formed). ``run(args)`` runs a command
        where the members can be reached (on a namespace host: ``Hosts.run``; this machine's own traffic to those
        addresses may be proxied)."""
        for endpoint in self.endpoints:
            done = run([sys.executable, "-c", READY, endpoint, json.dumps(self.tls), str(timeout_s)])
            if done.returncode != 0:
                logs = "".join(p.read_text()[-1500:] for p in self.folder.glob("etcd-*.log"))
                raise RuntimeError(f"etcd did not form a cluster in {timeout_s:g}s: {done.stdout[-500:]}"
                                   f"{done.stderr[-1500:]} {logs}")

    def stranger(self, name: str = "other-job", common_name: bool = True) -> Dict[str, str]:
        """The TLS files of another client the cluster trusts (the same CA signed it): another job's, say.
        ``common_name=False``: a certificate without a CommonName (/O=name), which etcd 3.4's JSON gateway takes
        once authentication is on (a job that logs in with a password)."""
        folder = self.folder / "certs"
        for args in (["req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                      "-subj", f"/CN={name}" if common_name else f"/O={name}"],
                     ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                      "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf"]):
            subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)
        (folder / f"{name}.key").chmod(0o600)
        return {"ca": self.tls["ca"], "cert": str(folder / f"{name}.pem"), "key": str(folder / f"{name}.key")}

    def users(self, jobs: Iterable[str], run: Callable[[list], subprocess.CompletedProcess]
              ) -> Dict[str, Tuple[Dict[str, str], Path]]:
        """Authentication on, as docs/multi-host.md says: ``scripts/ops/etcd-local.sh auth-on`` (a root user),
        then ``add-job`` as root for each job, a role and a user limited to the prefix ``<job>/``, its password in
        a file the script makes. Each job's certificate has no CommonName (etcd 3.4's JSON gateway refuses one
        once authentication is on). ``run(args)`` as in ``wait_ready``. Returns {job: (its TLS files, its
        password file)}."""
        t, root = self.tls, self.folder / "root.password"
        ctl = ["env", f"ETCDCTL_ENDPOINTS={self.endpoints[0]}", f"ETCDCTL_CACERT={t['ca']}",
               f"ETCDCTL_CERT={t['cert']}", f"ETCDCTL_KEY={t['key']}", "bash", str(ETCD_LOCAL)]
        found, steps = {}, [["auth-on", root]]
        for job in jobs:
            found[job] = (self.stranger(job, common_name=False), self.folder / f"{job}.password")
            steps.append(["add-job", job, f"{job}/", found[job][1], root])
        for step in steps:
            done = run(ctl + list(map(str, step)))
            if done.returncode != 0:
                raise RuntimeError(f"etcd-local.sh {step[0]} failed: {done.stdout}{done.stderr}")
            if step[0] == "add-job":
                assert done.stdout.split() == [f"launcher.etcd.prefix={step[2]}", f"launcher.etcd.user={step[1]}",
                                               f"launcher.etcd.password_file={step[3]}"], done.stdout
        return found

    def overrides(self, lease_s: float = 2, user: Tuple[str, Dict[str, str], Path] = None) -> list:
        """The `elasticflow train` overrides that put the job's store in this cluster; ``user``: (name, TLS files,
        password file) of a job's user (``users``), which the job logs in as under its prefix ``<name>/``."""
        t = user[1] if user else self.tls
        login = [f"launcher.etcd.prefix={user[0]}/", f"launcher.etcd.user={user[0]}",
                 f"launcher.etcd.password_file={user[2]}"] if user else []
        return ["launcher.store=etcd", f"launcher.etcd.endpoints=[{','.join(self.endpoints)}]",
                f"launcher.etcd.ca={t['ca']}", f"launcher.etcd.cert={t['cert']}", f"launcher.etcd.key={t['key']}",
                f"launcher.etcd.lease_s={lease_s:g}", *login]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
