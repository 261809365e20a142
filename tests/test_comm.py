"""Group.share_state between real processes on loopback: what arrives, who takes part, a dying sender."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO

# Each rank runs this; rank 0 hosts the store. argv: rank world port mode
RANK = r"""
import datetime, hashlib, json, os, signal, sys, time
import numpy as np, torch
import torch.distributed as dist
from elasticflow.distributed.comm.comm import Group, SumByExchange
from elasticflow.distributed.protocol import CommError

rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=30))
group = Group(store, 0, rank, world, timeout_s=20)
# Every member has built its group before anyone dies, so a death tests the transfer, not the construction.
# Files, not the store: rank 0 hosts the store, and a rank still polling it would see it die instead.
built = os.path.join(os.path.dirname(os.path.abspath(__file__)), "built.%d")
open(built % rank, "w").close()
deadline = time.monotonic() + 60
while not all(os.path.exists(built % r) for r in range(world)) and time.monotonic() < deadline:
    time.sleep(0.005)
state = {"W": np.arange(600 * 1000, dtype=np.float32).reshape(600, 1000),   # 2.4 MB: its own message
         "b": np.linspace(0, 1, 7, dtype=np.float32), "steps": np.array(41, np.int64),
         "rng/torch": np.arange(256, dtype=np.uint8), "none": np.zeros((0, 3), np.float32),
         "strided": np.arange(40, dtype=np.float64).reshape(5, 8)[:, ::2]}   # not contiguous
out = {"rank": rank}
if mode.startswith("sum"):  # two sums in flight at once: a small one (exchanged among 3+) and a large one (ring)
    rows = [torch.from_numpy(np.random.default_rng(r).standard_normal(5000).astype(np.float32)) for r in range(world)]
    big = torch.full((300_000,), float(rank + 1))  # 1.2 MB: more than EXCHANGE_MAX
    if mode == "sum-kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        mine = rows[rank].clone()
        works = [group.allreduce_start(mine), group.allreduce_start(big)]
        for work in works:
            group.wait(work)
        expect = rows[0].clone()
        for r in range(1, world):
            expect = expect + rows[r]  # rank order
        out.update(exact=torch.equal(mine, expect), big=bool(torch.all(big == world * (world + 1) / 2)),
                   digest=hashlib.sha1(mine.numpy().tobytes()).hexdigest(), exchanged=isinstance(works[0], SumByExchange))
    except CommError as exc:
        out["error"] = str(exc)
    print(json.dumps(out), flush=True)
    os._exit(0)
if (mode == "kill" and rank == 0) or (mode == "kill-receiver" and rank == 2):
    os.kill(os.getpid(), signal.SIGKILL)   # the sender (or the receiver) dies before the transfer
try:
    if rank == 0:
        group.share_state(state, {"step": 12, "cursor": {"epoch": 1}}, 0, [2])
    elif rank == 2:
        got, meta = group.share_state({}, {}, 0, [2])
        out["meta"] = meta
        out["equal"] = sorted(got) == sorted(state) and all(
            got[k].dtype == state[k].dtype and got[k].shape == state[k].shape and np.array_equal(got[k], state[k])
            for k in state)
except CommError as exc:
    out["error"] = str(exc)
print(json.dumps(out), flush=True)
sys.stdout.flush()
os._exit(0)   # a process whose group failed may abort in gloo's destructors
"""


# The ranks are forked from one process that has imported what each imports (torch, the comm layer): a fresh
# interpreter per rank spent ~1.5 s of CPU on imports, 21 of them in this file. The launcher's zygote starts
# workers the same way (elasticflow/launchers/zygote.py). Each rank's stdout and stderr go to files of its
# own; the forking process prints {rank: exit code} (negative: the signal that ended it).
FORK = r"""
import json, os, sys, traceback
import numpy as np, torch, torch.distributed
import elasticflow.distributed.comm.comm, elasticflow.distributed.protocol
script, world, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
code = compile(open(script).read(), script, "exec")
pids = {}
for rank in range(world):
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, "out"), (2, "err")):
            os.dup2(os.open(f"{script}.{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [script, str(rank), str(world), port, mode]
        try:
            exec(code, {"__name__": "__main__", "__file__": script})
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(1)
    pids[rank] = pid
print(json.dumps({rank: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for rank, pid in pids.items()}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(tmp_path: Path, mode: str, world: int = 3) -> dict:
    script, fork = tmp_path / "rank.py", tmp_path / "fork.py"
    script.write_text(RANK)
    fork.write_text(FORK)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # its own process group, which the ranks share: one killpg reaps them all if the wait runs out
    proc = subprocess.Popen([sys.executable, str(fork), str(script), str(world), str(port), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"the forking process exited {proc.returncode}: {stderr[-2000:]}"
    codes = {int(r): code for r, code in json.loads(lines[-1]).items()}
    results = {}
    for r in range(world):
        out = Path(f"{script}.{r}.out").read_text()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        results[r] = json.loads(lines[-1]) if lines else {
            "returncode": codes[r], "stderr": Path(f"{script}.{r}.err").read_text()[-2000:]}
    return results


def test_share_state_reaches_the_receivers_exactly(tmp_path):
    res = _run_ranks(tmp_path, "ok")
    assert res[2].get("equal") is True, res
    assert res[2]["meta"] == {"step": 12, "cursor": {"epoch": 1}}
    assert "error" not in res[0] and "error" not in res[1]  # rank 1 holds the state already: no part in it


def test_a_sender_that_dies_is_a_comm_error_not_a_hang(tmp_path):
    res = _run_ranks(tmp_path, "kill")
    assert res[0].get("returncode") == -signal.SIGKILL
    assert "failed" in res[2].get("error", ""), res[2]
    assert "Timed out" not in res[2]["error"], res[2]  # the closed socket woke it, not the group's 20 s timeout


def test_a_receiver_that_dies_is_a_comm_error_for_the_sender(tmp_path):
    res = _run_ranks(tmp_path, "kill-receiver")
    assert res[2].get("returncode") == -signal.SIGKILL
    assert "failed" in res[0].get("error", ""), res[0]
    assert "Timed out" not in res[0]["error"], res[0]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_sum_is_the_rank_order_sum_on_every_member(tmp_path, world):
    """Among 3 or more members a small sum is exchanged point to point (SumByExchange) and added in rank
    order; 2 members use gloo's ring, whose sum of two is the same bits. A large sum in flight beside it."""
    res = _run_ranks(tmp_path, "sum", world)
    assert all(res[r].get("exact") and res[r].get("big") for r in range(world)), res
    assert len({res[r]["digest"] for r in range(world)}) == 1
    assert all(res[r]["exchanged"] == (world >= 3) for r in range(world)), res


def test_a_member_killed_before_an_exchanged_sum_is_a_comm_error(tmp_path):
    res = _run_ranks(tmp_path, "sum-kill", 3)
    assert res[1].get("returncode") == -signal.SIGKILL
    for r in (0, 2):
        assert "allreduce failed" in res[r].get("error", ""), res[r]
        assert "Timed out" not in res[r]["error"], res[r]  # the closed socket woke it, not the 20 s timeout


def test_gpu_point_to_point_pairs_the_same_tags_on_both_sides_as_nccl_matches_by_order():
    """NCCL ignores tags and matches a pair's messages by order: exchange posts each side's GPU messages in
    (peer, tag) order inside one NCCL group, so a sender listing its pieces in any order still pairs each with
    the receive of the same tag. (The NCCL calls themselves need a GPU: scripts/ops/gpu_check.sh.)"""
    from elasticflow.distributed.comm.comm import Group

    class Recorder:
        def __init__(self):
            self.calls = []

        # The signatures of torch's Backend (a bare ProcessGroupNCCL), checked below against the installed torch
        def _start_coalescing(self):
            self.calls.append("start")

        def _end_coalescing(self):
            self.calls.append("end")

        def send(self, tensors, peer, tag):
            self.calls.append(("send", peer, int(tensors[0][0])))

        def recv(self, tensors, peer, tag):
            self.calls.append(("recv", peer, int(tensors[0][0])))

    sides = []
    for _ in range(2):
        g = Group.__new__(Group)
        g.nccl, g.aborted = Recorder(), False
        g._nccl_done = lambda work, device: None  # the device sync: a GPU's
        sides.append(g)
    import torch

    tagged = {tag: torch.full((3,), float(tag)) for tag in (7, 2, 5)}  # each message carries its tag as its value
    sides[0]._nccl_exchange([(tagged[t], 1, t) for t in (7, 2, 5)], [(torch.zeros(1), 1, 9)], torch.device("cpu"))
    # The receiver lists its receives in another order; each buffer is marked with its tag to see the posting order
    sides[1]._nccl_exchange([(torch.full((1,), 9.0), 0, 9)], [(torch.full((3,), float(t)), 0, t) for t in (5, 7, 2)],
                            torch.device("cpu"))
    sent = [c[2] for c in sides[0].nccl.calls if c[0] == "send"]
    received = [c[2] for c in sides[1].nccl.calls if c[0] == "recv"]
    assert sides[0].nccl.calls[0] == "start" and sides[0].nccl.calls[-1] == "end"
    assert sent == received == [2, 5, 7]
    # The recorder's signatures are the real backend's: no device argument (ProcessGroup's own wrapper takes one)
    backend = torch._C._distributed_c10d.Backend
    assert "(self: torch._C._distributed_c10d.Backend) ->" in backend._start_coalescing.__doc__
    assert "(self: torch._C._distributed_c10d.Backend) ->" in backend._end_coalescing.__doc__
