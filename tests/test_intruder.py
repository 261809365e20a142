"""A closed cluster: a process that reaches the job's store but holds no token tries every forgery against a
running 3-worker job. The job finishes with the 1-worker parameters, and each forgery is reported refused.

The intruder is a separate process with the job's store address and nothing else (no ELASTICFLOW_* in its
environment). It lists the store's keys, as anyone can, so it knows every record's name.
"""
import functools
import grp
import json
import os
import pwd
import random
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from harness import (PROBE, TOKEN as HOST_TOKEN, assert_equivalent, cli, events, finish, logged_step, run_cli, start,
                     wait_for)

INTRUDER = r"""
import datetime, json, sys, time
from elasticflow.distributed.store.stores import connect

events = sys.argv[2]  # the job's events.jsonl: where the job says what it refused


def job_said(pred):
    # Whether the job's events hold what PRED looks for (a torn last line is left out).
    try:
        lines = open(events).read().splitlines()
    except OSError:
        return False
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            pass
    return pred(found)


def until(pred, what, act=lambda: None):
    # ACT again and again until the job's events show PRED (within a deadline, else exit with WHAT).
    deadline = time.monotonic() + 60
    while not job_said(pred):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for the job to refuse {what}")
        act()
        time.sleep(0.02)


store = connect(sys.argv[1], 10.0)  # the job's private store: this intruder is its owner without the token
keys = store.list_keys()
done = []

def forge(what, key, value):
    store.set(key, value)
    done.append(what)

g = max(int(k.split("/")[1]) for k in keys if k.startswith("gen/") and k.split("/")[1].isdigit())
ids = sorted({int(k.split("/")[1]) for k in keys if k.startswith("worker/") and k.split("/")[1].isdigit()})
# A generation with a stranger in it (and its arrival), named by gen/current; then gen/current as garbage.
forge("fake generation", f"gen/{g + 1}", json.dumps({"members": ids + [999], "action": "train", "reason": "",
                                                     "waiting": []}))
forge("fake arrival", f"gen/{g + 1}/arrived/999", "1")
forge("gen/current", "gen/current", str(g + 1))
forge("gen/current garbage", "gen/current", "garbage")
forge("current generation replaced", f"gen/{g}", json.dumps({"members": [999], "action": "stop", "reason": "x",
                                                             "waiting": []}))
for i in ids:
    forge("memory", f"worker/{i}/memory", "garbage")
    forge("heartbeat", f"worker/{i}/hb", "not-a-number")
    forge("failure report", f"gen/{g}/failed/{i}", "1")
# The agent reads failure reports when their count moves (or every few seconds): a stranger who wants its forged
# reports acted on moves the count too, and has them read -- and refused.
store.set(f"gen/{g}/failures", str(10 ** 6))  # a hint, never trusted: not a record that can be refused
# The checkpoint folder slot (found by listing) and the shard reports of the saves to come.
for k in keys:
    if k.startswith("ckpt/job/"):
        forge("checkpoint job", k, "../../escape")
token = next(store.get(k).decode().split(" ", 1)[1] for k in keys if k.startswith("ckpt/token/"))
for step in (20, 40, 60):
    for r in range(3):
        forge("checkpoint report", f"ckpt/{token}/step_{step}/g{g}.1/rank{r}",
              json.dumps({"ok": True, "rank": r, "file": "../../etc/passwd", "bytes": 1}))
# Scale requests: malformed, unsigned, and a replay of the real one the test made before.
replayed = [store.get(k) for k in keys if k.startswith("control/request/")]
for request in ["[]", "null", json.dumps({"workers": None}), json.dumps({"workers": 1, "nonce": "abc", "mac": "0"}),
                *replayed]:
    n = store.add("control/count", 1)
    forge("scale request", f"control/request/{n}", request)
# Join requests: malformed, unsigned, and a real one replayed under a new number; then a huge join/count.
real = [store.get(k) for k in keys if k.startswith("join/request/")]
for request in ["[]", json.dumps({"id": None}), json.dumps({"n": 1, "id": 5, "pid": 1, "host": "x", "node": None,
                                                            "nonce": "n", "mac": "00"}), *real[:1]]:
    n = store.add("join/count", 1)
    forge("join request", f"join/request/{n}", request)
# Read (and refused) by the agent before the count below hides them.
until(lambda found: sum(e["event"] == "refused" and "pid" in e for e in found) >= 4, "the join requests")
store.add("join/count", 10 ** 12)
done.append("huge join/count")
# Memory figures and heartbeats again and again until their readers (rank 0 reads the figures every 2 s, the
# agent the beats every round) have refused one: forgeries the readers see, not ones the member's own next
# record replaced first. The beats only until the agent refused one: a stranger who drowns every beat for
# elastic.heartbeat_timeout_s gets a worker cut out.
def refused(kind):
    return lambda found: any(e["event"] == "forged" and e.get("record") == kind for e in found)


def forge_all(key, value):
    return lambda: [store.set(f"worker/{i}/{key}", value) for i in ids]


until(refused("heartbeat"), "a forged heartbeat", forge_all("hb", "not-a-number"))
until(refused("memory"), "a forged memory figure", forge_all("memory", "garbage"))
print(json.dumps(done))
"""


def test_an_intruder_without_the_token_changes_nothing(tmp_path, reference):
    run, pace = tmp_path / "run", tmp_path / "pace"
    pace.touch()  # slow steps while the intruder tries its forgeries; lifted once it is done
    proc = start(run, "launcher.workers=3", "checkpoint.interval.steps=20",
                 env={"EF_PROBE_SLEEP": "0.35", "EF_PROBE_PACE": str(pace)})
    wait_for(lambda: logged_step(run) >= 5, 120, "step 5")
    run_cli(["scale", run, "--workers", 3, "--wait", 30], timeout=90, check=True)  # a real request, to replay
    agent_file = run / ".elasticflow" / "agent.json"
    assert stat.S_IMODE(agent_file.stat().st_mode) == 0o600  # the store's address is the owner's to read
    address = json.loads(agent_file.read_text())["address"]
    script = tmp_path / "intruder.py"
    script.write_text(INTRUDER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICFLOW_")}
    intruder = subprocess.run([sys.executable, str(script), address, str(run / "events.jsonl")],
                              capture_output=True, text=True, timeout=240, env=env)
    assert intruder.returncode == 0, intruder.stderr[-3000:]
    tried = set(json.loads(intruder.stdout.splitlines()[-1]))
    pace.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert_equivalent(run, reference)
    log = events(run)
    assert all(e["members"] and 999 not in e["members"] for e in log if e["event"] == "generation")
    assert {len(e["members"]) for e in log if e["event"] == "generation"} == {3}  # nobody left, nobody entered
    forged = {e["record"] for e in log if e["event"] == "forged"}
    refused = [e for e in log if e["event"] == "refused" and "pid" in e]  # join requests
    # Each forgery, by the kind of record its refusal names.
    expect = {"fake generation": "generation", "fake arrival": "generation", "gen/current": "gen/current",
              "gen/current garbage": "gen/current", "current generation replaced": "generation",
              "memory": "memory", "heartbeat": "heartbeat", "failure report": "arrival",
              "checkpoint job": "checkpoint job", "checkpoint report": "checkpoint report",
              "scale request": "scale request", "huge join/count": "join/count"}
    # A forged shard report is refused when rank 0 reads it before the rank's own report replaces it, which
    # is a race (test_coordinator_refuses_a_forged_report makes it certain); either way the commits are real.
    for what in tried - {"join request", "checkpoint report"}:
        assert expect[what] in forged, f"{what}: no refusal of kind {expect[what]!r} in {sorted(forged)}"
    assert "join request" in tried and len(refused) >= 4 and all("token" in e["reason"] for e in refused), refused
    job_dirs = [p.name for p in (run / "checkpoints").iterdir()]
    assert len(job_dirs) == 1 and not (tmp_path / "escape").exists()
    assert not any(p.name == "escape" for p in tmp_path.parent.iterdir())
    metas = list((run / "checkpoints").glob("*/step_*/metadata.json"))
    assert metas
    for meta in metas:  # every committed save names its own shard files, nothing a forged report said
        files = {shard["file"] for t in json.loads(meta.read_text())["tensors"].values() for shard in t["shards"]}
        assert files and all("/" not in f and (meta.parent / f).is_file() for f in files), files


def test_coordinator_refuses_a_forged_report_and_takes_the_real_one():
    from elasticflow.checkpoint.coordinator import StoreCoordinator
    from elasticflow.distributed.store.listen import listening_store
    from elasticflow.distributed.store.stores import connect
    from elasticflow._util.sealing import REFUSED, Sealer

    store, listener = listening_store("127.0.0.1", 5.0)
    try:
        sealer = Sealer("t" * 32, "job1")
        rank1 = StoreCoordinator(functools.partial(connect, f"127.0.0.1:{store.port}", 5.0), sealer)
        rank0 = StoreCoordinator(functools.partial(connect, f"127.0.0.1:{store.port}", 5.0), sealer)
        before = REFUSED.counts.get("checkpoint report", 0)
        key = "ckpt/x/step_1/g0.1/rank1"
        store.set(key, json.dumps({"ok": True, "file": "../../etc/passwd"}))  # no MAC
        replay = Sealer("t" * 32, "an-older-run").seal(key, json.dumps({"ok": True, "file": "old"}))  # another run's
        threading.Timer(0.3, lambda: store.set(key, replay)).start()
        threading.Timer(0.8, lambda: rank1.report("ckpt/x/step_1/g0.1", 1, {"ok": True, "file": "rank1.bin"})).start()
        rank0.report("ckpt/x/step_1/g0.1", 0, {"ok": True, "file": "rank0.bin"})
        got = rank0.collect("ckpt/x/step_1/g0.1", 2, timeout_s=5.0)
        assert [r["file"] for r in got] == ["rank0.bin", "rank1.bin"]
        assert REFUSED.counts["checkpoint report"] == before + 2  # the unsigned one, and the replay
    finally:
        listener.close()


def test_the_checkpoint_coordinator_connects_as_the_worker_joins_not_at_the_first_save():
    """Issue #65: the coordinator's first connection was made at the first save, and a door shut by then cost the
    job every checkpoint. It is opened with the coordinator (as the worker joins): later connections that fail
    cost it nothing."""
    import torch.distributed as dist

    from elasticflow.checkpoint.coordinator import StoreCoordinator
    from elasticflow.distributed.store.listen import listening_store
    from elasticflow.distributed.store.stores import connect
    from elasticflow._util.sealing import Sealer

    store, listener = listening_store("127.0.0.1", 5.0)
    opened = []

    def connect_once():
        if opened:
            raise dist.DistNetworkError("the store is busy with other connections' handshakes")
        opened.append(connect(f"127.0.0.1:{store.port}", 5.0))
        return opened[-1]

    try:
        coordinator = StoreCoordinator(connect_once, Sealer("t" * 32, "job1"))
        assert len(opened) == 1  # before any save
        reports = []
        writer = threading.Thread(target=lambda: (coordinator.report("ckpt/x/step_1/g0.1", 0, {"ok": True}),
                                                  reports.append(coordinator.collect("ckpt/x/step_1/g0.1", 1, 5.0))))
        writer.start()  # from the writer thread, as saves are
        writer.join(60)
        assert reports == [[{"ok": True}]] and len(opened) == 1
    finally:
        listener.close()


CRASHER = r"""
import datetime, json, sys, time
from elasticflow.distributed.store.stores import connect

phase = sys.argv[2]
store = connect(sys.argv[1], 10.0)
ESCAPES = "\x1b[2J\x1b[HFAKE LINE: job finished, all good"
if phase == "bombs":
    # Parser bombs where the agent reads: a join request and a scale request of 100,000 nested brackets, one of
    # 70 KB, and a join request whose host clears the screen (refused: its host reaches the console and status).
    for count, prefix in (("join/count", "join/request"), ("control/count", "control/request")):
        for value in ("[" * 100000, json.dumps({"pad": "x" * 70000}),
                      json.dumps({"id": 1, "pid": 1, "host": ESCAPES, "node": None, "nonce": "n", "mac": "0"})):
            store.set(f"{prefix}/{store.add(count, 1)}", value)
    ids = sorted({int(k.split("/")[1]) for k in store.list_keys() if k.startswith("worker/") and k.split("/")[1].isdigit()})
    for i in ids:
        store.set(f"worker/{i}/device", ESCAPES)  # the one unsealed record: shown by `status`
    deadline = time.monotonic() + 60  # the agent reads (and refuses) the requests before their counters go
    while sum('"refused"' in line and '"pid"' in line for line in open(sys.argv[3]).read().splitlines()) < 3:
        assert time.monotonic() < deadline, "the agent never refused the join requests"
        time.sleep(0.05)
    # The counters deleted and put back to text, again and again for 3 s: an agent that checks a key and then
    # gets it waits for the store's timeout (and died of it); one that adds to text loses its connection.
    end = time.monotonic() + 3
    while time.monotonic() < end:
        for key in ("join/count", "control/count"):
            store.delete_key(key)
        time.sleep(0.002)
        for key in ("join/count", "control/count"):
            store.set(key, "not a count")
        time.sleep(0.002)
    print("done")
else:  # "text": text in the counters while a real worker joins and a real scale request is made
    end = time.monotonic() + float(phase)
    while time.monotonic() < end:
        for key in ("join/count", "control/count"):
            store.set(key, "not a count")
        time.sleep(0.05)
    print("done")
"""


def test_an_intruder_cannot_crash_stall_or_deceive_the_agent(tmp_path, reference):
    """Parser bombs, counters deleted or set to text between a check and a read, and terminal escapes, each
    caused for real against a running 3-worker job that then grows to 4: the job finishes on the 1-worker
    model with its checkpoint, the real join and scale request get through, and nothing prints an escape."""
    run, pace = tmp_path / "run", tmp_path / "pace"
    pace.touch()
    proc = start(run, "launcher.workers=3", "launcher.max_workers=4", "checkpoint.interval.steps=20",
                 env={"EF_PROBE_SLEEP": "0.5", "EF_PROBE_PACE": str(pace)})
    wait_for(lambda: logged_step(run) >= 5, 120, "step 5")
    address = json.loads((run / ".elasticflow" / "agent.json").read_text())["address"]
    script = tmp_path / "crasher.py"
    script.write_text(CRASHER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICFLOW_")}

    def attack(phase):
        return subprocess.Popen([sys.executable, str(script), address, phase, run / "events.jsonl"],
                                stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    bombs = attack("bombs")
    assert bombs.wait(120) == 0, bombs.stderr.read()[-3000:]
    shown = run_cli(["status", run], timeout=60, check=True).stdout
    assert "FAKE LINE" in shown and "\x1b" not in shown and "\\x1b[2J" in shown, shown
    text = attack("3")  # text in both counters while `scale` draws its number and the new worker its own
    grown = run_cli(["scale", run, "--workers", 4, "--wait", 60], timeout=120)
    assert text.wait(60) == 0, text.stderr.read()[-3000:]
    assert grown.returncode == 0, grown.stdout + grown.stderr
    wait_for(lambda: any(len(e.get("members", [])) == 4 for e in events(run) if e["event"] == "generation"),
             120, "the 4th worker's generation")
    pace.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "\x1b" not in out
    assert_equivalent(run, reference)
    assert list((run / "checkpoints").glob("*/step_*/metadata.json"))
    log = events(run)
    refused = [e for e in log if e["event"] == "refused" and "pid" in e]
    assert len(refused) >= 3 and all("token" in e["reason"] for e in refused), refused
    assert any(e["host"].startswith("\\x1b[2J\\x1b[HFAKE LINE") for e in refused), refused  # kept as text
    assert {"join/count", "control/count"} <= {e["record"] for e in log if e["event"] == "forged"}


LOCAL_USER = r"""
import json, os, socket, sys

# A local user without the token: it finds the job's store where any local user can (every Unix socket's path
# is in /proc/net/unix), then tries to open it and to read the job's private files.
run = sys.argv[1]
tried = {}
found = [line.split()[-1] for line in open("/proc/net/unix") if line.rstrip().endswith("/store.sock")]
tried["found"] = sorted({p for p in found if p.startswith(run)})  # one line per connection
for path in tried["found"]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        tried["connect"] = "connected"
    except OSError as e:
        tried["connect"] = type(e).__name__
tried["run_dir"] = sorted(os.listdir(run))  # the run directory itself is readable: events, metrics
for name in ("agent.json", "token"):
    try:
        open(os.path.join(run, ".elasticflow", name)).read()
        tried[name] = "read"
    except OSError as e:
        tried[name] = type(e).__name__
print(json.dumps(tried))
"""


def _tcp_listeners(pid: int) -> list:
    """The TCP ports process PID listens on (its sockets' inodes, found in /proc/net/tcp{,6} as LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            rows = [line.split() for line in open(table).read().splitlines()[1:]]
            ports += [int(r[1].rsplit(":", 1)[1], 16) for r in rows if r[3] == "0A" and r[9] in inodes]
    return ports


@pytest.mark.skipif(os.geteuid() != 0, reason="attacks as another user (nobody): needs root (as CI has)")
def test_a_local_user_cannot_reach_the_job_store(reference):
    """A 3-worker job in a run directory every local user may enter: its agent listens on no TCP port, and
    ``nobody`` finds the store's socket but cannot open it, nor read the store's address or the token. The job
    ends on the 1-worker parameters. (Gloo's own ports, between the workers, stay open: docs/security.md.)"""
    world = Path(tempfile.mkdtemp(prefix="ef-intruder-"))  # pytest's tmp_path is root's 0700: nobody would
    try:                                                    # stop there, whatever the job did
        os.chmod(world, 0o755)
        run, pace = world / "run", world / "pace"
        pace.touch()
        proc = start(run, "launcher.workers=3", "checkpoint.interval.steps=20",
                     env={"EF_PROBE_SLEEP": "0.2", "EF_PROBE_PACE": str(pace)})
        wait_for(lambda: logged_step(run) >= 3, 120, "step 3")
        agent = json.loads((run / ".elasticflow" / "agent.json").read_text())
        assert agent["address"].startswith("unix:") and _tcp_listeners(agent["pid"]) == []
        script = world / "local_user.py"
        script.write_text(LOCAL_USER)
        script.chmod(0o644)
        tried = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3",
                                str(script), str(run)], capture_output=True, text=True, timeout=60)
        assert tried.returncode == 0, tried.stderr
        seen = json.loads(tried.stdout)
        assert seen["found"] == [agent["address"][len("unix:"):]], seen  # finding it is not opening it
        assert seen["connect"] == "PermissionError", seen
        assert seen["agent.json"] == seen["token"] == "PermissionError", seen
        assert ".elasticflow" in seen["run_dir"], seen
        pace.unlink()
        out = finish(proc)
        assert proc.returncode == 0, out[-4000:]
        assert_equivalent(run, reference)
        assert list((run / "checkpoints").glob("*/step_*/metadata.json"))
        assert not (run / ".elasticflow" / "store.sock").exists()  # gone with the job
    finally:
        shutil.rmtree(world, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a directory to another user: needs root (as CI has)")
def test_a_run_directory_another_user_can_write_is_refused(tmp_path):
    """A local user (``nobody``) pre-creates the run directory, world-writable, to swap config.yaml under the job
    later (the workers import the model file it names): the job refuses it in one line before writing or reading
    anything of its own there. So does a folder of one's own that a shared group may write, unless trusted; a
    user private group (a umask of 002) is no one else."""
    planted = tmp_path / "planted"
    made = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "mkdir", "-m", "777",
                           str(planted)], capture_output=True, text=True)
    if made.returncode != 0:  # tmp_path's parents may not be searchable by nobody: make it as root, give it away
        planted.mkdir()
        os.chown(planted, pwd.getpwnam("nobody").pw_uid, -1)
        planted.chmod(0o777)
    out = cli(["train", PROBE, f"hydra.run.dir={planted}", "trainer.max_steps=1"])
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: the run directory {planted} belongs to uid {pwd.getpwnam('nobody').pw_uid}, "
                               "not to you"), lines
    assert lines[1] == (f"hint: use a directory of your own (chmod go-w {planted}), or pass "
                        "launcher.trust_shared_dirs=true if everyone who can write there is trusted")
    assert not (planted / ".elasticflow").exists() and not (planted / "checkpoints").exists()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    os.chown(shared, -1, grp.getgrnam("daemon").gr_gid)  # the primary group of user daemon too
    out = cli(["train", PROBE, f"hydra.run.dir={shared}", "trainer.max_steps=1"])
    assert out.returncode == 2, out.stderr
    assert "may be written by its group, which has other members (mode 775)" in out.stderr, out.stderr
    trusted = cli(["train", PROBE, f"hydra.run.dir={shared}", "trainer.max_steps=1", "launcher.trust_shared_dirs=true"])
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o775)  # and in this user's own group, whom nobody else is in (root's, on the test machines)
    assert all(p.pw_name == "root" for p in pwd.getpwall() if p.pw_gid == os.getegid())
    assert not grp.getgrgid(os.getegid()).gr_mem
    mine = cli(["train", PROBE, f"hydra.run.dir={private}", "trainer.max_steps=1"])
    assert mine.returncode == 0, mine.stderr[-2000:]


SLOW_HANDSHAKES = r"""
import json, os, socket, sys, threading, time
from elasticflow.distributed.store import wire

# A stranger on the job's host (the same address as its workers: 127.0.0.1), and with "all" on 16 more: each of
# its connections sends one right byte of a handshake every second, as if it were slow, and is opened again as
# soon as it is hung up on. 24 from the workers' address (16 fill its places); with "all", 16 from each of 16
# others too (256: the door's every place).
port, progress, stop, spread = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
start = getattr(wire, "OPEN", b"") + bytes(wire.NONCE)  # every byte right: none is a MAC byte, which it could
                                                       # not get right
seen = {"connections": 0, "busy": 0, "cut": 0}
lock = threading.Lock()


def count(what):
    with lock:
        seen[what] += 1


def slot(source):
    while not os.path.exists(stop):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
        except OSError:  # the agent is not listening yet (or no longer)
            time.sleep(0.05)
            continue
        count("connections")
        opened, sent, said = time.monotonic(), 0, b""
        try:
            s.settimeout(1.0)
            while not os.path.exists(stop) and sent < len(start):
                s.sendall(start[sent:sent + 1])
                sent += 1
                try:
                    said = s.recv(64)
                except socket.timeout:
                    continue
                if not said or said.startswith(wire.BUSY):
                    break  # told to come back, or closed
                said = b""  # a greeting (the store of before issue #65 greeted first): go on trickling
        except OSError:
            pass
        finally:
            s.close()
        if said.startswith(wire.BUSY) and time.monotonic() - opened < 0.5:
            count("busy")  # the door was full
            time.sleep(0.5)
        elif sent > 1:
            count("cut")   # held a place, and was hung up on (at the handshake's deadline)


sources = ["127.0.0.1"] * 24 + ([f"127.0.0.{i}" for i in range(2, 18) for _ in range(16)] if spread == "all" else [])
for source in sources:
    threading.Thread(target=slot, args=(source,), daemon=True).start()
while not os.path.exists(stop):
    with lock:
        text = json.dumps(seen)
    with open(progress + ".tmp", "w") as f:
        f.write(text)
    os.replace(progress + ".tmp", progress)
    time.sleep(0.5)
print(json.dumps(seen))
"""


def _free_port() -> int:
    """A free port below the ephemeral range: an attacker's connections to it, made before anything listens
    there, never take it themselves (a connection from an ephemeral port equal to its target connects to
    itself, and would hold the port the agent is about to listen on)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(max(1024, low - 8000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


def test_slow_handshakes_shut_no_worker_out_of_the_token_store(tmp_path, reference):
    """Issue #65's first attack, caused for real: a stranger holds more than the token store's whole door with
    slow handshakes (one right byte a second, from the workers' own address and 16 more), from before the job
    starts and again while it trains. A 3-worker job on that store (launcher=nodes on this host) still forms,
    saves and commits every checkpoint: exit 0, every worker throughout, the 1-worker parameters."""
    run, pace, stop = tmp_path / "run", tmp_path / "pace", tmp_path / "stop"
    port = _free_port()
    script = tmp_path / "slow_handshakes.py"
    script.write_text(SLOW_HANDSHAKES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICFLOW_")}

    def attack(name, spread):
        return subprocess.Popen([sys.executable, str(script), str(port), str(tmp_path / name), str(stop), spread],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def progress(name):
        try:
            return json.loads((tmp_path / name).read_text())
        except (OSError, ValueError):
            return {}

    pace.touch()
    attackers = [attack("before", "all")]
    try:
        proc = start(run, "launcher=nodes", f"launcher.endpoint=127.0.0.1:{port}", "launcher.procs_per_node=3",
                     "checkpoint.interval.steps=20",
                     env={"ELASTICFLOW_JOB_TOKEN": HOST_TOKEN, "EF_PROBE_SLEEP": "0.3", "EF_PROBE_PACE": str(pace)})
        wait_for(lambda: progress("before").get("busy", 0) > 0, 120, "the door full before the workers come",
                 proc=proc)
        wait_for(lambda: logged_step(run) >= 5, 180, "step 5", proc=proc)
        attackers.append(attack("during", "own address"))
        wait_for(lambda: progress("during").get("busy", 0) >= 24 and progress("before").get("cut", 0) >= 256, 120,
                 "the door full while the job trains", proc=proc)
        pace.unlink()
        out = finish(proc)
        stop.touch()
        seen = [json.loads(a.communicate(timeout=60)[0].splitlines()[-1]) for a in attackers]
    finally:
        stop.touch()
        for a in attackers:
            if a.poll() is None:
                a.kill()
                a.communicate()
    assert proc.returncode == 0, out[-4000:]
    assert "the store is busy" not in out and "did not commit" not in out, out[-4000:]
    assert all(s["busy"] > 0 for s in seen) and seen[0]["cut"] >= 256, seen  # full, and each place held to its end
    assert_equivalent(run, reference)
    generations = [e for e in events(run) if e["event"] == "generation"]
    assert generations and {len(e["members"]) for e in generations} == {3}  # every worker, throughout
    assert list((run / "checkpoints").glob("*/step_*/metadata.json"))
