"""Parameters with no gradient sit the step out, as torch.optim skips a parameter whose ``.grad`` is None: no
update, no weight decay, no change of its optimizer state, and no step counted (Adam's bias correction then
counts that parameter's own steps). The model is a mixture of experts whose rare experts get no token in most
steps, and a head forward() never calls (tests/models/moe_probe.py).

The hand-written loops below keep their parameters in one flat buffer, as the Engine does: BLAS kernels round
the last bit of a gradient differently for another memory alignment (a module with separately allocated
parameters ends ~2e-7 away after 60 steps, with or without ElasticFlow's skipping), and the point here is that
the update is torch.optim's to the bit.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import elasticflow.checkpoint as ckpt
from elasticflow.backends.torch import Engine
from elasticflow.backends.torch.optim import spec_from_native
from elasticflow.data import order as data
from elasticflow.train.state import TrainState
from harness import COMMON, assert_equivalent, final_state, finish, metrics, start, train_ok

sys.path.insert(0, str(Path(__file__).parent / "models"))
import moe_probe  # noqa: E402

from elasticflow._util.pages import ENV_STRICT  # noqa: E402

MOE = Path(moe_probe.__file__)
STEPS, BATCH, MICRO = 60, 64, 16
MOE_COMMON = [c for c in COMMON if not c.startswith("optimizer.")] + [f"trainer.micro_batch_size={MICRO}"]
RARE = ("experts.4.", "experts.5.")  # the experts the router starts away from
NEVER = "spare."                     # the head forward() never calls


def _flat(module: torch.nn.Module) -> None:
    """Move MODULE's parameters into one flat buffer, in order (the Engine's layout; see the docstring)."""
    params = list(module.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    at = 0
    for p in params:
        view = flat[at:at + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        at += p.numel()


def _cfg(kind: str):
    return OmegaConf.create({"seed": 0, "model_args": {"optimizer": kind}, "data": {"prefetch": 0}})


def _indices(step: int, n: int) -> np.ndarray:
    """The samples of global batch STEP (0-based) of N samples: the trainer's order, an epoch's last batch short."""
    epoch, k = divmod(step, -(-n // BATCH))
    return data.permutation(n, 0, epoch)[k * BATCH:(k + 1) * BATCH]


def hand_loop(kind: str, steps: int, micro: int = BATCH):
    """The model file's own torch.optim optimizer over the global order, micro-batch by micro-batch, as a user
    writes the loop. Returns ({name: parameter}, {name: steps it had no gradient}, the optimizer's state)."""
    built = moe_probe.model(_cfg(kind))
    net, opt = built["net"], built["optimizer"]
    _flat(net)
    x, y = (torch.from_numpy(a) for a in moe_probe.data(_cfg(kind)))
    sat_out = {name: 0 for name, _ in net.named_parameters()}
    for step in range(steps):
        idx = _indices(step, len(x))
        opt.zero_grad()
        for a in range(0, len(idx), micro):
            part = idx[a:a + micro]
            loss = moe_probe.forward(x[part], y[part], {"net": net})
            (loss * (len(part) / len(idx)) if micro < len(idx) else loss).backward()
        for name, p in net.named_parameters():
            sat_out[name] += p.grad is None
        opt.step()
    names = {p: name for name, p in net.named_parameters()}
    state = {f"optimizer/{names[p]}/{slot}": v.numpy().copy() for p, s in opt.state.items()
             for slot, v in s.items() if slot != "step"}
    return {n: p.detach().numpy().copy() for n, p in net.named_parameters()}, sat_out, state


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_the_engine_skips_what_torch_optim_skips_to_the_bit(kind):
    """The Engine against torch.optim over 80 steps: rare experts sit out some steps and take part in others,
    the spare head sits out all; parameters equal to the bit, and the spare head never moved (no decay)."""
    steps = 80
    want, sat_out, _ = hand_loop(kind, steps)
    built = moe_probe.model(_cfg(kind))
    engine = Engine({"net": built["net"]}, lambda x, y, params: moe_probe.forward(x, y, params),
                    spec_from_native(built["optimizer"]))
    names = list(engine.params)
    x, y = (torch.from_numpy(a) for a in moe_probe.data(_cfg(kind)))
    counted = np.zeros(len(names), dtype=int)
    for step in range(steps):
        idx = _indices(step, len(x))
        engine.zero_grad()
        engine.accumulate((x[idx], y[idx]), 1.0)
        took = engine.took_part().copy()
        engine.apply(built["optimizer"].defaults["lr"], None if took.all() else took,
                     counted.copy() if counted.any() else None)
        counted += ~took
    assert dict(zip([n[len("net."):] for n in names], counted.tolist())) == sat_out
    rare = [sat_out[n] for n in sat_out if n.startswith(RARE)]
    assert any(0 < s < steps for s in rare), sat_out  # a rare expert both sat out and took part
    got = engine.state()
    for name, value in want.items():
        np.testing.assert_array_equal(got["net." + name], value, err_msg=name)
    start = moe_probe.model(_cfg(kind))["net"]
    for name, p in start.named_parameters():
        if name.startswith(NEVER):
            np.testing.assert_array_equal(got["net." + name], p.detach().numpy(), err_msg=name)


def test_one_worker_is_the_hand_loop_to_the_bit_and_resumes_its_step_counts(tmp_path):
    """`elasticflow train` with micro-batches against the hand loop: every parameter and Adam moment equal to
    the bit, and each parameter's own step count in the checkpoint. Stopped at step 30 and resumed, the run
    ends on the same bits (the counts survive the checkpoint). One intra-op thread on both sides: the run's default
    is the cores' share, and once in three suites under load the embedding's gradient came out one ulp apart."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want, sat_out, moments = hand_loop("adam", STEPS, micro=MICRO)
    finally:
        torch.set_num_threads(threads)
    run = tmp_path / "run"
    train_ok(run, f"trainer.max_steps={STEPS // 2}", "backend.threads=1", model=MOE, common=MOE_COMMON)
    train_ok(run, "backend.threads=1", model=MOE, common=MOE_COMMON)
    newest = ckpt.latest(run / "checkpoints")
    got, meta = ckpt.load_with_metadata(newest)
    assert meta["step"] == STEPS
    assert meta["sat_out"] == {"net." + n: s for n, s in sat_out.items() if s}
    for name, value in {**want, **moments}.items():
        key = name.replace("optimizer/", "optimizer/net.") if name.startswith("optimizer/") else "net." + name
        np.testing.assert_array_equal(got[key], value, err_msg=name)
    skipped = [r.get("params_without_grad", 0) for r in metrics(run) if "loss" in r]
    assert len(skipped) == STEPS and all(s >= 2 for s in skipped)  # the spare head's two tensors, every step


@pytest.mark.parametrize("shard", ["none", "optimizer", "parameters"])
def test_three_workers_one_killed_end_on_the_one_worker_model(tmp_path, one_worker, shard):
    """3 workers, worker 1 SIGKILLed at step 20, against 1 worker: the same model to float32 rounding (the
    micro-batch sums come in another order), idle experts skipped the same way on every member. Under
    trainer.shard=parameters the experts' ModuleList is one unit that nobody calls: the first expert called brings
    it in (param_units: a container's members carry its hooks), with strict pages (a read of a given-back page
    ends the run; before, the experts' weights were read while out)."""
    reference = one_worker(model=MOE, common=MOE_COMMON, here=True)
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=3", f"trainer.shard={shard}", model=MOE, common=MOE_COMMON,
                 env={"EF_PROBE_KILL": "1:20:forward", ENV_STRICT: "1"})
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert [r["world_size"] for r in metrics(run) if "loss" in r][-1] == 2
    assert ckpt.read_metadata(ckpt.latest(run / "checkpoints"))["sat_out"] == \
        ckpt.read_metadata(ckpt.latest(reference / "checkpoints"))["sat_out"]
    assert_equivalent(run, reference)  # measured 1.4e-6 relative; 1 vs 2 threads on 1 worker: 1.3e-6
    spare = {n: v for n, v in final_state(run, rng=False).items() if NEVER in n and not n.startswith("optimizer/")}
    start_values = {"net." + n: p.detach().numpy() for n, p in moe_probe.model(_cfg("adam"))["net"].named_parameters()}
    for name, value in spare.items():
        np.testing.assert_array_equal(value, start_values[name], err_msg=name)


@pytest.mark.parametrize("bad", [{"net.spare.weight": -1}, {"net.spare.weight": "3"}, ["net.spare.weight"],
                                 {"net.spare.weight": 2.5}, {"net.spare.weight": True}])
def test_a_crafted_step_count_is_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        TrainState().load_state_dict({"sat_out": bad})
    s = TrainState()
    s.load_state_dict(json.loads(json.dumps({"sat_out": {"net.spare.weight": 3}})))
    assert s.sat_out == {"net.spare.weight": 3} and TrainState().sat_out == {}
