"""Hand-crafted checkpoints: metadata.json and shard headers are input, and the loader checks them first.

Each case writes a real checkpoint through the public API, edits its metadata.json (or a shard's header)
the way a damaged disk or a hand edit would, and expects one CorruptCheckpoint (an ElasticFlowError)
naming the file and the field -- never a MemoryError, a KeyError, uninitialised memory, or a read
outside the checkpoint. Then: resume=auto falls back past such a checkpoint with one warning line, an
explicit resume=PATH to it is an error, and `elasticflow inspect` prints one error line.

The last part crafts checkpoints that pass every checksum (a whole new save of altered tensors, or a shard
header rewritten and sealed again) and do not fit the run: an optimizer slot of another shape, a cursor past
the end of the data, a header field of the wrong type. Each is refused from its metadata before anything is
read, resume=auto falls back past it and ends on the model a clean run trains (3 workers in one case), and an
explicit resume=PATH to it is one error line.
"""
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from elasticflow.checkpoint import CorruptCheckpoint
from elasticflow.checkpoint.inspect import render
from elasticflow.errors import ElasticFlowError

from elasticflow.checkpoint.format import file_digest

from harness import assert_equivalent, cli, events, saved, train, train_in_process, train_ok

STATE = {"W": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.arange(3, dtype=np.int64)}
INFO = {"step": 10, "epoch": 0, "cursor": {"epoch": 0, "samples_in_epoch": 160, "samples_seen": 160}}
SHARD = ckpt.shard_name(0, 1)


@pytest.fixture
def checkpoint(tmp_path):
    """A real checkpoint (one shard), written by elasticflow; each test edits its own copy."""
    path = ckpt.save(tmp_path / "job_20250101-000000", "step_10", STATE, INFO)
    loaded = ckpt.load(path)
    assert all(np.array_equal(loaded[k], v) for k, v in STATE.items())
    return path


def edit_metadata(path, change):
    meta = json.loads((path / ckpt.METADATA).read_text())
    change(meta)
    (path / ckpt.METADATA).write_text(json.dumps(meta))


def refused(path, *fields, file=ckpt.METADATA, verify=True):
    """The one error loading (and inspecting) ``path`` gives: a CorruptCheckpoint naming ``file`` and ``fields``."""
    with pytest.raises(ElasticFlowError) as caught:
        ckpt.load(path, verify=verify)
    err = caught.value
    assert isinstance(err, CorruptCheckpoint), repr(err)
    assert f"'{path / file}'" in err.message and all(f in err.message for f in fields), err.message
    assert err.hint and "\n" not in err.message
    if file == ckpt.METADATA:  # inspect reads the metadata only: the same refusal
        with pytest.raises(CorruptCheckpoint) as inspected:
            render(path)
        assert inspected.value.message == err.message
    return err.message


# ---------------------------------------------------------------- shapes: checked before anything is allocated
def test_a_huge_shape_is_refused_before_it_is_allocated(checkpoint):
    edit_metadata(checkpoint, lambda m: m["tensors"]["W"].update(shape=[2 ** 50]))
    message = refused(checkpoint, "tensors['W']['shards']", "1125899906842624 elements of its 'shape'")
    assert "pieces covering [0, 12)" in message


def test_a_huge_shape_with_a_piece_to_match_is_bounded_by_the_file_size(checkpoint):
    def huge(meta):
        meta["tensors"]["W"].update(shape=[2 ** 50])
        meta["tensors"]["W"]["shards"][0]["end"] = 2 ** 50
    edit_metadata(checkpoint, huge)
    refused(checkpoint, f"files['{SHARD}']['bytes']", "bytes of the pieces")


def test_a_shape_no_array_can_have_is_refused(checkpoint):
    edit_metadata(checkpoint, lambda m: m["tensors"]["W"].update(shape=[0, 2 ** 70]))
    refused(checkpoint, "tensors['W']['shape']", "a shape an array can have")


def test_a_negative_shape_is_refused(checkpoint):
    edit_metadata(checkpoint, lambda m: m["tensors"]["W"].update(shape=[-4]))
    refused(checkpoint, "tensors['W']['shape']", "[-4]", "non-negative integers")


def test_an_unknown_dtype_is_refused(checkpoint):
    edit_metadata(checkpoint, lambda m: m["tensors"]["W"].update(dtype="object"))
    refused(checkpoint, "tensors['W']['dtype']", "'object'", "float32")


# ---------------------------------------------------------------- pieces: disjoint, in range, covering exactly
def split_b(first, second):
    def change(meta):
        piece = meta["tensors"]["b"]["shards"][0]
        meta["tensors"]["b"]["shards"] = [{**piece, "start": first[0], "end": first[1]},
                                          {**piece, "start": second[0], "end": second[1]}]
    return change


def test_pieces_with_a_negative_start_are_refused_though_their_lengths_add_up(checkpoint):
    edit_metadata(checkpoint, split_b((0, 3), (-3, 0)))  # 3 + 3 elements... of a 3-element tensor
    edit_metadata(checkpoint, lambda m: m["tensors"]["b"].update(shape=[6]))
    refused(checkpoint, "tensors['b']['shards'][1]['start']", "-3", "non-negative")


def test_overlapping_pieces_are_refused_though_their_lengths_add_up(checkpoint):
    edit_metadata(checkpoint, split_b((0, 2), (0, 2)))
    edit_metadata(checkpoint, lambda m: m["tensors"]["b"].update(shape=[4]))
    refused(checkpoint, "tensors['b']['shards']", "an overlap", "piece starting at element 2")


def test_a_gap_between_pieces_is_refused(checkpoint):
    edit_metadata(checkpoint, split_b((0, 1), (2, 3)))
    refused(checkpoint, "tensors['b']['shards']", "a gap", "piece starting at element 1")


def test_a_piece_past_the_end_of_its_tensor_is_refused(checkpoint):
    edit_metadata(checkpoint, split_b((0, 3), (3, 5)))
    refused(checkpoint, "tensors['b']['shards'][1]", "[3, 5]", "inside the tensor's 3 elements")


# ---------------------------------------------------------------- shard file names: never a path
@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", f"sub/{SHARD}", f"..{SHARD}"])
def test_a_shard_name_that_is_not_one_the_format_makes_is_refused(checkpoint, name):
    (checkpoint.parent / "outside.safetensors").write_bytes((checkpoint / SHARD).read_bytes())

    def rename(meta):
        meta["files"] = {name: meta["files"][SHARD]}
        for t in meta["tensors"].values():
            for piece in t["shards"]:
                piece["file"] = name
    edit_metadata(checkpoint, rename)
    refused(checkpoint, "shard file name", repr(name), "never a path")


def test_a_piece_in_an_unlisted_file_is_refused(checkpoint):
    edit_metadata(checkpoint, lambda m: m["tensors"]["W"]["shards"][0].update(file="../outside.safetensors"))
    refused(checkpoint, "tensors['W']['shards'][0]['file']", "one of the files the metadata lists")


# ---------------------------------------------------------------- required keys, with their types
@pytest.mark.parametrize("remove, field", [
    (lambda m: m["tensors"]["W"].pop("shards"), "tensors['W'] has no 'shards' entry"),
    (lambda m: m["tensors"]["W"].pop("dtype"), "tensors['W'] has no 'dtype' entry"),
    (lambda m: m["files"][SHARD].pop("bytes"), f"files['{SHARD}'] has no 'bytes' entry"),
    (lambda m: m["tensors"]["b"]["shards"][0].pop("end"), "tensors['b']['shards'][0] has no 'end' entry"),
    (lambda m: m.pop("files"), "has no 'files' entry"),
], ids=["shards", "dtype", "bytes", "end", "files"])
def test_a_missing_required_key_is_refused(checkpoint, remove, field):
    edit_metadata(checkpoint, remove)
    refused(checkpoint, field)


@pytest.mark.parametrize("change, field", [
    (lambda m: m["tensors"]["W"].update(shape="4x3"), "tensors['W']['shape'] is '4x3'"),
    (lambda m: m["tensors"]["W"]["shards"][0].update(start="0"), "tensors['W']['shards'][0]['start'] is '0'"),
    (lambda m: m["tensors"].update(W=[1, 2]), "tensors['W'] is [1, 2]"),
    (lambda m: m.update(step=True), "['step'] is True"),
    (lambda m: m["cursor"].update(samples_seen=-1), "'cursor'['samples_seen'] is -1"),
    (lambda m: m["tensors"]["W"].update(dtype=["float32"]), "tensors['W']['dtype'] is ['float32']"),
    (lambda m: m["tensors"]["W"]["shards"][0].update(file=["x"]), "tensors['W']['shards'][0]['file'] is ['x']"),
], ids=["shape", "start", "tensor", "step", "cursor", "dtype", "file"])
def test_a_key_of_the_wrong_type_is_refused(checkpoint, change, field):
    edit_metadata(checkpoint, change)
    refused(checkpoint, field)


# ---------------------------------------------------------------- shard headers: offsets inside the file's data
def edit_header(path, name, offsets):
    """Rewrite the shard's header with ``name``'s data_offsets changed (and the metadata's byte count to match)."""
    shard = path / SHARD
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[name]["data_offsets"] = offsets
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    edit_metadata(path, lambda m: m["files"][SHARD].update(bytes=shard.stat().st_size))


@pytest.mark.parametrize("verify", [False, True])
def test_negative_data_offsets_never_read_header_bytes(checkpoint, verify):
    edit_header(checkpoint, "W", [-16, 32])
    refused(checkpoint, "the header entry 'W'['data_offsets']", "[-16, 32]", "inside the file's", file=SHARD,
            verify=verify)


def test_data_offsets_past_the_end_of_the_file_are_refused(checkpoint):
    edit_header(checkpoint, "b", [48, 10 ** 9])
    refused(checkpoint, "the header entry 'b'['data_offsets']", file=SHARD, verify=False)


# ---------------------------------------------------------------- resume, inspect
MODEL = '''
import numpy as np
from elasticflow import ops, optim


def model(cfg):
    return {"W": np.zeros((4, 2), np.float32), "optimizer": optim.SGD(0.05)}


def forward(x, y, params):
    return ops.mse(x @ params["W"], y)


def data(cfg):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return x, (x @ rng.normal(size=(4, 2))).astype(np.float32)
'''

RUN = ["trainer.global_batch_size=16", "checkpoint.interval.steps=5", "checkpoint.keep=null"]


def one_error_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_resume_auto_falls_back_past_a_crafted_checkpoint_and_an_explicit_path_is_an_error(tmp_path, write_model):
    path, run = write_model(MODEL), tmp_path / "run"
    train(path, run, *RUN, "trainer.max_steps=10")
    found = sorted((p for p in (run / "checkpoints").rglob("step_*") if ckpt.is_complete(p)), key=lambda p: p.name)
    step10, step5 = found[0], found[1]
    assert (step5.name, step10.name) == ("step_5", "step_10")
    edit_metadata(step10, lambda m: m["tensors"]["W"].update(shape=[-4]))
    meta_file = step10 / ckpt.METADATA

    # an explicit path to it: one error line naming the file and the field, no fallback
    proc = train_in_process(path, tmp_path / "other", *RUN, "trainer.max_steps=12", f"resume={step10}")
    line = one_error_line(proc)
    assert str(meta_file) in line and "tensors['W']['shape']" in line and "resumed from" not in proc.stderr

    # inspect: the same one line
    line = one_error_line(cli(["inspect", step10]))
    assert str(meta_file) in line and "tensors['W']['shape']" in line

    # resume=auto: one warning line naming the bad checkpoint and why, then step_5
    proc = train(path, run, *RUN, "trainer.max_steps=12")
    warnings = [line for line in proc.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(warnings) == 1, proc.stderr
    assert str(step10) in warnings[0] and "tensors['W']['shape']" in warnings[0] and "falling back" in warnings[0]
    assert f"resumed from {step5}" in proc.stderr


def test_resume_auto_with_no_checkpoint_that_loads_is_one_error(tmp_path, write_model):
    path, run = write_model(MODEL), tmp_path / "run"
    train(path, run, *RUN, "trainer.max_steps=10")
    for p in (run / "checkpoints").rglob("step_*"):
        edit_metadata(p, lambda m: m["files"].clear())
    proc = train_in_process(path, run, *RUN, "trainer.max_steps=12")
    line = one_error_line(proc)
    assert "none of the 2 checkpoint(s)" in line and "step_5" in line and "resumed from" not in proc.stderr
    assert "resume=none" in proc.stderr  # the hint


def _nest(depth):
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("damage, why", [
    (lambda p: edit_metadata(p, lambda m: m.update(micro_step="x")), "['micro_step'] is 'x'"),
    (lambda p: edit_metadata(p, lambda m: m.update(last_metrics=5)), "holds progress this run cannot use"),
    (lambda p: (p / ckpt.METADATA).write_text((p / ckpt.METADATA).read_text().replace(
        '"skipped_steps": 0', '"skipped_steps": 1e999')), "['skipped_steps'] is inf"),
    # unreadable metadata sorts as the oldest checkpoint: step_5 is the newest, and nothing is skipped
    (lambda p: (p / ckpt.METADATA).write_text('{"step": ' + _nest(100_000) + "}"), None),
    (lambda p: _replace_header(p, b'{"W": ' + _nest(100_000).encode() + b"}"), "unreadable header"),
], ids=["micro_step", "last_metrics", "skipped_steps", "nested_metadata", "nested_header"])
def test_resume_auto_falls_back_past_progress_of_the_wrong_type_or_a_parser_bomb(tmp_path, write_model, damage, why):
    """Each of these stopped resume=auto with a raw TypeError, ValueError, OverflowError or RecursionError."""
    path, run = write_model(MODEL), tmp_path / "run"
    train_in_process(path, run, *RUN, "trainer.max_steps=10")
    step5, step10 = sorted((p for p in (run / "checkpoints").rglob("step_*") if ckpt.is_complete(p)),
                           key=lambda p: int(p.name.split("_")[1]))
    damage(step10)
    proc = train_in_process(path, run, *RUN, "trainer.max_steps=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "skipping checkpoint" in line]
    if why is not None:
        assert len(warnings) == 1 and str(step10) in warnings[0] and why in warnings[0], proc.stderr[-3000:]
    assert f"resumed from {step5}" in proc.stderr


def test_nested_metadata_is_one_line_for_inspect_and_an_explicit_resume(checkpoint):
    (checkpoint / ckpt.METADATA).write_text('{"step": ' + _nest(100_000) + "}")
    refused(checkpoint, "is corrupt or truncated (nested too deeply)")


def _replace_header(path, raw):
    """The shard's header replaced by ``raw`` (padded to 8 bytes), its data kept."""
    shard = path / SHARD
    old = shard.read_bytes()
    n = struct.unpack("<Q", old[:8])[0]
    raw += b" " * (-(8 + len(raw)) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + old[8 + n:])
    edit_metadata(path, lambda m: m["files"][SHARD].update(bytes=shard.stat().st_size))


# ---------------------------------------------------------------- crafted to pass the checksums, not to fit the run
def reseal(path):
    """Seal checkpoint ``path`` again after an edit of its shard's header: the file's size and checksum in the
    metadata become the new file's (the writer's: its header's bytes, then its pieces' checksums in the order it
    laid them out, sorted by tensor name), so every checksum passes and only the edit is wrong."""
    meta = json.loads((path / ckpt.METADATA).read_text())
    raw = (path / SHARD).read_bytes()
    pieces = sorted((name, p["start"], p["checksum"]) for name, t in meta["tensors"].items() for p in t["shards"])
    meta["files"][SHARD].update(bytes=len(raw), checksum=file_digest(
        meta["checksum"], raw[:8 + struct.unpack("<Q", raw[:8])[0]], [digest for _, _, digest in pieces]))
    (path / ckpt.METADATA).write_text(json.dumps(meta))


def edit_entry(path, name, change):
    """The shard's header entry for ``name`` changed by ``change`` (its data kept), then sealed again."""
    shard = path / SHARD
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[name] = change(header[name])
    _replace_header(path, json.dumps(header, separators=(",", ":")).encode())
    reseal(path)


@pytest.mark.parametrize("change, field", [
    (lambda e: {**e, "dtype": ["F32"]}, "the header entry 'W'['dtype'] is ['F32']"),
    (lambda e: {**e, "dtype": {"F32": 1}}, "the header entry 'W'['dtype'] is {'F32': 1}"),
    (lambda e: {**e, "shape": "12"}, "the header entry 'W'['shape'] is '12'"),
    (lambda e: {**e, "data_offsets": ["0", "48"]}, "the header entry 'W'['data_offsets'] is ['0', '48']"),
    (lambda e: [e], "the header entry 'W' is [{"),
], ids=["dtype-list", "dtype-dict", "shape", "data_offsets", "entry"])
def test_a_sealed_header_field_of_the_wrong_type_is_refused(checkpoint, change, field):
    """A list for a dtype stopped resume=auto with `TypeError: unhashable type: 'list'`."""
    edit_entry(checkpoint, "W", lambda e: dict(reversed(list(e.items()))))  # other bytes, the same header ...
    assert ckpt.load(checkpoint)["W"].tolist() == STATE["W"].tolist()  # ... which loads: reseal is the writer's seal
    edit_entry(checkpoint, "W", change)
    refused(checkpoint, field, file=SHARD)


MOMENTUM = MODEL.replace("optim.SGD(0.05)", "optim.SGD(0.05, momentum=0.9)")


@pytest.fixture(scope="module")
def momentum_runs(tmp_path_factory):
    """MOMENTUM trained to step 10 (checkpoints step_5 and step_10: each test crafts its own copy's step_10) and,
    clean, to step 12: the model a run that falls back to step_5 and trains on to step 12 must end on."""
    root = tmp_path_factory.mktemp("momentum")
    model = root / "model.py"
    model.write_text(MOMENTUM)
    for run, steps in (("run", 10), ("clean", 12)):
        proc = train_in_process(model, root / run, *RUN, f"trainer.max_steps={steps}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return model, root / "run", root / "clean"


def resave(path, change):
    """Checkpoint ``path`` written again, whole, with its tensors changed by ``change`` and its progress as it was:
    a save like any other, so every checksum is right."""
    state = ckpt.load(path)
    change(state)
    ckpt.save(path.parent, path.name, state, ckpt.read_metadata(path))
    assert ckpt.load(path).keys() == state.keys()  # it loads: the checksums pass


SLOT = "optimizer/W/momentum_buffer"
CRAFTS = {  # (what is done to step_10, the fields its refusal names)
    "slot-shape": (lambda p: resave(p, lambda s: s.update({SLOT: np.ones((3, 2), np.float32)})),
                   [f"tensors['{SLOT}']['shape'] is [3, 2]", "[4, 2] (the shape of parameter 'W')"]),
    "slot-reshaped": (lambda p: resave(p, lambda s: s.update({SLOT: np.ones((2, 4), np.float32)})),
                      [f"tensors['{SLOT}']['shape'] is [2, 4]"]),
    "param-dtype": (lambda p: resave(p, lambda s: s.update(W=s["W"].astype(np.int32))),
                    ["tensors['W']['dtype'] is 'int32'", "a floating dtype"]),
    "param-shape": (lambda p: resave(p, lambda s: s.update(W=np.zeros((4, 3), np.float32))),
                    ["W: model has shape (4, 2), checkpoint has (4, 3)", "this model file and config wrote it"]),
    "samples_in_epoch": (lambda p: edit_metadata(p, lambda m: m["cursor"].update(samples_in_epoch=10 ** 15)),
                         ["'cursor'['samples_in_epoch'] is 1000000000000000", "at most 64 (the samples in an epoch"]),
    "samples_seen": (lambda p: edit_metadata(p, lambda m: m["cursor"].update(samples_seen=16)),
                     ["'cursor'['samples_seen'] is 16", "at least the cursor's samples_in_epoch, 32"]),
    "epoch": (lambda p: edit_metadata(p, lambda m: m["cursor"].update(epoch=10 ** 15)),
              ["'cursor'['epoch'] is 1000000000000000", "at most 128"]),
    "step": (lambda p: edit_metadata(p, lambda m: m.update(step=10 ** 15)),
             ["['step'] is 1000000000000000", "at most 160"]),
    "loss_scale": (lambda p: edit_metadata(p, lambda m: m.update(loss_scale="x")),
                   ["['loss_scale'] is 'x'", "a positive finite number"]),
    "header-dtype": (lambda p: edit_entry(p, "W", lambda e: {**e, "dtype": ["F32"]}),
                     ["the header entry 'W'['dtype'] is ['F32']"]),
}


def crafted_copy(momentum_runs, tmp_path, craft):
    """A copy of the momentum run whose step_10 is crafted by CRAFTS[craft]: (model, run dir, step_5, step_10)."""
    model, trained, _ = momentum_runs
    shutil.copytree(trained, tmp_path / "run")
    found = saved(tmp_path / "run")
    # 10 steps of 16 samples, 64 an epoch: the numbers in CRAFTS' refusals
    assert ckpt.read_metadata(found["step_10"])["cursor"] == {"epoch": 2, "samples_in_epoch": 32, "samples_seen": 160}
    CRAFTS[craft][0](found["step_10"])
    return model, tmp_path / "run", found["step_5"], found["step_10"]


@pytest.mark.parametrize("craft", list(CRAFTS))
def test_an_explicit_resume_from_a_sealed_checkpoint_that_does_not_fit_is_one_error_line(momentum_runs, tmp_path,
                                                                                      craft):
    model, _, _, step10 = crafted_copy(momentum_runs, tmp_path, craft)
    proc = train_in_process(model, tmp_path / "other", *RUN, "trainer.max_steps=12", f"resume={step10}")
    line = one_error_line(proc)
    file = SHARD if craft.startswith("header") else ckpt.METADATA
    assert f"'{step10 / file}'" in line and "corrupt" in line, line
    assert all(field in line for field in CRAFTS[craft][1]), line
    assert "resumed from" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "other" / "checkpoints").exists() or not saved(tmp_path / "other")  # nothing trained


@pytest.mark.parametrize("craft", ["slot-shape", "samples_in_epoch", "header-dtype", "param-dtype", "param-shape"])
def test_resume_auto_falls_back_past_a_sealed_checkpoint_that_does_not_fit_and_ends_on_the_clean_model(
        momentum_runs, tmp_path, craft):
    """The issue's three (a slot of another shape: a RuntimeError on every worker; a cursor past the data: the run
    ended 130% away; a list for a header's dtype: a TypeError), and a parameter of another dtype or shape."""
    model, run, step5, step10 = crafted_copy(momentum_runs, tmp_path, craft)
    proc = train_in_process(model, run, *RUN, "trainer.max_steps=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(warnings) == 1 and str(step10) in warnings[0] and "falling back" in warnings[0], proc.stderr[-3000:]
    assert all(field in warnings[0] for field in CRAFTS[craft][1]), warnings[0]
    assert f"resumed from {step5}" in proc.stderr
    assert_equivalent(run, momentum_runs[2], records=False)


def test_three_workers_fall_back_past_a_cursor_past_the_data_and_end_on_the_one_worker_model(tmp_path, reference):
    """The issue's cursor (samples_in_epoch = 10**15, which passes every checksum: the metadata is not checksummed)
    in the newest checkpoint of a 3-worker job: every worker refuses it, all fall back to the one before, and the
    job trains the steps since again and ends exit 0 on the 1-worker model."""
    run, job = tmp_path / "run", ["launcher.workers=3", "checkpoint.interval.steps=20", "checkpoint.keep=null"]
    train_ok(run, *job)
    found = saved(run)
    assert {"step_40", "step_60"} <= set(found), sorted(found)
    edit_metadata(found["step_60"], lambda m: m["cursor"].update(samples_in_epoch=10 ** 15))
    out = train_ok(run, *job)
    assert Path(events(run, "ready")[-1]["resumed_from"]).resolve() == found["step_40"].resolve(), out[-3000:]
    assert "samples_in_epoch" in out and "falling back" in out, out[-3000:]
    assert_equivalent(run, reference, redone=True)
