"""Sharded corpora (``elasticflow.data.Shards``): jsonl, parquet, ``.npy``/``.bin`` tokens and WebDataset ``.tar``
read at any index through a per-shard index cached where only its user can write (never beside the data, which
a shared folder's other users could plant); an order shuffled within windows of shards,
the same for any number of workers; every sample exactly once across a kill, a join and a resume at another size.
"""
import grp
import hashlib
import io
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from harness import (Limit, assert_each_sample_once, assert_equivalent, finish, members, metrics, start, train,
                     train_in_process, wait_for, workers, world_sizes)
from elasticflow.data import Shards
from elasticflow.data.order import Dataset
from elasticflow.errors import ElasticFlowError

sys.path.insert(0, str(Path(__file__).parent / "models"))
import stream_probe  # noqa: E402

MODEL = Path(__file__).parent / "models" / "stream_probe.py"
COMMON = ["trainer.progress=false", "trainer.global_batch_size=20", "trainer.micro_batch_size=4", "trainer.log_every=1", "backend.threads=1",
          "optimizer.lr=0.1", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5"]


@pytest.fixture(autouse=True)
def index_cache_of_its_own(tmp_path, monkeypatch):
    """Each test's shard indexes go to a cache of its own (what a job it starts inherits), not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


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


# What another local user runs (stdlib only): the steps of a plan read from stdin, each step's outcome printed,
# "ok" or the error's name.
PLANT = r"""
import json, os, sys
done = []
for step in json.load(sys.stdin):
    try:
        if step["op"] == "mkdir":
            os.makedirs(step["path"], exist_ok=True)
            os.chmod(step["path"], 0o777)
        elif step["op"] == "link":
            os.symlink(step["to"], step["path"])
        else:
            with open(step["path"], "wb") as f:
                f.write(bytes.fromhex(step["bytes"]))
        done.append("ok")
    except OSError as exc:
        done.append(type(exc).__name__)
print(json.dumps(done))
"""


def as_nobody(world, plan):
    """Each step's outcome ("ok" or the error's name), carried out as user nobody."""
    script = world / "plant.py"
    script.write_text(PLANT)
    script.chmod(0o644)
    done = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3",
                           str(script)], input=json.dumps(plan), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def forged_index(shard, where, identity=None):
    """The plan that plants a folder WHERE holding an index of SHARD (a jsonl file) whose row 1 is row 0's line:
    sample 0 read twice, sample 1 never. ``identity``: the identity it claims (the cache's layout); without, the
    layout of the index that used to live beside the data."""
    from elasticflow.data.shard_formats import Jsonl

    index = Jsonl.index(str(shard))
    index["spans"][1] = index["spans"][0]
    files = {f"{name}.npy": _npy(array) for name, array in index.items()}
    if identity is not None:
        files["identity.json"] = json.dumps(identity, sort_keys=True).encode().hex()
    return [{"op": "mkdir", "path": str(where)}] + [{"op": "write", "path": str(where / name), "bytes": blob}
                                                     for name, blob in files.items()]


def _npy(array):
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue().hex()


@pytest.mark.skipif(os.geteuid() != 0, reason="plants files as another user (nobody): needs root (as CI has)")
def test_a_shared_data_folder_cannot_swap_samples_or_truncate_a_file_of_the_owners(tmp_path, corpus, monkeypatch,
                                                                                     caplog):
    """Issue 65's attack on a team folder every user may write (no sticky bit): ``nobody`` plants, where the
    index used to be cached (``.elasticflow-index/`` beside the data, under a name anyone can compute), a
    ``.lock`` symlink to a file of the job owner's (the job truncated it) and an index that reads sample 0 in
    place of sample 1 (the job trained on it, exit 0); and tries the same in the owner's cache, at the names the
    job will use, which it cannot write. A 3-worker job indexing the corpus cold ends exit 0 on the 1-worker
    model, every sample once, the owner's file intact and nothing written beside the data. A cache home in a
    shared folder, where ``nobody`` made it first and planted the same, is refused: the samples read are the
    files', and the owner's file stays intact."""
    from elasticflow.data import index_cache

    world = Path(tempfile.mkdtemp(prefix="ef-shared-data-"))  # tmp_path is root's 0700: nobody would stop there
    try:
        os.chmod(world, 0o755)
        data, home, shared = world / "data", world / "home-cache", world / "shared"
        data.mkdir()
        data.chmod(0o777)  # a team folder: every user may write it, no sticky bit
        home.mkdir(mode=0o755)  # the owner's cache home: others may read it, not write
        shared.mkdir()
        shared.chmod(0o1777)  # a folder like /tmp: a cache home named there may be taken by anyone first
        team = shared / "cache"
        (world / "earlier.jsonl").write_text('{"i": 0}\n')
        monkeypatch.setenv("XDG_CACHE_HOME", str(home))
        Shards(str(world / "earlier.jsonl"))  # the owner has indexed other data before: the cache is there
        stream_probe.write_corpus(str(data))
        notes = world / "owners-notes.txt"
        notes.write_text("the owner's notes\n")
        shard = data / "a.jsonl"  # samples 0..36

        old = data / ".elasticflow-index"  # the old name: sha1 of size, mtime, format, options
        st = os.stat(shard)
        key = hashlib.sha1(f"{st.st_size}-{st.st_mtime_ns}-Jsonl-{stream_probe.TOKENS}-None".encode()).hexdigest()
        identity = index_cache.shard_identity(str(shard), {"seq_len": stream_probe.TOKENS, "dtype": None})
        folder, name = index_cache.entry_of(identity)  # the new name: as computable, from stat and the file
        planted = {}
        for root in (old, home / "elasticflow" / "index" / folder, team / "elasticflow" / "index" / folder):
            claimed = None if root == old else identity
            planted[root] = as_nobody(world, [{"op": "mkdir", "path": str(root)},
                                              {"op": "link", "to": str(notes), "path": str(root / ".lock")}]
                                      + forged_index(shard, root / (f"a.jsonl.{key[:12]}" if root == old else name),
                                                     claimed))
        assert set(planted[old]) == set(planted[team / "elasticflow" / "index" / folder]) == {"ok"}, planted
        assert set(planted[home / "elasticflow" / "index" / folder]) == {"PermissionError"}, planted
        beside = sorted(str(p.relative_to(data)) for p in data.rglob("*"))

        run, record, alone = tmp_path / "run", tmp_path / "record", tmp_path / "alone"
        record.mkdir()
        env = {"EF_STREAM_CORPUS": str(data), "EF_STREAM_RECORD": str(record), "XDG_CACHE_HOME": str(home)}
        proc = start(run, "trainer.epochs=1", "launcher.workers=3", model=MODEL, common=COMMON, env=env)
        out = finish(proc)
        assert proc.returncode == 0, out[-4000:]
        assert {r["world_size"] for r in metrics(run) if "loss" in r} == {3}
        assert notes.read_text() == "the owner's notes\n"
        assert_each_sample_once(run, record, samples=stream_probe.SAMPLES)
        train(MODEL, alone, *COMMON, "trainer.epochs=1", env={"EF_STREAM_CORPUS": str(corpus)})
        assert_equivalent(run, alone)
        assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == beside  # nothing written there
        cached = sorted(p.name.rpartition(".")[0] for p in (home / "elasticflow" / "index" / folder).iterdir()
                        if not p.name.startswith("."))
        assert cached == sorted(stream_probe.SIZES), cached  # each shard indexed once, by the 3 workers together

        monkeypatch.setenv("XDG_CACHE_HOME", str(team))
        with caplog.at_level("WARNING", logger="elasticflow"):
            shards = Shards(str(data / "*"), window=2, seq_len=stream_probe.TOKENS)
        ids = stream_probe.collate(shards.samples(np.arange(stream_probe.SAMPLES)))[0]
        assert list(ids) == list(range(stream_probe.SAMPLES))
        assert f"{team} belongs to uid {os.stat(team).st_uid}, not to you" in caplog.text, caplog.text
        assert notes.read_text() == "the owner's notes\n"
    finally:
        shutil.rmtree(world, ignore_errors=True)


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


def test_a_changed_shard_is_indexed_again_in_the_users_cache_and_nothing_is_written_beside_the_data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(5)))
    assert len(Shards(str(folder / "a.jsonl"))) == 5
    with open(folder / "a.jsonl", "a") as f:
        f.write("\n" + json.dumps({"i": 5}))  # an empty line (no sample) and a last line without "\n"
    shards = Shards(str(folder / "a.jsonl"))
    assert len(shards) == 6 and shards.samples(np.asarray([5, 0])) == [{"i": 5}, {"i": 0}]
    assert os.listdir(folder) == ["a.jsonl"]  # nothing beside the data
    entries = list((tmp_path / "cache" / "elasticflow" / "index").glob("*/a.jsonl.*"))
    assert len(entries) == 1  # the old version's index is gone
    for made in (tmp_path / "cache" / "elasticflow", tmp_path / "cache" / "elasticflow" / "index", entries[0].parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made

    # Rewritten in place, as long as before, its first and last 4 KiB and its modification time as they were: the
    # change time (which nobody can set back) tells, and the index is built again.
    path = folder / "b.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(2000)))
    assert Shards(str(path)).samples(np.asarray([1000, 1001])) == [{"i": 1000}, {"i": 1001}]
    before = os.stat(path)
    clock = tmp_path / "clock"  # file times tick coarsely (a few ms): a write in the index's tick would not show
    wait_for(lambda: clock.touch() or os.stat(clock).st_ctime_ns > before.st_ctime_ns, 10, "file times to move on")
    with open(path, "r+") as f:  # two lines whose newline moves: '{"i": 1000}\n{"i": 1001}\n' (at 10890, mid-file)
        f.seek(path.read_text().index('{"i": 1000}'))
        f.write('{"i":1000}\n{"i": 1001} \n')
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert Shards(str(path)).samples(np.asarray([999, 1000, 1001, 1002])) == [{"i": i} for i in range(999, 1003)]


def test_an_index_that_does_not_fit_its_shard_is_built_again_never_trusted(tmp_path):
    """An entry in the cache is read only if it records the shard's identity and its offsets fit the file:
    one whose spans point past the file, whose identity is another file's, or whose row count is off is built
    again, and the samples read are the file's."""
    from elasticflow.data import index_cache

    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / "a.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(40)))
    want = [{"i": i} for i in range(40)]
    assert Shards(str(path)).samples(np.arange(40)) == want
    identity = index_cache.shard_identity(str(path), {"seq_len": None, "dtype": None})
    where, name = index_cache.entry_of(identity)
    entry = tmp_path / "cache" / "elasticflow" / "index" / where / name
    true_spans = np.load(entry / "spans.npy")

    def forged(change):
        for f in entry.iterdir():
            f.unlink()
        index = {"rows": np.asarray([40]), "spans": true_spans.copy()}
        recorded = dict(identity)
        change(index, recorded)
        for key, array in index.items():
            np.save(entry / f"{key}.npy", array)
        (entry / "identity.json").write_text(json.dumps(recorded))
        return Shards(str(path)).samples(np.arange(40))

    def past_the_end(index, recorded):
        index["spans"][-1] = [10**6, 10**6 + 9]

    def out_of_order(index, recorded):
        index["spans"][[3, 4]] = index["spans"][[4, 3]]

    def another_file(index, recorded):
        index["spans"][1] = index["spans"][0]
        recorded["inode"] += 1

    def rows_off(index, recorded):
        index["rows"] = np.asarray([39])

    for change in (past_the_end, out_of_order, another_file, rows_off):
        assert forged(change) == want, change.__name__
        assert np.array_equal(np.load(entry / "spans.npy"), true_spans), change.__name__  # built again


def test_every_formats_cached_index_is_read_back_and_one_off_by_a_row_or_past_the_file_is_not(corpus, monkeypatch):
    """What the cache keeps for each format fits its file and is read back, never built twice; the same index
    claiming a row more, or for a file half as long, does not fit (parquet's row groups pyarrow checks)."""
    from elasticflow.data import shard_formats

    Shards(str(corpus / "*"), seq_len=stream_probe.TOKENS)
    with monkeypatch.context() as patched:
        for kind in set(shard_formats.FORMATS.values()):
            patched.setattr(kind, "index", staticmethod(lambda *a, **k: pytest.fail("indexed again")))
        again = Shards(str(corpus / "*"), seq_len=stream_probe.TOKENS)
    picked = np.asarray([0, 40, 100, 150, 199, 245, 269])
    assert stream_probe.collate(again.samples(picked))[0].tolist() == picked.tolist()
    for path in sorted(corpus.glob("*")):
        kind, size = shard_formats.format_of(str(path)), path.stat().st_size
        index = kind.index(str(path), seq_len=stream_probe.TOKENS)
        assert shard_formats.fits(kind, index, size), path.name
        assert not shard_formats.fits(kind, {**index, "rows": index["rows"] + 1}, size), path.name
        if kind is not shard_formats.Parquet:
            assert not shard_formats.fits(kind, index, size // 2), path.name


@pytest.mark.parametrize("mode, group", [(0o777, None), (0o775, "daemon"), (0o775, "mine")])
def test_a_cache_others_may_write_is_not_used(tmp_path, monkeypatch, caplog, mode, group):
    """$XDG_CACHE_HOME in a folder others may write (no sticky bit), or a group with other members (daemon's):
    refused with one warning, and this process indexes into a private folder of its own instead; nothing is
    written into the shared one. A user private group (a umask of 002: nobody else is in it) is no one else."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    if group == "daemon":
        if os.geteuid() != 0:
            pytest.skip("gives a folder to another group: needs root (as CI has)")
        os.chown(shared, -1, grp.getgrnam("daemon").gr_gid)  # the primary group of user daemon too
    elif group == "mine" and {p.pw_name for p in pwd.getpwall() if p.pw_gid == os.getegid()} | set(
            grp.getgrgid(os.getegid()).gr_mem) != {pwd.getpwuid(os.geteuid()).pw_name}:
        pytest.skip("this user's group has other members: not a user private group")
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared / "cache"))
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.uint16))
    with caplog.at_level("WARNING", logger="elasticflow"):
        tokens = Shards(str(tmp_path / "t.npy"), seq_len=16)
    assert len(tokens) == 6 and list(tokens.samples(np.asarray([1]))[0]) == list(range(16, 32))
    if group == "mine":
        assert "is not used" not in caplog.text, caplog.text
        assert list((shared / "cache" / "elasticflow" / "index").glob("*/t.npy.*"))
        return
    assert f"{shared} may be written by others (mode {mode:o})" in caplog.text, caplog.text
    assert "hint: point $XDG_CACHE_HOME at a folder of your own" in caplog.text
    assert os.listdir(shared) == []


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


HF_SAMPLES = stream_probe.SIZES["a.jsonl"] + stream_probe.SIZES["e.jsonl"]  # stream_probe.hf_stream's


def test_a_transformed_hugging_face_stream_is_each_sample_once_across_a_kill_and_a_join(tmp_path, corpus):
    """stream_probe.hf_stream (map with_indices, rename_column, select_columns, cast_column) on 2 workers, one
    SIGKILLed at step 2 and replaced: every position of the stream trains once per epoch."""
    pytest.importorskip("datasets")
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    limit = Limit(tmp_path / "limit", step=3, last=16)
    proc = start(run, "trainer.epochs=4", "launcher.workers=2", "launcher.restart_failed=true", model=MODEL,
                 common=COMMON, env={"EF_STREAM_CORPUS": str(corpus), "EF_STREAM_RECORD": str(record),
                                     "EF_STREAM_HF": "1", "EF_STREAM_KILL": "1:2", "EF_STREAM_LIMIT": str(limit.path)})
    limit.advance_until(run, lambda: 1 in world_sizes(run), 120, "a step of the survivor alone")
    wait_for(lambda: len(workers(run)) == 2, 120, "the replacement admitted")  # steps held: however slow its start
    limit.advance_until(run, lambda: world_sizes(run)[-1] == 2, 120, "a step with the replacement")
    limit.lift()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    sizes = world_sizes(run)
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes  # the kill, then the replacement joined
    assert_each_sample_once(run, record, samples=HF_SAMPLES)
    assert metrics(run)[-1]["samples_seen"] == 4 * HF_SAMPLES


def test_a_hugging_face_stream_is_read_at_any_position_as_datasets_streams_it(corpus):
    """Per-example transforms are replayed on each sample at its position: read in any order, in any grouping
    (the workers' shares of a batch) and again (a step redone), each sample is what datasets itself yields there."""
    datasets = pytest.importorskip("datasets")
    plain = datasets.load_dataset("json", data_files=str(corpus / "*.jsonl"), split="train", streaming=True)
    assert type(Dataset(plain).reader) is Shards and len(Dataset(plain).reader) == HF_SAMPLES  # the files as they are
    stream = stream_probe.hf_stream(str(corpus))
    reader = Dataset(stream, "data()").reader
    want = list(stream)
    assert [s["sid"] for s in want] == list(range(HF_SAMPLES)) and list(want[0]) == ["sid", "x", "target"]
    assert reader.samples(np.asarray([0]))[0]["sid"] == stream_probe.SIZES["e.jsonl"]  # a.jsonl: streamed second
    order = np.random.default_rng(0).permutation(len(reader))
    for parts in (1, 3, 7):
        got = [s for part in np.array_split(order, parts) for s in reader.samples(part)]
        assert sorted(got, key=lambda s: s["sid"]) == want
    sid, x, target = reader.read(order[:4])  # stacked field by field, in the stream's column order
    assert sid.tolist() == [s["sid"] for s in reader.samples(order[:4])] and x.shape == (4, stream_probe.FEATURES)


def test_transforms_that_change_the_count_are_one_line_saying_what_to_do(corpus):
    datasets = pytest.importorskip("datasets")
    stream = datasets.load_dataset("json", data_files=str(corpus / "*.jsonl"), split="train", streaming=True)
    pieces = stream.map(lambda b: {"piece": [p for x in b["x"] for p in x]}, batched=True,
                        remove_columns=["id", "x", "y"])
    for source, said, hint in [
            (stream.filter(lambda s: s["y"] > 0), "with .filter(), which changes the number of samples", ".filter("),
            (stream.shuffle(seed=0, buffer_size=10), "with .shuffle(buffer_size=...)", "data.shuffle"),
            (stream.take(5), "with .take(n)", "trainer.max_steps"),
            (pieces, "returned 4 rows for 1", "collate(samples)")]:
        with pytest.raises(ElasticFlowError) as info:
            Dataset(source, "data()")
        assert said in info.value.message and "\n" not in info.value.message and hint in info.value.hint


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
