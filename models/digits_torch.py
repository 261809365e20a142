"""Classify scikit-learn's 8x8 digits with a torch module: `elasticflow train models/digits_torch.py`."""
import torch
from sklearn.datasets import load_digits
from torch import nn


def model(cfg):
    torch.manual_seed(cfg.seed)  # every worker builds the same initial weights
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return {"net": net, "optimizer": torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)}


def forward(x, y, model):
    logits = model["net"](x)
    return {"loss": nn.functional.cross_entropy(logits, y),
            "accuracy": (logits.argmax(dim=1) == y).float().mean()}


def _digits(train):
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int64")
    return (x[:1437], y[:1437]) if train else (x[1437:], y[1437:])


def data(cfg):
    return _digits(train=True)  # (inputs, labels): one sample per row


def eval_data(cfg):
    return _digits(train=False)
