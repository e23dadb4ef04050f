"""Whole data files copied between ranks of different nodes (the copies of a node-local
checkpoint tier), point to point, each copy written under the original's name and made to
appear only once every copy of the step has arrived.

Ranks visit their partners in the global order of pairs of :mod:`paddle_dcp.parallel.transfer`
(deadlock-free); within a pair the lower rank's file crosses first. A file travels as a
header (its name and size, or the FAILED status when the sender has no such file) and then
chunks of at most :data:`CHUNK` bytes moved by :mod:`~paddle_dcp.parallel.transfer`: the
sender reads each chunk into one reused buffer (from the page cache, far faster than the
connection: reading ahead on a thread of its own measured slower, the cores being busy with
the transfer), the receiver writes a chunk while it receives the next (three buffers in turn). A sender that fails while reading sends FAILED for
the rest of the file; its error reaches every rank at the step's agreement, after which the
receiver drops the copy (its writer is never committed).
"""
from __future__ import annotations

import json
import logging
from typing import Mapping

import numpy as np

from . import transfer, wire
from .comm import Comm
from .transfer import directions, pair_order
from ..errors import CollectiveError
from ..io.datafile import DataFileWriter, data_writer
from ..io.storage import Storage

logger = logging.getLogger(__name__)

CHUNK = 64 << 20  # bytes of one message of a copy


def copy_files(comm: Comm, store: Storage, sends: Mapping[int, str], receives: Mapping[int, str]) -> list[DataFileWriter]:
    """Pairwise: send the file ``sends[peer]`` of ``store`` to every peer in ``sends`` and
    receive the file ``receives[peer]`` from every peer in ``receives`` into ``store``, each
    under its own name. Returns the writers of the received copies, written but not committed
    (the caller commits them once every rank agrees, or aborts them); a failure is raised
    once every pair is done."""
    me = comm.rank
    reader = store.range_reader()
    sending = [np.empty(0, np.uint8)]  # reused from file to file
    writers: list[DataFileWriter] = []
    error: BaseException | None = None
    try:
        for peer in pair_order(me, set(sends) | set(receives)):
            for sender, receiver in directions(me, peer):
                if sender == me and peer in sends:
                    failed = _send_file(comm, peer, reader, store, sends[peer], sending)
                    error = error or failed
                elif receiver == me and peer in receives:
                    writer, failed = _receive_file(comm, peer, store, receives[peer])
                    if writer is not None:
                        writers.append(writer)
                    error = error or failed
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        reader.close()
    if error is not None:
        for w in writers:
            w.abort()
        raise error
    return writers


def _chunk(bufs: list, i: int, n: int) -> np.ndarray:
    """The first ``n`` bytes of buffer ``i`` of ``bufs`` (grown when too small)."""
    if len(bufs[i]) < n:
        bufs[i] = np.empty(n, np.uint8)
    return bufs[i][:n]


def _send_file(comm: Comm, peer: int, reader, store: Storage, name: str, bufs: list) -> BaseException | None:
    size = store.size(name)
    if size is None:
        wire.send_failed(comm, peer)
        return CollectiveError("replicate", {comm.rank: f"its data file {name} is missing, so it cannot be copied"})
    wire.send_message(comm, peer, json.dumps({"name": name, "size": size}).encode())
    starts = range(0, size, CHUNK)

    def read(i: int) -> np.ndarray:
        chunk = _chunk(bufs, 0, min(CHUNK, size - starts[i]))
        reader.read_into(name, starts[i], memoryview(chunk))
        return chunk

    return transfer.send(comm, peer, len(starts), read)


def _receive_file(comm: Comm, peer: int, store: Storage, name: str):
    header = wire.recv_message(comm, peer)
    if header is None:  # the sender has no such file: its error comes at the agreement
        return None, None
    doc = wire.decode_json(header, f"rank {peer}'s copy of {name}")
    size = doc.get("size") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("name") != name or type(size) is not int or size < 0:
        raise CollectiveError("replicate", {peer: f"sent {header[:200]!r} where the header of {name} was expected"})
    # a chunk is received while the writer still writes the last two (three buffers in turn,
    # this file's own: the writer is committed only later, and may still hold them)
    bufs = [np.empty(0, np.uint8) for _ in range(3)]
    writer = data_writer(store, name, block_bytes=0, depth=2, alignment=1)
    inbox = transfer.Receiver(comm, peer)
    error = None
    try:
        for i, start in enumerate(range(0, size, CHUNK)):
            chunk = _chunk(bufs, i % 3, min(CHUNK, size - start))
            if inbox.into(chunk, f"bytes [{start}, {start + len(chunk)}) of {name}") and error is None:
                try:
                    writer.write(chunk.data, keep=bufs[i % 3])
                except Exception as exc:  # noqa: BLE001 - keep receiving; agreed on later
                    error = exc
    except BaseException:
        writer.abort()
        raise
    error = error or inbox.error
    if error is not None or inbox.failed:  # the sender's own error comes at the agreement
        writer.abort()
        return None, error
    return writer, None
