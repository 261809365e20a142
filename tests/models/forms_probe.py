"""One small regression dataset in every form ``data()`` may return (``model_args.form``), for
tests/test_data_forms.py: each form must train the same parameters as the arrays.

model_args:
    form      arrays | mmap | shards | indexed | torch | torch_dict_collate | hf | hf_columns
    dir       where the mmap/shards forms write their .npy files (default: next to this file's run)
    augment   true: every sample gets noise from elasticflow.data.sample_rng(index) in __getitem__
    record    a directory: forward() appends {pid, step, generation, epoch, ids} to <dir>/<pid>.jsonl
    kill      "worker:step": that worker SIGKILLs itself in forward() at that step (generation 0)
    sleep     seconds forward() sleeps per micro-batch (spreads a run out for a kill and a join)
"""
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

import elasticflow
from elasticflow import ops
from elasticflow.distributed.protocol import ENV_WORKER_ID

N, FEATURES = 150, 6


def arrays():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = (x @ rng.normal(size=FEATURES) + 0.1 * rng.normal(size=N)).astype(np.float32)
    return x, y, np.arange(N, dtype=np.int64)


def _noise(i):
    return elasticflow.data.sample_rng(i).normal(scale=0.5, size=FEATURES).astype(np.float32)


class Items(torch.utils.data.Dataset):
    """A map-style torch dataset: one (x, y, id) item per index, as torch tensors."""

    def __init__(self, x, y, ids, augment=False, as_dict=False):
        self.x, self.y, self.ids, self.augment, self.as_dict = x, y, ids, augment, as_dict

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + _noise(i) if self.augment else self.x[i]
        item = (torch.from_numpy(x), torch.tensor(self.y[i]), torch.tensor(self.ids[i]))
        return dict(zip(("x", "y", "id"), item)) if self.as_dict else item


class Batches:
    """An object whose __getitem__ takes an array of indices."""

    def __init__(self, x, y, ids, augment=False):
        self.x, self.y, self.ids, self.augment = x, y, ids, augment

    def __len__(self):
        return len(self.x)

    def __getitem__(self, indices):
        x = self.x[indices]
        if self.augment:
            x = x + np.stack([_noise(i) for i in indices])
        return x, self.y[indices], self.ids[indices]


def collate_items(items):
    return tuple(torch.stack([item[k] for item in items]) for k in ("x", "y", "id"))


_ARGS = {}  # model_args, read by forward() too


def data(cfg):
    _ARGS.clear()
    _ARGS.update({k: cfg.model_args[k] for k in cfg.model_args})
    args = _ARGS
    form = args.get("form", "arrays")
    x, y, ids = arrays()
    augment = bool(args.get("augment", False))
    if form == "arrays":
        return x, y, ids
    if form in ("mmap", "shards"):
        where = Path(args["dir"])
        where.mkdir(parents=True, exist_ok=True)
        for name, a in (("x", x), ("y", y), ("id", ids)):
            for k, part in enumerate(np.array_split(a, 3)):
                np.save(where / f"{name}-{k:03d}.npy", part)
            np.save(where / f"{name}.npy", a)
        if form == "mmap":
            return tuple(np.load(where / f"{name}.npy", mmap_mode="r") for name in ("x", "y", "id"))
        return elasticflow.data.NpyShards(*(str(where / f"{name}-*.npy") for name in ("x", "y", "id")))
    if form == "indexed":
        return Batches(x, y, ids, augment)
    if form == "torch":
        return Items(x, y, ids, augment)
    if form == "torch_dict_collate":
        return elasticflow.data.Mapped(Items(x, y, ids, augment, as_dict=True), collate_fn=collate_items)
    if form in ("hf", "hf_columns"):
        import datasets

        ds = datasets.Dataset.from_dict({"id": ids, "label": y, "features": x})  # not forward()'s order
        return datasets.Dataset.from_dict({"features": x, "label": y, "id": ids}) if form == "hf" \
            else elasticflow.data.Columns(ds, "features", "label", "id")
    raise ValueError(f"unknown form {form!r}")


def model(cfg):
    return {"w": np.zeros((FEATURES, 1), np.float32), "b": np.zeros(1, np.float32)}  # 2-D: TF matmul


def forward(x, y, ids, params):
    args = elasticflow.context()
    cfg_args = _ARGS
    if cfg_args.get("kill") and torch.is_grad_enabled():
        worker, step = (int(v) for v in cfg_args["kill"].split(":"))
        if int(os.environ.get(ENV_WORKER_ID, "0")) == worker and args.step == step and args.generation == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    if cfg_args.get("record") and torch.is_grad_enabled():
        line = {"pid": os.getpid(), "step": args.step, "generation": args.generation, "epoch": args.epoch,
                "ids": ids.tolist()}
        with open(Path(cfg_args["record"]) / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
    if cfg_args.get("sleep") and torch.is_grad_enabled():
        time.sleep(float(cfg_args["sleep"]))
    return ops.mse((x @ params["w"])[:, 0] + params["b"], y)

