"""Optimizers and LR schedules: the trainer's updates equal torch.optim's on the same data, to 1e-6.

Each case trains a small MLP through the real ``ElasticTrainer`` (in-process: the numbers are the
point here, the CLI is covered elsewhere) and replays the same steps by hand with torch.optim:
same initial parameters, same global sample order (``data.permutation``), same batches.
"""
import json
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import elasticflow.checkpoint as ckpt
from elasticflow.data import order as data
from elasticflow import optim
from elasticflow.config.schema import compose
from elasticflow.train.model_file import load as load_model_file
from elasticflow.trainer import ElasticTrainer

SAMPLES, BATCH, STEPS = 96, 32, 7  # 3 steps per epoch: 7 steps cross two epoch boundaries

MLP = '''
import numpy as np
from elasticflow import ops, optim

SPECS = {
    "adam": lambda: optim.Adam(0.02, betas=(0.8, 0.99), eps=1e-6),
    "adamw": lambda: optim.AdamW(0.02, weight_decay=0.2),
    "nesterov": lambda: optim.SGD(0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}


def model(cfg):
    rng = np.random.default_rng(cfg.seed + 7)
    params = {"W1": rng.normal(0, 0.5, (4, 5)).astype(np.float32), "b1": np.zeros(5, np.float32),
              "W2": rng.normal(0, 0.5, (5, 3)).astype(np.float32),
              "b2": rng.normal(0, 0.1, 3).astype(np.float32)}
    if cfg.model_args.get("spec"):
        params["optimizer"] = SPECS[cfg.model_args.spec]()
    return params


def forward(x, y, params):
    h = ops.tanh(x @ params["W1"] + params["b1"])
    return ops.mse(h @ params["W2"] + params["b2"], y)


def data(cfg):
    rng = np.random.default_rng(99)
    x = rng.normal(size=(%d, 4)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2], x[:, 3] ** 2], axis=1).astype(np.float32)
    return x, y
''' % SAMPLES


def fit(model_path, run_dir, *overrides):
    """Train in-process; returns (final checkpoint state, per-step metrics records)."""
    cfg = compose(str(model_path), [f"trainer.global_batch_size={BATCH}", f"trainer.max_steps={STEPS}",
                                    "trainer.log_every=1", "trainer.progress=false", *overrides])
    ElasticTrainer(str(model_path), cfg, run_dir=str(run_dir)).fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return ckpt.load(ckpt.latest(run_dir / "checkpoints")), [r for r in records if "loss" in r]


def reference(model_path, make_optimizer, lrs=None, seed=0):
    """The same STEPS steps written by hand with torch.optim; returns ({name: array}, initial params)."""
    cfg = OmegaConf.create({"seed": seed, "model_args": {}})  # what model()/data() read
    mf = load_model_file(str(model_path))
    init = {k: v for k, v in mf.model(cfg).items() if k != "optimizer"}
    params = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    x, y = mf.data(cfg)
    opt = make_optimizer(list(params.values()))
    steps_per_epoch = SAMPLES // BATCH
    for step in range(STEPS):
        epoch, k = divmod(step, steps_per_epoch)
        idx = data.permutation(SAMPLES, seed, epoch)[k * BATCH:(k + 1) * BATCH]
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        opt.zero_grad()
        mf.forward(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]), params=params).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in params.items()}, init


def assert_same_params(state, expected, init):
    for name, want in expected.items():
        np.testing.assert_allclose(state[name], want, rtol=0, atol=1e-6, err_msg=name)
    # Guard against a vacuous pass: the replay really moved the parameters.
    assert max(np.abs(expected[n] - init[n]).max() for n in expected) > 1e-3


# (config overrides, the torch.optim equivalent)
CONFIG_CASES = {
    "sgd": (["optimizer.lr=0.1"], lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd_momentum": (["optimizer.lr=0.05", "optimizer.momentum=0.9"],
                     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "sgd_nesterov": (["optimizer.lr=0.05", "optimizer.momentum=0.9", "optimizer.nesterov=true"],
                     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    "sgd_weight_decay": (["optimizer.lr=0.1", "optimizer.weight_decay=0.3"],
                         lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.3)),
    "adam": (["optimizer=adam", "optimizer.lr=0.01"], lambda p: torch.optim.Adam(p, lr=0.01)),
    "adam_l2_betas": (["optimizer=adam", "optimizer.lr=0.01", "optimizer.weight_decay=0.1",
                       "optimizer.betas=[0.8,0.99]", "optimizer.eps=1e-6"],
                      lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adamw": (["optimizer=adamw", "optimizer.lr=0.01", "optimizer.weight_decay=0.1"],
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_group_optimizer_matches_torch_optim(tmp_path, write_model, case):
    overrides, make = CONFIG_CASES[case]
    path = write_model(MLP)
    state, records = fit(path, tmp_path / "run", *overrides)
    expected, init = reference(path, make)
    assert_same_params(state, expected, init)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


# model()["optimizer"] trains; a config optimizer setting beside it is refused (test_modelfile.py).
SPEC_CASES = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.02, betas=(0.8, 0.99), eps=1e-6),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.2),
    "nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}


@pytest.mark.parametrize("spec", sorted(SPEC_CASES))
def test_model_file_optimizer_spec_matches_torch_optim(tmp_path, write_model, spec):
    path = write_model(MLP)
    # (the config's optimizer.lr beside it is refused: test_modelfile.py's ..._refused_not_dropped)
    state, records = fit(path, tmp_path / "run", f"+model_args.spec={spec}")
    expected, init = reference(path, SPEC_CASES[spec])
    assert_same_params(state, expected, init)
    assert {r["lr"] for r in records} == {0.02 if spec.startswith("adam") else 0.05}


def test_the_optimizer_cases_are_distinguishable(write_model):
    """The comparisons above can fail: every case's replay ends somewhere measurably different."""
    path = write_model(MLP)
    finals = {name: reference(path, make)[0] for name, (_, make) in CONFIG_CASES.items()}
    finals.update({f"spec_{name}": reference(path, make)[0] for name, make in SPEC_CASES.items()})
    names = sorted(finals)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            gap = max(np.abs(finals[a][n] - finals[b][n]).max() for n in finals[a])
            assert gap > 1e-4, f"{a} and {b} end within {gap}"


def test_scheduled_momentum_sgd_matches_torch_and_logs_its_lr(tmp_path, write_model):
    path = write_model(MLP)
    state, records = fit(path, tmp_path / "run", "optimizer.lr=0.1", "optimizer.momentum=0.9",
                         "optimizer.schedule=cosine", "optimizer.warmup_steps=2", "optimizer.min_lr=0.01")
    # Hand-computed: warmup 0.05, 0.1; then cosine from 0.1 to 0.01 over the remaining 5 of 7 steps.
    lrs = [0.05, 0.1] + [0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * k / 5)) for k in range(5)]
    assert [r["lr"] for r in records] == pytest.approx(lrs, abs=1e-12)
    expected, init = reference(path, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lrs=lrs)
    assert_same_params(state, expected, init)


def test_seed_changes_init_and_order_and_the_replay_still_matches(tmp_path, write_model):
    path = write_model(MLP)
    state, _ = fit(path, tmp_path / "run", "seed=5", "optimizer=adam", "optimizer.lr=0.01")
    expected, init = reference(path, lambda p: torch.optim.Adam(p, lr=0.01), seed=5)
    assert_same_params(state, expected, init)


# ---------------------------------------------------------------- lr_at, by hand
def spec(kind, lr=1.0, **schedule):
    return optim.SGD(lr, schedule=optim.Schedule(kind=kind, **schedule))


@pytest.mark.parametrize("kind, schedule, total, expected", [
    ("constant", {}, 100, {0: 1.0, 50: 1.0, 99: 1.0}),
    # warmup: (step + 1) / warmup_steps of the base lr, then the schedule
    ("constant", {"warmup_steps": 4}, 100, {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 90: 1.0}),
    # linear to min_lr at decay_steps, flat after
    ("linear", {"decay_steps": 10}, None, {0: 1.0, 5: 0.5, 9: 0.1, 10: 0.0, 30: 0.0}),
    ("linear", {"decay_steps": 10, "min_lr": 0.2}, None, {0: 1.0, 5: 0.6, 10: 0.2, 11: 0.2}),
    # decay_steps counts from step 0: warmup 2 then 8 steps of decay
    ("linear", {"warmup_steps": 2, "decay_steps": 10}, None, {0: 0.5, 1: 1.0, 2: 1.0, 6: 0.5, 10: 0.0}),
    # decay_steps null: decay over all training steps
    ("linear", {}, 20, {0: 1.0, 10: 0.5, 15: 0.25}),
    ("cosine", {"decay_steps": 10}, None, {0: 1.0, 5: 0.5, 10: 0.0, 12: 0.0}),
    ("cosine", {"decay_steps": 10, "min_lr": 0.1}, None,
     {0: 1.0, 5: 0.55, 10: 0.1, 2: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2))}),
    ("cosine", {"warmup_steps": 2}, 6, {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.5, 3: 0.5 * (1 + math.cos(math.pi / 4))}),
    ("step", {"step_size": 3, "gamma": 0.5}, None, {0: 1.0, 2: 1.0, 3: 0.5, 5: 0.5, 6: 0.25, 9: 0.125}),
    ("step", {"step_size": 3, "gamma": 0.5, "warmup_steps": 2}, None, {0: 0.5, 1: 1.0, 2: 1.0, 4: 1.0, 5: 0.5}),
])
def test_lr_at_hand_computed(kind, schedule, total, expected):
    s = spec(kind, **schedule)
    got = {step: optim.lr_at(s, step, total) for step in expected}
    assert got == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_warmup_from_zero_is_hugging_faces_schedule(kind):
    """optimizer.warmup_from_zero=true: the learning rate of each update equals what transformers'
    get_{linear,cosine}_schedule_with_warmup gives the torch optimizer for that update."""
    import torch
    import transformers

    make = {"linear": transformers.get_linear_schedule_with_warmup,
            "cosine": transformers.get_cosine_schedule_with_warmup}[kind]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    scheduler = make(opt, num_warmup_steps=4, num_training_steps=20)
    theirs = []
    for _ in range(21):  # 20 updates and one past the end (HF's cosine rises again after it)
        theirs.append(opt.param_groups[0]["lr"])  # the lr of this update
        opt.step()
        scheduler.step()
    ours = spec(kind, lr=0.3, warmup_steps=4, warmup_from_zero=True)
    assert [optim.lr_at(ours, step, 20) for step in range(21)] == pytest.approx(theirs, abs=1e-12)


def test_lr_at_scales_with_the_base_lr():
    assert optim.lr_at(spec("cosine", lr=0.3, decay_steps=10), 5, None) == pytest.approx(0.15)
    assert optim.lr_at(spec("constant", lr=0.3, warmup_steps=3), 0, None) == pytest.approx(0.1)


@pytest.mark.parametrize("overrides, expected", [
    (["optimizer.schedule=linear", "optimizer.warmup_steps=2"], [0.05, 0.1, 0.1, 0.08, 0.06, 0.04, 0.02]),
    (["optimizer.schedule=step", "optimizer.step_size=3", "optimizer.gamma=0.5"],
     [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025]),
    (["optimizer.schedule=linear", "optimizer.decay_steps=4", "optimizer.min_lr=0.02"],
     [0.1, 0.08, 0.06, 0.04, 0.02, 0.02, 0.02]),
])
def test_metrics_lr_column_follows_the_schedule(tmp_path, write_model, overrides, expected):
    path = write_model(MLP)
    _, records = fit(path, tmp_path / "run", "optimizer.lr=0.1", *overrides)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["lr"] for r in records] == pytest.approx(expected, abs=1e-12)


def test_optimizer_spec_validation():
    with pytest.raises(Exception, match="momentum"):
        optim.SGD(0.1, nesterov=True)
    assert optim.AdamW(1e-3).weight_decay == 0.01  # torch.optim.AdamW's default
    assert optim.Adam(1e-3).slots() == ("exp_avg", "exp_avg_sq")
    assert optim.SGD(0.1).slots() == () and optim.SGD(0.1, momentum=0.9).slots() == ("momentum_buffer",)


# ---------------------------------------------------------------- the flat Adam on a model nobody tuned for it
def _gpt_and_batches(seed=0, steps=12):
    """models/tiny_gpt.py (nn.MultiheadAttention, LayerNorm, a tied embedding) small, and its batches."""
    import importlib.util
    from harness import MODELS
    spec = importlib.util.spec_from_file_location("tiny_gpt_for_optim", MODELS / "tiny_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = OmegaConf.create({"seed": seed, "model_args": {"vocab": 50, "width": 16, "layers": 2, "samples": 8 * steps}})
    x, y = (torch.from_numpy(a) for a in mod.data(cfg))
    return mod, (lambda: mod.model(cfg)), [(x[8 * k:8 * k + 8], y[8 * k:8 * k + 8]) for k in range(steps)]


def _engine_steps(engine, batches, lrs):
    for (x, y), lr in zip(batches, lrs):
        engine.zero_grad()
        engine.accumulate((x, y), 1.0)
        engine.apply(lr)


def _torch_state(net, opt, slot_names):
    """torch.optim's run as an Engine.state(): parameters, buffers and optimizer/<param>/<slot>."""
    names = {p: n for n, p in net.named_parameters()}
    persistent = set(net.state_dict())  # a non-persistent buffer (the causal mask) is the module's, not state
    out = {n: t.detach().numpy().copy() for n, t in list(net.named_parameters()) + list(net.named_buffers())
           if n in persistent}
    for p, slots in opt.state.items():
        out.update({f"optimizer/{names[p]}/{s}": slots[s].numpy().copy() for s in slot_names})
    return out


def _torch_steps(net, opt, mod, batches, lrs):
    for (x, y), lr in zip(batches, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        mod.forward(x, y, net).backward()
        opt.step()


ADAM_MODULE_CASES = {
    "adamw": (lambda: optim.AdamW(3e-3, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1)),
    "adam_l2": (lambda: optim.Adam(3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
                lambda p: torch.optim.Adam(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
}


def _side_by_side(make_spec, make_torch, lr: float):
    """torch.optim and the Engine's flat optimizer over models/tiny_gpt.py from the same weights: 12 steps
    with a changing lr, and a second Engine loaded from torch.optim's state at step 6 that does the last 6.
    Returns (torch.optim's state at step 6, the Engine's, torch.optim's state at the end, the two Engines'
    states at the end, the initial parameters by name); states as ``Engine.state()`` names them."""
    from elasticflow.backends.torch import Engine

    mod, make_net, batches = _gpt_and_batches()
    lrs = [lr * (1 - k / 24) for k in range(len(batches))]
    net = make_net()
    opt = make_torch(list(net.parameters()))
    engine = Engine(make_net(), mod.forward, make_spec())
    slots = make_spec().slots()

    _torch_steps(net, opt, mod, batches[:6], lrs[:6])
    _engine_steps(engine, batches[:6], lrs[:6])
    halfway, engine_halfway = _torch_state(net, opt, slots), engine.state()
    resumed = Engine(make_net(), mod.forward, make_spec())
    resumed.load_state(halfway, optimizer_steps=6)
    _torch_steps(net, opt, mod, batches[6:], lrs[6:])
    _engine_steps(engine, batches[6:], lrs[6:])
    _engine_steps(resumed, batches[6:], lrs[6:])
    init = {n: p.detach().numpy() for n, p in make_net().named_parameters()}
    return halfway, engine_halfway, _torch_state(net, opt, slots), [engine.state(), resumed.state()], init


def _moved(final, init) -> float:
    """The least any parameter tensor moved (its largest element change): a test that compares is not vacuous."""
    return min(np.abs(final[n] - value).max() for n, value in init.items())


@pytest.mark.parametrize("case", sorted(ADAM_MODULE_CASES))
def test_flat_adam_on_a_module_matches_torch_optim_and_resumes_from_its_state(case):
    """12 steps with a changing lr: parameters and moments equal torch.optim's to float32 rounding, the
    slots keep torch.optim's names, and an Engine loaded from torch.optim's state at step 6 continues
    exactly as torch.optim does (checkpoints move between the two)."""
    halfway, got, final, ends, init = _side_by_side(*ADAM_MODULE_CASES[case], lr=3e-3)
    assert sorted(k for k in got if k.startswith("optimizer/")) == sorted(k for k in halfway if k.startswith("optimizer/"))
    for name, want in halfway.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-9, err_msg=name)
    for got in ends:
        for name, want in final.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-9, err_msg=name)
    # Not vacuous: the run moved every tensor well past the tolerance.
    assert _moved(final, init) > 1e-3


SGD_MODULE_CASES = {
    "plain": (lambda: optim.SGD(0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    "momentum": (lambda: optim.SGD(0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "nesterov_wd": (lambda: optim.SGD(0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
}


@pytest.mark.parametrize("case", sorted(SGD_MODULE_CASES))
def test_flat_sgd_on_a_module_is_torch_optim_bit_for_bit_and_resumes_from_its_state(case):
    """The flat SGD (one update over the whole model) against torch.optim.SGD over the module's parameters:
    12 steps with a changing lr give identical bits, parameters and momentum alike, and an Engine loaded
    from torch.optim's state at step 6 goes on identically."""
    halfway, got, final, ends, init = _side_by_side(*SGD_MODULE_CASES[case], lr=0.05)
    assert sorted(got) == sorted(halfway)
    for got in ends:
        for name, want in final.items():
            np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert _moved(final, init) > 1e-3


# ---------------------------------------------------------------- a native optimizer and its schedule
NATIVE = '''
import numpy as np
import torch
from torch import nn
from torch.optim import lr_scheduler as L

SCHEDULERS = {  # model_args.sched: what model() returns beside its optimizer
    "sequential": lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.2, total_iters=2),
                                               L.CosineAnnealingLR(o, T_max=4)], milestones=[3]),
    "lightning": lambda o: {"scheduler": L.StepLR(o, 2, 0.5), "interval": "step"},
    "plateau": lambda o: L.ReduceLROnPlateau(o),
    "epoch": lambda o: {"scheduler": L.StepLR(o, 2, 0.5)},
    "cosine": lambda o: L.CosineAnnealingLR(o, T_max=4),
}


def model(cfg):
    torch.manual_seed(cfg.seed + 3)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": weights}, {"params": biases, "lr": 0.04, "weight_decay": 0.0}],
                            lr=0.02, weight_decay=0.1)
    out = {"net": net, "optimizer": opt}
    sched = cfg.model_args.get("sched")
    if sched == "unreturned":
        L.StepLR(opt, 2)  # built on the optimizer, then forgotten
    elif sched:
        out["lr_scheduler"] = SCHEDULERS[sched](opt)
    return out


def forward(x, y, model):
    return nn.functional.mse_loss(model["net"](x), y)


def data(cfg):
    rng = np.random.default_rng(99)
    x = rng.normal(size=(%d, 4)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2], x[:, 3] ** 2], axis=1).astype(np.float32)
    return x, y
''' % SAMPLES


def torch_loop(model_path, scheduler=None, sched_arg=None):
    """The plain torch loop: model()'s own net and torch.optim.AdamW, its lr moved by torch's own scheduler
    (``scheduler(opt)``, or the one model() returned), STEPS steps on the trainer's global batches. Returns
    ({name: array}, the lr of each step's first group, the initial parameters)."""
    cfg = OmegaConf.create({"seed": 0, "model_args": {"sched": sched_arg}})
    mf = load_model_file(str(model_path))
    built = mf.model(cfg)
    net, opt = built["net"], built["optimizer"]
    sched = built.get("lr_scheduler") or scheduler(opt)
    sched = sched["scheduler"] if isinstance(sched, dict) else sched
    init = {f"net.{k}": v.detach().numpy().copy() for k, v in net.named_parameters()}
    x, y = mf.data(cfg)
    lrs = []
    for step in range(STEPS):
        epoch, k = divmod(step, SAMPLES // BATCH)
        idx = data.permutation(SAMPLES, 0, epoch)[k * BATCH:(k + 1) * BATCH]
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        mf.forward(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]), params={"net": net}).backward()
        opt.step()
        sched.step()
    return {f"net.{k}": v.detach().numpy() for k, v in net.named_parameters()}, lrs, init


def test_a_native_adamw_follows_the_configs_cosine_schedule_as_torchs_schedulers_move_it(tmp_path, write_model):
    """model() returns torch.optim.AdamW with two param groups (lr 0.02 and 0.04); the config asks for
    schedule=cosine with 2 warmup steps. The logged lr and the weights are the plain torch loop's with torch's
    own schedulers (LinearLR warmup, then CosineAnnealingLR: each group's lr scaled alike), and the banner's
    description names the schedule."""
    path = write_model(NATIVE)
    state, records = fit(path, tmp_path / "run", "optimizer.schedule=cosine", "optimizer.warmup_steps=2")
    W = 2
    expected, lrs, init = torch_loop(path, lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 1 / W, total_iters=W - 1),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS - W)], milestones=[W]))
    hand = [0.02 * (s + 1) / W for s in range(W)] + \
           [0.01 * (1 + math.cos(math.pi * (s - W) / (STEPS - W))) for s in range(W, STEPS)]
    assert lrs == pytest.approx(hand, rel=1e-12)  # torch's schedulers are the formula
    assert [r["lr"] for r in records] == pytest.approx(lrs, rel=1e-12)
    assert_same_params(state, expected, init)


def test_a_returned_lr_scheduler_is_stepped_per_step_and_resumes_as_torch_steps_it(tmp_path, write_model):
    """{"optimizer": opt, "lr_scheduler": SequentialLR(LinearLR warmup, CosineAnnealingLR)}: trained to step 4 in
    this process, then resumed to 7 by the CLI; the lr of every step and the weights are torch's own loop's.
    MLflow's params, the banner and `elasticflow status` name the AdamW, its lr and the schedule that trained,
    not the config's unused sgd at 0.1."""
    import mlflow

    from elasticflow.observability.trackers import MlflowTracker
    from harness import cli, fit_here, train

    path = write_model(NATIVE)
    run = tmp_path / "run"
    common = [f"trainer.global_batch_size={BATCH}", "trainer.log_every=1", "+model_args.sched=sequential"]
    fit_here(path, run, *common, "trainer.max_steps=4", "trainer.loggers=[]", "trainer.progress=false")
    # csv: the sidecar's cheapest tracker; every tracker gets the same params (.elasticflow/params.json)
    second = train(path, run, *common, f"trainer.max_steps={STEPS}", "trainer.loggers=[csv]")
    assert "optimizer adamw(lr=0.02" in second.stderr + second.stdout
    assert "schedule=cosine(warmup_steps=3, warmup_start=0.2, warmup_ramp=2, decay_steps=7" in \
        second.stderr + second.stdout
    expected, lrs, init = torch_loop(path, sched_arg="sequential")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if "loss" in r] == pytest.approx(lrs, rel=1e-12)
    assert_same_params(ckpt.load(ckpt.latest(run / "checkpoints")), expected, init)

    # Those params into MLflow as the sidecar hands them over (its own process costs ~20 s of MLflow start-up here;
    # test_trackers.py runs that path), read back as MLflow's users do.
    MlflowTracker(run, json.loads((run / ".elasticflow" / "params.json").read_text())).close()
    mlflow.set_tracking_uri(f"sqlite:///{run / 'mlflow.db'}")
    params = mlflow.search_runs(experiment_names=["elasticflow"], output_format="list")[0].data.params
    assert (params["optimizer.name"], params["optimizer.lr"], params["optimizer.schedule"]) == \
        ("adamw", "0.02", "cosine")
    assert params["optimizer.source"] == "model file" and params["optimizer.warmup_steps"] == "3"
    assert "optimizer.momentum" not in params  # the config group's sgd setting never trained
    shown = cli(["status", run]).stdout
    assert "optimizer adamw  lr 0.02  schedule cosine(warmup_steps=3" in shown and "(from the model file)" in shown


@pytest.mark.parametrize("sched, said", [
    ("plateau", "model()['lr_scheduler'] is a ReduceLROnPlateau (it follows a metric, not the step), which "
                "ElasticFlow cannot compute"),
    ("epoch", "model()['lr_scheduler'] asks for interval='epoch' (Lightning's default), frequency=1: ElasticFlow "
              "steps a scheduler once per optimizer step"),
    ("unreturned", "model()'s torch.optim.AdamW has a learning-rate scheduler built on it that model() did not "
                   "return: it would train at the scheduler's first lr (0.02) for every step"),
    ("cosine", "model() gives its optimizer a schedule (cosine(decay_steps=4, min_lr=0, periodic=True)) and the "
               "config asks for optimizer.schedule=linear(decay_steps=all, min_lr=0): only one can set the "
               "learning rate"),
])
def test_a_schedule_that_would_not_be_applied_is_one_line_before_training(tmp_path, write_model, sched, said):
    from harness import train_in_process

    path = write_model(NATIVE)
    out = train_in_process(path, tmp_path / "run", f"+model_args.sched={sched}", "optimizer.schedule=linear"
                           if sched == "cosine" else "trainer.max_steps=1")
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {said}"], out.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_lightnings_step_interval_dict_is_honoured():
    """{"scheduler": StepLR, "interval": "step"}: the spec's schedule is StepLR's, each group in proportion."""
    from elasticflow.backends.torch.optim import spec_from_native
    from elasticflow.train.model_file import _scheduler

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.3}], lr=0.1)
    spec = spec_from_native(opt, _scheduler({"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
                                             "interval": "step"}))
    assert [optim.lr_at(spec, s, None) for s in range(5)] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    assert [g.lr for g in spec.groups] == [0.1, 0.3]  # the groups' own lrs, not what StepLR's start left there


@pytest.mark.parametrize("make", [
    "CosineAnnealingLR(o, T_max=5)",  # past T_max torch's cosine climbs back: so does the translation
    "CosineAnnealingLR(o, T_max=5, eta_min=0.01)",
    "LinearLR(o, start_factor=0.25, total_iters=4)",
    "LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=6)",
    "StepLR(o, 3, 0.5)",
    "ExponentialLR(o, 0.9)",
    "PolynomialLR(o, total_iters=8, power=1.0)",
    "LambdaLR(o, lambda s: 1 / (1 + s))",
    "SequentialLR(o, [LinearLR(o, 0.1, total_iters=2), CosineAnnealingLR(o, T_max=6)], milestones=[3])",
    "SequentialLR(o, [LinearLR(o, 0.5, total_iters=3), StepLR(o, 2, 0.5)], milestones=[3])",
    "transformers.get_cosine_schedule_with_warmup(o, 3, 12)",
])
def test_each_translated_torch_scheduler_gives_torchs_lr_for_20_steps(make):
    import transformers  # noqa: F401 - named by a case
    from torch.optim.lr_scheduler import (CosineAnnealingLR, ExponentialLR, LambdaLR, LinearLR,  # noqa: F401
                                          PolynomialLR, SequentialLR, StepLR)

    from elasticflow.backends.torch.optim import spec_from_native

    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]}]
    if "eta_min" not in make:  # eta_min is absolute in torch: in proportion only over one lr
        groups.append({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.05})
    o = torch.optim.SGD(groups, lr=0.1)
    sched = eval(make)
    spec = spec_from_native(o, sched)
    for step in range(20):
        ours = [optim.lr_at(spec, step, 20) * g.lr / spec.lr for g in spec.groups]
        assert ours == pytest.approx([g["lr"] for g in o.param_groups], rel=1e-12, abs=1e-15), step
        o.step()
        sched.step()


@pytest.mark.parametrize("make, why", [
    ("ConstantLR(o, factor=0.5)", "ConstantLR"),
    ("MultiStepLR(o, [2, 5])", "MultiStepLR"),
    ("OneCycleLR(o, max_lr=0.1, total_steps=10)", "OneCycleLR"),
    ("LinearLR(o, start_factor=0.5, end_factor=0.2)", "LinearLR from 0.5 to 0.2"),
    ("CosineAnnealingLR(o, T_max=5, eta_min=0.01)", "CosineAnnealingLR with eta_min=0.01 over param groups"),
])
def test_a_scheduler_that_cannot_be_computed_is_refused(make, why):
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, MultiStepLR, OneCycleLR  # noqa: F401

    from elasticflow.backends.torch.optim import spec_from_native
    from elasticflow.errors import ElasticFlowError

    o = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                         {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.05}], lr=0.1, momentum=0.9)
    with pytest.raises(ElasticFlowError, match=why) as info:
        spec_from_native(o, eval(make))
    assert "optimizer.schedule" in info.value.hint


# ---------------------------------------------------------------- TensorFlow: a keras optimizer and its schedule
KERAS = '''
import numpy as np
from elasticflow import ops

N = 16


def model(cfg):
    import keras

    keras.utils.set_random_seed(cfg.seed)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh", name="hidden"),
                            keras.layers.Dense(2, name="out")], name="net")
    net.compile(optimizer=OPTIMIZERS[cfg.model_args.how](keras), loss="mse")
    return net


OPTIMIZERS = {  # model_args.how: the optimizer model() compiles in, and the same as keras runs it in the test
    "schedule": lambda keras: keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(0.2, 4, alpha=0.1),
                                                   momentum=0.5),
    "config": lambda keras: keras.optimizers.Adam(0.05),  # the test's config: schedule=linear, decay_steps=5
    "config_as_keras": lambda keras: keras.optimizers.Adam(keras.optimizers.schedules.PolynomialDecay(0.05, 5, 0.0)),
}


def forward(x, y, net):
    return ops.mse(net(x), y)


def data(cfg):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    return x, np.stack([x[:, 0] * x[:, 1], np.sin(x[:, 2])], 1).astype(np.float32)
'''


@pytest.mark.parametrize("how, overrides, oracle", [
    ("schedule", [], "schedule"),  # a keras LearningRateSchedule: keras's own lr each step
    ("config", ["optimizer.schedule=linear", "optimizer.decay_steps=5"], "config_as_keras"),  # the config's drives it
])
def test_a_keras_optimizers_schedule_or_the_configs_drives_it_as_fit_does(tmp_path, write_model, how, overrides,
                                                                          oracle):
    """A keras model compiled with SGD(CosineDecay), or with Adam(0.05) and the config's linear schedule: the
    logged lr of each step is keras's schedule's, and the weights are model.fit's with that schedule (full-batch
    steps, so the order within a batch is all that differs)."""
    pytest.importorskip("tensorflow")
    import keras

    from harness import fit_here

    path = write_model(KERAS)
    run = tmp_path / "run"
    fit_here(path, run, "backend=tensorflow", "backend.threads=1", "trainer.global_batch_size=16",
             "trainer.max_steps=5", "trainer.log_every=1", "trainer.progress=false", f"+model_args.how={how}",
             *overrides)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    mf = load_model_file(str(path))
    cfg = OmegaConf.create({"seed": 0, "model_args": {"how": oracle}})
    reference = mf.model(cfg)
    x, y = mf.data(cfg)
    lrs = [float(reference.optimizer._learning_rate(s)) for s in range(5)]
    assert [r["lr"] for r in records if "loss" in r] == pytest.approx(lrs, rel=1e-6)
    assert len(set(lrs)) == 5  # the lr moved every step
    reference.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0)
    state = ckpt.load(ckpt.latest(run / "checkpoints"))
    start = mf.model(cfg)
    for v, v0 in zip(reference.trainable_weights, start.trainable_weights):
        name = v.path.split("/", 1)[1]  # the trainer names a weight by its path inside the model
        np.testing.assert_allclose(state[name], v.numpy(), rtol=0, atol=1e-5, err_msg=name)
        assert np.abs(v.numpy() - v0.numpy()).max() > 1e-3  # not vacuous: it trained


def test_what_a_keras_optimizer_cannot_take_as_its_schedule_is_one_line():
    """A torch-style lr_scheduler beside a keras optimizer, and a learning rate that is a function of nothing,
    are refused naming the schedule, never trained at a constant lr."""
    pytest.importorskip("tensorflow")
    import keras

    from elasticflow.backends.tensorflow.optim import spec_from_native
    from elasticflow.errors import ElasticFlowError

    with pytest.raises(ElasticFlowError, match=r"model\(\)\['lr_scheduler'\] \(StepLR\) is given beside a keras SGD"):
        spec_from_native(keras.optimizers.SGD(0.1), torch.optim.lr_scheduler.StepLR(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), 2))
    with pytest.raises(ElasticFlowError, match="with a learning-rate function") as info:
        spec_from_native(keras.optimizers.Adam(lambda: 0.1))
    assert "LearningRateSchedule" in info.value.hint
