"""Turn ``launcher.interface`` (an interface name, an address, or nothing) into an address to listen on.

Used by the agent's host (launchers/slurm.py) and by each worker for gloo's address (launchers/worker.py):
where a process listens is the distributed layer's, whichever launcher started it.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Optional

from ..errors import ElasticFlowError

_SIOCGIFADDR = 0x8915


def address_of(interface: Optional[str]) -> str:
    if not interface:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError as exc:
            raise ElasticFlowError(f"cannot resolve this host's name {socket.gethostname()!r} ({exc})",
                                   "name the network interface: launcher.interface=eth0") from exc
    try:
        ipaddress.ip_address(interface)
        return interface
    except ValueError:
        pass
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError as exc:
        raise ElasticFlowError(f"launcher.interface={interface!r} has no IPv4 address here ({exc.strerror})",
                               "pick an interface from `ip -4 addr`, or pass an address") from exc
    finally:
        s.close()
