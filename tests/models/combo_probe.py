"""One model on the digits whose features switch on one by one, for the feature-combination matrix
(tests/test_combinations.py, docs/combinations.md): each switch is a way users write models, and a row of the
matrix turns several on at once.

``model_args.hidden`` sets the width (default 48). ``model_args`` (torch, an nn.Module of four top-level submodules -- four units under trainer.shard=parameters):
    norm=batch          BatchNorm1d after the embedding (running statistics: buffers), else LayerNorm
    dropout=1           Dropout(0.2) inside the block
    frozen=1            the embedding frozen (requires_grad=False), as a fine-tuner freezes a stem
    checkpointing=K     the block recomputed in backward by torch.utils.checkpoint: call (the module, as
                        ``checkpoint(block, h)``), forward (its bound ``forward``, transformers 5's way)
    compile=1           the block torch.compile'd (backend aot_eager: dynamo and AOT autograd, without a C++
                        build in every worker)
    moe=1               top-1 routing over 3 experts, an expert no sample chose not called
    lora=1              peft's LoRA adapters on the block's two Linear layers, their base frozen
    native=1            model() returns a torch.optim.SGD (the head at a tenth of the lr)
With backend=tensorflow a keras model of the same shape (norm, dropout, frozen; native: compiled with SGD).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import digits_probe  # noqa: E402
from digits_probe import data  # noqa: E402,F401 - the model file's data()

import elasticflow  # noqa: E402
from elasticflow import ops  # noqa: E402

EXPERTS, LR = 3, 0.1


def model(cfg):
    a = cfg.model_args
    global HIDDEN
    HIDDEN = int(a.get("hidden", 48))
    if cfg.backend.name == "tensorflow":
        return _keras(cfg)
    import torch

    torch.manual_seed(cfg.seed)
    net = _Net(a)
    if a.get("lora"):
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules=["block.0", "block.3"],
                                             lora_dropout=0.0))
    if not a.get("native"):
        return net
    head = [p for n, p in net.named_parameters() if "head" in n]
    rest = [p for n, p in net.named_parameters() if "head" not in n]
    return {"net": net, "optimizer": torch.optim.SGD([{"params": rest}, {"params": head, "lr": LR / 10}], lr=LR)}


def _Net(a):
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(64, HIDDEN)
            self.norm = nn.BatchNorm1d(HIDDEN) if a.get("norm") == "batch" else nn.LayerNorm(HIDDEN)
            self.block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Dropout(0.2 if a.get("dropout") else 0.0),
                                       nn.Linear(HIDDEN, HIDDEN))
            if a.get("moe"):
                self.router = nn.Linear(HIDDEN, EXPERTS)
                self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS))
            self.head = nn.Linear(HIDDEN, 10)
            if a.get("frozen"):
                self.embed.requires_grad_(False)
            self.style = str(a.get("checkpointing") or "none")
            self.run_block = torch.compile(self.block, backend="aot_eager") if a.get("compile") else self.block

        def forward(self, x):
            h = self.norm(torch.relu(self.embed(x)))
            if self.style == "call" and torch.is_grad_enabled():
                b = checkpoint(self.run_block, h, use_reentrant=False)
            elif self.style == "forward" and torch.is_grad_enabled():
                b = checkpoint(self.block.forward, h, use_reentrant=False)
            else:
                b = self.run_block(h)
            if hasattr(self, "experts"):
                probs = torch.softmax(self.router(h), -1)
                weight, chosen = probs.max(-1)
                mixed = torch.zeros_like(h)
                for e, expert in enumerate(self.experts):
                    rows = (chosen == e).nonzero(as_tuple=True)[0]
                    if rows.numel():
                        mixed = mixed.index_add(0, rows, expert(h[rows]) * weight[rows, None])
                b = b + mixed
            return self.head(h + b)

    return Net()


def _keras(cfg):
    import keras

    a = cfg.model_args
    keras.utils.set_random_seed(cfg.seed)
    net = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(HIDDEN, activation="relu", name="embed", trainable=not a.get("frozen")),
        keras.layers.BatchNormalization(name="norm") if a.get("norm") == "batch" else
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(HIDDEN, activation="tanh", name="block0"),
        keras.layers.Dropout(0.2 if a.get("dropout") else 0.0, name="drop"),
        keras.layers.Dense(10, name="head"),
    ], name="combo")
    if a.get("native"):
        net.compile(optimizer=keras.optimizers.SGD(LR))
    return net


def forward(x, y, net):
    digits_probe._inject(elasticflow.context())
    if isinstance(net, dict):
        net = net["net"]
    logits = net(x) if hasattr(net, "parameters") else net(x, training=ops.training())
    return ops.cross_entropy(logits, y)
