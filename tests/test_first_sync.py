"""The first state sync (``Replica.sync_state`` as a worker joins) fails like any other collective: the members
regroup and sync again, and the job goes on. Issue #65: a stranger who connected to a worker's gloo port before
its peer did was handed the peer's connection; the first sync waited on it until elastic.timeout_s, and that
failure, unlike one in a step, ended the job (exit 1, no checkpoint)."""
import os
import select
import socket
import struct
import threading
from pathlib import Path

from harness import STEPS, assert_equivalent, events, finish, metrics, start, train_ok, wait_for


def test_a_member_lost_in_the_first_state_sync_regroups_and_the_job_goes_on(tmp_path, reference):
    run = tmp_path / "run"
    # Worker 1 dies in its first sync, before it sends: the others' first sync fails while they wait for it.
    out = train_ok(run, "launcher.workers=3", env={"EF_PROBE_KILL": "1:0:sync"})
    assert_equivalent(run, reference)  # the final checkpoint, on the 1-worker parameters
    recovered = events(run, "recovered")
    assert recovered and recovered[0]["step"] == 0 and recovered[0]["world_size"] == 2, out[-4000:]
    assert len(events(run, "left")) == 1
    world = {r["step"]: r["world_size"] for r in metrics(run) if "loss" in r}
    assert world[1] == 2 and world[STEPS] == 2


def test_a_stranger_on_a_gloo_port_before_the_peer_costs_one_regroup_not_the_job(tmp_path, reference):
    run, stall = tmp_path / "run", tmp_path / "stall.json"
    # Worker 2 waits before it builds its first group (EF_PROBE_STALL_BUILD): workers 0 and 1 listen meanwhile
    # on their gloo ports for it, and the stranger connects first, as a faster process on the path would.
    proc = start(run, "launcher.workers=3", env={"EF_PROBE_STALL_BUILD": f"2:120:{stall}"})
    stranger = Stranger()
    try:
        wait_for(stall.is_file, 120, "worker 2 to reach its group build", proc=proc)
        ports = wait_for(lambda: len(listening(job_pids(proc.pid))) >= 2 and listening(job_pids(proc.pid)), 60,
                         "workers 0 and 1 to listen on their gloo ports", proc=proc)
        stranger.connect(ports)
        stall.unlink()  # worker 2 builds its group: its connection to the hijacked pair is parked unread
        out = finish(proc)
    finally:
        stranger.close()
    assert proc.returncode == 0, out[-4000:]
    assert stranger.read >= 24, "the stranger was never handed a pair: the attack did not happen"
    assert_equivalent(run, reference)  # the final checkpoint, on the 1-worker parameters
    recovered = events(run, "recovered")
    assert len(recovered) == 1 and recovered[0]["step"] == 0 and recovered[0]["world_size"] == 3, out[-4000:]
    assert "generation 0" in recovered[0]["reason"]
    assert not events(run, "left")  # every worker throughout
    world = {r["step"]: r["world_size"] for r in metrics(run) if "loss" in r}
    assert world[1] == 3 and world[STEPS] == 3


class Stranger:
    """Connects to gloo ports and says, on each connection, one of the first pair sequence numbers (gloo's
    listener hands a connection to the pair whose number it reads first), then reads what comes and never
    answers."""

    def __init__(self):
        self.socks, self.read, self._stop = [], 0, threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def connect(self, ports):
        for port in ports:
            for seq in range(4):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(struct.pack("<Q", seq))
                self.socks.append(s)
        self._reader.start()

    def _read(self):
        while not self._stop.is_set() and self.socks:
            ready, _, _ = select.select(self.socks, [], [], 0.1)
            for s in ready:
                try:
                    data = s.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:  # the worker dropped the group (its next generation): nothing more to read here
                    self.socks.remove(s)
                    s.close()
                self.read += len(data)

    def close(self):
        self._stop.set()
        if self._reader.is_alive():
            self._reader.join(10)
        for s in self.socks:
            s.close()


def job_pids(root):
    """ROOT and its descendants (the agent and its workers), from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        pid, ppid = int(text.split()[0]), int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def listening(pids):
    """The loopback TCP ports these processes listen on. (A stranger sees every listening port in
    /proc/net/tcp; the test keeps to its own job's, so as not to disturb another test's.)"""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # it exited
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:  # LISTEN
            ports.append(int(f[1].split(":")[1], 16))
    return sorted(ports)
