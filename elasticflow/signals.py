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
    """``requested`` turns True at the first SIGINT/SIGUSR1 while ``installed()`` is active."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        log.warning("%s: finishing the current step, then writing a checkpoint (Ctrl-C again to abort)", what)

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
