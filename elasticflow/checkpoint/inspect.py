"""`elasticflow inspect CKPT`: the metadata of a checkpoint as a table."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .format import is_complete, read_metadata


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def render(path: Path) -> str:
    meta = read_metadata(path)
    cursor = meta.get("cursor", {})
    lines = [f"checkpoint {path}" + ("" if is_complete(path) else "  (INCOMPLETE: no COMMIT marker)"),
             f"  step {meta['step']}  epoch {meta['epoch']}  samples seen {cursor.get('samples_seen')}  "
             f"world size {meta['world_size']}  backend {meta['backend']}  optimizer {meta.get('optimizer')}",
             f"  files: " + ", ".join(f"{f} ({_size(i['bytes'])})" for f, i in meta["files"].items()), ""]
    rows = [("name", "dtype", "shape", "size", "shards")]
    total = 0
    for name, t in sorted(meta["tensors"].items()):
        nbytes = int(np.prod(t["shape"], dtype=np.int64)) * np.dtype(t["dtype"]).itemsize
        total += nbytes
        rows.append((name, t["dtype"], "x".join(map(str, t["shape"])) or "scalar", _size(nbytes),
                     str(len(t["shards"]))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"  {len(rows) - 1} tensors, {_size(total)}")
    return "\n".join(lines)
