"""Fine-tune GPT-2 with LoRA adapters (peft) on a small text, character by character:
`elasticflow train models/gpt2_lora.py` (docs/tutorial-lora.md walks through it).

The GPT-2 here is a small one built from a config, so the file trains offline in a minute; for the real one,
replace `GPT2LMHeadModel(GPT2Config(...))` by `GPT2LMHeadModel.from_pretrained("gpt2")` and the characters by
its tokenizer's ids.
"""
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

TEXT = Path(__file__).resolve().parent / "data" / "tiny_text.txt"
CONTEXT = 32


def base(seed):
    """The model being adapted (its weights stay frozen)."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=128, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config)


def model(cfg):
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    net = get_peft_model(base(cfg.seed), lora)  # only the adapters require a gradient: only they train
    return {"net": net, "optimizer": torch.optim.AdamW(net.parameters(), lr=1e-2)}


def forward(ids, model):
    return model["net"](input_ids=ids, labels=ids).loss  # the library shifts the labels by one


def _windows(text):
    ids = np.frombuffer(text.encode("ascii", "replace"), dtype=np.uint8).astype(np.int64) % 128
    return (np.lib.stride_tricks.sliding_window_view(ids, CONTEXT)[::4].copy(),)  # (windows,): one field


def data(cfg):
    text = TEXT.read_text()
    return _windows(text[: len(text) * 9 // 10])


def eval_data(cfg):
    text = TEXT.read_text()
    return _windows(text[len(text) * 9 // 10:])
