"""The dataset forms users bring (torch map-style datasets, Hugging Face datasets, arrays on disk),
prefetch, per-sample randomness, and the errors a broken source gets.

Each form trains the same parameters as the same rows given as arrays; exactly-once with prefetch
is checked from what forward() trained on, across a real SIGKILL and a join.
"""
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import elasticflow
from harness import assert_equivalent, cli, events, finish, reap, run_cli, start, wait_for
from elasticflow.data import order as data
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.trainer import ElasticTrainer

PROBE = Path(__file__).parent / "models" / "forms_probe.py"
COMMON = ["trainer.global_batch_size=32", "trainer.micro_batch_size=8", "trainer.epochs=2", "trainer.log_every=1",
          "trainer.progress=false", "optimizer.lr=0.05", "seed=5"]


def fit(run_dir: Path, *overrides: str) -> dict:
    cfg = compose(str(PROBE), [*COMMON, *overrides])
    trainer = ElasticTrainer(str(PROBE), cfg, run_dir=str(run_dir))
    trainer.fit()
    params = {k: v.copy() for k, v in trainer.engine.state().items() if k in ("w", "b")}
    assert params.keys() == {"w", "b"}
    return params


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("arrays"), "+model_args.form=arrays")


@pytest.mark.parametrize("form,extra", [
    ("mmap", []), ("shards", []), ("indexed", []), ("torch", []), ("torch_dict_collate", []),
    ("hf", []), ("hf_columns", []),
    ("torch", ["data.prefetch=0"]), ("torch", ["data.workers=2", "data.prefetch=4"]),
    ("torch", ["data.worker_type=process", "data.workers=2"]),
])
def test_each_form_trains_the_array_forms_parameters(tmp_path, reference, form, extra):
    got = fit(tmp_path / "run", f"+model_args.form={form}", f"+model_args.dir={tmp_path / 'npy'}", *extra)
    assert got.keys() == reference.keys()
    for name in reference:
        np.testing.assert_array_equal(got[name], reference[name], err_msg=f"{form} {extra}: {name}")


def test_memory_mapped_arrays_are_read_per_batch_not_loaded(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(40, dtype=np.float32).reshape(20, 2))
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    ds = data.Dataset((x, np.zeros(20, np.float32)))
    assert ds.arrays is None  # not made resident: a 2 GB file would be read whole
    rows = ds.fetch(np.array([7, 2, 19]))
    np.testing.assert_array_equal(rows[0], [[14, 15], [4, 5], [38, 39]])


def test_npy_shards_join_files_in_name_order(tmp_path):
    for k, part in enumerate(np.array_split(np.arange(10), 3)):
        np.save(tmp_path / f"a-{k}.npy", part)
    shards = data.NpyShards(str(tmp_path / "a-*.npy"))
    assert len(shards) == 10
    np.testing.assert_array_equal(shards.read(np.array([9, 0, 4, 3, 5])), [[9, 0, 4, 3, 5]])
    with pytest.raises(ElasticFlowError, match="no file matches"):
        data.NpyShards(str(tmp_path / "b-*.npy"))
    np.save(tmp_path / "c-0.npy", np.zeros(3))
    with pytest.raises(ElasticFlowError, match="different numbers of rows"):
        data.NpyShards(str(tmp_path / "a-*.npy"), str(tmp_path / "c-*.npy"))


def test_hf_columns_name_a_missing_column():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"x": [1, 2], "y": [0, 1]})
    with pytest.raises(ElasticFlowError, match="no column 'label'") as info:
        data.Columns(ds, "x", "label")
    assert "'x', 'y'" in info.value.hint


# ---------------------------------------------------------------- refusals and errors
def iterable_sources():
    import torch

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(3)

    def gen():
        yield np.zeros(3)

    return [(Stream(), "torch IterableDataset"), (gen(), "an iterable"),
            (torch.utils.data.DataLoader([1, 2, 3]), "torch DataLoader")]


def test_iterable_sources_are_refused_with_why():
    for source, kind in iterable_sources():
        with pytest.raises(ElasticFlowError, match=kind) as info:
            data.Dataset(source)
        assert "exactly-once" in info.value.message and info.value.hint


def test_tf_data_is_refused_with_what_to_return_instead():
    tf = pytest.importorskip("tensorflow")
    with pytest.raises(ElasticFlowError, match="tf.data.Dataset.*in order") as info:
        data.Dataset(tf.data.Dataset.from_tensor_slices(np.zeros(4)))
    assert "as_numpy_iterator" in info.value.hint
    # The usual dataset of dicts, batched: the hint's code, run as written, gives the arrays by key.
    x, y = np.arange(12, dtype=np.float32).reshape(6, 2), np.arange(6)
    ds = tf.data.Dataset.from_tensor_slices({"image": x, "label": y}).batch(4).prefetch(1)
    with pytest.raises(ElasticFlowError) as info:
        data.Dataset(ds)
    code = info.value.hint.split("return the arrays it reads: ")[1].split(" (order the keys")[0]
    scope = {"np": np, "ds": ds}
    exec("def data():\n    " + code.replace("; ", "\n    "), scope)
    got = scope["data"]()
    assert len(got) == 2 and np.array_equal(got[0], x) and np.array_equal(got[1], y)


class Broken:
    def __len__(self):
        return 50

    def __getitem__(self, indices):
        if 37 in np.atleast_1d(indices):
            raise KeyError("corrupt record")
        return np.zeros((len(indices), 2), np.float32), np.zeros(len(indices), np.float32)


def test_a_raising_getitem_names_the_sample():
    ds = data.Dataset(Broken())
    with pytest.raises(ElasticFlowError, match=r"reading sample 37 raised KeyError: 'corrupt record'"):
        ds.fetch(np.array([3, 12, 37, 40]))


def test_per_item_rows_of_another_shape_name_the_sample():
    class Ragged:
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.zeros(3 if i != 6 else 4, np.float32), np.float32(i)

    with pytest.raises(ElasticFlowError, match=r"sample 6's field #0 is float32 of shape \(4,\)"):
        data.Dataset(data.Mapped(Ragged())).fetch(np.array([1, 6, 2]))


def test_a_batch_of_another_dtype_or_length_is_caught_with_its_samples():
    class Drifting(Broken):
        def __getitem__(self, indices):
            x = np.zeros((len(indices), 2), np.float64 if 9 in indices else np.float32)
            return x, np.zeros(len(indices) - (1 if 4 in indices else 0), np.float32)

    ds = data.Dataset(Drifting())
    ds.fetch(np.array([0, 1]))
    with pytest.raises(ElasticFlowError, match=r"batch of samples \[9, 2\] has fields #0 float64"):
        ds.fetch(np.array([9, 2]))
    with pytest.raises(ElasticFlowError, match=r"do not have len\(indices\)=2 rows .* samples \[4, 5\]"):
        ds.fetch(np.array([4, 5]))


DYING_LOADER = '''
import os
import numpy as np
from elasticflow import ops


class Dying:
    def __len__(self):
        return 64

    def __getitem__(self, indices):
        if os.environ.get("ELASTICFLOW_DATA_LOADER") and 40 in np.asarray(indices):
            os._exit(3)  # a loader process killed (e.g. for memory) while reading
        return np.ones((len(indices), 2), np.float32), np.zeros(len(indices), np.float32)


def model(cfg):
    return {"w": np.zeros(2, np.float32)}


def forward(x, y, params):
    return ops.mse(x @ params["w"], y)


def data(cfg):
    return Dying()
'''


def test_a_dead_loader_process_is_an_error_not_a_hang(tmp_path, write_model):
    path = write_model(DYING_LOADER)
    proc = run_cli(["train", path, f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress=false",
                    "trainer.global_batch_size=8", "data.worker_type=process", "data.workers=2"], timeout=120)
    assert proc.returncode != 0  # an exit, with the error below (a hang would pass the 120 s deadline)
    assert "error: a data loader process died" in proc.stderr and "hint:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_data_settings_are_validated(tmp_path):
    for override, message in (("data.prefetch=-1", "data.prefetch must be an integer >= 0"),
                              ("data.workers=0", "data.workers must be a positive integer"),
                              ("data.worker_type=fibers", "data.worker_type must be one of thread, process")):
        proc = cli(["train", PROBE, f"hydra.run.dir={tmp_path / 'run'}", override])
        assert proc.returncode == 2 and f"error: {message}" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- per-sample randomness
def test_sample_seed_depends_on_seed_epoch_and_index_only():
    ctx = elasticflow.context()
    ctx.seed = 11
    a = data.sample_seed(5, epoch=0)
    assert a == data.sample_seed(5, epoch=0) and a != data.sample_seed(6, epoch=0) != data.sample_seed(5, epoch=1)
    ctx.seed = 12
    assert data.sample_seed(5, epoch=0) != a
    ctx.seed = 0


def test_augmented_samples_do_not_depend_on_prefetch_or_readers(tmp_path):
    base = ["+model_args.form=torch", "+model_args.augment=true"]
    want = fit(tmp_path / "a", *base, "data.prefetch=0")
    for extra in (["data.prefetch=3", "data.workers=2"], ["data.worker_type=process", "data.workers=2"]):
        got = fit(tmp_path / "b", *base, *extra)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{extra}: {name}")
    plain = fit(tmp_path / "c", "+model_args.form=torch")
    assert not np.array_equal(plain["w"], want["w"])  # the augmentation did change the data


# ---------------------------------------------------------------- elastic, with prefetch
def committed_ids(run_dir: Path, record: Path) -> dict:
    """Per epoch, the ids forward() trained on in the generation that committed each step."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    committed = {r["step"]: r["generation"] for r in metrics if "loss" in r}
    per_epoch = {}
    for f in record.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if committed.get(r["step"]) == r["generation"]:
                per_epoch.setdefault(r["epoch"], Counter()).update(r["ids"])
    return per_epoch


def test_prefetch_exactly_once_and_equal_to_one_worker_across_a_kill_and_a_join(tmp_path):
    common = [*COMMON, "trainer.epochs=8", "+model_args.form=torch", "+model_args.augment=true",
              "data.prefetch=3", "data.workers=2", "elastic.timeout_s=15", "elastic.heartbeat_timeout_s=5"]
    one = tmp_path / "one"  # at full speed: forward's sleep only delays, it changes no number
    run_cli(["train", PROBE, f"hydra.run.dir={one}", *common], timeout=240, check=True)
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    proc = start(run, "launcher.workers=3", "launcher.max_workers=3", f"+model_args.record={record}",
                 "+model_args.kill=1:4", "+model_args.sleep=0.1", model=PROBE,
                 common=["trainer.progress=false", *common])
    try:
        wait_for(lambda: events(run, "left"), 120, "worker 1 to die at step 4 (3 -> 2 workers)", proc=proc)
        scale = run_cli(["scale", run, "--workers", "3"], timeout=150)
        out = finish(proc)
    finally:
        reap(proc)
    assert proc.returncode == 0, out[-4000:]
    assert scale.returncode == 0, scale.stdout + scale.stderr
    worlds = [json.loads(line).get("world_size") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3  # killed, then joined
    for epoch, ids in committed_ids(run, record).items():
        assert ids == Counter(range(150)), f"epoch {epoch}"
    assert sorted(committed_ids(run, record)) == list(range(8))
    assert_equivalent(run, one)


def test_tensorflow_reads_ahead_the_same_rows(tmp_path):
    pytest.importorskip("tensorflow")
    want = fit(tmp_path / "a", "backend=tensorflow", "+model_args.form=arrays")
    got = fit(tmp_path / "b", "backend=tensorflow", "+model_args.form=torch", "data.prefetch=3", "data.workers=2")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ---------------------------------------------------------------- collate(samples)
def test_a_collate_dict_reaches_forward_by_name_and_a_list_of_samples_is_collated():
    from elasticflow.data.order import Dataset

    def collate(samples):  # keys in another order than forward(x, y)'s parameters, as a BatchEncoding may be
        return {"y": np.asarray([s["y"] for s in samples]), "x": np.stack([s["x"] for s in samples])}

    samples = [{"x": np.full(2, i, np.float32), "y": i} for i in range(6)]
    batch = Dataset(samples, collate=collate, names=["x", "y"]).fetch(np.asarray([4, 1]))
    np.testing.assert_array_equal(batch[0], [[4, 4], [1, 1]])
    np.testing.assert_array_equal(batch[1], [4, 1])
    # forward(*batch): no names to go by, so the dict's own order
    assert Dataset(samples, collate=collate).fetch(np.asarray([4]))[0].tolist() == [4]


def test_a_collate_that_fails_is_named_with_its_samples():
    from elasticflow.data.order import Dataset

    def pad(samples):
        raise ValueError("no pad token")

    with pytest.raises(ElasticFlowError) as info:
        Dataset([(np.zeros(2),)] * 4, collate=pad).fetch(np.asarray([2, 0]))
    assert info.value.message == "pad() raised ValueError: no pad token (on samples [2, 0])"
    assert info.value.hint.startswith("fix pad(samples)")

    def unpadded(samples):
        return ([[1, 2], [3]],)

    with pytest.raises(ElasticFlowError) as info:
        Dataset([(np.zeros(2),)] * 4, collate=unpadded).fetch(np.asarray([0, 1]))
    assert info.value.message.startswith("unpadded() returned a field numpy cannot make one array of")
