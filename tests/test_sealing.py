"""Sealed store records and the agent's defences against what anyone on the network can write (_util/sealing.py,
protocol.py): each forgery or malformed input is refused, and the reader's connection survives it."""
import datetime
import os
import signal
import stat
import subprocess
import sys
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore

from elasticflow.distributed import protocol
from elasticflow.distributed.agent.process import Worker
from elasticflow.distributed.store.listen import listening_store
from elasticflow._util.sealing import REFUSED, Forged, Sealer


@pytest.fixture
def store():
    server, listener = listening_store("127.0.0.1", 5.0)
    client = TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=5))
    yield client
    listener.close()


def test_a_record_verifies_only_at_its_key_in_its_run():
    sealer = Sealer("t" * 32, "run-a")
    sealed = sealer.seal("gen/3", '{"members": [0, 1]}')
    assert sealer.open("gen/3", sealed) == '{"members": [0, 1]}'
    for key, opener, raw in (("gen/5", sealer, sealed),                          # copied to another key
                             ("gen/3", Sealer("t" * 32, "run-b"), sealed),        # replayed into the next run
                             ("gen/3", Sealer("u" * 32, "run-a"), sealed),        # another token
                             ("gen/3", sealer, sealed.replace("[0, 1]", "[0, 1, 999]")),  # altered
                             ("gen/3", sealer, '{"members": [999]}'), ("gen/3", sealer, b"\xff\x00")):
        with pytest.raises(Forged):
            opener.open(key, raw)


def test_a_forged_record_is_refused_counted_and_reported_once(store, caplog):
    sealer = Sealer("t" * 32, "run")
    seen = []
    REFUSED.on_first, before = (lambda kind, detail: seen.append(kind)), REFUSED.counts.get("test kind", 0)
    try:
        store.set("worker/1/memory", "garbage")
        assert protocol.fetch(store, sealer, "worker/1/memory", "test kind") is None
        assert protocol.fetch(store, sealer, "worker/1/memory", "test kind") is None
        protocol.put(store, sealer, "worker/1/memory", "12.5")
        assert protocol.fetch(store, sealer, "worker/1/memory", "test kind") == "12.5"
    finally:
        REFUSED.on_first = None
    assert REFUSED.counts["test kind"] == before + 2
    assert seen == (["test kind"] if before == 0 else [])
    assert sum("refused a forged test kind record" in r.message for r in caplog.records) == (1 if before == 0 else 0)


def test_a_counter_set_to_text_is_refused_and_the_connection_survives(store):
    store.set("join/count", "not-a-number")  # add() on this would close the reader's connection
    assert protocol.counter(store, "join/count", "join/count") is None
    assert protocol.draw(store, "join/count", "join/count") >= 1  # put back to a number, then counted
    store.set("still", "alive")
    assert store.get("still") == b"alive"


def test_an_inflated_count_keeps_only_the_newest_numbers_and_unfilled_ones_expire(store, monkeypatch):
    now = [1000.0]  # the inbox's clock, moved by the test
    monkeypatch.setattr(protocol, "time", SimpleNamespace(monotonic=lambda: now[0]))
    inbox = protocol.Inbox("join/count", "join/request", backlog=8, expire_s=0.3)
    store.add("join/count", 10 ** 12)
    real = int(store.add("join/count", 1))  # a real writer counts after whoever inflated it
    store.set(f"join/request/{real}", '{"id": 1}')
    assert list(inbox.read(store)) == [(real, {"id": 1})]
    assert len(inbox.unread) == 7  # the other numbers a stranger counted: bounded
    now[0] += 0.2
    assert list(inbox.read(store)) == [] and len(inbox.unread) == 7  # not expired yet
    now[0] += 0.2
    assert list(inbox.read(store)) == [] and inbox.unread == {}  # never written: dropped
    n = int(store.add("join/count", 1))
    store.set(f"join/request/{n}", "[]")  # not a JSON object
    assert list(inbox.read(store)) == [(n, {})]


def test_private_files_replace_a_planted_symlink_and_a_loose_mode(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep me")
    link = tmp_path / "run" / ".elasticflow" / "token"
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    token = protocol.new_token(tmp_path / "run")
    assert target.read_text() == "keep me" and not link.is_symlink() and link.read_text() == token
    assert stat.S_IMODE(link.stat().st_mode) == 0o600
    os.chmod(link, 0o644)
    protocol.new_token(tmp_path / "run", "a-token-of-my-own-choosing")
    assert stat.S_IMODE(link.stat().st_mode) == 0o600 and protocol.read_token(tmp_path / "run") == \
        "a-token-of-my-own-choosing"
    assert sorted(p.name for p in link.parent.iterdir()) == ["token"]  # no temporary left behind


def test_a_pid_from_another_host_is_never_signalled_here(monkeypatch):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sent = []
    kill = os.kill
    monkeypatch.setattr(os, "kill", lambda pid, sig: (sent.append((pid, sig)), kill(pid, sig)))
    try:
        Worker(7, bystander.pid, None, host="some-other-host").signal(signal.SIGKILL)
        # a hand-started worker on another host: its pid means nothing here, so no signal went to it
        assert sent == [] and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
