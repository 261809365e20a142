"""tests/models/digits_probe.py with SIGKILLs that land inside a phase of a sharded step, for
tests/test_shard_kill.py and scripts/soak/soak_shard_kill.py (trainer.shard=optimizer).

Environment (read by every worker; the victim's rank and the step are generation 0's):
    EF_SHARD_KILL  "rank:step:phase[:peer][,...]": that rank SIGKILLs itself inside that phase of that step:
        reduction  in the gradient's sum (comm.SumByExchange, the digits MLP's small gradient among 3 or more
                   members): it receives every peer's gradient, sends its own to ``peer`` only (no peer: to
                   nobody), waits until that send is out, and dies. ``peer`` then completes the sum and
                   commits the step; the others fail in it, one step behind.
        update     in the update of its ranges (shard.FlatUpdate): after the first range, before the second.
        exchange   in the parameters' allgather (comm.Group.allgather_flat): as in reduction, with its owned
                   range: ``peer`` completes the allgather and goes on to the next step, the others fail in it.
Every other EF_PROBE_* variable works as in digits_probe.
"""
import os
import signal
import sys
from pathlib import Path

import elasticflow
from elasticflow.replica import shard
from elasticflow.distributed.comm import comm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_probe import data, eval_data, forward, model  # noqa: E402,F401

KILLS = {}  # (rank, step) -> (phase, peer or None)
for spec in filter(None, os.environ.get("EF_SHARD_KILL", "").split(",")):
    rank, step, phase, *peer = spec.split(":")
    KILLS[(int(rank), int(step))] = (phase, int(peer[0]) if peer else None)
_calls = {}  # phase -> calls seen in the victim's step


def _due(phase):
    """Whether this worker dies in ``phase`` now, and the peer it still sends to (a call count for update)."""
    ctx = elasticflow.context()
    kill = KILLS.get((ctx.rank, ctx.step))
    if ctx.generation != 0 or kill is None or kill[0] != phase:
        return False, None
    _calls[phase] = _calls.get(phase, 0) + 1
    return True, kill[1]


def _die():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _send_only(group, tensor, peer, tag, incoming):
    """Receive every surviving peer's message of ``tag`` (``incoming``: a buffer by peer; so their sends
    complete; a peer dying at this step too never sends), then send ``tensor`` to ``peer`` alone and die
    once it is out: the others wait for it in vain."""
    ctx = elasticflow.context()
    dying = {rank for rank, step in KILLS if step == ctx.step}
    try:
        for work in [group.pg.recv([buf], r, tag) for r, buf in incoming.items() if buf.numel() and r not in dying]:
            work.wait()
        if peer is not None:
            group.pg.send([tensor], peer, tag).wait()
    finally:
        _die()


_sum_init = comm.SumByExchange.__init__


def _dying_sum(self, group, tensor, tag):
    due, peer = _due("reduction")
    if due and _calls["reduction"] == 1:  # the step's first sum is the gradient's
        _send_only(group, tensor, peer, tag, {r: tensor.clone() for r in range(group.world) if r != group.rank})
    _sum_init(self, group, tensor, tag)


_gather = comm.Group.allgather_flat


def _dying_gather(self, flat, chunk):
    due, peer = _due("exchange")
    if due:
        n = flat.numel()
        part = {r: flat[min(r * chunk, n):min((r + 1) * chunk, n)] for r in range(self.world)}
        _send_only(self, part[self.rank], peer, 0, {r: t.clone() for r, t in part.items() if r != self.rank})
    _gather(self, flat, chunk)


_update = shard.FlatUpdate.__call__


def _dying_update(self, *args, **kwargs):
    due, _ = _due("update")
    if due and _calls["update"] == 2:  # one range updated, the next not
        _die()
    _update(self, *args, **kwargs)


comm.SumByExchange.__init__ = _dying_sum
comm.Group.allgather_flat = _dying_gather
shard.FlatUpdate.__call__ = _dying_update
