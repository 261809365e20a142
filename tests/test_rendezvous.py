"""The agent's reads at scale (issue #48): failure reports read when their count moves or once a SWEEP_S, a
generation's arrivals and formations by one ``check`` until all are there, heartbeats a turn at a time."""
from __future__ import annotations

from collections import Counter

from elasticflow.distributed import protocol
from elasticflow.distributed.agent import health
from elasticflow.distributed.membership.rendezvous import SWEEP_S, Rendezvous, failures_key, key


class CountingStore:
    """A store in a dict that counts reads of each key (compare_set, untrusted.read's one round trip) and checks."""

    def __init__(self):
        self.data, self.reads, self.checks = {}, Counter(), 0

    def set(self, k, v):
        self.data[k] = v.encode() if isinstance(v, str) else bytes(v)

    def compare_set(self, k, expected, desired):
        self.reads[k] += 1
        expected = expected.encode() if isinstance(expected, str) else expected
        if self.data.get(k, b"" if expected == b"" else None) == expected:
            self.set(k, desired)
            return desired.encode() if isinstance(desired, str) else desired
        return self.data.get(k, expected)

    def check(self, keys):
        self.checks += 1
        return all(k in self.data for k in keys)

    def add(self, k, n):
        value = int(self.data.get(k, b"0")) + n
        self.set(k, str(value))
        return value

    def clone(self):
        return self


SEALER = protocol.Sealer("ab" * 16, "job1")


def read_of(store, what: str, g: int = 0) -> int:
    return sum(n for k, n in store.reads.items() if k.startswith(f"gen/{g}/{what}/"))


def test_failure_reports_are_read_when_their_count_moves_or_once_a_sweep():
    store, ids = CountingStore(), list(range(100))
    rdv = Rendezvous(store, 30.0, SEALER)
    rdv.opened(0, ids, now=0.0)
    rdv.phase = "formed"
    for r in range(9):  # 0.9 s of rounds: one sweep (the first), then only the count
        assert rdv.poll(r * 0.1, ids) is None
    assert read_of(store, "failed") == 100 and store.reads[failures_key(0)] == 9
    protocol.put(store, SEALER, key(0, "failed", 7), "t")  # what Membership.report_failure writes
    protocol.draw(store, failures_key(0), "failures")
    assert rdv.reports(0.95, ids) == {7}
    assert rdv.reports(0.95, ids) == {7} and read_of(store, "failed") == 200, "once a round at most"
    # A stranger deletes the count: the sweep still finds a report within SWEEP_S.
    protocol.put(store, SEALER, key(0, "failed", 8), "t")
    del store.data[failures_key(0)]
    assert rdv.reports(0.96 + SWEEP_S, ids) == {7, 8}


def test_a_forming_generation_costs_one_check_a_round_until_every_member_arrived():
    store, ids = CountingStore(), list(range(200))
    rdv = Rendezvous(store, 30.0, SEALER)
    rdv.opened(0, ids, now=0.0)
    for i in ids[:-1]:
        protocol.put(store, SEALER, key(0, "arrived", i), "t")
    for r in range(5):
        assert rdv.poll(r * 0.1, ids) is None and rdv.phase == "arriving"
    assert read_of(store, "arrived") == 0, "no member's arrival read while one is missing"
    protocol.put(store, SEALER, key(0, "arrived", ids[-1]), "t")
    rdv.poll(0.6, ids)
    assert rdv.phase == "building" and read_of(store, "arrived") == 200  # each seal read once
    for i in ids:
        protocol.put(store, SEALER, key(0, "formed", i), "t")
    verdict = rdv.poll(0.7, ids)
    assert verdict is not None and verdict.outcome == "formed"
    # A forged arrival (no seal) is not an arrival: the generation waits, then fails naming the late member.
    rdv.opened(1, ids, now=1.0)
    for i in ids:
        store.set(key(1, "arrived", i), "forged" if i == 5 else SEALER.seal(key(1, "arrived", i), "t"))
    assert rdv.poll(1.1, ids) is None and rdv.phase == "arriving"
    verdict = rdv.poll(40.0, ids)
    assert verdict.outcome == "failed" and "[5] did not arrive" in verdict.cause


def test_heartbeats_are_read_a_turn_at_a_time_past_a_full_round():
    small = list(range(health.FULL_ROUND))
    assert health.due(small, 10.0, 0) == (small, 0)
    workers = list(range(1024))
    seen, cursor = Counter(), 0
    for _ in range(10):  # one second of rounds
        read, cursor = health.due(workers, 10.0, cursor)
        seen.update(read)
    assert set(seen) == set(workers) and max(seen.values()) <= 2
    # A short heartbeat timeout reads each member more often: every timeout / 4.
    seen, cursor = Counter(), 0
    for _ in range(2):  # 0.2 s = 2 s / 4 / ... every member within timeout / 4 = 0.5 s, so 2 rounds cover 40%
        read, cursor = health.due(workers, 2.0, cursor)
        seen.update(read)
    assert len(seen) == 2 * -(-1024 * health.HEALTH_S // 0.5)
