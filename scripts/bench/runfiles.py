"""Reading what a run wrote, for the bench scripts: scripts/bench_elastic.py and scripts/bench/join.py.

Here, under scripts/bench/, so the dependency goes one way: scripts/*.py import scripts/bench/, never the reverse.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List


def jsonl(path: Path) -> List[dict]:
    """The records of a JSONL file (metrics.jsonl, events.jsonl); [] if it does not exist yet."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line torn by a SIGKILL
            pass
    return out
