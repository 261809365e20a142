"""Checkpoint layout, metadata and checksums. No pickle anywhere: tensors are safetensors, the rest JSON.

    CHECKPOINT_DIR/step_<N>/            (or epoch_<N>/)
        shard-00000-of-00001.safetensors
        metadata.json                   tensors (dtype, shape, which file holds which range),
                                        step, epoch, data cursor, world size, backend, checksums
        COMMIT                          written last; a directory without it is never loaded
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..errors import ElasticFlowError

FORMAT_VERSION = 1
METADATA = "metadata.json"
COMMIT = "COMMIT"
NAME_RE = re.compile(r"^(step|epoch)_(\d+)$")


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_complete(path: Path) -> bool:
    return (path / COMMIT).is_file() and (path / METADATA).is_file()


def read_metadata(path: Path) -> Dict[str, Any]:
    meta_file = Path(path) / METADATA
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError as exc:
        raise ElasticFlowError(f"checkpoint '{path}' has no {METADATA}",
                               "pass a checkpoint directory such as RUN_DIR/checkpoints/step_100") from exc
    except json.JSONDecodeError as exc:
        raise ElasticFlowError(f"checkpoint metadata '{meta_file}' is corrupt ({exc.msg} at char {exc.pos})",
                               "resume from an earlier checkpoint (resume=auto falls back by itself)") from exc
    if meta.get("format_version") != FORMAT_VERSION:
        raise ElasticFlowError(f"checkpoint '{path}' has format version {meta.get('format_version')!r}, "
                               f"this elasticflow reads {FORMAT_VERSION}", "use the elasticflow that wrote it")
    return meta


def complete_checkpoints(directory: Path) -> List[Path]:
    """Complete checkpoints under ``directory``, oldest first (by step, then epoch count)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        if child.is_dir() and NAME_RE.match(child.name) and is_complete(child):
            try:
                meta = json.loads((child / METADATA).read_text())
                key = (int(meta["step"]), int(meta["cursor"]["samples_seen"]))
            except (ValueError, KeyError, json.JSONDecodeError):
                key = (-1, -1)  # unreadable metadata sorts first; load() reports it if it is chosen
            found.append((key, child.stat().st_mtime, child))
    return [p for _, _, p in sorted(found, key=lambda t: (t[0], t[1]))]


def latest(directory: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``directory``, or None."""
    found = complete_checkpoints(Path(directory))
    return found[-1] if found else None
