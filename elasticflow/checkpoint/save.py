"""Write a checkpoint atomically: files under a temporary name, COMMIT last, then one rename."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
from safetensors.numpy import save_file

from .format import COMMIT, FORMAT_VERSION, METADATA, complete_checkpoints, file_digest, shard_name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str | Path, name: str, tensors: Dict[str, np.ndarray], info: Dict[str, Any],
         keep: Optional[int] = None) -> Path:
    """Write ``tensors`` and ``info`` as checkpoint ``directory/name``; returns its path.

    A crash at any moment leaves either the previous checkpoints only, or this one complete.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / name
    tmp = directory / f".{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    shard = shard_name(0, 1)
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(arrays, str(tmp / shard))
    with open(tmp / shard, "rb+") as f:
        os.fsync(f.fileno())
    meta = {
        "format_version": FORMAT_VERSION,
        **info,
        "tensors": {k: {"dtype": str(v.dtype), "shape": list(v.shape),
                        "shards": [{"file": shard, "start": 0, "end": int(v.size)}]} for k, v in arrays.items()},
        "files": {shard: {"sha256": file_digest(tmp / shard), "bytes": (tmp / shard).stat().st_size}},
    }
    (tmp / METADATA).write_text(json.dumps(meta, indent=1, sort_keys=True))
    (tmp / COMMIT).write_text("ok\n")
    _fsync_dir(tmp)
    if final.exists():  # same step written twice (e.g. a final save right after an interval save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(directory)
    if keep:
        for old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final
