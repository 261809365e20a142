"""How a process entry point ends: one error line and a hint, or one ``done:`` summary line.

Shared by the CLI and the SLURM batch entry (``python -m elasticflow.launchers.slurm``). It lives
apart from cli.py so that a launcher can end its process the same way without importing the CLI
(which imports the launchers): it depends on errors.py, envnames.py, fileio.py and goodput.py only.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, NoReturn, Optional

from .._util.envnames import ENV_DEBUG
from .._util.fileio import write_atomic
from ..errors import ElasticFlowError, TrainingInterrupted

log = logging.getLogger("elasticflow")


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


def _stdout_gone() -> bool:
    """True when nobody reads our stdout any more (a pipe whose reader exited: Linux polls it as an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is not a file
        return False


def quiet_exit_on_broken_pipe() -> NoReturn:
    """The reader of our stdout went away (``elasticflow inspect DIR | head``): exit quietly with the status
    of a process killed by SIGPIPE, as cat or ls do. Python flushes stdout once more at exit; pointed at
    /dev/null, that flush cannot fail again and print its own complaint."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass
    raise SystemExit(128 + signal.SIGPIPE)


def report(exc: BaseException, debug: bool) -> NoReturn:
    """Exit on ``exc`` with one line for the user (plus a hint); the traceback only with --debug."""
    if isinstance(exc, BrokenPipeError) and _stdout_gone():  # another pipe's (a socket's) is a real error
        quiet_exit_on_broken_pipe()
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
    fail(f"{type(exc).__name__}: {exc}{user_frame(exc)}",
         "the full traceback is above" if debug else "run with --debug for the full traceback", 1)


def _library(filename: str) -> bool:
    """A file of an installed library or the standard library (torch, transformers, numpy, functools)."""
    path = filename.replace(os.sep, "/")
    return ("/site-packages/" in path or "/dist-packages/" in path or path.startswith("<")
            or path.startswith(_STDLIB))


_STDLIB = os.path.dirname(os.__file__).replace(os.sep, "/") + "/"


def user_frame(exc: BaseException) -> str:
    """`` at FILE:LINE`` of the innermost frame in the user's own code (a model file, their package), where
    the fix usually is: not ElasticFlow's, not a library's (an error raised inside torch.nn.Linear is located
    at the line of forward() that called it). Else the innermost frame outside ElasticFlow; else ""."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "elasticflow/" not in f.filename.replace(os.sep, "/") or "/models/" in f.filename]
    own = [f for f in frames if not _library(f.filename)]
    frame = (own or frames or [None])[-1]
    return f" at {frame.filename}:{frame.lineno}" if frame is not None else ""


def print_done(summary: Dict[str, Any], run_dir: Optional[Path] = None) -> None:
    """The last line of a finished run on stdout: ``done: k=v ...``, floats to 4 significant digits; the same
    fields go to RUN_DIR/result.json.

    With ``run_dir``: the goodput ledger the job wrote (RUN_DIR/goodput.json) comes first, as a block.
    """
    if run_dir is not None:  # for scripts and elasticflow.fit(): the same fields, as JSON (Hugging Face's all_results.json)
        try:
            write_atomic(Path(run_dir) / "result.json", json.dumps(summary, default=str, indent=1) + "\n")
        except OSError as exc:
            log.warning("could not write %s: %s", Path(run_dir) / "result.json", exc)
    ledger = Path(run_dir) / "goodput.json" if run_dir is not None else None
    lines = []
    if ledger is not None and ledger.is_file():
        from ..observability.goodput import render

        try:
            lines.append(render(json.loads(ledger.read_text())))
        except (ValueError, KeyError, TypeError):
            pass  # a report, not the result: the done line still comes
    shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items())
    lines.append(f"done: {shown}")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `elasticflow train ... | head`: the run is done, its reader is not
        quiet_exit_on_broken_pipe()
