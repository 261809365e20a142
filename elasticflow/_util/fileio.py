"""Small file habits the package shares: replace a file atomically, append a JSON line and read them back,
align a byte offset."""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Dict, List, TextIO

from . import untrusted

ALIGN = 64  # bytes: a cache line, and a start aligned for any dtype


def aligned(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


def write_atomic(path: Path, text: str, mode: int = 0o666) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and a rename: a reader sees the old or the
    new content, never a torn one, and after a crash (power loss included) one of the two is on disk.

    The temporary file is created beside ``path`` with O_EXCL and O_NOFOLLOW under a random name, so neither
    a second writer nor a symlink planted at a name guessed in advance is ever written through. On any
    failure before the rename it is removed and ``path`` keeps its old content (a failing fsync of the
    directory, after it, raises with the new content in place).

    Note: two fsyncs (the file before the rename, the directory after it) cost a few milliseconds on a disk;
    the callers write small records (summaries, job records), not every step. The new file gets ``mode`` less
    the umask (0o600: the owner's only, a secret), not the old file's: a looser old mode is replaced.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:  # owns fd from here: closes it on the way out, also on an error
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())  # the content is on disk before the rename makes it the file's
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt too: never leave a stray temporary behind
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)  # the rename itself is on disk


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_append(path: Path, buffering: int = -1) -> TextIO:
    """``open(path, "a")``, but never through a symlink at ``path`` (O_NOFOLLOW: a planted link fails with
    ELOOP instead of having the job append into a file of the planter's choosing)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    return os.fdopen(fd, "a", buffering=buffering)


def append_event(path: Path, kind: str, source: str, **fields: Any) -> None:
    """Append one event ``{"time", "event", "source", **fields}`` to a JSONL file (RUN_DIR/events.jsonl).

    Note: one ``write`` of one line on a file opened for appending: lines of processes that append to
    the same file (the agent and the workers) do not interleave.
    """
    record: Dict[str, Any] = {"time": time.time(), "event": kind, "source": source, **fields}
    with open_append(path) as f:
        f.write(json.dumps(record) + "\n")


class Records(list):
    """``read_jsonl``'s records, and how many lines it skipped (``skipped``)."""

    skipped = 0


def read_jsonl(path: Path, timed: bool = False) -> Records:
    """The JSON objects of a JSONL file (events.jsonl, metrics.jsonl), in order; [] if it does not exist.

    A line that is not a JSON object is skipped and counted in ``.skipped``: a torn last line (its writer was
    killed mid-line), or a line someone crafted (parsed by ``untrusted.loads``: bounded in size and depth).
    ``timed``: only records whose ``time`` is a plausible Unix time and whose ``event``, if any, is text.
    """
    path = Path(path)
    out = Records()
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = untrusted.loads(line, max_bytes=1 << 20)
        except ValueError:
            record = None
        if isinstance(record, dict) and (not timed or _timed(record)):
            out.append(record)
        elif line.strip():
            out.skipped += 1
    return out


def _timed(record: Dict[str, Any]) -> bool:
    return (untrusted.unix_time(record.get("time")) and isinstance(record.get("event", ""), str)
            and isinstance(record.get("step", 0), int))
