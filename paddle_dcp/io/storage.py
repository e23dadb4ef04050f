"""The storage interface: what the save and load code asks of a checkpoint directory
(:class:`Storage`, the data files it opens, the byte streams it writes), and what is built once
above it: the listing of a directory (:func:`list_checkpoints`) and the metadata file's read
and commit (:func:`read_metadata`, :func:`commit_metadata`).

A storage (:class:`Storage`) lists, reads, writes and removes the files of one checkpoint
directory; :func:`paddle_dcp.io.open_storage` gives the one for a path (``io/local.py``: the
local disk; ``io/objects.py``: object storage). OSError becomes StorageError naming the path;
bytes that disagree with the metadata become IntegrityError naming file and key. What works on
any storage lives beside it: a data file's layout and checksums as it is written
(``io/datafile.py``), reading byte ranges (``io/reads.py``), cleaning up (``io/cleanup.py``);
the checksum scheme is in the core (``core/checksums.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Protocol, Sequence

import numpy as np

from ..errors import FormatError, StorageError
from ..core.metadata import MAX_METADATA_BYTES, FileEntry, Metadata
from ..core.metadata_parse import parse_metadata
from ..core.naming import (  # noqa: F401 - re-exported
    DATA_RE, METADATA_RE, TMP_MARK, TMP_RE, claim_name, data_file_name, metadata_name, parse_claim_name, parse_data_name,
)


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
        claims: (id, generation) of every claim present: saves in progress, saves that
            crashed, and the generations of checkpoints present (a claim goes with its files).
    """

    complete: frozenset[int]
    data: dict[int, frozenset[tuple[int, int]]]
    temporary: tuple[str, ...] = ()
    names: frozenset[str] = frozenset()
    files: frozenset[str] = frozenset()
    claims: frozenset[tuple[int, int]] = frozenset()

    def claimed(self, unique_id: int) -> list[int]:
        """The generations of ``unique_id`` claimed, ascending."""
        return sorted(g for u, g in self.claims if u == unique_id)

    def claim_names(self, which: Callable[[int, int], bool]) -> list[str]:
        """The names of the claims (id, generation) that ``which`` takes, in order."""
        return [claim_name(u, g) for u, g in sorted(self.claims) if which(u, g)]

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
    complete, temporary, found, every, claims = set(), [], [], [], set()
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
        elif (claim := parse_claim_name(name)) is not None:
            claims.add(claim)
    data_sets = {k: frozenset(v) for k, v in data.items()}
    return Listing(
        frozenset(complete), data_sets, tuple(sorted(temporary)), frozenset(found), frozenset(every), frozenset(claims)
    )


class FileRanges:
    """Byte ranges of one file of a storage, read as they are asked for (what
    :func:`paddle_dcp.core.metafile.read_part` reads the metadata through). Ranges less than
    ``gap`` bytes apart are read in one request; ``bytes_read`` counts what was read."""

    def __init__(self, store: "Storage", name: str, gap: int = 4096):
        self.name, self.gap = name, gap
        self.reader = store.range_reader()
        self.bytes_read = 0

    def __call__(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        out: list[bytes] = [b""] * len(ranges)
        order = sorted(range(len(ranges)), key=lambda i: ranges[i])
        run: list[int] = []

        def flush() -> None:
            if not run:
                return
            lo, hi = ranges[run[0]][0], max(ranges[i][1] for i in run)
            buf = bytearray(hi - lo)
            self.reader.read_into(self.name, lo, memoryview(buf))
            self.bytes_read += hi - lo
            for i in run:
                out[i] = bytes(buf[ranges[i][0] - lo : ranges[i][1] - lo])
            run.clear()

        end = 0
        for i in order:
            a, b = ranges[i]
            if run and a > end + self.gap:
                flush()
            end = max(end, b) if run else b
            run.append(i)
        flush()
        return out

    def close(self) -> None:
        self.reader.close()


# ---------------------------------------------------------------------- the interface
class DataFiles(Protocol):
    """Data files opened for reading, by index into the entries they were opened from; each
    file's size is checked against its entry's when it is first used."""

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


class ByteStream(Protocol):
    """One file being written front to back, absent under its final name until
    :meth:`commit` (what :class:`paddle_dcp.io.datafile.DataFileWriter` writes a data file
    through)."""

    def write_at(self, data: memoryview, offset: int, keep=None) -> None:
        """Write ``data`` at ``offset``, at or past the end of what was written (the bytes
        between are zeros); ``keep`` stays alive until the bytes are written."""

    def commit(self, size: int, durable: bool = False) -> None:
        """Make the file of ``size`` bytes appear, whole, under its final name (``durable``:
        on stable storage first)."""

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

    def list_names(self, temporary: bool = True) -> list[str]:
        """The name of every file the directory holds (a missing directory holds none). With
        ``temporary=False`` a storage whose temporary files cost a request of their own to
        list (object storage: the open multipart uploads) may leave them out."""

    def size(self, name: str) -> int | None:
        """The size in bytes of file ``name``, or None when the directory holds no file of that
        name (a subdirectory is not a file)."""

    def open_files(self, entries: Sequence[FileEntry], whose: str = "") -> DataFiles:
        """The files ``entries`` name (each with the size it must have), opened for reading
        (``whose``: what messages add to a file's name, e.g. " of checkpoint 3")."""

    def range_reader(self) -> RangeSource:
        """A reader of byte ranges of data files by name."""

    def write_atomic(self, name: str, data: bytes, durable: bool = False) -> None:
        """Write ``data`` as file ``name``: it appears whole or not at all."""

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Write ``data`` as file ``name`` unless a file of that name exists, in one atomic
        step: True when this call created it, False when it existed (a save's claim)."""

    def read_file(self, name: str, limit: int | None = None) -> bytes | None:
        """The whole content of a small file ``name`` (a metadata file, a manager's manifest);
        None when it does not exist. With ``limit``, a file of more bytes is a FormatError naming
        it, refused before it is read where the storage knows its size."""

    def open_stream(self, name: str, depth: int = 2) -> ByteStream:
        """File ``name`` to write front to back (``depth``: how many writes may wait to be
        done, where the storage writes from a thread of its own)."""

    def remove(self, names: Iterable[str]) -> list[str]:
        """Remove the files ``names`` (missing ones skipped); returns the names removed."""

    def resolve(self, name: str) -> str:
        """The full name of file ``name`` (FormatError when it would leave the directory)."""


# ========================================================= what a directory holds, read once here
def list_checkpoints(store: Storage, temporary: bool = True) -> Listing:
    """The checkpoints, data files and temporary files of ``store`` (``temporary``: as for
    :meth:`Storage.list_names`)."""
    return listing_of(store.list_names(temporary))


# ========================================================= a checkpoint's metadata file
# written and read here once, over any storage's bytes: the save's commit, the tiers' copies
# and the command line's import all commit through commit_metadata; every load reads through
# metadata_bytes / read_metadata
def metadata_bytes(store: Storage, unique_id: int) -> bytes:
    """The content of checkpoint ``unique_id``'s metadata file, unparsed: a StorageError when
    there is none, a FormatError over the size limit (refused before it is read)."""
    name = metadata_name(unique_id)
    data = store.read_file(name, limit=MAX_METADATA_BYTES)
    if data is None:
        url = store.resolve(name)
        raise StorageError(f"checkpoint {unique_id} has no metadata file {url}", url)
    return data


def open_data_files(store: Storage, meta: Metadata) -> DataFiles:
    """The data files of the checkpoint ``meta`` describes, opened for reading."""
    return store.open_files(meta.files, f" of checkpoint {meta.unique_id}")


def read_metadata(store: Storage, unique_id: int, lazy: bool = False) -> Metadata:
    """Checkpoint ``unique_id``'s metadata, read and validated (tensor entries parsed on first
    use when ``lazy``)."""
    data = metadata_bytes(store, unique_id)
    return metadata_from_bytes(data, unique_id, store.resolve(metadata_name(unique_id)), lazy)


def commit_metadata(store: Storage, unique_id: int, data: bytes, durable: bool = False) -> None:
    """Write checkpoint ``unique_id``'s metadata file, the last file of a save or of a copy of
    one: it appears whole or not at all, and with it the checkpoint."""
    store.write_atomic(metadata_name(unique_id), data, durable)
