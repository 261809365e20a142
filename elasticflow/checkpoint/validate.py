"""The checks a loader runs on a checkpoint's metadata and shard headers before it allocates or reads.

metadata.json and the shard headers are input like any other file: a damaged or hand-edited one is
refused as one ``CorruptCheckpoint`` naming the file and the field, never turned into an allocation of
whatever shape it claims, a read outside the checkpoint or outside a shard's data, or uninitialised
memory handed back as a tensor. ``resume=auto`` then falls back to the previous checkpoint.

What is checked (``check_metadata``): the keys the loader uses, with their types; shard file names
exactly as ``shard_name`` makes them (so never a path); known dtypes; non-negative shapes; every
tensor's pieces in range, disjoint and covering it exactly; and no file holding more bytes of pieces
than the metadata says it has -- which the loader compares with the file on disk before allocating,
so nothing larger than the shard files is ever allocated. ``check_entry``: a shard header's entry for
one piece lies inside the file's data. Each is a few integer comparisons per piece: nothing next to
reading the bytes (scripts/bench/bench_checkpoint.py, load).

Against the run that resumes (``CheckpointManager.load``, also from the metadata alone, before any shard data is
read): ``check_fit``, every tensor's shape and kind of dtype against the model's and the optimizer's;
``check_progress``, the cursor and step against the data's size and each other.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, NoReturn, Optional, Tuple

import numpy as np

from .format import DTYPES, HINT_FALLBACK, METADATA, NUMPY_DTYPES, SHARD_RE, CorruptCheckpoint

# numpy's own limits: an array of more dimensions, or whose shape (zeros aside) spans more bytes, cannot
# be made even empty (numpy 1.x allows 32 dimensions, 2.x 64).
MAX_NDIM = 32
MAX_BYTES = 2 ** 62
ITEMSIZE = {name: np.dtype(name).itemsize for name in DTYPES}
CURSOR_KEYS = ("epoch", "samples_in_epoch", "samples_seen")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Refusal:
    """Builds the one error for a field of one file: what it is, what was expected, the hint."""

    def __init__(self, where: str):
        self.where = where

    def __call__(self, field: str, got: Any, expected: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.where} is corrupt: {field} is {_shown(got)}, expected {expected}",
                                 HINT_FALLBACK)

    def missing(self, field: str, key: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.where} is corrupt: {field} has no {key!r} entry", HINT_FALLBACK)


def _get(bad: _Refusal, obj: Dict[str, Any], key: str, field: str, kind: type, what: str) -> Any:
    if key not in obj:
        raise bad.missing(field, key)
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad(f"{field}[{key!r}]", value, what)
    return value


def _count(bad: _Refusal, obj: Dict[str, Any], key: str, field: str) -> int:
    value = _get(bad, obj, key, field, int, "a non-negative integer")
    if value < 0:
        raise bad(f"{field}[{key!r}]", value, "a non-negative integer")
    return value


def check_metadata(path: Path, meta: Dict[str, Any]) -> None:
    """Raise CorruptCheckpoint unless ``meta`` (checkpoint ``path``'s, from ``read_metadata``) is one the
    loader can follow without allocating more than the shard files hold or reading outside them."""
    bad = _Refusal(f"checkpoint metadata '{Path(path) / METADATA}'")
    _count(bad, meta, "step", "the metadata")
    cursor = _get(bad, meta, "cursor", "the metadata", dict, "an object (the data cursor)")
    if set(cursor) - set(CURSOR_KEYS):  # data.Cursor's fields: the trainer rebuilds the cursor from these
        raise bad("'cursor'", sorted(cursor), f"some of the keys {', '.join(CURSOR_KEYS)}")
    for key in cursor:
        _count(bad, cursor, key, "the metadata's 'cursor'")
    if "checksum" in meta and not isinstance(meta["checksum"], str):
        raise bad("'checksum'", meta["checksum"], "the name of a checksum algorithm")
    files = _get(bad, meta, "files", "the metadata", dict, "an object {shard file: its size and checksum}")
    tensors = _get(bad, meta, "tensors", "the metadata", dict, "an object {tensor name: dtype, shape, pieces}")
    held: Dict[str, int] = {}  # bytes of pieces each file holds, by the metadata
    for fname, info in files.items():
        field = f"files[{fname!r}]"
        if not SHARD_RE.fullmatch(fname):
            raise bad("a shard file name", fname, "a name like 'shard-00000-of-00004.safetensors' "
                                                  "(a file in the checkpoint directory, never a path)")
        if not isinstance(info, dict):
            raise bad(field, info, "an object (bytes, checksum)")
        _count(bad, info, "bytes", field)
        for key, kind, what in (("checksum", str, "a hex digest"), ("tensors", int, "a count")):
            if key in info:
                _get(bad, info, key, field, kind, what)
        held[fname] = 0
    for name, t in tensors.items():
        # The common case in a few cheap tests; messages are built only for a tensor that fails one
        # (formatting them for every tensor doubled the cost: ~2.7 us a tensor against ~1.2).
        if not (type(t) is dict and type(t.get("dtype")) is str and t["dtype"] in ITEMSIZE
                and type(t.get("shape")) is list and len(t["shape"]) <= MAX_NDIM
                and all(type(d) is int and d >= 0 for d in t["shape"]) and type(t.get("shards")) is list):
            _diagnose_tensor(bad, f"tensors[{name!r}]", t)
        itemsize, shape = ITEMSIZE[t["dtype"]], t["shape"]
        if math.prod(max(d, 1) for d in shape) * itemsize > MAX_BYTES:
            raise bad(f"tensors[{name!r}]['shape']", shape, "a shape an array can have")
        _check_pieces(bad, name, t["shards"], math.prod(shape), itemsize, files, held)
    for fname, nbytes in held.items():
        if nbytes > files[fname]["bytes"]:
            raise bad(f"files[{fname!r}]['bytes']", files[fname]["bytes"],
                      f"at least the {nbytes} bytes of the pieces the tensors place in it")


def _diagnose_tensor(bad: _Refusal, field: str, t: Any) -> NoReturn:
    """The error for a tensor's entry that failed check_metadata's quick test: which field, and why."""
    if not isinstance(t, dict):
        raise bad(field, t, "an object (dtype, shape, shards)")
    dtype = _get(bad, t, "dtype", field, str, f"one of {', '.join(DTYPES)}")
    if dtype not in DTYPES:
        raise bad(f"{field}['dtype']", dtype, f"one of {', '.join(DTYPES)}")
    shape = _get(bad, t, "shape", field, list, "a list of non-negative integers")
    if len(shape) > MAX_NDIM or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"{field}['shape']", shape, f"a list of at most {MAX_NDIM} non-negative integers")
    _get(bad, t, "shards", field, list, "a list of pieces")
    raise AssertionError(f"{field} passes every check it failed")  # unreachable: the checks are the same


def _check_pieces(bad: _Refusal, name: str, pieces: List[Any], size: int, itemsize: int,
                  files: Dict[str, Any], held: Dict[str, int]) -> None:
    """The pieces of tensor ``name`` of ``size`` elements: each in a listed file, together covering
    [0, size) exactly once (so every element of the array the loader allocates is read into)."""
    spans = []
    for i, piece in enumerate(pieces):
        if not (type(piece) is dict and type(piece.get("file")) is str and piece["file"] in files
                and type(piece.get("start")) is int
                and type(piece.get("end")) is int and 0 <= piece["start"] <= piece["end"] <= size
                and type(piece.get("checksum", "")) is str):
            _diagnose_piece(bad, f"tensors[{name!r}]['shards'][{i}]", piece, size, files)
        start, end = piece["start"], piece["end"]
        held[piece["file"]] += (end - start) * itemsize
        spans.append((start, end, i))
    covered = 0
    for start, end, i in sorted(spans):
        if start != covered:
            raise bad(f"tensors[{name!r}]['shards'][{i}]", [start, end],
                      f"a piece starting at element {covered} (the pieces of a tensor cover it exactly "
                      f"once: {'a gap' if start > covered else 'an overlap'})")
        covered = end
    if covered != size:
        raise bad(f"tensors[{name!r}]['shards']", f"pieces covering [0, {covered})",
                  f"pieces covering all {size} elements of its 'shape'")


def _diagnose_piece(bad: _Refusal, where: str, piece: Any, size: int, files: Dict[str, Any]) -> NoReturn:
    """The error for a piece that failed _check_pieces's quick test: which field, and why."""
    if not isinstance(piece, dict):
        raise bad(where, piece, "an object (file, start, end, checksum)")
    fname = _get(bad, piece, "file", where, str, "a shard file name")
    if fname not in files:
        raise bad(f"{where}['file']", fname, f"one of the files the metadata lists ({', '.join(sorted(files))})")
    start, end = _count(bad, piece, "start", where), _count(bad, piece, "end", where)
    if "checksum" in piece and not isinstance(piece["checksum"], str):
        raise bad(f"{where}['checksum']", piece["checksum"], "a hex digest")
    if not start <= end <= size:
        raise bad(where, [start, end], f"an element range [start, end) inside the tensor's {size} elements")
    raise AssertionError(f"{where} passes every check it failed")  # unreachable: the checks are the same


def check_entry(fpath: Path, name: str, entry: Any, piece: Dict[str, Any], dtype: np.dtype,
                data_start: int, file_size: int) -> range:
    """The byte range (from the file's start) of the piece ``name``[start:end] in shard ``fpath``, after
    checking that its header entry holds it as the metadata says and lies inside the file's data."""
    bad = _Refusal(f"checkpoint shard '{fpath}'")
    field = f"the header entry {name!r}"
    n = piece["end"] - piece["start"]
    if not isinstance(entry, dict):
        raise bad(field, entry, f"an entry holding {name!r}[{piece['start']}:{piece['end']}] as the metadata says")
    written = entry.get("dtype")
    if not isinstance(written, str) or NUMPY_DTYPES.get(written) != dtype.name:  # a list: unhashable, so first
        raise bad(f"{field}['dtype']", written, f"{DTYPES[dtype.name]!r} (the metadata's {dtype.name})")
    if entry.get("shape") != [n]:
        raise bad(f"{field}['shape']", entry.get("shape"), f"[{n}] (the piece [{piece['start']}:{piece['end']}])")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise bad(f"{field}['data_offsets']", offsets, "[begin, end]: two integers")
    begin, end = offsets
    if not (0 <= begin <= end <= file_size - data_start and end - begin == n * dtype.itemsize):
        raise bad(f"{field}['data_offsets']", offsets,
                  f"{n * dtype.itemsize} bytes inside the file's {file_size - data_start} bytes of data")
    return range(data_start + begin, data_start + end)


# ---------------------------------------------------------------- against the run that resumes from it
# A checkpoint can be well formed and still not fit the run: a slot of another shape (a RuntimeError in the
# engine's copy on every worker), a cursor past the end of the data (the rest of the epoch skipped in silence).
# These checks read the metadata only, so a misfit is refused before a byte of shard data is read or a tensor
# of the run's is written, and resume=auto falls back past it as past a failed checksum.
EXTRA = ("optimizer/", "rng/", "outer/")  # state beside the model's: absent or extra ones are allowed
KINDS = {"f": "floating", "i": "integer", "u": "integer", "b": "bool"}


def _kind(dtype: Any) -> str:
    """The class of a dtype a load may cast within (a float32 model loads float16 or float64 tensors, as a
    resume across trainer.precision does) but never across (an integer or bool tensor for a float one)."""
    return KINDS.get(np.dtype(dtype).kind, np.dtype(dtype).name)


def _parameter_of(name: str) -> str:
    """The parameter an optimizer slot (``optimizer/<parameter>/<slot>``) or outer state
    (``outer/<what>/<parameter>``) belongs to; '' for any other tensor."""
    if name.startswith("optimizer/"):
        return name[len("optimizer/"):].rpartition("/")[0]
    if name.startswith("outer/"):
        return name[len("outer/"):].partition("/")[2]
    return ""


def check_fit(path: Path, meta: Dict[str, Any], model: Dict[str, Tuple[Tuple[int, ...], Any]]) -> None:
    """Raise CorruptCheckpoint unless each tensor of checkpoint ``path`` that the run will load has the shape
    and the kind of dtype (``_kind``) the run gives it.

    Args:
        meta: the checkpoint's metadata, passed by ``check_metadata``.
        model: (shape, dtype) of each tensor the run holds now, by name. An optimizer slot or outer state the run
            has not allocated yet (slots appear at the first update) has its parameter's shape and a float dtype.
    Note: the parameters' names and shapes are compared first by the caller (``compare_names``): a checkpoint of
    another model is a mismatch that stops the run, not damage to fall back past.
    """
    bad = _Refusal(f"checkpoint metadata '{Path(path) / METADATA}'")
    params = {n: v for n, v in model.items() if not n.startswith(EXTRA)}
    for name, t in meta["tensors"].items():
        want, why = model.get(name), "this run's"
        owner = _parameter_of(name)
        if owner in params:  # a slot has its parameter's shape, allocated yet or not
            want, why = (params[owner][0], np.float32), f"the shape of parameter {owner!r}"
        if want is None:
            continue  # not loaded (an extra slot), or a parameter the caller reports missing or unexpected
        shape, dtype = want
        if tuple(t["shape"]) != tuple(shape):
            raise bad(f"tensors[{name!r}]['shape']", t["shape"], f"{list(shape)} ({why})")
        if _kind(t["dtype"]) != _kind(dtype):
            raise bad(f"tensors[{name!r}]['dtype']", t["dtype"],
                      f"a {_kind(dtype)} dtype (the run's is {np.dtype(dtype).name})")


def check_progress(path: Path, meta: Dict[str, Any], epoch_samples: Optional[int]) -> None:
    """Raise CorruptCheckpoint unless the counters of checkpoint ``path`` are counts (its loss scale a positive
    number), and its data cursor lies inside the run's data and agrees with them and with its step.

    ``epoch_samples``: the samples in an epoch of the run's data (None: not known here). What holds for any
    history, also one resumed with more or less data or another global batch: the position in the epoch is
    inside it; the samples seen include it; each epoch before it and each optimizer step consumed at least one.
    Note: a cursor that is consistent but not the one the tensors were trained to cannot be told from a real one.
    """
    bad = _Refusal(f"checkpoint metadata '{Path(path) / METADATA}'")
    for key in ("micro_step", "skipped_steps", "loss_scale_good_steps"):  # the other counters (absent: 0)
        if key in meta:
            _count(bad, meta, key, "the metadata")
    scale = meta.get("loss_scale", 1.0)
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < math.inf):
        raise bad("the metadata['loss_scale']", scale, "a positive finite number")
    cursor = "the metadata's 'cursor'"
    epoch, in_epoch, seen = (meta["cursor"].get(k, 0) for k in CURSOR_KEYS)
    if epoch_samples is not None and in_epoch > epoch_samples:
        raise bad(f"{cursor}['samples_in_epoch']", in_epoch,
                  f"at most {epoch_samples} (the samples in an epoch of this run's data)")
    if in_epoch > seen:
        raise bad(f"{cursor}['samples_seen']", seen, f"at least the cursor's samples_in_epoch, {in_epoch}")
    if epoch > seen - in_epoch:
        raise bad(f"{cursor}['epoch']", epoch, f"at most {seen - in_epoch} (each epoch before this one consumed "
                                               "samples: the cursor's samples_seen less samples_in_epoch)")
    if meta["step"] > seen:
        raise bad("the metadata['step']", meta["step"], f"at most {seen} (each optimizer step consumed samples: "
                                                        "the cursor's samples_seen)")
