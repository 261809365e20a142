"""Silent corruption (elastic.fingerprint, train/fingerprint.py): a bit flipped in one replica's parameters by
`elasticflow inject --bitflip` is caught in the step it is made. With a majority the odd member is cut out, a
replacement joins with the majority's state and the job ends on the 1-worker model; with two members, nobody can
tell which is right, and both fall back to the last checkpoint saved before it. The same for the optimizer state
(replicated: within 4 steps) and under each trainer.shard mode (a sharded range's two copies: the fallback). And a
device that computes wrongly (elastic.verify_every, train/spot_check.py): caught by the spot check, cut out by a
referee's majority.
"""
import time

import pytest
import torch

from harness import (MODELS, PROBE, Limit, assert_bitwise, assert_equivalent, events, finish, members, metrics, reap,
                     run_cli, start, train_ok, wait_for)

from elasticflow.config.schema import compose
from elasticflow.distributed.protocol import CommError
from elasticflow.errors import ElasticFlowError
from elasticflow.train.spot_check import Spot, SpotCheck
from elasticflow.train.fingerprint import (PRIME, Fingerprints, Flips, checksum, compare, compare_copies, halves,
                                          joined)

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
    # Sharded state: owner r's range against its copy on rank r + 1 (the last rank's copy is on rank 0)
    assert compare_copies([3, 4, 5], [5, 3, 4]) is None
    v = compare_copies([3, 4, 5], [5, 3, 9])
    assert not v.majority and v.copies == [1] and v.odd == [1, 2]
    assert compare_copies([3, 4, 5], [6, 3, 4]).copies == [2]
    assert compare_copies([3, 4], [4, 3]) is None and compare_copies([3, 0], [9, 3]) is None  # 0: none reported


class _Engine:
    """What Fingerprints and Flips read of an engine: flat parameters (a 4x5 and a 10), Adam's flat slots."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.p = torch.randn(30, generator=gen)
        self.s = {"exp_avg": torch.randn(30, generator=gen), "exp_avg_sq": torch.rand(30, generator=gen)}

    def flat_params(self):
        return self.p

    def flat_layout(self):
        return [("w", (4, 5)), ("b", (10,))]

    def flat_slots(self):
        return self.s

    def params_written(self):
        pass


class _Member:
    worker_id, events = 7, None


def test_replicated_optimizer_slots_are_compared_a_quarter_a_step_and_named_when_they_differ():
    engine = _Engine()
    fp, flips = Fingerprints(engine, None), Flips(_Member(), None)
    before = [fp.slots(step) for step in range(8)]
    names, sums = fp.tensor_sums(3)
    assert names == ["w", "b", "optimizer/b/exp_avg", "optimizer/b/exp_avg_sq"]  # quarter 3: [24, 30), in b
    flips.flip(engine, None, {"tensor": "optimizer/b/exp_avg", "bit": 3}, 0, 0)  # b's element 0: flat index 20
    after = [fp.slots(step) for step in range(8)]
    # Index 20 is in quarter 2 ([16, 24)): steps 2 and 6 see it, every byte is seen every 4 steps
    assert [a != b for a, b in zip(before, after)] == [False, False, True, False] * 2
    flips.flip(engine, None, {"tensor": "b", "bit": 0}, 0, 0)
    assert all(a != b for a, b in zip(before, [fp.slots(step) for step in range(8)]))
    old = _Engine()
    got = [n for n, x, y in zip(fp.tensor_sums(2)[0], fp.tensor_sums(2)[1], Fingerprints(old, None).tensor_sums(2)[1])
           if x != y]
    assert got == ["b", "optimizer/b/exp_avg"]
    # A name that holds nothing: a warning, nothing flipped
    kept = [fp.slots(step) for step in range(4)]
    for name in ("optimizer/b/momentum_buffer", "optimizer/c/exp_avg", "c"):
        flips.flip(engine, None, {"tensor": name, "bit": 3}, 0, 0)
    assert [fp.slots(step) for step in range(4)] == kept


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


def _flipped_job(run, overrides, model, flip, join):
    """A 3-worker job (launcher.restart_failed) whose rank 1 is asked at step 10 to flip the bit ``flip`` names; with
    ``join``, held a step at a time until a replacement joined. Returns (the victim's member record, the output);
    the job exited 0."""
    limit = Limit(run.parent / "limit", 10)
    proc = start(run, "launcher.workers=3", "launcher.restart_failed=true", *overrides, model=model,
                 env={"EF_PROBE_LIMIT": str(limit.path)})
    try:
        victim = _flip_at(run, proc, limit, 3, 1, *flip)
        if join:
            limit.advance_until(run, lambda: events(run, "joined"), 120, "the replacement's join")
        limit.lift()
        out = finish(proc)
    finally:
        if proc.poll() is None:
            reap(proc)
    assert proc.returncode == 0, out[-4000:]
    return victim, out


@pytest.mark.parametrize("bit,extra", [(20, ["trainer.reproducible=true", "trainer.micro_batch_size=16"]), (0, [])],
                         ids=["reproducible", "default-lowest-bit"])
def test_a_flipped_bit_is_caught_the_member_replaced_and_the_model_is_the_one_workers(tmp_path, one_worker, bit,
                                                                                      extra):
    """The default mode's step scalars travel in float32: the flip of the mantissa's lowest bit is caught too."""
    reference = one_worker(*extra, *SAVE, here=True)
    run = tmp_path / "run"
    victim, out = _flipped_job(run, [*extra, *SAVE], PROBE, ["--tensor", "out/W", "--bit", str(bit)], join=True)
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
    reference = one_worker(*SAVE, here=True)
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


UNITS = MODELS.parent / "tests" / "models" / "units_probe.py"
ADAM = ["optimizer=adam", "optimizer.lr=0.003"]
SLOT = "optimizer/out/W/exp_avg"
# (overrides, model, what to flip ('': the first parameter the rank holds), the action): stage 2 has no
# reproducible mode. Replicated state and stages 1-2 compare whole parameters (a majority); the sharded slots and
# stage 3's parameters are compared as each range's two copies (none: no majority)
FLIPS = {
    "replicated-slot": (["trainer.shard=none"], PROBE, SLOT, "evict"),
    "optimizer": (["trainer.shard=optimizer", "trainer.reproducible=true", "trainer.micro_batch_size=16"], PROBE, "",
                  "evict"),
    # the probe's out/W lies in rank 2's range: rank 1 holds its own range of hidden/W and rank 0's copy
    "gradients-slot": (["trainer.shard=gradients"], PROBE, "optimizer/hidden/W/exp_avg", "fall_back"),
    "parameters": (["trainer.shard=parameters", "trainer.reproducible=true", "trainer.global_batch_size=32",
                    "trainer.micro_batch_size=8", "+model_args.hidden=128"], UNITS, "", "fall_back"),
}


@pytest.mark.parametrize("case", list(FLIPS))
def test_a_flipped_bit_in_optimizer_state_or_sharded_state_is_caught_and_repaired(tmp_path, one_worker, case):
    """A bit of the optimizer state (replicated: a quarter of it is compared a step, so within 4 steps) or of sharded
    state is caught, the member cut out (a majority) or every member falls back to the checkpoint before it (two
    copies of a range), and the job ends on the 1-worker model: its bits where the mode is reproducible."""
    extra, model, tensor, action = FLIPS[case]
    exact = "trainer.reproducible=true" in extra
    reference = one_worker(*[x for x in extra if not x.startswith("trainer.shard")], *ADAM, *SAVE, model=model,
                           here=True)
    run = tmp_path / "run"
    victim, out = _flipped_job(run, ["checkpoint.async_save=false", *extra, *ADAM, *SAVE], model,
                               ["--bit", "20", *(["--tensor", tensor] if tensor else [])], join=action == "evict")
    flipped = events(run, "bitflip")
    assert [(e["worker"], e["bit"]) for e in flipped] == [(victim["worker_id"], 20)], flipped
    assert not tensor or flipped[0]["tensor"] == tensor
    caught = events(run, "corruption")
    assert len(caught) == 1 and caught[0]["action"] == action and 1 in caught[0]["ranks"], caught
    assert flipped[0]["step"] <= caught[0]["step"] < flipped[0]["step"] + (4 if tensor else 1), (flipped, caught)
    if action == "evict":
        assert caught[0]["ranks"] == [1] and caught[0]["tensors"] == [flipped[0]["tensor"]], caught
        assert [e["worker"] for e in events(run, "left")] == [victim["worker_id"]]
        assert metrics(run)[-1]["world_size"] == 3
    else:  # the flipped copy and its other copy: rank 1's own range and rank 2's, or rank 0's range and rank 1's
        assert caught[0]["ranks"] in ([1, 2], [0, 1]) and len(caught[0]["copies"]) == 1, caught
        assert "range of the" in out and len(events(run, "fell_back")) == 1 and not events(run, "left")
    (assert_bitwise if exact else assert_equivalent)(run, reference)


class _Log:
    def __init__(self):
        self.events = []

    def event(self, kind, **fields):
        self.events.append((kind, fields))


def test_a_spot_checks_difference_calls_a_referee_then_the_majority_decides_and_two_cannot():
    check, log = SpotCheck(5), _Log()
    assert check.plan(3, (0, 64), 3, 16, None) is None  # step 4: not a multiple of 5
    spot = check.plan(4, (0, 64), 3, 16, None)  # step 5: micro-batch 5 // 5 % 4 = 1, rank 0's second (2, 1, 1)
    assert (spot.index, spot.owner, spot.ranks, spot.referee) == (1, 0, [0, 1], False)
    agree = [*halves(9), *halves(9), 0, 0]
    check.check(spot, agree, 0, 4, [0, 1, 2], log)  # the two agree: nothing
    with pytest.raises(CommError, match="computed micro-batch 1 of step 5 differently"):
        check.check(spot, [*halves(9), *halves(8), 0, 0], 0, 4, [0, 1, 2], log)
    assert log.events[-1][1]["action"] == "referee"
    spot = check.plan(4, (0, 64), 3, 16, None)  # the redo: every member computes it
    assert spot.ranks == [0, 1, 2] and spot.referee
    with pytest.raises(ElasticFlowError, match="evicted: its computation differed") as e:
        check.check(spot, [*halves(9), *halves(8), *halves(9)], 1, 4, [0, 7, 2], log)
    assert e.value.exit_code == 10
    with pytest.raises(CommError):  # a majority member redoes the step without it
        check.check(spot, [*halves(9), *halves(8), *halves(9)], 0, 4, [0, 7, 2], log)
    assert log.events[-1][1]["action"] == "evict" and log.events[-1][1]["workers"] == [7]
    two = Spot(1, 0, [0, 1], True)
    with pytest.raises(ElasticFlowError, match="a device computes wrongly"):
        check.check(two, [*halves(9), *halves(8)], 0, 4, [0, 1], log)
    check.referee_step = 4
    check.check(check.plan(4, (0, 64), 3, 16, None), [*halves(9)] * 3, 0, 4, [0, 1, 2], log)  # a transient fault
    assert check.referee_step is None
    for bad, match in ((["elastic.verify_every=5"], "only trainer.reproducible makes equal"),
                       (["elastic.verify_every=5", "trainer.reproducible=true", "trainer.micro_batch_size=8",
                         "trainer.shard=parameters"], "its gradient goes to its owners during backward"),
                       (["elastic.verify_every=0"], "elastic.verify_every")):
        with pytest.raises(ElasticFlowError, match=match):
            compose("models/digits_mlp.py", bad)


def test_a_device_that_computes_wrongly_is_caught_by_the_spot_check_and_cut_out(tmp_path, one_worker):
    """elastic.verify_every=1: worker 1 computes step 12 wrongly (every attempt of it, a wrong gradient stored
    correctly: no fingerprint differs). Step 12's spot is micro-batch 0 (12 % 4), rank 0's, computed again by rank 1:
    they differ, the step is redone with every member computing it, the majority cuts worker 1 out, a replacement
    joins, and the job ends on the 1-worker bits."""
    mode = ["trainer.reproducible=true", "trainer.micro_batch_size=16"]
    reference = one_worker(*mode, *SAVE, here=True)
    run = tmp_path / "run"
    out = train_ok(run, "launcher.workers=3", "launcher.restart_failed=true", "elastic.verify_every=1",
                   "elastic.straggler=off", *mode, *SAVE, env={"EF_PROBE_MISCOMPUTE": "1:12"})
    caught = [(e["step"], e["action"], e["ranks"], e["workers"], e["check"]) for e in events(run, "corruption")]
    assert caught == [(12, "referee", [0, 1], [0, 1], "spot"), (12, "evict", [1], [1], "spot")], caught
    assert [(e["worker"], e["cause"]) for e in events(run, "left")] == [(1, "evicted: its computation differed")]
    assert "silent corruption (spot check): ranks 0 (worker 0), 1 (worker 1) computed micro-batch 0" in out
    assert_bitwise(run, reference)
