"""``trainer.shard=parameters`` (ZeRO stage 3): the parameters a worker does not hold are brought in per unit for
forward and again for backward, and given back after each.

Design
------
**Units.** Each top-level submodule of the model is a unit (FSDP2's ``fully_shard`` per block), or each submodule
``trainer.shard_units`` names by pattern; a parameter that two units share (tied embeddings) and the parameters
of no unit (a dict of arrays, the root's own) form the *root*, brought in for a whole micro-batch. A unit is a
set of spans of the flat parameter vector
(``ShardedState``'s, in ``PagedVector`` memory whose pages can be given back).

**Forward.** A unit's forward pre-hook brings its spans in (``ShardedState.fetch``: each owner sends its piece to
every member that does not hold it); its forward hook gives them back.

**Backward** brings a unit in before its first node runs: its forward hook puts a hook on each output that
requires a gradient, and the first of them to receive its gradient fetches the unit (FSDP2's pre-backward).
That is also what makes activation checkpointing right: a recompute runs inside the unit's backward, after
that fetch, whichever way it calls the unit's code: ``checkpoint(unit, h)``, ``checkpoint(unit.forward, h)``,
a ``forward`` that checkpoints its own body (transformers' ``GradientCheckpointingLayer``), reentrant or not.
(torch.utils.checkpoint's own ``saved_tensors_hooks`` replace ours inside the checkpoint, so the unpack below
never sees what a recompute reads; and a recompute that calls ``forward`` directly skips the pre-hook.) A unit
whose every trainable parameter has accumulated its gradient of the micro-batch is given back there: autograd
runs a parameter's accumulation only after every node that took it as an input, so no later node of this
backward reads it. Frozen parameters have no such signal: a unit holding some passes its inputs that require a
gradient through ``AfterBackward`` in forward, whose backward runs once their gradients are computed (FSDP2's
post-backward), and goes once that and its trainable parameters' gradients are done. Where forward runs a
unit's ``forward`` without ``__call__`` (``checkpoint(unit.forward, h)``), the unit's ``forward`` attribute, which
the ParamUnits replace with a wrapper, brings it in and gives it back the same way.

A ``saved_tensors_hooks`` pair sees every other use of a parameter in backward: a saved view of the vector is
packed with its unit, and unpacking it brings the unit in again if it is out. A unit with frozen parameters whose
saved tensors have all been unpacked is given back too once backward has moved on to another unit's (the CPU's
autograd runs one node at a time: a node's unpacks come before its work, and the next node's after it).

**The gradient** of a unit goes to its owners once each of its parameters has accumulated its gradient of the
micro-batch (autograd's post-accumulate hook): each member sends its piece to the piece's owner, who adds every
member's (in rank order) into ``acc``, its range's sums of the step; the unit's gradient pages are then given
back, so backward never holds a whole gradient. The root's, and a unit's with a parameter that got none, go at
the micro-batch's end. The step's end (``Replica.start_reduce``) sums only the votes and hands ``acc`` to the buddy.

**Frozen parameters** (a LoRA base) lie in a second flat vector (``frozen_shards.py``): a unit's frozen spans
come in after its trainable ones and go with them; they have no gradient. Under ``trainer.reproducible`` the
owners' sums are exact (``exact_sum.py``): the same bits in whatever order the pieces arrive.

**The same collectives on every member.** A fetch is point to point between all members, so every member must
fetch the same units in the same order: each one records the units one micro-batch fetched (``trace``), and a
member dealt fewer micro-batches than another replays that trace for each one it lacks (``replay``), sending
its pieces and receiving (into memory it gives back at once). So a model must run the same submodules for every
micro-batch; data-dependent skipping of a unit (a mixture of experts routing no token to one) is not supported.
A container unit (the experts' ModuleList: never called itself) is brought in by the first of its members that
is called, and kept until its parameters have their gradients: any expert may go unused as long as one is called.

Note: a parameter read in forward outside its unit's own forward (``self.head.weight`` used in the parent's
forward) is read while out; where autograd saves it, the pack hook catches that and says so.
Inside a non-reentrant checkpoint autograd saves with the checkpoint's hooks, not ours: such a read there (or
``type(unit).forward(unit, h)`` called from outside the unit) is not caught. ``torch.compile(fullgraph=True)``
cannot trace the hooks and is refused when the ParamUnits are built, before training.
"""
from __future__ import annotations

import fnmatch
import functools
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import ElasticFlowError
from .unit_hooks import AfterBackward, fullgraph, tensors, wrap_forward

Span = Tuple[int, int]


def merge(spans: Sequence[Span]) -> List[Span]:
    """Sorted, adjacent and overlapping spans joined."""
    out: List[Span] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif hi > lo:
            out.append((lo, hi))
    return out


def unit_modules(module: Optional[torch.nn.Module],
                 patterns: Sequence[str] = ()) -> List[Tuple[str, torch.nn.Module]]:
    """The units' (name, submodule): those whose qualified name matches one of ``patterns`` (fnmatch, e.g.
    ``transformer.h.*``; the outermost where two nest), or the top-level submodules where none is given."""
    if module is None:
        return []
    if not patterns:
        return list(module.named_children())
    chosen: List[Tuple[str, torch.nn.Module]] = []
    for name, sub in module.named_modules():
        if name and any(fnmatch.fnmatchcase(name, p) for p in patterns) and \
                not any(name.startswith(c + ".") for c, _ in chosen):
            chosen.append((name, sub))
    if not chosen:
        top = ", ".join(n for n, _ in list(module.named_children())[:8])
        raise ElasticFlowError(f"trainer.shard_units={list(patterns)} names no submodule of the model",
                               f"name submodules by their qualified names, e.g. trainer.shard_units=[{top}] or "
                               "'[blocks.*]' (print(model) shows them)")
    return chosen


class UnitPlan(NamedTuple):
    """Each unit's spans of the flat parameters, the root's, each unit's name; and the same spans of the frozen
    parameters' vector (``frozen_shards.py``; empty without one)."""
    spans: List[List[Span]]
    root: List[Span]
    names: List[str]
    frozen: List[List[Span]]
    frozen_root: List[Span]


def plan_units(module: Optional[torch.nn.Module], params: Sequence[torch.Tensor],
               patterns: Sequence[str] = (), frozen: Sequence[torch.Tensor] = ()) -> UnitPlan:
    """The units of ``params`` (the engine's, in flat order) and of ``frozen`` (its frozen vector's); a unit with
    either kind of parameter is kept."""
    children = unit_modules(module, patterns)
    units, root = _spans(children, params)
    frozen_units, frozen_root = _spans(children, frozen)
    keep = [u for u in range(len(children)) if units[u] or frozen_units[u]]
    return UnitPlan([merge(units[u]) for u in keep], merge(root), [children[u][0] for u in keep],
                    [merge(frozen_units[u]) for u in keep], merge(frozen_root))


def _spans(children: List[Tuple[str, torch.nn.Module]], params: Sequence[torch.Tensor]):
    """(each child's spans, the root's) of the flat vector ``params`` lie in, in its order."""
    offsets, at = {}, 0
    for p in params:
        offsets[id(p)] = (at, at + p.numel())
        at += p.numel()
    owners: Dict[int, List[int]] = {}
    for u, (_, child) in enumerate(children):
        for p in child.parameters():
            if id(p) in offsets:
                owners.setdefault(id(p), []).append(u)
    units: List[List[Span]] = [[] for _ in children]
    root: List[Span] = []
    for pid, span in offsets.items():
        where = owners.get(pid, [])
        (units[where[0]] if len(where) == 1 else root).append(span)
    return units, root


class _Where:
    """Which unit each element of a flat vector belongs to (-1: the root), and the vector's storage address."""

    def __init__(self, base: torch.Tensor, spans: List[List[Span]]):
        self.ptr = base.untyped_storage().data_ptr()
        starts = np.asarray([s[0] for sp in spans for s in sp], dtype=np.int64)
        order = np.argsort(starts)
        self.starts = starts[order]
        self.ends = np.asarray([s[1] for sp in spans for s in sp], dtype=np.int64)[order]
        self.unit_of = np.asarray([u for u, sp in enumerate(spans) for _ in sp], dtype=np.int64)[order]

    def unit(self, at: int) -> int:
        """The unit of element ``at`` (-1: the root)."""
        i = int(np.searchsorted(self.starts, at, side="right")) - 1
        return int(self.unit_of[i]) if i >= 0 and at < self.ends[i] else -1


class ParamUnits:
    """The hooks that bring units in and give them back, on the engine's module, for a ``ShardedState`` of stage
    ``parameters``. ``begin``/``end`` bracket each micro-batch's forward and backward (``Stepper``)."""

    def __init__(self, engine: Any, shards: Any, patterns: Sequence[str] = (), model: Any = None):
        """``model``: what model() returned (a module, a compiled wrapper, a dict of them): checked for a
        ``fullgraph`` compile."""
        self.shards, self.engine = shards, engine
        self.frozen = shards.frozen  # frozen_shards.FrozenShards, or None
        module, params = engine.parameter_units()
        plan = plan_units(module, params, patterns, engine.frozen_units() if self.frozen is not None else ())
        self.spans, self.root, self.names = plan.spans, plan.root, plan.names
        if self.names and fullgraph(model, module):
            raise ElasticFlowError("trainer.shard=parameters brings each unit in from Python hooks, which "
                                   "torch.compile(fullgraph=True) cannot trace (it stops at the first one)",
                                   "compile without fullgraph=True (each hook is then a graph break between "
                                   "compiled pieces), or pass trainer.shard=gradients")
        self.frozen_spans, self.frozen_root = plan.frozen, plan.frozen_root
        self.resident = [False] * len(self.spans)
        self.root_in = False
        self.packs = [0] * len(self.spans)
        self.unpacks = [0] * len(self.spans)
        self.done: List[int] = []       # units whose saved tensors were all unpacked: given back once backward moves on
        self.trace: List[Tuple[str, int]] = []  # this micro-batch's fetches ("f") and reductions ("g"), by unit
        self.last_trace: Optional[List[Tuple[str, int]]] = None
        self.reducing = False           # this step's gradient goes to its owners unit by unit (ShardedState.scatters)
        self.layout = -1                # ShardedState.layout_version the resident flags belong to
        self.whole = False              # every parameter in (evaluation): the hooks do nothing
        # Where a saved view of either vector belongs (_pack)
        self._where = [_Where(shards.params, self.spans)]
        if self.frozen is not None:
            self._where.append(_Where(self.frozen.params, self.frozen_spans))
        # Each parameter's unit (-1: the root), for the gradient hooks: a unit's gradient is reduced to its
        # owners once every parameter of it has accumulated its gradient of the micro-batch.
        self._param_unit = []
        at = 0
        for p in params:
            self._param_unit.append(self._where[0].unit(at))
            at += p.numel()
        self._params_of = [self._param_unit.count(u) for u in range(len(self.spans))]
        # Given back in backward once its parameters have their gradients (not with frozen ones: no such signal)
        self._after_grads = [self._params_of[u] > 0 and not self.frozen_spans[u] for u in range(len(self.spans))]
        self._arrived = [0] * len(self.spans)
        self._reduced = [False] * len(self.spans)
        self._inputs_due = [0] * len(self.spans)  # a unit with frozen parameters: its calls' input gradients to come
        self._hooks = []
        for p, u in zip(params, self._param_unit):
            if u >= 0:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda _p, u=u: self._grad_ready(u)))
        if module is not None:
            children = dict(unit_modules(module, patterns))
            for u, name in enumerate(self.names):
                child = children[name]
                if type(child).forward is torch.nn.Module.forward:  # a ModuleList or ModuleDict: never called, its
                    self._hooks += [sub.register_forward_pre_hook(lambda _m, _a, u=u: self._member_in(u))  # members
                                    for sub in child.modules()  # are: the first brings the unit in
                                    if type(sub).forward is not torch.nn.Module.forward]
                    continue
                self._hooks.append(child.register_forward_pre_hook(
                    lambda _m, args, kwargs, u=u: self._forward_in(u, args, kwargs), with_kwargs=True))
                self._hooks.append(child.register_forward_hook(lambda _m, _a, out, u=u: self._forward_out(u, out)))
                wrap_forward(child, self, u)
        self.device = shards.params.device  # a saved tensor elsewhere is not a parameter view
        self.saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ------------------------------------------------------------------ a step, a micro-batch
    def begin_step(self) -> None:
        """Before a step's first micro-batch: its sums start at zero."""
        self._check_layout()
        self.reducing = self.shards.scatters()
        self.shards.start_step()

    def begin(self) -> None:
        """Before a micro-batch's forward: the root in, the unit counters reset."""
        self._check_layout()
        self.trace = []
        self.packs = [0] * len(self.spans)
        self.unpacks = [0] * len(self.spans)
        self._arrived = [0] * len(self.spans)
        self._reduced = [False] * len(self.spans)
        self._inputs_due = [0] * len(self.spans)
        self.done = []
        if not self.reducing:  # the whole gradient is summed and read (trainer.reproducible: after each micro-batch,
            self.engine.grad_in(0, self.shards.n)  # which zero_grad gave back): all of it in memory
        if (self.root or self.frozen_root) and not self.whole:
            self._fetch(-1)
            self.root_in = True

    def end(self) -> None:
        """After its backward: the gradients not yet reduced (a unit with a parameter that had none; the root)
        reduced, in the units' order; every unit and the root given back; the trace kept for ``replay``."""
        if self.reducing:
            for u in range(len(self.spans)):
                if not self._reduced[u] and self.spans[u]:
                    self._reduce(u)
            if self.root:
                self._reduce(-1)
        for u in range(len(self.spans)):
            if self.resident[u]:
                self._give_back(u)
        if self.root_in:
            self._give_back(-1)
            self.root_in = False
        self.last_trace = list(self.trace)

    def replay(self, times: int) -> None:
        """The fetches of ``times`` micro-batches this member was not dealt, so that its peers' complete."""
        if times <= 0 or self.shards.holds_all():
            return
        if self.last_trace is None:
            raise ElasticFlowError("trainer.shard=parameters: this worker was dealt no micro-batch in its first step, "
                                   "so it cannot take part in its peers' parameter fetches",
                                   "use a global batch of at least one micro-batch per worker")
        self._check_layout()
        for _ in range(times):
            for kind, u in self.last_trace:
                if kind == "f":
                    self._bring(u)
                    self._give_back(u)
                elif self.reducing:  # this member's gradient there is zero: it sends zeros, an owner sums
                    self.shards.reduce_grad(self.root if u < 0 else self.spans[u])

    # ------------------------------------------------------------------ the hooks
    def _forward_in(self, u: int, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if self.whole:
            return None
        if not self.resident[u]:
            self._fetch(u)
        return self._watch_inputs(u, args, kwargs or {})

    def _member_in(self, u: int) -> None:
        """A module inside container unit ``u`` (the experts of a ModuleList) is called: the unit in, and kept (no
        forward hook of the container fires) until its parameters have their gradients or the micro-batch ends."""
        if not self.whole and not self.resident[u]:
            self._fetch(u)

    def _watch_inputs(self, u: int, args: tuple, kwargs: dict) -> Any:
        """A unit with frozen parameters: its inputs that require a gradient pass through ``AfterBackward``, whose
        backward says when their gradients, and so the nodes of the unit that read its frozen weights for them,
        are done (FSDP2's post-backward). None where nothing is to watch (the args stay as they are)."""
        if self._after_grads[u] or not self.frozen_spans[u] or not torch.is_grad_enabled() or \
                torch._C._current_graph_task_id() != -1:
            return None
        at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not at and not keys:
            return None
        self._inputs_due[u] += 1
        out = AfterBackward.apply(self, u, *[args[i] for i in at], *[kwargs[k] for k in keys])
        args, kwargs = list(args), dict(kwargs)
        for i, t in zip(at + keys, out):
            if isinstance(i, int):
                args[i] = t
            else:
                kwargs[i] = t
        return tuple(args), kwargs

    def inputs_done(self, u: int) -> None:
        """``AfterBackward``: the gradients of one call's inputs of unit ``u`` are computed."""
        self._inputs_due[u] -= 1
        if self._inputs_due[u] == 0 and self._arrived[u] == self._params_of[u] and self.resident[u] \
                and not self.whole:
            self._give_back(u)

    def _forward_out(self, u: int, out: Any) -> None:
        # Not inside backward: activation checkpointing runs the unit's forward again there, and its recomputed
        # ops use it next (kept until its parameters have their gradients: _grad_ready).
        if self.whole or torch._C._current_graph_task_id() != -1:
            return
        if self.resident[u]:
            self._give_back(u)
        if torch.is_grad_enabled():  # its backward brings it in first (a reentrant checkpoint's recompute: no grad)
            fetch = functools.partial(self._backward_in, u)
            for t in tensors(out):
                if t.requires_grad:
                    t.register_hook(fetch)

    def _backward_in(self, u: int, _grad: Any = None) -> None:
        """The unit's backward starts (a gradient reached one of its outputs): in, before any of its nodes runs,
        and so before a checkpoint recomputes its forward."""
        if not self.whole and not self.resident[u]:
            self._fetch(u)

    def direct_forward(self, u: int, forward: Any, args: tuple, kwargs: dict) -> Any:
        """The unit's ``forward`` called without ``__call__`` (no hooks ran): in for the call, out after it."""
        if self.whole or self.resident[u]:
            return forward(*args, **kwargs)  # __call__'s pre-hook brought it in, or backward did (a recompute)
        args, kwargs = self._forward_in(u, args, kwargs) or (args, kwargs)
        out = forward(*args, **kwargs)
        self._forward_out(u, out)
        return out

    def _pack(self, t: torch.Tensor) -> Any:
        if self.whole or not isinstance(t, torch.Tensor) or t.device != self.device or not self.names:
            return t
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional wrapper)
            return t
        at = int(t.storage_offset())
        u = next((w.unit(at) for w in self._where if w.ptr == ptr), None)
        if u is None or u < 0:
            return t  # not a parameter, or the root's: in for the whole micro-batch
        if not self.resident[u]:
            raise ElasticFlowError(f"trainer.shard=parameters: forward() used a parameter of unit "
                                   f"{self.names[u]!r} outside that submodule's own forward, while it was not "
                                   "gathered", "call the submodule instead of reading its parameters, or pass "
                                   "trainer.shard=gradients")
        self.packs[u] += 1
        return (_Saved, u, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and len(packed) == 3 and packed[0] is _Saved):
            return packed
        _, u, t = packed
        for d in [d for d in self.done if d != u]:  # backward moved on: their nodes are finished
            if self.resident[d]:
                self._give_back(d)
        self.done = [d for d in self.done if d == u]
        if not self.resident[u]:
            self._fetch(u)
        self.unpacks[u] += 1
        if self.unpacks[u] == self.packs[u] and not self._after_grads[u] and not self._inputs_due[u]:
            self.done.append(u)  # (not before the units' own signals: a recompute's reads are not unpacked here)
        return t

    def _grad_ready(self, u: int) -> None:
        """A parameter of unit ``u`` accumulated its gradient (autograd's hook): the unit's last sends it on."""
        self._arrived[u] += 1
        if self.whole or self._arrived[u] != self._params_of[u]:
            return
        if self.reducing and not self._reduced[u]:
            self._reduce(u)
        if self._after_grads[u] and self.resident[u]:  # no later node of this backward reads it (the docstring)
            self._give_back(u)
        elif self.frozen_spans[u] and self._inputs_due[u] == 0 and self.resident[u]:  # its inputs' are done too
            self._give_back(u)

    # ------------------------------------------------------------------ in and out
    def _reduce(self, u: int) -> None:
        self.trace.append(("g", u))
        self.shards.reduce_grad(self.root if u < 0 else self.spans[u])
        if u >= 0:
            self._reduced[u] = True

    def _fetch(self, u: int) -> None:
        self.trace.append(("f", u))
        self._bring(u)
        if u >= 0:
            self.resident[u] = True

    def _bring(self, u: int) -> None:
        """Unit ``u``'s (-1: the root's) parameters in: the trainable ones, then the frozen ones (two exchanges,
        in the same order on every member; a unit without one kind skips its exchange on every member)."""
        spans, frozen = (self.root, self.frozen_root) if u < 0 else (self.spans[u], self.frozen_spans[u])
        for lo, hi in spans:  # backward writes the unit's gradient: its memory in (a GPU's unmaps it when given back)
            self.engine.grad_in(lo, hi)
        if spans:
            self.shards.fetch(spans)
        if frozen:
            self.frozen.fetch(frozen)

    def _give_back(self, u: int) -> None:
        spans, frozen = (self.root, self.frozen_root) if u < 0 else (self.spans[u], self.frozen_spans[u])
        self.shards.give_back(spans)
        if frozen:
            self.frozen.give_back(frozen)
        if u >= 0:
            self.resident[u] = False

    def _check_layout(self) -> None:
        """After a membership change every span not held was given back: no unit is in."""
        if self.layout != self.shards.layout_version:
            self.layout = self.shards.layout_version
            self.resident = [False] * len(self.spans)
            self.root_in = False


class _Saved:
    """The tag of a packed parameter view (a class, so no user tuple is taken for one)."""
