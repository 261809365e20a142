"""The private store of one host (distributed/store/server.py): TCPStore's answers, on a socket only the owner
opens. The end-to-end check (a local user against a running job) is in test_intruder.py."""
from __future__ import annotations

import datetime
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticflow.distributed.store import base as store_base, server as store_server, stores, wire as store_wire
from elasticflow.distributed.store.dist_store import StoreClient  # a worker's: a torch.distributed.Store
from elasticflow.distributed.store.server import StoreServer

SHORT = datetime.timedelta(seconds=0.3)


TOKEN = "t0ken" * 8


@pytest.fixture(params=["private", "token"])
def server(tmp_path, request):
    """Each store the agent serves: a Unix socket, and TCP with the token handshake (clients: ``client``)."""
    state = tmp_path / "state"
    state.mkdir()
    srv = (StoreServer.private(store_server.socket_path(state)) if request.param == "private"
           else StoreServer.token("127.0.0.1", 0, TOKEN))
    yield srv
    srv.close()


def client(srv, timeout=SHORT):
    return StoreClient(srv.address, timeout, TOKEN)


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
    from elasticflow.distributed.store.listen import listening_store

    tcp, listener = listening_store("127.0.0.1", 5.0)
    try:
        tcp_client = stores.connect(f"127.0.0.1:{tcp.port}", 5.0)
        expected = _script(tcp_client)
    finally:
        listener.close()
    ours = stores.connect(server.address, 5.0, TOKEN)
    assert isinstance(ours, StoreClient)
    assert _script(ours) == expected
    assert sorted(ours.list_keys()) == ["bin", "fresh", "none2"]


def test_get_and_wait_block_until_the_key_is_set_and_time_out_otherwise(server):
    waiter = client(server, datetime.timedelta(seconds=30))
    got = []
    t = threading.Thread(target=lambda: got.append(waiter.get("late")))
    t.start()
    client(server).set("late", b"here")
    t.join(30)
    assert got == [b"here"]
    c = client(server)
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        c.get("never")
    with pytest.raises(dist.DistStoreError, match="never"):
        c.wait(["late", "never"], SHORT)
    c.wait(["late"])
    assert c.get("late") == b"here"  # the connection is still good after a timeout


def test_add_on_text_is_an_error_that_keeps_the_connection(server):
    c = client(server)
    c.set("count", "not a count")
    with pytest.raises(RuntimeError, match="refused add"):
        c.add("count", 1)
    c.set("count", "7")
    assert c.add("count", 1) == 8


def test_a_closed_store_fails_every_client_call_as_a_lost_network(server):
    c = client(server)
    c.set("k", "v")
    server.close()
    with pytest.raises(dist.DistNetworkError, match="closed the connection"):
        c.get("k")
    with pytest.raises(dist.DistNetworkError, match="does not answer"):
        client(server)


def test_the_agents_client_answers_the_same_without_torch_and_raises_the_plain_errors(server):
    """The agent's side (stores.client) is not a torch.distributed.Store; a worker's is, and its errors are both."""
    plain = stores.client(server.address, 0.05, TOKEN)
    assert not isinstance(plain, dist.Store) and isinstance(stores.connect(server.address, 5.0, TOKEN), dist.Store)
    plain.set("k", "v")
    assert plain.get("k") == b"v" and plain.clone().get("k") == b"v"
    with pytest.raises(store_base.StoreTimeout, match="never") as caught:
        plain.get("never")
    assert not isinstance(caught.value, dist.DistError)
    with pytest.raises(store_base.StoreTimeout):  # a worker's: torch's error and the plain one
        client(server, datetime.timedelta(seconds=0.05)).get("never")
    server.close()
    with pytest.raises(store_base.StoreLost, match="closed the connection") as caught:
        plain.get("k")
    assert not isinstance(caught.value, dist.DistError)


def test_gloo_rendezvouses_through_the_private_store(server):
    """Two processes build a gloo group on a PrefixStore over the private store and allreduce."""
    code = (
        "import datetime, sys, torch, torch.distributed as dist\n"
        "from elasticflow.distributed.store.stores import connect\n"
        "rank = int(sys.argv[2])\n"
        "opts = dist.ProcessGroupGloo._Options(); opts._timeout = datetime.timedelta(seconds=60)\n"
        "opts._devices = [dist.ProcessGroupGloo.create_device(hostname='127.0.0.1')]\n"
        "store = connect(sys.argv[1], 60, sys.argv[3])  # held: a PrefixStore alone keeps no Python methods\n"
        "pg = dist.ProcessGroupGloo(dist.PrefixStore('gen0/', store), rank, 2, opts)\n"
        "x = torch.tensor([rank + 1.0]); pg.allreduce([x]).wait(); print(x.item(), flush=True)\n"
        # as a worker leaves (launchers/worker.py): the interpreter's teardown, destroying a gloo group over a
        # store written in Python, sometimes aborts ("terminate called without an active exception")
        "import os; os._exit(0)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, server.address, str(r), TOKEN], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and [o.strip() for o, _ in outs] == ["3.0", "3.0"], outs


def test_a_run_directory_too_deep_for_a_socket_gets_a_private_one(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = store_server.socket_path(deep)
    assert len(str(path)) <= 108 and path.parent != deep
    srv = StoreServer.private(path)
    try:
        assert (os.stat(path.parent).st_mode & 0o777) == 0o700
        client(srv).set("k", "v")
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
    srv = StoreServer.private(store_server.socket_path(state))
    try:
        client(srv).set("secret", "v")
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
        StoreServer.private(other / "store.sock")


def test_a_store_kind_and_address_per_launcher():
    from elasticflow.config.launchers import store_kind
    from elasticflow.config.schema import compose
    from elasticflow.errors import ElasticFlowError

    assert store_kind(compose("models/linear.py", []).launcher) == "private"
    assert store_kind(compose("models/linear.py", ["launcher.store=tcp"]).launcher) == "tcp"
    nodes = ["launcher=nodes", "launcher.endpoint=10.0.0.1:29400"]
    assert store_kind(compose("models/linear.py", nodes).launcher) == "token"
    with pytest.raises(ElasticFlowError, match="launcher.store=private serves one host"):
        compose("models/linear.py", [*nodes, "launcher.store=private"])
    with pytest.raises(ElasticFlowError, match="launcher.store must be one of auto, private, token, tcp, etcd"):
        compose("models/linear.py", ["launcher.store=redis"])
    with pytest.raises(ElasticFlowError, match="launcher.store=etcd runs with launcher=nodes"):
        compose("models/linear.py", ["launcher.store=etcd"])
    assert stores.host_of("unix:/x/store.sock") == "127.0.0.1" and stores.host_of("10.1.2.3:29400") == "10.1.2.3"
    assert stores.host_of("token:10.1.2.3:29400") == "10.1.2.3"
    assert stores.address_of("token", "10.1.2.3:29400") == "token:10.1.2.3:29400"
    assert stores.address_of("token", "token:10.1.2.3:29400") == "token:10.1.2.3:29400"
    assert stores.address_of("tcp", "10.1.2.3:29400") == "10.1.2.3:29400"


def _rogue_store() -> str:
    """A server that plays the handshake without the token: it reads the client's opening, greets, reads the
    client's proof, and answers 32 bytes of its own. Its address."""
    listener = socket.create_server(("127.0.0.1", 0))

    def play():
        conn, _ = listener.accept()
        with conn:
            store_wire._recv_exact(conn, store_wire.OPENING)
            conn.sendall(store_wire.HELLO + bytes(16))
            store_wire._recv_exact(conn, store_wire.PROOF)
            conn.sendall(bytes(32))
            conn.recv(1)
        listener.close()
    threading.Thread(target=play, daemon=True).start()
    return f"token:127.0.0.1:{listener.getsockname()[1]}"


def test_a_token_store_serves_no_one_without_the_token_and_a_client_trusts_no_impostor():
    """A stranger on the network: without the token (a TCPStore client, a wrong token) it is hung up on before a
    request is read, and nothing changes; a worker never talks to a store that cannot prove the token."""
    from torch.distributed import TCPStore

    srv = StoreServer.token("127.0.0.1", 0, TOKEN)
    impostor = StoreServer.token("127.0.0.1", 0, "another job's token" * 2)
    try:
        client(srv).set("gen/current", "7")
        port = int(srv.address.rsplit(":", 1)[1])
        with pytest.raises(Exception):  # TCPStore's own protocol: the handshake's first bytes are not an answer
            TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=2)).set("gen/current", "9")
        with pytest.raises(dist.DistNetworkError, match="hung up during the handshake: the job token is wrong"):
            StoreClient(srv.address, datetime.timedelta(seconds=60), "a wrong token" * 3)  # at once, no retries
        with pytest.raises(ValueError, match="prove the job token: pass it"):
            StoreClient(srv.address, SHORT)
        with pytest.raises(dist.DistNetworkError, match="the job token is wrong"):
            StoreClient(impostor.address, SHORT, TOKEN)  # another job's store hangs up on us
        with pytest.raises(dist.DistNetworkError, match="it did not prove the job token: not this job's store"):
            StoreClient(_rogue_store(), SHORT, TOKEN)  # one that answers anything is not believed
        assert srv.refused_peers >= 2
        assert client(srv).get("gen/current") == b"7" and client(srv).num_keys() == 1
    finally:
        srv.close()
        impostor.close()


class Relay:
    """A process on the network path between a client and a token store: it passes the handshake on untouched,
    then hands each frame (each direction's, by count) to ``tamper``, which returns the bytes to pass on."""

    def __init__(self, upstream: str, tamper):
        self.tamper, self.upstream = tamper, upstream.rsplit(":", 1)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"token:127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        conn, _ = self.listener.accept()
        up = socket.create_connection((self.upstream[0][len("token:"):], int(self.upstream[1])))
        hello = len(store_wire.HELLO) + store_wire.NONCE
        threading.Thread(target=self._pump, args=(conn, up, "c2s", store_wire.OPENING + store_wire.PROOF),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(up, conn, "s2c", hello + store_wire.PROOF), daemon=True).start()

    def _pump(self, src, dst, direction, handshake):
        try:
            while handshake:  # as it comes: each side waits for the other's part
                part = src.recv(handshake)
                if not part:
                    raise OSError("closed")
                dst.sendall(part)
                handshake -= len(part)
            count = 0
            while True:
                head = store_wire._recv_exact(src, 4)
                frame = head + store_wire._recv_exact(src, int.from_bytes(head, "big"))
                dst.sendall(self.tamper(direction, count, frame))
                count += 1
        except OSError:  # one side hung up: so does the relay, both ways (shutdown wakes the other pump)
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _flip_last(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 1])


@pytest.mark.parametrize("attack", ["alter a request", "replay a request", "alter a reply", "reflect a request"])
def test_a_proven_connection_cannot_be_altered_replayed_or_reflected_on_the_way(attack):
    """Past the handshake, every frame carries a MAC under the connection's own key and its count in that
    direction: the side that receives a frame altered, replayed or reflected by a process on the path hangs up
    (the client: DistNetworkError, the agent-lost path's error) and nothing it carried takes effect."""
    srv = StoreServer.token("127.0.0.1", 0, TOKEN)
    seen = {}

    def tamper(direction, count, frame):
        seen.setdefault(direction, []).append(frame)
        if attack == "alter a request" and direction == "c2s" and count == 1:
            return _flip_last(frame)
        if attack == "replay a request" and direction == "c2s" and count == 1:
            return frame + frame  # the add, twice
        if attack == "alter a reply" and direction == "s2c" and count == 1:
            return _flip_last(frame)
        if attack == "reflect a request" and direction == "s2c" and count == 1:
            return seen["c2s"][1]  # the client's own frame, back as the answer
        return frame

    try:
        relay = Relay(srv.address, tamper)
        victim = StoreClient(relay.address, datetime.timedelta(seconds=5), TOKEN)
        victim.set("before", "1")  # frame 0 each way: untouched
        honest = client(srv)
        if attack == "replay a request":
            assert victim.add("count", 1) == 1  # the first copy is served ...
            with pytest.raises(dist.DistNetworkError, match="closed the connection"):
                victim.check(["before"])  # ... the second ended the connection
            assert honest.get("count") == b"1"
            return
        with pytest.raises(dist.DistNetworkError, match="closed the connection|MAC"):
            victim.add("count", 1)
        if attack == "alter a request":
            assert not honest.check(["count"])  # the altered request was never served
        else:
            assert honest.get("count") == b"1"  # served, but the client refused the answer it got
        assert honest.get("before") == b"1"
    finally:
        srv.close()


def _stranger(port: int, source: str, first: bytes = store_wire.OPEN[:1]) -> socket.socket:
    """A connection from ``source`` that has begun a handshake it cannot finish: ``first``, a right start."""
    s = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    s.sendall(first)
    return s


def _answer(s: socket.socket, timeout: float = 30) -> bytes:
    """What the server says to a stranger's connection before it closes: BUSY, or nothing (b"")."""
    s.settimeout(timeout)
    got = b""
    while True:
        part = s.recv(64)
        if not part:
            return got
        got += part


def test_strangers_who_fill_the_door_keep_no_worker_out(monkeypatch):
    """Strangers in the middle of a handshake hold at most MAX_UNPROVEN_PER_PEER places per address and
    MAX_UNPROVEN in all, each until HANDSHAKE_S: more are told BUSY. A worker's first bytes prove the token
    (its opening), so it takes no place: from the strangers' own address, through a full door, it connects at
    once. A client told BUSY (a replayed opening waits for a place) retries until its timeout, and fails as a
    store that does not answer, never as a wrong token (a crowd of joiners from one host is not refused)."""
    monkeypatch.setattr(store_server, "HANDSHAKE_S", 2.0)
    monkeypatch.setattr(store_server, "MAX_UNPROVEN", store_server.MAX_UNPROVEN_PER_PEER + 2)
    srv = StoreServer.token("127.0.0.1", 0, TOKEN)
    port = int(srv.address.rsplit(":", 1)[1])
    held, busy = [], []
    try:
        for _ in range(store_server.MAX_UNPROVEN_PER_PEER):  # the workers' own address's places, all taken
            held.append(_stranger(port, "127.0.0.1"))
        held += [_stranger(port, "127.0.0.2"), _stranger(port, "127.0.0.2")]  # and the door's last two
        busy = [_stranger(port, "127.0.0.1"), _stranger(port, "127.0.0.3")]   # per address, and in all
        assert [_answer(s) for s in busy] == [store_wire.BUSY + bytes(16)] * 2 and srv.busy_peers == 2
        assert srv.places_held() == store_server.MAX_UNPROVEN
        c = client(srv)  # from 127.0.0.1, whose places strangers hold
        c.set("k", "v")
        assert c.get("k") == b"v" and srv.busy_peers == 2
        for s in held:  # hung up on at HANDSHAKE_S without a proof, and told to come back (as a slow worker is)
            assert _answer(s) == store_wire.BUSY + bytes(16)
        assert srv.refused_peers == len(held) and srv.places_held() == 0
        monkeypatch.setattr(store_server, "MAX_UNPROVEN_PER_PEER", 0)  # every connection that needs a place: BUSY
        monkeypatch.setattr(StoreServer, "_fresh", lambda self, head: False)  # as a replayed opening
        with pytest.raises(dist.DistNetworkError, match="does not answer .*busy") as caught:
            StoreClient(srv.address, datetime.timedelta(seconds=0.5), TOKEN)
        assert not isinstance(caught.value, store_server.WrongToken)
    finally:
        for s in held + busy:
            s.close()
        srv.close()


def test_the_handshake_has_one_deadline_from_accept_however_its_bytes_trickle(monkeypatch):
    """A connection that sends a right byte of its opening every 0.2 s is cut at HANDSHAKE_S from accept (told
    to come back), not kept alive by each byte; its place is free again."""
    monkeypatch.setattr(store_server, "HANDSHAKE_S", 1.0)
    srv = StoreServer.token("127.0.0.1", 0, TOKEN)
    port = int(srv.address.rsplit(":", 1)[1])
    start = store_wire.OPEN + bytes(store_wire.NONCE)  # every byte right: no MAC byte yet
    s = _stranger(port, "127.0.0.1")
    try:
        sent, said = 1, b""
        s.settimeout(0.2)  # the trickle's pace: one byte each time the server says nothing for 0.2 s
        while sent < len(start):
            try:
                said = s.recv(64)
                break  # BUSY, or closed
            except socket.timeout:
                pass
            try:
                s.sendall(start[sent:sent + 1])
            except OSError:  # cut between two bytes
                said = b""
                break
            sent += 1
        said += _answer(s)
        assert sent < len(start), "a trickle of right bytes kept its connection past the handshake's deadline"
        assert said in (store_wire.BUSY + bytes(16), b"") and srv.refused_peers == 1
        assert srv.places_held() == 0
        c = client(srv)
        c.set("after", "1")
        assert c.get("after") == b"1"
    finally:
        s.close()
        srv.close()


@pytest.mark.parametrize("where", ["opening", "proof"])
def test_a_wrong_byte_ends_the_handshake_there_and_frees_its_place(monkeypatch, where):
    """A stranger's first wrong byte (of the opening's MAC, or of its proof over the server's nonce) is hung
    up on at once (well before HANDSHAKE_S), and the place it held is free again."""
    monkeypatch.setattr(store_server, "HANDSHAKE_S", 60.0)
    monkeypatch.setattr(store_server, "MAX_UNPROVEN_PER_PEER", 1)
    srv = StoreServer.token("127.0.0.1", 0, TOKEN)
    port = int(srv.address.rsplit(":", 1)[1])
    key = store_wire.key_of(TOKEN)
    first, nonce = store_wire.opening(key)
    s = _stranger(port, "127.0.0.1")  # takes the address's one place
    try:
        assert _answer(_stranger(port, "127.0.0.1")) == store_wire.BUSY + bytes(16)  # (it is held)
        if where == "opening":
            wrong = first[1:-store_wire.PROOF] + bytes([first[-store_wire.PROOF] ^ 1])
            s.sendall(wrong)
            assert _answer(s) == b""  # hung up on at the first MAC byte: no HELLO, no BUSY
        else:
            s.sendall(first[1:])  # a whole opening (one recorded from a worker, say): still in its place ...
            hello = store_wire.read_until(s, len(store_wire.HELLO) + store_wire.NONCE, time.monotonic() + 30)
            assert hello.startswith(store_wire.HELLO)
            right = store_wire._mac(key, b"client", hello[len(store_wire.HELLO):], nonce)
            s.sendall(bytes([right[0] ^ 1]))  # ... until its proof's first byte
            assert _answer(s) == b""
        wait_until_free(srv)
        c = client(srv)
        c.set("after", "1")
        assert c.get("after") == b"1" and srv.busy_peers == 1
    finally:
        s.close()
        srv.close()


def wait_until_free(srv, within: float = 30.0):
    deadline = time.monotonic() + within
    while srv.places_held():
        assert time.monotonic() < deadline, "a place still held after its connection was hung up on"
        time.sleep(0.01)
