"""This process's resident memory (``rss_mib``): read by the membership thread for the agent's store and by
rank 0 for its step records. A leaf, so that both import it from below."""
from __future__ import annotations

import os

_PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2 ** 20 if hasattr(os, "sysconf") else 0.0


def rss_mib() -> float:
    """This process's resident memory in MiB (Linux's /proc/self/statm, ~10 us; 0.0 where it cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_MIB
    except (OSError, ValueError, IndexError):
        return 0.0
