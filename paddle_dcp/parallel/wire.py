"""Bytes that travel between ranks: the framing of every message, and compact, versioned
encodings of the planning messages.

Framing, the one way a message of any length crosses ranks:
  * in a collective, every rank's message is padded to the longest one with an 8-byte length
    in front (:func:`pad` / :func:`unpad`);
  * between two ranks (:func:`send_message` / :func:`recv_message`), a 16-byte header (status,
    length) comes first, then the bytes; a sender that cannot answer sends the status FAILED
    and no bytes, so the pair stays in step (its error reaches every rank at the step's
    agreement, :mod:`paddle_dcp.parallel.agree`).

Nothing here unpickles. Each message starts with a 4-byte tag; lengths are little-endian.
The coordinator caches the parse of summary headers, which are equal across the ranks of a
pipeline stage, so a save at thousands of ranks parses each distinct layout once.
"""
from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Sequence

import numpy as np
import xxhash

from ..errors import CollectiveError, FormatError
from ..core.job_layout import JobLayout, Mesh
from ..core.metadata import _MAX_INT
from ..core.metafile_layout import deflate, inflate, most_inflated
from ..core.save_plan import SaveSummary
from ..core.json_text import parse_json

_SUMMARY = b"DCS1"
_SUMMARY_ROWS = b"DCS2"  # a summary with several rows for some leaf: a leaf column leads the boxes
# the same two with 4-byte box values, sent when every value fits: half the bytes to inflate,
# and the coordinator's table of every rank's rows half as large
_SUMMARY_32 = b"DCS3"
_SUMMARY_ROWS_32 = b"DCS4"
_LAYOUTS = {_SUMMARY: (0, "<i8"), _SUMMARY_ROWS: (1, "<i8"), _SUMMARY_32: (0, "<i4"), _SUMMARY_ROWS_32: (1, "<i4")}
_TAG_OF = {layout: tag for tag, layout in _LAYOUTS.items()}  # (leading leaf columns, dtype) -> tag
_REPORT = b"DCR1"
_ASSIGN = b"DCA1"
_CHUNKS = b"DCK1"


def encode_summary(summary: SaveSummary) -> bytes:
    """A rank's summary: its header (outline, tensor keys, derived pairs as JSON; dtypes and
    global shapes as integers), compressed, then its boxes."""
    doc = {"o": summary.outline, "k": list(summary.keys)}
    if summary.derived:  # absent otherwise: a save without derived tensors sends what it did
        doc["v"] = [list(pair) for pair in summary.derived]
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    n, width = summary.shapes.shape
    ints = np.concatenate([summary.dtype_codes, summary.ndims, summary.shapes.reshape(-1)]).astype("<i8")
    hz = zlib.compress(struct.pack("<QQQ", len(text), n, width) + text + ints.tobytes(), 6)
    boxes = summary.boxes if summary.row_leaf is None else np.column_stack([summary.row_leaf, summary.boxes])
    narrow = boxes.size == 0 or (int(boxes.min()) >= -(2**31) and int(boxes.max()) < 2**31)
    dtype = "<i4" if narrow else "<i8"
    tag = _TAG_OF[int(summary.row_leaf is not None), dtype]
    boxes = np.ascontiguousarray(boxes, dtype=dtype)
    bz = deflate(boxes.tobytes())  # bounded: a decode refuses boxes that inflate further
    return tag + struct.pack("<QQQ", len(hz), boxes.shape[0], boxes.shape[1]) + hz + bz


def decode_summary(data: bytes, rank: int, cache: dict | None = None) -> SaveSummary:
    """Parse a rank's summary; ``cache`` (shared across calls) keeps parsed headers: the ranks
    of a job hold few distinct layouts, each parsed once."""
    return decode_summaries([rank], [data], cache)[0]


def decode_summaries(ranks: Sequence[int], blobs: Sequence[bytes], cache: dict | None = None) -> list[SaveSummary]:
    """Parse every rank's summary (as :func:`decode_summary`). When their box rows are all as
    wide, they are decoded into one table, each summary's boxes a view of its rows: the
    coordinator of a large save holds one array of every held row, which the plan takes as it
    is (:func:`paddle_dcp.core.ragged.joined`), instead of one per rank and then their join.
    The table holds int32 values when every rank sent them so, int64 otherwise."""
    cache = {} if cache is None else cache
    frames = [_frame(b, r) for r, b in zip(ranks, blobs)]
    widths = {width - lead for _, _, width, lead, _ in frames}
    narrow = all(dtype == "<i4" for *_, dtype in frames)
    table = np.empty((sum(f[1] for f in frames), widths.pop()), np.int32 if narrow else np.int64) if len(widths) == 1 else None
    out, at = [], 0
    for r, data, (hlen, rows, width, lead, dtype) in zip(ranks, blobs, frames):
        hz = bytes(data[28 : 28 + hlen])
        hid = xxhash.xxh3_128_digest(hz)
        parsed = cache.get(hid)
        if parsed is None:
            parsed = cache[hid] = _header(zlib.decompress(hz), r)
        size = np.dtype(dtype).itemsize
        raw = inflate(data[28 + hlen :], rows * width * size, f"rank {r}: a save summary's boxes")
        rows_of = np.frombuffer(raw, dtype=dtype).reshape(rows, width)
        boxes = rows_of[:, lead:]
        if table is not None:
            boxes = table[at : at + rows]
            boxes[:] = rows_of[:, lead:]
            boxes.flags.writeable = False  # read only, as a single decode's are
            at += rows
        elif dtype != "<i8":  # rows apart from any table are int64, as before
            boxes = boxes.astype(np.int64)
        row_leaf = rows_of[:, 0].astype(np.int64) if lead else None
        outline, keys, codes, shapes, ndims, derived = parsed
        out.append(SaveSummary(r, outline, keys, codes, shapes, ndims, boxes, header_id=hid, row_leaf=row_leaf,
                               derived=derived))
    return out


def _frame(data: bytes, rank: int) -> tuple[int, int, int, int, str]:
    """(header bytes, rows, width, leading leaf columns, box value dtype) of a summary, checked
    against its size before anything is allocated for its rows."""
    if len(data) < 28 or bytes(data[:4]) not in _LAYOUTS:
        raise FormatError(f"rank {rank}: not a save summary")
    hlen, rows, width = struct.unpack_from("<QQQ", data, 4)
    lead, dtype = _LAYOUTS[bytes(data[:4])]
    packed = len(data) - 28 - hlen  # the boxes cannot claim more than these bytes inflate to
    if packed < 0 or (width - lead) % 2 != 1 or rows * width * np.dtype(dtype).itemsize > most_inflated(packed):
        raise FormatError(f"rank {rank}: a save summary's sizes do not add up")
    return hlen, rows, width, lead, dtype


def _header(raw: bytes, rank: int) -> tuple:
    """(outline, keys, dtype codes, shapes, ndims, derived pairs) of a summary's header."""
    text_len, n, width = struct.unpack_from("<QQQ", raw, 0)
    if 24 + text_len + 8 * (2 * n + n * width) != len(raw):
        raise FormatError(f"rank {rank}: a save summary's header does not add up")
    doc = parse_json(raw[24 : 24 + text_len], f"rank {rank}", "a save summary's header")
    ints = np.frombuffer(raw, dtype="<i8", offset=24 + text_len).astype(np.int64)
    ndims, shapes = ints[n : 2 * n], ints[2 * n :].reshape(n, width)
    if width > 64 or (n and (ndims.min() < 0 or ndims.max() > width)) or (
        shapes.size and (shapes.min() < 0 or shapes.max() > _MAX_INT)
    ):
        raise FormatError(f"rank {rank}: a save summary's shapes are out of range (at most 64 dims, entries in [0, 2**62])")
    derived = tuple((str(m), str(p)) for m, p in doc.get("v", ()))
    return doc["o"], tuple(doc["k"]), ints[:n], shapes, ndims, derived


def encode_assignment(writes: np.ndarray, leaves: int) -> bytes:
    """Which of a rank's ``leaves`` it writes, as a bit mask."""
    mask = np.zeros(leaves, dtype=bool)
    mask[np.asarray(writes, dtype=np.int64)] = True
    return _ASSIGN + struct.pack("<Q", leaves) + np.packbits(mask).tobytes()


def decode_assignment(data: bytes) -> np.ndarray:
    if data[:4] != _ASSIGN:
        raise FormatError("not an assignment message")
    (leaves,) = struct.unpack_from("<Q", data, 4)
    mask = np.unpackbits(np.frombuffer(data, dtype=np.uint8, offset=12), count=leaves).astype(bool)
    return np.flatnonzero(mask)


def encode_report(file_bytes: int, checksums: np.ndarray) -> bytes:
    sums = np.ascontiguousarray(checksums, dtype="<u8")
    return _REPORT + struct.pack("<QQ", file_bytes, len(sums)) + sums.tobytes()


def decode_report(data: bytes, rank: int) -> tuple[int, np.ndarray]:
    if data[:4] != _REPORT:
        raise FormatError(f"rank {rank}: not a write report")
    file_bytes, n = struct.unpack_from("<QQ", data, 4)
    sums = np.frombuffer(data, dtype="<u8", offset=20, count=n)
    return file_bytes, sums


def encode_chunks(numbers: Sequence[int], chunks: Sequence[bytes | memoryview]) -> bytes:
    """Integers and byte strings in one message (byte ranges asked for, and their bytes)."""
    lengths = np.array([len(c) for c in chunks], dtype="<u8")
    return b"".join([_CHUNKS, struct.pack("<QQ", len(numbers), len(chunks)),
                     np.asarray(numbers, dtype="<i8").tobytes(), lengths.tobytes(), *chunks])


def decode_chunks(data: bytes) -> tuple[list[int], list[bytes]]:
    """:func:`encode_chunks`' integers and byte strings, every length checked."""
    data = bytes(data)
    if data[:4] != _CHUNKS or len(data) < 20:
        raise FormatError("not a message of byte ranges")
    n, k = struct.unpack_from("<QQ", data, 4)
    at = 20 + 8 * (n + k)
    if n > len(data) or k > len(data) or at > len(data):
        raise FormatError("a message of byte ranges is truncated")
    numbers = np.frombuffer(data, dtype="<i8", count=n, offset=20).tolist()
    lengths = np.frombuffer(data, dtype="<u8", count=k, offset=20 + 8 * n).tolist()
    if at + sum(lengths) != len(data):
        raise FormatError("a message of byte ranges does not add up")
    chunks = []
    for length in lengths:
        chunks.append(data[at : at + length])
        at += length
    return numbers, chunks


def encode_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def decode_json(data: bytes, source: str = "a peer's message"):
    return parse_json(data, source) if data else None


def rle(values: Sequence[int]) -> list[list[int]]:
    """Sorted ints as [first, last] runs: node-local file sets stay a few bytes long."""
    runs: list[list[int]] = []
    for v in sorted(set(int(x) for x in values)):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return runs


def from_runs(runs) -> set[int]:
    """The ints of the [first, last] ``runs`` (:func:`rle`'s inverse)."""
    return {v for first, last in runs for v in range(int(first), int(last) + 1)}


_MAX_PACKED_INTS = 1 << 24  # ints a packing of ints may stand for, and bytes a packing of names


def _pack(raw: bytes) -> str:
    return base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def _unpack(text: str, what: str, limit: int) -> bytes:
    """The bytes :func:`_pack` packed (at most ``limit``); FormatError naming ``what`` when
    ``text`` is not such a packing."""
    try:
        d = zlib.decompressobj()
        raw = d.decompress(base64.b64decode(text.encode("ascii"), validate=True), limit)
        if d.unconsumed_tail or not d.eof:
            raise ValueError("not a whole packing, or longer than a message holds")
    except (ValueError, TypeError, AttributeError, zlib.error) as exc:
        raise FormatError(f"a peer's packed {what} do not unpack: {exc}") from None
    return raw


def pack_ints(values: Sequence[int]) -> str:
    """Ints as text of a few bytes when they follow a pattern (consecutive ranks, equal
    sizes): their differences, deflated, in base64."""
    return _pack(np.diff(np.asarray(values, dtype="<i8"), prepend=np.int64(0)).tobytes())


def unpack_ints(text: str) -> list[int]:
    """The ints :func:`pack_ints` packed; FormatError when ``text`` is not such a packing."""
    raw = _unpack(text, "ints", 8 * _MAX_PACKED_INTS)
    if len(raw) % 8:
        raise FormatError("a peer's packed ints do not unpack: not a whole list of ints")
    return np.cumsum(np.frombuffer(raw, dtype="<i8")).tolist()


def pack_names(names: Sequence[str]) -> str:
    """Names (of a step's data files: alike but for a rank) as a few bytes of text."""
    return _pack("\n".join(names).encode())


def unpack_names(text: str) -> list[str]:
    """The names :func:`pack_names` packed."""
    raw = _unpack(text, "names", _MAX_PACKED_INTS)
    try:
        return raw.decode().split("\n") if raw else []
    except UnicodeDecodeError as exc:
        raise FormatError(f"a peer's packed names do not unpack: {exc}") from None


def encode_layout(layout: JobLayout) -> dict:
    """A job's layout as JSON values whose rank lists are packed (:func:`pack_ints`): a few
    hundred bytes for thousands of ranks on regular nodes and meshes."""
    meshes = None if layout.meshes is None else [
        [list(m.shape), pack_ints(m.process_ids), list(m.dim_names)] for m in layout.meshes
    ]
    return {"w": layout.world_size, "m": meshes, "n": None if layout.nodes is None else pack_nodes(layout.nodes)}


def pack_nodes(nodes: Sequence[Sequence[int]]) -> list[str]:
    """The ranks of each node, packed (:func:`pack_ints`): their counts, then every rank."""
    return [pack_ints([len(n) for n in nodes]), pack_ints([r for n in nodes for r in n])]


def unpack_nodes(packed: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The nodes :func:`pack_nodes` packed."""
    lengths, flat = (unpack_ints(t) for t in packed)
    if any(n < 0 for n in lengths) or sum(lengths) != len(flat):
        raise FormatError(f"a peer's nodes do not add up: {len(lengths)} nodes, {len(flat)} ranks")
    starts = np.cumsum([0] + lengths).tolist()
    return tuple(tuple(flat[a:b]) for a, b in zip(starts, starts[1:]))


def decode_layout(doc: dict) -> JobLayout:
    """The layout :func:`encode_layout` encoded."""
    try:
        meshes = None if doc["m"] is None else tuple(
            Mesh(tuple(int(x) for x in shape), tuple(unpack_ints(ids)), tuple(str(n) for n in names))
            for shape, ids, names in doc["m"]
        )
        return JobLayout(int(doc["w"]), meshes, None if doc["n"] is None else unpack_nodes(doc["n"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"a peer's layout does not decode: {exc}") from None


# ------------------------------------------------------------------ framing
def pad(data: bytes, width: int) -> np.ndarray:
    """``data`` as a collective's message of ``width`` bytes: its length, then its bytes."""
    out = np.zeros(width + 8, dtype=np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(data)), dtype=np.uint8)
    out[8 : 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return out


def unpad(buf: np.ndarray) -> bytes:
    buf = np.asarray(buf, dtype=np.uint8)
    (n,) = struct.unpack("<Q", buf[:8].tobytes())
    if n > len(buf) - 8:
        raise CollectiveError("message", {-1: "a message is longer than its buffer"})
    return buf[8 : 8 + n].tobytes()


OK, FAILED = 0, 1
MAX_MESSAGE = 1 << 30  # bytes of one message between two ranks


def send_header(comm, peer: int, status: int, length: int) -> None:
    comm.send(peer, np.array([status, length], dtype="<i8").view(np.uint8))


def recv_header(comm, peer: int) -> tuple[int, int]:
    buf = np.zeros(16, dtype=np.uint8)
    comm.recv_into(peer, buf)
    status, length = (int(x) for x in buf.view("<i8"))
    if status not in (OK, FAILED) or not 0 <= length <= MAX_MESSAGE or (status == FAILED and length):
        raise CollectiveError("message", {peer: f"sent a malformed message header ({status}, {length})"})
    return status, length


def send_message(comm, peer: int, data: bytes | np.ndarray, status: int = OK) -> None:
    """Send ``data`` to ``peer`` over ``comm``'s point to point (``send`` / ``recv_into``)."""
    arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else data
    send_header(comm, peer, status, len(arr))
    if len(arr):
        comm.send(peer, arr)


def send_failed(comm, peer: int) -> None:
    """Tell ``peer``, which waits for a message, that this rank cannot answer: the pair stays in
    step, and this rank's error reaches every rank at the step's agreement, not here."""
    send_header(comm, peer, FAILED, 0)


def recv_message(comm, peer: int) -> bytes | None:
    """The next message from ``peer``; None when the peer could not answer (it sent FAILED,
    and reports its error at the step's agreement)."""
    status, length = recv_header(comm, peer)
    if status == FAILED:
        return None
    buf = np.zeros(length, dtype=np.uint8)
    if length:
        comm.recv_into(peer, buf)
    return buf.tobytes()
