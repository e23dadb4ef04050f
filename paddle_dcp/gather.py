"""save_gathered: every tensor of a sharded state dict, whole, in ONE safetensors file written
by one rank, gathered group by group so that rank's memory stays bounded.

The job of ``paddle.incubate.distributed.utils.io.save(..., gather_to=...)``, without pickle
and for semi-auto-parallel dist tensors:

1. Every rank flattens its state dict, reduces its Partial tensors (as ``save_state_dict``
   does) and sends the gathering rank a summary: keys, dtypes, global shapes, its boxes.
2. The gathering rank plans: one holder per distinct piece (itself when it holds the piece),
   the file's layout (tensors in the state dict's order), and the groups: each tensor cut
   along its outer dims into contiguous chunks of at most ``max_grouped_size`` bytes, chunks
   packed in file order into groups of at most ``max_grouped_size`` bytes. Each rank
   receives the list of messages it must send.
3. The gathering rank writes the safetensors header (sizes follow from shapes and dtypes),
   then, group by group, assembles the group's bytes in one host buffer (its own pieces
   copied, the others received over a process group of two ranks straight into place, or
   through a staging buffer when the place is strided) and appends them to the file, a
   data file writer of its directory's storage.
4. The ranks agree on the transfer's outcome through the gathering rank, which then commits
   the file (it appears whole) when no rank failed and tells every rank the outcome; all
   raise the same error otherwise.

The four steps run as a protocol (:func:`save_steps`, on :mod:`paddle_dcp.parallel.protocol`'s
machinery): steps 1 and 2 are collectives of the group, each local step ending with an
agreement; step 3 is a pairwise step, step 4 a local one. The plan is
:mod:`paddle_dcp.parallel.gather_plan`'s. The transfer and the agreements of steps 3 and 4
travel point to point (``comm.send`` / ``comm.recv_into``, over a connection of the two ranks
(:mod:`~paddle_dcp.parallel.p2p`); the agreement is :mod:`paddle_dcp.parallel.agree`'s star
route), never the job's group: gloo's collectives on the job's group give up after 30 s, and
ranks whose pieces are sent early may wait far longer while the gathering rank writes.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

import numpy as np

from .core import nested, save_plan
from .core.boxes import Box, element_span, is_contiguous
from .core.dtypes import itemsize, storage_dtype
from .parallel import protocol, transfer, wire
from .parallel.comm import Comm, make_comm
from .parallel.gather_plan import GatherPlan, Region, plan_gather
from .parallel.ranks import Prepared
from .parallel.requests import Reduction
from .errors import ArgumentError, CollectiveError, FormatError
from .format.safetensors import MAX_HEADER_BYTES
from .io import open_output
from .io.datafile import DataFileWriter

logger = logging.getLogger(__name__)

STATE_TYPES = ("params", "opt")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes in ``value``: a positive int, or a str like ``"3G"``, ``"512M"``, ``"64K"``,
    ``"100"`` (powers of 1024, as paddle's helper reads them; ``"3GB"``/``"3GiB"`` too).

    Raises:
        ArgumentError: anything else.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value <= 0:
            raise ArgumentError(f"max_grouped_size must be positive, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m and int(m.group(1)) > 0:
            return int(m.group(1)) * _UNITS[m.group(2).upper()]
    raise ArgumentError(f"max_grouped_size must be a positive int or a size like '3G', '512M', '64K'; got {value!r}")


# ============================================================================ the save
def save_gathered(
    state_dict: dict,
    path: str,
    gather_to: int = 0,
    state_type: str = "params",
    max_grouped_size: int | str = "3G",
    process_group=None,
    durable: bool = False,
    *,
    storage_options: dict | None = None,
) -> None:
    """Gather the full value of every tensor of a (nested, sharded) state dict to one rank and
    write it there as one safetensors file; every rank of the group calls it.

    Tensors travel in groups of at most ``max_grouped_size`` bytes (a tensor larger than that
    is cut along its outer dims), so the gathering rank holds about one group plus a quarter
    of one at a time, besides its own state dict. Replicated pieces travel once; Partial
    tensors are reduced first. Plain values (and the nesting) go to the file's
    ``__metadata__``, from the gathering rank (``"opt"``: from every rank, the gathering
    rank's winning).

    The file loads with ``paddle.load(path, safetensors=True)`` (a flat dict: key -> CPU
    tensor, no plain values) and with ``paddle_dcp.load_state_dict(state_dict, path)``
    (in place, plain values too, into any layout).

    Args:
        state_dict: nested dicts / lists / tuples of paddle tensors (dist or not), numpy
            arrays and plain values. Plain tensors count as replicated.
        path: the file to write (its directory is created). It appears, complete, only at the
            end (written as ``path.tmp.<hex>`` and renamed).
        gather_to: the global rank that writes the file.
        state_type: ``"params"``: every rank holds the same tensors (a model's state dict);
            ``"opt"``: ranks may hold different keys (an optimizer state split by key, as
            sharding stage 1 splits it): the file holds the union.
        max_grouped_size: bytes per group, an int or a str like ``"3G"``, ``"512M"``.
        process_group: the ranks that take part; default: all.
        durable: fsync the file and its directory before returning.
        storage_options: for a URL ``path`` (``s3://bucket/prefix/model.safetensors``): as in
            :func:`paddle_dcp.save_state_dict`; the file is then one multipart upload that
            appears at its end.

    Raises:
        CollectiveError: on every rank, when a step failed on some rank (several ranks).
        DcpError: the failure itself (one rank): MismatchError when ranks disagree on the
            tensors, FormatError for a dtype safetensors lacks (complex), StorageError.
    """
    if state_type not in STATE_TYPES:
        raise ArgumentError(f"state_type must be 'params' or 'opt', got {state_type!r}")
    if type(gather_to) is not int:
        raise ArgumentError(f"gather_to must be one global rank (an int), got {gather_to!r}")
    limit = parse_size(max_grouped_size)
    path = os.fspath(path)
    comm = make_comm(process_group, gather_to)
    if gather_to not in comm.ranks:
        raise ArgumentError(f"gather_to={gather_to} is not a rank of the group {list(comm.ranks)}")
    started = time.perf_counter()
    rank = GatherRank(comm, state_dict, path, state_type, limit, durable, storage_options)
    plan = protocol.run(comm, save_steps(rank))
    if plan is not None:
        logger.info(
            "gathered %d tensors (%d bytes) from %d ranks into %s in %d groups in %.3f s",
            len(plan.tensors), plan.data_bytes, comm.size, path, len(plan.groups), time.perf_counter() - started,
        )


@dataclass(frozen=True)
class Opened:
    """What a rank does in the transfer: the gathering rank writes its file (``writer``);
    every other rank sends its messages (``sends``: per group, per message, its regions)."""

    writer: DataFileWriter | None = None
    sends: tuple = ()


class GatherRank:
    """One rank's side of a gathered save (see :func:`save_steps`): its inputs; each step's
    result is a value the protocol carries to the next step."""

    def __init__(
        self, comm: Comm, state_dict: dict, path: str, state_type: str, limit: int, durable: bool = False,
        storage_options: dict | None = None,
    ):
        self.comm, self.state_dict, self.path, self.state_type, self.limit = comm, state_dict, path, state_type, limit
        self.durable, self.storage_options = durable, storage_options
        self.root = comm.coordinator
        self.is_root = comm.rank == self.root

    def prepare(self) -> tuple[Prepared, tuple[Reduction, ...]]:
        from .parallel.placements import is_tensor, partial_pieces
        from .io import is_url

        if self.is_root and not is_url(self.path) and os.path.isdir(self.path):
            raise ArgumentError(
                f"{self.path} is a directory: save_gathered writes one file; name it, e.g. "
                f"{os.path.join(self.path, 'model.safetensors')}"
            )
        flat = nested.flatten(self.state_dict, is_tensor, keep_values=self.is_root or self.state_type == "opt")
        prepared = Prepared(flat, partial_pieces(flat.tensors, self.comm.rank))
        return prepared, prepared.reductions

    def describe(self, prepared: Prepared) -> tuple[dict, bytes]:
        """(key -> what this rank holds of it, its summary for the gathering rank: the pieces
        as ``save_state_dict`` describes them, encoded as its summaries are)."""
        from .parallel.placements import held_of

        flat = prepared.flat
        held = {h.piece.key: h for h in held_of(flat.tensors, prepared.reduced(), self.comm.rank)}
        pieces = [h.piece for h in held.values()]
        return held, wire.encode_summary(save_plan.SaveSummary.from_pieces(self.comm.rank, flat.skeleton, pieces))

    def plan_all(self, summaries: list[bytes] | None) -> tuple[GatherPlan | None, list[bytes] | None]:
        """The gathering rank's plan and every rank's assignment ((None, None) elsewhere)."""
        if not self.is_root:
            return None, None
        decoded = wire.decode_summaries(self.comm.ranks, summaries)  # each distinct header parsed once
        plan = plan_gather(decoded, self.comm.ranks, self.root, self.state_type, self.limit)
        if len(plan.header) - 8 > MAX_HEADER_BYTES:
            raise FormatError(
                f"the safetensors header would take {len(plan.header) - 8} bytes, over the "
                f"{MAX_HEADER_BYTES} safetensors reads; save fewer tensors per file"
            )
        return plan, [plan.assignment(r) for r in self.comm.ranks]

    def open(self, plan: GatherPlan | None, assignment: bytes, held: dict) -> Opened:
        """The gathering rank opens its file; every other rank reads what it must send."""
        if self.is_root:
            return Opened(writer=open_output(self.path, plan.header, self.storage_options))
        return Opened(sends=tuple(_parse_assignment(assignment, held, self.root)))

    def transfer(self, comm: Comm, plan: GatherPlan | None, opened: Opened, held: dict) -> None:
        """Step 3: the gathering rank receives and writes every group, the others send theirs.
        A failure is raised only once this rank's share of the messages has crossed, so that
        its peers stay in step; it is agreed on after."""
        if self.is_root:
            error = _receive(comm, plan, held, opened.writer)
        else:
            error = _send_all(comm, self.root, opened.sends, held)
        if error is not None:
            raise error

    def commit(self, opened: Opened) -> None:
        """Step 4: the file appears, whole (the gathering rank; no rank failed)."""
        if opened.writer is not None:
            opened.writer.commit(self.durable)


def save_steps(rank: GatherRank) -> protocol.Protocol:
    """A gathered save (see the module docstring) as a protocol: steps 1 and 2 are local steps
    each ending with an agreement and the save's collectives; step 3 is one pairwise step and
    step 4 a local one, both agreed on point to point through the gathering rank. Returns the
    plan on the gathering rank (None elsewhere)."""
    prepared, reductions = yield from protocol.local("prepare", rank.prepare)
    yield protocol.ReduceAmong("reduce", reductions)  # agreed on like a local step
    held, summary = yield from protocol.local("describe", lambda: rank.describe(prepared))
    summaries = yield protocol.Gather(summary, rank.root)
    plan, parts = yield from protocol.local("plan", lambda: rank.plan_all(summaries))
    mine = yield protocol.Scatter(parts, rank.root)
    opened = yield from protocol.local("open", lambda: rank.open(plan, mine, held))
    # from here on, only pairs of ranks: see the module docstring
    try:
        yield protocol.Pairwise("gather save", lambda comm: rank.transfer(comm, plan, opened, held), star=True)
        yield from protocol.local("commit", lambda: rank.commit(opened), star=True)
    except BaseException:
        if opened.writer is not None:
            opened.writer.abort()  # nothing appears
        raise
    return plan


def _parse_assignment(data: bytes, held: dict, root: int) -> list[list[list[tuple[str, Box]]]]:
    out = []
    for group in wire.decode_json(data, f"rank {root}'s assignment") or []:
        msgs = []
        for msg in group:
            regions = []
            for key, offsets, shape in msg:
                if key not in held or held[key].local is None:
                    raise CollectiveError("open", {root: f"{key}: asked for a piece this rank does not hold"})
                regions.append((key, Box(tuple(offsets), tuple(shape))))
            msgs.append(regions)
        out.append(msgs)
    return out


class _HostPieces:
    """This rank's pieces as host arrays: a view of the tensor's own memory on the CPU; on a
    GPU one copy, kept while consecutive regions come from the same piece."""

    def __init__(self, held: dict):
        self.held = held
        self._key, self._bytes = None, None

    def region(self, key: str, box: Box) -> np.ndarray:
        """The elements of ``box`` (global coordinates) of this rank's piece of ``key``."""
        from .parallel.device import host_bytes

        h = self.held[key]
        if key != self._key:
            self._key, self._bytes = None, None  # the previous copy goes first
            self._bytes = host_bytes(h.local)  # kept whole: it owns the host copy its array views
            self._key = key
        return _sub(self._bytes.array, box.relative_to(h.piece.box))


def _sub(array: np.ndarray, box: Box) -> np.ndarray:
    """A view of ``box`` of ``array`` (an array even for a 0-d one, where ``[()]`` would give a
    scalar)."""
    return array[box.slices() + (Ellipsis,)]


def _send_all(comm: Comm, root: int, sends, held: dict) -> BaseException | None:
    """Send this rank's messages, in plan order (:mod:`~paddle_dcp.parallel.transfer`: after a
    failure the rest go as FAILED, so that the gathering rank stays in step); returns the
    failure, reported at the end."""
    pieces = _HostPieces(held)
    messages = [msg for group in sends for msg in group]

    def fill(i: int) -> np.ndarray:
        msg = messages[i]
        return _message(msg, pieces, sum(b.volume * itemsize(held[k].piece.dtype) for k, b in msg))

    return transfer.send(comm, root, len(messages), fill)


def _message(msg, pieces: _HostPieces, nbytes: int) -> np.ndarray:
    if len(msg) == 1:
        key, box = msg[0]
        arr = pieces.region(key, box)
        if arr.flags.c_contiguous and arr.flags.writeable:
            return arr.reshape(-1).view(np.uint8)
        return np.array(arr, order="C").reshape(-1).view(np.uint8)  # a copy, writable (dlpack needs it)
    out = np.empty(nbytes, np.uint8)
    at = 0
    for key, box in msg:
        arr = pieces.region(key, box)
        n = arr.nbytes
        out[at : at + n].view(arr.dtype).reshape(arr.shape)[...] = arr
        at += n
    return out


def _receive(comm: Comm, plan: GatherPlan, held: dict, writer: DataFileWriter) -> BaseException | None:
    """Assemble and write every group; returns the first error. After an error, or once a
    sender failed (its own error comes at the agreement), messages are still taken, so that the
    senders stay in step, but nothing more is written."""
    error = None
    buf = np.empty(max((g.nbytes for g in plan.groups), default=0), np.uint8)
    stage = [np.empty(0, np.uint8)]
    dtypes = {t.key: storage_dtype(t.dtype) for t in plan.tensors}
    pieces = _HostPieces(held)
    inboxes = {sender: transfer.Receiver(comm, sender) for g in plan.groups for sender in g.messages}
    for g in plan.groups:
        gbuf = buf[: g.nbytes]
        for reg in g.own:
            if error is None:
                try:
                    _place(reg, gbuf, dtypes)[...] = pieces.region(reg.key, reg.box)
                except Exception as exc:  # noqa: BLE001 - reported at the end
                    error = exc
        for sender in sorted(g.messages):
            for msg in g.messages[sender]:
                _receive_message(inboxes[sender], msg, gbuf, dtypes, stage)
        error = error or next((i.error for i in inboxes.values() if i.error is not None), None)
        if error is None and not any(i.failed for i in inboxes.values()):
            try:
                writer.write(memoryview(gbuf))
            except Exception as exc:  # noqa: BLE001 - reported at the end
                error = exc
    return error


def _place(reg: Region, gbuf: np.ndarray, dtypes: dict) -> np.ndarray:
    """The region's elements in the group buffer (a strided view)."""
    chunk = gbuf[reg.at : reg.at + reg.chunk.volume * reg.itemsize].view(dtypes[reg.key]).reshape(reg.chunk.shape)
    return _sub(chunk, reg.box.relative_to(reg.chunk))


def _receive_message(inbox: transfer.Receiver, msg: list[Region], gbuf: np.ndarray, dtypes: dict, stage: list) -> None:
    """One message into its places in the group buffer: straight into place when it is one
    contiguous region, else through the staging buffer ``stage[0]`` (grown as needed)."""
    nbytes = sum(r.nbytes for r in msg)
    what = f"gathered bytes of {msg[0].key}"
    reg = msg[0]
    rel = reg.box.relative_to(reg.chunk)
    if len(msg) == 1 and is_contiguous(reg.chunk.shape, rel):
        at = reg.at + element_span(reg.chunk.shape, rel)[0] * reg.itemsize
        inbox.into(gbuf[at : at + nbytes], what)
        return
    if len(stage[0]) < nbytes:
        stage[0] = np.empty(nbytes, np.uint8)
    if not inbox.into(stage[0][:nbytes], what):
        return
    at = 0
    for r in msg:
        dest = _place(r, gbuf, dtypes)
        dest[...] = stage[0][at : at + r.nbytes].view(dest.dtype).reshape(dest.shape)
        at += r.nbytes
