"""Local workers forked from one warm process, instead of each starting a fresh interpreter.

Most of a worker's start is imports: torch, Hydra and the trainer take ~2 s of CPU before the first line of
its own work, and on a 2-core machine a 3-worker job, or a replacement for a killed worker, waits for them.
The zygote (``python -m elasticflow.launchers.zygote``) imports them once; each worker after that is an
``os.fork()`` of it, which starts from the imported modules in milliseconds. torch's DataLoader forks its
workers from such a process the same way.

    server = ForkServer()           # started by the first launch of an agent (or node agent) process
    proc = server.launch(env)       # a worker with that environment: what the agent uses of a Popen

A fork copies only the forking thread, so the zygote forks while it has no other Python thread, never
imports TensorFlow (whose import starts threads) and never touches CUDA. It runs nothing parallel itself
(the OpenMP and BLAS pools come up in the worker). It is the workers' parent: it reaps them and reports
each exit code to the agent, which sees a ``Forked`` handle with a Popen's ``pid``, ``poll``, ``wait`` and
signals. Where it cannot serve (it failed to start or died), ``launch`` starts the worker as a fresh
interpreter, as before (``launcher.fork_workers=false`` always does).

Protocol, one line each way: the agent writes ``{"env": {...}}`` and reads ``pid N``; the zygote writes
``exit N CODE`` when a worker ends (CODE as Popen's returncode: negative for a signal).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Optional

log = logging.getLogger("elasticflow")

START_TIMEOUT_S = 120.0  # the zygote's imports (~2 s idle; minutes on a machine that is thrashing)


class Forked:
    """A worker the zygote forked: the part of ``subprocess.Popen`` the agent uses."""

    def __init__(self, pid: int, server: "ForkServer"):
        self.pid, self.server = pid, server
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The agent's side: starts the zygote, asks it for workers, collects their exit codes."""

    def __init__(self):
        self._pids: "queue.Queue[int]" = queue.Queue()
        self._exits: Dict[int, int] = {}
        self._lock = threading.Lock()  # one request in flight: each waits for its pid
        self._alive = True
        request_r, self._request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        # Its own session: a Ctrl-C on the terminal reaches the agent, which forwards it to the workers.
        self.proc = subprocess.Popen([sys.executable, "-m", "elasticflow.launchers.zygote", str(request_r),
                                      str(reply_w)], pass_fds=(request_r, reply_w), stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        os.close(request_r)
        os.close(reply_w)
        self._replies = os.fdopen(reply_r, "r")
        threading.Thread(target=self._read, name="zygote-replies", daemon=True).start()

    def _read(self) -> None:
        for line in self._replies:
            kind, *values = line.split()
            if kind == "pid":
                self._pids.put(int(values[0]))
            elif kind == "exit":
                self._exits[int(values[0])] = int(values[1])
        self._alive = False
        self._pids.put(-1)  # wakes a launch waiting for a pid that will not come

    def launch(self, env: Dict[str, str]) -> Optional[Forked]:
        """A worker forked with ``env`` as its environment; None when the zygote cannot serve."""
        with self._lock:
            if not self._alive:
                return None
            try:
                os.write(self._request_w, (json.dumps({"env": env}) + "\n").encode())
                pid = self._pids.get(timeout=START_TIMEOUT_S)
            except (OSError, queue.Empty):
                pid = -1
            if pid < 0:
                self._alive = False
                return None
            self._exits.pop(pid, None)  # a reused pid: the exit code of the earlier worker is not this one's
            return Forked(pid, self)

    def exit_code(self, pid: int) -> Optional[int]:
        if pid in self._exits:
            return self._exits[pid]
        if not self._alive and not _exists(pid):
            # The zygote died before it reported this worker (killed with its host): the code is lost.
            return -int(signal.SIGKILL)
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        """No more workers: the zygote exits once those it forked have. Waits that long for it (the agent
        closes after its workers ended, so it is at once), then leaves it: it ends with its last worker."""
        with self._lock:
            self._alive = False
            try:
                os.close(self._request_w)
            except OSError:
                return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ---------------------------------------------------------------- the zygote process
def _warm() -> None:
    """What every torch worker imports before its own work (~2 s of CPU once, instead of once a worker)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from .. import trainer  # noqa: F401 - and through it the training layers
    from ..backends import torch as _torch_backend  # noqa: F401
    from ..distributed.membership import membership  # noqa: F401
    from . import worker  # noqa: F401


def _child(env: Dict[str, str], close: tuple) -> None:
    """In the forked worker: its own session and environment, then the worker's main (which ends the process)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        os.setsid()
        os.environ.clear()
        os.environ.update(env)
        from . import worker

        sys.argv = [worker.__file__]
        worker.main()  # ends with os._exit
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the inherited stderr, as a fresh interpreter would
        import traceback

        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def serve(request_fd: int, reply_fd: int) -> None:
    _warm()
    if threading.active_count() > 1 or "tensorflow" in sys.modules:
        return  # a fork would lose a thread's work (or TF's runtime): the agent starts fresh interpreters
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() at once: exit codes reach the agent fast
    signal.set_wakeup_fd(wake_w)
    requests = os.fdopen(request_fd, "r")
    replies = os.fdopen(reply_fd, "w", buffering=1)
    children, open_ = set(), True
    while open_ or children:
        try:
            ready, _, _ = select.select([requests, wake_r] if open_ else [wake_r], [], [], 1.0)
        except InterruptedError:
            ready = []
        if wake_r in ready:
            os.read(wake_r, 512)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            replies.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
        if open_ and requests in ready:
            line = requests.readline()
            if not line:  # the agent closed it, or died: serve no more, reap what is left
                open_ = False
                continue
            env = json.loads(line)["env"]
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(env, (requests.fileno(), replies.fileno(), wake_r, wake_w))
            children.add(pid)
            replies.write(f"pid {pid}\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
    # Every worker is reaped and reported: leave without the interpreter's teardown of torch and the trainer
    # (~0.5 s, which the agent waited out in ForkServer.close at the end of every job). Nothing else to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
