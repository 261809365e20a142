"""Console logging that never holds up the process writing it.

A pipe whose reader stopped reading (a parent that collects the output only at the end, a pager), or a
terminal paused with Ctrl-S, blocks every write once its buffer is full (64 KiB for a pipe). The agent
would then stop watching the job -- a hung worker no longer cut out, a failed generation no longer
superseded -- and a worker would stop training. So the root logger's console handlers are fed from a
bounded queue by a thread of their own: a log call returns at once; what a full queue cannot take is
counted and announced once the console moves again. Log files are written as before.
"""
from __future__ import annotations

import logging
import logging.handlers
import queue
import threading
from typing import List, Optional

QUEUE_RECORDS = 10_000  # about 1-2 MB of pending lines; beyond it lines are dropped and counted


class _Enqueue(logging.handlers.QueueHandler):
    """Stands in for one console handler: applies its level and filters in the logging thread (a filter
    such as "rank 0 only" must see the state of the moment), then queues the formatted record."""

    def __init__(self, q: "queue.Queue", console: logging.Handler):
        super().__init__(q)
        self.setLevel(console.level)
        self.filters = list(console.filters)
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        """A record logged with ``extra={"console": False}`` is for the log files only (gloo's raw text, say)."""
        return getattr(record, "console", True) is not False and super().filter(record)

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            if self.dropped:
                note = logging.makeLogRecord({"msg": f"({self.dropped} log line(s) dropped: the console was not "
                                                     f"read; the log files have them)", "levelno": logging.WARNING,
                                              "levelname": "WARNING", "name": "elasticflow"})
                self.queue.put_nowait(note)
                self.dropped = 0
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class DetachedConsole:
    """Moves ``logger``'s console handlers (stream handlers that are not files) behind a queue and a thread.

    Example:
        >>> console = DetachedConsole()          # from here on, logging never blocks on the console
        >>> ...
        >>> console.close(timeout_s=5)           # drain (bounded), then the handlers write directly again
    """

    def __init__(self, logger: Optional[logging.Logger] = None, records: int = QUEUE_RECORDS):
        self.logger = logger or logging.getLogger()
        self.consoles: List[logging.Handler] = [
            h for h in self.logger.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
        self.queue: "queue.Queue" = queue.Queue(records)
        self.stand_ins = [_Enqueue(self.queue, h) for h in self.consoles]
        for console, stand_in in zip(self.consoles, self.stand_ins):
            self.logger.removeHandler(console)
            self.logger.addHandler(stand_in)
        self._filters = [list(h.filters) for h in self.consoles]
        for h in self.consoles:
            h.filters = []  # applied by the stand-in already
        self._thread = threading.Thread(target=self._pump, name="elasticflow-console", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            record = self.queue.get()
            if record is None:
                return
            for h in self.consoles:
                if record.levelno >= h.level:
                    h.handle(record)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Write what is queued (waiting at most ``timeout_s`` for a console that does not move), then give
        the console handlers back to the logger. Returns False if the queue could not be drained."""
        for stand_in in self.stand_ins:
            self.logger.removeHandler(stand_in)
        try:
            self.queue.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)
        except queue.Full:
            pass
        drained = not self._thread.is_alive()
        for console, filters in zip(self.consoles, self._filters):
            console.filters = filters
            self.logger.addHandler(console)
        dropped = sum(s.dropped for s in self.stand_ins)
        if drained and dropped:
            logging.getLogger("elasticflow").warning(
                "(%d log line(s) dropped: the console was not read; the log files have them)", dropped)
        return drained
