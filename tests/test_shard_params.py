"""trainer.shard=parameters (ZeRO stage 3): each worker keeps only its ranges of the parameters, brings each
submodule's in for its forward and backward, and gives them back after, and sends each submodule's gradient to
its owners as its backward ends; on real processes.

tests/models/units_probe.py is an nn.Module of four submodules (four units) on the digits, 512 wide (2.3 MB of
parameters: whole pages to give back). Each run must end on the 1-worker run of the same model with replicated
state (harness.assert_equivalent, parameters and momentum within 1e-5), including through a SIGKILL in a
backward that was fetching units, and its checkpoint must resume without sharding and export into the module.
"""
import json
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import elasticflow
import elasticflow.checkpoint as ckpt
from harness import (MODELS, Limit, assert_bitwise, assert_equivalent, events, lose_join_retire, metrics, start,
                     train_ok, world_sizes)

from elasticflow._util.pages import ENV_STRICT as STRICT, PagedVector
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.replica.param_units import plan_units
from elasticflow.train import model_file as modelfile

UNITS = MODELS.parent / "tests" / "models" / "units_probe.py"
# 8 micro-batches of 4 a step (COMMON's 64 samples would double each step's compute, not what is tested)
ARGS = ["trainer.global_batch_size=32", "trainer.micro_batch_size=4", "+model_args.hidden=512", "optimizer.momentum=0.9", "optimizer.lr=0.02",
        "checkpoint.interval.steps=10", "checkpoint.keep=null"]


# ---------------------------------------------------------------- in this process
def test_given_back_pages_read_as_zero_and_writes_through_the_alias_are_not_in_place_changes():
    v = PagedVector(3 * 1024 * 1024)  # 12 MiB
    v.tensor.fill_(1.0)
    assert v.resident_bytes() >= 12 << 20
    dropped = v.drop(1000, 2 * 1024 * 1024)
    assert dropped > 0 and v.resident_bytes() <= (12 << 20) - dropped
    assert float(v.tensor[1024:2 * 1024 * 1024 - 1024].abs().sum()) == 0.0  # whole pages only: the rest kept
    assert float(v.tensor[:1000].sum()) == 1000.0 and float(v.tensor[2 * 1024 * 1024:].min()) == 1.0
    version = v.tensor._version
    v.alias[:10].fill_(2.0)  # a unit arriving: autograd's saved views of v.tensor must not see an in-place change
    assert v.tensor._version == version and float(v.tensor[0]) == 2.0


def test_strict_pages_given_back_fault_until_ensured_as_a_gpus_unmapped_memory_does():
    """ELASTICFLOW_STRICT_PAGES=1 (the end-to-end runs below set it): the CPU keeps the GPU path's protocol, so a
    touch of memory given back without ``ensure`` ends the process, as it would end a GPU's context."""
    v = PagedVector(3 * 1024 * 1024, strict=True)
    v.tensor.fill_(1.0)
    v.zero(1000, 2 * 1024 * 1024)  # the gradient's way: whole pages given back, the partial ones written
    v.ensure(4096, 8192)
    assert float(v.tensor[4096:8192].abs().sum()) == 0.0 and float(v.tensor[:1000].sum()) == 1000.0
    v.ensure(0, v.n)
    assert float(v.tensor.sum()) == v.n - (2 * 1024 * 1024 - 1000)
    touch = ("from elasticflow._util.pages import PagedVector\n"
             "v = PagedVector(1 << 20, strict=True); v.drop(0, 1 << 20); print(float(v.tensor[5000]))")
    died = subprocess.run([sys.executable, "-c", touch], capture_output=True, timeout=120)
    assert died.returncode == -signal.SIGSEGV, (died.returncode, died.stderr[-400:])


def test_units_are_the_top_level_submodules_and_shared_parameters_go_to_the_root():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 4))
    net[2].weight = torch.nn.Parameter(net[0].weight.detach().t().clone())  # not shared: its own
    shared = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    shared.b.weight = shared.a.weight  # tied, as a language model's embedding and head
    params = [p for _, p in net.named_parameters()]
    spans, root, names, _, _ = plan_units(net, params)
    assert names == ["0", "1", "2"] and root == [] and spans == [[(0, 15)], [(15, 27)], [(27, 43)]]
    params = [p for _, p in shared.named_parameters()]  # a.weight, a.bias, b.bias
    spans, root, names, _, _ = plan_units(shared, params)
    assert names == ["a", "b"] and spans == [[(4, 6)], [(6, 8)]] and root == [(0, 4)]
    spans, root, names, _, _ = plan_units(None, params)  # a dict of arrays: no submodule, all in the root
    assert spans == [] and names == [] and root == [(0, 8)]


def test_settings_stage_3_cannot_run_are_one_error_each():
    with pytest.raises(ElasticFlowError, match="trainer.shard=parameters is built for backend=torch"):
        compose(str(UNITS), ["trainer.shard=parameters", "backend=tensorflow"])
    with pytest.raises(ElasticFlowError, match="trainer.shard=gradients reduce-scatters float32 sums"):
        compose(str(UNITS), ["trainer.shard=gradients", "trainer.reproducible=true", "trainer.micro_batch_size=8"])
    with pytest.raises(ElasticFlowError, match=r"trainer.shard_units=\['decoder.\*'\] names no submodule"):
        from elasticflow.replica.param_units import unit_modules
        unit_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["decoder.*"])


# ---------------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def reference(one_worker):
    return one_worker(*ARGS, model=UNITS)


def _resident(folder):
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_three_workers_hold_their_ranges_survive_a_kill_in_backward_a_join_and_a_scale_down_and_resume_and_export(
        tmp_path, reference):
    """3 workers, each holding its own third of the parameters and its buddy's. Worker 2 dies in a backward that
    has fetched units (head, norm, block) from its peers, which fail in their own fetches: the 2 survivors redo
    the step from the dead worker's ranges their buddy copies held. A third worker then joins (it receives its
    ranges from its peers) and one retires (its ranges go to the stayers). (Kills in every other phase:
    scripts/soak_shard_kill.py --stage parameters.) With strict pages: the GPU path's protocol holds throughout."""
    run, seen, limit = tmp_path / "run", tmp_path / "resident", Limit(tmp_path / "limit", 12, last=28)
    seen.mkdir()
    proc = start(run, "launcher.workers=3", "launcher.max_workers=3", "trainer.shard=parameters", *ARGS,
                 model=UNITS, env={"EF_UNITS_KILL_BACKWARD": "2:8", "EF_UNITS_RESIDENT": str(seen),
                                   "EF_PROBE_LIMIT": str(limit.path), STRICT: "1"})
    lose_join_retire(run, proc, limit)
    assert_equivalent(run, reference, records=False)
    kinds = [e["event"] for e in events(run)]
    assert "fell_back" not in kinds and kinds.count("recovered") == 1, kinds  # the ranges came from the buddies

    # Memory at 3 workers (at 2, each holds both slices: nothing is given back), before the kill and with the joiner.
    rows = [r for r in _resident(seen) if r["step"] > 0 and r["world"] == 3]  # step 0: the start-up probe
    params, grads = ([r for r in rows if r["what"] == what] for what in ("params", "grads"))
    assert len(params) >= 3 * 8 and len(grads) >= 3 * 7
    # At each step's start a worker holds two thirds of the vector: its own and its buddy's.
    worst = max(r["resident"] / r["total"] for r in params)
    assert 0.66 <= worst <= 0.69, worst
    # In backward, once head, norm and block have their gradients (94% of the vector), those went to their
    # owners and their pages with them: never a whole gradient (embed's, 6%, is not computed yet).
    assert max(r["resident"] / r["total"] for r in grads) <= 0.02

    # The step-30 checkpoint (2 workers, each writing the parameters it owns), resumed by 1 worker without sharding.
    at_30 = next(p for p in ckpt.complete_checkpoints(run / "checkpoints") if p.name == "step_30")
    meta = ckpt.read_metadata(at_30)
    assert meta["writers"] == 2 and len({meta["files"][p["file"]]["rank"]
                                         for p in meta["tensors"]["block.0.weight"]["shards"]}) == 2
    resumed = tmp_path / "resumed"
    train_ok(resumed, f"resume={at_30}", *ARGS, model=UNITS)
    assert_equivalent(resumed, reference, records=False)
    # ... and the final one exports into the user's module with strict=True.
    exported = elasticflow.export(run, tmp_path / "out")
    net = modelfile.load(str(UNITS)).model(compose(str(UNITS), ["+model_args.hidden=512"]))
    from safetensors.torch import load_file

    net.load_state_dict(load_file(str(tmp_path / "out" / exported.files[0])), strict=True)
    final = ckpt.load(ckpt.latest(reference / "checkpoints"))
    assert np.allclose(net.head.weight.detach().numpy(), final["head.weight"], rtol=1e-4, atol=1e-6)


def test_a_kill_in_each_other_phase_of_a_step_ends_on_the_one_worker_model(tmp_path, one_worker):
    """5 workers, three SIGKILLs in three generations, each in a phase the test above does not kill in: a unit's
    fetch in forward (its peers wait for its pieces), a unit's gradient on its way to its owners, and the update
    between its own range and its buddy's. The survivors redo each step from the buddy copies and end on the
    1-worker model (1e-5), with no checkpoint read. 8 micro-batches over 5 and 3 members: some are dealt fewer,
    and replay their peers' fetches. With strict pages (a worker touching memory given back dies)."""
    steps = ["trainer.max_steps=20"]
    want = one_worker(*ARGS, *steps, model=UNITS)
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=5", "trainer.shard=parameters", *ARGS, *steps, model=UNITS,
             env={"EF_UNITS_KILL": "4:4:forward_fetch:2,1:9:reduce:3,2:14:update:2", STRICT: "1"})
    assert world_sizes(run)[0] == 5 and world_sizes(run)[-1] == 2, world_sizes(run)
    kinds = [e["event"] for e in events(run)]
    assert kinds.count("left") == 3 and "fell_back" not in kinds, kinds
    assert_equivalent(run, want, records=False)


def test_bf16_and_activation_checkpointing_end_on_the_one_worker_model(tmp_path, one_worker):
    """Under autocast to bf16 autograd saves each unit's bf16 copy of its weights, not the weights (backward then
    fetches nothing for them); with torch.utils.checkpoint on the block its forward runs again inside backward,
    and the unit is brought in for it and kept for its recomputed ops. 3 workers end on the 1-worker model with
    both at once (1e-5). One thread a worker, on 1 worker too: under bf16, 1 worker with 2 threads ends 3e-2 from
    1 worker with 1 (rounding alone)."""
    extra = ["trainer.precision=bf16", "+model_args.checkpointing=1", "trainer.max_steps=30", "backend.threads=1"]
    want = one_worker(*ARGS, *extra, model=UNITS)
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", "trainer.shard=parameters", *ARGS, *extra, model=UNITS)
    assert_equivalent(run, want, records=False)


@pytest.mark.parametrize("stage, precision", [("gradients", "32"), ("parameters", "32"), ("parameters", "16")])
def test_clipping_takes_the_norm_over_the_owners_sums(tmp_path, one_worker, stage, precision):
    """trainer.grad_clip with no worker holding the whole summed gradient (stages 2 and 3): each owner adds the
    squares of its own range's sums (not its buddy's copy) into one small allreduce, so every worker clips by the
    same factor as 1 worker does, and they end on its model (1e-5). The norm is taken in blocks at fixed offsets
    with float64 sums (_util/norms.py): float32's own norm of the whole vector rounds at 2e-5 here, which a
    clipping factor carries into every step. Float16 with its loss scale takes each block's norm in float64 (on 1
    worker too): with float32 blocks the factor's last bits, which float16's casts turn into whole float16 steps
    of some weights, took this run 8.6e-4 away by step 40. One thread a worker, on 1 worker too: under float16
    this model is chaotic, and 1 worker with 2 threads ends 1.3e-2 from 1 worker with 1 (rounding alone)."""
    clip = ["trainer.grad_clip=0.5", f"trainer.precision={precision}"] + \
        (["backend.threads=1"] if precision == "16" else [])
    want = one_worker(*ARGS, *clip, model=UNITS)
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", f"trainer.shard={stage}", *ARGS, *clip, model=UNITS)
    norms = [r["grad_norm"] for r in metrics(run) if "loss" in r]
    assert sum(n > 0.5 for n in norms) >= 10, norms  # clipping was at work
    assert_equivalent(run, want, records=False)


def test_parameter_groups_keep_their_lr_and_decay_over_the_units_slices(tmp_path, one_worker):
    """optimizer.groups with stage 3: a group's stretch (head at a tenth of the lr, norm without weight decay)
    lies inside the units' slices, and each owner updates its range with its stretches' settings: 3 workers end
    on the 1-worker model. SGD with momentum: Adam with an L2 decay and these groups is chaotic on this model
    (1 worker with another micro-batch size ends 7e-5 away in loss, as 2 workers do: rounding, amplified)."""
    steps = ["trainer.max_steps=30"]
    groups = ["optimizer.weight_decay=0.01",
              "optimizer.groups=[{params:[head],lr:0.002},{params:[norm],weight_decay:0.0}]"]
    want = one_worker(*ARGS, *steps, *groups, model=UNITS)
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", "trainer.shard=parameters", *ARGS, *steps, *groups, model=UNITS)
    assert_equivalent(run, want, records=False)
    baseline = one_worker(*ARGS, *steps, "optimizer.weight_decay=0.01", model=UNITS)  # the groups changed it
    with pytest.raises(AssertionError):
        assert_equivalent(run, baseline, records=False)


def test_reproducible_mode_with_clipping_and_a_kill_in_the_gradients_way_to_its_owners_ends_on_the_one_workers_bits(
        tmp_path, one_worker):
    """trainer.reproducible with stage 3: each owner sums every micro-batch's gradient of its range exactly
    (replica/exact_sum.py) as the pieces arrive, and clipping's norm is an exact sum of squares over the owners'
    ranges, so 3 workers, one SIGKILLed while a unit's gradient is on its way to its owners, end on the bits of
    1 worker (AdamW: the parameters, both moments and every step's loss are ==). With strict pages: at 2 members,
    each holding all, the whole gradient is summed exactly after each micro-batch, which zero_grad gives back."""
    mode = ["trainer.reproducible=true", "trainer.shard=parameters", "trainer.micro_batch_size=8",
            "+model_args.hidden=128", "optimizer=adamw", "optimizer.lr=0.003", "trainer.grad_clip=0.5",
            "trainer.max_steps=24"]
    want = one_worker(*mode, model=UNITS)
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", *mode, model=UNITS, env={"EF_UNITS_KILL": "1:9:reduce:3", STRICT: "1"})
    assert world_sizes(run)[0] == 3 and world_sizes(run)[-1] == 2
    assert sum(r["grad_norm"] > 0.5 for r in metrics(run) if "loss" in r) >= 5  # clipping was at work
    assert_bitwise(run, want)
