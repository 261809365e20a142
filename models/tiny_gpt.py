"""A small GPT-2-shaped decoder in plain torch (an ``nn.Module``), trained on random tokens.

Pre-norm blocks (causal ``nn.MultiheadAttention``, GELU MLP, LayerNorm) over learned token and
position embeddings, with the output head tied to the token embedding as in GPT-2. It stands in for
``transformers``' GPT-2 (not installed here) in scripts/bench/bench_models.py: the same parameter layout
(12 tensors a block, a tied embedding), so the optimizer walks as many tensors as it does there.
The data are uniform random tokens, so the loss only falls toward log(vocab); it is for timing.

    elasticflow train models/tiny_gpt.py optimizer=adamw +model_args.layers=2 +model_args.width=64
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SEQ = 64


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, h, mask):
        a = self.ln_1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return h + self.proj(F.gelu(self.fc(self.ln_2(h))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(SEQ, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        # Non-persistent: a constant, not state to checkpoint or reconcile.
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1), persistent=False)

    def forward(self, ids):
        h = self.wte(ids) + self.wpe.weight[: ids.shape[1]]
        for block in self.blocks:
            h = block(h, self.mask)
        return self.ln_f(h) @ self.wte.weight.T  # tied head, as GPT-2's lm_head


def _args(cfg):
    a = cfg.get("model_args", {}) or {}
    return int(a.get("vocab", 1000)), int(a.get("width", 64)), int(a.get("layers", 2)), int(a.get("heads", 2))


def model(cfg):
    """``model_args.vocab`` (1000), ``width`` (64), ``layers`` (2), ``heads`` (2) set the size."""
    torch.manual_seed(cfg.seed)
    return TinyGPT(*_args(cfg))


def forward(x, y, params):
    logits = params(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def data(cfg):
    """(x, y): random token windows and the same shifted by one, int64 (samples, SEQ);
    ``model_args.samples`` windows (2048)."""
    vocab = _args(cfg)[0]
    samples = int((cfg.get("model_args", {}) or {}).get("samples", 2048))
    ids = np.random.default_rng(0).integers(0, vocab, (samples, SEQ + 1))
    return np.ascontiguousarray(ids[:, :-1]), np.ascontiguousarray(ids[:, 1:])
