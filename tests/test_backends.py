"""The backends as a family: every Engine keeps the one contract (backends/engine.py)."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from elasticflow import backends, optim
from elasticflow.backends.engine import Engine as Contract

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
            "state", "load_state", "state_names", "rng_state", "set_rng_state"} <= set(METHODS)
    assert ATTRIBUTES == ["num_params"]
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
