"""A mixture of experts on the digits, written as users write one, with digits_probe's fault injection.

Top-2 routing over 6 experts with a Switch-style load-balancing loss. An expert that no sample of a micro-batch
is routed to is not called, so its parameters get no gradient (torch leaves ``.grad`` None and torch.optim skips
them); two experts start with a router bias that makes them rare, so in most steps nobody reaches them and in
some somebody does. ``spare`` is a head left over from pretraining that forward() never uses: it never gets a
gradient at all. ``model_args.optimizer`` (adam, adamw or sgd) returns a torch.optim optimizer from model().
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import elasticflow

sys.path.insert(0, str(Path(__file__).resolve().parent))
import digits_probe  # noqa: E402

EXPERTS, TOP, HIDDEN = 6, 2, 24
RARE_BIAS = (0.0, 0.0, 0.0, 0.0, -2.5, -3.5)  # the router's start: experts 4 and 5 are seldom chosen
AUX_WEIGHT = 0.05


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(64, HIDDEN)
        self.router = torch.nn.Linear(HIDDEN, EXPERTS)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN))
            for _ in range(EXPERTS))
        self.head = torch.nn.Linear(HIDDEN, 10)
        self.spare = torch.nn.Linear(HIDDEN, 10)
        with torch.no_grad():
            self.router.bias.copy_(torch.tensor(RARE_BIAS))

    def forward(self, x):
        h = F.relu(self.embed(x))
        probs = F.softmax(self.router(h), dim=-1)
        weights, chosen = probs.topk(TOP, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:  # no sample routed here: the expert is not called
                continue
            mixed = mixed.index_add(0, rows, expert(h[rows]) * weights[rows, slot, None])
        # Switch Transformer's auxiliary loss: the fraction routed to each expert times its mean probability.
        routed = F.one_hot(chosen, EXPERTS).sum(1).float().mean(0) / TOP
        aux = EXPERTS * (routed * probs.mean(0)).sum()
        return self.head(h + mixed), aux


def model(cfg):
    torch.manual_seed(cfg.seed)
    net = MoE()
    kind = cfg.model_args.get("optimizer", "adam")
    params = net.parameters()
    opt = {"adam": lambda: torch.optim.Adam(params, lr=1e-2),
           "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
           "sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)}[kind]()
    return {"net": net, "optimizer": opt}


def forward(x, y, net):
    digits_probe._inject(elasticflow.context())
    logits, aux = net["net"](x)
    return F.cross_entropy(logits, y) + AUX_WEIGHT * aux


data = digits_probe.data  # the digits training split (recording fetches under EF_PROBE_RECORD)
