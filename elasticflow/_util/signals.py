"""The orderly stop: the first Ctrl-C (or SIGUSR1, SLURM's warning before preemption or the time limit)
asks the trainer to finish the step, write a checkpoint and exit 130; a second Ctrl-C stops at once."""
from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger("elasticflow")


class StopSignal:
    """``requested`` turns True at the first SIGINT/SIGUSR1 while ``installed()`` is active.

    Note: the handler only records the request; :meth:`announce` logs it, from the loop. A handler runs
    in the main thread between two bytecodes, possibly inside a logging call that holds the console
    queue's lock: logging from it there waited for that lock forever (a worker hung at Ctrl-C while
    writing a step's record).
    """

    def __init__(self, console: bool = True) -> None:
        self.requested = False
        self._what: str = ""        # the signal, once requested and not yet announced
        # False in a worker run by an agent: the agent tells the console once for the job (it forwards the
        # signal to every worker); a worker's own line goes to its log file only (worker.py's console filter).
        self.console = console

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name

    def announce(self) -> None:
        """Log a stop request once (call it outside the handler: from the loop)."""
        if self._what:
            what, self._what = self._what, ""
            log.warning("%s: finishing the current step, then writing a checkpoint (Ctrl-C again to abort)", what,
                        extra=None if self.console else {"console": False})

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Handle SIGINT and SIGUSR1 inside the block (only the main thread can), then restore."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGUSR1)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
