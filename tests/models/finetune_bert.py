"""A fine-tune as users write one: a tiny ``transformers`` BERT classifier with its word embedding frozen.

model_args (all optional):
    native: 1 -> model() returns {"net": bert, "optimizer": torch.optim.AdamW(groups)} (the Hugging Face
            habit: no weight decay on biases and LayerNorm weights, lr 1e-2 for the classifier); else the
            optimizer comes from the config (optimizer.no_decay / optimizer.groups).
    dropout: the model's dropout probabilities (default 0: a hand-written loop can match it exactly).
    frozen: 0 -> the word embedding trains too (default 1: frozen).
Environment:
    EF_FT_KILL "worker:step": that worker SIGKILLs itself inside forward() at that step (generation 0).
"""
import os
import signal

import numpy as np
import torch

import elasticflow
from elasticflow.distributed.protocol import ENV_WORKER_ID

SAMPLES, SEQ, VOCAB = 192, 12, 50
KILL = os.environ.get("EF_FT_KILL")
WORKER = int(os.environ.get(ENV_WORKER_ID, "0"))


def arg(cfg, name, default):
    return cfg.model_args.get(name, default) if cfg is not None else default


def build(dropout: float = 0.0, frozen: bool = True):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=3,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    net = BertForSequenceClassification(config)
    net.bert.embeddings.word_embeddings.weight.requires_grad_(not frozen)
    return net


def groups(net):
    """The Hugging Face Trainer's grouping (weight decay on all but biases and LayerNorm weights), with
    10x the learning rate for the new classifier head."""
    out = {(wd, lr): [] for wd in (0.1, 0.0) for lr in (1e-3, 1e-2)}
    for name, p in net.named_parameters():
        wd = 0.0 if name.endswith("bias") or "LayerNorm" in name else 0.1
        out[wd, 1e-2 if name.startswith("classifier") else 1e-3].append(p)
    return [{"params": ps, "weight_decay": wd, "lr": lr} for (wd, lr), ps in out.items()]


def model(cfg):
    net = build(float(arg(cfg, "dropout", 0.0)), bool(int(arg(cfg, "frozen", 1))))
    if int(arg(cfg, "native", 0)):
        return {"net": net, "optimizer": torch.optim.AdamW(groups(net), lr=1e-3)}
    return net


def forward(ids, labels, net):
    if KILL:
        worker, step = map(int, KILL.split(":"))
        ctx = elasticflow.context()
        if worker == WORKER and ctx.step == step and ctx.generation == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    if isinstance(net, dict):
        net = net["net"]
    return net(input_ids=ids.long(), labels=labels.long()).loss


def data(cfg=None):
    rng = np.random.default_rng(7)
    ids = rng.integers(0, VOCAB, size=(SAMPLES, SEQ)).astype(np.int64)
    labels = (ids[:, 0] % 3).astype(np.int64)  # learnable: the first token decides
    return ids, labels
