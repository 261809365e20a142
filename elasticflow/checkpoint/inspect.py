"""`elasticflow inspect CKPT`: a checkpoint's metadata as tables: tensors, and which shard holds what."""
from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import numpy as np

from .format import is_complete, read_metadata, resolve
from .validate import check_metadata


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _table(rows: Sequence[Sequence[str]]) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(path: Path) -> str:
    """The text ``elasticflow inspect`` prints; ``path`` may also be a job dir or checkpoint.dir (its newest)."""
    path = resolve(Path(path))
    meta = read_metadata(path)
    check_metadata(path, meta)  # a damaged or hand-edited one is one error line, not a traceback
    cursor = meta.get("cursor", {})
    files = meta["files"]
    ranks = {f: info.get("rank", i) for i, (f, info) in enumerate(sorted(files.items()))}
    lines = [f"checkpoint {path}" + ("" if is_complete(path) else "  (INCOMPLETE: no COMMIT marker)"),
             f"  step {meta['step']}  epoch {meta.get('epoch')}  samples seen {cursor.get('samples_seen')}  "
             f"world size {meta.get('world_size')}  backend {meta.get('backend')}  optimizer {meta.get('optimizer')}",
             f"  {len(files)} shard file(s) written by {meta.get('writers', len(files))} rank(s), "
             f"{_size(sum(i['bytes'] for i in files.values()))}; format {meta['format_version']}, "
             f"config hash {meta.get('config_hash', '-')}", ""]
    rows = [("name", "dtype", "shape", "size", "pieces (rank[start:end] of the flat tensor)")]
    total = 0
    for name, t in sorted(meta["tensors"].items()):
        nbytes = int(np.prod(t["shape"], dtype=np.int64)) * np.dtype(t["dtype"]).itemsize
        total += nbytes
        pieces = " ".join(f"r{ranks.get(p['file'], '?')}[{p['start']}:{p['end']}]" for p in t["shards"])
        rows.append((name, t["dtype"], "x".join(map(str, t["shape"])) or "scalar", _size(nbytes), pieces or "-"))
    lines += _table(rows)
    lines += [f"  {len(rows) - 1} tensors, {_size(total)}", ""]
    frows = [("file", "rank", "size", meta.get("checksum", "checksum"), "pieces", "holds (first .. last piece)")]
    for fname, info in sorted(files.items(), key=lambda kv: kv[1].get("rank", 0)):
        held = [(n, p) for n, t in sorted(meta["tensors"].items()) for p in t["shards"] if p["file"] == fname]
        span = (f"{held[0][0]}[{held[0][1]['start']}:] .. {held[-1][0]}[:{held[-1][1]['end']}]" if held else "-")
        frows.append((fname, str(info.get("rank", "?")), _size(info["bytes"]), str(info.get("checksum")),
                      str(len(held)), span))
    lines += _table(frows)
    return "\n".join(lines)
