"""The agent's handle on one worker process, and how the agent starts its store.

How a worker process starts is the launcher's (``Agent(launch=...)``: launchers/local.py, slurm.py).
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

from torch.distributed import TCPStore

HOSTNAME = socket.gethostname()


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (0: any free port), for a store's server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def listening_store(host: str, timeout_s: float, port: int = 0) -> "tuple[TCPStore, socket.socket]":
    """A TCPStore listening on ``host`` only (TCPStore alone would listen on every interface)."""
    sock = listening_socket(host, port)
    store = TCPStore(host, sock.getsockname()[1], None, True, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False, master_listen_fd=sock.fileno())
    return store, sock


@dataclass
class Worker:
    id: int
    pid: int                                  # the worker process (behind srun: learned from its join request)
    proc: Optional[subprocess.Popen] = None   # what we started (the worker, or its srun); None if started elsewhere
    host: str = HOSTNAME
    state: str = "joining"
    spawned_at: float = field(default_factory=time.time)
    hb_value: int = -1
    hb_seen: float = field(default_factory=time.monotonic)
    has_state: bool = False                   # was a member of a generation that formed (holds the training state)
    slot: int = 0                             # its slot on the host: which GPU it binds (devices.local_slot)
    node: Optional[str] = None                # started by the node agent of this host (launcher=nodes) ...
    outbox: Optional[list] = None             # ... to which signals go, through the agent's store (hosts.py)
    exit_code: Optional[int] = None           # ... which reported its exit code

    def poll(self) -> Optional[int]:
        return self.proc.poll() if self.proc is not None else self.exit_code

    def signal(self, sig: int) -> None:
        """Signal the worker itself; on another node, through its srun (which forwards USR1, and
        cancels the step on TERM), or its node agent."""
        if self.node is not None:
            self.outbox.append((self.node, self.id, int(sig)))  # sent from the agent's loop: not from a handler
            return
        try:
            if self.proc is None and self.host != HOSTNAME:
                return  # started by hand on another host: its pid means nothing here (the cut record tells it)
            if self.host == HOSTNAME or self.proc is None:
                os.kill(self.pid, sig)
            elif sig in (signal.SIGINT, signal.SIGUSR1):
                self.proc.send_signal(signal.SIGUSR1)
            else:
                self.proc.terminate()
        except ProcessLookupError:
            pass

    def describe(self, rank: Optional[int] = None) -> dict:
        out = {"worker_id": self.id, "pid": self.pid, "host": self.host, "state": self.state}
        return {"rank": rank, **out} if rank is not None else out
