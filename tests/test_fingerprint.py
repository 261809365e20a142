"""Silent corruption (elastic.fingerprint, train/fingerprint.py): a bit flipped in one replica's parameters by
`elasticflow inject --bitflip` is caught in the step it is made. With a majority the odd member is cut out, a
replacement joins with the majority's state and the job ends on the 1-worker model; with two members, nobody can
tell which is right, and both fall back to the last checkpoint saved before it.
"""
import time

import pytest
import torch

from harness import (Limit, assert_bitwise, assert_equivalent, events, finish, members, metrics, reap, run_cli,
                     start, wait_for)

from elasticflow.train.fingerprint import PRIME, checksum, compare, halves, joined, tensors_of

SAVE = ["checkpoint.interval.steps=5"]


def test_any_one_flipped_bit_moves_the_checksum_and_the_majority_names_the_odd_member():
    flat = torch.randn(1000)
    words = flat.view(torch.int32)
    base = checksum(flat)
    assert 1 <= base <= PRIME
    for bit in range(32):  # the sign bit too: 2^31 is not 0 modulo the prime
        words[417] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
        assert checksum(flat) != base, bit
        words[417] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
    assert checksum(flat) == base
    # In two halves float32 holds exactly, and back
    for value in (1, 2, 65535, 65536, 65537, PRIME, PRIME - 1):
        hi, lo = halves(value)
        assert float(torch.tensor([hi, lo], dtype=torch.float32)[0]) == hi and hi >= 1
        assert joined([hi, lo, 0, 0]) == [value, 0]
    assert compare([5, 5, 5]) is None and compare([5, 0, 5]) is None  # 0: a member that reports none
    v = compare([5, 7, 5])
    assert v.majority and v.odd == [1]
    v = compare([5, 7])
    assert not v.majority and v.odd == [0, 1]
    assert not compare([5, 7, 5, 7]).majority
    layout = [("w1", (10, 10)), ("b1", (10,)), ("w2", (10, 89))]
    before = tensors_of(flat, layout)
    words[105] ^= 1  # in b1
    after = tensors_of(flat, layout)
    assert [a != b for a, b in zip(before, after)] == [False, True, False]


def _flip_at(run, proc, limit, workers, rank, *args):
    """Hold the job's WORKERS at the limit, ask RANK's worker to flip a bit, let the request be read, then let the
    job go 10 steps further."""
    wait_for(lambda: len(limit.held()) == workers, 120, "every worker at the limit", proc=proc)
    victim = members(run)[rank]
    said = run_cli(["inject", run, "--bitflip", rank, *args], check=True).stdout
    assert f"worker {victim['worker_id']}" in said and "flip bit" in said, said
    asked = events(run, "inject")[-1]
    wait_for(lambda: time.time() > asked["time"] + 1.2, 5, "the worker's next read")
    limit.allow(limit.step + 10)
    return victim


@pytest.mark.parametrize("bit,extra", [(20, ["trainer.reproducible=true", "trainer.micro_batch_size=16"]), (0, [])],
                         ids=["reproducible", "default-lowest-bit"])
def test_a_flipped_bit_is_caught_the_member_replaced_and_the_model_is_the_one_workers(tmp_path, one_worker, bit,
                                                                                      extra):
    """The default mode's step scalars travel in float32: the flip of the mantissa's lowest bit is caught too."""
    reference = one_worker(*extra, *SAVE)
    run, limit = tmp_path / "run", Limit(tmp_path / "limit", 10)
    proc = start(run, "launcher.workers=3", "launcher.restart_failed=true", *extra, *SAVE,
                 env={"EF_PROBE_LIMIT": str(limit.path)})
    try:
        victim = _flip_at(run, proc, limit, 3, 1, "--tensor", "out/W", "--bit", str(bit))
        limit.advance_until(run, lambda: events(run, "joined"), 120, "the replacement's join")
        limit.lift()
        out = finish(proc)
    finally:
        if proc.poll() is None:
            reap(proc)
    assert proc.returncode == 0, out[-4000:]
    flipped = events(run, "bitflip")
    assert [(e["worker"], e["tensor"], e["bit"]) for e in flipped] == [(victim["worker_id"], "out/W", bit)], flipped
    caught = events(run, "corruption")
    assert len(caught) == 1 and caught[0]["ranks"] == [1] and caught[0]["workers"] == [victim["worker_id"]]
    assert caught[0]["tensors"] == ["out/W"] and caught[0]["step"] == flipped[0]["step"] and caught[0]["action"] == "evict"
    left = events(run, "left")
    assert [(e["worker"], e["cause"]) for e in left] == [(victim["worker_id"], "evicted: its parameters differed")]
    assert events(run, "restart")[0]["replacing"] == victim["worker_id"]
    assert "silent corruption: the parameters of rank(s) 1" in out
    assert metrics(run)[-1]["world_size"] == 3
    (assert_bitwise if extra else assert_equivalent)(run, reference)


def test_two_members_cannot_tell_who_is_right_and_fall_back_to_the_checkpoint_before_it(tmp_path, one_worker):
    reference = one_worker(*SAVE)
    run, limit = tmp_path / "run", Limit(tmp_path / "limit", 12)
    proc = start(run, "launcher.workers=2", "checkpoint.async_save=false", *SAVE,
                 env={"EF_PROBE_LIMIT": str(limit.path)})
    try:
        _flip_at(run, proc, limit, 2, 0)
        limit.lift()
        out = finish(proc)
    finally:
        if proc.poll() is None:
            reap(proc)
    assert proc.returncode == 0, out[-4000:]
    step = events(run, "bitflip")[0]["step"]
    caught = events(run, "corruption")
    assert [(e["ranks"], e["action"], e["step"]) for e in caught] == [([0, 1], "fall_back", step)], caught
    fell = events(run, "fell_back")
    # The checkpoint of the step before the flip was checked only by the flip's own step: the one before it
    assert len(fell) == 1 and fell[0]["step"] == 5 * ((step - 2) // 5), (fell, step)
    assert "replicas that differed: fell back to checkpoint" in out
    assert not events(run, "left")
    assert_equivalent(run, reference, redone=True)
