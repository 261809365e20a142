"""How a process entry point ends: one error line and a hint, or one ``done:`` summary line.

Shared by the CLI and the SLURM batch entry (``python -m elasticflow.launchers.slurm``). It lives
apart from cli.py so that a launcher can end its process the same way without importing the CLI
(which imports the launchers): it depends on errors.py, protocol.py and goodput.py only.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, NoReturn, Optional

from .distributed.protocol import ENV_DEBUG
from .errors import ElasticFlowError, TrainingInterrupted


def debug_requested() -> bool:
    """True under ``--debug``: the CLI sets $ELASTICFLOW_DEBUG, so processes it starts inherit it."""
    return os.environ.get(ENV_DEBUG) == "1"


def fail(message: str, hint: str = "", code: int = 2) -> NoReturn:
    """Print ``error: message`` and ``hint: hint`` to stderr and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    raise SystemExit(code)


def report(exc: BaseException, debug: bool) -> NoReturn:
    """Exit on ``exc`` with one line for the user (plus a hint); the traceback only with --debug."""
    if debug:
        traceback.print_exc()
    if isinstance(exc, TrainingInterrupted):
        print("interrupted: checkpoint written; resume with the same command (resume=auto)", file=sys.stderr)
        raise SystemExit(130)
    if isinstance(exc, KeyboardInterrupt):
        print("aborted by a second Ctrl-C: no checkpoint written for this step", file=sys.stderr)
        raise SystemExit(130)
    if isinstance(exc, ElasticFlowError):
        fail(exc.message, exc.hint, exc.exit_code)
    # Not ours: name the innermost frame in the user's code (or a model file), where the fix usually is.
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "elasticflow/" not in frame.filename.replace(os.sep, "/") or "/models/" in frame.filename:
            where = f" at {frame.filename}:{frame.lineno}"
            break
    fail(f"{type(exc).__name__}: {exc}{where}",
         "the full traceback is above" if debug else "run with --debug for the full traceback", 1)


def print_done(summary: Dict[str, Any], run_dir: Optional[Path] = None) -> None:
    """The last line of a finished run on stdout: ``done: k=v ...``, floats to 4 significant digits.

    With ``run_dir``: the goodput ledger the job wrote (RUN_DIR/goodput.json) comes first, as a block.
    """
    ledger = Path(run_dir) / "goodput.json" if run_dir is not None else None
    if ledger is not None and ledger.is_file():
        from .goodput import render

        try:
            print(render(json.loads(ledger.read_text())))
        except (ValueError, KeyError, TypeError):
            pass  # a report, not the result: the done line still comes
    shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items())
    print(f"done: {shown}", flush=True)
