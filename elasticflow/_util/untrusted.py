"""Reading what anyone may have written: a store key a stranger can set or delete, a file in a run directory.

Two rules, each learnt from a crash: parse JSON only through :func:`loads` (bounded in size and depth, and
failing only with ValueError), and read a store key only through :func:`read` (one round trip that never
waits, and no ``check`` before it to race with a delete).
"""
import json
import math
import re
import secrets
from typing import Any, Optional

MAX_RECORD = 64 * 1024  # bytes: the largest request or record is a few hundred
MAX_DEPTH = 16  # our records nest 3 deep; 100,000 ``[`` made json.loads raise RecursionError
_MARKS = re.compile(r'[\\"\[\]{}]')  # what decides nesting: brackets, and the quotes and escapes of strings


def loads(raw: Any, max_bytes: int = MAX_RECORD, max_depth: int = MAX_DEPTH) -> Any:
    """A JSON value from the store, or from a file anyone may have written: the one reader of untrusted JSON.

    ValueError (and only ValueError) when ``raw`` is larger than ``max_bytes``, nested deeper than ``max_depth``,
    not UTF-8 or not JSON, so a stranger's value costs a refusal and never the reader (json.loads itself raises
    RecursionError on deep nesting, which the agent's readers did not catch).
    """
    if len(raw) > max_bytes:
        raise ValueError(f"{len(raw)} bytes, more than the {max_bytes} a record may hold")
    text = bytes(raw).decode() if isinstance(raw, (bytes, bytearray, memoryview)) else str(raw)
    _check_depth(text, max_depth)
    return json.loads(text)


def _check_depth(text: str, max_depth: int) -> None:
    """ValueError if ``text``'s brackets outside strings nest deeper than ``max_depth``: one linear pass (a
    regular expression for JSON strings backtracked for 30 s over 60 KiB of quotes and backslashes)."""
    depth, in_string, escaped_at = 0, False, -1
    for mark in _MARKS.finditer(text):
        at, c = mark.start(), mark.group()
        if at == escaped_at:
            continue
        if in_string:
            if c == "\\":
                escaped_at = at + 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > max_depth:
                raise ValueError(f"nested deeper than {max_depth}")
        elif c in "]}":
            depth -= 1


_ABSENT = secrets.token_hex(16)  # compare_set's answer when the key is missing (no stored value equals it)


def read(store, key: str) -> Optional[bytes]:
    """The value at ``key``, or None when there is none, in one round trip that never waits.

    ``get`` on a missing key waits for the store's whole timeout, and ``check`` then ``get`` races with a
    stranger who deletes the key in between (the agent then blocked 30 s and died of the timeout). ``compare_set``
    with an expected value nobody stored answers the current value, or, for a missing key, the expected one,
    and changes nothing.
    """
    raw = store.compare_set(key, _ABSENT, _ABSENT)
    return None if raw == _ABSENT.encode() else raw


def printable(value: Any, limit: int = 200) -> str:
    """``value`` as text safe for a terminal: at most ``limit`` characters, control characters and escapes
    shown as ``\\xNN`` (a stranger's "host" once cleared the agent's console and printed a fake last line)."""
    text = str(value)[:limit]
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def number(value: Any, bound: float = math.inf) -> bool:
    """Whether ``value`` is a real number (not a bool, not text) smaller than ``bound`` in size, so finite: where
    a record holds a figure, a crafted line may hold text, a list or 1e999."""
    return type(value) in (int, float) and abs(value) < bound  # abs(nan) < anything is False


def unix_time(value: Any) -> bool:
    """Whether ``value`` is a plausible Unix time (a positive number below 1e11: datetime overflows past it)."""
    return number(value, 1e11) and value > 0
