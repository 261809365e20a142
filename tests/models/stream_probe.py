"""A regression read from a sharded corpus (``elasticflow.data.Shards``) that mixes jsonl, parquet, ``.npy`` rows,
nanoGPT ``.bin`` tokens and WebDataset ``.tar`` shards; ``collate`` turns each format's samples into (ids, x, y), and ``forward`` records the
sample ids each step trains on, so a test can count every sample's uses.

Environment:
    EF_STREAM_CORPUS  the corpus folder (``write_corpus`` fills it; the test calls it before training).
    EF_STREAM_RECORD  a folder: forward() appends {pid, worker, generation, step, epoch, ids} per micro-batch
                      to <folder>/<pid>.jsonl (harness.consumed_by_epoch reads them).
    EF_STREAM_KILL    "worker:step": that worker SIGKILLs itself inside forward() at that step (generation 0).
    EF_STREAM_LIMIT   a file holding a step number: forward() of a later step waits while the file says so
                      (harness.Limit: a test lets training go exactly as far as it needs).
    EF_STREAM_HF      set: data() is a Hugging Face stream of the jsonl shards, as an HF user writes one, with
                      per-example transforms (``hf_stream``); a sample's id is its position in that stream.
"""
import io
import json
import os
import signal
import tarfile
import time

import numpy as np
import torch

import elasticflow
from elasticflow.distributed.protocol import ENV_WORKER_ID

SIZES = {"a.jsonl": 37, "b.parquet": 50, "c.npy": 41, "d.tar": 29, "e.jsonl": 45, "f.parquet": 38, "g.bin": 30}
TOKENS = 4  # a .bin sample: TOKENS uint16 token ids, the first its sample id
SAMPLES = sum(SIZES.values())
FEATURES = 4
WORKER = int(os.environ.get(ENV_WORKER_ID, "0"))


def sample(i):
    rng = np.random.default_rng(i)
    x = rng.normal(size=FEATURES).astype(np.float32)
    return x, np.float32(x.sum() * 0.5 + 1.0 + rng.normal() * 0.1)


def write_corpus(folder):
    """Each shard's samples, with their global ids in the file order of the shards (sorted by name)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    first = 0
    for name, n in SIZES.items():
        ids = range(first, first + n)
        rows = [{"id": i, "x": sample(i)[0].tolist(), "y": float(sample(i)[1])} for i in ids]
        path = os.path.join(folder, name)
        if name.endswith(".jsonl"):
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        elif name.endswith(".parquet"):
            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
        elif name.endswith(".bin"):  # token windows: the id, then padding tokens (x and y follow from the id)
            np.asarray([[i] + [0] * (TOKENS - 1) for i in ids], np.uint16).tofile(path)
        elif name.endswith(".npy"):
            np.save(path, np.asarray([[r["id"], *r["x"], r["y"]] for r in rows], np.float32))
        else:
            with tarfile.open(path, "w") as tar:
                for r in rows:
                    blob = json.dumps(r).encode()
                    info = tarfile.TarInfo(f"{r['id']:06d}.json")
                    info.size = len(blob)
                    tar.addfile(info, io.BytesIO(blob))
        first += n


def model(cfg):
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


HF_FILES = ("e.jsonl", "a.jsonl")  # the stream's order; Shards sorts them (a, e): positions map back


def hf_stream(folder):
    """The jsonl shards as a ``datasets`` stream, cast, mapped, renamed and selected: its sample at position i
    has ``sid`` i (``map(with_indices=True)``), the file sample's x and its ``y`` as float32 (renamed ``target``)."""
    import datasets

    stream = datasets.load_dataset("json", data_files=[os.path.join(folder, f) for f in HF_FILES], split="train",
                                   streaming=True)
    return (stream.cast_column("y", datasets.Value("float32"))
            .map(lambda s, i: {"sid": i, "x": [v * 1.0 for v in s["x"]]}, with_indices=True)
            .rename_column("y", "target").select_columns(["sid", "x", "target"]))


def data(cfg):
    if os.environ.get("EF_STREAM_HF"):
        return hf_stream(os.environ["EF_STREAM_CORPUS"])
    return elasticflow.data.Shards(os.path.join(os.environ["EF_STREAM_CORPUS"], "*"), window=2, seq_len=TOKENS)


def collate(samples):
    rows = []
    for s in samples:
        if isinstance(s, np.ndarray) and s.dtype == np.uint16:  # a token window: its id first
            x, y = sample(int(s[0]))
            rows.append((int(s[0]), x, float(y)))
            continue
        if isinstance(s, np.ndarray):  # a .npy row: id, x..., y
            rows.append((int(s[0]), s[1:1 + FEATURES], float(s[-1])))
            continue
        if "sid" in s:  # a sample of hf_stream()
            rows.append((s["sid"], s["x"], s["target"]))
            continue
        if "json" in s:  # a WebDataset sample: {"__key__", "json": bytes}
            s = json.loads(s["json"])
        rows.append((s["id"], s["x"], s["y"]))
    return (np.asarray([r[0] for r in rows], np.int64), np.asarray([r[1] for r in rows], np.float32),
            np.asarray([r[2] for r in rows], np.float32))


def forward(ids, x, y, net):
    ctx = elasticflow.context()
    kill = os.environ.get("EF_STREAM_KILL")
    if kill and ctx.generation == 0 and [int(v) for v in kill.split(":")] == [WORKER, ctx.step]:
        os.kill(os.getpid(), signal.SIGKILL)
    limit, deadline = os.environ.get("EF_STREAM_LIMIT"), time.monotonic() + 120
    while limit and ctx.step > _allowed(limit) and time.monotonic() < deadline:
        time.sleep(0.01)
    record = os.environ.get("EF_STREAM_RECORD")
    if record:
        line = {"pid": os.getpid(), "worker": WORKER, "generation": ctx.generation, "step": ctx.step,
                "epoch": ctx.epoch, "ids": ids.tolist()}
        with open(os.path.join(record, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
    return torch.nn.functional.mse_loss(net(x).squeeze(-1), y)


def _allowed(path):
    """The last step the limit file lets run (every step once it is gone; none while it is torn)."""
    try:
        with open(path) as f:
            return int(f.read())
    except FileNotFoundError:
        return float("inf")
    except ValueError:
        return 0
