"""Files on disk: listing checkpoints, writing data files and metadata atomically, and reading
byte ranges straight into the buffers that need them, with checksums checked.

Only this module touches the checkpoint directory. OSError becomes StorageError naming the
path; bytes that disagree with the metadata become IntegrityError naming file and key.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import xxhash

from ..core.boxes import Box, c_strides, element_span
from ..core.dtypes import storage_dtype
from ..errors import FormatError, IntegrityError, StorageError
from ..core.metadata import ALIGNMENT, MAX_METADATA_BYTES, Metadata, SavedPiece, check_file_name
from ..core.naming import DATA_RE, METADATA_RE, TMP_MARK, TMP_RE, data_file_name, metadata_name, parse_data_name  # noqa: F401 - re-exported
from ..core.load_plan import ReadOp, Segment

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Listing:
    """What a directory holds.

    Attributes:
        complete: ids whose metadata exists (complete checkpoints).
        data: id -> (rank, generation) of every data file present.
        temporary: names of temporary files that saves in progress or crashed left behind.
        names: every data file's name (``.distcp`` or ``.safetensors``); for a directory of
            safetensors files loaded as a checkpoint, the files it holds.
    """

    complete: frozenset[int]
    data: dict[int, frozenset[tuple[int, int]]]
    temporary: tuple[str, ...] = ()
    names: frozenset[str] = frozenset()

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


def list_checkpoints(path: str) -> Listing:
    """Scan ``path``; a missing directory is an empty listing."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return Listing(frozenset(), {})
    except OSError as exc:
        raise StorageError(f"cannot list checkpoint directory {path}: {exc}", path) from exc
    complete, data, temporary, found = set(), {}, [], []
    for name in names:
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
    return Listing(frozenset(complete), data_sets, tuple(sorted(temporary)), frozenset(found))


def remove_files(path: str, names) -> list[str]:
    """Remove ``path/name`` for each name (missing ones skipped); returns the names removed."""
    removed = []
    for name in names:
        try:
            os.unlink(os.path.join(path, name))
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            full = os.path.join(path, name)
            raise StorageError(f"cannot remove {full}: {exc}", full) from exc
    return removed


def remove_temporary(path: str, unique_id: int | None = None, rank: int | None = None) -> list[str]:
    """Remove temporary files of crashed saves: all of them, or those of one id (and, with
    ``rank``, only that rank's data files; the metadata's when ``rank`` is the coordinator's
    job: pass rank=-1). Returns the names removed."""
    names = []
    for name in list_checkpoints(path).temporary:
        m = TMP_RE.match(name)
        owner = int(m.group(1)) if m.group(1) is not None else -1
        if unique_id is not None and int(m.group(2)) != unique_id:
            continue
        if rank is not None and owner != rank:
            continue
        names.append(name)
    return remove_files(path, names)


def remove_data(path: str, unique_id: int, rank: int, keep_generation: int | None = None) -> list[str]:
    """Remove ``rank``'s data files of ``unique_id`` but the generation ``keep_generation``."""
    listing = list_checkpoints(path)
    names = []
    for name in listing.data_names(unique_id):
        writer, _, generation = parse_data_name(name)
        if writer == rank and generation != keep_generation:
            names.append(name)
    return remove_files(path, names)


def remove_incomplete(path: str) -> list[str]:
    """Remove the data files of ids that have no metadata in ``path``. (On node-local disks a
    node without the metadata holds complete checkpoints' files too: only for shared storage.)"""
    listing = list_checkpoints(path)
    names = [n for uid in sorted(listing.data) if uid not in listing.complete for n in listing.data_names(uid)]
    return remove_files(path, names)


def inside(path: str, name: str) -> str:
    """``path/name`` for a validated plain ``name`` that resolves inside ``path``."""
    check_file_name(name)
    full = os.path.join(path, name)
    real_dir = os.path.realpath(path)
    real = os.path.realpath(full)
    if os.path.dirname(real) != real_dir:
        raise FormatError(f"{full} resolves to {real}, outside the checkpoint directory {real_dir}")
    return full


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, name: str, data: bytes, durable: bool = False) -> None:
    """Write ``data`` to ``path/name`` through a temporary file and a rename."""
    final = os.path.join(path, name)
    tmp = f"{final}{TMP_MARK}{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if durable:
            _fsync_dir(path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise StorageError(f"cannot write {final}: {exc}", final) from exc


def read_metadata(path: str, unique_id: int, lazy: bool = False) -> Metadata:
    """Read and validate ``path/{unique_id}.metadata`` (tensor entries on first use when
    ``lazy``)."""
    full = os.path.join(path, metadata_name(unique_id))
    try:
        with open(full, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_METADATA_BYTES:
                raise FormatError(f"{full}: {size} bytes is over the {MAX_METADATA_BYTES}-byte limit for metadata")
            data = f.read()
    except FileNotFoundError:
        raise StorageError(f"checkpoint {unique_id} has no metadata file {full}", full) from None
    except OSError as exc:
        raise StorageError(f"cannot read {full}: {exc}", full) from exc
    meta = Metadata.from_json(data, source=full, lazy=lazy)
    if meta.unique_id != unique_id:
        raise FormatError(f"{full} describes checkpoint {meta.unique_id}, not {unique_id}")
    return meta


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


def block_checksums(buf: memoryview, block_bytes: int, seed: int = 0) -> list[int]:
    """The checksum of every ``block_bytes`` block of a piece's bytes ``buf`` (one for an
    empty buffer)."""
    n = len(buf)
    if n == 0:
        return [block_checksum(b"", seed, 0)]
    return [block_checksum(buf[i : i + block_bytes], seed, k) for k, i in enumerate(range(0, n, block_bytes))]


def as_bytes(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    return memoryview(array.reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------- writing
class DataWriter:
    """Writes one rank's data file: pieces back to back at ALIGNMENT boundaries, under a
    temporary name until :meth:`commit`.

    The bytes go to the file from a thread of their own while the caller prepares the next
    piece (its checksums; on a GPU, its copy to host memory): at most ``depth`` pieces wait to
    be written, and their host memory is kept alive until they are. ``header`` (a safetensors
    header) is written first, and the pieces follow it at multiples of ``alignment`` bytes.
    """

    def __init__(
        self, path: str, name: str, block_bytes: int, depth: int = 2, header: bytes = b"", alignment: int = ALIGNMENT
    ):
        self.final = os.path.join(path, name)
        self.tmp = f"{self.final}{TMP_MARK}{secrets.token_hex(4)}"
        self.block_bytes = block_bytes
        self.offset = 0
        self.depth = depth
        self.alignment = alignment
        self._pending: deque[Future] = deque()
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot create {self.tmp}: {exc}", self.tmp) from exc
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paddle_dcp-write")
        if header:
            self._write_at(memoryview(header), 0, None)
            self.offset = len(header)

    def write(self, data: memoryview, keep=None, seed: int = 0) -> list[int]:
        """Append one piece (bytes in C order; ``keep`` is whatever must stay alive until the
        bytes are written; ``seed`` its :func:`piece_seed`); returns its block checksums."""
        view = data.cast("B") if data.format != "B" else data
        start = self.offset + (-self.offset % self.alignment)  # the gap stays zeros (sparse)
        sums = block_checksums(view, self.block_bytes, seed) if self.block_bytes else []
        self._pending.append(self._pool.submit(self._write_at, view, start, keep))
        self.offset = start + len(view)
        while len(self._pending) > self.depth:
            self._pending.popleft().result()
        return sums

    def _write_at(self, view: memoryview, offset: int, keep) -> None:
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as exc:
            raise StorageError(f"cannot write {self.tmp}: {exc}", self.tmp) from exc

    def _drain(self) -> None:
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self._pool.shutdown(wait=True)

    def commit(self, durable: bool = False) -> int:
        """Close and rename into place (with ``durable``: after an fsync of the file, and with
        one of the directory after); returns the file's size."""
        self._drain()
        try:
            os.ftruncate(self.fd, self.offset)
            if durable:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.final)
            if durable:
                _fsync_dir(os.path.dirname(self.final) or ".")
        except OSError as exc:
            raise StorageError(f"cannot commit {self.final}: {exc}", self.final) from exc
        return self.offset

    def abort(self) -> None:
        try:
            self._drain()
        except Exception:  # noqa: BLE001 - the save already failed; remove what is left
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


# ---------------------------------------------------------------------- reading
def read_exact(fd: int, offset: int, out: memoryview, name: str, whose: str) -> None:
    """Fill ``out`` from ``offset`` of an open file; a file that ends first is an
    IntegrityError naming it and ``whose`` expectation it fails."""
    done = 0
    try:
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise IntegrityError(
                    f"data file {name} ends at {offset + done} bytes, before the {offset + len(out)} {whose}"
                )
            done += n
    except OSError as exc:
        raise StorageError(f"cannot read {name}: {exc}", name) from exc


class FileSet:
    """Open data files of one checkpoint, by index into ``Metadata.files``; checks each file's
    size against the metadata the first time it is opened."""

    def __init__(self, path: str, meta: Metadata):
        self.path = path
        self.meta = meta
        self._fds: dict[int, int] = {}
        self._stats: dict[int, tuple[int, int, int]] = {}

    def fd(self, index: int) -> int:
        fd = self._fds.get(index)
        if fd is not None:
            return fd
        entry = self.meta.files[index]
        full = inside(self.path, entry.name)
        try:
            fd = os.open(full, os.O_RDONLY)
        except FileNotFoundError:
            raise IntegrityError(f"data file {full} of checkpoint {self.meta.unique_id} is missing") from None
        except OSError as exc:
            raise StorageError(f"cannot open {full}: {exc}", full) from exc
        st = os.fstat(fd)
        if st.st_size != entry.nbytes:
            os.close(fd)
            raise IntegrityError(f"data file {full} has {st.st_size} bytes, the metadata says {entry.nbytes}")
        self._fds[index] = fd
        self._stats[index] = _identity(st)
        return fd

    def check_unchanged(self) -> None:
        """Raise IntegrityError when a file opened by this set was written since it was opened
        (its size or modification time moved): bytes checked before the copy may not be the
        bytes copied."""
        for index, fd in self._fds.items():
            if _identity(os.fstat(fd)) != self._stats[index]:
                raise IntegrityError(
                    f"data file {self.name(index)} was modified while it was being loaded: the loaded "
                    f"values may mix old and new bytes"
                )

    def name(self, index: int) -> str:
        return os.path.join(self.path, self.meta.files[index].name)

    def read_into(self, index: int, offset: int, out: memoryview) -> None:
        read_exact(self.fd(index), offset, out, self.name(index), "the metadata promises")

    @contextmanager
    def mapped(self, index: int, start: int, stop: int) -> Iterator[np.ndarray]:
        """The bytes [start, stop) of a file as a read-only uint8 array, mapped from the page
        cache (no read copy: a strided copy out of it touches only the bytes it needs)."""
        fd = self.fd(index)
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            mm = mmap.mmap(fd, stop - base, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED, offset=base)
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot map {self.name(index)}: {exc}", self.name(index)) from exc
        try:
            yield np.frombuffer(mm, dtype=np.uint8, count=stop - start, offset=start - base)
        finally:
            try:
                mm.close()
            except BufferError:  # a view still alive: unmapped when it is collected
                pass

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._stats.clear()


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    # not the change time: unlinking or renaming a file (which loads fine through its open
    # descriptor) moves it
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def seed_of(meta: Metadata, piece: SavedPiece) -> int:
    return piece_seed(piece.key, meta.tensors[piece.key].dtype, piece.box.offsets, piece.box.shape)


def segment_blocks(meta: Metadata, seg: Segment) -> list[tuple[int, int, int, int]]:
    """(file offset, length, seed, expected checksum) of every checksum block a segment covers."""
    piece = seg.piece
    block = meta.block_bytes
    sums = meta.tensors[piece.key].pieces.checksums
    first = (seg.start - piece.byte_offset) // block
    seed = seed_of(meta, piece)
    out = []
    for k, at in enumerate(range(seg.start, max(seg.stop, seg.start + 1), block)):
        index = first + k
        out.append((at, min(block, seg.stop - at), (seed + index) & _MASK64, int(sums[piece.first_block + index])))
    return out


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


def verify_segment(meta: Metadata, files: "FileSet", file: int, seg: Segment, data: memoryview) -> None:
    """Check the checksums of the whole blocks of ``seg`` held in ``data``."""
    piece = seg.piece
    entry = meta.tensors[piece.key]
    block = meta.block_bytes
    rel = seg.start - piece.byte_offset
    first_block = rel // block
    sums = entry.pieces.checksums
    seed = seed_of(meta, piece)
    for k, at in enumerate(range(0, max(len(data), 1), block)):
        got = block_checksum(data[at : at + block], seed, first_block + k)
        want = int(sums[piece.first_block + first_block + k])
        if got != want:
            lo = seg.start + at
            raise IntegrityError(
                f"{files.name(file)}: bytes [{lo}, {lo + min(block, len(data) - at)}) of tensor "
                f"{piece.key!r} (piece at offset {piece.box.offsets}) fail their checksum: the "
                f"file is damaged or does not belong to this metadata"
            )


def read_ahead(files: "FileSet", ops: Sequence, window: int = 128 << 20) -> Iterator:
    """Yield ``ops`` in order, having asked the kernel to start reading the byte ranges of the
    next ones (``posix_fadvise`` WILLNEED) while the current one is hashed or copied: a
    checkpoint on disk rather than in the page cache is then read in large requests ahead of
    use, not a page fault at a time. At most ``window`` bytes are asked for ahead of the op
    being worked on; pages already cached cost a lookup."""
    advise = getattr(os, "posix_fadvise", None)
    advised = done = 0  # bytes of ops asked for / finished
    following = 0  # first op not asked for yet
    for i, op in enumerate(ops):
        while advise is not None and following < len(ops) and (following <= i or advised - done < window):
            nxt = ops[following]
            try:
                advise(files.fd(nxt.file), nxt.start, nxt.stop - nxt.start, os.POSIX_FADV_WILLNEED)
            except OSError:  # a hint only: the read itself reports any real problem
                pass
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
    files: "FileSet",
    targets: Sequence[np.ndarray],
    staging: Staging,
    verify: bool = True,
    fetch: Callable[[ReadOp, memoryview], None] | None = None,
    check_only: bool = False,
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
    """
    meta = files.meta
    if fetch is None:
        with files.mapped(op.file, op.start, op.stop) as buf:
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
    fetch(op, memoryview(buf))
    _verify_and_copy(op, files, targets, buf, verify, check_only)


def _verify_and_copy(op: ReadOp, files: "FileSet", targets, buf: np.ndarray, verify: bool, check_only: bool) -> None:
    meta = files.meta
    if verify or check_only:
        for seg in op.segments:
            verify_segment(meta, files, op.file, seg, memoryview(buf[seg.start - op.start : seg.stop - op.start]))
    if check_only:
        return
    for seg in op.segments:
        dtype = storage_dtype(meta.tensors[seg.piece.key].dtype)
        for c in seg.copies:
            targets[c.target][c.region_in_target.slices()] = piece_view(buf, op.start, seg.piece, c.region_in_saved, dtype)


def execute_reads(
    ops: Sequence[ReadOp],
    files: "FileSet",
    targets: Sequence[np.ndarray],
    verify: bool = True,
    staging: Staging | None = None,
) -> int:
    """Carry out read ops from local files (see :func:`execute_op`); returns bytes read."""
    staging = staging or Staging()
    for op in ops:
        execute_op(op, files, targets, staging, verify)
    return sum(op.nbytes for op in ops)


class RangeReader:
    """Reads byte ranges of named data files for other ranks (a server of node-local data)."""

    def __init__(self, path: str):
        self.path = path
        self._fds: dict[str, int] = {}

    def read_into(self, name: str, start: int, out: memoryview) -> None:
        fd = self._fds.get(name)
        if fd is None:
            full = inside(self.path, name)
            try:
                fd = os.open(full, os.O_RDONLY)
            except FileNotFoundError:
                raise IntegrityError(f"data file {full} is missing") from None
            except OSError as exc:
                raise StorageError(f"cannot open {full}: {exc}", full) from exc
            self._fds[name] = fd
        read_exact(fd, start, out, os.path.join(self.path, name), "a reader asked for")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
