"""Checkpoint layout, the flat-state plan, shard files, metadata and checksums. No pickle anywhere.

    CHECKPOINT_DIR/                         checkpoint.dir (default RUN_DIR/checkpoints)
        <job_name>_<YYYYmmdd-HHMMSS>/       one directory per job (kept across restarts of a run)
            step_<N>/   (or epoch_<N>/)
                shard-00000-of-00004.safetensors    rank r's contiguous 1/W of the flat state
                ...
                metadata.json               tensors (dtype, shape, which file holds which element
                                            range), step, epoch, data cursor, world size, backend,
                                            config hash, checksum (xxh3_64) + byte size of every file
                COMMIT                      written last; a directory without it is never loaded
            .step_<N>.tmp-...               a save in flight (or one that died): never loaded

The flat state: every tensor in sorted-name order, flattened and laid end to end. Rank r of W
writes the elements whose first byte falls in [r*B/W, (r+1)*B/W) of the B bytes, so the split is
balanced by bytes and a tensor crossing a boundary is split between two files. Each shard file is
a plain safetensors file whose entries are the 1-D pieces (``safe_open`` reads it).

With sharded optimizer state (``trainer.shard``, ``Sharded``) the optimizer's tensors are not split by
bytes: each lies at an offset of the flat parameter vector, and rank r writes the elements of its own
slice of that vector (``shard.owned``), which is what it holds; the other tensors are split by bytes
as above. Nothing is gathered to save, and the metadata lists pieces either way, so a reader sees no
difference.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ElasticFlowError

FORMAT_VERSION = 2
METADATA = "metadata.json"
COMMIT = "COMMIT"
NAME_RE = re.compile(r"^(step|epoch)_(\d+)$")
JOB_RE = re.compile(r"^(?P<job>.+)_(?P<stamp>\d{8}-\d{6})(?:\.(?P<n>\d+))?$")
TMP_RE = re.compile(r"^\.(?P<name>(?:step|epoch)_\d+)\.tmp-s(?P<step>\d+)-(?P<token>[0-9a-f]+)-")

# The hints (ElasticFlowError's second line) of most errors in reading a checkpoint, here and in
# load: defined once, so that a reworded hint reads the same wherever it is given.
HINT_FALLBACK = "resume from an earlier checkpoint (resume=auto falls back by itself)"
HINT_PATH = "pass a checkpoint directory such as RUN_DIR/checkpoints/<job>/step_100"

# safetensors dtype codes (numpy has no bfloat16; the backends hand over numpy arrays)
DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
          "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
          "bool": "BOOL"}
NUMPY_DTYPES = {v: k for k, v in DTYPES.items()}


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


SHARD_RE = re.compile(r"shard-\d{5,}-of-\d{5,}\.safetensors")  # every name shard_name makes, and only those


class CorruptCheckpoint(ElasticFlowError):
    """A checkpoint whose metadata or shard files are damaged, truncated or inconsistent: resume=auto
    falls back past it to the previous one (unlike CheckpointMismatch, which stops the run)."""


# ---------------------------------------------------------------- the plan: who writes which elements
@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of tensor ``name``, held by shard ``rank``."""
    name: str
    rank: int
    start: int
    end: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) * self.itemsize


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: Tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class Partial:
    """What one rank holds of a sharded tensor of ``shape``: its elements [start, start + data.size)."""
    data: np.ndarray
    start: int
    shape: Tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def take(self, lo: int, hi: int) -> np.ndarray:
        if not (self.start <= lo and hi <= self.start + self.data.size):
            raise ValueError(f"elements [{lo}, {hi}) are not in this rank's [{self.start}, {self.start + self.data.size})")
        return self.data[lo - self.start:hi - self.start]


@dataclass(frozen=True)
class Sharded:
    """Tensors split by the owner of each range of a flat vector of ``n`` elements, not by bytes.

    ``offsets``: each such tensor's offset in the flat vector (an optimizer slot at its parameter's).
    ``owners``: parameter servers: the rank of each shard's primary (``servers.Layout``), which writes it;
    None: rank r owns the r-th of ``world`` equal ranges.
    ``frozen``: a second flat vector split by the same rule (trainer.shard=parameters' frozen parameters).
    """
    n: int
    offsets: Dict[str, int]
    owners: Optional[Tuple[int, ...]] = None
    frozen: Optional["Sharded"] = None

    def vectors(self) -> List["Sharded"]:
        return [self] + ([self.frozen] if self.frozen is not None else [])

    def owned(self, world: int, rank: int) -> Tuple[int, int]:
        if self.owners is not None:
            if rank not in self.owners:
                return 0, 0
            world, rank = len(self.owners), self.owners.index(rank)
        c = -(-self.n // world)  # the rule of shard.owned
        return min(rank * c, self.n), min((rank + 1) * c, self.n)


def take(value: Any, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of a state entry (an array or a ``Partial``), flat."""
    if isinstance(value, Partial):
        return value.take(lo, hi)
    return np.ravel(np.asarray(value))[lo:hi]


def specs_of(state: Dict[str, Any]) -> List[TensorSpec]:
    out = []
    for name in sorted(state):
        value = state[name]
        if isinstance(value, Partial):
            out.append(TensorSpec(name, value.dtype.name, tuple(int(d) for d in value.shape)))
            continue
        dtype = np.asarray(state[name]).dtype
        if dtype.name not in DTYPES:
            raise ElasticFlowError(f"state entry {name!r} has dtype {dtype}, which a checkpoint cannot hold",
                                   f"use one of {', '.join(DTYPES)}")
        out.append(TensorSpec(name, dtype.name, tuple(int(d) for d in np.shape(state[name]))))
    return out


def plan(specs: Sequence[TensorSpec], world: int, sharded: Optional[Sharded] = None) -> List[List[Piece]]:
    """The pieces each of ``world`` ranks writes, in file order (sorted name, then element).

    ``sharded``: tensors each rank writes its own slice of (see ``Sharded``); the rest split by bytes.
    """
    if sharded is not None:
        vectors = sharded.vectors()
        out = _plan_bytes([s for s in specs if not any(s.name in v.offsets for v in vectors)], world)
        for s in specs:
            vector = next((v for v in vectors if s.name in v.offsets), None)
            if vector is None:
                continue
            at, item = vector.offsets[s.name], np.dtype(s.dtype).itemsize
            for r in range(world):
                lo, hi = vector.owned(world, r)
                a, b = max(lo, at), min(hi, at + s.size)
                if b > a:
                    out[r].append(Piece(s.name, r, a - at, b - at, item))
        return [sorted(pieces, key=lambda p: (p.name, p.start)) for pieces in out]
    return _plan_bytes(specs, world)


def _plan_bytes(specs: Sequence[TensorSpec], world: int) -> List[List[Piece]]:
    total = sum(s.size * np.dtype(s.dtype).itemsize for s in specs)
    bounds = [r * total // world for r in range(world + 1)]
    out: List[List[Piece]] = [[] for _ in range(world)]
    offset = 0
    for s in specs:
        item = np.dtype(s.dtype).itemsize
        nbytes = s.size * item
        # The first rank whose byte range reaches into this tensor; walk forward from there.
        for r in range(world):
            if bounds[r + 1] <= offset:
                continue
            if bounds[r] >= offset + nbytes and nbytes:
                break
            lo = max(0, -(-(bounds[r] - offset) // item))
            hi = min(s.size, -(-(bounds[r + 1] - offset) // item))
            if hi > lo:
                out[r].append(Piece(s.name, r, lo, hi, item))
        offset += nbytes
    return out


def plan_digest(specs: Sequence[TensorSpec], world: int, sharded: Optional[Sharded] = None) -> str:
    """Every rank computes the plan from its own replica; rank 0 checks they all agree."""
    text = json.dumps([world, [[s.name, s.dtype, list(s.shape)] for s in specs],
                       None if sharded is None else [sharded.n, sorted(sharded.offsets.items())]
                       + ([] if sharded is None or sharded.owners is None else [list(sharded.owners)])
                       + ([] if sharded is None or sharded.frozen is None else
                          [sharded.frozen.n, sorted(sharded.frozen.offsets.items())])])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- safetensors shard files
def shard_header(pieces: Sequence[Piece], specs: Dict[str, TensorSpec], rank: int, world: int) -> bytes:
    """The 8-byte length plus JSON header of a shard file holding ``pieces`` end to end."""
    header: Dict[str, Any] = {"__metadata__": {"format": "elasticflow", "rank": str(rank), "world": str(world)}}
    at = 0
    for p in pieces:
        header[p.name] = {"dtype": DTYPES[specs[p.name].dtype], "shape": [p.end - p.start],
                          "data_offsets": [at, at + p.nbytes]}
        at += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def read_shard_header(path: Path) -> Tuple[Dict[str, Any], int, bytes]:
    """(entries, offset of the data region, the raw header bytes) of a shard file."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if not 0 < n < 100_000_000:
                raise ValueError("bad header length")
            raw = f.read(n)
        header = json.loads(raw)
    except (OSError, ValueError, struct.error, RecursionError) as exc:  # RecursionError: nested too deeply
        raise CorruptCheckpoint(f"checkpoint shard '{path}' is corrupt (unreadable header: {exc})",
                                HINT_FALLBACK) from exc
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"checkpoint shard '{path}' is corrupt: its header is a JSON "
                                f"{type(header).__name__}, expected an object", HINT_FALLBACK)
    header.pop("__metadata__", None)
    return header, 8 + n, prefix + raw


# ---------------------------------------------------------------- checksums
class _Crc32:
    """zlib.crc32 behind the hashlib interface: the fallback when the xxhash package is missing."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value & 0xFFFFFFFF:08x}"


def _xxh3():
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_64


# xxh3_64 hashes at ~10 GB/s on one core, against ~1.5 for CRC-32 (zlib): hashing every byte as it
# is written costs ~5% of the write instead of half of it (scripts/bench/bench_checkpoint.py).
CHECKSUM = "xxh3_64" if _xxh3() is not None else "crc32"


def hasher(algorithm: str):
    """A streaming hasher (``update``, ``hexdigest``) for the checksum named in a checkpoint's metadata."""
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "xxh3_64":
        xxh3 = _xxh3()
        if xxh3 is None:
            raise ElasticFlowError("this checkpoint's checksums are xxh3_64 and the xxhash package is missing",
                                   "pip install xxhash (elasticflow's setup installs it)")
        return xxh3()
    raise ElasticFlowError(f"unknown checkpoint checksum {algorithm!r}", "use the elasticflow that wrote it")


def file_digest(algorithm: str, header: bytes, piece_digests: Sequence[str]) -> str:
    """A shard file's checksum: of its header and its pieces' checksums, in file order. Every byte
    of the file is covered, and each byte is hashed once whether a reader wants the whole or a part."""
    h = hasher(algorithm)
    h.update(header)
    for d in piece_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


# ---------------------------------------------------------------- moving shard data in chunks
# Bytes per read or write call on shard data. Each chunk is hashed right beside its I/O, so small
# enough that the hash and the copy write() or readinto() makes find it in the CPU's last-level cache
# (tens of MiB on a server) rather than both going to memory for it; large enough that a call's fixed
# cost (a syscall, a hasher update, a turn of a Python loop: microseconds) stays under 1% of moving
# the chunk (milliseconds).
CHUNK = 8 << 20


def chunks(view: memoryview) -> Iterator[memoryview]:
    """``view`` in CHUNK-byte slices, in order (slices of the view: no copy)."""
    return (view[at:at + CHUNK] for at in range(0, len(view), CHUNK))


def read_chunks(f, nbytes: int, into: Optional[memoryview] = None) -> Iterator[memoryview]:
    """Read ``nbytes`` from the file ``f`` CHUNK bytes at a time, yielding each chunk as it lands.

    Args:
        f: a file opened with ``buffering=0`` (``readinto`` goes straight to ``into``).
        into: ``nbytes`` bytes to fill in place (the caller's array: no copy); None: one scratch
            chunk, overwritten by the next read (when only the hash of the bytes is wanted).
    Note: stops at the end of the file: a truncated file yields fewer than ``nbytes`` bytes, and the
    caller, who knows what that means, compares.
    """
    scratch = memoryview(bytearray(min(nbytes, CHUNK))) if into is None else None
    for at in range(0, nbytes, CHUNK):
        chunk = into[at:at + CHUNK] if scratch is None else scratch[:min(CHUNK, nbytes - at)]
        got = f.readinto(chunk)
        if got:
            yield chunk[:got]
        if got != len(chunk):
            return


def hashed(h, stream: Iterable[memoryview]) -> Iterator[memoryview]:
    """The chunks of ``stream`` as they are, each fed to the hasher ``h`` as it passes: the one place
    shard data is hashed. Writing, ``for c in hashed(h, chunks(view)): write(c)`` hashes a chunk
    just before it is written; reading, ``hashed(h, read_chunks(f, n, view))`` hashes it just after
    it is read. Either way the chunk is hashed while it is in the CPU cache, and nothing is copied
    for the hash."""
    for chunk in stream:
        h.update(chunk)
        yield chunk


def file_checksum(path: Path, algorithm: str) -> str:
    """Recompute a shard file's checksum from its bytes (the writer's ``file_digest``)."""
    header, data_start, raw = read_shard_header(path)
    digests = []
    with open(path, "rb", buffering=0) as f:
        for entry in sorted(header.values(), key=lambda e: e["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            f.seek(data_start + begin)
            h = hasher(algorithm)
            for _ in hashed(h, read_chunks(f, end - begin)):
                pass
            digests.append(h.hexdigest())
    return file_digest(algorithm, raw, digests)


# ---------------------------------------------------------------- metadata
def is_complete(path: Path) -> bool:
    return (Path(path) / COMMIT).is_file() and (Path(path) / METADATA).is_file()


def read_metadata(path: Path) -> Dict[str, Any]:
    meta_file = Path(path) / METADATA
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError as exc:
        raise ElasticFlowError(f"checkpoint '{path}' has no {METADATA}", HINT_PATH) from exc
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        where = (f" ({exc.msg} at char {exc.pos})" if isinstance(exc, json.JSONDecodeError) else
                 " (nested too deeply)" if isinstance(exc, RecursionError) else "")
        raise CorruptCheckpoint(f"checkpoint metadata '{meta_file}' is corrupt or truncated{where}",
                                HINT_FALLBACK) from exc
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ElasticFlowError(f"checkpoint '{path}' has format version {version!r}, "
                               f"this elasticflow reads {FORMAT_VERSION}", "use the elasticflow that wrote it")
    for key in ("step", "cursor", "tensors", "files"):
        if key not in meta:
            raise CorruptCheckpoint(f"checkpoint metadata '{meta_file}' has no {key!r} entry", HINT_FALLBACK)
    return meta


def config_hash(cfg: Any) -> str:
    """A short hash of what shapes training: the model, its arguments, optimizer, batch and seed
    (not how it runs: workers, checkpoints, max_steps). Recorded for inspection, never enforced."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    keep = {k: c.get(k) for k in ("model_args", "optimizer", "seed")}
    keep["model"] = Path(str(c.get("model"))).name
    keep["global_batch_size"] = (c.get("trainer") or {}).get("global_batch_size")
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- finding checkpoints
def _job_key(path: Path) -> Tuple[str, int]:
    m = JOB_RE.match(path.name)
    return (m.group("stamp"), int(m.group("n") or 0)) if m else ("", 0)


def job_dirs(directory: str | Path, job_name: Optional[str] = None) -> List[Path]:
    """The job directories under ``directory`` (checkpoint.dir), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [c for c in directory.iterdir() if c.is_dir() and (m := JOB_RE.match(c.name))
             and (job_name is None or m.group("job") == job_name)]
    return sorted(found, key=lambda p: (_job_key(p), p.stat().st_mtime))


def _checkpoints_in(directory: Path) -> List[Path]:
    found = []
    for child in directory.iterdir():
        if child.is_dir() and NAME_RE.match(child.name) and is_complete(child):
            try:
                meta = json.loads((child / METADATA).read_text())
                key = (int(meta["step"]), int(meta["cursor"]["samples_seen"]))
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError, UnicodeDecodeError):
                key = (-1, -1)  # unreadable metadata sorts first; load() reports it if it is chosen
            found.append((key, child.stat().st_mtime, child))
    return [p for _, _, p in sorted(found, key=lambda t: (t[0], t[1]))]


def complete_checkpoints(directory: str | Path) -> List[Path]:
    """Complete checkpoints under ``directory``, oldest first.

    ``directory`` is a job directory, or checkpoint.dir: then the job directories one level down
    are searched, oldest job first (by step, then samples seen, within a job).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = _checkpoints_in(directory)
    for job in job_dirs(directory):
        out += _checkpoints_in(job)
    return out


def latest(directory: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``directory`` (a job dir or checkpoint.dir), or None."""
    found = complete_checkpoints(Path(directory))
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint directory as given, or the newest complete one under a job dir, a checkpoint.dir or a
    run directory (its ``checkpoints/``, where ``elasticflow train`` puts them by default)."""
    path = Path(path)
    if (path / METADATA).exists() or not path.is_dir():
        return path
    found = latest(path)
    if found is None and (path / "checkpoints").is_dir():
        found = latest(path / "checkpoints")
    return found or path


def temp_dirs(job_dir: Path) -> Iterable[Tuple[Path, int, str]]:
    """(path, step, run token) of every in-flight or abandoned save under ``job_dir``."""
    if not job_dir.is_dir():
        return []
    out = []
    for child in job_dir.iterdir():
        m = TMP_RE.match(child.name)
        if m and child.is_dir():
            out.append((child, int(m.group("step")), m.group("token")))
    return out
