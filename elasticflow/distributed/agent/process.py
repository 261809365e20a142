"""The agent's handle on one worker process.

How a worker process starts is the launcher's (``Agent(launch=...)``: launchers/local.py, slurm.py); where the
agent's store listens is the store room's (store/listen.py).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

HOSTNAME = socket.gethostname()


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
