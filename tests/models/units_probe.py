"""An nn.Module on the digits with four submodules, for trainer.shard=parameters (ZeRO stage 3): each top-level
submodule is a unit its workers bring in for forward and backward. The kills and records of digits_probe.py
(its EF_PROBE_* environment) apply here too. ``model_args.hidden`` sets the width (default 96).

``model_args.checkpointing`` recomputes the block in backward (torch.utils.checkpoint), in one of the ways users
write it; the model computes the same values in each:
    call             checkpoint(self.block, h): its __call__, hooks and all (1 says the same)
    forward          checkpoint(self.block.forward, h): its forward alone, no module hook runs
    reentrant        the same with use_reentrant=True (forward under no_grad; the recompute in backward)
    layer            the block's own forward checkpoints its body (transformers' GradientCheckpointingLayer,
                     FSDP2's convention): __call__ runs once, the recompute runs the body without hooks
    layer-reentrant  the same with use_reentrant=True
``model_args.frozen=1`` freezes the block's first weight (requires_grad=False: the block holds frozen parameters,
as a LoRA base does). ``model_args.compile``: "model" returns torch.compile(net) from model(); "block" compiles the
block in place (``nn.Module.compile``: its __call__, hooks included); "fullgraph": torch.compile(net,
fullgraph=True).

    EF_UNITS_KILL_BACKWARD  "worker:step": that worker SIGKILLs itself in the first backward of that step (generation
                            0), once the head, norm and block units were brought back in for it and before embed.
    EF_UNITS_KILL           "worker:step:phase[:n][,...]": that worker SIGKILLs itself on entering the n-th (default
                            1st) call of a phase of that step, in whichever generation that call comes (a step
                            another death made redo counts on) (soak_shard_kill.py --stage parameters):
                            forward_fetch   a unit brought in for forward: the peers wait in vain for its pieces
                            backward_fetch  a unit brought in again in backward
                            reduce          a unit's gradient on its way to its owners
                            update          the update of its held ranges, after the first (its own) range
    EF_UNITS_RESIDENT       a directory: at each step's first forward, before any unit is brought in, every worker
                            appends {worker, step, world, what: "params", resident, total} to <dir>/<pid>.jsonl: the
                            bytes of the flat parameter vector in memory (/proc/self/pagemap) and its size; and in
                            that micro-batch's backward, once head, norm and block have their gradients (before
                            embed's), the same of the flat gradient (what: "grads") and of the flat parameter
                            vector (what: "params_backward": those three units given back, embed not yet in).
"""
import json
import os
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch import nn

import digits_probe
from digits_probe import data  # noqa: F401 - the model file's data()
from digits_mlp import eval_data  # noqa: F401,E402 - importable once digits_probe put models/ on the path

import elasticflow
from elasticflow._util.pages import resident_bytes


class Block(nn.Sequential):
    """Linear, tanh, linear; ``layer`` ("layer", "layer-reentrant"): its forward checkpoints its own body."""
    layer = ""

    def forward(self, h):
        if self.layer and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(super().forward, h, use_reentrant=self.layer != "layer")
        return super().forward(h)


STYLES = {"1": "call", "call": "call", "forward": "forward", "reentrant": "reentrant", "layer": "layer",
          "layer-reentrant": "layer-reentrant"}


class Net(nn.Module):
    def __init__(self, hidden: int, checkpointing: str = ""):
        super().__init__()
        self.embed = nn.Linear(64, hidden)
        self.block = Block(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, hidden))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 10)
        self.recompute = checkpointing if checkpointing in ("call", "forward", "reentrant") else ""
        self.block.layer = checkpointing if checkpointing.startswith("layer") else ""

    def forward(self, x):
        h = torch.relu(self.embed(x))
        if BACKWARD_KILL and torch.is_grad_enabled():
            ctx = elasticflow.context()
            if (digits_probe.WORKER, ctx.step, ctx.generation) == (*BACKWARD_KILL, 0):
                h.register_hook(lambda _grad: digits_probe._kill_self())  # after the units above h, before embed
        if RESIDENT and torch.is_grad_enabled() and elasticflow.context().step not in _grads_seen:
            _grads_seen.add(elasticflow.context().step)
            grad, param = self.embed.weight.grad, self.embed.weight
            h.register_hook(lambda _grad: _record_resident(elasticflow.context(), grad, "grads"))
            h.register_hook(lambda _grad: _record_resident(elasticflow.context(), param, "params_backward"))
        if self.recompute:  # activation checkpointing: the block's forward runs again in backward
            run = self.block if self.recompute == "call" else self.block.forward
            block = torch.utils.checkpoint.checkpoint(run, h, use_reentrant=self.recompute == "reentrant")
        else:
            block = self.block(h)
        return self.head(self.norm(h + block))


BACKWARD_KILL = tuple(int(v) for v in os.environ["EF_UNITS_KILL_BACKWARD"].split(":")) \
    if os.environ.get("EF_UNITS_KILL_BACKWARD") else None


def model(cfg):
    torch.manual_seed(cfg.seed)
    style = str(cfg.model_args.get("checkpointing", "0"))
    net = Net(int(cfg.model_args.get("hidden", 96)), STYLES.get(style, ""))
    if style not in STYLES and style not in ("0", ""):
        raise ValueError(f"model_args.checkpointing={style!r}: one of {sorted(STYLES)}")
    if int(cfg.model_args.get("frozen", 0)):
        net.block[0].weight.requires_grad_(False)
    compiled = str(cfg.model_args.get("compile", ""))
    if compiled == "block":
        net.block.compile()
    if compiled == "fullgraph":
        return torch.compile(net, fullgraph=True)
    return torch.compile(net) if compiled == "model" else net


def forward(x, y, params):
    ctx = elasticflow.context()
    digits_probe._inject(ctx)
    if RESIDENT and (ctx.step, ctx.generation) not in _resident_seen:
        _resident_seen.add((ctx.step, ctx.generation))
        _record_resident(ctx, next(params.parameters()), "params")
    logits = params(x)
    return {"loss": nn.functional.cross_entropy(logits, y.long()),
            "accuracy": (logits.argmax(-1) == y.long()).float().mean()}


RESIDENT = os.environ.get("EF_UNITS_RESIDENT")
PHASE_KILLS = {}  # (worker, step) -> (phase, n)
for _spec in filter(None, os.environ.get("EF_UNITS_KILL", "").split(",")):
    _w, _s, _phase, *_n = _spec.split(":")
    PHASE_KILLS[(int(_w), int(_s))] = (_phase, int(_n[0]) if _n else 1)
_phase_calls = {}


def _die_in(phase):
    ctx = elasticflow.context()
    kill = PHASE_KILLS.get((digits_probe.WORKER, ctx.step))
    if kill is None or kill[0] != phase:
        return
    _phase_calls[phase] = _phase_calls.get(phase, 0) + 1
    if _phase_calls[phase] == kill[1]:
        digits_probe._kill_self()


if PHASE_KILLS:
    from elasticflow.replica import flat_update, held_params

    _fetch, _reduce, _update = (held_params.HeldParameters.fetch, held_params.HeldParameters.reduce_grad,
                                flat_update.FlatUpdate.__call__)

    def _dying_fetch(self, spans):
        _die_in("backward_fetch" if torch._C._current_graph_task_id() != -1 else "forward_fetch")
        return _fetch(self, spans)

    def _dying_reduce(self, spans):
        _die_in("reduce")
        return _reduce(self, spans)

    def _dying_update(self, *args, **kwargs):
        _die_in("update")
        return _update(self, *args, **kwargs)

    held_params.HeldParameters.fetch = _dying_fetch
    held_params.HeldParameters.reduce_grad = _dying_reduce
    flat_update.FlatUpdate.__call__ = _dying_update
_resident_seen, _grads_seen = set(), set()


def _record_resident(ctx, tensor, what):
    storage = tensor.untyped_storage()
    line = {"worker": digits_probe.WORKER, "step": ctx.step, "generation": ctx.generation, "world": ctx.world_size,
            "what": what, "resident": resident_bytes(storage.data_ptr(), storage.nbytes()), "total": storage.nbytes()}
    with open(Path(RESIDENT) / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
