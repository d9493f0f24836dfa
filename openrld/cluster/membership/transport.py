"""How members reach each other: the datagram transport and the push-pull client, as interfaces.

`Transport` carries sealed datagrams between gossip addresses ("host:port");
`UdpTransport` is the production one, on a trio UDP socket. `PushPullClient`
exchanges full state with a peer's HTTP API (`HttpPushPull`, in
`peer_client.py`). The in-memory network in `fake_network.py` implements both
for simulations under trio's fake clock. Nothing here decodes or judges a
packet: that is the codec's and the node's job. A datagram that cannot be sent
(no route, a refused port) is dropped like a lost one, because UDP promises
nothing more and the protocol already copes with loss.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Protocol

import msgspec
import trio

from openrld.cluster.membership.codec import MAX_DATAGRAM_BYTES

logger = logging.getLogger(__name__)


class Packet(msgspec.Struct, frozen=True):
    frame: bytes
    source: str  # the sender's address, "host:port" (a name on the fake network)


class PeerUnreachable(Exception):
    """A push-pull got no valid answer (refused, timed out, a non-200 status)."""


class Transport(Protocol):
    @property
    def local_addr(self) -> str: ...

    async def send(self, addr: str, frame: bytes) -> None:
        """Send one datagram; a failure is a silent loss."""
        ...

    async def receive(self) -> Packet: ...

    async def aclose(self) -> None: ...


class PushPullClient(Protocol):
    async def exchange(self, peer_url: str, body: bytes, tag_hex: str) -> tuple[bytes, str]:
        """Send our state to the peer; its (body, tag) in answer.

        Raises:
            PeerUnreachable: no answer, or not a 200 one.
        """
        ...


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_addr(addr: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port".

    Raises:
        ValueError: no port, or a port outside 1-65535, naming the address.
    """
    host, sep, port_text = addr.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1-65535, got {addr!r}")
    return host.removeprefix("[").removesuffix("]"), int(port_text)


# Errors a send may meet that mean only "this datagram is lost". Routes and
# firewalls answer with more than unreachable: a blackhole route gives EINVAL,
# a prohibit route EACCES, a local firewall EPERM; none of them is this
# node's fault, and a daemon must not stop over one.
_LOSS_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN, errno.EMSGSIZE,
        errno.EINVAL, errno.EACCES, errno.EPERM,
    }
)


class UdpTransport:
    """One UDP socket, bound before `open` returns."""

    def __init__(self, sock: trio.socket.SocketType, advertise_host: str) -> None:
        self._sock = sock
        self._local_addr = format_addr(advertise_host, sock.getsockname()[1])

    @classmethod
    async def open(cls, bind_host: str, port: int, advertise_host: str) -> UdpTransport:
        """Bind `bind_host:port` (0 picks a free port) and advertise `advertise_host` with it.

        Raises:
            OSError: the address cannot be bound.
        """
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        sock = trio.socket.socket(family, socket.SOCK_DGRAM)
        try:
            await sock.bind((bind_host, port))
        except BaseException:
            sock.close()
            raise
        return cls(sock, advertise_host)

    @property
    def local_addr(self) -> str:
        return self._local_addr

    async def send(self, addr: str, frame: bytes) -> None:
        host, port = parse_addr(addr)
        try:
            await self._sock.sendto(frame, (host, port))
        except OSError as exc:
            if exc.errno not in _LOSS_ERRNOS and not isinstance(exc, socket.gaierror):
                raise
            logger.debug("gossip datagram to addr=%s lost: %s", addr, exc)

    async def receive(self) -> Packet:
        while True:
            try:
                frame, source = await self._sock.recvfrom(MAX_DATAGRAM_BYTES + 1)
            except OSError as exc:
                # Linux reports an earlier send's ICMP "port unreachable" on the next receive.
                if exc.errno in _LOSS_ERRNOS:
                    continue
                raise
            return Packet(frame, format_addr(source[0], source[1]))

    async def aclose(self) -> None:
        self._sock.close()
