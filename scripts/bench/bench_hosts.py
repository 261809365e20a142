"""Across hosts: what launcher=nodes costs over a real TCP link, against the same job on one host, in one run.

    .venv/bin/python scripts/bench/bench_hosts.py                 # ~2.5 min on 2 cores: 3 repeats of kill, off, join
    .venv/bin/python scripts/bench/bench_hosts.py --repeats 1     # a smoke run
    .venv/bin/python scripts/bench/bench_hosts.py --parts cut     # a silent host: ~2.5 min more
    .venv/bin/python scripts/bench/bench_hosts.py --parts join --keep runs/hosts

Hosts are network namespaces on this machine (scripts/ops/hosts.sh through tests/hosts.py): h1 and h2, each
with its own address, hostname and process tree, joined by a bridge whose links are limited to 1 Gbit/s
(tbf). The job is ``elasticflow train MODEL launcher=nodes launcher.endpoint=H1:PORT`` with the same
ELASTICFLOW_JOB_TOKEN on every host; h1 owns the endpoint and runs the agent. Every figure is a median over
``--repeats`` jobs, each on freshly started hosts; the one-host and across-hosts jobs alternate which goes
first, so a change in the machine's load hits both.

The one-host baseline is launcher=nodes too, on h1 alone with launcher.procs_per_node=4 (not launcher=local
with 4 workers): the same agent, the same signed store and gloo on the same namespaced address, the same 4
processes on the same cores. What differs is only where the workers are: across hosts, 2 of them sit
behind a node agent on h2, their exits reach the agent as the node agent's reports, and their traffic
crosses the 1 Gbit/s link. So each ratio is the cost of another host, nothing else.

1. kill: 4 workers (2 on h1, 2 on h2), ``models/digits_mlp.py``; once step ``--kill-at`` is logged,
   SIGKILL the first worker of h2 (one host: the worker of the same rank). Latency: from the SIGKILL to
   the survivors' first metrics.jsonl record after it (world_size 3), as scripts/bench/bench_elastic.py times it.
2. off: the same job; ``hosts.sh off h2`` (its 2 workers and its node agent SIGKILLed at once, by its
   namespace's init), against SIGKILLing the same 2 ranks at once on one host. Latency: from the start of
   the power-off command to the survivors' first record (world_size 2).
3. join: a 100 MB model (``scripts/bench/models/wide_linear.py``, 25M float32 parameters), 2 workers on h1
   (launcher.nodes=1); then the same command on h2 with launcher.procs_per_node=1: a late host whose one
   worker joins. One host: ``elasticflow scale RUN --workers 3`` on h1, one joiner started by the agent.
   From the joiner's "joined" event and the survivors' "regrouped" event, as scripts/bench/join.py reads
   them: rebuild (less the wait for the survivors to finish their step) + state transfer.
4. cut (on request): the job of 1.; ``hosts.sh cut h2`` (its link down: silence, no FIN or RST), against
   SIGSTOPping the same 2 ranks on one host (silent, their sockets open; the agent SIGKILLs them after
   elastic.heartbeat_timeout_s, which closes them). Latency as in 2.

Note: the namespaces share one kernel and one pair of cores: the link's rate is real (tbf), its latency is
a veth's (tens of microseconds), not a physical network's. A host powered off here closes its sockets (the
kernel sends FIN/RST for the dead processes), so its peers' collectives fail at once; a real power-off is
silence, which 4. measures. Needs root. Every subprocess has a timeout; the hosts are torn down after every job.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from runfiles import jsonl  # scripts/bench/runfiles.py (this file's folder, scripts/bench/, is on sys.path)
from bench_elastic import BenchError, Tail, _env, med

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from hosts import SCRIPT, Hosts  # noqa: E402  tests/hosts.py: scripts/ops/hosts.sh for Python

CLI = [sys.executable, "-m", "elasticflow.cli"]
MODEL = "models/digits_mlp.py"
BIG_MODEL = "scripts/bench/models/wide_linear.py"  # 5000 x 5000 float32: 100 MB of parameters
PREFIX, SUBNET = "efb", "10.233.0"          # not the tests' "ef" / 10.231.0: both may run at once
ENDPOINT = f"{SUBNET}.1:29400"              # h1's address; each job gets fresh hosts, so the port is free
RATE = "1gbit"
TOKEN = "b7e1c0d94a6f4f2e9d3a58c1e0f7b624"
START_TIMEOUT_S = 180   # start-up to the kill step (4 processes importing torch on 2 cores, a busy machine)
EVENT_TIMEOUT_S = 90    # a fault to the survivors' next step (a cut: elastic.timeout_s, 30 s); a joiner's start to
                        # its "joined" event
COMMON = ["trainer.global_batch_size=64", "trainer.log_every=1", "trainer.max_steps=1000000",
          "checkpoint.interval.steps=null", "launcher=nodes", f"launcher.endpoint={ENDPOINT}"]


# ---------------------------------------------------------------- hosts and jobs on them
class Net:
    """Two fresh hosts for one job; ``close()`` powers them off (every process on them dies) and reaps."""

    def __init__(self, tmp: Path, name: str):
        self.tmp, self.name = tmp, name
        # Down first, on its own: hosts.sh's `up` over hosts still up comes back with none (its down() loops
        # with a variable named n, not local, and overwrites up's n: `seq efb-sw`), and every run fails.
        self.env = {**os.environ, "EF_HOSTS_PREFIX": PREFIX, "EF_HOSTS_SUBNET": SUBNET}
        self._script("down")
        try:
            self.hosts = Hosts(2, rate=RATE, prefix=PREFIX, subnet=SUBNET)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            self._script("down")
            raise BenchError(f"could not bring the hosts up: {exc}") from None
        self.logs: List = []

    def _script(self, *args: str) -> str:
        return subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                              timeout=60).stdout

    def start(self, host: str, log: str, args: List[str]) -> subprocess.Popen:
        """``args`` on ``host`` in the background, output to TMP/<log>.log (tests/hosts.py's popen pipes it,
        and an unread pipe would stall a long job once it fills)."""
        out = open(self.tmp / f"{log}.log", "w")
        self.logs.append(out)
        env = {**_env(), "EF_HOSTS_PREFIX": PREFIX, "EF_HOSTS_SUBNET": SUBNET, "ELASTICFLOW_JOB_TOKEN": TOKEN}
        proc = subprocess.Popen(["bash", str(SCRIPT), "run", host, *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        self.hosts.procs.append(proc)  # Hosts.down() reaps it
        return proc

    def train(self, host: str, run: Path, model: str, *overrides: str) -> subprocess.Popen:
        return self.start(host, f"{run.name}-{host}", CLI + ["train", str(REPO / model), f"hydra.run.dir={run}",
                                                              "trainer.progress=false", *COMMON, *overrides])

    def global_pid(self, host: str, pid: int) -> int:
        """This machine's pid of ``host``'s process ``pid`` (workers.json holds pids as their host sees them):
        the process in the host's pid namespace whose innermost pid (NSpid's last) is ``pid``."""
        init = next(int(line.split("init=")[1].split()[0]) for line in self._script("list").splitlines()
                    if line.split()[0] == host)
        ns = os.readlink(f"/proc/{init}/ns/pid")
        for entry in os.listdir("/proc"):
            try:
                if not entry.isdigit() or os.readlink(f"/proc/{entry}/ns/pid") != ns:
                    continue
                with open(f"/proc/{entry}/status") as f:
                    nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue
            if int(nspid[-1]) == pid:
                return int(entry)
        raise BenchError(f"no process {pid} on {host}")

    def close(self) -> None:
        self.hosts.down()
        for out in self.logs:
            out.close()


def tail_of(path: Path, n: int = 600) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else ""


def wait_for(predicate, timeout: float, what: str, procs: List[subprocess.Popen], logs: List[Path],
             poll_s: float = 0.005):
    """Poll ``predicate`` until it returns something true; fail when a job's process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise BenchError(f"a job process exited ({proc.returncode}) before {what}: {tail_of(log)!r}")
        time.sleep(poll_s)
    raise BenchError(f"timed out after {timeout:.0f}s waiting for {what} ({tail_of(logs[0], 300)!r})")


def events(run: Path, kind: str, after: float = 0.0) -> List[dict]:
    return [e for e in jsonl(run / "events.jsonl") if e["event"] == kind and e["time"] > after]


# ---------------------------------------------------------------- 1, 2: a fault -> the survivors' next step
@dataclass
class Fault:
    ok: bool
    latency_s: float = float("nan")  # the fault -> the survivors' first record
    note: str = ""
    extra: dict = field(default_factory=dict)


def fault(tmp: Path, name: str, across: bool, what: str, kill_at: int) -> Fault:
    """One job of 4 workers, across h1+h2 (``across``) or on h1 alone, and one fault: ``what`` is "kill" (one
    worker of h2, or the same rank on one host), "off" (h2 powered off, or its 2 ranks killed at once) or "cut"
    (h2's link cut, or its 2 ranks SIGSTOPped: silent peers whose sockets stay open)."""
    run = tmp / name
    net = Net(tmp, name)
    try:
        placement = ["launcher.procs_per_node=2", "launcher.nodes=2"] if across else \
            ["launcher.procs_per_node=4", "launcher.nodes=1"]
        procs = [net.train(h, run, MODEL, *placement) for h in (["h1", "h2"] if across else ["h1"])]
        logs = [tmp / f"{name}-{h}.log" for h in ["h1", "h2"][:len(procs)]]
        tail = Tail(run / "metrics.jsonl")
        wait_for(lambda: tail() >= kill_at, START_TIMEOUT_S, f"step {kill_at}", procs, logs)
        members = json.loads((run / "workers.json").read_text())["members"]
        if len(members) != 4:
            raise BenchError(f"expected 4 members in workers.json, found {len(members)}")
        # Across hosts, h2's workers (ranks 2 and 3: the agent's own 2 start first); on one host, the same ranks.
        far = [m for m in members if m["host"] == "h2"] if across else members[2:]
        if len(far) != 2:
            raise BenchError(f"expected 2 workers on h2, found {[m['host'] for m in members]}")
        victims = far[:1] if what == "kill" else far
        pids = [net.global_pid(m["host"], m["pid"]) for m in victims]
        t0 = time.time()
        if across and what in ("off", "cut"):
            getattr(net.hosts, what)("h2")  # from the command's start: an upper bound by its run time (printed)
        else:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP if what == "cut" else signal.SIGKILL)
        command_s = time.time() - t0
        world = 4 - len(victims)
        first = wait_for(lambda: [r for r in jsonl(run / "metrics.jsonl")
                                  if "loss" in r and r["time"] > t0 and r["world_size"] == world],
                         EVENT_TIMEOUT_S, f"a step by the {world} survivors", procs[:1], logs[:1])[0]
        rec = wait_for(lambda: events(run, "recovered", t0), 10, "the 'recovered' event", procs[:1], logs[:1])[0]
        # When the agent took each victim out: its first "hung" (cut out) or "left" (its exit seen) event.
        out: Dict[int, dict] = {}
        ids = [m["worker_id"] for m in victims]
        for e in jsonl(run / "events.jsonl"):
            if e["event"] in ("left", "hung") and e["time"] > t0 and e.get("worker") in ids:
                out.setdefault(e["worker"], e)
        how = sorted({e.get("reason") or e.get("cause", "") for e in out.values()})
        return Fault(True, first["time"] - t0, extra={
            "ranks": [m["rank"] for m in victims], "command_s": command_s,
            "noticed_s": max(e["time"] - t0 for e in out.values()) if len(out) == len(victims) else float("nan"),
            "how": how,
            "recovery_s": rec["recovery_s"], "detect_s": rec.get("detect_s", float("nan"))})
    except BenchError as exc:  # a job that hangs or dies is a result to report, not the end of the benchmark
        return Fault(False, note=str(exc))
    finally:
        net.close()


# ---------------------------------------------------------------- 3: a 100 MB model joins
def join(tmp: Path, name: str, across: bool) -> Fault:
    """2 workers on h1 train the 100 MB model; one more joins, from h2 (``across``) or from h1."""
    run = tmp / name
    net = Net(tmp, name)
    # As scripts/bench/join.py: long timeouts (a 100 MB step on 2 busy cores must not be taken for a hang).
    big = ["launcher.nodes=1", "optimizer.lr=0.001", "elastic.timeout_s=60", "elastic.heartbeat_timeout_s=20"]
    try:
        procs = [net.train("h1", run, BIG_MODEL, "launcher.procs_per_node=2", "launcher.max_workers=3", *big)]
        logs = [tmp / f"{name}-h1.log"]
        tail = Tail(run / "metrics.jsonl")
        wait_for(lambda: tail() >= 3, START_TIMEOUT_S, "step 3", procs, logs, poll_s=0.05)
        asked = time.time()
        if across:  # the same command on a late host, with one worker: one joiner, as on one host
            procs.append(net.train("h2", run, BIG_MODEL, "launcher.procs_per_node=1", *big))
            logs.append(tmp / f"{name}-h2.log")
        else:
            done = net.hosts.run("h1", [*CLI, "scale", str(run), "--workers", "3", "--wait", "0"], timeout=60)
            if done.returncode != 0:
                raise BenchError(f"elasticflow scale exited {done.returncode}: {(done.stdout + done.stderr)[-400:]}")
        joined = wait_for(lambda: events(run, "joined", asked), EVENT_TIMEOUT_S, "the 'joined' event", procs, logs,
                          poll_s=0.05)[0]
        regrouped = wait_for(lambda: events(run, "regrouped", asked), EVENT_TIMEOUT_S, "the 'regrouped' event",
                             procs, logs, poll_s=0.05)[0]
        # scripts/bench/join.py's reading: the joiner is admitted mid-step, the survivors leave training at the
        # step's end (regrouped's time - recovery_s); until then the joiner's group build only waits for them.
        boundary = regrouped["time"] - regrouped["recovery_s"]
        group_ready = joined["time"] - joined["transfer_s"]
        admitted = group_ready - joined["rebuild_s"]
        rebuild = group_ready - max(boundary, admitted)
        return Fault(True, rebuild + joined["transfer_s"], extra={
            "start_s": joined["start_s"], "admit_s": joined["admit_s"], "wait_s": max(0.0, boundary - admitted),
            "rebuild_s": rebuild, "transfer_s": joined["transfer_s"], "stall_s": regrouped["recovery_s"],
            "world": joined["world_size"]})
    except BenchError as exc:
        return Fault(False, note=str(exc))
    finally:
        net.close()


# ---------------------------------------------------------------- report
MEASURES = {  # what each part measures, in the summary's words
    "kill": "4 workers (one host: 4 on h1; across: 2 on h1 + 2 on h2), SIGKILL one (across: one of h2's) -> "
            "the survivors' next step, s",
    "off": "same; one host: 2 workers SIGKILLed at once; across: h2 powered off (its 2 workers and its node agent) "
           "-> the survivors' next step, s",
    "cut": "same; one host: 2 workers SIGSTOPped (silent, their sockets open); across: h2's link cut (silent: "
           "no FIN or RST reaches h1, as after a real power-off) -> the survivors' next step, s",
    "join": "a 100 MB model, 2 workers on h1, one joins (one host: `elasticflow scale` on h1; across: the same "
            "command on a late host h2, 1 worker): rebuild + state transfer, s",
}


def describe(key: str, f: Fault) -> str:
    if not f.ok:
        return f"FAILED: {f.note[-400:]}"
    x = f.extra
    if key == "join":
        return (f"rebuild + transfer {f.latency_s:.3f} s (rebuild {x['rebuild_s']:.3f}, transfer "
                f"{x['transfer_s']:.3f}; "
                f"waited {x['wait_s']:.3f} for the step boundary; survivors stalled {x['stall_s']:.3f}; process "
                f"start {x['start_s']:.2f}, admission {x['admit_s']:.3f}; world {x['world']})")
    return (f"ranks {x['ranks']}: next step {f.latency_s:.3f} s after the fault (command {x['command_s']:.3f} s; "
            f"the agent took the victims out at {x['noticed_s']:.3f} s: {'; '.join(x['how'])}; 'recovered': recovery_s "
            f"{x['recovery_s']:.3f}, detect_s {x['detect_s']:.3f})")


def report(argv: List[str], elapsed: float, loads, got: Dict[str, Dict[str, List[Fault]]]) -> None:
    import torch

    print("\n## Summary\n")
    print(f"`{shlex.join(['.venv/bin/python', 'scripts/bench/bench_hosts.py', *argv])}`: {elapsed:.0f} s, "
          f"{datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} cores, {platform.platform()}, load "
          f"average {loads[0]:.1f} at start, {loads[1]:.1f} at the end. Hosts: network namespaces on this "
          f"machine, links limited to {RATE}/s (tbf). Medians over repeats.\n")
    print("| measure | one host | across hosts | across / one host | runs ok (one host, across) |")
    print("|---|---|---|---|---|")
    for key, label in MEASURES.items():
        if key not in got:
            continue
        one = med([f.latency_s for f in got[key]["one"] if f.ok])
        across = med([f.latency_s for f in got[key]["across"] if f.ok])
        ok = f"{sum(f.ok for f in got[key]['one'])}/{len(got[key]['one'])}, " \
             f"{sum(f.ok for f in got[key]['across'])}/{len(got[key]['across'])}"
        print(f"| {label} | {one:.3f} | {across:.3f} | x{across / one:.1f} | {ok} |")
        if key == "join":
            for part, words in (("transfer_s", "of which state transfer, s"),
                                ("stall_s", "the survivors' stall (their 'regrouped' recovery_s), s")):
                a = med([f.extra[part] for f in got[key]["one"] if f.ok])
                b = med([f.extra[part] for f in got[key]["across"] if f.ok])
                print(f"| {words} | {a:.3f} | {b:.3f} | x{b / a:.1f} | |")
        else:
            a = med([f.extra["noticed_s"] for f in got[key]["one"] if f.ok])
            b = med([f.extra["noticed_s"] for f in got[key]["across"] if f.ok])
            print(f"| the agent took the victims out (its 'left' or 'hung' event), s after the fault | {a:.3f} | "
                  f"{b:.3f} | x{b / a:.1f} | |")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="jobs per measure and placement (the figure: the median)")
    p.add_argument("--parts", nargs="+", default=["kill", "off", "join"], choices=list(MEASURES),
                   help="which measures; cut (a silent host, bounded by elastic.timeout_s: ~2.5 min more) on request")
    p.add_argument("--kill-at", type=int, default=100, help="the fault lands once this step is logged")
    p.add_argument("--keep", metavar="DIR", help="write the runs under DIR and keep them (default: a temp dir)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("error: bench_hosts.py needs root (scripts/ops/hosts.sh makes network namespaces)", file=sys.stderr)
        return 2
    import torch

    started, load0 = time.monotonic(), os.getloadavg()[0]
    print(f"bench_hosts: {datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, python "
          f"{platform.python_version()}, {os.cpu_count()} cores, load average {load0:.1f}; hosts {PREFIX}-h1/h2 at "
          f"{SUBNET}.1/.2, links {RATE}", flush=True)
    got: Dict[str, Dict[str, List[Fault]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_hosts_") as tmp_name:
        tmp = Path(args.keep or tmp_name).resolve()
        tmp.mkdir(parents=True, exist_ok=True)
        for key in args.parts:
            print(f"\n{key}: {MEASURES[key]}", flush=True)
            got[key] = {"one": [], "across": []}
            for i in range(args.repeats):
                for where in (("one", "across") if i % 2 == 0 else ("across", "one")):
                    name = f"{key}-{where}-{i}"
                    try:
                        f = join(tmp, name, where == "across") if key == "join" else \
                            fault(tmp, name, where == "across", key, args.kill_at)
                    except BenchError as exc:  # the hosts did not come up: this job's result, not the end
                        f = Fault(False, note=str(exc))
                    got[key][where].append(f)
                    print(f"  {i} {where:6s}: {describe(key, f)}", flush=True)
            print(f"   ({time.monotonic() - started:.0f} s so far)", flush=True)
    report(argv, time.monotonic() - started, (load0, os.getloadavg()[0]), got)
    return 0 if all(f.ok for per in got.values() for fs in per.values() for f in fs) else 1


if __name__ == "__main__":
    sys.exit(main())
