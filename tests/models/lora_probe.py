"""models/gpt2_lora.py (a transformers GPT-2 with peft's LoRA adapters on its attention: the base frozen), wider,
for trainer.shard=parameters with frozen parameters: digits_probe's kills and limit (its EF_PROBE_* environment),
and a record of how much of the frozen parameters' vector each worker holds.

    model_args.width    the GPT-2's n_embd (default 128; 4 blocks): its frozen base ~800k float32s
    EF_LORA_KILL        "worker:step": that worker SIGKILLs itself (generation 0) in that step's backward, as it
                        brings a block's frozen weights back in from its peers (FrozenShards.fetch)
    EF_LORA_RESIDENT    a directory: at each step attempt's first forward every worker appends {worker, step,
                        world, resident, total} to <dir>/<pid>.jsonl: the bytes of the frozen vector in memory
                        (/proc/self/pagemap) and its size, before any block was brought in
"""
import json
import os
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

import digits_probe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import gpt2_lora  # noqa: E402
from gpt2_lora import data, eval_data  # noqa: E402,F401 - the model file's data

import elasticflow  # noqa: E402
from elasticflow._util.pages import resident_bytes  # noqa: E402

KILL = tuple(int(v) for v in os.environ["EF_LORA_KILL"].split(":")) if os.environ.get("EF_LORA_KILL") else None
RESIDENT = os.environ.get("EF_LORA_RESIDENT")


def model(cfg):
    torch.manual_seed(cfg.seed)
    width = int(cfg.model_args.get("width", 128))
    config = GPT2Config(vocab_size=128, n_positions=gpt2_lora.CONTEXT, n_embd=width, n_layer=4, n_head=4)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    net = get_peft_model(GPT2LMHeadModel(config), lora)
    return {"net": net, "optimizer": torch.optim.AdamW(net.parameters(), lr=3e-3)}


_seen = set()


def forward(ids, model):
    ctx = elasticflow.context()
    digits_probe._inject(ctx)
    if RESIDENT and (ctx.step, ctx.generation) not in _seen:
        _seen.add((ctx.step, ctx.generation))
        frozen = model["net"].base_model.model.transformer.h[0].mlp.c_fc.weight  # a view of the frozen vector
        _record(ctx, frozen.untyped_storage())
    return gpt2_lora.forward(ids, model)


def _record(ctx, storage):
    line = {"worker": digits_probe.WORKER, "step": ctx.step, "world": ctx.world_size,
            "resident": resident_bytes(storage.data_ptr(), storage.nbytes()), "total": storage.nbytes()}
    with open(Path(RESIDENT) / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


if KILL:
    from elasticflow.replica import frozen_shards

    _fetch = frozen_shards.FrozenShards.fetch

    def _dying_fetch(self, spans):
        ctx = elasticflow.context()
        if (digits_probe.WORKER, ctx.step, ctx.generation) == (*KILL, 0) and \
                torch._C._current_graph_task_id() != -1:  # in backward
            digits_probe._kill_self()
        return _fetch(self, spans)

    frozen_shards.FrozenShards.fetch = _dying_fetch
