"""Small file habits the package shares: replace a file atomically, append a JSON line and read them back,
align a byte offset."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

ALIGN = 64  # bytes: a cache line, and a start aligned for any dtype


def aligned(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader sees the old or the new
    content, never a torn one. The temporary name carries the pid, so two writers never share it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def append_event(path: Path, kind: str, source: str, **fields: Any) -> None:
    """Append one event ``{"time", "event", "source", **fields}`` to a JSONL file (RUN_DIR/events.jsonl).

    Note: one ``write`` of one line on a file opened for appending: lines of processes that append to
    the same file (the agent and the workers) do not interleave.
    """
    record: Dict[str, Any] = {"time": time.time(), "event": kind, "source": source, **fields}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    """The JSON objects of a JSONL file (events.jsonl, metrics.jsonl), in order; [] if it does not exist.
    A torn line (its writer was killed mid-line) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
