"""A causal language model as Hugging Face users train one: a tiny ``transformers`` GPT-2 on a ragged tokenized
``datasets.Dataset`` (no padding in the data), padded per micro-batch by ``DataCollatorForLanguageModeling``
(padding's labels are -100), the loss a mean over each micro-batch's target tokens and weighted by their count.

model_args (all optional):
    weighted: 0 -> forward() returns the loss alone, so micro-batches count by samples (default 1: by tokens).
    optimizer: "sgd" (default) or "adamw".
    dropout: GPT-2's three dropout rates (default 0.0).
Environment:
    EF_LM_KILL "worker:step": that worker SIGKILLs itself inside forward() at that step (generation 0).
"""
import functools
import os
import signal

import numpy as np
import torch

import elasticflow
from elasticflow.distributed.protocol import ENV_WORKER_ID

SAMPLES, VOCAB, SHORTEST, LONGEST = 240, 40, 3, 24
PAD = VOCAB  # one more id than the words: the tokenizer's pad token
KILL = os.environ.get("EF_LM_KILL")
WORKER = int(os.environ.get(ENV_WORKER_ID, "0"))


def arg(cfg, name, default):
    return cfg.model_args.get(name, default) if cfg is not None else default


def tokenizer():
    """A word-level tokenizer built offline (no download): ids 0..VOCAB-1 are words, VOCAB pads."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["[PAD]"] = PAD
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[PAD]")), pad_token="[PAD]")


def build(dropout: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB + 1, n_positions=LONGEST, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, pad_token_id=PAD)
    return GPT2LMHeadModel(config)


def optimizer(net, name):
    if name == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    return torch.optim.SGD(net.parameters(), lr=0.5)


def model(cfg):
    net = build(float(arg(cfg, "dropout", 0.0)))
    return {"net": net, "optimizer": optimizer(net, str(arg(cfg, "optimizer", "sgd")))}


def forward(input_ids, attention_mask, labels, net):
    if KILL:
        worker, step = map(int, KILL.split(":"))
        ctx = elasticflow.context()
        if worker == WORKER and ctx.step == step and ctx.generation == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    out = net["net"](input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    if not WEIGHTED:
        return out.loss
    # The model shifts the labels by one: its loss is the mean over the targets of labels[:, 1:].
    return {"loss": out.loss, "weight": (labels[:, 1:] != -100).sum()}


WEIGHTED = True


def data(cfg=None):
    """Ragged sequences of a little language (each word mostly follows from the one before)."""
    global WEIGHTED
    WEIGHTED = bool(int(arg(cfg, "weighted", 1)))
    from datasets import Dataset

    rng = np.random.default_rng(5)
    rows = []
    for n in rng.integers(SHORTEST, LONGEST + 1, size=SAMPLES):
        ids = [int(rng.integers(VOCAB))]
        for _ in range(n - 1):
            ids.append(int((ids[-1] * 7 + 3) % VOCAB if rng.random() < 0.8 else rng.integers(VOCAB)))
        rows.append(ids)
    return Dataset.from_dict({"input_ids": rows})


@functools.lru_cache(maxsize=None)
def collator():
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(tokenizer(), mlm=False)


def collate(samples):
    """Pad to the micro-batch's longest sequence; labels are the ids with -100 where padded."""
    return collator()(samples)
