"""The backends as a family: every Engine keeps the one contract (backends/engine.py), forward()'s
output is checked with the same messages everywhere, and elasticflow.ops dispatches to the right one."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

from elasticflow import backends, ops, optim
from elasticflow.backends import common
from elasticflow.backends.engine import Engine as Contract
from elasticflow.errors import ElasticFlowError

BACKENDS = ["torch", "tensorflow"]
METHODS = sorted(n for n, v in vars(Contract).items() if inspect.isfunction(v) and not n.startswith("_"))
ATTRIBUTES = sorted(n for n in Contract.__annotations__)


def _problems(want: inspect.Signature, have: inspect.Signature) -> list:
    """How ``have`` fails to accept every call ``want`` accepts (same names, order, kinds, defaults)."""
    problems = []
    have_params = list(have.parameters.values())
    for i, p in enumerate(want.parameters.values()):
        q = have.parameters.get(p.name)
        if q is None:
            problems.append(f"no argument {p.name!r}")
            continue
        if p.kind is not inspect.Parameter.KEYWORD_ONLY and (have_params.index(q) != i or q.kind != p.kind):
            problems.append(f"argument {p.name!r} is {q.kind.description} at position {have_params.index(q)}, "
                            f"expected {p.kind.description} at {i}")
        if p.default is not inspect.Parameter.empty and q.default != p.default:
            problems.append(f"argument {p.name!r} defaults to {q.default!r}, expected {p.default!r}")
    for q in have_params:  # what the contract never passes must be optional
        if q.name not in want.parameters and q.default is inspect.Parameter.empty \
                and q.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            problems.append(f"extra required argument {q.name!r}")
    return problems


def test_the_contract_lists_what_the_trainer_calls():
    # A test that cannot fail is a defect: an empty or shrunken contract would pass the one below.
    assert {"train_mode", "zero_grad", "accumulate", "grad_view", "grad_norm", "scale_grad", "apply", "evaluate",
            "state", "load_state", "state_names", "seed", "buffer_rules", "buffer_arrays", "set_buffers"} <= set(METHODS)
    assert ATTRIBUTES == ["grad_scale", "num_params"]
    assert _problems(inspect.signature(Contract.state), inspect.signature(lambda self: None)) == [
        "no argument 'copy'"]
    assert _problems(inspect.signature(Contract.apply), inspect.signature(lambda self, lr=0.1, extra=1: None)) == []
    assert _problems(inspect.signature(Contract.apply), inspect.signature(lambda self, rate, lr: None)) == [
        "argument 'lr' is positional or keyword at position 2, expected positional or keyword at 1",
        "extra required argument 'rate'"]


@pytest.mark.parametrize("name", BACKENDS)
def test_every_engine_keeps_the_contract(name):
    engine_cls = backends.load(name).Engine
    for member in METHODS + ["__init__"]:
        impl = getattr(engine_cls, member, None)
        assert callable(impl), f"{name} Engine has no {member}()"
        problems = _problems(inspect.signature(getattr(Contract, member)), inspect.signature(impl))
        assert not problems, f"{name} Engine.{member}: {'; '.join(problems)}"
    engine = engine_cls({"W": np.ones((3, 2), np.float32)}, lambda x, params: x, optim.SGD(0.1))
    for attribute in ATTRIBUTES:
        assert hasattr(engine, attribute), f"{name} Engine has no attribute {attribute}"
    assert isinstance(engine, Contract) and engine.num_params == 6


def test_no_backend_imports_ops():
    """ops dispatches through backends.common; a backend importing ops back would be an import cycle."""
    for path in sorted(Path(backends.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module or ''}.{a.name}" for a in node.names] + [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not [n for n in names if n.split(".")[-1] == "ops" or n.endswith("elasticflow.ops")], \
                f"{path.name}:{node.lineno} imports elasticflow.ops"


# ---------------------------------------------------------------- dispatch
def test_using_restores_the_previous_backend_even_none():
    with ops.using():
        common.activate(None)
        assert ops.current().NAME == "torch"  # nothing chosen: the first op picks torch
        with ops.using("tensorflow") as tfb:
            assert tfb.NAME == ops.backend_name() == "tensorflow" and ops.current() is tfb
            with pytest.raises(KeyError):
                with ops.using("torch"):
                    raise KeyError("fails inside")
            assert ops.current() is tfb
        assert ops.current().NAME == "torch"
        common.activate(None)
        with ops.using():
            ops.use("tensorflow")
            assert common.active() is ops.current() and ops.current().NAME == "tensorflow"
        assert common.active() is None


@pytest.mark.parametrize("name", BACKENDS)
def test_an_engine_routes_ops_to_its_own_backend(name):
    """forward()'s ops reach the engine's backend even after another trainer switched ops elsewhere."""
    seen = []

    def forward(x, params):
        seen.append(ops.backend_name())
        return ops.mean(ops.square(x * params["w"]))

    other = "tensorflow" if name == "torch" else "torch"
    with ops.using(name) as module:
        engine = module.Engine({"w": np.ones(2, np.float32)}, forward, optim.SGD(0.1))
        x = module.to_tensor(np.array([1.0, 3.0]))
        ops.use(other)  # another trainer in the process
        loss, _ = engine.accumulate((x,), 1.0)
        assert float(loss) == 5.0 and seen == [name]
        assert ops.backend_name() == name  # left on the engine's backend, as ops.use(NAME) left it


# ---------------------------------------------------------------- forward()'s output
def _messages(name, out):
    module = backends.load(name)
    with pytest.raises(ElasticFlowError) as info:
        module._check_loss(out(module), "for a micro-batch")
    return info.value.message, info.value.hint


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_forward_outputs_give_the_same_messages_on_every_backend(name):
    assert _messages(name, lambda m: 1.5) == (
        "forward() returned a float as the loss for a micro-batch",
        f"compute the loss from params with elasticflow.ops (or {name}) so gradients flow")
    assert _messages(name, lambda m: m.to_tensor(np.ones((2, 3)))) == (
        "forward() returned a non-scalar loss of shape (2, 3) for a micro-batch",
        "reduce it to one number, e.g. ops.mean(...) or ops.cross_entropy(logits, y)")
    assert _messages(name, lambda m: {"loss": m.to_tensor(np.ones(1)), "acc": m.to_tensor(np.ones(2))}) == (
        "forward() metric 'acc' is not a scalar", "every value in forward()'s dict must be a single number")
    assert _messages(name, lambda m: {"loss": m.to_tensor(np.ones(1)), "acc": np.float32(1)})[0] == \
        "forward() metric 'acc' is not a scalar"
    assert _messages(name, lambda m: {"lost": 1.0}) == (
        "forward() returned a dict without a 'loss' key (keys: ['lost'])",
        "return {'loss': loss, 'accuracy': acc, ...}")
    module = backends.load(name)
    loss, metrics = module._check_loss({"loss": module.to_tensor(np.full((1, 1), 2.0)), "n": 3}, "in evaluation")
    assert tuple(loss.shape) == () and float(loss) == 2.0 and float(metrics["n"]) == 3.0


def test_state_names_order():
    assert common.state_names({"a": 0, "b": 0}, ["steps"], ("exp_avg", "exp_avg_sq")) == [
        "a", "b", "steps", "optimizer/a/exp_avg", "optimizer/a/exp_avg_sq", "optimizer/b/exp_avg",
        "optimizer/b/exp_avg_sq"]
