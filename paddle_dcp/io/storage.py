"""The storage interface the save and load protocols talk to, and the code that works on any
storage: a directory's listing, checksums of a piece's blocks, and reading byte ranges into
the buffers that need them with their checksums checked.

A storage (:class:`Storage`) lists, reads, writes and removes the files of one checkpoint
directory; :func:`paddle_dcp.io.open_storage` gives the one for a path (``io/local.py``: the
local disk). OSError becomes StorageError naming the path; bytes that disagree with the
metadata become IntegrityError naming file and key.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator, Protocol, Sequence

import numpy as np
import xxhash

from ..core.boxes import Box, c_strides, element_span
from ..core.dtypes import storage_dtype
from ..errors import FormatError, IntegrityError
from ..core.metadata import ALIGNMENT, Metadata, SavedPiece
from ..core.metadata_parse import parse_metadata
from ..core.naming import DATA_RE, METADATA_RE, TMP_MARK, TMP_RE, data_file_name, metadata_name, parse_data_name  # noqa: F401 - re-exported
from ..core.load_plan import ReadOp, Segment

logger = logging.getLogger(__name__)


def metadata_from_bytes(data: bytes, unique_id: int, source: str, lazy: bool = False) -> Metadata:
    """Checkpoint ``unique_id``'s metadata parsed and validated from ``data``, the content of
    its file ``source`` (named in errors)."""
    meta = parse_metadata(data, source=source, lazy=lazy)
    if meta.unique_id != unique_id:
        raise FormatError(f"{source} describes checkpoint {meta.unique_id}, not {unique_id}")
    return meta


@dataclass(frozen=True)
class Listing:
    """What a directory holds.

    Attributes:
        complete: ids whose metadata exists (complete checkpoints).
        data: id -> (rank, generation) of every data file present.
        temporary: names of temporary files that saves in progress or crashed left behind.
        names: every data file's name (``.distcp`` or ``.safetensors``); for a directory of
            safetensors files loaded as a checkpoint, the files it holds.
        files: the name of every file the directory holds, of any kind.
    """

    complete: frozenset[int]
    data: dict[int, frozenset[tuple[int, int]]]
    temporary: tuple[str, ...] = ()
    names: frozenset[str] = frozenset()
    files: frozenset[str] = frozenset()

    def data_names(self, unique_id: int) -> list[str]:
        """The names of ``unique_id``'s data files present, sorted."""
        return sorted(n for n in self.names if (parse_data_name(n) or (-1, -1))[1] == unique_id)

    @property
    def latest(self) -> int | None:
        return max(self.complete) if self.complete else None

    def generations(self, unique_id: int) -> dict[int, list[int]]:
        """generation -> ranks whose data file of ``unique_id`` is present."""
        out: dict[int, list[int]] = {}
        for rank, gen in sorted(self.data.get(unique_id, ())):
            out.setdefault(gen, []).append(rank)
        return out


def listing_of(names: Iterable[str]) -> Listing:
    """The listing of a directory that holds the files ``names``."""
    complete, temporary, found, every = set(), [], [], []
    data: dict[int, set[tuple[int, int]]] = {}
    for name in names:
        every.append(name)
        m = METADATA_RE.match(name)
        if m:
            complete.add(int(m.group(1)))
            continue
        parsed = parse_data_name(name)
        if parsed is not None:
            data.setdefault(parsed[1], set()).add((parsed[0], parsed[2]))
            found.append(name)
        elif TMP_RE.match(name):
            temporary.append(name)
    data_sets = {k: frozenset(v) for k, v in data.items()}
    return Listing(frozenset(complete), data_sets, tuple(sorted(temporary)), frozenset(found), frozenset(every))


# ---------------------------------------------------------------------- the interface
class DataFiles(Protocol):
    """The data files of one checkpoint opened for reading, by index into ``meta.files``;
    each file's size is checked against the metadata when it is first used."""

    meta: Metadata

    def name(self, index: int) -> str:
        """The file's full name, for messages."""

    def open(self, index: int) -> None:
        """Open file ``index`` now (IntegrityError if it is missing or of another size)."""

    def read_into(self, index: int, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``offset`` (IntegrityError if it ends first)."""

    def mapped(self, index: int, start: int, stop: int, again: bool = False) -> ContextManager[np.ndarray]:
        """The bytes [start, stop) of a file as a read-only uint8 array, valid inside the block;
        ``again``: the same range is read once more soon (a load's copy after its check)."""

    def advise(self, index: int, start: int, length: int, again: bool = False) -> None:
        """A hint that these bytes are read soon (may do nothing); ``again``: as for
        :meth:`mapped`."""

    def check_unchanged(self) -> None:
        """Raise IntegrityError when a file was written since it was opened."""

    def close(self) -> None: ...


class RangeSource(Protocol):
    """Byte ranges of named data files, read for other ranks."""

    def read_into(self, name: str, start: int, out: memoryview) -> None: ...

    def close(self) -> None: ...


class DataFileWriter(Protocol):
    """One data file being written: pieces appended at ``alignment`` boundaries, absent under
    its final name until :meth:`commit`."""

    offset: int  # bytes written so far

    def write(self, data: memoryview, keep=None, seed: int = 0) -> list[int]:
        """Append one piece (``keep`` stays alive until it is written); returns its block
        checksums."""

    def commit(self, durable: bool = False) -> int:
        """Make the file appear, whole, under its final name; returns its size."""

    def abort(self) -> None:
        """Drop the file (never raises)."""


class Storage(Protocol):
    """The files of one checkpoint directory ``path``: the save and load code lists, reads,
    writes and removes them only through this."""

    path: str
    # every rank sees the same files (object storage): one rank's listing and cleaning serve
    # all. A local path may be a shared file system or a node-local disk: False.
    seen_by_all: bool

    def create(self) -> None:
        """Make the directory, where the storage has directories (a save calls it first)."""

    def list_checkpoints(self) -> Listing:
        """What the directory holds (a missing directory is an empty listing)."""

    def size(self, name: str) -> int | None:
        """The size in bytes of file ``name``, or None when the directory holds no file of that
        name (a subdirectory is not a file)."""

    def read_metadata(self, unique_id: int, lazy: bool = False) -> Metadata:
        """Read and validate checkpoint ``unique_id``'s metadata (:func:`metadata_from_bytes`
        of :meth:`metadata_bytes`)."""

    def metadata_bytes(self, unique_id: int) -> bytes:
        """The content of checkpoint ``unique_id``'s metadata file, unparsed (StorageError when
        there is none; FormatError over the size limit)."""

    def open_files(self, meta: Metadata) -> DataFiles:
        """The data files ``meta`` names, opened for reading."""

    def range_reader(self) -> RangeSource:
        """A reader of byte ranges of data files by name."""

    def write_atomic(self, name: str, data: bytes, durable: bool = False) -> None:
        """Write ``data`` as file ``name``: it appears whole or not at all."""

    def read_file(self, name: str) -> bytes | None:
        """The whole content of a small file ``name`` (e.g. a manager's manifest); None when
        it does not exist."""

    def data_writer(
        self, name: str, block_bytes: int, depth: int = 2, header: bytes = b"", alignment: int = ALIGNMENT
    ) -> DataFileWriter:
        """A streaming writer of data file ``name`` (``header`` first, then the pieces)."""

    def remove(self, names: Iterable[str]) -> list[str]:
        """Remove the files ``names`` (missing ones skipped); returns the names removed."""

    def resolve(self, name: str) -> str:
        """The full name of file ``name`` (FormatError when it would leave the directory)."""


def read_range(store: Storage, name: str, start: int, length: int) -> bytes:
    """Bytes [start, start + length) of file ``name`` (a small read: an index, a header)."""
    out = bytearray(length)
    reader = store.range_reader()
    try:
        reader.read_into(name, start, memoryview(out))
    finally:
        reader.close()
    return bytes(out)


def list_files(store: Storage, temporary: bool = True) -> Listing:
    """``store.list_checkpoints()``; without ``temporary`` a storage that lists its temporary
    files at a cost of their own (object storage: a LIST of the open multipart uploads) may
    leave them out of the listing."""
    if not temporary and getattr(store, "lists_temporary_apart", False):
        return store.list_checkpoints(temporary=False)  # type: ignore[call-arg]
    return store.list_checkpoints()


# ---------------------------------------------------------------------- cleaning up
def temporary_names(listing: Listing, unique_id: int | None = None, rank: int | None = None) -> list[str]:
    """The temporary files of crashed saves in ``listing``: all of them, or those of one id
    (and, with ``rank``, only that rank's data files; the metadata's when ``rank`` is the
    coordinator's job: pass rank=-1)."""
    names = []
    for name in listing.temporary:
        m = TMP_RE.match(name)
        if m is None:  # a listing's temporary names all match
            continue
        owner = int(m.group(1)) if m.group(1) is not None else -1
        if unique_id is not None and int(m.group(2)) != unique_id:
            continue
        if rank is not None and owner != rank:
            continue
        names.append(name)
    return names


def remove_temporary(store: Storage, unique_id: int | None = None, rank: int | None = None) -> list[str]:
    """Remove the :func:`temporary_names` of ``store``'s listing. Returns the names removed."""
    return store.remove(temporary_names(store.list_checkpoints(), unique_id, rank))


def remove_data(
    store: Storage, unique_id: int, rank: int | None, keep_generation: int | None = None, listing: Listing | None = None
) -> list[str]:
    """Remove ``rank``'s (None: every rank's) data files of ``unique_id`` but the generation
    ``keep_generation`` (``listing``: the store's, when the caller has one; else it is listed)."""
    listing = listing or store.list_checkpoints()
    names = []
    for name in listing.data_names(unique_id):
        writer, _, generation = parse_data_name(name) or (-1, -1, -1)
        if (rank is None or writer == rank) and generation != keep_generation:
            names.append(name)
    return store.remove(names)


def remove_incomplete(store: Storage) -> list[str]:
    """Remove the data files of ids that have no metadata in ``store``. (On node-local disks a
    node without the metadata holds complete checkpoints' files too: only for shared storage.)"""
    listing = store.list_checkpoints()
    names = [n for uid in sorted(listing.data) if uid not in listing.complete for n in listing.data_names(uid)]
    return store.remove(names)


# ---------------------------------------------------------------------- checksums
_MASK64 = (1 << 64) - 1


def piece_seed(key: str, dtype: str, offsets, shape) -> int:
    """The checksum seed of a piece: the xxh3_64 of its identity (key, dtype, global offset,
    local shape), so a block's checksum holds only for these bytes at this place: a piece
    moved, relabelled or reinterpreted in an edited metadata fails its checksums."""
    ident = f"{key}\0{dtype}\0{','.join(map(str, offsets))}\0{','.join(map(str, shape))}"
    return xxhash.xxh3_64_intdigest(ident.encode())


def checksum(buf, seed: int = 0) -> int:
    return xxhash.xxh3_64_intdigest(buf, seed=seed)


def block_checksum(buf, seed: int, index: int) -> int:
    """The checksum of block ``index`` of a piece whose seed is ``seed``."""
    return xxhash.xxh3_64_intdigest(buf, seed=(seed + index) & _MASK64)


def blocks(start: int, stop: int, piece_start: int, block_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(index in the piece, offset, length) of every checksum block that bytes [start, stop)
    of a piece starting at ``piece_start`` cover (``start`` on a block boundary); an empty
    range is one empty block."""
    first = (start - piece_start) // block_bytes
    for k, at in enumerate(range(start, max(stop, start + 1), block_bytes)):
        yield first + k, at, min(block_bytes, stop - at)


def block_checksums(buf: memoryview, block_bytes: int, seed: int = 0) -> list[int]:
    """The checksum of every ``block_bytes`` block of a piece's bytes ``buf`` (one for an
    empty buffer)."""
    return [block_checksum(buf[at : at + n], seed, k) for k, at, n in blocks(0, len(buf), 0, block_bytes)]


def as_bytes(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    return array.reshape(-1).view(np.uint8).data


# ---------------------------------------------------------------------- reading
def seed_of(meta: Metadata, piece: SavedPiece) -> int:
    return piece_seed(piece.key, meta.tensors[piece.key].dtype, piece.box.offsets, piece.box.shape)


def segment_blocks(meta: Metadata, seg: Segment) -> list[tuple[int, int, int, int]]:
    """(file offset, length, seed, expected checksum) of every checksum block a segment covers."""
    piece = seg.piece
    sums = meta.tensors[piece.key].pieces.checksums
    seed = seed_of(meta, piece)
    return [
        (at, n, (seed + k) & _MASK64, int(sums[piece.first_block + k]))
        for k, at, n in blocks(seg.start, seg.stop, piece.byte_offset, meta.block_bytes)
    ]


def piece_view(buf: np.ndarray, buf_start: int, piece: SavedPiece, region: Box, dtype: np.dtype) -> np.ndarray:
    """A strided view of ``region`` (in_saved) of ``piece`` inside ``buf``, which holds the
    file's bytes from offset ``buf_start`` on. numpy checks that the view stays inside."""
    isz = dtype.itemsize
    first = element_span(piece.box.shape, region)[0] if region.ndim else 0
    strides = tuple(s * isz for s in c_strides(piece.box.shape))
    return np.ndarray(
        shape=region.shape,
        dtype=dtype,
        buffer=buf,
        offset=piece.byte_offset + first * isz - buf_start,
        strides=strides,
    )


def verify_segment(meta: Metadata, files: DataFiles, file: int, seg: Segment, data: memoryview) -> None:
    """Check the checksums of the whole blocks of ``seg`` held in ``data``."""
    piece = seg.piece
    sums = meta.tensors[piece.key].pieces.checksums
    seed = seed_of(meta, piece)
    for k, at, n in blocks(seg.start, seg.start + len(data), piece.byte_offset, meta.block_bytes):
        rel = at - seg.start
        if block_checksum(data[rel : rel + n], seed, k) != int(sums[piece.first_block + k]):
            raise IntegrityError(
                f"{files.name(file)}: bytes [{at}, {at + n}) of tensor "
                f"{piece.key!r} (piece at offset {piece.box.offsets}) fail their checksum: the "
                f"file is damaged or does not belong to this metadata"
            )


def read_ahead(files: DataFiles, ops: Sequence, window: int = 128 << 20, again: bool = False) -> Iterator:
    """Yield ``ops`` in order, having asked the kernel to start reading the byte ranges of the
    next ones (:meth:`DataFiles.advise`) while the current one is hashed or copied: a
    checkpoint on disk rather than in the page cache is then read in large requests ahead of
    use, not a page fault at a time. At most ``window`` bytes are asked for ahead of the op
    being worked on; pages already cached cost a lookup. ``again``: the ops are read once more
    soon (see :meth:`DataFiles.mapped`)."""
    advised = done = 0  # bytes of ops asked for / finished
    following = 0  # first op not asked for yet
    for i, op in enumerate(ops):
        while following < len(ops) and (following <= i or advised - done < window):
            nxt = ops[following]
            files.advise(nxt.file, nxt.start, nxt.stop - nxt.start, again)
            advised += nxt.stop - nxt.start
            following += 1
        yield op
        done += op.stop - op.start


class Staging:
    """One reusable host buffer for reads that cannot land in place (bounded by the plan's
    largest read)."""

    def __init__(self):
        self.buf = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if len(self.buf) < nbytes:
            self.buf = np.empty(nbytes, dtype=np.uint8)
        return self.buf[:nbytes]


def execute_op(
    op: ReadOp,
    files: DataFiles,
    targets: Sequence[np.ndarray],
    staging: Staging,
    verify: bool = True,
    fetch: Callable[[ReadOp, memoryview], None] | None = None,
    check_only: bool = False,
    again: bool = False,
) -> None:
    """Carry out one read op: check its blocks' checksums, then copy its regions into
    ``targets`` (host arrays of the target pieces, in storage dtype).

    Bytes of a local file are mapped, checked and copied straight out of the page cache (one
    copy, of the needed bytes only). Bytes from another rank (``fetch``) land in the target
    for a direct op, else in ``staging``.

    Args:
        fetch: fills a buffer with the op's bytes instead of reading the file (bytes received
            from another rank).
        check_only: only check the checksums (a load checks every block before it changes any
            target, so a damaged file leaves the state dict as it was).
        again: the op is carried out once more soon (the copy after a check_only pass).
    """
    meta = files.meta
    if fetch is None:
        with files.mapped(op.file, op.start, op.stop, again) as buf:
            _verify_and_copy(op, files, targets, buf, verify, check_only)
            del buf  # no view may outlive the mapping
        return
    if op.direct:
        seg = op.segments[0]
        copy = seg.copies[0]
        target = targets[copy.target]
        first = element_span(target.shape, copy.region_in_target)[0] if target.ndim else 0
        dest = as_bytes(target.reshape(-1)[first : first + copy.region_in_target.volume])
        fetch(op, dest)
        if verify:
            verify_segment(meta, files, op.file, seg, dest)
        return
    buf = staging.get(op.nbytes)
    fetch(op, buf.data)
    _verify_and_copy(op, files, targets, buf, verify, check_only)


def _verify_and_copy(op: ReadOp, files: DataFiles, targets, buf: np.ndarray, verify: bool, check_only: bool) -> None:
    meta = files.meta
    if verify or check_only:
        for seg in op.segments:
            verify_segment(meta, files, op.file, seg, buf[seg.start - op.start : seg.stop - op.start].data)
    if check_only:
        return
    for seg in op.segments:
        dtype = storage_dtype(meta.tensors[seg.piece.key].dtype)
        for c in seg.copies:
            targets[c.target][c.region_in_target.slices()] = piece_view(buf, op.start, seg.piece, c.region_in_saved, dtype)


def execute_reads(
    ops: Sequence[ReadOp],
    files: DataFiles,
    targets: Sequence[np.ndarray],
    verify: bool = True,
    staging: Staging | None = None,
) -> int:
    """Carry out read ops from local files (see :func:`execute_op`); returns bytes read."""
    staging = staging or Staging()
    for op in ops:
        execute_op(op, files, targets, staging, verify)
    return sum(op.nbytes for op in ops)
