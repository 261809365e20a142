"""launcher=nodes across real hosts (network namespaces: tests/hosts.py): the same command on every host,
and what only happens across hosts -- a host powered off, a partition that heals, a host joining late, the
agent's own host lost. Each run is checked against the 1-worker run and the exactly-once sample record."""
from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

from harness import (ENDPOINT, PROBE, STEPS, TOKEN, Limit, assert_each_sample_once, assert_equivalent, events, finish,
                     logged_step, metrics, nodes_args, cli, start_on_hosts, wait_for, workers, world_sizes)
from hosts import Hosts, hosts  # noqa: F401 - fixture

from elasticflow import checkpoint as ckpt


def failures(run: Path, worker_ids) -> list:
    """What those workers' logs say of their collectives that failed."""
    return [line for w in worker_ids for line in (run / "logs" / f"worker-{w}.log").read_text().splitlines()
            if "failed in generation" in line]


def worker_hosts(run: Path) -> Counter:
    return Counter(m["host"] for m in json.loads((run / "workers.json").read_text())["members"])


STRANGER = r"""
import datetime, socket, struct, sys
from torch.distributed import TCPStore
from elasticflow.distributed.store.stores import connect
# A stranger on the job's network: it knows the endpoint (a port scan would find it), not the token. Each attack
# of issue #42 needs a connection first: a TCPStore client's and ours under a wrong token are refused, so none
# is ever tried (each would print "served"). Then a request sent before any handshake, and a flood of
# connections that never prove anything, held while the job trains on.
host, port = sys.argv[1].rsplit(":", 1)
clients = {"tcpstore": lambda: TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=1)),
           "wrong token": lambda: connect("token:" + sys.argv[1], 3.0, "not the job's token" * 2)}
attacks = {"nested join request": lambda s: s.set("join/req/0", "[" * 100000),
           "counter deleted": lambda s: s.delete_key("join/count"),
           "refusal forged": lambda s: s.set("join/ack/0", '{"refused": "forged"}'),
           "shard reports deleted": lambda s: [s.delete_key(k) for k in s.list_keys() if k.startswith("ckpt/")],
           "gloo rank keys overwritten": lambda s: s.set("gen/1/pg/rank_0", "garbage"),
           "memory filled": lambda s: s.set("junk", b"x" * (8 << 20))}
for who, make in clients.items():
    try:
        store = make()
    except Exception as exc:
        print(who, "refused", type(exc).__name__)
        continue
    for what, attack in attacks.items():
        attack(store)
        print(who, what, "served")
raw = socket.create_connection((host, int(port)))
body = b"".join(struct.pack("!I", len(f)) + f for f in (b"set", b"gen/current", b"99"))
raw.sendall(struct.pack("!I", len(body)) + body)
raw.settimeout(30)
try:
    while raw.recv(4096):
        pass
except ConnectionResetError:
    pass
print("raw frame refused: hung up")
flood = [socket.create_connection((host, int(port))) for _ in range(48)]
print("flood", "held", len(flood))
"""


def test_two_hosts_of_two_workers_equal_one_worker(hosts, tmp_path, reference):
    """Two hosts of two workers train as one; a stranger on a third host, without the token, is refused by the
    store (each attack of issue #42 by a plain TCPStore client and by our client with a wrong token, a request
    before any handshake, a flood of silent connections) and changes nothing."""
    net = hosts(3)
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    # The job trains on while the stranger tries, but cannot end before it is done (a paced job once ended
    # first on a loaded machine, and the flood met a closed door)
    limit = Limit(tmp_path / "limit", 40)
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", record=record,
                           env={"EF_PROBE_SLEEP": "0.1", "EF_PROBE_LIMIT": str(limit.path)})
    wait_for(lambda: logged_step(run) >= 3, 180, "step 3")
    script = tmp_path / "stranger.py"
    script.write_text(STRANGER)
    tried = net.run("h3", [sys.executable, str(script), ENDPOINT], timeout=120)
    limit.lift()
    assert tried.stdout.count("refused") == 3 and "served" not in tried.stdout, tried.stdout + tried.stderr
    assert "flood held 48" in tried.stdout, tried.stdout + tried.stderr
    out = {h: finish(p) for h, p in procs.items()}
    assert procs["h1"].returncode == 0, out["h1"][-3000:]
    assert procs["h2"].returncode == 0, out["h2"][-3000:]
    assert "done: host=h2 workers=2" in out["h2"]
    assert_equivalent(run, reference)
    assert_each_sample_once(run, record)
    assert {r["world_size"] for r in metrics(run) if "loss" in r} == {4}
    hosts_seen = {e["host"] for e in events(run) if e["event"] == "node"}
    assert hosts_seen == {"h2"}
    # Every worker advertised its host's own address to its peers, never a loopback one.
    for log in (run / "logs").glob("worker-*.log"):
        assert "127.0.0.1" not in log.read_text()


def test_host_powered_off_mid_step(hosts, tmp_path, reference):
    net = hosts(2)
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    pace = tmp_path / "pace"  # steps take EF_PROBE_SLEEP while it exists: h2 goes off in the middle of one
    pace.touch()
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", "launcher.min_workers=2",
                      env={"EF_PROBE_SLEEP": "0.1", "EF_PROBE_PACE": str(pace)}, record=record)
    wait_for(lambda: logged_step(run) >= 20, 150, "step 20")
    net.off("h2")  # both of its workers and its node agent die at once
    pace.unlink()  # h1's workers go on at full speed once they have regrouped
    out = finish(procs["h1"])
    assert procs["h1"].returncode == 0, out[-3000:]
    assert_equivalent(run, reference)
    assert_each_sample_once(run, record)
    world = world_sizes(run)
    assert world[0] == 4 and world[-1] == 2
    cut = events(run, "hung")
    assert len(cut) == 2 and all("host h2 went silent" in e["reason"] or "never reported" in e["reason"] for e in cut)
    recovered = events(run, "recovered")
    assert recovered and recovered[0]["world_size"] == 2
    # The survivors went on once h2 was known silent (hosts.NODE_SILENT_S), not after their collective timed out.
    lost = failures(run, (0, 1))
    assert lost and not [line for line in lost if "Timed out" in line], lost


def test_partition_longer_than_the_timeouts_then_heal(hosts, tmp_path, reference):
    """h2 cut off for longer than elastic.timeout_s: h1's workers go on once the agent declares h2's gone
    (heartbeat_timeout_s: they cut their links to the silent host, not waiting out their collective's
    timeout_s); h2's workers, cut off, write nothing the job reads and exit; when the link heals h2's node
    agent starts them again and they join as new members. The result is still the 1-worker run's."""
    net = hosts(2)
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    pace = tmp_path / "pace"  # steps take EF_PROBE_SLEEP while it exists: the job outlasts h2's restarts
    pace.touch()
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", "launcher.min_workers=2",
                      "elastic.heartbeat_timeout_s=2", "elastic.timeout_s=8", "launcher.restart_failed=true",
                      env={"EF_PROBE_SLEEP": "0.6", "EF_PROBE_PACE": str(pace)}, record=record)
    wait_for(lambda: logged_step(run) >= 5, 150, "step 5")
    net.cut("h2")
    wait_for(lambda: 2 in world_sizes(run), 60, "h1 alone training")
    # Cut off past every timeout: the agent has cut out both of h2's workers (their heartbeats stopped), and
    # each of them has seen its own collective fail (elastic.timeout_s), where it cannot reach the job.
    wait_for(lambda: {e["worker"] for e in events(run, "hung")} >= {2, 3}, 60, "h2's workers cut out")
    wait_for(lambda: all(failures(run, (w,)) for w in (2, 3)), 60, "h2's workers to see their collectives fail")
    net.heal("h2")
    wait_for(lambda: sum(1 for w in workers(run) if w["host"] == "h2" and w["worker_id"] >= 4) == 2, 150,
             "h2's workers started again and admitted")
    # ... and training with them: lifted before, the pace lets the job end before their generation forms
    wait_for(lambda: 4 in world_sizes(run)[world_sizes(run).index(2):], 60, "a step with h2's new workers")
    pace.unlink()
    out = finish(procs["h1"])
    out2 = finish(procs["h2"])
    assert procs["h1"].returncode == 0, out[-3000:]
    assert_equivalent(run, reference)
    assert_each_sample_once(run, record)
    world = world_sizes(run)
    assert world[0] == 4 and 2 in world
    assert world[-1] == 4, ("h2's workers should rejoin as new members", world, out2[-3000:])
    assert "was cut out of the job by the agent" in out2 and "done: host=h2 workers=4 restarts=2" in out2, out2
    assert {e["worker"] for e in events(run, "hung")} == {2, 3}, "h2's workers, and only they, were cut out"
    # h1's workers left the collective when the agent declared h2's workers gone, not at its timeout
    lost = failures(run, (0, 1))
    assert lost and all("links cut" in line and "Timed out" not in line for line in lost), lost
    joined = events(run, "joined")
    assert {e["worker"] for e in joined} >= {4, 5}, joined


def test_a_host_started_late_joins_the_running_job(hosts, tmp_path, reference):
    net = hosts(2)
    run, record, pace = tmp_path / "run", tmp_path / "record", tmp_path / "pace"
    record.mkdir()
    pace.touch()  # steps take EF_PROBE_SLEEP until h2's workers are in: the job outlasts their start-up
    env = {"EF_PROBE_SLEEP": "0.25", "EF_PROBE_PACE": str(pace)}
    procs = start_on_hosts(net, run, ["h1"], "launcher.nodes=1", env=env, record=record)
    wait_for(lambda: logged_step(run) >= 5, 150, "step 5")
    procs.update(start_on_hosts(net, run, ["h2"], "launcher.nodes=1", env=env, record=record))
    wait_for(lambda: sum(1 for w in workers(run) if w["host"] == "h2") == 2, 150, "h2's workers admitted")
    wait_for(lambda: any(r.get("world_size") == 4 for r in metrics(run) if "loss" in r), 60, "a step with h2's workers")
    pace.unlink()
    out = {h: finish(p) for h, p in procs.items()}
    assert procs["h1"].returncode == 0 and procs["h2"].returncode == 0, (out["h1"][-2000:], out["h2"][-2000:])
    assert_equivalent(run, reference)
    assert_each_sample_once(run, record)
    world = world_sizes(run)
    assert world[0] == 2 and world[-1] == 4, world
    assert worker_hosts(run) == Counter({"h1": 2, "h2": 2})


def test_agent_host_lost_every_worker_checkpoints_and_a_rerun_resumes(hosts, tmp_path, reference):
    net = hosts(2)
    run = tmp_path / "run"
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", env={"EF_PROBE_SLEEP": "0.1"})
    wait_for(lambda: logged_step(run) >= 20, 150, "step 20")
    net.off("h1")  # the agent, its store and rank 0 with it
    out = finish(procs["h2"], timeout=60)
    assert procs["h2"].returncode == 4, out[-3000:]
    assert "the job's agent at 10.231.0.1:29400 is gone" in out and "Traceback" not in out
    saved = ckpt.latest(run / "checkpoints")
    assert saved is not None and ckpt.read_metadata(saved)["step"] >= 20, "h2's workers wrote where they were"
    net.on("h1")
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2")
    out = {h: finish(p) for h, p in procs.items()}
    assert procs["h1"].returncode == 0, out["h1"][-3000:]
    assert f"resumed from {saved}" in out["h1"] or "resum" in out["h1"], out["h1"][-3000:]
    assert_equivalent(run, reference)


def test_a_host_that_cannot_see_the_run_directory_fails_in_one_line(hosts, tmp_path):
    net = hosts(2)
    run = tmp_path / "run"
    job = start_on_hosts(net, run, ["h1"], "launcher.nodes=2", "elastic.wait_s=60")
    # h2 has its own (empty) filesystem where the run directory is: no shared filesystem.
    hidden = net.run("h2", ["mount", "-t", "tmpfs", "tmpfs", str(tmp_path)])
    assert hidden.returncode == 0, hidden.stderr
    node = start_on_hosts(net, tmp_path / "elsewhere", ["h2"])["h2"]
    out = finish(node, timeout=60)
    assert node.returncode == 2, out[-2000:]
    lines = [ln for ln in out.splitlines() if ln.startswith(("error:", "hint:"))]
    assert lines[0] == (f"error: host h2 cannot see the run directory {run} that the endpoint's host writes: "
                        "launcher=nodes needs it on a filesystem every host shares")
    assert lines[1].startswith("hint: put hydra.run.dir and checkpoint.dir on a shared filesystem")
    assert "Traceback" not in out
    # A host with another token is refused, and the job is untouched.
    wrong = net.train("h2", PROBE, tmp_path / "other", *nodes_args(),
                      env={"ELASTICFLOW_JOB_TOKEN": "0123456789abcdef" * 2})
    out = finish(wrong, timeout=60)
    assert wrong.returncode == 6 and "refused host h2: wrong or missing job token" in out, out[-2000:]
    Hosts.kill(job["h1"])


def test_the_token_comes_from_a_private_file_or_the_environment(tmp_path):
    base = ["train", PROBE, f"hydra.run.dir={tmp_path / 'r'}", "launcher=nodes", "launcher.endpoint=127.0.0.1:29433"]
    missing = cli(base, env={"ELASTICFLOW_JOB_TOKEN": ""})
    assert missing.returncode == 2
    assert "error: launcher=nodes needs the job's shared token" in missing.stderr
    assert "launcher.token_file" in missing.stderr and "Traceback" not in missing.stderr
    loose = tmp_path / "token"
    loose.write_text(TOKEN)
    loose.chmod(0o644)
    shared = cli(base + [f"launcher.token_file={loose}"], env={"ELASTICFLOW_JOB_TOKEN": ""})
    assert shared.returncode == 2 and "can be read by others (mode 644)" in shared.stderr
    assert f"hint: chmod 600 {loose}" in shared.stderr
    for weak, bits in (("x" * 32, 0), ("0123abcd" * 2, 64), ("hunter2hunter2hunter2", 0)):
        guessable = cli(base, env={"ELASTICFLOW_JOB_TOKEN": weak})
        assert guessable.returncode == 2, guessable.stderr
        assert (f"error: the job token in $ELASTICFLOW_JOB_TOKEN is too weak to guess offline: about {bits} bits, "
                "at least 128 needed") in guessable.stderr
        assert "hint: generate one: `openssl rand -hex 32" in guessable.stderr
    no_endpoint = cli(["train", PROBE, f"hydra.run.dir={tmp_path / 'e'}", "launcher=nodes"])
    assert no_endpoint.returncode == 2 and "launcher=nodes needs launcher.endpoint" in no_endpoint.stderr
    bad = cli(["train", PROBE, f"hydra.run.dir={tmp_path / 'b'}", "launcher=nodes", "launcher.endpoint=10.0.0.1"])
    assert bad.returncode == 2 and "error: launcher.endpoint='10.0.0.1' is not HOST:PORT" in bad.stderr
    assert "hint: pass launcher.endpoint=HOST:PORT" in bad.stderr


def test_a_slow_link_where_a_step_outlasts_the_heartbeat_timeout_cuts_no_one(hosts, tmp_path, one_worker):
    """20 Mbit/s between the hosts and 8 MB of gradients: every step's allreduce takes seconds (8 MB at 20 Mbit/s:
    about 3 s), longer than elastic.heartbeat_timeout_s; heartbeats travel beside it, so nobody is taken for hung.
    Two such steps: the first, and one after it."""
    wide = ["+model_args.hidden=27000", "trainer.max_steps=2", "trainer.log_every=1", "trainer.global_batch_size=64",
            "optimizer.lr=0.01"]
    net = hosts(2, rate="20mbit")
    run = tmp_path / "run"
    env = {"ELASTICFLOW_JOB_TOKEN": TOKEN}
    slow = [*nodes_args(*wide), "launcher.procs_per_node=1", "launcher.nodes=2", "elastic.heartbeat_timeout_s=1.5",
            "elastic.timeout_s=60"]
    procs = {h: net.train(h, PROBE, run, *slow, env=env) for h in ("h1", "h2")}
    out = {h: finish(p, timeout=240) for h, p in procs.items()}
    assert procs["h1"].returncode == 0 and procs["h2"].returncode == 0, (out["h1"][-2000:], out["h2"][-2000:])
    assert world_sizes(run) == [2, 2]
    assert not [e for e in events(run) if e["event"] in ("hung", "left", "superseded")]
    assert_equivalent(run, one_worker(*wide))


NETIF_PROBE = """
from elasticflow.distributed.comm import netif
from elasticflow.errors import ElasticFlowError
print("default", netif.address_of(None))
print("toward", netif.address_toward("10.231.0.1"))
print("named", netif.address_of("eth1"))
try:
    netif.address_of("nope0")
except ElasticFlowError as exc:
    print("bad", exc.message, "|", exc.hint)
"""


def name_servers() -> list:
    """The IPv4 name servers of /etc/resolv.conf off this host (a loopback one fails at once anyway)."""
    try:
        lines = Path("/etc/resolv.conf").read_text().splitlines()
    except OSError:
        return []
    found = [line.split()[1] for line in lines if len(line.split()) > 1 and line.split()[0] == "nameserver"]
    return sorted({a for a in found if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", a) and not a.startswith("127.")})


def test_a_multi_homed_host_advertises_the_address_its_peers_reach(hosts, tmp_path, reference):
    """h2 has a second interface, and its default route leaves by it: its workers must still give their
    peers the address on the route to the endpoint (eth0), never that one, nor a loopback one."""
    net = hosts(2)
    # A second NIC (a veth pair inside h2: this kernel has no dummy interfaces) on a network h1 is not on.
    # Nothing answers behind it: a DNS query sent there (the host name's lookup) would wait out the resolver's
    # timeout (~6 s, in the probe, the node agent and the worker alike) instead of failing at once as on a host
    # without a default route; the name servers are made unreachable so that it fails at once here too.
    for cmd in (["ip", "link", "add", "eth1", "type", "veth", "peer", "name", "eth1p"],
                ["ip", "addr", "add", "10.99.0.2/24", "dev", "eth1"], ["ip", "link", "set", "eth1p", "up"],
                ["ip", "link", "set", "eth1", "up"], ["ip", "route", "add", "default", "dev", "eth1"],
                *(["ip", "route", "add", "unreachable", f"{ns}/32"] for ns in name_servers())):
        done = net.run("h2", cmd)
        assert done.returncode == 0, done.stderr
    probe = net.run("h2", [sys.executable, "-c", NETIF_PROBE])
    assert probe.returncode == 0, probe.stderr
    lines = dict(line.split(" ", 1) for line in probe.stdout.splitlines())
    assert lines["default"] == "10.99.0.2"   # what a process without an endpoint to aim at would take
    assert lines["toward"] == "10.231.0.2"   # what a node agent gives its workers
    assert lines["named"] == "10.99.0.2"     # launcher.interface=eth1
    assert lines["bad"] == ("launcher.interface='nope0' has no IPv4 address on h2 | pick one of ['eth0', 'eth1', 'lo'] "
                            "(`ip -4 addr`), or pass an address")
    run = tmp_path / "run"
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", "launcher.procs_per_node=1")
    out = {h: finish(p) for h, p in procs.items()}
    assert procs["h1"].returncode == 0 and procs["h2"].returncode == 0, (out["h1"][-2000:], out["h2"][-2000:])
    assert_equivalent(run, reference)


def test_a_checkpoint_whose_shards_rank_0_cannot_see_fails_in_one_line(hosts, tmp_path):
    """checkpoint.dir stops being shared mid-job (h2 mounts its own filesystem over it): the first save after
    that cannot be committed from h2's shards, and the job says why instead of writing a checkpoint that no
    restart could load."""
    net = hosts(2)
    run = tmp_path / "run"
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", "checkpoint.interval.steps=30",
                      env={"EF_PROBE_SLEEP": "0.05"})
    wait_for(lambda: logged_step(run) >= 5, 150, "step 5")
    (run / "checkpoints").mkdir(exist_ok=True)
    hidden = net.run("h2", ["mount", "-t", "tmpfs", "tmpfs", str(run / "checkpoints")])
    assert hidden.returncode == 0, hidden.stderr
    out = finish(procs["h1"])
    assert procs["h1"].returncode == 2, out[-3000:]
    errors = [ln for ln in out.splitlines() if ln.startswith(("error:", "hint:"))]
    assert re.fullmatch(r"error: checkpoint step_30: rank [23] on h2 wrote .*, which rank 0 on h1 cannot see: "
                        r"checkpoint.dir is not on a filesystem every host shares", errors[0]), errors
    assert errors[1].startswith("hint: put checkpoint.dir (and hydra.run.dir) on a shared filesystem")
    assert ckpt.latest(run / "checkpoints") is None


# A stranger on another host that reaches the workers' gloo ports (a port scan finds them): on each port it says
# one of the first pair numbers (gloo's listener hands a connection to the pair whose number it reads first),
# reads what comes and never answers. Writes argv[2] once connected, and argv[3] with the bytes it read when
# every worker hung up on it (its next generation) or after 300 s.
GLOO_STRANGER = r"""
import select, socket, struct, sys, time
host, connected, result = sys.argv[1], sys.argv[2], sys.argv[3]
socks = []
for port in map(int, sys.argv[4:]):
    for seq in range(4):
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(struct.pack("<Q", seq))
        socks.append(s)
open(connected, "w").write(str(len(socks)))
read, deadline = 0, time.monotonic() + 300
while socks and time.monotonic() < deadline:
    for s in select.select(socks, [], [], 0.5)[0]:
        try:
            data = s.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            socks.remove(s)
            s.close()
        read += len(data)
open(result, "w").write(str(read))
"""


def test_a_stranger_on_another_host_at_a_gloo_port_costs_one_regroup_not_the_job(hosts, tmp_path, reference):
    """Issue #65 item 4 across a network: a 3-worker job on h1 whose worker 2 is slow to build its first gloo
    group (EF_PROBE_STALL_BUILD), and a stranger on h2 that connects first to the ports workers 0 and 1 listen
    on for it. It is handed a pair and reads the first state sync's bytes; the sync times out; the job regroups
    once with all three workers and ends exit 0 with its final checkpoint and the 1-worker parameters."""
    net = hosts(2)
    run, stall, connected, result = (tmp_path / n for n in ("run", "stall.json", "connected", "read"))
    proc = start_on_hosts(net, run, ["h1"], "launcher.nodes=1", "launcher.procs_per_node=3",
                          env={"EF_PROBE_STALL_BUILD": f"2:120:{stall}"})["h1"]
    wait_for(stall.is_file, 120, "worker 2 to reach its group build", proc=proc)
    store_port = int(ENDPOINT.rsplit(":", 1)[1])

    def gloo_ports():
        ports = listening(proc.pid) - {store_port}
        return len(ports) >= 2 and sorted(ports)
    ports = wait_for(gloo_ports, 60, "workers 0 and 1 to listen on their gloo ports", proc=proc)
    script = tmp_path / "gloo_stranger.py"
    script.write_text(GLOO_STRANGER)
    stranger = net.popen("h2", [sys.executable, str(script), net.addr("h1"), connected, result, *ports])
    wait_for(connected.is_file, 60, "the stranger's connections", proc=stranger)
    stall.unlink()  # worker 2 builds its group: its connection to the hijacked pair is parked unread
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    wait_for(result.is_file, 60, "the stranger to be hung up on", proc=stranger)
    assert int(result.read_text()) >= 24, "the stranger was never handed a pair: the attack did not happen"
    assert_equivalent(run, reference)  # the final checkpoint, on the 1-worker parameters
    recovered = events(run, "recovered")
    assert len(recovered) == 1 and recovered[0]["step"] == 0 and recovered[0]["world_size"] == 3, out[-4000:]
    assert "generation 0" in recovered[0]["reason"]
    assert not events(run, "left")  # every worker throughout
    world = {r["step"]: r["world_size"] for r in metrics(run) if "loss" in r}
    assert world[1] == 3 and world[STEPS] == 3


def listening(root: int) -> set:
    """The TCP ports that ROOT's descendants (the job on its host) listen on, from /proc: each process's socket
    inodes, looked up in its own network namespace's table (/proc/PID/net/tcp)."""
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        children.setdefault(int(text.rsplit(")", 1)[1].split()[1]), []).append(int(text.split()[0]))
    pids, todo = set(), [root]
    while todo:
        pid = todo.pop()
        pids.add(pid)
        todo.extend(children.get(pid, []))
    ports = set()
    for pid in pids:
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")}
            table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
        except OSError:  # it exited, or a descriptor closed meanwhile
            continue
        ports |= {int(f[1].split(":")[1], 16) for f in map(str.split, table) if f[3] == "0A" and f[9] in inodes}
    return ports
