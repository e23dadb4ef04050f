"""Point-to-point byte streams between two ranks, over TCP, outside every process group.

Node-local loads and ``save_gathered`` move checkpoint bytes between pairs of ranks. Those bytes
start and end in host memory, so they travel host to host: no device buffers, no NCCL
communicator (one per pair would cost device memory and a communicator setup each), no gloo
group per pair (paddle keeps every group's context for the life of the process). Each process
has one listening socket; the ranks of a group that pairs up learn each other's addresses by
one all-gather over the group, the first time (:meth:`Transport.learn`; a rank that finds no
address learned asks the job's store, whose get takes ~90 ms); a pair talks over one
connection per channel (the caller's thread and an async save's writer thread each have
their own), made by the lower rank, accepted by the higher. Connections are closed when the
pairwise step that used them ends (:meth:`Transport.end_step`), so a process holds none
between steps, whatever the number of peers it talked to.

Each message is an 8-byte length then the bytes; a receiver expecting another length fails
with a :class:`~paddle_dcp.errors.CollectiveError` naming the peer. Every wait has a deadline
(``PADDLE_DCP_GROUP_TIMEOUT``, 600 s by default).
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from typing import Hashable, Sequence

import numpy as np

from ..errors import CollectiveError

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<q16s")  # the connecting rank, its channel
_LENGTH = struct.Struct("<Q")


def _timeout() -> float:
    return float(os.environ.get("PADDLE_DCP_GROUP_TIMEOUT", "600"))


def host_address() -> str:
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    return endpoint.rsplit(":", 1)[0] if ":" in endpoint else "127.0.0.1"


def _recv_exact(conn: socket.socket, view: memoryview, peer: int) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise CollectiveError("point to point", {peer: "closed the connection; it may have died"})
        got += n


def _hello(conn: socket.socket) -> tuple[int, str] | None:
    """(rank, channel) a connecting rank announces first; None for anything else (a closed
    connection, bytes that are not a hello)."""
    hello = bytearray(_HELLO.size)
    try:
        _recv_exact(conn, memoryview(hello), -1)
        rank, channel = _HELLO.unpack(hello)
        return int(rank), channel.rstrip(b"\0").decode("ascii")
    except (CollectiveError, OSError, UnicodeDecodeError) as exc:
        logger.warning("point to point: dropped a connection that did not say which rank it is (%s)", exc)
        return None


class Transport:
    """This process's point-to-point endpoint (see the module doc); thread-safe."""

    def __init__(self, rank: int, store):
        self.rank = rank
        self._store = store  # the job's key-value store: addresses are announced there
        self._listener: socket.socket | None = None
        self._conns: dict[tuple[int, str], socket.socket] = {}
        self._waiting: dict[tuple[int, str], socket.socket] = {}  # accepted, not yet asked for
        self._addresses: dict[int, tuple[str, int]] = {}
        self._groups: set[Hashable] = set()  # keys of the groups whose addresses were all-gathered
        self._lock = threading.Lock()
        self._accepting = threading.Lock()

    def _key(self, rank: int) -> str:
        return f"paddle_dcp/p2p/{rank}"

    def _listen(self) -> socket.socket:
        with self._lock:
            if self._listener is None:
                host = host_address()
                listener = socket.socket()
                listener.bind((host, 0))
                listener.listen(256)
                self._store.set(self._key(self.rank), f"{host}:{listener.getsockname()[1]}".encode())
                self._listener = listener
            return self._listener

    def address(self) -> str:
        """Where this process listens (``host:port``; listening from now on)."""
        host, port = self._listen().getsockname()[:2]
        return f"{host}:{port}"

    def knows(self, key: Hashable) -> bool:
        """Whether the group ``key`` names learned its addresses (:meth:`learn`): the same
        answer on every rank of it, as all of them took part. The key names a comm, not only
        its ranks: a process's comms over the same ranks (the caller's, an async save's) pair
        up in their own orders, so each learns once, by itself."""
        with self._lock:
            return key in self._groups

    def learn(self, key: Hashable, ranks: Sequence[int], addresses: Sequence[str]) -> None:
        """The addresses of the ranks of group ``key`` (``address()`` of each, in order),
        all-gathered."""
        with self._lock:
            for rank, text in zip(ranks, addresses):
                host, port = text.rsplit(":", 1)
                self._addresses[rank] = (host, int(port))
            self._groups.add(key)

    def connection(self, peer: int, channel: str) -> socket.socket:
        """The connection to ``peer`` on ``channel``, made (or accepted) on first use."""
        key = (peer, channel)
        with self._lock:
            conn = self._conns.get(key)
        if conn is not None:
            return conn
        listener = self._listen()  # announced before anything waits on a peer
        if self.rank < peer:
            conn = socket.create_connection(self._address(peer), timeout=_timeout())
            conn.sendall(_HELLO.pack(self.rank, channel.encode()))
        else:
            conn = self._accept(listener, key)
        conn.settimeout(_timeout())
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._conns[key] = conn
        return conn

    def _address(self, peer: int) -> tuple[str, int]:
        """Where ``peer`` listens: learned with its group, else asked of the job's store once (a
        get costs ~90 ms there), then remembered (a listener lives as long as its process)."""
        with self._lock:
            address = self._addresses.get(peer)
        if address is None:
            host, port = bytes(self._store.get(self._key(peer))).decode().rsplit(":", 1)
            address = (host, int(port))
            with self._lock:
                self._addresses[peer] = address
        return address

    def _accept(self, listener: socket.socket, key: tuple[int, str]) -> socket.socket:
        """Accept connections until ``key``'s arrives (others wait for their own askers)."""
        deadline = time.monotonic() + _timeout()
        while True:
            with self._lock:
                conn = self._waiting.pop(key, None)
            if conn is not None:
                return conn
            if time.monotonic() > deadline:
                raise CollectiveError("point to point", {key[0]: f"did not connect within {_timeout():.0f} s"})
            if not self._accepting.acquire(timeout=0.05):
                continue
            try:
                listener.settimeout(0.2)
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    continue
                conn.settimeout(_timeout())
                asker = _hello(conn)
                if asker is None:  # not a rank of this job (a port scan, a stray client): dropped
                    conn.close()
                    continue
                with self._lock:
                    self._waiting[asker] = conn
            finally:
                self._accepting.release()

    def send(self, peer: int, channel: str, data: np.ndarray) -> None:
        """Send the bytes of ``data`` (uint8, contiguous) to ``peer``."""
        conn = self.connection(peer, channel)
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        conn.sendall(_LENGTH.pack(len(view)))
        conn.sendall(view)

    def recv_into(self, peer: int, channel: str, out: np.ndarray) -> None:
        """Receive exactly ``len(out)`` bytes from ``peer`` into the uint8 array ``out``."""
        conn = self.connection(peer, channel)
        head = bytearray(_LENGTH.size)
        _recv_exact(conn, memoryview(head), peer)
        (length,) = _LENGTH.unpack(head)
        if length != out.nbytes:
            raise CollectiveError("point to point", {peer: f"sent {length} bytes where {out.nbytes} were expected"})
        _recv_exact(conn, memoryview(out).cast("B"), peer)

    def end_step(self, channel: str) -> None:
        """Close this channel's connections (and its lanes', ``channel/i``): the pairwise step
        that used them is over."""
        with self._lock:
            done = [k for k in self._conns if k[1] == channel or k[1].startswith(channel + "/")]
            conns = [self._conns.pop(k) for k in done]
        for conn in conns:
            conn.close()

    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns) + len(self._waiting)

    def close(self) -> None:
        """Close every connection (the listener stays: peers know its address)."""
        with self._lock:
            conns = list(self._conns.values()) + list(self._waiting.values())
            self._conns.clear()
            self._waiting.clear()
        for conn in conns:
            conn.close()
