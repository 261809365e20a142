"""Read a checkpoint back as numpy arrays by name, verifying every file's checksum."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Tuple

import numpy as np
from safetensors import safe_open

from ..errors import ElasticFlowError
from .format import file_digest, is_complete, read_metadata


def load(path: str | Path, verify: bool = True) -> Dict[str, np.ndarray]:
    """The full state of checkpoint ``path``: parameters, buffers and ``optimizer/<param>/<slot>``.

    Example:
        >>> state = elasticflow.checkpoint.load("outputs/run/checkpoints/step_100")
        >>> state["W1"].shape
    """
    return load_with_metadata(path, verify)[0]


def load_with_metadata(path: str | Path, verify: bool = True) -> Tuple[Dict[str, np.ndarray], dict]:
    path = Path(path)
    if not path.is_dir():
        raise ElasticFlowError(f"checkpoint '{path}' does not exist", "pass a directory such as RUN_DIR/checkpoints/step_100")
    if not is_complete(path):
        raise ElasticFlowError(f"checkpoint '{path}' is incomplete (no COMMIT marker): its save was interrupted",
                               "resume from an earlier checkpoint; resume=auto skips incomplete ones")
    meta = read_metadata(path)
    for fname, info in meta["files"].items():
        fpath = path / fname
        if not fpath.is_file():
            raise ElasticFlowError(f"checkpoint shard '{fpath}' is missing", "resume from an earlier checkpoint")
        if verify and (fpath.stat().st_size != info["bytes"] or file_digest(fpath) != info["sha256"]):
            raise ElasticFlowError(f"checkpoint shard '{fpath}' fails its checksum (corrupt or truncated)",
                                   "resume from an earlier checkpoint (resume=auto falls back by itself)")
    out: Dict[str, np.ndarray] = {}
    handles: Dict[str, object] = {}
    try:
        for name, t in meta["tensors"].items():
            flat = np.empty(int(np.prod(t["shape"], dtype=np.int64)), dtype=np.dtype(t["dtype"]))
            for piece in t["shards"]:
                if piece["file"] not in handles:
                    handles[piece["file"]] = safe_open(str(path / piece["file"]), framework="numpy")
                flat[piece["start"]:piece["end"]] = handles[piece["file"]].get_tensor(name).reshape(-1)
            out[name] = flat.reshape(t["shape"])
    finally:
        handles.clear()
    return out, meta


def compare_names(expected: Dict[str, Tuple[int, ...]], found: Dict[str, Tuple[int, ...]]) -> Iterable[str]:
    """Human-readable differences between the model's state and a checkpoint's."""
    for n in sorted(set(expected) - set(found)):
        yield f"missing {n} {tuple(expected[n])}"
    for n in sorted(set(found) - set(expected)):
        yield f"unexpected {n} {tuple(found[n])}"
    for n in sorted(set(expected) & set(found)):
        if tuple(expected[n]) != tuple(found[n]):
            yield f"{n}: model has shape {tuple(expected[n])}, checkpoint has {tuple(found[n])}"
