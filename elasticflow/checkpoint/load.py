"""Read a checkpoint written by any number of ranks back as full numpy arrays (resharding on load).

Each requested tensor is reassembled from the element ranges the metadata lists, read straight
from the shard files into the output array (seek + readinto: only those bytes, no extra copy),
and every piece read is checked against its checksum (xxh3_64).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ElasticFlowError
from .format import (HINT_FALLBACK, HINT_PATH, CorruptCheckpoint, file_digest, hashed, hasher, is_complete,
                     read_chunks, read_metadata, read_shard_header)
from .validate import check_entry, check_metadata


def load(path: str | Path, names: Optional[Iterable[str]] = None, verify: bool = True) -> Dict[str, np.ndarray]:
    """The state of checkpoint ``path`` by name: parameters, buffers, ``optimizer/<param>/<slot>``, ``rng/*``.

    Args:
        names: only these tensors (reads only their byte ranges); None: all of them.
        verify: check the checksum of every piece read (and of every whole file, when all are read).

    Example:
        >>> state = elasticflow.checkpoint.load(elasticflow.checkpoint.latest("outputs/run/checkpoints"))
        >>> state["W1"].shape
    """
    return load_with_metadata(path, names, verify)[0]


def _corrupt(fpath: Path, what: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"checkpoint shard '{fpath}' fails its checksum ({what})", HINT_FALLBACK)


def load_with_metadata(path: str | Path, names: Optional[Iterable[str]] = None, verify: bool = True,
                       check: Optional[Callable[[dict], None]] = None) -> Tuple[Dict[str, np.ndarray], dict]:
    """``load`` and the metadata. ``check``: called with the metadata once it is found well formed, before
    anything is allocated or read (a resume refuses a checkpoint that does not fit the run there)."""
    path = Path(path)
    if not path.is_dir():
        raise ElasticFlowError(f"checkpoint '{path}' does not exist", HINT_PATH)
    if not is_complete(path):
        raise ElasticFlowError(f"checkpoint '{path}' is incomplete (no COMMIT marker): its save was interrupted",
                               "resume from an earlier checkpoint; resume=auto skips incomplete ones")
    meta = read_metadata(path)
    check_metadata(path, meta)  # before anything is allocated or read: the metadata is input like any other
    if check is not None:
        check(meta)
    tensors, files = meta["tensors"], meta["files"]
    wanted = sorted(tensors) if names is None else list(dict.fromkeys(names))
    unknown = [n for n in wanted if n not in tensors]
    if unknown:
        raise ElasticFlowError(f"checkpoint '{path}' has no tensor(s) {', '.join(unknown[:8])}",
                               "elasticflow inspect CHECKPOINT lists what it holds")
    # Every file is checked for presence and size, not only those read: a missing shard is an
    # incomplete checkpoint whatever the reader asks for. And as check_metadata bounded the pieces by
    # these sizes, nothing allocated below is larger than the files on disk.
    for fname, info in files.items():
        fpath = path / fname
        if not fpath.is_file():
            raise CorruptCheckpoint(f"checkpoint shard '{fpath}' is missing (the checkpoint was written by "
                                    f"{meta.get('writers', len(files))} ranks)", HINT_FALLBACK)
        size = fpath.stat().st_size
        if size != info["bytes"]:
            raise _corrupt(fpath, f"corrupt or truncated: {size} bytes, metadata says {info['bytes']}")
    out: Dict[str, np.ndarray] = {}
    by_file: Dict[str, List[Tuple[str, dict, np.ndarray]]] = {}
    for name in wanted:
        t = tensors[name]
        flat = np.empty(int(np.prod(t["shape"], dtype=np.int64)), dtype=np.dtype(t["dtype"]))
        for piece in t["shards"]:  # they cover the tensor exactly (check_metadata): every element is read
            by_file.setdefault(piece["file"], []).append((name, piece, flat[piece["start"]:piece["end"]]))
        out[name] = flat.reshape(t["shape"])
    algorithm = meta.get("checksum", "crc32")
    for fname, items in by_file.items():
        whole = names is None and len(items) == files[fname].get("tensors", -1)
        _read_file(path / fname, files[fname], items, algorithm if verify else None, whole)
    return out, meta


def _read_file(fpath: Path, info: dict, items: Sequence[Tuple[str, dict, np.ndarray]], algorithm: Optional[str],
               whole: bool) -> None:
    """Read ``items`` (name, piece, destination) from one shard; check each piece's checksum, and
    the file's when the pieces read are all of it (``whole``)."""
    header, data_start, raw_header = read_shard_header(fpath)
    # Each piece's byte range, checked against the header and the file's size before any is read.
    spans = [(check_entry(fpath, name, header.get(name), piece, dst.dtype, data_start, info["bytes"]), name, piece,
              dst) for name, piece, dst in items]
    spans.sort(key=lambda it: it[0].start)
    digests: Optional[List[str]] = [] if algorithm and whole else None
    at_expected = data_start
    with open(fpath, "rb", buffering=0) as f:
        for span, name, piece, dst in spans:
            if span.start != at_expected:
                digests = None  # a gap: the file's checksum cannot be checked from the pieces
            at_expected = span.stop
            f.seek(span.start)
            mv = memoryview(dst).cast("B") if dst.size else memoryview(b"")
            piece_hash = hasher(algorithm) if algorithm else None
            landed = read_chunks(f, len(mv), into=mv)
            if piece_hash is not None:
                landed = hashed(piece_hash, landed)
            if sum(len(chunk) for chunk in landed) != len(mv):
                raise _corrupt(fpath, "truncated")
            if piece_hash is not None:
                digest = piece_hash.hexdigest()
                if digest != piece.get("checksum"):
                    raise _corrupt(fpath, f"corrupt: {name!r}[{piece['start']}:{piece['end']}]")
                if digests is not None:
                    digests.append(digest)
    if digests is not None and file_digest(algorithm, raw_header, digests) != info.get("checksum"):
        raise _corrupt(fpath, "corrupt: its header or layout differs from the one written")


def compare_names(expected: Dict[str, Tuple[int, ...]], found: Dict[str, Tuple[int, ...]]) -> Iterable[str]:
    """Human-readable differences between the model's state and a checkpoint's."""
    for n in sorted(set(expected) - set(found)):
        yield f"missing {n} {tuple(expected[n])}"
    for n in sorted(set(found) - set(expected)):
        yield f"unexpected {n} {tuple(found[n])}"
    for n in sorted(set(expected) & set(found)):
        if tuple(expected[n]) != tuple(found[n]):
            yield f"{n}: model has shape {tuple(expected[n])}, checkpoint has {tuple(found[n])}"
