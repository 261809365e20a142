"""Cutting a collective's links (elasticflow/_util/links.py, comm.Group.cut_links): a gloo collective waiting
on a silent peer fails at once, instead of at the group's timeout."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from elasticflow._util import links


def test_the_connections_opened_since_are_found_without_listeners_or_the_store_and_cut():
    listener = socket.create_server(("127.0.0.1", 0))
    store = socket.create_server(("127.0.0.1", 0))
    before = links.sockets()
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    to_store = socket.create_connection(store.getsockname())
    also_listening = socket.create_server(("127.0.0.1", 0))
    found = links.opened_since(before, not_to_port=store.getsockname()[1])
    assert found == {links.inode_of(ours), links.inode_of(theirs)}, (found, links.inode_of(to_store))
    assert links.cut(found) == 2
    assert ours.recv(1) == b"" and theirs.recv(1) == b""  # both ends see the connection end
    to_store.sendall(b"x")  # untouched
    for s in (ours, theirs, to_store, also_listening, listener, store):
        s.close()
    assert links.cut(found) == 0  # closed since: nothing left to cut (a reused number is checked by inode)


SILENT_PEER = textwrap.dedent('''
    import datetime, os, sys, threading, time, torch, torch.distributed as dist
    from elasticflow._util import links
    from elasticflow.distributed.comm.comm import Group
    from elasticflow.distributed.protocol import CommError
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    before = links.sockets()
    group = Group(store, 0, rank, 2, timeout_s=120)
    group.links = links.opened_since(before, not_to_port=port)
    x = torch.ones(1000)
    group.allreduce_(x)
    print(rank, "summed", x[0].item(), flush=True)
    if rank == 1:  # silent from here: alive, its sockets open, never in the next collective
        store.set("silent", "1")
        time.sleep(120)
        os._exit(0)
    store.wait(["silent"])
    threading.Timer(0.5, group.cut_links).start()  # as the membership poller does when the agent says so
    try:
        group.allreduce_(x)
        print("summed with a silent peer?!")
    except CommError as exc:
        print("failed:", exc, flush=True)
    os._exit(0)
''')


def test_a_collective_waiting_on_a_silent_peer_fails_when_its_links_are_cut(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text(SILENT_PEER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        out = procs[0].communicate(timeout=100)[0]  # well before the group's 120 s timeout
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "0 summed 2.0" in out, out
    assert "failed: allreduce failed in generation 0" in out and "links cut" in out, out
