"""The backends as a family: packages of the same shape, every Engine keeps the one contract
(backends/engine.py) and the contract holds every member its callers use, forward()'s output is checked
with the same messages everywhere, and elasticflow.ops dispatches to the right one."""
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
PACKAGE = Path(backends.__file__).parent
ELASTICFLOW = PACKAGE.parent
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
            "state", "load_state", "state_names", "seed", "buffer_rules", "buffer_arrays", "set_buffers",
            "buckets", "arm", "fold_buffer", "flat_params", "params_written", "flat_layout", "flat_runs",
            "release_optimizer", "took_part"} <= set(METHODS)
    assert ATTRIBUTES == ["EXACT_SQRT", "compiling", "frozen_pages", "grad_scale", "num_params", "placement"]
    assert _problems(inspect.signature(Contract.state), inspect.signature(lambda self: None)) == [
        "no argument 'copy'"]
    assert _problems(inspect.signature(Contract.apply), inspect.signature(
        lambda self, lr=0.1, took_part=None, sat_out=None, extra=1: None)) == []
    assert _problems(inspect.signature(Contract.apply), inspect.signature(
        lambda self, rate, lr, took_part=None, sat_out=None: None)) == [
        "argument 'lr' is positional or keyword at position 2, expected positional or keyword at 1",
        "argument 'took_part' is positional or keyword at position 3, expected positional or keyword at 2",
        "argument 'sat_out' is positional or keyword at position 4, expected positional or keyword at 3",
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


def _two_layers(name):
    module = backends.load(name)
    model = {"a": np.ones((3, 2), np.float32), "b": np.full(2, 0.5, np.float32)}
    engine = module.Engine(model, lambda x, params: ops.mean(ops.square(x @ params["a"] + params["b"])), optim.SGD(0.1))
    return module, engine, (module.to_tensor(np.ones((4, 3), np.float32)),)


@pytest.mark.parametrize("name", BACKENDS)
def test_the_members_a_backend_has_no_use_for_are_harmless(name):
    """The no-op defaults callers rely on instead of probing: TensorFlow's ``arm`` never reports and its
    ``fold_buffer`` is None; torch's ``params_written`` leaves the model as written."""
    with ops.using(name):
        module, engine, batch = _two_layers(name)
        ranges = engine.buckets(1)
        assert ranges == [(6, 8), (0, 6)]  # the last parameters first, each bucket a whole parameter
        ready = []
        engine.arm(ranges, ready.append)
        engine.zero_grad()
        engine.accumulate(batch, 1.0)
        grad = engine.grad_view()
        engine.arm(ranges, None)
        fold = engine.fold_buffer(3)
        params = engine.flat_params()
        params[:6] = 2.0
        engine.params_written()
        written = engine.state()["a"]
    if name == "torch":
        assert sorted(ready) == [0, 1]  # each bucket as backward finished it
        assert fold.numel() == 8 + 3 and fold.data_ptr() == grad.data_ptr()  # the gradient's own memory
        assert engine.fold_buffer(10 ** 6) is None  # more than the room kept after the gradient
    else:
        assert ready == [] and fold is None
    np.testing.assert_array_equal(written, np.full((3, 2), 2.0, np.float32))


def _engine_uses(tree: ast.AST):
    """(line, member, probed) for every ``engine.X``/``<...>.engine.X`` in ``tree``; ``probed``: X is the
    string passed to hasattr/getattr on an engine (``hasattr(self.engine, "arm")``)."""
    def is_engine(node):
        return (isinstance(node, ast.Name) and node.id == "engine") or \
               (isinstance(node, ast.Attribute) and node.attr == "engine")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_engine(node.value):
            yield node.lineno, node.attr, False
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr") \
                and node.args and is_engine(node.args[0]):
            member = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
            yield node.lineno, member, True


def _callers():
    """elasticflow's modules outside the backends, parsed: the engine's callers."""
    for path in sorted(ELASTICFLOW.rglob("*.py")):
        if PACKAGE not in path.parents:
            yield path.relative_to(ELASTICFLOW.parent), ast.parse(path.read_text())


def test_the_contract_declares_every_member_its_callers_use():
    """What replica, shard, evaluation, checkpoints ... call on an engine is in the Protocol, so each backend
    must have it (the test above), and nobody asks an engine whether it has a member."""
    declared = set(METHODS) | set(ATTRIBUTES)
    undeclared, probes, used = [], [], set()
    for path, tree in _callers():
        for line, member, probed in _engine_uses(tree):
            used.add(member)
            if probed:
                probes.append(f"{path}:{line} probes the engine for {member!r}")
            elif member not in declared:
                undeclared.append(f"{path}:{line} uses engine.{member}, which backends/engine.py does not declare")
    assert not probes, "\n".join(probes) + "\ndeclare the member in backends/engine.py (a no-op where a backend has none)"
    assert not undeclared, "\n".join(undeclared)
    assert {"arm", "fold_buffer", "params_written", "flat_params", "accumulate"} <= used  # the scan sees the callers


def test_the_scan_finds_an_engine_probe():
    code = "def f(self, engine):\n    if hasattr(self.engine, 'arm'):\n        engine.undeclared()\n"
    assert list(_engine_uses(ast.parse(code))) == [(2, "arm", True), (3, "undeclared", False)]


def test_the_backends_have_the_same_shape():
    """Keras 3's backend/{torch,tensorflow}/: the same module names wherever a concern exists on both."""
    modules = {name: {p.stem for p in (PACKAGE / name).glob("*.py")} for name in BACKENDS}
    shared = {"__init__", "ops", "data", "devices", "native", "optim", "variables", "engine"}
    assert modules["torch"] - shared == {"device_pages"}  # torch's own: a GPU's vector for trainer.shard=parameters
    assert modules["tensorflow"] - shared == {"compiled", "quiet"}  # TensorFlow's own extras
    assert shared <= modules["torch"] and shared <= modules["tensorflow"]
    assert not [p.name for p in PACKAGE.glob("*.py") if p.stem in BACKENDS or p.stem.startswith(("torch_", "tensorflow_"))]


def _imported(path: Path, node: ast.stmt):
    """The absolute module names ``node`` in the file at ``path`` imports (a from-import: the module and
    each module.name)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    parts = list(path.relative_to(ELASTICFLOW.parent).with_suffix("").parts)
    package = parts[:-1] if node.level else []
    for _ in range(max(node.level - 1, 0)):
        package = package[:-1]
    base = ".".join(package + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


OPS = ("elasticflow.ops", "elasticflow.train.ops")  # elasticflow/ops.py names train/ops.py's module


def test_no_backend_imports_ops():
    """ops dispatches through backends.common; a backend importing ops back would be an import cycle.
    (A backend's own ``ops.py`` is not ``elasticflow.ops``.)"""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"{path.name}:{node.lineno}" for n in _imported(path, node)  # the public name or the module
                          if n in OPS or n.startswith(tuple(f"{o}." for o in OPS))]
    assert not found, f"imports of elasticflow.ops in a backend: {found}"
    own = ast.parse("from . import ops").body[0]
    assert _imported(PACKAGE / "torch" / "__init__.py", own) == ["elasticflow.backends.torch",
                                                                  "elasticflow.backends.torch.ops"]
    assert "elasticflow.ops" in _imported(PACKAGE / "torch" / "engine.py", ast.parse("from ... import ops").body[0])


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
        module.engine._check_loss(out(module), "for a micro-batch")
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
    assert _messages(name, lambda m: {"loss": m.to_tensor(np.ones(1)), "acc": np.ones(2, np.float32)})[0] == \
        "forward() metric 'acc' is not a scalar"
    assert _messages(name, lambda m: {"lost": 1.0}) == (
        "forward() returned a dict without a 'loss' key (keys: ['lost'])",
        "return {'loss': loss, 'accuracy': acc, ...}")
    module = backends.load(name)
    loss, metrics = module.engine._check_loss({"loss": module.to_tensor(np.full((1, 1), 2.0)), "n": 3}, "in evaluation")
    assert tuple(loss.shape) == () and float(loss) == 2.0 and float(metrics["n"]) == 3.0
    # numpy scalars are numbers too (a token count from np.count_nonzero, an np.float32 metric)
    _, metrics = module.engine._check_loss({"loss": module.to_tensor(np.ones(1)), "weight": np.int64(7),
                                            "acc": np.float32(0.5)}, "in evaluation")
    assert float(metrics["weight"]) == 7.0 and float(metrics["acc"]) == 0.5


def test_state_names_order():
    assert common.state_names({"a": 0, "b": 0}, ["steps"], ("exp_avg", "exp_avg_sq")) == [
        "a", "b", "steps", "optimizer/a/exp_avg", "optimizer/a/exp_avg_sq", "optimizer/b/exp_avg",
        "optimizer/b/exp_avg_sq"]
