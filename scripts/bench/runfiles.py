"""What the bench scripts share for running a job and reading what it wrote: scripts/bench/bench_elastic.py,
bench_shard.py, bench_hosts.py, bench_failover.py and join.py.

A leaf beside them (``from runfiles import jsonl``: a script's own folder is first on sys.path): it imports no
bench script, so the dependency goes one way.
"""
from __future__ import annotations

import signal
import subprocess

from elasticflow._util.fileio import read_jsonl as jsonl  # noqa: F401  (skips a line torn by a SIGKILL)


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """Stop a job the bench started as Ctrl-C would (its workers checkpoint and exit), SIGKILL it if it has not
    ended within ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
