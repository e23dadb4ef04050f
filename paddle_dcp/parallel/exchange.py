"""Moving checkpoint bytes between ranks when a rank cannot read a file itself.

On clusters whose disks are local to each node, a rank may lack the metadata file or some data
files. Ranks then talk in pairs, over a connection of the two (see :mod:`paddle_dcp.parallel.p2p`):

* a rank without the metadata sends its targets to a helper that has it, and receives only
  the part of the metadata its targets need (:func:`ask_for_metadata`);
* a rank that needs bytes of a file it cannot read asks a rank that can (its server): first
  for the checksums of the blocks it will read (:func:`check_remote`, so damaged bytes are
  found before any target changes), then for the bytes, one read at a time, each at most the
  plan's largest read (:func:`fetch_remote`), moved by :mod:`paddle_dcp.parallel.transfer`.

Every rank visits its partners in transfer's global order of pairs (deadlock-free); within a
pair, the lower rank's request and its answer come first. A server that fails to read answers
FAILED, the pair stays in step, the client stops asking it, and the server's error reaches
every rank at the step's agreement (:mod:`paddle_dcp.parallel.agree`) instead of as a hang.
"""
from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Sequence

import numpy as np

from . import transfer, wire
from .comm import Comm
from .transfer import directions, pair_order
from ..errors import CollectiveError, DcpError, IntegrityError
from ..core import checksums
from ..core.load_plan import ReadOp
from ..io.reads import Staging
from ..io.storage import Storage

logger = logging.getLogger(__name__)


def ask_for_metadata(
    comm: Comm,
    my_helper: int | None,
    request: bytes,
    my_clients: Sequence[int],
    answer: Callable[[int, bytes], bytes],
) -> bytes | None:
    """Pairwise: send ``request`` to ``my_helper`` and return its answer (None when the helper
    could not answer: its error comes at the step's agreement); answer every rank of
    ``my_clients`` with ``answer(client, its request)``. A failed answer is a FAILED status,
    not left hanging."""
    me = comm.rank
    reply, error = None, None
    asking = {my_helper} if my_helper is not None else set()
    for peer in pair_order(me, asking | set(my_clients)):
        for client, server in directions(me, peer):
            if client == me and server == my_helper:
                wire.send_message(comm, peer, request)
                reply = wire.recv_message(comm, peer)
            elif server == me and client in my_clients:
                question = wire.recv_message(comm, peer) or b""
                try:
                    wire.send_message(comm, peer, answer(peer, question))
                except Exception as exc:  # noqa: BLE001 - agreed on; the client is not left hanging
                    wire.send_failed(comm, peer)
                    error = error or exc
    if error is not None:
        raise error
    return reply


LANES = 2  # connections the bytes of one direction of a pair travel over at once
LANE_BYTES = 32 << 20  # a direction moving fewer bytes keeps to one connection


def lanes_of(request: list, lanes: int) -> list[list[int]]:
    """The ranges of ``request`` ([name, start, stop] each) dealt to the connections of a pair:
    each to the lane with the fewest bytes so far, in order. Client and server compute it from
    the same request, so they agree on which range travels where."""
    sizes = [stop - start if type(start) is int and type(stop) is int and stop > start else 0 for _, start, stop in request]
    count = lanes if len(request) > 1 and sum(sizes) >= LANE_BYTES else 1
    parts: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for i, n in enumerate(sizes):
        lane = load.index(min(load))
        parts[lane].append(i)
        load[lane] += n
    return [p for p in parts if p] or [[]]


def _on_lanes(comm: Comm, parts: list[list[int]], fn: Callable) -> list:
    """``fn(lane comm, part)`` for every part, each on its own connection and thread (the
    first on the caller's)."""
    if len(parts) == 1:
        return [fn(comm, parts[0])]
    with ThreadPoolExecutor(max_workers=len(parts) - 1, thread_name_prefix="paddle_dcp-lane") as pool:
        others = [pool.submit(fn, comm.lane(i), part) for i, part in enumerate(parts) if i]
        first = fn(comm, parts[0])
        return [first] + [f.result() for f in others]


def fetch_remote(
    comm: Comm,
    store: Storage,
    my_servers: dict[int, list[ReadOp]],
    my_clients: Sequence[int],
    file_name: Callable[[int], str],
    run_op: Callable[[ReadOp, Callable[[ReadOp, memoryview], None]], None],
) -> int:
    """Pairwise: fetch the bytes of this rank's remote ops from their servers and serve the
    ranges other ranks ask of this rank; a direction that moves many bytes uses ``LANES``
    connections at once. Returns the bytes received.

    Args:
        my_servers: server rank -> this rank's ops in files it cannot read.
        my_clients: ranks that will ask this rank for bytes.
        file_name: data file name of a file index of this rank's metadata.
        run_op: carries out one op, taking its bytes from the fetch function it is given
            (called from several threads at once, for distinct ops).
    """
    me = comm.rank
    received, error = 0, None
    for peer in pair_order(me, set(my_servers) | set(my_clients)):
        for client, server in directions(me, peer):
            if client == me and server in my_servers:
                ops = my_servers[server]
                request = [[file_name(op.file), op.start, op.stop] for op in ops]
                wire.send_message(comm, peer, json.dumps(request).encode())
                parts = lanes_of(request, comm.lanes)
                for got, failed in _on_lanes(comm, parts, lambda c, part: _fetch(c, peer, [ops[i] for i in part], file_name, run_op)):
                    received, error = received + got, error or failed
            elif server == me and client in my_clients:
                error = _serve(comm, peer, store) or error
    if error is not None:
        raise error
    return received


def _fetch(comm: Comm, peer: int, ops: list[ReadOp], file_name: Callable[[int], str], run_op) -> tuple[int, DcpError | None]:
    """Receive ``ops``' bytes from ``peer`` on one connection; (bytes received, the first
    error). The pair stays in step after an error: every answer is taken."""
    inbox = transfer.Receiver(comm, peer)
    received, error = 0, None
    for op in ops:
        taken = [False]

        def fetch(op: ReadOp, out: memoryview, taken=taken) -> None:
            taken[0] = True
            if not inbox.into(out, f"bytes [{op.start}, {op.stop}) of {file_name(op.file)}"):
                raise _ServerFailed()  # or a message of another size: inbox.error

        try:
            if error is None and not inbox.failed and inbox.error is None:
                run_op(op, fetch)
                received += op.nbytes
        except _ServerFailed:  # its own error comes at the agreement
            pass
        except DcpError as exc:
            error = error or exc
        if not taken[0]:  # keep the pair in step after an error
            inbox.skip()
    return received, error or inbox.error


class _ServerFailed(Exception):
    """The server sent FAILED in place of an op's bytes (inside fetch_remote only)."""


def _serve(comm: Comm, client: int, store: Storage) -> Exception | None:
    """Answer ``client``'s request, on as many connections as it uses (:func:`lanes_of`);
    returns the first error (the client got FAILED for that range and the ones after it)."""
    request = wire.decode_json(wire.recv_message(comm, client), f"rank {client}'s request") or []
    parts = lanes_of(request, comm.lanes)
    errors = _on_lanes(comm, parts, lambda c, part: _serve_lane(c, client, [request[i] for i in part], store))
    return next((e for e in errors if e is not None), None)


def _serve_lane(comm: Comm, client: int, request: list, store: Storage) -> Exception | None:
    """Answer ranges of ``request`` in order, each read while the one before it is sent (one
    reading thread, two buffers in turn)."""
    buffers = (Staging(), Staging())
    reader = store.range_reader()

    def read(i: int) -> np.ndarray:
        name, start, stop = request[i]
        if type(start) is not int or type(stop) is not int or not 0 <= start <= stop or stop - start > wire.MAX_MESSAGE:
            # the peer broke the protocol (a bug, or another version): no file is at fault
            raise CollectiveError("exchange", {client: f"asked rank {comm.rank} for a malformed range [{start}, {stop}) of {name!r}"})
        buf = buffers[i % 2].get(stop - start)
        reader.read_into(str(name), start, memoryview(buf))
        return buf

    try:
        return transfer.send(comm, client, len(request), read, ahead=True)
    finally:
        reader.close()


def _read(reader, staging: Staging, name: str, at: int, n: int) -> memoryview:
    """Bytes [at, at + n) of file ``name`` in the staging buffer (valid until the next read)."""
    buf = memoryview(staging.get(n))
    reader.read_into(name, at, buf)
    return buf


def check_remote(
    comm: Comm,
    store: Storage,
    my_servers: dict[int, list[ReadOp]],
    my_clients: Sequence[int],
    blocks: Callable[[ReadOp], list[checksums.Block]],
    file_name: Callable[[int], str],
) -> None:
    """Pairwise: ask each server for the checksums of the blocks this rank will read from it,
    compare them with the metadata's, and answer the same question for this rank's clients.
    Raises IntegrityError naming the file and range of the first mismatch."""
    me = comm.rank
    reader = store.range_reader()
    staging = Staging()
    error = None
    try:
        for peer in pair_order(me, set(my_servers) | set(my_clients)):
            for client, server in directions(me, peer):
                if client == me and server in my_servers:
                    found = _ask_checks(comm, peer, [(file_name(op.file), blocks(op)) for op in my_servers[server]])
                    error = error or found
                elif server == me and client in my_clients:
                    found = _answer_checks(comm, peer, lambda name, at, n: _read(reader, staging, name, at, n))
                    error = error or found
    finally:
        reader.close()
    if error is not None:
        raise error


def _ask_checks(comm: Comm, server: int, wanted: list[tuple[str, list[checksums.Block]]]) -> DcpError | None:
    """Send a server the blocks to hash (file, offset, length, seed) and compare its answer
    with the recorded checksums; returns the first mismatch (a server that failed says so at
    the agreement; a failed send or receive raises)."""
    request = [[name, [[at, n, seed] for at, n, seed, _ in bl]] for name, bl in wanted]
    wire.send_message(comm, server, json.dumps(request).encode())
    answer = wire.recv_message(comm, server)
    if answer is None:
        return None
    got = np.frombuffer(answer, dtype="<u8")
    expected = sum(len(bl) for _, bl in wanted)
    if len(got) != expected:
        return CollectiveError("verify remote", {server: f"sent {len(got)} checksums for {expected} blocks"})
    for name, bl in wanted:
        bad, got = checksums.failing(bl, got[: len(bl)]), got[len(bl) :]
        if bad:
            at, n = bad[0][:2]
            return IntegrityError(
                f"{name} on rank {server}: bytes [{at}, {at + n}) fail their checksum: "
                f"the file is damaged or does not belong to this metadata"
            )
    return None


def _answer_checks(comm: Comm, client: int, read: Callable[[str, int, int], memoryview]) -> DcpError | None:
    """Hash the blocks a client asks for (``read(file, offset, length)``) and send the
    checksums; a malformed request or a failed read tells the client this rank failed and is
    returned."""
    request = wire.decode_json(wire.recv_message(comm, client), f"rank {client}'s request") or []
    try:
        sums: list[int] = []
        for name, ranges in request:
            for at, n, seed in ranges:
                if (
                    type(at) is not int or type(n) is not int or type(seed) is not int
                    or at < 0 or not 0 <= n <= wire.MAX_MESSAGE or not 0 <= seed < 1 << 64
                ):  # fmt: skip
                    raise CollectiveError("verify remote", {client: f"asked rank {comm.rank} for a malformed range of {name!r}"})
            sums += checksums.hashed([(at, n, seed, 0) for at, n, seed in ranges], partial(read, str(name)))
        wire.send_message(comm, client, np.asarray(sums, dtype="<u8").view(np.uint8))
    except DcpError as exc:
        wire.send_failed(comm, client)
        return exc
    return None
