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
from harness import (MODELS, Limit, assert_bitwise, assert_equivalent, events, finish, lose_join_retire, metrics,
                     start, train_ok, world_sizes)

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
# Each 1-worker oracle trains in this process (one_worker's here): this file imports torch anyway, and a CLI
# job for each of its twelve would import torch, Hydra and the trainer (transformers for GPT-2) again.
@pytest.fixture(scope="module")
def reference(one_worker):
    return one_worker(*ARGS, model=UNITS, here=True)


def _resident(folder):
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_three_workers_hold_their_ranges_survive_a_kill_in_backward_a_join_and_a_scale_down_and_resume_and_export(
        tmp_path, reference):
    """3 workers, each holding its own third of the parameters and its buddy's. Worker 2 dies in a backward that
    has fetched units (head, norm, block) from its peers, which fail in their own fetches: the 2 survivors redo
    the step from the dead worker's ranges their buddy copies held. A third worker then joins (it receives its
    ranges from its peers) and one retires (its ranges go to the stayers). (Kills in every other phase:
    scripts/soak/soak_shard_kill.py --stage parameters.) With strict pages: the GPU path's protocol holds throughout."""
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
    want = one_worker(*ARGS, *steps, model=UNITS, here=True)
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
    want = one_worker(*ARGS, *extra, model=UNITS, here=True)
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
    want = one_worker(*ARGS, *clip, model=UNITS, here=True)
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
    want = one_worker(*ARGS, *steps, *groups, model=UNITS, here=True)
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", "trainer.shard=parameters", *ARGS, *steps, *groups, model=UNITS)
    assert_equivalent(run, want, records=False)
    baseline = one_worker(*ARGS, *steps, "optimizer.weight_decay=0.01", model=UNITS, here=True)  # the groups changed it
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
    want = one_worker(*mode, model=UNITS, here=True)
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", *mode, model=UNITS, env={"EF_UNITS_KILL": "1:9:reduce:3", STRICT: "1"})
    assert world_sizes(run)[0] == 3 and world_sizes(run)[-1] == 2
    assert sum(r["grad_norm"] > 0.5 for r in metrics(run) if "loss" in r) >= 5  # clipping was at work
    assert_bitwise(run, want)


# ---------------------------------------------------------------- activation checkpointing
# A recompute in backward reads the unit it recomputes: each way of writing it must find the unit in (with strict
# pages a read of a given-back page ends the worker). 8 steps: reading given-back pages, 3 workers left the 1-worker
# model from step 2 (transformers' GPT-2 ended 0.78 away, issue 63).
SHORT = ["trainer.max_steps=8"]


@pytest.fixture(scope="module")
def short_reference(one_worker):
    """1 worker without checkpointing: a recompute computes the same values, so every style must end here."""
    return one_worker(*ARGS, *SHORT, model=UNITS, here=True)


@pytest.mark.parametrize("extra", [
    ["+model_args.checkpointing=forward"],
    ["+model_args.checkpointing=reentrant"],
    ["+model_args.checkpointing=layer-reentrant"],
    ["+model_args.checkpointing=forward", "trainer.shard_units=[block]"],
    ["+model_args.checkpointing=layer", "+model_args.compile=block"],
], ids=["forward", "forward_reentrant", "layer_reentrant", "forward_shard_units", "layer_compiled_unit"])
def test_every_way_of_checkpointing_a_unit_ends_on_the_one_worker_model(tmp_path, short_reference, extra):
    """checkpoint(unit.forward, h) runs no module hook, in forward nor in its recompute (a unit named by
    trainer.shard_units too, the rest in the root); reentrant, forward runs under no_grad and backward runs it
    again; a unit whose forward checkpoints its own body (transformers' way, the next test without reentrant)
    recomputes it in backward without hooks; a unit compiled in place (nn.Module.compile: its __call__, hooks
    and checkpoint traced; torch.compile of the whole model passes too, 40 s more here). In each, 3 workers with
    strict pages end on the 1-worker model, every step's loss too (1e-5; compiled kernels' own rounding: 3e-7).
    Before the fix the first four died on a given-back page (SIGSEGV) or stopped with "used a parameter
    outside that submodule's own forward"; the compiled unit was right already (AOTAutograd saves the weights
    where the unpack hook sees them)."""
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", "trainer.shard=parameters", *ARGS, *SHORT, *extra, model=UNITS,
             env={STRICT: "1"})
    assert world_sizes(run) == [3] * 8  # no worker died (a read of a given-back page would end it)
    assert_equivalent(run, short_reference)


def test_a_unit_that_checkpoints_its_own_forward_comes_in_before_its_backward_and_goes_after(tmp_path,
                                                                                           short_reference):
    """transformers' GradientCheckpointingLayer way: the unit's __call__ runs once, its forward checkpoints its
    body, and backward recomputes the body without hooks. The unit is brought in as a gradient reaches its output
    (before the recompute) and given back once its parameters have their gradients: in backward, once head, norm
    and block have theirs, a worker holds its two thirds of the parameters again (all of them if they stayed).
    A worker SIGKILLed in its second fetch of a backward (norm's): the survivors fail in theirs and redo the step."""
    run, seen = tmp_path / "run", tmp_path / "resident"
    seen.mkdir()
    train_ok(run, "launcher.workers=3", "trainer.shard=parameters", *ARGS, *SHORT,
             "+model_args.checkpointing=layer", model=UNITS,
             env={"EF_UNITS_KILL": "2:5:backward_fetch:2", "EF_UNITS_RESIDENT": str(seen), STRICT: "1"})
    assert world_sizes(run)[0] == 3 and world_sizes(run)[-1] == 2, world_sizes(run)
    kinds = [e["event"] for e in events(run)]
    assert kinds.count("left") == 1 and "fell_back" not in kinds, kinds
    assert_equivalent(run, short_reference, records=False)
    rows = [r for r in _resident(seen) if r["what"] == "params_backward" and r["world"] == 3 and r["step"] > 0]
    assert len(rows) >= 3 * 4, rows
    assert max(r["resident"] / r["total"] for r in rows) <= 0.69, rows


def test_a_checkpointed_unit_with_frozen_weights_goes_once_its_inputs_gradients_are_done(tmp_path, one_worker):
    """Frozen weights have no gradient to say that backward is done with them: a unit holding some goes once the
    gradients of its inputs are computed as well as its parameters' (FSDP2's post-backward), here with the block's
    first weight frozen and its body recomputed in backward. In backward, once head, norm and block are done, a
    worker holds its two thirds of the trainable parameters (all of them if the block stayed), and 3 workers end on
    the 1-worker model."""
    frozen = [*SHORT, "+model_args.checkpointing=layer", "+model_args.frozen=1"]
    want = one_worker(*ARGS, *frozen, model=UNITS, here=True)
    run, seen = tmp_path / "run", tmp_path / "resident"
    seen.mkdir()
    train_ok(run, "launcher.workers=3", "trainer.shard=parameters", *ARGS, *frozen, model=UNITS,
             env={"EF_UNITS_RESIDENT": str(seen), STRICT: "1"})
    assert world_sizes(run) == [3] * 8
    assert_equivalent(run, want)
    rows = [r for r in _resident(seen) if r["what"] == "params_backward" and r["world"] == 3 and r["step"] > 0]
    assert len(rows) == 3 * 8 and max(r["resident"] / r["total"] for r in rows) <= 0.69, rows


def test_full_graph_compile_is_refused_in_one_line_before_training(tmp_path):
    """torch.compile(net, fullgraph=True) cannot trace the hooks that bring units in: refused at start, in one
    line with a hint, not a dynamo traceback at the first step."""
    proc = start(tmp_path / "run", "trainer.shard=parameters", *ARGS, *SHORT, "+model_args.compile=fullgraph",
                 model=UNITS)
    out = finish(proc)
    assert proc.returncode != 0
    assert "torch.compile(fullgraph=True) cannot trace" in out and "hint: compile without fullgraph=True" in out, \
        out[-2000:]
    assert "step 1 " not in out and "Traceback" not in out, out[-2000:]


GPT2 = MODELS.parent / "tests" / "models" / "gpt2_checkpointing.py"
# tests/models/gpt2_checkpointing.py: ragged_gpt2's tiny GPT-2 (2 blocks of 12.6k parameters) with
# gradient_checkpointing_enable(); one thread a worker, on 1 worker too (the floor below is rounding's)
LM = ["trainer.global_batch_size=24", "trainer.micro_batch_size=4", "trainer.max_steps=6", "backend.threads=1"]


@pytest.mark.parametrize("extra, env, worlds", [
    (["trainer.shard_units=[net.transformer.h.*]"], {"EF_LM_KILL": "1:3"}, [3, 3, 2, 2, 2, 2]),
    (["+model_args.reentrant=1"], {}, [3] * 6),
], ids=["block_units_and_a_kill", "the_model_one_unit_reentrant"])
def test_hugging_face_gradient_checkpointing_ends_on_the_one_worker_model(tmp_path, one_worker, extra, env, worlds):
    """A transformers GPT-2 with gradient_checkpointing_enable() (transformers 5 checkpoints each block's
    forward: its recompute runs no hook) and trainer.shard=parameters ends on the 1-worker model: with its blocks
    as units (the tied embedding and head in the root) and 3 workers, one SIGKILLed at step 3; and with the
    default units (the model is one), reentrant, against the same 1-worker run (a recompute computes the same
    values). Measured with the blocks (whole model, relative): 2.2e-8; the floor, 1 worker with 2 threads against
    1 with 1, 1.4e-8; 3 replicated workers with the same kill (shard=none), 3.4e-8; before units were fetched for
    their recompute, 1.6e-2 (a bias 0.47 away), and a SIGSEGV with strict pages. assert_equivalent's 1e-5 a
    tensor (measured 5e-7 here, 3e-7 from the threads alone) tells those apart."""
    want = one_worker(*LM, model=GPT2, here=True)
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", "trainer.shard=parameters", *extra, *LM, model=GPT2, env={**env, STRICT: "1"})
    assert world_sizes(run) == worlds, world_sizes(run)
    assert_equivalent(run, want)
