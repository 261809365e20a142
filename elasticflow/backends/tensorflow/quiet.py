"""Import TensorFlow without its start-up noise on the console.

TF 2.16+ logs through absl before absl is initialised, and those first lines ignore
``TF_CPP_MIN_LOG_LEVEL``: every worker printed "All log messages before absl::InitializeLog() ..." and
"oneDNN custom operations are on ..." twice (once per shared library). ``import_tensorflow`` catches
what the import writes to file descriptor 2 and writes back every line but those, so a real error
or warning of the import still reaches the console (after the import, not interleaved with it).
``TF_ENABLE_ONEDNN_OPTS`` is left alone: turning oneDNN off would silence the line by changing the
numbers. ``TF_CPP_MIN_LOG_LEVEL`` defaults to 1 (no INFO lines once absl is up); a user's own value
wins, and 0 shows everything, the start-up lines included.
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
from types import ModuleType

# Lines TF prints at every start that say nothing about this run.
NOISE = (b"All log messages before absl::InitializeLog() is called",
         b"oneDNN custom operations are on",
         b"This TensorFlow binary is optimized to use available CPU instructions",
         b"To enable the following instructions:")


def drop_noise(text: bytes) -> bytes:
    """``text`` without the lines that contain one of ``NOISE``."""
    return b"".join(line for line in text.splitlines(keepends=True) if not any(n in line for n in NOISE))


def import_tensorflow(name: str = "tensorflow") -> ModuleType:
    """``import tensorflow`` (or module ``name``) with the start-up lines of ``NOISE`` dropped from stderr.

    Raises what the import raises (ImportError for a missing package), after writing back what it printed.
    """
    if sys.modules.get(name) is not None:
        return sys.modules[name]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0":  # the user asked for every line
        return importlib.import_module(name)
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no file descriptor 2 (a closed or replaced stderr): nothing to filter
        return importlib.import_module(name)
    with tempfile.TemporaryFile() as caught:  # a file, not a pipe: a long import log cannot block it
        os.dup2(caught.fileno(), 2)
        try:
            return importlib.import_module(name)
        finally:
            try:
                sys.stderr.flush()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            caught.seek(0)
            kept = drop_noise(caught.read())
            while kept:
                kept = kept[os.write(2, kept):]
