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

        float32 tensors (nearly all the bytes) travel as one flat buffer: one packing copy on the
        sender, views on the receivers. The rest (RNG bytes, integer buffers) goes as safetensors
        (no pickle), and the names, shapes and ``meta`` as a JSON header.
        """
        from safetensors.numpy import load as st_load, save as st_save

        if self.rank == src:
            floats = {k: v for k, v in state.items() if v.dtype == np.float32}
            rest = st_save({k: np.ascontiguousarray(v) for k, v in state.items() if k not in floats})
            header = json.dumps({"meta": meta, "floats": [[k, list(v.shape)] for k, v in floats.items()],
                                 "rest_bytes": len(rest)}).encode()
            sizes = torch.tensor([len(header), sum(v.size for v in floats.values())], dtype=torch.int64)
        else:
            sizes = torch.zeros(2, dtype=torch.int64)
        self.broadcast_(sizes, src)
        header_t = (torch.frombuffer(bytearray(header), dtype=torch.uint8) if self.rank == src
                    else torch.empty(int(sizes[0]), dtype=torch.uint8))
        self.broadcast_(header_t, src)
        info = json.loads(header_t.numpy().tobytes())
        if self.rank == src:
            flat = torch.cat([torch.from_numpy(np.ascontiguousarray(v)).reshape(-1) for v in floats.values()]) \
                if floats else torch.empty(0)
            rest_t = torch.frombuffer(bytearray(rest), dtype=torch.uint8) if rest else torch.empty(0, dtype=torch.uint8)
        else:
            flat = torch.empty(int(sizes[1]), dtype=torch.float32)
            rest_t = torch.empty(info["rest_bytes"], dtype=torch.uint8)
        if flat.numel():
            self.broadcast_(flat, src)
        if rest_t.numel():
            self.broadcast_(rest_t, src)
        if self.rank == src:
            return state, meta
        out: Dict[str, np.ndarray] = st_load(rest_t.numpy().tobytes()) if rest_t.numel() else {}
        values, offset = flat.numpy(), 0
        for name, shape in info["floats"]:
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = values[offset:offset + n].reshape(shape)
            offset += n
        return out, info["meta"]
