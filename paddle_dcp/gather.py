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
   through a staging buffer when the place is strided) and appends them to the file.
4. Every rank reports to the gathering rank, which renames the file into place when no rank
   failed and tells every rank the outcome; all raise the same error otherwise.

Steps 1 and 2 are collectives of the group, each ending with an agreement (comm.step). The
transfer and the final reports travel over process groups of two ranks ("links"), never the
job's group: gloo's collectives on the job's group give up after 30 s, and ranks whose pieces
are sent early may wait far longer while the gathering rank writes.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .core import nested
from .core.boxes import Box, check_tiling, element_span, is_contiguous, split_region
from .dist.comm import Comm, describe_error, make_comm
from .core.dtypes import itemsize, storage_dtype
from .errors import CollectiveError, DcpError, FormatError, MismatchError, StorageError
from .io.local import AtomicFile
from .format.safetensors import MAX_HEADER_BYTES, SAFETENSORS_DTYPES, encode_header
from .singlefile import METADATA_FORMAT, METADATA_VERSION
from .version import __version__

logger = logging.getLogger(__name__)

STATE_TYPES = ("params", "opt")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)
_MAX_REPORT = 1 << 20  # bytes of a rank's final report


def parse_size(value: int | str) -> int:
    """Bytes in ``value``: a positive int, or a str like ``"3G"``, ``"512M"``, ``"64K"``,
    ``"100"`` (powers of 1024, as paddle's helper reads them; ``"3GB"``/``"3GiB"`` too).

    Raises:
        DcpError: anything else.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value <= 0:
            raise DcpError(f"max_grouped_size must be positive, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m and int(m.group(1)) > 0:
            return int(m.group(1)) * _UNITS[m.group(2).upper()]
    raise DcpError(f"max_grouped_size must be a positive int or a size like '3G', '512M', '64K'; got {value!r}")


# ============================================================================ the plan
@dataclass(frozen=True)
class Region:
    """A box of one tensor that one rank sends, and where it lands.

    Attributes:
        key: flat state-dict key.
        box: the region, in global coordinates (elements).
        chunk: the chunk of the tensor it lies in, in global coordinates.
        at: the chunk's first byte in its group's buffer, in bytes.
        itemsize: bytes per element.
    """

    key: str
    box: Box
    chunk: Box
    at: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.box.volume * self.itemsize


@dataclass
class Group:
    """A run of the file's data section assembled in memory at once.

    Attributes:
        start / stop: its bytes in the data section (from the end of the header), in bytes.
        own: regions the gathering rank copies from its own pieces.
        messages: sender rank -> its messages, in order; a message is the concatenated
            bytes of its regions.
    """

    start: int
    stop: int
    own: list[Region] = field(default_factory=list)
    messages: dict[int, list[list[Region]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TensorLayout:
    """A tensor of the file: its key, dtype name, global shape, and bytes in the data section."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int


@dataclass
class GatherPlan:
    """The gathering rank's plan: the file's header and groups, and each sender's part."""

    tensors: list[TensorLayout]
    skeleton: dict
    groups: list[Group]
    header: bytes

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].begin + self.tensors[-1].nbytes if self.tensors else 0

    def assignment(self, rank: int) -> bytes:
        """What ``rank`` sends: per group, its messages, each a list of [key, offsets, shape]."""
        out = [
            [[[r.key, list(r.box.offsets), list(r.box.shape)] for r in msg] for msg in g.messages.get(rank, ())]
            for g in self.groups
        ]
        return json.dumps(out, separators=(",", ":")).encode()


def _limits(limit: int) -> tuple[int, int, int]:
    """(batch, small, part) in bytes: small regions travel together in messages of at most
    ``batch`` bytes; larger ones are cut into messages of at most ``part`` bytes, which bounds
    the gathering rank's staging buffer (strided places) to a quarter of a group or so."""
    batch = min(max(limit // 4, 64 << 10), 4 << 20)
    return batch, max(batch // 4, 1), max(batch, limit // 4)


def _summary(rank: int, skeleton: dict, pieces) -> bytes:
    tensors = [
        [p.key, p.dtype, list(p.global_shape)]
        + ([list(p.box.offsets), list(p.box.shape)] if p.box is not None and p.box.volume > 0 else [None, None])
        for p in pieces
    ]
    return json.dumps({"rank": rank, "s": skeleton, "t": tensors}, separators=(",", ":")).encode()


def plan_gather(summaries: list[bytes], ranks: tuple[int, ...], root: int, state_type: str, limit: int) -> GatherPlan:
    """Plan a gathered save from every rank's summary (in group order). Pure: no I/O.

    Raises:
        MismatchError: ranks disagree on a tensor's dtype or shape, on what is a tensor, or (for
            ``state_type="params"``) on which tensors there are.
        FormatError: a dtype safetensors cannot hold, or the reserved key ``__metadata__``.
        PlanError: pieces that overlap or leave a gap.
    """
    docs = {r: json.loads(s) for r, s in zip(ranks, summaries)}
    base = docs[root]
    skeleton = base["s"]
    info: dict[str, tuple[str, tuple[int, ...]]] = {}
    holders: dict[str, dict[tuple, list[int]]] = {}
    root_keys = {t[0] for t in base["t"]}
    for r in [root] + [r for r in ranks if r != root]:
        doc = docs[r]
        keys = [t[0] for t in doc["t"]]
        if state_type == "params" and r != root and set(keys) != root_keys:
            lacks = sorted(root_keys - set(keys))[:5]
            extra = sorted(set(keys) - root_keys)[:5]
            raise MismatchError(
                f"state_type='params' needs the same tensors on every rank: rank {r} lacks {lacks} and "
                f"has {extra} that rank {root} lacks; for optimizer states split by key across ranks "
                f"(sharding), pass state_type='opt'"
            )
        if state_type == "opt" and r != root:
            try:
                skeleton = nested.merge(skeleton, doc["s"])
            except FormatError as exc:
                raise MismatchError(f"rank {r} and rank {root}: {exc}") from None
        for key, dtype, shape, offsets, bshape in doc["t"]:
            shape = tuple(shape)
            seen = info.setdefault(key, (dtype, shape))
            if seen != (dtype, shape):
                raise MismatchError(
                    f"{key}: rank {r} holds {dtype} of global shape {shape}, another rank {seen[0]} of shape {seen[1]}"
                )
            if offsets is not None:
                holders.setdefault(key, {}).setdefault((tuple(offsets), tuple(bshape)), []).append(r)
    order = nested.tensor_keys(skeleton)
    if "__metadata__" in info:
        raise FormatError("the key '__metadata__' is reserved by safetensors; rename that entry of the state dict")

    # the file's layout, in the state dict's order
    tensors, at = [], 0
    for key in order:
        dtype, shape = info[key]
        if dtype not in SAFETENSORS_DTYPES:
            raise FormatError(
                f"{key}: {dtype} has no safetensors dtype (supported: {', '.join(SAFETENSORS_DTYPES)}); "
                f"save it with save_state_dict instead"
            )
        nbytes = math.prod(shape) * itemsize(dtype)
        tensors.append(TensorLayout(key, dtype, shape, at, nbytes))
        at += nbytes

    # one holder per distinct piece: the gathering rank when it holds it, else the least loaded
    sent = {r: 0 for r in ranks}
    chosen: dict[str, list[tuple[int, Box]]] = {}
    for t in tensors:
        pieces = holders.get(t.key, {})
        boxes = [Box(o, s) for o, s in pieces]
        check_tiling(t.key, t.shape, np.asarray([b.offsets for b in boxes], np.int64).reshape(len(boxes), len(t.shape)),
                     np.asarray([b.shape for b in boxes], np.int64).reshape(len(boxes), len(t.shape)))
        out = []
        for box, who in zip(boxes, pieces.values()):
            r = root if root in who else min(who, key=lambda x: (sent[x], x))
            if r != root:
                sent[r] += box.volume
            out.append((r, box))
        chosen[t.key] = out

    # chunks (contiguous, at most `limit` bytes) packed into groups (at most `limit` bytes)
    batch, small, part = _limits(limit)
    groups: list[Group] = []
    pending: dict[int, list[Region]] = {}

    def flush_batches(group: Group) -> None:
        for r, regions in pending.items():
            msgs = group.messages.setdefault(r, [])
            cur, size = [], 0
            for reg in regions:
                if cur and size + reg.nbytes > batch:
                    msgs.append(cur)
                    cur, size = [], 0
                cur.append(reg)
                size += reg.nbytes
            if cur:
                msgs.append(cur)
        pending.clear()

    for t in tensors:
        isz = itemsize(t.dtype)
        whole = Box.whole(t.shape)
        chunks = [whole] if t.nbytes <= limit else split_region(whole, max(1, limit // isz), t.shape)
        for chunk in chunks:
            first, stop = element_span(t.shape, chunk)
            cstart, cbytes = t.begin + first * isz, (stop - first) * isz
            if cbytes == 0:
                continue
            if not groups or groups[-1].nbytes + cbytes > limit:
                if groups:
                    flush_batches(groups[-1])
                groups.append(Group(cstart, cstart))
            g = groups[-1]
            at_in_group = cstart - g.start
            g.stop = cstart + cbytes
            for r, box in chosen[t.key]:
                inter = chunk.intersect(box)
                if inter is None:
                    continue
                reg = Region(t.key, inter, chunk, at_in_group, isz)
                if r == root:
                    g.own.append(reg)
                elif reg.nbytes <= small:
                    pending.setdefault(r, []).append(reg)
                else:
                    origin = Box((0,) * inter.ndim, inter.shape)
                    for p in split_region(origin, max(1, part // isz), inter.shape):
                        shifted = Box(tuple(a + b for a, b in zip(p.offsets, inter.offsets)), p.shape)
                        g.messages.setdefault(r, []).append([Region(t.key, shifted, chunk, at_in_group, isz)])
    if groups:
        flush_batches(groups[-1])
    return GatherPlan(tensors, skeleton, groups, _header(tensors, skeleton))


def _header(tensors: list[TensorLayout], skeleton: dict) -> bytes:
    """The safetensors header: 8-byte length, then JSON padded with spaces to 8 bytes."""
    metadata = {
        "format": METADATA_FORMAT,
        "format_version": METADATA_VERSION,
        "created_by": f"paddle_dcp {__version__}",
        "structure": json.dumps(skeleton, separators=(",", ":")),
    }
    # Tensors without elements are described in the metadata only: safetensors 0.8's paddle
    # backend (paddle.load(..., safetensors=True)) fails on a zero-byte tensor.
    empty = {t.key: {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape)} for t in tensors if t.nbytes == 0}
    if empty:
        metadata["empty_tensors"] = json.dumps(empty, separators=(",", ":"))
    stored = sorted((t for t in tensors if t.nbytes), key=lambda t: t.begin)
    at = 0
    for t in stored:  # encode_header places them back to back: the plan's layout must agree
        if t.begin != at:
            raise AssertionError(f"{t.key}: the plan puts it at byte {t.begin}, after {at} bytes")
        at += t.nbytes
    return encode_header(((t.key, SAFETENSORS_DTYPES[t.dtype], t.shape, t.nbytes) for t in stored), metadata)


# ============================================================================ the save
def save_gathered(
    state_dict: dict,
    path: str,
    gather_to: int = 0,
    state_type: str = "params",
    max_grouped_size: int | str = "3G",
    process_group=None,
    durable: bool = False,
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

    Raises:
        CollectiveError: on every rank, when a step failed on some rank (several ranks).
        DcpError: the failure itself (one rank): MismatchError when ranks disagree on the
            tensors, FormatError for a dtype safetensors lacks (complex), StorageError.
    """
    from .dist.placements import describe, has_partial, is_tensor, reduce_partial

    if state_type not in STATE_TYPES:
        raise DcpError(f"state_type must be 'params' or 'opt', got {state_type!r}")
    if type(gather_to) is not int:
        raise DcpError(f"gather_to must be one global rank (an int), got {gather_to!r}")
    limit = parse_size(max_grouped_size)
    path = os.fspath(path)
    comm = make_comm(process_group, gather_to)
    if gather_to not in comm.ranks:
        raise DcpError(f"gather_to={gather_to} is not a rank of the group {list(comm.ranks)}")
    root = comm.coordinator
    is_root = comm.rank == root
    started = time.perf_counter()
    st: dict[str, Any] = {}

    with comm.step("prepare"):
        st["flat"] = nested.flatten(state_dict, is_tensor, keep_values=is_root or state_type == "opt")
    with comm.step("reduce"):
        st["reduced"] = {
            k: reduce_partial(k, v, comm.rank, comm) for k, v in st["flat"].tensors.items() if has_partial(v)
        }
    with comm.step("describe"):
        held = {}
        for k, v in st["flat"].tensors.items():
            h = describe(k, v, comm.rank)
            if k in st["reduced"] and h.local is not None:
                h.local = st["reduced"][k]
            held[k] = h
        summary = _summary(comm.rank, st["flat"].skeleton, [h.piece for h in held.values()])
    summaries = comm.call("gather summaries", lambda: comm.gather(summary, root))
    with comm.step("plan"):
        if is_root:
            st["plan"] = plan_gather(summaries, comm.ranks, root, state_type, limit)
            if len(st["plan"].header) - 8 > MAX_HEADER_BYTES:
                raise FormatError(
                    f"the safetensors header would take {len(st['plan'].header) - 8} bytes, over the "
                    f"{MAX_HEADER_BYTES} safetensors reads; save fewer tensors per file"
                )
    parts = [st["plan"].assignment(r) for r in comm.ranks] if is_root else None
    mine = comm.call("send plan", lambda: comm.scatter(parts, root))
    writer = None
    with comm.step("open"):
        if is_root:
            writer = _open_output(path, st["plan"].header)
        else:
            st["sends"] = _parse_assignment(mine, held)

    # from here on, only pair groups: see the module docstring
    error: BaseException | None = None
    if is_root:
        plan = st["plan"]
        try:
            error = _receive(comm, plan, held, writer)
        except BaseException:
            writer.abort()
            raise
        if error is not None:
            writer.abort()
        failures = {}
        if error is not None:
            failures[comm.rank] = describe_error(error)
        for r in comm.ranks:
            if r != root:
                report = _recv_bytes(comm, r)
                if report:
                    failures[r] = report.decode(errors="replace")
        if not failures:
            try:
                writer.commit(durable)
            except BaseException as exc:  # noqa: BLE001 - reported to every rank below
                error = exc
                failures[comm.rank] = describe_error(exc)
                writer.abort()
        elif error is None:
            writer.abort()
        verdict = json.dumps({str(r): m for r, m in failures.items()}).encode()
        for r in comm.ranks:
            if r != root:
                _send_bytes(comm, r, verdict)
    else:
        error = _send_all(comm, root, st["sends"], held)
        _send_bytes(comm, root, describe_error(error).encode()[:_MAX_REPORT] if error is not None else b"")
        verdict = _recv_bytes(comm, root)
        failures = {int(r): m for r, m in json.loads(verdict).items()}
    if failures:
        if comm.size == 1 and error is not None:
            raise error
        raise CollectiveError("gather save", failures) from error
    if is_root:
        logger.info(
            "gathered %d tensors (%d bytes) from %d ranks into %s in %d groups in %.3f s",
            len(plan.tensors), plan.data_bytes, comm.size, path, len(plan.groups), time.perf_counter() - started,
        )


def _parse_assignment(data: bytes, held: dict) -> list[list[list[tuple[str, Box]]]]:
    out = []
    for group in json.loads(data):
        msgs = []
        for msg in group:
            regions = []
            for key, offsets, shape in msg:
                if key not in held or held[key].local is None:
                    raise DcpError(f"{key}: asked to send a piece this rank does not hold")
                regions.append((key, Box(tuple(offsets), tuple(shape))))
            msgs.append(regions)
        out.append(msgs)
    return out


class _HostPieces:
    """This rank's pieces as host arrays: a view of the tensor's own memory on the CPU; on a
    GPU one copy, kept while consecutive regions come from the same piece."""

    def __init__(self, held: dict):
        self.held = held
        self._key, self._array = None, None

    def region(self, key: str, box: Box) -> np.ndarray:
        """The elements of ``box`` (global coordinates) of this rank's piece of ``key``."""
        from .dist.device import host_bytes

        h = self.held[key]
        if key != self._key:
            self._key, self._array = None, None  # the previous copy goes first
            self._array = host_bytes(h.local).array
            self._key = key
        return _sub(self._array, box.relative_to(h.piece.box))


def _sub(array: np.ndarray, box: Box) -> np.ndarray:
    """A view of ``box`` of ``array`` (an array even for a 0-d one, where ``[()]`` would give a
    scalar)."""
    return array[box.slices() + (Ellipsis,)]


def _send_all(comm: Comm, root: int, sends, held: dict) -> BaseException | None:
    """Send this rank's messages, in plan order. A failure is remembered and zeros are sent in
    place of the bytes, so that the gathering rank stays in step; it is reported at the end."""
    error = None
    pieces = _HostPieces(held)
    for group in sends:
        for msg in group:
            nbytes = sum(b.volume * itemsize(held[k].piece.dtype) for k, b in msg)
            data = None
            if error is None:
                try:
                    data = _message(msg, pieces, nbytes)
                except Exception as exc:  # noqa: BLE001 - reported at the end
                    error = exc
            if data is None:
                data = np.zeros(nbytes, np.uint8)
            _send(comm, root, data)
    return error


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


def _receive(comm: Comm, plan: GatherPlan, held: dict, writer: AtomicFile) -> BaseException | None:
    """Assemble and write every group; returns the first error (after which bytes are still
    received, so that the senders stay in step, but nothing more is written)."""
    error = None
    buf = np.empty(max((g.nbytes for g in plan.groups), default=0), np.uint8)
    stage = np.empty(0, np.uint8)
    dtypes = {t.key: storage_dtype(t.dtype) for t in plan.tensors}
    pieces = _HostPieces(held)

    def place(reg: Region, gbuf: np.ndarray) -> np.ndarray:
        """The region's elements in the group buffer (a strided view)."""
        chunk = gbuf[reg.at : reg.at + reg.chunk.volume * reg.itemsize].view(dtypes[reg.key]).reshape(reg.chunk.shape)
        return _sub(chunk, reg.box.relative_to(reg.chunk))

    for g in plan.groups:
        gbuf = buf[: g.nbytes]
        for reg in g.own:
            if error is None:
                try:
                    place(reg, gbuf)[...] = pieces.region(reg.key, reg.box)
                except Exception as exc:  # noqa: BLE001 - reported at the end
                    error = exc
        for sender in sorted(g.messages):
            for msg in g.messages[sender]:
                nbytes = sum(r.nbytes for r in msg)
                reg = msg[0]
                rel = reg.box.relative_to(reg.chunk)
                if len(msg) == 1 and is_contiguous(reg.chunk.shape, rel):
                    first, _ = element_span(reg.chunk.shape, rel)
                    at = reg.at + first * reg.itemsize
                    _recv_into(comm, sender, gbuf[at : at + nbytes])  # straight into place
                    continue
                if len(stage) < nbytes:
                    stage = np.empty(nbytes, np.uint8)
                _recv_into(comm, sender, stage[:nbytes])
                at = 0
                for r in msg:
                    dest = place(r, gbuf)
                    dest[...] = stage[at : at + r.nbytes].view(dest.dtype).reshape(dest.shape)
                    at += r.nbytes
        if error is None:
            try:
                writer.write(gbuf)
            except Exception as exc:  # noqa: BLE001 - reported at the end
                error = exc
    return error


# ============================================================================ small helpers
def _send_bytes(comm: Comm, peer: int, data: bytes) -> None:
    _send(comm, peer, np.frombuffer(struct.pack("<Q", len(data)), np.uint8).copy())
    if data:
        _send(comm, peer, np.frombuffer(data, np.uint8).copy())


def _recv_bytes(comm: Comm, peer: int) -> bytes:
    head = np.zeros(8, np.uint8)
    _recv_into(comm, peer, head)
    (n,) = struct.unpack("<Q", head.tobytes())
    if n > 4 * _MAX_REPORT:
        raise CollectiveError("gather save", {peer: f"sent a report of {n} bytes; the ranks are out of step"})
    out = np.zeros(n, np.uint8)
    if n:
        _recv_into(comm, peer, out)
    return out.tobytes()


# Point to point, over a process group of the two ranks alone (a "link"). comm.PaddleComm's
# send/recv_into would do, but comm._group gives every group it makes the same gid, which
# paddle accepts once per process: the gathering rank needs a group with every sender.
# A link is made the same way (its own store, announced through the job's store), with a gid
# of its own per pair, and kept for the life of the process.
_LINKS: dict[tuple[int, int], object] = {}
_LINK_GID = 1 << 24


def _link(rank: int, peer: int):
    """(the process group of ``rank`` and ``peer``, the peer's index in it)."""
    a, b = sorted((rank, peer))
    index = 1 if rank == a else 0
    group = _LINKS.get((a, b))
    if group is not None:
        return group, index
    from paddle.base import core
    from paddle.distributed import collective

    from .dist.comm import _host

    gid = _LINK_GID + b * (b - 1) // 2 + a  # distinct for every pair
    if gid >= 1 << 31:
        raise DcpError(f"ranks {a} and {b}: too many ranks for a link of save_gathered")
    job_store = collective._default_store
    key = f"paddle_dcp/gather-link/{a}-{b}"
    timeout = int(os.environ.get("PADDLE_DCP_GROUP_TIMEOUT", "600"))
    if rank == a:
        host = _host()
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        job_store.set(key, f"{host}:{port}".encode())
        store = core.TCPStore(host, port, True, 2, timeout)
    else:
        host, port = bytes(job_store.get(key)).decode().rsplit(":", 1)
        store = core.TCPStore(host, int(port), False, 2, timeout)
    if collective._default_backend == "nccl":
        from paddle.distributed.parallel import _get_global_env

        group = core.ProcessGroupNCCL.create(store, 1 - index, 2, gid, _get_global_env().pg_timeout, 0, None)
    else:
        group = core.ProcessGroupGloo.create(store, 1 - index, 2, gid)
    _LINKS[(a, b)] = group
    return group, index


def _send(comm: Comm, peer: int, data: np.ndarray) -> None:
    """Send the uint8 array ``data`` to ``peer`` (blocks until it is taken)."""
    from .dist.device import wire_tensor

    group, index = _link(comm.rank, peer)
    group.send(wire_tensor(data), index, True).wait()


def _recv_into(comm: Comm, peer: int, out: np.ndarray) -> None:
    """Receive exactly ``len(out)`` bytes from ``peer`` into the uint8 array ``out``."""
    from .dist.device import wire_buffer

    group, index = _link(comm.rank, peer)
    with wire_buffer(out) as t:
        group.recv(t, index, True).wait()


def _open_output(path: str, header: bytes) -> AtomicFile:
    """``path`` (its directory created) written through ``path.tmp.<hex>`` beside it, the
    header first; renamed into place by its commit."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc}", path) from exc
    if os.path.isdir(path):
        raise StorageError(f"cannot write {path}: it is a directory", path)
    out = AtomicFile(path)
    try:
        out.write(header)
    except StorageError:
        out.abort()
        raise
    return out
