"""The links paddle_dcp keeps between ranks in a process: its gloo groups, one per (members,
purpose), and its point-to-point endpoint; :class:`Groups` holds them (the process's:
``paddle_dcp.parallel.state.STATE.groups``), ``close`` releases them."""
from __future__ import annotations

import logging
import os
import socket
import threading

import xxhash

from .p2p import Transport, host_address

logger = logging.getLogger(__name__)


class Groups:
    """The gloo process groups and the point-to-point endpoint paddle_dcp made in this process.

    Groups, one per (members, purpose): per process group handed to paddle_dcp, one control
    group and, once it saves asynchronously, one background group; and one per line of a
    Partial mesh dim it reduces along. Each is made by its members only, with a store of its
    own hosted by the lowest member and announced through the job's store (gloo groups created
    at the same time through one store can connect to wrong peers). Bytes between two ranks
    (node-local loads, save_gathered) travel over :mod:`~paddle_dcp.parallel.p2p` connections, no
    group per pair. :meth:`close` releases them all (made again when needed; paddle keeps each
    group's communication context registered until the process exits).
    """

    def __init__(self):
        self._groups: dict[str, object] = {}
        self._made: dict[str, int] = {}  # name -> groups of that name made so far (store keys differ)
        self._transport: Transport | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._groups)

    def names(self) -> list[str]:
        return sorted(self._groups)

    def get(self, rank: int, members: tuple[int, ...], purpose: str):
        name = "-".join(map(str, members)) + f"/{purpose}"
        with self._lock:  # held for the lookup only: making a group waits for other ranks
            group = self._groups.get(name)
            generation = self._made.get(name, 0)
        if group is None:  # one thread per purpose: never two makers of one name
            full = f"{name}/{generation}"
            group = _make_group(rank, members, full, _group_id(full))
            with self._lock:
                self._groups[name] = group
                self._made[name] = generation + 1
        return group

    def transport(self, rank: int) -> Transport:
        """The point-to-point endpoint of this process (made on first use)."""
        with self._lock:
            if self._transport is None:
                from paddle.distributed import collective

                self._transport = Transport(rank, collective._default_store)
            return self._transport

    def close(self) -> None:
        """Release every group and point-to-point connection of this process."""
        with self._lock:
            self._groups.clear()
            transport = self._transport
        if transport is not None:
            transport.close()


def _make_group(rank: int, members: tuple[int, ...], name: str, gid: int):
    from paddle.base import core
    from paddle.distributed import collective

    job_store = collective._default_store
    key = "paddle_dcp/group/" + name
    timeout = int(os.environ.get("PADDLE_DCP_GROUP_TIMEOUT", "600"))
    if rank == members[0]:
        host = host_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        job_store.set(key, f"{host}:{port}".encode())
        store = core.TCPStore(host, port, True, len(members), timeout)
    else:
        host, port = bytes(job_store.get(key)).decode().rsplit(":", 1)
        store = core.TCPStore(host, int(port), False, len(members), timeout)
    logger.debug("made gloo group %s", name)
    return core.ProcessGroupGloo.create(store, members.index(rank), len(members), gid)


_GROUP_GID_BASE, _GROUP_GID_SPAN = 1 << 30, 1 << 29


def _group_id(name: str) -> int:
    """paddle keeps one communication context per group id in a process, for the life of the
    process (``close`` does not remove it): every group of ours needs its own id, and its
    members must agree on it without talking: a hash of its name (members, purpose and
    generation), in a range of ids paddle's own groups do not reach."""
    return _GROUP_GID_BASE + xxhash.xxh3_64_intdigest(name.encode()) % _GROUP_GID_SPAN
