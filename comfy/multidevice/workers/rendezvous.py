"""Where a worker pool's ranks meet: one door on rank 0 for the process's life, one
generation per pool, and the network interfaces the pool's traffic may use.

Rank 0 serves its door (workers/door.py) at one address and port for as long as its process
lives, so the join commands of other servers find every later pool at the same place. Each
pool is a generation with its own key; its ranks meet in torch.distributed's store, which
listens on loopback only, under a prefix derived from that key.

Interfaces. Without ranks on other servers nothing of a pool needs to be reachable from
another machine: the door is on the loopback address the pool was given and gloo binds to the
loopback interface, whatever the host name resolves to (Docker's /etc/hosts maps it to the
LAN address). With remote ranks, gloo binds to the interface that holds the rendezvous
address the user named, unless GLOO_SOCKET_IFNAME says otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
import threading

from comfy.multidevice.workers import admission
from comfy.multidevice.workers.door import Door

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"

_served: dict[tuple[str, int], Door] = {}
_served_lock = threading.Lock()
_env_lock = threading.Lock()


def rendezvous_at(host: str, port: int, timeout_s: float, remote: int = 0) -> Door:
    """This process's door on `host`:`port`, served from its first call on (port 0: the port
    the system picked then). Pools with `remote` ranks need the cluster secret (SecretError,
    before anything listens, when it is not set)."""
    with _served_lock:
        for (served_host, served_port), door in _served.items():
            if served_host == host and port in (0, served_port):
                if remote and not door.cluster:
                    admission.cluster_secret(required=True)  # says how to set it
                    raise admission.SecretError(
                        f"the door at {door.address} started without a cluster secret; restart ComfyUI with "
                        f"{admission.SECRET_FILE_ENV} set to serve ranks of other servers")
                return door
        cluster = admission.cluster_secret(required=remote > 0)
        door = Door(host, port, timeout_s, cluster or admission.random_base())
        door.cluster = cluster is not None
        _served[(host, door.port)] = door
        return door


def interface_of(address: str) -> str | None:
    """The name of this server's interface that holds IPv4 `address` (None: none does, or
    `address` is not IPv4 / not resolvable)."""
    try:
        wanted = socket.gethostbyname(address)
    except OSError:
        return None
    if ipaddress.ip_address(wanted).is_loopback:
        wanted = "127.0.0.1"
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == wanted:
            return name
    return None


def interface_towards(host: str, port: int) -> str | None:
    """The interface this server reaches `host` through (a join command's ranks bind there)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP: no packet is sent, the route is chosen
            return interface_of(probe.getsockname()[0])
    except OSError:
        return None


def _ipv4_of(name: str) -> str | None:
    siocgifaddr = 0x8915  # Linux's ioctl for an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def gloo_interface_for(host: str) -> str | None:
    """GLOO_SOCKET_IFNAME for a pool meeting at `host`: the user's, else the interface holding it."""
    return os.environ.get(GLOO_IFNAME_ENV) or interface_of(host)


@contextlib.contextmanager
def gloo_interface(name: str | None):
    """Gloo groups made inside bind to interface `name` (it reads the variable as each group is made)."""
    if not name:
        yield
        return
    with _env_lock:
        before = os.environ.get(GLOO_IFNAME_ENV)
        os.environ[GLOO_IFNAME_ENV] = name
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(GLOO_IFNAME_ENV, None)
            else:
                os.environ[GLOO_IFNAME_ENV] = before
