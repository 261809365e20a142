"""The private store of one host (distributed/private_store.py): TCPStore's answers, on a socket only the owner
opens. The end-to-end check (a local user against a running job) is in test_intruder.py."""
from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticflow.distributed import private_store, stores
from elasticflow.distributed.private_store import PrivateStore, StoreServer

SHORT = datetime.timedelta(seconds=0.3)


@pytest.fixture
def server(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    srv = StoreServer(private_store.socket_path(state))
    yield srv
    srv.close()


def _script(store):
    """One sequence of calls, with every answer: what a worker, the agent and gloo ask of a store."""
    out = []
    store.set("a", "1")
    out.append(store.add("a", 4))
    out.append(store.add("fresh", 0))
    out.append(store.compare_set("a", "wrong", "x"))   # not equal: the current value
    out.append(store.compare_set("a", "5", "x"))       # equal: set, the new value
    out.append(store.compare_set("none", "e", "d"))    # missing, expected non-empty: the expected value
    out.append(store.compare_set("none2", "", "d"))    # missing, expected empty: set
    out.append(store.check(["a", "none2"]))
    out.append(store.check(["a", "never"]))
    out.append(store.delete_key("a"))
    out.append(store.delete_key("a"))
    out.append(store.check(["a"]))
    store.set("bin", bytes(range(256)))
    out.append(store.get("bin"))
    out.append(store.num_keys())
    return out


def test_the_private_store_answers_as_tcpstore_does(server):
    from elasticflow.distributed.process import listening_store

    tcp, listener = listening_store("127.0.0.1", 5.0)
    try:
        tcp_client = stores.connect(f"127.0.0.1:{tcp.port}", 5.0)
        expected = _script(tcp_client)
    finally:
        listener.close()
    client = stores.connect(server.address, 5.0)
    assert isinstance(client, PrivateStore)
    assert _script(client) == expected
    assert sorted(client.list_keys()) == ["bin", "fresh", "none2"]


def test_get_and_wait_block_until_the_key_is_set_and_time_out_otherwise(server):
    waiter = PrivateStore(server.address, datetime.timedelta(seconds=30))
    got = []
    t = threading.Thread(target=lambda: got.append(waiter.get("late")))
    t.start()
    PrivateStore(server.address, SHORT).set("late", b"here")
    t.join(30)
    assert got == [b"here"]
    client = PrivateStore(server.address, SHORT)
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        client.get("never")
    with pytest.raises(dist.DistStoreError, match="never"):
        client.wait(["late", "never"], SHORT)
    client.wait(["late"])
    assert client.get("late") == b"here"  # the connection is still good after a timeout


def test_add_on_text_is_an_error_that_keeps_the_connection(server):
    client = PrivateStore(server.address, SHORT)
    client.set("count", "not a count")
    with pytest.raises(RuntimeError, match="refused add"):
        client.add("count", 1)
    client.set("count", "7")
    assert client.add("count", 1) == 8


def test_a_closed_store_fails_every_client_call_as_a_lost_network(server):
    client = PrivateStore(server.address, SHORT)
    client.set("k", "v")
    server.close()
    with pytest.raises(dist.DistNetworkError, match="closed the connection"):
        client.get("k")
    with pytest.raises(dist.DistNetworkError, match="does not exist"):
        PrivateStore(server.address, SHORT)


def test_gloo_rendezvouses_through_the_private_store(server):
    """Two processes build a gloo group on a PrefixStore over the private store and allreduce."""
    code = (
        "import datetime, sys, torch, torch.distributed as dist\n"
        "from elasticflow.distributed.stores import connect\n"
        "rank = int(sys.argv[2])\n"
        "opts = dist.ProcessGroupGloo._Options(); opts._timeout = datetime.timedelta(seconds=60)\n"
        "opts._devices = [dist.ProcessGroupGloo.create_device(hostname='127.0.0.1')]\n"
        "store = connect(sys.argv[1], 60)  # held: a PrefixStore alone does not keep its Python methods\n"
        "pg = dist.ProcessGroupGloo(dist.PrefixStore('gen0/', store), rank, 2, opts)\n"
        "x = torch.tensor([rank + 1.0]); pg.allreduce([x]).wait(); print(x.item())\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, server.address, str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == ["3.0", "3.0"], outs


def test_a_run_directory_too_deep_for_a_socket_gets_a_private_one(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = private_store.socket_path(deep)
    assert len(str(path)) <= 108 and path.parent != deep
    srv = StoreServer(path)
    try:
        assert (os.stat(path.parent).st_mode & 0o777) == 0o700
        PrivateStore(srv.address, SHORT).set("k", "v")
    finally:
        srv.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="connects as another user (nobody): needs root, as CI has")
def test_another_user_can_neither_open_the_socket_nor_be_served_through_a_loosened_mode(tmp_path):
    """As ``nobody``: the socket's 0700 directory refuses the connection; with the directory and socket opened
    to everyone (a mistake), the server reads the peer's uid and hangs up before serving anything."""
    world = Path(tempfile.mkdtemp(prefix="ef-store-test-"))  # tmp_path's parents are root's, 0700: nobody must
    os.chmod(world, 0o755)                                      # reach the state directory, and stop there
    state = world / "state"
    state.mkdir()
    srv = StoreServer(private_store.socket_path(state))
    try:
        PrivateStore(srv.address, SHORT).set("secret", "v")
        probe = (
            "import socket, struct, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect(sys.argv[1])\n"
            "except OSError as e:\n"
            "    print('connect', type(e).__name__); sys.exit()\n"
            "body = struct.pack('!I', 8) + b'num_keys'\n"
            "try:\n"
            "    s.sendall(struct.pack('!I', len(body)) + body)\n"
            "    reply = s.recv(100)\n"
            "    print('served', reply) if reply else print('hung up')\n"
            "except OSError as e:\n"
            "    print('hung up')\n")
        as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-c", probe,
                     str(srv.path)]
        shut = subprocess.run(as_nobody, capture_output=True, text=True, timeout=60)
        assert shut.stdout.strip() == "connect PermissionError", shut.stdout + shut.stderr
        assert srv.refused_peers == 0
        os.chmod(state, 0o777)
        os.chmod(srv.path, 0o777)
        opened = subprocess.run(as_nobody, capture_output=True, text=True, timeout=60)
        assert opened.stdout.strip() == "hung up", opened.stdout + opened.stderr
        assert srv.refused_peers == 1
    finally:
        srv.close()
        shutil.rmtree(world)


def test_a_state_directory_of_another_user_is_refused(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 65534, -1) if os.geteuid() == 0 else pytest.skip("needs root to give a directory away")
    with pytest.raises(PermissionError, match="not a directory of this user"):
        StoreServer(other / "store.sock")


def test_a_store_kind_and_address_per_launcher():
    from elasticflow.config.launchers import store_kind
    from elasticflow.config.schema import compose
    from elasticflow.errors import ElasticFlowError

    assert store_kind(compose("models/linear.py", []).launcher) == "private"
    assert store_kind(compose("models/linear.py", ["launcher.store=tcp"]).launcher) == "tcp"
    with pytest.raises(ElasticFlowError, match="launcher.store=private serves one host"):
        compose("models/linear.py", ["launcher=nodes", "launcher.endpoint=10.0.0.1:29400", "launcher.store=private"])
    with pytest.raises(ElasticFlowError, match="launcher.store must be one of auto, private, tcp"):
        compose("models/linear.py", ["launcher.store=etcd"])
    assert stores.host_of("unix:/x/store.sock") == "127.0.0.1" and stores.host_of("10.1.2.3:29400") == "10.1.2.3"
