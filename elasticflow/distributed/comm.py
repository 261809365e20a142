"""Fault-tolerant collectives: one gloo process group per membership generation.

The group is built directly as ``ProcessGroupGloo(PrefixStore(f"gen{g}/", store), rank, world, opts)``:
``init_process_group``/``new_group`` are process-global and cannot grow. Every call has an explicit
timeout (gloo's default is 30 minutes). A failed call raises :class:`CommError`; the caller drops the
group (closing its sockets wakes peers blocked on us) and rebuilds with the next generation.
"""
from __future__ import annotations

import datetime
import json
from typing import Dict, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from .protocol import CommError


class Group:
    """The collectives of one generation. Not reusable after a CommError: build the next one."""

    def __init__(self, store, generation: int, rank: int, world: int, timeout_s: float, host: str = "127.0.0.1"):
        self.generation, self.rank, self.world = generation, rank, world
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        try:
            self.pg = dist.ProcessGroupGloo(PrefixStore(f"gen{generation}/", store), rank, world, opts)
        except Exception as exc:  # a member died or never arrived while the group was forming
            raise CommError(f"building the group of generation {generation} failed: {exc}") from exc

    def close(self) -> None:
        # Dropping the last reference destroys the gloo context and closes its sockets.
        self.pg = None

    def _run(self, what: str, fn):
        if self.pg is None:
            raise CommError(f"{what} on a closed group (generation {self.generation})")
        try:
            return fn()
        except Exception as exc:
            self.close()
            raise CommError(f"{what} failed in generation {self.generation}: {str(exc).splitlines()[0][:300]}") from exc

    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce of one tensor (pass one flat buffer, not many small ones)."""
        if self.world == 1:
            return tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        self._run("allreduce", lambda: self.pg.allreduce([tensor], opts).wait())
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.world == 1:
            return tensor
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._run("broadcast", lambda: self.pg.broadcast([tensor], opts).wait())
        return tensor

    def broadcast_state(self, state: Dict[str, np.ndarray], meta: dict, src: int) -> Tuple[Dict[str, np.ndarray], dict]:
        """Send ``state`` and ``meta`` from rank ``src`` to every member; returns what src sent.

        One length broadcast and one byte broadcast: safetensors (no pickle) with meta as JSON.
        """
        from safetensors.numpy import load as st_load, save as st_save

        if self.rank == src:
            payload = st_save({k: np.ascontiguousarray(v) for k, v in state.items()},
                              metadata={"meta": json.dumps(meta)})
            length = torch.tensor([len(payload)], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.broadcast_(length, src)
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == src
               else torch.empty(int(length.item()), dtype=torch.uint8))
        self.broadcast_(buf, src)
        if self.rank == src:
            return state, meta
        raw = buf.numpy().tobytes()
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + header_len])
        return st_load(raw), json.loads(header["__metadata__"]["meta"])
