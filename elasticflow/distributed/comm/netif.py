"""Which address a process listens on and tells its peers: ``launcher.interface`` (an interface name or an
address), else one that other hosts can reach, never a loopback one in a multi-host job.

Used by the agent's host (launchers/slurm.py, launchers/nodes.py) and by each worker for gloo's address
(launchers/worker.py): where a process listens is the distributed layer's, whichever launcher started it.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Dict, Optional

from ...errors import ElasticFlowError

_SIOCGIFADDR = 0x8915


def interfaces() -> Dict[str, str]:
    """{interface name: its IPv4 address} for every interface that has one (lo included)."""
    found = {}
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address is not None:
            found[name] = address
    return found


def _ipv4_of(name: str) -> Optional[str]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def address_of(interface: Optional[str]) -> str:
    """This host's address for peers on other hosts.

    ``interface`` (``launcher.interface``) wins: an address is used as given, a name is looked up. Without
    it: the address this host's name resolves to, if it is a non-loopback address of this host; else the
    address of the interface the default route leaves by (the kernel's own choice for traffic off the
    host); else the only non-loopback one. Debian maps the host name to 127.0.1.1, which no peer can reach.
    """
    if interface:
        try:
            ipaddress.ip_address(interface)
            return interface
        except ValueError:
            pass
        address = _ipv4_of(interface)
        if address is None:
            raise ElasticFlowError(f"launcher.interface={interface!r} has no IPv4 address on {socket.gethostname()}",
                                   f"pick one of {sorted(interfaces())} (`ip -4 addr`), or pass an address")
        return address
    own = {a for a in interfaces().values() if not _loopback(a)}
    try:
        named = socket.gethostbyname(socket.gethostname())
        if named in own:
            return named
    except OSError:
        pass
    routed = _default_route_address()
    if routed is not None:
        return routed
    if len(own) == 1:
        return own.pop()
    if not own:
        raise ElasticFlowError(f"{socket.gethostname()} has no network address but loopback, so no other host can "
                               "reach it", "connect it to the other hosts' network, or run on one host (launcher=local)")
    raise ElasticFlowError(f"{socket.gethostname()} has several addresses ({', '.join(sorted(own))}) and no default "
                           "route to choose by", "name the one the other hosts reach: launcher.interface=eth1")


def address_toward(host: str, interface: Optional[str] = None) -> str:
    """The address of this host on the route to ``host`` (the job's endpoint): the one that host's peers can
    reach back, on a multi-homed host too. ``interface`` wins, as in :func:`address_of`."""
    if interface:
        return address_of(interface)
    try:
        target = socket.gethostbyname(host)
    except OSError as exc:
        raise ElasticFlowError(f"cannot resolve the job's endpoint host {host!r} ({exc})",
                               "pass its address: launcher.endpoint=10.0.0.1:29400") from exc
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((target, 9))  # UDP: no packet is sent; the kernel picks the route and its source address
        address = s.getsockname()[0]
    except OSError as exc:
        raise ElasticFlowError(f"no route from {socket.gethostname()} to the endpoint {host} ({exc.strerror})",
                               "check the network, or name the interface: launcher.interface=eth1") from exc
    finally:
        s.close()
    if _loopback(address) and not _loopback(target):
        return address_of(None)
    return address


def _default_route_address() -> Optional[str]:
    try:
        with open("/proc/net/route") as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return None
    for row in rows:
        if len(row) > 2 and row[1] == "00000000":  # destination 0.0.0.0: the default route
            return _ipv4_of(row[0])
    return None
