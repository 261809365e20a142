"""A model's parameters as the torch ``Engine`` holds them: views of flat float32 vectors, read and written by name.

Gradients accumulate into one flat buffer (each parameter's ``.grad`` is a view of it), so a distributed
reduction is a single call on one tensor and zeroing is one ``zero_()``; the parameters are views of another,
so the optimizer's update is a few calls over the whole model (``optim.py``). With ``paged=True``
(trainer.shard=parameters) both vectors, and the float32 frozen parameters, live in memory whose pages can be
given back (``_util/pages.py`` on a host, ``device_pages.py`` on a GPU).

The same module name as ``backends/tensorflow/variables.py``, which does this for TF variables (which cannot be
views of one buffer: there, a dict model's arrays live in one flat variable instead).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from ...config import optim
from ...config.optim import OptimizerSpec
from ...errors import ElasticFlowError
from ..buffers import Rule
from ..common import flatten, rebuild
from . import native
from .data import to_tensor

FOLD_SCALARS = 64  # room after the flat gradient for the step's loss, metrics and votes (fold_buffer)


class Variables:
    """The parameters, buffers and frozen parameters of one model, in the flat order, on one device.

    Args:
        model: what ``model(cfg)`` returned, without the "optimizer" key: a (nested) dict of
            arrays/tensors, or a ``torch.nn.Module``.
        spec: the optimizer spec; its groups (``optimizer.groups``/``no_decay``) set the flat order.
        device: where the parameters, the flat gradient and the buffers live (in float32).
        paged: trainer.shard=parameters: the flat vectors in memory whose pages can be given back.

    ``params`` (trainable, in the flat order: each group contiguous), ``frozen`` (``requires_grad=False``),
    ``buffers``: by name. ``sizes`` and ``runs``: per parameter, and each group's stretch of the flat order.
    ``flat_param``/``flat_grad``: the vectors the parameters and their ``.grad`` are views of. ``view``:
    what forward() receives as ``params``.
    """

    def __init__(self, model: Any, spec: OptimizerSpec, device: torch.device, paged: bool = False):
        self.device = device
        self.module: Optional[torch.nn.Module] = None
        self.frozen: Dict[str, torch.Tensor] = {}  # requires_grad=False: state, never trained (torch.optim's skip)
        owners: Dict[str, str] = {}
        if isinstance(model, torch.nn.Module) or native.modules_only(model):
            # {"net": module, ...} (what model() returned beside its optimizer): one ModuleDict to train,
            # while forward() receives the dict as it was returned.
            own = native.unwrapped(model)  # torch.compile's wrapper: state under the module's own names
            self.module = (own if isinstance(own, torch.nn.Module) else torch.nn.ModuleDict(own)).to(device)
            named = dict(self.module.named_parameters())
            self.frozen = {n: p for n, p in named.items() if not p.requires_grad}
            self.params = {n: p for n, p in named.items() if p.requires_grad}
            self.buffers = dict(self.module.named_buffers())
            owners = native.owners(self.module)
            self.view = model
        else:
            leaves: Dict[str, torch.Tensor] = {}
            self.params, self.buffers = {}, {}
            for name, value in flatten(model):
                t = value.detach().clone() if isinstance(value, torch.Tensor) else to_tensor(np.array(value))
                t = t.to(device)
                if t.is_floating_point():
                    t = t.to(torch.float32).requires_grad_(True)
                    self.params[name] = t
                else:
                    self.buffers[name] = t
                leaves[name] = t
            self.view = rebuild(model, leaves)
        if not self.params:
            raise ElasticFlowError("model() returned no floating-point parameters to train" +
                                   (" (every parameter has requires_grad=False)" if self.frozen else ""),
                                   "return a dict of float arrays, e.g. {'W': np.zeros((64, 10), np.float32)}, "
                                   "or leave some parameters trainable")
        # Parameter groups: parameters of equal hyperparameters sit next to each other in the flat
        # buffers, so the update runs once per group instead of once per tensor (optim.grouped_order).
        identity = {id(p): n for n, p in {**self.frozen, **self.params}.items()}
        hyper = optim.hypers(spec, list(self.params), owners, identity)
        self.params = {n: self.params[n] for n in optim.grouped_order(list(self.params), hyper)}
        self.sizes = [p.numel() for p in self.params.values()]
        self.runs = optim.runs(list(self.params), self.sizes, hyper)
        # What state() holds: the module's state_dict names (non-persistent buffers such as position ids
        # are rebuilt by the module, not state), frozen parameters included.
        self._stateful = set(self.module.state_dict()) if self.module is not None else None
        self.num_params = int(np.sum(self.sizes))
        # The flat gradient is the head of a longer buffer: the replica writes the step's scalars and
        # buffer contributions after it and reduces both in one in-place allreduce (fold_buffer), instead
        # of copying the gradient into a concatenation and back every step.
        # trainer.shard=parameters: in pages given back as each unit's gradient is reduced (param_units.py), and
        # by zero_grad (no whole gradient written each step)
        self.grad_pages = self._paged(self.num_params + self._fold_room()) if paged else None
        self._fold = torch.zeros(self.num_params + self._fold_room(), dtype=torch.float32, device=device) \
            if self.grad_pages is None else self.grad_pages.tensor
        self.flat_grad = self._fold[:self.num_params]
        # Parameters become views of one flat buffer too, so the optimizer runs once over the model
        # (optim.py). A copy of the model's values at start-up; the Parameter objects stay
        # the module's own, only their storage moves (as .data, which autograd allows on leaves).
        # trainer.shard=parameters: in memory whose pages can be given back (page_params), from the start: a copy
        # later would hold the whole vector twice for a moment.
        self.paged = self._paged(self.num_params) if paged else None
        self.flat_param = torch.empty(self.num_params, dtype=torch.float32, device=device) \
            if self.paged is None else self.paged.tensor
        offset = 0
        for p in self.params.values():
            n = p.numel()
            view = self.flat_param[offset:offset + n].view_as(p)
            view.copy_(p.detach())
            p.data = view
            p.grad = self.flat_grad[offset:offset + n].view_as(p)
            offset += n
        if self.paged is not None and device.type == "cuda":
            # The module's own parameters were just freed into torch's cache; the device vector's granules come
            # from the driver (device_pages.py), which cannot use those cached blocks
            torch.cuda.empty_cache()
        # trainer.shard=parameters: the float32 frozen parameters (a LoRA base) in a paged vector of their own, held
        # in ranges like the trainable ones, with no gradient and no optimizer state (replica/frozen_shards.py)
        self._paged_frozen: List[str] = []  # their names, in the vector's order
        self.frozen_pages = self._page_frozen() if paged else None
        self._buffer_views: Optional[Dict[str, np.ndarray]] = None  # buffer_arrays(), made at first use

    def layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of each parameter, in the flat order."""
        return [(n, tuple(p.shape)) for n, p in self.params.items()]

    # -- the flat gradient's room for the step's scalars
    def _fold_room(self) -> int:
        """Slots after the gradient: the step's scalars and flags (a loss, metrics, four votes) and one
        value per element of the buffers that are state (what ``buffers.Reconciler`` contributes)."""
        persistent = set(self.module.state_dict()) if self.module is not None else set(self.buffers)
        return (FOLD_SCALARS + len(self.params)  # and a flag per parameter: whether it took part (took_part)
                + int(np.sum([b.numel() for n, b in self.buffers.items() if n in persistent])))

    def fold_buffer(self, extra: int) -> Optional[torch.Tensor]:
        """The flat gradient followed by ``extra`` free slots (``Engine.fold_buffer``); None past the room."""
        n = self.num_params + extra
        return self._fold[:n] if n <= self._fold.numel() else None

    # -- by name (backend-neutral checkpoints)
    def is_state(self, name: str) -> bool:
        """Whether buffer ``name`` is state (in the module's state_dict; every buffer of a dict model)."""
        return self._stateful is None or name in self._stateful

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Parameters, frozen parameters and the buffers that are state, by name (``Engine.state`` less the
        optimizer's slots)."""
        tensors = {n: p for n, p in self.params.items()}
        tensors.update(self.frozen)
        tensors.update((n, b) for n, b in self.buffers.items() if self.is_state(n))
        return tensors

    def in_pages(self) -> Set[str]:
        """The names whose values live in paged vectors (``paged=True``): every parameter and the paged frozen
        ones; empty otherwise."""
        return set(self.params) | set(self._paged_frozen) if self.paged is not None else set()

    @torch.no_grad()
    def load(self, state: Dict[str, np.ndarray]) -> None:
        """``tensors()`` backwards: copy ``state``'s arrays into the live tensors."""
        for n, t in [*self.params.items(), *self.frozen.items(), *self.buffers.items()]:
            if n not in state and n in self.buffers and not self.is_state(n):
                continue  # a non-persistent buffer (older checkpoints held them): the module's own value
            t.copy_(torch.from_numpy(np.asarray(state[n])).to(t.dtype).reshape(t.shape))

    # -- trainer.shard=parameters: memory whose pages can be given back
    def page_params(self) -> Any:
        """The ``PagedVector`` the flat parameters were built in (``paged=True``)."""
        if self.paged is None:
            raise ElasticFlowError("trainer.shard=parameters needs an engine built with paged_params=True",
                                   "build it as train/builder.py does for trainer.shard=parameters")
        return self.paged

    def _paged(self, n: int) -> Any:
        """A flat float32 vector whose memory can be given back in pieces: host pages, or a GPU's granules."""
        if self.device.type == "cuda":
            from .device_pages import DeviceVector

            return DeviceVector(n, self.device)
        if self.device.type != "cpu":
            raise ElasticFlowError(f"trainer.shard=parameters cannot shard parameters on {self.device.type}",
                                   "pass trainer.shard=gradients, or train on CPUs or CUDA GPUs")
        from ..._util.pages import PagedVector, strict_default

        return PagedVector(n, strict=strict_default())

    def _page_frozen(self) -> Any:
        """The float32 host frozen parameters moved into one ``PagedVector`` (their names: ``_paged_frozen``)."""
        from ..._util.pages import PagedVector

        self._paged_frozen = [n for n, p in self.frozen.items() if p.dtype == torch.float32 and p.device.type == "cpu"]
        if not self._paged_frozen:
            return None
        vector = PagedVector(sum(self.frozen[n].numel() for n in self._paged_frozen))
        at = 0
        for p in self.frozen_units():
            view = vector.tensor[at:at + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
            at += p.numel()
        return vector

    def frozen_units(self) -> List[torch.Tensor]:
        """The frozen parameters in ``frozen_pages`` (``paged=True``), in its order."""
        return [self.frozen[n] for n in self._paged_frozen]

    def frozen_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of each frozen parameter in ``frozen_pages``, in its order."""
        return [(n, tuple(self.frozen[n].shape)) for n in self._paged_frozen]

    def zero_grad_range(self, lo: int, hi: int) -> None:
        if self.grad_pages is not None:
            self.grad_pages.zero(lo, hi)
        else:
            self.flat_grad[lo:hi].zero_()

    def grad_in(self, lo: int, hi: int) -> None:
        """Map the gradient's memory over [lo, hi) before backward writes it (a GPU's is unmapped where given
        back; the host's pages need nothing: ``_util/pages.py``)."""
        if self.grad_pages is not None:
            self.grad_pages.ensure(lo, hi)

    # -- buffers (reconciled across workers: backends/buffers.py)
    def buffer_rules(self) -> Dict[str, Rule]:
        return native.buffer_rules(self.module, self.buffers)

    def buffer_arrays(self) -> Dict[str, np.ndarray]:
        """Every buffer by name, as numpy views of the live tensors (made once: BatchNorm, load and
        set_buffers all write in place, so the views stay the buffers' own). On a GPU, host copies taken
        now (a sync point); ``set_buffers`` copies back."""
        if self.device.type != "cpu":
            return {n: b.detach().cpu().numpy() for n, b in self.buffers.items()}
        if self._buffer_views is None:
            self._buffer_views = {n: b.detach().numpy() for n, b in self.buffers.items()}
        return self._buffer_views

    def set_buffers(self, values: Dict[str, np.ndarray]) -> None:
        if self.device.type != "cpu":
            with torch.no_grad():
                for name, value in values.items():
                    b = self.buffers[name]
                    b.copy_(torch.from_numpy(np.asarray(value)).reshape(b.shape))  # copy_ casts to b's dtype
            return
        views = self.buffer_arrays()
        for name, value in values.items():
            np.copyto(views[name], np.reshape(value, views[name].shape), casting="unsafe")
