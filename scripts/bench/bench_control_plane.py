"""The control plane at scale: N members against a real agent and store, with no model and no gloo (issue 48).

    nice -n 19 .venv/bin/python scripts/bench/bench_control_plane.py --sizes 64,256,1024

For each size N, one agent process (``distributed.agent.agent.Agent.run``: its TCPStore, admission, health
rounds, rendezvous verdicts, events.jsonl and workers.json) and ``--procs`` member processes, each holding
about N/procs members as threads. Every member is a real ``distributed.membership.membership.Membership``: it checks
its token, asks to join (a signed request, a sealed verdict), heartbeats and polls ``gen/current`` on its
own thread, and enters each generation through ``Membership.rebuild`` (arrive, wait for every member's
arrival, mark formed). Records stay sealed with the job token (HMAC on every write and read).

What is stubbed, and why:
  * ``membership.Group`` (comm.Group: the gloo group a member builds in ``rebuild``) is ``NullGroup``,
    ``membership.PrefixStore`` (the store prefix gloo's rendezvous would use) returns None, and
    ``membership.links`` (listing the group's connections in /proc/self/fd) finds none. The load is the
    control plane alone; gloo needs a process per rank. So gloo's own rendezvous traffic through the store
    (each rank's address, read by every peer) is NOT in these figures.
  * The agent's ``launch`` returns a ``FakeProc`` (as tests/test_agent.py does), and ``process.Worker.signal``
    (in the agent process only) marks that FakeProc killed instead of calling os.kill: a member process holds
    hundreds of members, so a real SIGKILL aimed at one member's pid would end them all. The agent sees the
    kill as it sees a child's death: ``poll()`` answers -9 at its next ``_reap``.
  * No training: a member's step is a sleep of ``--step-s``. At each step boundary it does what the trainer
    does with the membership: it reads the newest ``latest_generation`` of the members of its process (what the
    votes allreduce carries: the maximum over every member's) and, when a newer generation was published, enters
    it with ``rebuild(after=generation)`` (replica.recover).
  * Store clients are wrapped (``CountingStore``) to count calls: one Python call per store call, no change
    to what is sent.

Connections (a stub too): on this machine (2 cores, a gVisor sandbox) a new TCPStore connection stalls 5 or 10 s
when connections are opened at more than a few per second, while open connections answer in under a ms
(c10d then warns "The hostname of the client socket cannot be retrieved. err=-3"). ``protocol.draw`` opens a
throwaway connection (``store.clone()``) for every join request, and a join whose draw stalls 5 s spends the
whole ``VERDICT_S`` on it: the worker asks again, and the agent admits it twice (``Admission.judge`` gives the
second request a fresh id; the first id stays "joining" and the first generation is never published). So by
default each member process opens all its connections before any member starts, one at a time, hands them
to ``membership._connect``, and serves ``draw``'s ``clone()`` from one kept connection; the agent, which draws
a worker id (a ``clone()``) for each of the N workers it spawns, also draws through one kept connection. ``--fresh-connections``
connects as the real code does (and shows the failure here). At 1,024 members even that is 2,048 connections
to open at a few a second (600 in 2.5 min): ``--connections K`` opens K per member process and deals them out,
each call under the connection's lock. The server sees the same calls over fewer sockets; a member's call may
wait behind another's on its connection, which only makes the figures worse.

Figures, per N:
  formation   the first generation: from the agent's "generation" event to the last member back from rebuild
  join        one more member (started by hand with the token) calls join(), until all N+1 entered the
              generation that has it; "publish" is the part until the agent published that generation
  kill        one member goes silent (its heartbeat thread stops, as under SIGSTOP): "detect" is until the
              agent cuts it out (elastic.heartbeat_timeout_s, ``--heartbeat-timeout``, plus up to a health
              round), "protocol" from the cut until every survivor entered the generation without it
  ops/step    store calls per member per step in steady state: the training thread's (step boundary) and the
              membership thread's (heartbeat and gen/current poll; rank 0 also reads every member's memory)
  agent       the agent process's CPU in steady state, as a share of one core: its main (Python) thread, and
              the whole process (the TCPStore server's threads serve every member's polls); ms CPU of the
              main thread per health round (Health.check, every HEALTH_S), and the mean wall time of one round
  load        the member processes' CPU over the same window, in cores: near the machine's cores, the load
              itself is saturated and every time above is inflated

Note: every process runs on this one machine; on 2 cores N=1024 saturates the load (see the "load" column).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import types
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
TICK = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    pass


# ------------------------------------------------------------------ stubs and counters (both roles)
class CountingStore:
    """A store client that counts its calls by method; everything else passes through."""

    def __init__(self, store, role: str, drawing: Optional["CountingStore"] = None):
        self._store, self.role, self._drawing = store, role, drawing
        self.counts: Dict[str, int] = {}
        self.lock = threading.Lock()

    def __getattr__(self, name):
        value = getattr(self._store, name)
        if not callable(value):
            return value

        def counted(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            if name == "clone" and self._drawing is not None:  # protocol.draw's throwaway: a kept one
                return Serialized(self._drawing)
            out = value(*args, **kwargs)
            return CountingStore(out, self.role) if name == "clone" else out
        return counted


class Serialized:
    """One connection shared by a process's members for ``protocol.draw``'s ``add`` (a client is not thread-safe)."""

    def __init__(self, store: CountingStore):
        self._store = store

    def add(self, key: str, value: int) -> int:
        with self._store.lock:
            return self._store.add(key, value)


class Locked:
    """A connection shared by several members' clients (``--connections``): each call under its lock."""

    def __init__(self, store):
        self._store, self._lock = store, threading.Lock()

    def __getattr__(self, name):
        value = getattr(self._store, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            with self._lock:
                return value(*args, **kwargs)
        return call


class NullGroup:
    """Stands in for comm.Group: no gloo, nothing to build, close, abort or cut."""

    hierarchy = None
    aborted = cut = False

    def __init__(self, store, generation: int, *args, **kwargs):
        self.generation, self.members, self.links = generation, [], set()

    def cut_links(self) -> None:
        self.cut = True

    def close(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True


class FakeProc:
    """The agent's handle on a member that is a thread elsewhere: alive until the stubbed signal kills it."""

    def __init__(self, pid: int):
        self.pid, self.rc = pid, None

    def poll(self):
        return self.rc


def _fake_signal(worker, sig: int) -> None:
    if sig == signal.SIGKILL and isinstance(worker.proc, FakeProc):
        worker.proc.rc = -int(signal.SIGKILL)


def write_json(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


# ------------------------------------------------------------------ the agent process
def agent_main(args) -> int:
    from elasticflow.config.schema import compose
    from elasticflow.distributed.agent import agent as agent_mod, health, process
    from elasticflow.distributed.store import stores as stores_mod

    n = args.n
    cfg = compose("models/linear.py", [
        f"launcher.workers={n}", f"launcher.max_workers={n + 1}", "launcher.restart_failed=false",
        "launcher.store=tcp",  # the TCPStore: its server's threads, not the agent's Python, serve the members
        f"elastic.heartbeat_timeout_s={args.heartbeat_timeout}", f"elastic.timeout_s={args.timeout}",
        "elastic.wait_s=3600"])  # the first generation waits for all N, however long they take to join
    process.Worker.signal = _fake_signal
    stores: List[CountingStore] = []
    real_listening = stores_mod.listening_store

    def listening(*a, **kw):
        store, sock = real_listening(*a, **kw)
        kept = None
        if not args.fresh_connections:  # protocol.draw's clone() (a new worker id each) from a kept connection
            from elasticflow.distributed.membership.membership import _connect
            kept = CountingStore(_connect(f"{store.host}:{store.port}", args.timeout), "agent")
            stores.append(kept)
        stores.append(CountingStore(store, "agent", kept))
        return stores[-1], sock
    stores_mod.listening_store = listening

    rounds = {"n": 0, "wall_s": 0.0, "cpu_s": 0.0, "max_wall_s": 0.0}
    real_check = health.Health.check

    def check(self, now):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            real_check(self, now)
        finally:
            took = time.perf_counter() - wall
            rounds["n"] += 1
            rounds["wall_s"] += took
            rounds["max_wall_s"] = max(rounds["max_wall_s"], took)
            rounds["cpu_s"] += time.thread_time() - cpu
    health.Health.check = check

    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
    stats_file, dump_file = args.run_dir / "bench-agent.json", args.run_dir / "bench-profile-now"

    def dump_stats():
        while True:
            time.sleep(0.25)
            counts: Dict[str, int] = {}
            for s in stores:
                for k, v in list(s.counts.items()):
                    counts[k] = counts.get(k, 0) + v
            write_json(stats_file, {"rounds": dict(rounds), "ops": counts})
            if profiler is not None and dump_file.exists():
                dump_file.unlink()
                profiler.dump_stats(str(args.profile))
                write_json(args.run_dir / "bench-profile-done", True)
    threading.Thread(target=dump_stats, daemon=True).start()

    pids = iter(range(4_000_000, 5_000_000))
    a = agent_mod.Agent(cfg, args.run_dir, launch=lambda env: FakeProc(next(pids)))
    if profiler is not None:
        profiler.enable()
    a.run()
    return 0


# ------------------------------------------------------------------ a member process
def members_main(args) -> int:
    from elasticflow.distributed import protocol
    from elasticflow.distributed.membership import membership as mem

    real_connect = mem._connect
    if args.direct_arrivals is not None:
        mem.DIRECT_ARRIVALS = args.direct_arrivals
    stores: List[CountingStore] = []
    lock = threading.Lock()
    ids = [int(i) for i in args.ids.split(",") if i]
    # Every connection opened before any member starts, one at a time (see "Connections" in the docstring).
    opened = 0 if args.fresh_connections else args.connections or 2 * len(ids) + 4
    pool = [real_connect(args.address, args.timeout) for _ in range(opened)]
    shared = [Locked(c) for c in pool] if args.connections else []  # dealt out in turn, never used up
    dealt = [0]
    drawing = CountingStore(real_connect(args.address, args.timeout), "main")

    def connect(address, timeout_s, token=None):
        role = "poller" if threading.current_thread().name == "elasticflow-membership" else "main"
        with lock:
            if shared:
                dealt[0] += 1
            client = shared[dealt[0] % len(shared)] if shared else \
                pool.pop() if pool else real_connect(address, timeout_s, token)
            store = CountingStore(client, role, None if args.fresh_connections else drawing)
            stores.append(store)
        return store
    mem._connect = connect
    mem.Group = NullGroup
    mem.PrefixStore = lambda prefix, store: None  # gloo's store: nothing reads it with NullGroup
    # The group's connections, found in /proc/self/fd around its build (_util/links.py): here one process
    # holds every member's store connections (thousands), and NullGroup opens none.
    mem.links = types.SimpleNamespace(sockets=dict, opened_since=lambda before, port=None: set())

    token = protocol.read_token(args.run_dir)
    steps: Dict[int, int] = {}
    newest = [0]  # the newest generation a member of this process saw: what the votes spread at a step boundary
    killed: Dict[int, bool] = {}
    by_id: Dict[int, "mem.Membership"] = {}

    def say(**record) -> None:
        with lock:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    def member(wid: Optional[int], key: int) -> None:
        try:
            m = mem.Membership(args.address, wid, args.timeout, 3600.0, token)
            started = time.time()
            m.check_token()
            m.join()
            by_id[m.worker_id] = m
            say(ev="entered", id=m.worker_id, g=m.generation, seen=started, at=time.time(), joiner=wid is None)
            while m.worker_id not in killed:
                time.sleep(args.step_s)
                steps[key] = steps.get(key, 0) + 1
                if m.worker_id in killed:
                    break
                # What the step boundary's votes agree on: the newest generation any member saw (the real votes
                # take it over all members; here over this process's, half or more of them).
                newest[0] = max(newest[0], m.latest_generation)
                if newest[0] > m.generation:
                    seen = time.time()
                    m.rebuild(after=m.generation)
                    say(ev="entered", id=m.worker_id, g=m.generation, seen=seen, at=time.time())
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which fails the run
            say(ev="error", id=wid, error=f"{type(exc).__name__}: {exc}"[:300])

    for i, wid in enumerate(ids):
        threading.Thread(target=member, args=(wid, wid), daemon=True).start()
        time.sleep(args.stagger_s)  # the agent's listen backlog: not every member connects at once
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["do"] == "kill":
            killed[cmd["id"]] = True
            by_id[cmd["id"]]._stop.set()  # its heartbeat thread stops now: the agent sees a silent member
            say(ev="killed", id=cmd["id"], at=time.time())
        elif cmd["do"] == "join":
            say(ev="join_started", at=time.time())
            threading.Thread(target=member, args=(None, -2), daemon=True).start()
        elif cmd["do"] == "counts":
            totals: Dict[str, int] = {}
            with lock:
                for s in stores:
                    for k, v in list(s.counts.items()):
                        totals[f"{s.role}.{k}"] = totals.get(f"{s.role}.{k}", 0) + v
            say(ev="counts", counts=totals, steps=sum(steps.values()), cpu_s=sum(os.times()[:2]),
                members=len(steps))
    return 0


# ------------------------------------------------------------------ the driver
def cpu_by_thread(pid: int) -> Dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


class Members:
    """One member process: commands in on stdin, records out on stdout (read by a thread into ``inbox``)."""

    def __init__(self, args, run_dir: Path, address: str, ids: List[int], inbox: "queue.Queue", log: Path):
        cmd = [sys.executable, __file__, "--role", "members", "--run-dir", str(run_dir), "--address", address,
               "--ids", ",".join(map(str, ids)), "--step-s", str(args.step_s), "--timeout", str(args.timeout),
               "--stagger-s", str(args.stagger_s), "--connections", str(args.connections)] + \
            (["--fresh-connections"] if args.fresh_connections else [])
        cmd += ["--direct-arrivals", str(args.direct_arrivals)] if args.direct_arrivals is not None else []
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=REPO)
        self.inbox = inbox
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            record["proc"] = self
            self.inbox.put(record)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


class Run:
    """One size: the agent, the member processes, and what they reported."""

    def __init__(self, args, n: int, work: Path):
        self.args, self.n = args, n
        self.run_dir = work / f"n{n}"
        self.run_dir.mkdir(parents=True)
        self.inbox: "queue.Queue" = queue.Queue()
        self.entered: Dict[int, Dict[int, tuple]] = {}  # generation -> member id -> (seen, entered) times
        self.records: List[dict] = []
        self.members: List[Members] = []
        cmd = [sys.executable, __file__, "--role", "agent", "--run-dir", str(self.run_dir), "-n", str(n),
               "--heartbeat-timeout", str(args.heartbeat_timeout), "--timeout", str(args.timeout)]
        cmd += ["--fresh-connections"] if args.fresh_connections else []
        if args.profile:
            cmd += ["--profile", str(Path(args.profile).resolve().with_suffix(f".n{n}.prof"))]
        self.agent_log = open(self.run_dir.parent / f"agent-n{n}.log", "w")
        self.agent = subprocess.Popen(cmd, stdout=self.agent_log, stderr=subprocess.STDOUT, cwd=REPO)

    def start_members(self) -> None:
        from elasticflow.distributed import protocol

        info = self.wait(lambda: _json(protocol.agent_file(self.run_dir)), 60, "the agent's address")
        procs = max(1, min(self.args.procs, self.n))
        ids = list(range(self.n))  # the agent spawns N (fake) workers first: ids 0..N-1
        for p in range(procs):
            self.members.append(Members(self.args, self.run_dir, info["address"], ids[p::procs], self.inbox,
                                        self.run_dir.parent / f"members-n{self.n}-{p}.log"))

    def pump(self, timeout: float = 0.05) -> None:
        """Take what the member processes reported."""
        try:
            record = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            if record["ev"] == "error":
                raise BenchError(f"N={self.n}: member {record['id']} failed: {record['error']}")
            if record["ev"] == "entered":
                self.entered.setdefault(record["g"], {})[record["id"]] = (record["seen"], record["at"])
            self.records.append(record)
            try:
                record = self.inbox.get_nowait()
            except queue.Empty:
                return

    def wait(self, ready, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            if self.agent.poll() is not None:
                raise BenchError(f"N={self.n}: the agent exited ({self.agent.returncode}) waiting for {what}; "
                                 f"see {self.agent_log.name}")
            self.pump()
            value = ready()
            if value:
                return value
            if time.monotonic() > deadline:
                raise BenchError(f"N={self.n}: no {what} within {timeout_s:g}s (try a larger --deadline, or a "
                                 f"smaller size)")

    def events(self, kind: str) -> List[dict]:
        path = self.run_dir / "events.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line being written
            if record.get("event") == kind:
                out.append(record)
        return out

    def generation_with(self, test) -> Optional[dict]:
        """The first published generation whose members pass ``test``."""
        return next((e for e in self.events("generation") if test(e["members"])), None)

    def all_entered(self, gen: dict) -> Optional[float]:
        """When the last member of ``gen`` returned from rebuild into it (None: not all have yet)."""
        got = self.entered.get(gen["generation"], {})
        if not set(gen["members"]) <= set(got):
            return None
        return max(got[i][1] for i in gen["members"])

    def counts(self) -> dict:
        """Every member process's store counts, steps and CPU seconds, summed; the agent's stats."""
        for m in self.members:
            m.send(do="counts")
        self.wait(lambda: sum(r["ev"] == "counts" for r in self.records) >= len(self.members), 60, "store counts")
        got = {id(r["proc"]): r for r in self.records if r["ev"] == "counts"}
        self.records = [r for r in self.records if r["ev"] != "counts"]
        total: Dict[str, float] = {}
        for r in got.values():
            for k, v in r["counts"].items():
                total[k] = total.get(k, 0) + v
            for k in ("steps", "cpu_s", "members"):
                total[k] = total.get(k, 0) + r[k]
        agent = _json(self.run_dir / "bench-agent.json") or {}
        return {"members": total, "agent": agent, "agent_cpu": cpu_by_thread(self.agent.pid), "at": time.monotonic()}

    def close(self) -> None:
        for m in self.members:
            m.close()
        if self.agent.poll() is None:
            self.agent.kill()
        self.agent.wait(10)
        self.agent_log.close()


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def measure(args, n: int, work: Path) -> dict:
    """Start the agent and N members, then time the first formation, a steady window, a join and a kill."""
    run = Run(args, n, work)
    try:
        run.start_members()
        first = run.wait(lambda: run.generation_with(lambda ids: len(ids) == n), args.deadline, "first generation")
        formed_at = run.wait(lambda: run.all_entered(first), args.deadline, f"all {n} members in generation 0")
        out = {"n": n, "formation_s": formed_at - first["time"]}

        # Steady state: every member heartbeats and steps; nothing changes.
        time.sleep(args.settle_s)
        before = run.counts()
        time.sleep(args.window_s)
        if args.profile:
            (run.run_dir / "bench-profile-now").touch()
            run.wait(lambda: (run.run_dir / "bench-profile-done").exists(), 60, "the agent's profile")
        after = run.counts()
        out.update(steady(before, after, run.agent.pid))

        # A join: one more member, started with the token, until all N+1 entered its generation.
        run.members[0].send(do="join")
        started = run.wait(lambda: next((r for r in run.records if r["ev"] == "join_started"), None), 30, "join")
        joined = run.wait(lambda: run.generation_with(lambda ids: len(ids) == n + 1), args.deadline,
                          "the generation with the joiner")
        joined_at = run.wait(lambda: run.all_entered(joined), args.deadline, f"all {n + 1} in the join's generation")
        out.update(join_s=joined_at - started["at"], join_publish_s=joined["time"] - started["at"],
                   join_form_s=joined_at - joined["time"])
        # Where the form part went: until the last member noticed the generation (its own poll: the bench has no
        # step votes to spread the news), and the longest rebuild from noticing it to entering it.
        times = run.entered.get(joined["generation"], {}).values()
        if times:
            out.update(join_notice_s=max(seen for seen, _ in times) - joined["time"],
                       join_rebuild_s=max(at - seen for seen, at in times))
        ops_after_join = run.counts()
        # Store calls per member to enter one generation (the join's): arrivals read, polls while waiting.
        out["ops_per_member_per_formation"] = (
            sum(v for k, v in ops_after_join["members"].items() if k.startswith("main."))
            - sum(v for k, v in after["members"].items() if k.startswith("main."))) / (n + 1)

        # A kill: a member (the last rank) goes silent; the agent cuts it out after the heartbeat timeout.
        victim = joined["members"][-2]
        holder = next(m for m in run.members if victim in _ids_of(m))
        holder.send(do="kill", id=victim)
        silent = run.wait(lambda: next((r for r in run.records if r["ev"] == "killed"), None), 30, "the kill")
        cut = run.wait(lambda: next((e for e in run.events("hung") if e["worker"] == victim), None),
                       args.deadline, "the agent cutting the silent member out")
        without = run.wait(lambda: run.generation_with(lambda ids: len(ids) == n and victim not in ids),
                           args.deadline, "the generation without the silent member")
        done_at = run.wait(lambda: run.all_entered(without), args.deadline, "every survivor in it")
        out.update(kill_detect_s=cut["time"] - silent["at"], kill_protocol_s=done_at - cut["time"],
                   kill_publish_s=without["time"] - cut["time"], kill_form_s=done_at - without["time"])
        return out
    finally:
        run.close()


def _ids_of(members: Members) -> List[int]:
    return [int(i) for i in members.proc.args[members.proc.args.index("--ids") + 1].split(",")]


def steady(before: dict, after: dict, agent_pid: int) -> dict:
    wall = after["at"] - before["at"]
    b, a = before["members"], after["members"]
    steps = a["steps"] - b["steps"]
    main = sum(a.get(k, 0) - b.get(k, 0) for k in a if k.startswith("main."))
    poller = sum(a.get(k, 0) - b.get(k, 0) for k in a if k.startswith("poller."))
    rb, ra = before["agent"].get("rounds", {}), after["agent"].get("rounds", {})
    rounds = ra.get("n", 0) - rb.get("n", 0)
    agent_ops = sum(after["agent"].get("ops", {}).values()) - sum(before["agent"].get("ops", {}).values())
    cb, ca = before["agent_cpu"], after["agent_cpu"]
    main_cpu = ca.get(agent_pid, 0) - cb.get(agent_pid, 0)
    process_cpu = sum(ca.values()) - sum(cb.get(t, 0) for t in ca)
    return {
        "ops_per_step_training": main / max(steps, 1), "ops_per_step_membership": poller / max(steps, 1),
        "store_ops_per_s": (main + poller + agent_ops) / wall, "agent_ops_per_round": agent_ops / max(rounds, 1),
        "agent_main_core": main_cpu / wall, "agent_process_core": process_cpu / wall,
        "agent_ms_per_round": 1000 * (ra.get("cpu_s", 0) - rb.get("cpu_s", 0)) / max(rounds, 1),
        "round_wall_ms": 1000 * (ra.get("wall_s", 0) - rb.get("wall_s", 0)) / max(rounds, 1),
        "rounds_per_s": rounds / wall, "load_cores": (a["cpu_s"] - b["cpu_s"]) / wall,
    }


COLUMNS = [("N", "n", "{:d}"), ("formation s", "formation_s", "{:.3f}"), ("join s", "join_s", "{:.3f}"),
           ("(publish", "join_publish_s", "{:.3f}"), ("+ form)", "join_form_s", "{:.3f}"),
           ("kill detect s", "kill_detect_s", "{:.3f}"), ("kill protocol s", "kill_protocol_s", "{:.3f}"),
           ("ops/step train", "ops_per_step_training", "{:.2f}"),
           ("ops/step member", "ops_per_step_membership", "{:.2f}"),
           ("ops/formation", "ops_per_member_per_formation", "{:.0f}"),
           ("store ops/s", "store_ops_per_s", "{:.0f}"), ("agent ops/round", "agent_ops_per_round", "{:.0f}"),
           ("agent main %core", "agent_main_core", "{:.1%}"), ("agent proc %core", "agent_process_core", "{:.1%}"),
           ("agent ms/round", "agent_ms_per_round", "{:.2f}"), ("round wall ms", "round_wall_ms", "{:.1f}"),
           ("load cores", "load_cores", "{:.2f}")]


def table(rows: List[dict]) -> str:
    cells = [[h for h, _, _ in COLUMNS]] + [[f.format(r[k]) if k in r else "-" for _, k, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["driver", "agent", "members"], default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="64,256,1024", help="member counts, comma-separated (default 64,256,1024)")
    ap.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)),
                    help="member processes per size (default: cores - 1, at most 8)")
    ap.add_argument("--step-s", type=float, default=0.1, help="a member's step time (default 0.1)")
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0, help="elastic.heartbeat_timeout_s (default 2)")
    ap.add_argument("--timeout", type=float, default=60.0, help="elastic.timeout_s (default 60)")
    ap.add_argument("--window-s", type=float, default=5.0, help="steady-state window (default 5)")
    ap.add_argument("--settle-s", type=float, default=1.0, help="wait after the first formation (default 1)")
    ap.add_argument("--deadline", type=float, default=180.0, help="longest wait for any one event (default 180)")
    ap.add_argument("--stagger-s", type=float, default=0.002, help="between member starts in a process")
    ap.add_argument("--profile", help="cProfile the agent's main thread over the steady window: PATH.n<N>.prof")
    ap.add_argument("--json", help="write the rows to this file too")
    ap.add_argument("--direct-arrivals", type=int,
                    help="members read each other's arrivals up to this many (rendezvous.DIRECT_ARRIVALS; "
                         "beyond, they wait for the agent's gen/<g>/go)")
    ap.add_argument("--fresh-connections", action="store_true",
                    help="connect as the real code does: each member's two connections as it starts, and a new "
                         "one for every join request (protocol.draw's clone); see \"Connections\"")
    ap.add_argument("--connections", type=int, default=0,
                    help="open only this many store connections per member process, each shared by its members "
                         "in turn under a lock (0: two per member); see \"Connections\"")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it (logs, events.jsonl); default: a temporary one")
    # the roles' own
    ap.add_argument("-n", type=int)
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--address")
    ap.add_argument("--ids", default="")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    if args.role == "agent":
        return agent_main(args)
    if args.role == "members":
        return members_main(args)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print(f"command: {' '.join([os.path.relpath(sys.executable, REPO), 'scripts/bench/bench_control_plane.py', *(argv if argv is not None else sys.argv[1:])])}")
    print(f"machine: {os.cpu_count()} cores; {args.procs} member processes; step {args.step_s:g}s; "
          f"heartbeat_timeout_s={args.heartbeat_timeout:g}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep)
        for n in sizes:
            try:
                rows.append(measure(args, n, Path(tmp)))
            except BenchError as exc:
                print(f"error: {exc}", file=sys.stderr)
                rows.append({"n": n})
                for log in sorted(Path(tmp).glob(f"*n{n}*.log")):
                    print(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:]), file=sys.stderr)
            print(f"N={n}: " + json.dumps({k: round(v, 4) for k, v in rows[-1].items()}), flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(len(r) > 1 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
