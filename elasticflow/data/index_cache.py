"""The shard index cache: each shard's index (``shard_formats``) built once, kept where only its user can write,
under a name made from the shard's identity, and read back only while it still describes that very file.

Where: ``$XDG_CACHE_HOME/elasticflow/index`` (default ``~/.cache/elasticflow/index``), its folders made ``0700``.
It is used only if it is this user's and writable by nobody else, and every folder above it belongs to this user
or root and is writable by nobody else (a sticky folder like /tmp aside, where only an entry's owner may rename
it, and a user private group's). Anything else (a cache on a shared folder, a home of another user's) is refused
with one warning, and the process indexes into a private temporary folder of its own, removed at exit.

Never beside the data: a name anyone can compute in a folder others may write let a local user plant an index
that swaps samples, or a ``.lock`` symlink through which the job truncated a file of its owner's (issue 65). An
``.elasticflow-index/`` folder that older versions left beside the data is never read nor written.

The identity: the shard's real path, inode, size, modification and change times, and a hash of its first and last
4 KiB, with the format and its options. Nobody can set a file's change time back, so a shard rewritten in place,
its modification time restored, is indexed again. An entry is trusted only if it is a folder of this user's, its
recorded identity is the shard's now, and its arrays fit the file (``Shard.fits``: row counts, offsets inside the
file); anything else is built again. Files are opened ``O_NOFOLLOW``, written under fresh names (``O_EXCL``) and
renamed into place whole: nothing is truncated, nothing written through a link.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np

from .._util.paths import private_group
from ..errors import ElasticFlowError
from . import shard_formats
from .rows import DiskRows

log = logging.getLogger("elasticflow")

VERSION = 2  # of the entries' layout: a change makes every entry another name, so older ones are built again
EDGE = 4096  # bytes hashed at each end of a shard: one page each, read once per shard per start
MAPPED_BYTES = 1 << 16  # an index array larger than this stays on disk (DiskRows); smaller ones are read whole
NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
TRIES = 3  # a shard that changes while each of these builds is refused


def cached_index(path: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """The shard's index, from the cache where an entry still describes the file; else built and cached. Arrays
    with a row per sample come back as ``DiskRows`` (read by ``pread``), the rest in memory.

    Workers that start together share the work: one lock per data folder's entries (``flock`` on a ``.lock``
    in the private cache), and whoever takes it indexes the next shard not yet cached while the others wait and
    then read its result."""
    kind = shard_formats.format_of(path)
    for _ in range(TRIES):
        identity = shard_identity(path, options)
        folder, name = entry_of(identity)
        where = _root() / folder
        try:
            _own(where)
        except _Unsafe as exc:  # only this user (or root) can have made it so, the cache above being private
            raise ElasticFlowError(f"the shard index cache's folder {exc.args[0]}",
                                   f"remove {where}: it is made again") from None
        loaded = _load(where / name, identity, kind)
        if loaded is not None:
            return loaded
        with _locked(where):
            loaded = _load(where / name, identity, kind)
            if loaded is not None:
                return loaded
            built = kind.index(path, **options)
            if shard_identity(path, options) != identity:
                continue  # written to while it was indexed: the index may describe neither version
            _remove(where / name)  # an entry that did not load: it does not describe this file
            _store(where, name, identity, built)
            _prune(where, name)
        return _load(where / name, identity, kind) or built
    raise ElasticFlowError(f"{path} changed each of the {TRIES} times it was indexed",
                           "stop whatever is writing the shard, or train on a copy of it")


def shard_identity(path: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """What an index describes: the file (real path, inode, size, times, its ends' hash), format and options.
    The device is left out: hosts that share the data number its mount differently."""
    real = os.path.realpath(path)
    with open(real, "rb") as f:
        st = os.fstat(f.fileno())
        ends = hashlib.sha256(f.read(EDGE))
        f.seek(max(st.st_size - EDGE, 0))
        ends.update(f.read(EDGE))
    seq_len, dtype = options.get("seq_len"), options.get("dtype")
    return {"version": VERSION, "path": real, "inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ends": ends.hexdigest(), "format": shard_formats.format_of(path).__name__,
            "seq_len": None if seq_len is None else int(seq_len), "dtype": None if dtype is None else str(dtype)}


def entry_of(identity: Dict[str, Any]) -> Tuple[str, str]:
    """(folder, entry) under the cache's root: a folder per data folder, an entry per shard version."""
    parent, base = os.path.split(identity["path"])
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return hashlib.sha1(parent.encode()).hexdigest()[:16], f"{base[:100]}.{digest}"  # the folders of version 1


# ---------------------------------------------------------------- where: a folder only this user can write
def _root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return _private_root(os.path.abspath(base))


@functools.lru_cache(maxsize=None)  # once per process and cache home
def _private_root(base: str) -> Path:
    home = Path(os.path.realpath(base))
    root = home / "elasticflow" / "index"
    try:
        for folder in [*reversed(home.parents), home]:
            if not os.path.lexists(folder):  # a cache home not made yet (~/.cache): made 0700
                _mkdir(folder)
            _check(folder, mine=False)
        for folder in (root.parent, root):
            _own(folder)
        return root
    except (_Unsafe, OSError) as exc:
        why = exc.args[0] if isinstance(exc, _Unsafe) else f"cannot be made ({exc.strerror}: {exc.filename})"
    fallback = tempfile.mkdtemp(prefix="elasticflow-index-")  # 0700 under a fresh name
    owner = os.getpid()  # forked loaders inherit the handler: only this process removes it
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(fallback, ignore_errors=True))
    log.warning(f"the shard index cache {root} is not used: {why}; indexing into {fallback} for this process "
                f"only (hint: point $XDG_CACHE_HOME at a folder of your own that nobody else may write)")
    return Path(fallback)


class _Unsafe(Exception):
    pass


def _mkdir(folder: Path) -> None:
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass


def _own(folder: Path) -> None:
    """FOLDER, one of the cache's own, made 0700 where missing; one of this user's left looser by an older
    version (made under the umask) is made 0700, its entries being checked one by one as they are read."""
    _mkdir(folder)
    st = os.lstat(folder)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(folder, 0o700)
    _check(folder, mine=True)


def _check(folder: Path, mine: bool) -> None:
    """_Unsafe unless FOLDER is a real folder (no link) that only this user (and root, above the cache) may
    change: whoever else could would rename our entries away and put theirs in their place. Above the cache a
    sticky folder (/tmp) is fine, and so is one a user private group may write (a umask of 002)."""
    st = os.lstat(folder)
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        raise _Unsafe(f"{folder} is not a folder")
    if st.st_uid != os.geteuid() and (mine or st.st_uid != 0):
        raise _Unsafe(f"{folder} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})")
    if mine and mode & 0o022 or not mine and not mode & stat.S_ISVTX and (
            mode & stat.S_IWOTH or mode & stat.S_IWGRP and not private_group(st.st_gid, st.st_uid)):
        raise _Unsafe(f"{folder} may be written by others (mode {mode:o})")


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    try:
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)  # never truncated: only a lock
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        _remove(folder / ".lock")  # a link (left where an older version's folder was looser): never followed
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        yield
    finally:
        os.close(fd)


# ---------------------------------------------------------------- an entry: written whole, read back checked
def _store(folder: Path, name: str, identity: Dict[str, Any], index: Dict[str, Any]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=folder))
    for key, array in index.items():
        with _create(tmp / f"{key}.npy") as f:
            np.save(f, np.asarray(array), allow_pickle=False)
    with _create(tmp / "identity.json") as f:
        f.write(json.dumps(identity, sort_keys=True).encode())
    try:
        os.rename(tmp, folder / name)  # whole or absent: a folder appears at once
    except OSError:  # one is there already (built on another host): it is read back and checked
        shutil.rmtree(tmp, ignore_errors=True)


def _create(path: Path):
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600), "wb")


def _prune(folder: Path, name: str) -> None:
    """Under the folder's lock: remove the entries of the shard's earlier versions (same file name, another
    identity) and any build left half done (by a process that died: a build holds the lock)."""
    base = name.rpartition(".")[0]
    for other in os.listdir(folder):
        stem, _, digest = other.rpartition(".")
        earlier = stem == base and len(digest) in (12, 32) and all(c in "0123456789abcdef" for c in digest)
        if other != name and (earlier or (other.startswith(".") and other.endswith(".tmp"))):
            _remove(folder / other)


def _remove(entry: Path) -> None:
    """Remove ENTRY, a link or a file as itself (never what it points to), a folder with what it holds."""
    try:
        if stat.S_ISDIR(os.lstat(entry).st_mode):
            shutil.rmtree(entry, ignore_errors=True)  # which never follows a link inside
        else:
            os.unlink(entry)
    except FileNotFoundError:
        pass


def _load(entry: Path, identity: Dict[str, Any], kind: type) -> Optional[Dict[str, Any]]:
    try:
        st = os.lstat(entry)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return None
        if json.loads(_read(entry / "identity.json", 1 << 16)) != identity:
            return None
        index = {n[:-4]: _array(entry / n) for n in os.listdir(entry) if n.endswith(".npy")}
        return index if shard_formats.fits(kind, index, identity["size"]) else None
    except (OSError, ValueError, TypeError, IndexError, ElasticFlowError):  # whatever it holds: built again
        return None


def _read(path: Path, limit: int) -> bytes:
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | NOFOLLOW)) as f:
        return f.read(limit)


def _array(path: Path) -> Any:
    """An index array, opened O_NOFOLLOW and mapped (np.load maps by name only); object arrays refused."""
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | NOFOLLOW)) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):  # np.save writes these for an index's arrays
            raise ValueError(f"{path}: .npy version {version}")
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = header(f)
        if dtype.hasobject or fortran:
            raise ValueError(f"{path}: not an index array")
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes <= MAPPED_BYTES or len(shape) != 2:  # read whole
            blob = f.read(nbytes)
            if len(blob) != nbytes:
                raise ValueError(f"{path}: shorter than its header says")
            return np.frombuffer(blob, dtype).reshape(shape).copy()
        return DiskRows(np.memmap(f, dtype=dtype, mode="r", offset=f.tell(), shape=shape))  # ValueError if short
