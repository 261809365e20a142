"""Fault-tolerant collectives: one gloo process group per membership generation (plus an NCCL one for
GPU tensors with ``comm.backend=nccl``).

The group is built directly as ``ProcessGroupGloo(PrefixStore(f"gen{g}/", store), rank, world, opts)``:
``init_process_group``/``new_group`` are process-global and cannot grow. Every call has an explicit
timeout (gloo's default is 30 minutes). A failed call raises :class:`CommError`; the caller drops the
group (closing its sockets wakes peers blocked on us) and rebuilds with the next generation.
"""
from __future__ import annotations

import datetime
import json
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from ..._util import affinity, links
from ..._util.fileio import aligned
from . import hierarchy, nccl as nccl_errors
from ..protocol import CommError

BIG = 1 << 20  # bytes: a tensor this large travels as its own message in share_state, without a copy
# A sum of at most this many bytes among 3 or more members is a direct exchange (SumByExchange), not gloo's
# ring: one round of messages instead of the ring's 2 x (W - 1), each a wake-up of every member's threads,
# which with 4 workers on 2 cores more than halved the digits MLP's step. Not for 2 members: there the ring
# was as fast or faster. The figures: docs/benchmarks.md ("Multi-worker throughput") and the A/B in
# docs/benchmarks/history.md ("The point-to-point sum").
EXCHANGE_MAX = 1 << 20
EXCHANGE_MIN_WORLD = 3
SUM_TAG = 1 << 24  # point-to-point tags from here on are the exchanged sums' (share_state counts from 0)


class Group:
    """The collectives of one generation. Not reusable after a CommError: build the next one.

    Args:
        nccl_device: with ``comm.backend=nccl``, this worker's GPU ("cuda:N"): GPU tensors are then reduced by an
            NCCL group of the same generation (host tensors, and the state transfer, stay on gloo).
        group_tag: with ``topology=hierarchical``, this worker's group (its host, node or realm): sums then go
            through the groups' leaders (hierarchy.py).
        superseded: asked once before the build: True if a newer generation was published meanwhile (CommError).
    """

    def __init__(self, store, generation: int, rank: int, world: int, timeout_s: float, host: str = "127.0.0.1",
                 nccl_device: Optional[str] = None, group_tag: Optional[str] = None,
                 superseded: Optional[Callable[[], bool]] = None):
        self.generation, self.rank, self.world, self.timeout_s = generation, rank, world, timeout_s
        self._stage = None  # allreduce_'s pinned host buffer for GPU tensors
        self._sums = 0  # sums started by exchange: their tags
        self.nccl = None
        self.aborted = False
        self.cut = False  # its links were cut: the agent declared a member gone (cut_links)
        self.links: Set[int] = set()  # the TCP connections its construction opened (set by the caller)
        self.members: List[int] = []  # the generation's members by id (set by the caller)
        self.unsent: List[Any] = []  # the newest SumByExchange's sends, waited for by the next one (or close)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        # gloo's threads start here (the device's transport loop, the group's run loops), with the mask of
        # this thread: not on the training thread's cores (backend.pin_cores)
        self.hierarchy = None
        # A member late to its group's build (stopped, slow) whose generation was superseded meanwhile would
        # connect to peers that have left, and retry until the timeout: it goes to the next generation now.
        if superseded is not None and superseded():
            raise CommError(f"generation {generation} was superseded before this member built its group")
        with affinity.unpinned():
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            try:
                self.pg = dist.ProcessGroupGloo(PrefixStore(f"gen{generation}/", store), rank, world, opts)
                self.hierarchy = hierarchy.build(self.pg, store, generation, rank, world, group_tag, opts)
            except Exception as exc:  # a member died or never arrived while the group was forming
                raise CommError(f"building the group of generation {generation} failed: {exc}") from exc
        if nccl_device is not None and world > 1:
            # An NCCL error must raise here, not end the process: read by the constructor (nccl.py says why).
            # The worker's main set it before any thread started; this is a no-op then, a net for other callers.
            nccl_errors.environment()
            self.nccl = dist.ProcessGroupNCCL(PrefixStore(f"gen{generation}/nccl/", store), rank, world,
                                              nccl_errors.options(timeout_s))
            # The communicator made now (ncclCommInitRank, ~0.1-1 s), by every member: made lazily, at the first
            # NCCL call, it needs every member in that call, and sharded state's first call may be point to point
            # between some of them (a roll forward, a range's move) while the rest wait in a gloo collective.
            try:
                self.nccl.eager_connect_single_device(torch.device(nccl_device))
            except Exception as exc:
                self.nccl = None
                raise CommError(f"connecting the NCCL group of generation {generation} failed: {exc}") from exc

    def close(self, flush: bool = True) -> None:
        """Close the group (dropping the last reference destroys the gloo context and closes its sockets).
        ``flush``: first let the newest sum's sends finish, so no peer loses this member's last row (not after
        a failure: the peer may be the dead one)."""
        if flush and self.pg is not None:
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - a peer died meanwhile: it fails its own step, as it would anyway
                pass
        self.unsent = []
        if self.hierarchy is not None:
            self.hierarchy.close()
        self.pg = self.hierarchy = None
        if self.nccl is not None:
            self.abort()
            self.nccl = None

    def abort(self) -> None:
        """Abort the NCCL communicator: a collective spinning on the GPU for a dead peer returns, and the
        waiting call raises CommError. Safe from another thread (the membership poller calls it when
        the agent publishes a generation without a member of this one)."""
        nccl = self.nccl
        if nccl is not None and not self.aborted:
            self.aborted = True
            try:
                nccl.abort()  # ncclCommAbort; torchft found it reliable enough with a timeout behind it
            except Exception:
                pass

    def cut_links(self) -> None:
        """The agent declared a member of this generation gone: shut down this member's connections of the
        group, so a collective waiting on a silent peer (a host powered off or cut off) fails now, not at the
        group's timeout, and nothing a healed peer sends later lands in a buffer (_util/links.py). Safe from
        another thread (the membership poller calls it). The next generation builds a group of its own."""
        if self.cut:
            return
        self.cut = True
        links.cut(self.links)
        self.abort()

    def _run(self, what: str, fn):
        if self.pg is None:
            raise CommError(f"{what} on a closed group (generation {self.generation})")
        try:
            return fn()
        except Exception as exc:
            self.close(flush=False)
            why = " (links cut: the agent declared a member gone)" if self.cut else ""
            raise CommError(f"{what} failed in generation {self.generation}: {gloo_text(exc)}{why}") from exc

    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce of one tensor (pass one flat buffer, not many small ones).

        A GPU tensor travels through a pinned host buffer (gloo reduces host memory): one copy down, the
        reduction, one copy up, queued behind the tensor's producers on its stream.
        """
        if self.world == 1:
            return tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        if tensor.is_cuda and self.nccl is not None:
            self._run("allreduce", lambda: self._nccl_allreduce(tensor, opts))
            return tensor
        host = self._staged(tensor) if tensor.is_cuda else tensor
        if self.hierarchy is not None and op == "sum":
            self._run("allreduce", lambda: self.hierarchy.start_sum(host).wait())
        else:
            self._run("allreduce", lambda: self.pg.allreduce([host], opts).wait())
        if host is not tensor:
            tensor.copy_(host, non_blocking=True)  # the next step's copy down waits for it on the same stream
        return tensor

    def allreduce_start(self, tensor: torch.Tensor) -> Any:
        """Start a sum-allreduce of a host tensor in place and return its work, for :meth:`wait`. The
        members must start the same allreduces in the same order (gloo matches them by sequence).

        Among ``EXCHANGE_MIN_WORLD`` or more members a host tensor of at most ``EXCHANGE_MAX`` bytes is
        summed by :class:`SumByExchange`: one round of messages rather than gloo's ring of 2 x (world - 1).
        """
        if self.hierarchy is not None:  # the groups' leaders carry it across (hierarchy.py)
            return self._run("allreduce", lambda: self.hierarchy.start_sum(tensor))
        small = tensor.numel() * tensor.element_size() <= EXCHANGE_MAX
        if self.world >= EXCHANGE_MIN_WORLD and small and not tensor.is_cuda:  # gloo's send/recv take host memory
            self._sums += 1  # the members start the same sums in the same order: the tags agree
            tag = SUM_TAG + self._sums % SUM_TAG
            return self._run("allreduce", lambda: SumByExchange(self, tensor, tag))
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self._run("allreduce", lambda: self.pg.allreduce([tensor], opts))

    def wait(self, work: Any) -> None:
        """Wait for a started collective (the group's timeout bounds it); CommError if it failed."""
        self._run("allreduce", work.wait)

    def flush(self) -> None:
        """Wait for the sends of the newest SumByExchange (already complete, but for the last sum of a run)."""
        unsent, self.unsent = self.unsent, []
        for work in unsent:
            work.wait()

    # -- sharded state (trainer.shard): equal chunks of a flat vector, the last one padded
    def allgather_flat(self, flat: torch.Tensor, chunk: int) -> None:
        """Every member's chunk ``flat[r*chunk:(r+1)*chunk]`` to every member, in place (host tensors).

        Point to point, each chunk sent from where it lies and received where it belongs, all posted at
        once: gloo's allgather allocates a whole-vector output every call and copies out of it (for a
        100 MB model that was half the extra cost of a sharded step); here no copy and no allocation.
        """
        n = flat.numel()

        def part(r: int) -> torch.Tensor:
            return flat[min(r * chunk, n):min((r + 1) * chunk, n)]

        peers = [r for r in range(self.world) if r != self.rank]
        self.exchange([(part(self.rank), r, 0) for r in peers], [(part(r), r, 0) for r in peers])

    def reduce_scatter_start(self, pieces: Sequence[torch.Tensor], out: torch.Tensor) -> Any:
        """Start the sum of ``pieces[r]`` over the members into rank r's ``out`` (pieces of one size);
        returns the work, for :meth:`wait`. GPU tensors: NCCL's reduce-scatter, or through host copies."""
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        if out.is_cuda and self.nccl is not None:
            work = self._run("reduce_scatter", lambda: self.nccl.reduce_scatter([out], [list(pieces)], opts))
            return _Finished(lambda: self._nccl_done(work, out.device))
        if out.is_cuda:  # no NCCL group: gloo reduces host copies (a sync point), the sum goes back at wait
            host_out = torch.empty(out.shape, dtype=out.dtype)
            work = self._run("reduce_scatter", lambda: self.pg.reduce_scatter([host_out], [[p.cpu() for p in pieces]],
                                                                              opts))
            return _Finished(lambda: (work.wait(), out.copy_(host_out)))
        return self._run("reduce_scatter", lambda: self.pg.reduce_scatter([out], [list(pieces)], opts))

    def exchange(self, sends: Sequence[Tuple[torch.Tensor, int, int]],
                 recvs: Sequence[Tuple[torch.Tensor, int, int]]) -> None:
        """Point to point: every (tensor, peer, tag) of ``sends`` to its peer, every one of ``recvs`` from
        its peer, all posted at once and then waited for. Only the members named take part.

        GPU tensors go by NCCL where the group has one (``_nccl_exchange``), else through host copies; host
        tensors by gloo. A member's sends and its peer's receives must name the same GPU tensors' tags."""
        on_gpu = [t for t, _, _ in [*sends, *recvs] if t.is_cuda and t.numel()]
        if on_gpu and self.nccl is None:
            self._staged_exchange(sends, recvs)
            return
        host_sends = [m for m in sends if not m[0].is_cuda]
        host_recvs = [m for m in recvs if not m[0].is_cuda]
        works = [self._run("send", lambda t=t, r=r, tag=tag: self.pg.send([t], r, tag)) for t, r, tag in host_sends
                 if t.numel()]
        works += [self._run("receive", lambda t=t, r=r, tag=tag: self.pg.recv([t], r, tag))
                  for t, r, tag in host_recvs if t.numel()]
        if on_gpu:
            self._run("exchange", lambda: self._nccl_exchange([m for m in sends if m[0].is_cuda],
                                                              [m for m in recvs if m[0].is_cuda], on_gpu[0].device))
        for work in works:
            self._run("exchange", work.wait)

    def _nccl_exchange(self, sends: Sequence[Tuple[torch.Tensor, int, int]],
                       recvs: Sequence[Tuple[torch.Tensor, int, int]], device: torch.device) -> None:
        """GPU tensors point to point, posted as one NCCL group (ncclGroupStart/End: a pair that sends to each
        other does not deadlock). NCCL matches a pair's messages by their order, not by tag: both sides post
        them in (peer, tag) order, which pairs the same tags, as gloo would."""
        self.nccl._start_coalescing()  # the backend's own (the ProcessGroup wrapper's takes a device)
        for t, r, _ in sorted([m for m in sends if m[0].numel()], key=lambda m: (m[1], m[2])):
            self.nccl.send([t], r, 0)
        for t, r, _ in sorted([m for m in recvs if m[0].numel()], key=lambda m: (m[1], m[2])):
            self.nccl.recv([t], r, 0)
        self._nccl_done(self.nccl._end_coalescing(), device)

    def _staged_exchange(self, sends: Sequence[Tuple[torch.Tensor, int, int]],
                         recvs: Sequence[Tuple[torch.Tensor, int, int]]) -> None:
        """``exchange`` of GPU tensors without an NCCL group: host copies through gloo (sync points)."""
        host_recvs = [(torch.empty(t.shape, dtype=t.dtype) if t.is_cuda else t, r, tag) for t, r, tag in recvs]
        down: Dict[Tuple[int, int, Any], torch.Tensor] = {}  # one copy of a range sent to several peers (allgather)

        def host(t: torch.Tensor) -> torch.Tensor:
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in down:
                down[key] = t.cpu()
            return down[key]

        self.exchange([(host(t), r, tag) for t, r, tag in sends], host_recvs)
        for (t, _, _), (h, _, _) in zip(recvs, host_recvs):
            if h is not t:
                t.copy_(h)

    def _nccl_done(self, work: Any, device: torch.device) -> None:
        """Wait for an NCCL operation, at most the group's timeout, then for the device: a peer's death, a
        timeout or the abort the membership poller makes raises here (nccl.finish), not at some later sync point."""
        nccl_errors.finish(work, device, self.timeout_s, lambda: self.aborted)

    def _nccl_allreduce(self, tensor: torch.Tensor, opts) -> None:
        self._nccl_done(self.nccl.allreduce([tensor], opts), tensor.device)

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in a pinned host buffer, reused while the size fits (a sync point)."""
        n = tensor.numel()
        if self._stage is None or self._stage.dtype != tensor.dtype or self._stage.numel() < n:
            self._stage = torch.empty(n, dtype=tensor.dtype, pin_memory=True)
        host = self._stage[:n].view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        return host

    def share_state(self, state: Dict[str, np.ndarray], meta: dict, src: int,
                    receivers: Sequence[int]) -> Tuple[Dict[str, np.ndarray], dict]:
        """Send ``state`` and ``meta`` from rank ``src`` to the ``receivers`` only; returns what src sent.

        Called by src and by every receiver (the other members need not take part, so a member that
        already holds the state does not pay for the bytes). Point to point rather than a broadcast:
        a join then moves the model once, not once per member. Tensors of ``BIG`` bytes or more go
        as they are, without a packing copy; the small ones are packed into one buffer, so a model
        of many small tensors costs a few messages, not one each. Names, dtypes, shapes and ``meta``
        travel as a JSON header (no pickle).

        Note: src's arrays must not change until this returns (``engine.state(copy=False)`` views
        do not: nothing trains meanwhile).
        """
        if self.rank != src and self.rank not in receivers:
            raise ValueError(f"rank {self.rank} is neither the sender {src} nor a receiver {list(receivers)}")
        if self.rank == src:
            arrays = {k: np.asarray(v, order="C") for k, v in state.items()}  # not ascontiguousarray: 0-d stays 0-d
            small = [k for k, v in arrays.items() if v.nbytes < BIG]
            # Each packed tensor starts aligned, so the receiver views it as its dtype without a copy.
            offsets = np.cumsum([0] + [aligned(arrays[k].nbytes) for k in small]).tolist()
            packed = np.empty(offsets[-1], np.uint8)
            for k, at in zip(small, offsets):
                packed[at:at + arrays[k].nbytes] = arrays[k].reshape(-1).view(np.uint8)
            header = json.dumps({"meta": meta, "packed": len(packed),
                                 "tensors": [[k, v.dtype.str, list(v.shape), v.nbytes >= BIG]
                                             for k, v in arrays.items()]}).encode()
            messages = [torch.tensor([len(header)], dtype=torch.int64),
                        torch.frombuffer(bytearray(header), dtype=torch.uint8), torch.from_numpy(packed)]
            messages += [_bytes(v) for v in arrays.values() if v.nbytes >= BIG]
            # Every send at once: gloo moves them in the background, to all receivers in parallel.
            works = [self._run("send", lambda t=t, r=r, tag=tag: self.pg.send([t], r, tag))
                     for r in receivers for tag, t in enumerate(messages) if t.numel()]
            for work in works:
                self._run("send", work.wait)
            return state, meta
        size = self._recv(torch.zeros(1, dtype=torch.int64), src, 0)
        info = json.loads(self._recv(torch.empty(int(size[0]), dtype=torch.uint8), src, 1).numpy().tobytes())
        packed = self._recv(torch.empty(info["packed"], dtype=torch.uint8), src, 2).numpy()
        out: Dict[str, np.ndarray] = {}
        at, tag = 0, 3
        for name, dtype, shape, big in info["tensors"]:
            dt = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if big:
                raw = self._recv(torch.empty(nbytes, dtype=torch.uint8), src, tag).numpy()
                tag += 1
            else:
                raw = packed[at:at + nbytes]
                at += aligned(nbytes)
            out[name] = raw.view(dt).reshape(shape)
        return out, info["meta"]

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        if tensor.numel():
            self._run("receive", lambda: self.pg.recv([tensor], src, tag).wait())
        return tensor


def gloo_text(exc: BaseException) -> str:
    """gloo's error as one short line of ours: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer
    [127.0.0.1]:3302. This is typically caused by a remote worker crashing. Check the logs ... GLHF! 🏖️" becomes
    "Connection closed by peer [127.0.0.1]:3302 (gloo pair.cc:553)"."""
    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    where = ""
    if text.startswith("[") and "] " in text:
        source, text = text[1:].split("] ", 1)
        where = f" (gloo {source.rsplit('/', 1)[-1]})"
    text = text.split(" This is typically caused", 1)[0].rstrip(". ")
    return text[:240] + where


def _bytes(array: np.ndarray) -> torch.Tensor:
    """A contiguous array's bytes as a uint8 tensor, without a copy."""
    return torch.from_numpy(array.reshape(-1).view(np.uint8))


class _Finished:
    """A started GPU collective, for :meth:`Group.wait`: ``wait`` runs what completes it."""

    def __init__(self, finish: Callable[[], Any]):
        self.finish = finish

    def wait(self) -> None:
        self.finish()


class SumByExchange:
    """A host tensor summed over the members in place by sending it to every other member and adding what
    they send: one round of messages, all in flight at once (gloo's ring allreduce takes 2 x (world - 1)
    rounds in turn, each a wake-up of the members' threads; with more processes than cores and a small
    tensor those rounds are the whole cost). Every member adds the rows in rank order,
    ``((t0 + t1) + t2) + ...``, so every member holds the same bits.

    Costs (world - 1) x the tensor's bytes each way, the ring 2 x (world - 1) / world: small tensors only.
    Started by :meth:`Group.allreduce_start`; :meth:`Group.wait` finishes it.
    """

    def __init__(self, group: Group, tensor: torch.Tensor, tag: int):
        self.group, self.tensor, self.rank = group, tensor, group.rank
        peers = [r for r in range(group.world) if r != group.rank]
        self.rows = {r: torch.empty_like(tensor) for r in peers}
        # The receives first: a message whose receive is already posted is read straight into its row.
        self.receives = [group.pg.recv([self.rows[r]], r, tag) for r in peers]
        # Sent from a copy, so the sum can land in ``tensor`` while the sends are still in flight.
        self.sent = tensor.clone()
        self.sends = [group.pg.send([self.sent], r, tag) for r in peers]

    def wait(self) -> None:
        """The sum, once every peer's row is in. This member's own sends are not waited for here: the next
        sum (or ``Group.close``) does, after its receives, when every peer has long received them (a peer
        sends its next row only after this one's). Waiting for them here once made a survivor wait out gloo's
        whole timeout on a send to a SIGKILLed peer whose closed socket never failed it, holding up the
        other survivor's recovery (tests/test_elastic.py, 1 run in 8 under load)."""
        for work in self.receives:
            work.wait()  # no timeout given: gloo's, the group's, bounds each
        self.group.flush()
        self.group.unsent = self.sends
        own, rows = self.tensor, self.rows
        acc = rows[0] if self.rank != 0 else own
        for r in range(1, len(rows) + 1):
            term = own if r == self.rank else rows[r]
            out = own if r >= self.rank else acc  # from this member's own row on, add where the sum ends
            torch.add(acc, term, out=out)
            acc = out
