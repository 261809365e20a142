"""The global sample order and how a global batch is cut: every sample exactly once per epoch."""
import json
import os
from collections import Counter

import numpy as np
import pytest

from elasticflow.data import order as data
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.trainer import ElasticTrainer


# ---------------------------------------------------------------- pure functions
def test_split_evenly():
    assert data.split_evenly(64, 3) == [22, 21, 21]
    assert data.split_evenly(64, 4) == [16, 16, 16, 16]
    assert data.split_evenly(5, 3) == [2, 2, 1]
    assert data.split_evenly(2, 4) == [1, 1, 0, 0]
    for total, parts in [(97, 5), (1, 1), (0, 3), (1000, 7)]:
        sizes = data.split_evenly(total, parts)
        assert len(sizes) == parts and sum(sizes) == total and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("start, end, world", [(0, 64, 3), (128, 192, 4), (50, 56, 8), (10, 11, 2)])
def test_worker_shares_tile_the_global_batch(start, end, world):
    shares = [data.worker_share((start, end), rank, world) for rank in range(world)]
    assert shares[0][0] == start and shares[-1][1] == end
    for (_, hi), (lo, _) in zip(shares, shares[1:]):
        assert hi == lo  # contiguous, no overlap, no gap
    assert [hi - lo for lo, hi in shares] == data.split_evenly(end - start, world)


def test_worker_share_values():
    assert data.worker_share((0, 64), 0, 3) == (0, 22)
    assert data.worker_share((0, 64), 1, 3) == (22, 43)
    assert data.worker_share((0, 64), 2, 3) == (43, 64)
    assert data.worker_share((64, 128), 0, 1) == (64, 128)


def test_micro_batches():
    assert data.micro_batches(0, 64, 24) == [(0, 24), (24, 48), (48, 64)]
    assert data.micro_batches(0, 64, 16) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert data.micro_batches(10, 74, None) == [(10, 74)]
    assert data.micro_batches(0, 10, 64) == [(0, 10)]
    assert data.micro_batches(5, 5, 4) == []


def test_permutation_is_deterministic_per_seed_and_epoch():
    a = data.permutation(1000, seed=3, epoch=2)
    assert np.array_equal(a, data.permutation(1000, seed=3, epoch=2))
    assert sorted(a.tolist()) == list(range(1000))
    assert not np.array_equal(a, data.permutation(1000, seed=3, epoch=3))
    assert not np.array_equal(a, data.permutation(1000, seed=4, epoch=2))
    assert not np.array_equal(a, np.arange(1000))


def test_steps_per_epoch():
    assert data.steps_per_epoch(70, 16, drop_last=False) == 5
    assert data.steps_per_epoch(70, 16, drop_last=True) == 4
    assert data.steps_per_epoch(64, 16, drop_last=True) == 4


def test_dataset_checks():
    with pytest.raises(ElasticFlowError, match=r"unequal length \(#0: 10, #1: 9 rows\)"):
        data.Dataset((np.zeros((10, 2)), np.zeros(9)))
    with pytest.raises(ElasticFlowError, match="fewer than one global batch of 64"):
        data.check_size(63, 64)
    with pytest.raises(ElasticFlowError, match="returned a int"):
        data.Dataset(5)
    assert len(data.Dataset((np.zeros((7, 3)), np.zeros(7)))) == 7


def test_a_dict_of_arrays_is_refused_not_read_as_two_samples():
    # A dict has __len__ and __getitem__, but its length is its number of keys: the user would be
    # told "data() has 2 samples, fewer than one global batch" about 1000 rows.
    with pytest.raises(ElasticFlowError, match="returned a dict") as info:
        data.Dataset({"x": np.zeros((1000, 3)), "y": np.zeros(1000)})
    assert "tuple" in info.value.hint


# ---------------------------------------------------------------- through the trainer
# ids run 0..69; __getitem__(indices) appends what it served to served.txt; forward() appends
# the ids it trained on (with autograd on: not the trainer's evaluation passes) to trained.txt.
RECORDING = '''
import time
from pathlib import Path

import numpy as np
import torch
from elasticflow import ops

HERE = Path(__file__).parent
N = 70


class Recording:
    def __len__(self):
        return N

    def __getitem__(self, indices):
        indices = np.asarray(indices)
        with open(HERE / "served.txt", "a") as f:
            f.write(" ".join(map(str, indices.tolist())) + "\\n")
        x = np.stack([indices.astype(np.float32), np.ones(len(indices), np.float32)], axis=1)
        return x, (indices % 3).astype(np.float32)


def model(cfg):
    return {"w": np.zeros(2, np.float32)}


def forward(x, y, params):
    if torch.is_grad_enabled():
        with open(HERE / "trained.txt", "a") as f:
            f.write(" ".join(str(int(i)) for i in x[:, 0].tolist()) + "\\n")
        time.sleep(0.01)  # a step that takes time, as real ones do: the readers get to read ahead meanwhile
    return ops.mse(x @ params["w"] * 0.001, y)


def data(cfg):
    return Recording()
'''


def read_ids(path):
    return [[int(i) for i in line.split()] for line in path.read_text().splitlines()]


def fit(path, run_dir, *overrides):
    cfg = compose(str(path), ["trainer.global_batch_size=16", "trainer.log_every=1", "trainer.progress=false",
                              "optimizer.lr=0.01", *overrides])
    summary = ElasticTrainer(str(path), cfg, run_dir=str(run_dir)).fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in records if "loss" in r]


@pytest.mark.parametrize("micro,prefetch", [("null", 0), (5, 0), ("null", 2), (5, 3)])
def test_every_sample_once_per_epoch_including_the_last_partial_batch(tmp_path, write_model, micro, prefetch):
    path = write_model(RECORDING)
    summary, records = fit(path, tmp_path / "run", "trainer.epochs=2", "seed=7", f"trainer.micro_batch_size={micro}",
                           f"data.prefetch={prefetch}")
    order = np.concatenate([data.permutation(70, 7, 0), data.permutation(70, 7, 1)]).tolist()
    trained = [i for chunk in read_ids(tmp_path / "trained.txt") for i in chunk]
    assert trained == order  # each epoch: its permutation, in order, every id exactly once
    served_chunks = read_ids(tmp_path / "served.txt")[1:]  # the first: the metric probe's two samples
    if prefetch == 0:
        served = [i for chunk in served_chunks for i in chunk]
        assert served == order  # ...fetched through __getitem__(indices), when trained
    else:  # read ahead in a thread: every trained micro-batch read once, and nothing past the last step
        # (a third epoch's micro-batches would never be trained)
        served, trained_chunks = Counter(map(tuple, served_chunks)), Counter(map(tuple, read_ids(tmp_path / "trained.txt")))
        assert served == trained_chunks and max(served.values()) == 1
    # 70 = 4 x 16 + 6: five steps per epoch, the fifth a global batch of 6
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["epoch"] for r in records] == [0] * 5 + [1] * 5
    assert [r["samples_seen"] for r in records] == [16, 32, 48, 64, 70, 86, 102, 118, 134, 140]
    assert summary["step"] == 10 and summary["samples_seen"] == 140 and summary["epochs_completed"] == 2
    if micro == 5:  # 16 = 5 + 5 + 5 + 1 and the last batch 6 = 5 + 1
        chunks = read_ids(tmp_path / "trained.txt")
        assert [len(c) for c in chunks[:5]] == [5, 5, 5, 1, 5]


def test_shuffle_false_trains_the_samples_in_datas_order_every_epoch(tmp_path, write_model):
    path = write_model(RECORDING)
    fit(path, tmp_path / "run", "trainer.epochs=2", "data.shuffle=false", "trainer.micro_batch_size=5")
    trained = [i for chunk in read_ids(tmp_path / "trained.txt") for i in chunk]
    assert trained == list(range(70)) * 2


# The first step waits (10 s at most) until the reads ahead of it have reached step 4's batch.
READ_AHEAD = RECORDING.replace("""        time.sleep(0.01)  # a step""", """        served = HERE / "served.txt"
        deadline = time.monotonic() + 10
        while len(served.read_text().splitlines()) < 1 + 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # the metric probe's read, then steps 1..4's batches
        if not (HERE / "seen.txt").exists():  # the first step's view
            (HERE / "seen.txt").write_text(str(len(served.read_text().splitlines()) - 1))
        time.sleep(0.01)  # a step""")


def test_data_prefetch_reads_that_many_micro_batches_ahead_across_steps(tmp_path, write_model):
    # One micro-batch per step: data.prefetch=3 reads the next three steps' batches while one trains
    # (it once read only the next step's, whatever data.prefetch said).
    path = write_model(READ_AHEAD)
    fit(path, tmp_path / "run", "trainer.max_steps=6", "data.prefetch=3")
    assert int((tmp_path / "seen.txt").read_text()) >= 4


def test_loader_processes_take_their_cores_from_the_intra_op_threads(tmp_path, write_model, monkeypatch):
    import torch

    from elasticflow._util import affinity

    monkeypatch.setattr(affinity, "others_running", lambda: 0.0)  # an idle host (the default counts busy cores)
    path = write_model(RECORDING)
    cores, before = os.cpu_count() or 1, torch.get_num_threads()
    try:
        for k, (overrides, want) in enumerate((
                (["data.worker_type=process", "data.workers=2"], max(1, cores - 2)),
                (["data.workers=2"], cores),  # threads: a reader holds the GIL, not a core
                (["data.worker_type=process", "data.workers=2", "backend.threads=3"], 3))):
            cfg = compose(str(path), ["trainer.global_batch_size=16", "trainer.max_steps=1", *overrides])
            # A run directory each: three runs in one process and one second would name the same checkpoint
            # folder, which the first still holds (checkpoint/jobdir.py's lease).
            ElasticTrainer(str(path), cfg, run_dir=str(tmp_path / f"run{k}")).prepare()
            assert torch.get_num_threads() == want, overrides
    finally:
        torch.set_num_threads(before)


def test_drop_last_skips_the_partial_batch(tmp_path, write_model):
    path = write_model(RECORDING)
    summary, records = fit(path, tmp_path / "run", "trainer.epochs=2", "seed=7", "trainer.drop_last=true")
    order = (data.permutation(70, 7, 0)[:64].tolist() + data.permutation(70, 7, 1)[:64].tolist())
    trained = [i for chunk in read_ids(tmp_path / "trained.txt") for i in chunk]
    assert trained == order
    assert [r["samples_seen"] for r in records] == [16 * k for k in range(1, 9)]
    assert [r["epoch"] for r in records] == [0] * 4 + [1] * 4
    assert summary["step"] == 8 and summary["epochs_completed"] == 2


def test_max_steps_stops_mid_epoch(tmp_path, write_model):
    path = write_model(RECORDING)
    summary, records = fit(path, tmp_path / "run", "trainer.max_steps=7", "seed=1")
    trained = [i for chunk in read_ids(tmp_path / "trained.txt") for i in chunk]
    assert trained == data.permutation(70, 1, 0).tolist() + data.permutation(70, 1, 1)[:32].tolist()
    assert summary["step"] == 7 and records[-1]["samples_seen"] == 102
