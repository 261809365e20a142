"""Buffer reconciliation: members that each ran part of a step's micro-batches end with the buffers one
worker holds after running all of them in order (real torch BatchNorm layers, no distribution)."""
import numpy as np
import pytest
import torch

from elasticflow.backends.buffers import Reconciler, Rule
from elasticflow.data.order import deal


def _buffers(bn):
    return {k: v.detach().numpy().copy() for k, v in bn.named_buffers()}


def _rules(momentum):
    if momentum is None:
        stat = Rule("cma", counter="num_batches_tracked")
    else:
        stat = Rule("ema", momentum=momentum)
    return {"running_mean": stat, "running_var": stat, "num_batches_tracked": Rule("count")}


@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
@pytest.mark.parametrize("world", [2, 3, 5])
def test_members_reconcile_to_the_sequential_statistics(momentum, world):
    torch.manual_seed(0)
    batch, micro = torch.randn(37, 4) * 3 + 1, 5
    bn = torch.nn.BatchNorm1d(4, momentum=momentum)
    for _ in range(3):  # statistics that are not the initial ones
        bn(torch.randn(8, 4))
    start = _buffers(bn)

    sequential = torch.nn.BatchNorm1d(4, momentum=momentum)
    sequential.load_state_dict({k: torch.from_numpy(v) for k, v in start.items()}, strict=False)
    for a, b in deal((0, len(batch)), 0, 1, micro).micro:
        sequential(batch[a:b])

    parts, result = [], None
    for rank in range(world):
        member = torch.nn.BatchNorm1d(4, momentum=momentum)
        member.load_state_dict({k: torch.from_numpy(v) for k, v in start.items()}, strict=False)
        rec = Reconciler(_rules(momentum))
        rec.begin(_buffers(member))
        share = deal((0, len(batch)), rank, world, micro)
        for a, b in share.micro:
            member(batch[a:b])
        parts.append(rec.contribution(_buffers(member), share.first, len(share.micro), share.total, rank, world))
        result = rec
    reconciled = result.finish(np.sum(parts, axis=0))
    for name, expected in _buffers(sequential).items():
        np.testing.assert_allclose(reconciled[name], expected, rtol=1e-6, atol=1e-7, err_msg=name)


def test_unchanged_buffers_stay_bit_identical_and_integers_are_rank_zeros():
    rules = {"scale": Rule("mean"), "ids": Rule("first")}
    start = {"scale": np.full(3, 0.1, np.float32), "ids": np.arange(4)}
    rec = Reconciler(rules)
    rec.begin(start)
    members = [{"scale": start["scale"], "ids": start["ids"] + 7 * r} for r in range(3)]
    parts = [rec.contribution(m, r, 1, 3, r, 3) for r, m in enumerate(members)]
    out = rec.finish(np.sum(parts, axis=0))
    assert out["scale"].tobytes() == start["scale"].tobytes()  # (0.1 + 0.1 + 0.1) / 3 would not be
    assert out["ids"].tolist() == [0, 1, 2, 3] and out["ids"].dtype == start["ids"].dtype
