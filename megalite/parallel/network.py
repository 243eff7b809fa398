"""Which address a rank shows the other hosts, and the loopback trap.

Debian's and Ubuntu's default ``/etc/hosts`` maps the machine's own name to ``127.0.1.1``.
gloo (without ``GLOO_SOCKET_IFNAME``) and NCCL's bootstrap (without
``NCCL_SOCKET_IFNAME``) listen on the address the host name resolves to, and torchrun's
agent advertises its host name for the rendezvous (without ``--local-addr``). On such a
host a multi-node job advertises a loopback address: the other hosts connect to their own
loopback and wait for the whole timeout, then fail with errors that name neither cause.

:func:`loopback_problem` tells that case (this host's name resolves to loopback only, the
rendezvous endpoint does not) from a resolver's answers, before any process group exists;
:func:`route_to` and :func:`interface_of` find the address and interface that reach the
endpoint, which ``python -m megalite.launch`` then uses.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to (IPv4 first), or [] when it does not."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    found = [info[4][0] for info in infos]
    return sorted(dict.fromkeys(found), key=lambda a: ":" in a)


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return address == "localhost"


def route_to(host: str, port: int = 29500) -> str | None:
    """This machine's source address on the route to ``host`` (nothing is sent), or None."""
    for address in resolve(host) or [host]:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((address, port))
                return probe.getsockname()[0]
        except OSError:
            continue
    return None


def interface_of(address: str) -> str | None:
    """The name of the interface holding the IPv4 ``address``, or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def loopback_problem(endpoint_host: str, hostname: str | None = None,
                     resolver=resolve) -> str | None:
    """What goes wrong when this host's name resolves to loopback only while the
    rendezvous endpoint ``endpoint_host`` does not (a job across hosts would advertise
    a loopback address), in a sentence; None when that is not the case. ``resolver``:
    host name -> addresses."""
    hostname = hostname or socket.gethostname()
    endpoint = resolver(endpoint_host) or [endpoint_host]
    if any(is_loopback(a) for a in endpoint):
        return None
    own = resolver(hostname)
    if not own or not all(is_loopback(a) for a in own):
        return None
    return (f"this host's name {hostname!r} resolves to {', '.join(own)} (loopback) while "
            f"the rendezvous endpoint {endpoint_host} is at {endpoint[0]}: the ranks here "
            "would advertise a loopback address that the other hosts cannot reach, and "
            "the job would hang for the whole timeout")


def fix_hint(endpoint_host: str) -> str:
    """The two settings that fix :func:`loopback_problem`, with this host's values."""
    address = route_to(endpoint_host)
    name = interface_of(address) if address else None
    iface = name or "<the interface that reaches it>"
    return (f"set GLOO_SOCKET_IFNAME={iface} (NCCL_SOCKET_IFNAME={iface} on GPUs) and "
            f"PET_LOCAL_ADDR={address or '<this host address>'} (torchrun's --local-addr), "
            "or map this host's name to its real address in /etc/hosts")


def worker_check(hostname: str | None = None, resolver=resolve) -> str | None:
    """In a worker of a job across hosts (``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``) that
    would advertise a loopback address: the error sentence, fixes included; else None."""
    env = os.environ
    if env.get("GLOO_SOCKET_IFNAME") or "MASTER_ADDR" not in env:
        return None
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", "0"))
    if not local or world <= local:
        return None
    problem = loopback_problem(env["MASTER_ADDR"], hostname, resolver)
    return None if problem is None else f"{problem}; {fix_hint(env['MASTER_ADDR'])}"
