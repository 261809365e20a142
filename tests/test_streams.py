"""Sharded corpora (``elasticflow.data.Shards``): jsonl, parquet, ``.npy``/``.bin`` tokens and WebDataset ``.tar``
read at any index through a per-shard index cached beside the data; an order shuffled within windows of shards,
the same for any number of workers; every sample exactly once across a kill, a join and a resume at another size.
"""
import json
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from harness import (Limit, assert_each_sample_once, assert_equivalent, finish, members, metrics, start, train,
                     train_in_process, world_sizes)
from elasticflow.data import Shards
from elasticflow.data.order import Dataset
from elasticflow.errors import ElasticFlowError

sys.path.insert(0, str(Path(__file__).parent / "models"))
import stream_probe  # noqa: E402

MODEL = Path(__file__).parent / "models" / "stream_probe.py"
COMMON = ["trainer.progress=false", "trainer.global_batch_size=20", "trainer.micro_batch_size=4", "trainer.log_every=1", "backend.threads=1",
          "optimizer.lr=0.1", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    stream_probe.write_corpus(str(folder))
    return folder


def test_three_workers_a_kill_a_join_and_a_resume_at_two_use_every_sample_once(tmp_path, corpus):
    """Epochs 1-2 on 3 workers (one SIGKILLed at step 4 and replaced: a join), then epoch 3 resumed on 2:
    per epoch each of the 270 samples (7 shards, 5 formats) trains in exactly one committed step, and the model
    is one worker's."""
    run, record, alone = tmp_path / "run", tmp_path / "record", tmp_path / "alone"
    record.mkdir()
    env = {"EF_STREAM_CORPUS": str(corpus), "EF_STREAM_RECORD": str(record)}
    limit = Limit(tmp_path / "limit", step=5, last=20)
    proc = start(run, "trainer.epochs=2", "launcher.workers=3", "launcher.restart_failed=true", model=MODEL,
                 common=COMMON, env={**env, "EF_STREAM_KILL": "1:4", "EF_STREAM_LIMIT": str(limit.path)})
    limit.advance_until(run, lambda: 2 in world_sizes(run) and len(members(run)) == 3, 120, "the replacement")
    limit.lift()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    sizes = world_sizes(run)
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes  # the kill, then the replacement joined
    train(MODEL, run, *COMMON, "trainer.epochs=3", "launcher.workers=2", env=env)
    assert [r["world_size"] for r in metrics(run) if "loss" in r][-1] == 2
    assert_each_sample_once(run, record, samples=stream_probe.SAMPLES)
    assert metrics(run)[-1]["samples_seen"] == 3 * stream_probe.SAMPLES
    train(MODEL, alone, *COMMON, "trainer.epochs=3", env={"EF_STREAM_CORPUS": str(corpus)})
    assert_equivalent(run, alone, records=False)


def test_the_order_is_each_sample_once_per_epoch_local_to_a_window_and_alike_everywhere(corpus):
    shards = Shards(str(corpus / "*"), window=2, seq_len=stream_probe.TOKENS)
    assert len(shards) == stream_probe.SAMPLES
    order = shards.order(seed=3, epoch=0)
    ids = np.concatenate([order[a:a + 20] for a in range(0, len(order), 20)])  # read as global batches are
    assert sorted(ids) == list(range(len(shards)))
    assert not np.array_equal(ids, shards.order(seed=3, epoch=1)[0:len(order)])  # another order each epoch
    again = Shards(str(corpus / "*"), window=2, seq_len=stream_probe.TOKENS)
    np.testing.assert_array_equal(ids, again.order(3, 0)[0:len(order)])
    # Locality: the first window's positions hold the samples of two shards only, and that window is all
    # the order keeps of the epoch.
    first = order.windows[0]
    span = order[0:int(order.starts[1])]
    owners = np.searchsorted(shards.offsets, span, side="right") - 1
    assert set(owners) == set(first) and len(first) == 2
    assert len(order._kept) <= 3
    np.testing.assert_array_equal(shards.order(3, 0, shuffle=False)[0:len(shards)], np.arange(len(shards)))


def test_the_next_windows_shards_are_read_ahead_as_a_window_is_first_sliced(corpus, monkeypatch):
    """Cold, rows read at random came page by page from disk: each window's first slice asks the kernel for the
    next window's files (posix_fadvise WILLNEED), once; the last window has none after it."""
    from elasticflow.data import rows

    told = []
    monkeypatch.setattr(rows, "_advise", lambda fd: told.append(os.readlink(f"/proc/self/fd/{fd}")))
    shards = Shards(str(corpus / "*"), window=2, seq_len=stream_probe.TOKENS)
    order = shards.order(seed=3, epoch=0)
    paths = lambda w: {shards.shards[s].path for s in order.windows[w]}  # noqa: E731
    order[0:5]
    assert set(told) == paths(1)
    order[5:10]
    assert len(told) == len(paths(1))  # once a window
    told.clear()
    order[int(order.starts[1]):int(order.starts[1]) + 5]
    assert set(told) == paths(2)
    told.clear()
    order[len(order) - 5:len(order)]
    assert told == []
    rows.read_ahead(str(corpus / "no such shard"))  # a hint only: a missing file is reported when it is read


def test_every_format_reads_the_samples_written(corpus):
    shards = Shards(str(corpus / "*"), seq_len=stream_probe.TOKENS)
    picked = np.asarray([239, 0, 40, 100, 37, 150, 1, 199, 269, 245])  # across every shard, unsorted
    got = stream_probe.collate(shards.samples(picked))
    np.testing.assert_array_equal(got[0], picked)
    np.testing.assert_allclose(got[1], np.stack([stream_probe.sample(i)[0] for i in picked]))


def test_lines_parsed_together_are_what_json_loads_gives_each_and_a_bad_line_is_named(tmp_path):
    """Jsonl parses a read's lines as one string (shard_formats.parse_lines): the same values as json.loads line
    by line, and whatever a line holds that json.loads refuses (two values, half a value, a blank line, bytes that
    are not UTF-8) is refused, naming its line, never joined with a neighbour into one value."""
    from elasticflow.data.shard_formats import parse_lines

    good = [b'{"a": [1, 2.5e3, null], "s": "\\u00e9t\xc3\xa9 \\n"}\n', b'  [true, {}] \r\n', b'"x"\t\n', b"-0.0\n",
            b"NaN"]
    assert parse_lines(good)[:4] == [json.loads(line) for line in good][:4] and np.isnan(parse_lines(good)[4])
    for bad in ([b"[1,\n", b"2]\n"], [b"1 2\n"], [b"   \n", b"3\n"], [b'"\xff"\n'], [b"{}\n", b"[\n", b"]\n"]):
        with pytest.raises((ValueError, StopIteration)):
            parse_lines(bad)
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b'{"i": 0}\n{"i": [1,\n2]}\n{"i": 3}\n')
    shards = Shards(str(folder / "a.jsonl"))
    assert shards.samples(np.asarray([0, 3])) == [{"i": 0}, {"i": 3}]
    with pytest.raises(ElasticFlowError, match=r"a.jsonl: line 2 \(counting non-empty lines\) is not JSON"):
        shards.samples(np.asarray([0, 1, 2, 3]))


def test_a_changed_shard_is_indexed_again_and_read_only_data_indexes_under_the_cache(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(5)))
    assert len(Shards(str(folder / "a.jsonl"))) == 5
    with open(folder / "a.jsonl", "a") as f:
        f.write("\n" + json.dumps({"i": 5}))  # an empty line (no sample) and a last line without "\n"
    shards = Shards(str(folder / "a.jsonl"))
    assert len(shards) == 6 and shards.samples(np.asarray([5, 0])) == [{"i": 5}, {"i": 0}]
    assert len(list((folder / ".elasticflow-index").glob("a.jsonl.*"))) == 1  # the old index is gone

    # Where the index folder cannot be made beside the data (read-only data; here, as root, a file in its way):
    # under the user's cache.
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    np.save(readonly / "t.npy", np.arange(100, dtype=np.uint16))
    (readonly / ".elasticflow-index").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tokens = Shards(str(readonly / "t.npy"), seq_len=16)
    assert len(tokens) == 6 and list(tokens.samples(np.asarray([1]))[0]) == list(range(16, 32))
    assert list((tmp_path / "cache" / "elasticflow" / "index").rglob("t.npy.*"))


def test_token_files_are_cut_into_windows_and_flat_ones_need_a_length(tmp_path):
    (np.arange(1000, dtype=np.uint16)).tofile(tmp_path / "train.bin")  # nanoGPT's format
    shards = Shards(str(tmp_path / "train.bin"), seq_len=64)
    assert len(shards) == 15
    batch = Dataset(shards).fetch(np.asarray([2, 0]))
    np.testing.assert_array_equal(batch[0], np.stack([np.arange(128, 192), np.arange(0, 64)]))
    with pytest.raises(ElasticFlowError, match="pass seq_len= to Shards"):
        Shards(str(tmp_path / "train.bin"))
    with pytest.raises(ElasticFlowError, match="no shard format"):
        (tmp_path / "notes.txt").write_text("x")
        Shards(str(tmp_path / "*"))


def test_a_hugging_face_stream_over_files_trains_and_one_with_transforms_is_refused(tmp_path, corpus):
    datasets = pytest.importorskip("datasets")
    stream = datasets.load_dataset("json", data_files=str(corpus / "*.jsonl"), split="train", streaming=True)
    reader = Dataset(stream).reader
    assert isinstance(reader, Shards) and len(reader) == 37 + 45
    with pytest.raises(ElasticFlowError) as info:
        Dataset(stream.map(lambda r: r), "data()")
    assert info.value.message.startswith("data() returned a Hugging Face IterableDataset with transforms applied")
    assert "collate(samples)" in info.value.hint


class Files:
    """A torch-style stream that names the files it reads (the protocol): ElasticFlow reads them itself."""

    def __init__(self, files):
        self.shard_files = files

    def __iter__(self):
        raise AssertionError("never iterated")


def test_streams_that_cannot_be_indexed_are_one_line_saying_what_to_return(tmp_path, corpus):
    assert len(Dataset(Files(sorted(map(str, corpus.glob("*.parquet"))))).reader) == 50 + 38
    path = tmp_path / "gen.py"
    path.write_text("import numpy as np\n"
                    "def model(cfg): return {'w': np.zeros(2, np.float32)}\n"
                    "def forward(x, params): return (x * params['w']).sum()\n"
                    "def data(cfg): return (np.ones(2, np.float32) for _ in range(10))\n")
    out = train_in_process(path, tmp_path / "run", "trainer.global_batch_size=2", "trainer.max_steps=1")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: data() returned an iterable (generator), which can only be read in order; "
                      "exactly-once training deals each global batch by sample index, so the source must be "
                      "readable at any index"], out.stderr
    assert "elasticflow.data.Shards(paths)" in out.stderr and out.returncode != 0


def test_counts_by_format(corpus):
    shards = Shards(str(corpus / "*"), seq_len=stream_probe.TOKENS)
    per_file = {Path(p).name: n for p, n in zip(shards.paths, shards.counts)}
    assert Counter(per_file) == Counter(stream_probe.SIZES)


def test_a_large_index_stays_on_disk_and_reads_the_right_rows(tmp_path):
    """Past 64 KiB an index array is read by pread as needed (memory flat in the corpus's size)."""
    from elasticflow.data.rows import DiskRows

    with open(tmp_path / "big.jsonl", "w") as f:
        f.writelines(json.dumps({"i": i, "pad": "x" * (i % 7)}) + "\n" for i in range(6000))
    shards = Shards(str(tmp_path / "big.jsonl"))
    assert isinstance(shards.shards[0].index["spans"], DiskRows)
    picked = np.asarray([5999, 3, 4, 5, 2500, 0])
    assert [s["i"] for s in shards.samples(picked)] == picked.tolist()
