"""A console nobody reads must not stop the job (console.py).

The chaos soak once read the job's output only at the end: the 64 KiB pipe filled, the agent blocked in a
log call on its way to cutting out a stopped worker, and a generation waited 481 s. These tests fill a
small pipe and leave it unread.
"""
import fcntl
import logging
import os
import signal
import struct
import termios
import threading
import time
from pathlib import Path

from harness import events, logged_step, members, reap, start, wait_for

from elasticflow._util.console import DetachedConsole

F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Python 3.10+ on Linux); spelled out for older fcntl modules


def small_pipe():
    """(read fd, write fd) of a pipe that holds one page: it is full after a few lines."""
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    return r, w


def drain(fd: int, into: bytearray) -> threading.Thread:
    def run():
        while chunk := os.read(fd, 65536):
            into.extend(chunk)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


class UnreadConsole:
    """A logger of its own whose one console handler writes to a one-page pipe nobody reads (yet)."""

    def __init__(self, name: str):
        self.r, w = small_pipe()
        self.stream = os.fdopen(w, "w", buffering=1)
        self.logger = logging.getLogger(name)
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        self.handler = logging.StreamHandler(self.stream)
        self.logger.addHandler(self.handler)
        self.got = bytearray()
        self.reader = None

    def start_reading(self) -> None:
        self.reader = drain(self.r, self.got)

    def close(self, console: DetachedConsole) -> list:
        """Read the pipe, close the detached console (asserting it drained); the lines the console got."""
        if self.reader is None:
            self.start_reading()
        assert console.close(timeout_s=30)
        self.stream.close()
        self.reader.join(10)
        return self.got.decode().splitlines()


def test_logging_returns_while_the_console_is_not_read_and_nothing_is_lost_below_the_bound():
    pipe = UnreadConsole("test-console-bounded")
    console = DetachedConsole(pipe.logger, records=5000)
    lines = [f"line {i:05d} " + "x" * 80 for i in range(3000)]  # ~270 KB: 66 times the pipe
    writer = threading.Thread(target=lambda: [pipe.logger.info(s) for s in lines], daemon=True)
    writer.start()
    writer.join(30)
    assert not writer.is_alive(), "logging blocked on a console nobody reads"
    assert pipe.close(console) == lines  # all of them, in order


def test_a_full_queue_drops_lines_and_says_how_many():
    pipe = UnreadConsole("test-console-drops")
    console = DetachedConsole(pipe.logger, records=20)
    # Lines until the console thread is blocked on the full one-page pipe and its queue is full (a pause after each
    # lets the thread run: logged all at once, a thread first scheduled late drains the queue into the pipe's room
    # and lets the last lines in); from then on every line is dropped
    i = 0
    while not (console.queue.full() and queued_bytes(pipe.r) >= 4096 - 100):
        assert i < 500, "the console never blocked on a one-page pipe"
        pipe.logger.info("line %d %s", i, "y" * 80)
        i += 1
        time.sleep(0.001)
    first_dropped = i
    for i in range(first_dropped, 2000):
        pipe.logger.info("line %d %s", i, "y" * 80)
    pipe.start_reading()
    wait_for(console.queue.empty, 30, "the console to move again: its queue empties", every=0.01)
    pipe.logger.info("after the console moved again")
    lines = pipe.close(console)
    text = "\n".join(lines)
    assert "line 0 " in text and "line 1999 " not in text
    assert "log line(s) dropped: the console was not read" in text
    assert lines[-1] == "after the console moved again"


def test_filters_run_when_the_line_is_logged():
    pipe = UnreadConsole("test-console-filters")
    rank = {"now": 1}
    pipe.handler.addFilter(lambda record: rank["now"] == 0)  # like the workers' "rank 0 only"
    console = DetachedConsole(pipe.logger)
    pipe.logger.info("as rank 1")
    rank["now"] = 0
    pipe.logger.info("as rank 0")
    rank["now"] = 1  # before the console thread writes: the verdict was taken when the line was logged
    assert pipe.close(console) == ["as rank 0"]
    assert pipe.handler in pipe.logger.handlers and pipe.handler.filters  # given back as it was


def queued_bytes(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_stopped_worker_is_cut_out_while_nobody_reads_the_jobs_output(tmp_path: Path):
    """The job's stdout and stderr are a one-page pipe, unread until the end. Once rank 0's step lines have
    filled it, a member is SIGSTOPped: the agent must still cut it out (it logs a warning on the way), and
    the job must finish."""
    run, steps, pace = tmp_path / "run", 150, tmp_path / "pace"
    pace.touch()  # steps take EF_PROBE_SLEEP until the stopped worker is cut out; then the job ends at full speed
    r, w = small_pipe()
    proc = start(run, f"trainer.max_steps={steps}", "launcher.workers=3", "launcher.min_workers=2",
                 env={"EF_PROBE_SLEEP": "0.05", "EF_PROBE_PACE": str(pace)}, stdout=w)
    os.close(w)
    got, victim = bytearray(), None
    try:
        # Full: a writer blocks once the room left is shorter than its next line, and a step line (with its ETA,
        # ms/step, samples/s and metrics) runs to ~150 bytes: with 100 bytes' slack the test waited for a pipe
        # that had already stopped filling, 1 run in 3
        wait_for(lambda: queued_bytes(r) >= 4096 - 400, 120, "the pipe to fill", proc=proc)  # fails at once if it exits
        assert logged_step(run) < steps
        victim = members(run)[1]
        os.kill(victim["pid"], signal.SIGSTOP)
        hung = wait_for(lambda: [e for e in events(run) if e["event"] == "hung"], 30, "the stopped worker cut out")
        assert hung[0]["worker"] == victim["worker_id"]
        pace.unlink()
        reader = drain(r, got)
        proc.wait(240)
        reader.join(10)
    finally:
        if proc.poll() is None:
            reap(proc)
        if victim is not None:
            try:
                os.kill(victim["pid"], signal.SIGKILL)  # a failed run must not leave it stopped forever
            except ProcessLookupError:
                pass
        os.close(r)
    assert proc.returncode == 0, got.decode()[-3000:]
    assert logged_step(run) == steps
