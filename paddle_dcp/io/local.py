"""The local-disk storage: a checkpoint directory on a local or shared POSIX filesystem.

Files are written under a temporary name beside the final one and renamed into place
(:class:`AtomicFile`, the one atomic writer: data files, metadata, gathered and converted
files); data files are read with ``preadv`` or mapped from the page cache. OSError becomes
StorageError naming the path.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import ContextManager, Iterable, Iterator, Sequence

import numpy as np

from ..errors import FormatError, IntegrityError, StorageError
from ..core.metadata import FileEntry, check_member_name
from ..core.naming import TMP_MARK

logger = logging.getLogger(__name__)


class LocalStorage:
    """The :class:`paddle_dcp.io.storage.Storage` of a directory on disk."""

    seen_by_all = False  # a shared file system, or node-local disks: every rank lists its own

    def __init__(self, path: str):
        self.path = path

    def create(self) -> None:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the directory {self.path}: {exc}", self.path) from exc

    def list_names(self, temporary: bool = True) -> list[str]:
        return list_names(self.path)  # temporary files are listed with the rest, at no cost

    def size(self, name: str) -> int | None:
        full = os.path.join(self.path, name)
        try:
            st = os.stat(full)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StorageError(f"cannot read {full}: {exc}", full) from exc
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def open_files(self, entries: Sequence[FileEntry], whose: str = "") -> "FileSet":
        return FileSet(self.path, entries, whose)

    def range_reader(self) -> "RangeReader":
        return RangeReader(self.path)

    def write_atomic(self, name: str, data: bytes, durable: bool = False) -> None:
        write_atomic(self.path, name, data, durable)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        return create_exclusive(self.path, name, data)

    def read_file(self, name: str, limit: int | None = None) -> bytes | None:
        full = os.path.join(self.path, name)
        try:
            with os.fdopen(open_member(self.path, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if limit is not None and size > limit:
                    raise FormatError(f"{full}: {size} bytes is over the {limit}-byte limit for this file")
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StorageError(f"cannot read {full}: {exc}", full) from exc

    def open_stream(self, name: str, depth: int = 2) -> "FileStream":
        return FileStream(self.path, name, depth)

    def remove(self, names: Iterable[str]) -> list[str]:
        return remove_files(self.path, names)

    def resolve(self, name: str) -> str:
        return inside(self.path, name)


def list_names(path: str) -> list[str]:
    """The names in directory ``path``; a missing directory holds none."""
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StorageError(f"cannot list checkpoint directory {path}: {exc}", path) from exc


def remove_files(path: str, names: Iterable[str]) -> list[str]:
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


def inside(path: str, name: str) -> str:
    """``path/name`` for a validated plain ``name`` that resolves inside ``path``, or, for a
    snapshot of the Hugging Face hub cache (``models--org--name/snapshots/REV``), inside its
    repository's ``blobs`` directory, where the snapshot's files link to."""
    check_member_name(name)
    full = os.path.join(path, name)
    real_dir = os.path.realpath(path)
    real = os.path.realpath(full)
    where = os.path.dirname(real)
    if where != real_dir and where != _hub_blobs(real_dir):
        raise FormatError(f"{full} resolves to {real}, outside the checkpoint directory {real_dir}")
    return full


_HUB_REPO = re.compile(r"(?:models|datasets|spaces)--[^/]+\Z")


def _hub_blobs(real_dir: str) -> str | None:
    """The ``blobs`` directory of the hub cache repository whose snapshot ``real_dir`` is: a
    directory ``snapshots/REV`` of a repository named as the hub names them
    (``models--org--name``) beside a real ``blobs`` directory and ``refs``."""
    snapshots = os.path.dirname(real_dir)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or not _HUB_REPO.match(os.path.basename(repo)):
        return None
    blobs = os.path.join(repo, "blobs")
    if os.path.islink(blobs) or not os.path.isdir(blobs) or not os.path.isdir(os.path.join(repo, "refs")):
        return None
    return blobs


_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def open_member(path: str, name: str) -> int:
    """A descriptor open for reading of ``name``, a regular file of directory ``path`` (the
    one way a checkpoint's files are opened to be read). The name is opened relative to the
    directory and never through a link: a link is followed only when it resolves inside the
    directory, or from a hub cache snapshot into its repository's blobs (see :func:`inside`),
    and then its target is opened the same way. A FIFO, device, socket or directory is a
    StorageError at once (O_NONBLOCK: opening a FIFO does not wait for a writer).

    Raises:
        FileNotFoundError: there is no such file (the caller says what is missing).
        FormatError: a link out of the directory.
    """
    check_member_name(name)
    full = os.path.join(path, name)
    try:
        return _open_regular(path, name, full)
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # O_NOFOLLOW met a link
            raise
    real = inside(path, name)
    target = os.path.realpath(real)
    return _open_regular(os.path.dirname(target), os.path.basename(target), full)


def _open_regular(directory: str, name: str, full: str) -> int:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(name, _READ, dir_fd=dfd)
    finally:
        os.close(dfd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a directory" if stat.S_ISDIR(mode) else "a device"
        raise StorageError(f"{full} is {kind}, not a regular file: refused", full)
    return fd


# ---------------------------------------------------------------------- writing
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A file written as ``{final}.tmp.{hex}`` beside ``final`` and renamed to ``final`` by
    :meth:`commit`, so that it appears whole or not at all. With ``durable``, the file is
    fsynced before the rename and its directory after. :meth:`abort` removes it."""

    def __init__(self, final: str):
        self.final = os.fspath(final)
        self.tmp = f"{self.final}{TMP_MARK}{secrets.token_hex(4)}"
        try:
            # a name of its own: created here (O_EXCL), never through a link planted under it
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise StorageError(f"cannot create {self.tmp}: {exc}", self.tmp) from exc

    def write(self, data) -> None:
        """Append ``data`` (any buffer) at the current position."""
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.write(self.fd, view[done : done + (1 << 30)])
        except OSError as exc:
            raise StorageError(f"cannot write {self.tmp}: {exc}", self.tmp) from exc

    def pwrite(self, view: memoryview, offset: int) -> None:
        """Write ``view`` (bytes) at ``offset``."""
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as exc:
            raise StorageError(f"cannot write {self.tmp}: {exc}", self.tmp) from exc

    def commit(self, durable: bool = False, size: int | None = None) -> None:
        """Close (cut to ``size`` bytes first, when given) and rename into place."""
        try:
            if size is not None:
                os.ftruncate(self.fd, size)
            if durable:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.final)
            if durable:
                fsync_dir(os.path.dirname(self.final) or ".")
        except OSError as exc:
            raise StorageError(f"cannot write {self.final}: {exc}", self.final) from exc

    def abort(self) -> None:
        """Close and remove the temporary file (never raises)."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


@contextmanager
def atomic_path(final: str, durable: bool = False) -> Iterator[str]:
    """The temporary name to write ``final`` under (by any writer that takes a path); renamed
    to ``final`` when the block ends normally, removed when it raises."""
    out = AtomicFile(final)
    try:
        yield out.tmp
        out.commit(durable)
    except BaseException:
        out.abort()
        raise


def write_atomic(path: str, name: str, data: bytes, durable: bool = False) -> None:
    """Write ``data`` to ``path/name`` through a temporary file and a rename."""
    out = AtomicFile(os.path.join(path, name))
    try:
        out.write(data)
        out.commit(durable)
    except StorageError:  # only an I/O failure: a process that dies leaves its files as they are
        out.abort()
        raise


def create_exclusive(path: str, name: str, data: bytes) -> bool:
    """Create ``path/name`` holding ``data`` unless it exists (O_EXCL: atomic on local file
    systems and NFS 3 and later, never through a link); True when this call created it. Its
    content is written after the creation: a reader may find it shorter for a moment."""
    full = os.path.join(path, check_member_name(name))
    try:
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        raise StorageError(f"cannot create {full}: {exc}", full) from exc
    try:
        os.write(fd, data)
    except OSError as exc:
        raise StorageError(f"cannot write {full}: {exc}", full) from exc
    finally:
        os.close(fd)
    return True


class FileStream:
    """A file on disk written front to back (a :class:`~paddle_dcp.io.storage.ByteStream`),
    under a temporary name until :meth:`commit`. The bytes go to the file from a thread of its
    own while the caller prepares the next piece (its checksums; on a GPU, its copy to host
    memory): at most ``depth`` writes wait to be done, and their host memory is kept alive
    until they are. The gaps between writes stay holes (zeros)."""

    def __init__(self, path: str, name: str, depth: int = 2):
        self.file = AtomicFile(os.path.join(path, name))
        self.final, self.tmp = self.file.final, self.file.tmp
        self.depth = depth
        self._pending: deque[Future] = deque()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paddle_dcp-write")

    def write_at(self, data: memoryview, offset: int, keep=None) -> None:
        self._pending.append(self._pool.submit(self._write_at, data, offset, keep))
        while len(self._pending) > self.depth:
            self._pending.popleft().result()

    def _write_at(self, view: memoryview, offset: int, keep) -> None:
        self.file.pwrite(view, offset)

    def _drain(self) -> None:
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self._pool.shutdown(wait=True)

    def commit(self, size: int, durable: bool = False) -> None:
        """Close and rename into place (with ``durable``: after an fsync of the file, and with
        one of the directory after)."""
        self._drain()
        self.file.commit(durable, size=size)

    def abort(self) -> None:
        try:
            self._drain()
        except Exception:  # noqa: BLE001 - the save already failed; remove what is left
            pass
        self.file.abort()


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


def open_data(path: str, name: str, whose: str = "") -> int:
    """A descriptor of data file ``name`` of ``path`` open for reading (:func:`open_member`); a
    missing one is an IntegrityError (``whose``: what to add to its name, e.g. " of checkpoint
    3")."""
    full = os.path.join(path, name)
    try:
        return open_member(path, name)
    except (FileNotFoundError, NotADirectoryError):
        raise IntegrityError(f"data file {full}{whose} is missing") from None
    except OSError as exc:
        raise StorageError(f"cannot open {full}: {exc}", full) from exc


class FileSet:
    """Open data files, by index into the entries they were opened from; checks each file's
    size against the metadata the first time it is opened."""

    def __init__(self, path: str, entries: Sequence[FileEntry], whose: str = ""):
        self.path = path
        self.entries, self.whose = entries, whose
        self._fds: dict[int, int] = {}
        self._stats: dict[int, tuple[int, int, int]] = {}

    def fd(self, index: int) -> int:
        fd = self._fds.get(index)
        if fd is not None:
            return fd
        entry = self.entries[index]
        full = os.path.join(self.path, entry.name)
        fd = open_data(self.path, entry.name, self.whose)
        st = os.fstat(fd)
        if st.st_size != entry.nbytes:
            os.close(fd)
            raise IntegrityError(f"data file {full} has {st.st_size} bytes, the metadata says {entry.nbytes}")
        self._fds[index] = fd
        self._stats[index] = _identity(st)
        return fd

    def open(self, index: int) -> None:
        """Open file ``index`` now and check its size."""
        self.fd(index)

    def advise(self, index: int, start: int, length: int, again: bool = False) -> None:
        """Ask the kernel to start reading these bytes (``posix_fadvise`` WILLNEED)."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        try:
            advise(self.fd(index), start, length, os.POSIX_FADV_WILLNEED)
        except OSError:  # a hint only: the read itself reports any real problem
            pass

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
        return os.path.join(self.path, self.entries[index].name)

    def read_into(self, index: int, offset: int, out: memoryview) -> None:
        read_exact(self.fd(index), offset, out, self.name(index), "the metadata promises")

    def mapped(self, index: int, start: int, stop: int, again: bool = False) -> ContextManager[np.ndarray]:
        """The bytes [start, stop) of a file as a read-only uint8 array, mapped from the page
        cache (no read copy: a strided copy out of it touches only the bytes it needs); a read
        again costs a page-cache lookup, so ``again`` changes nothing here."""
        return map_range(self.fd(index), start, stop, self.name(index))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._stats.clear()


@contextmanager
def map_range(fd: int, start: int, stop: int, name: str) -> Iterator[np.ndarray]:
    """Bytes [start, stop) of an open file as a read-only uint8 array mapped from the page cache,
    valid inside the block."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        mm = mmap.mmap(fd, stop - base, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED, offset=base)
    except (OSError, ValueError) as exc:
        raise StorageError(f"cannot map {name}: {exc}", name) from exc
    try:
        yield np.frombuffer(mm, dtype=np.uint8, count=stop - start, offset=start - base)
    except BaseException as exc:
        # the finished frames of the error's traceback hold views of the mapping, which keep it
        # (and the descriptor mmap duplicated) open until a collection: a refused load would
        # leave its files open
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        unmap(mm)


def unmap(mm: mmap.mmap) -> None:
    """Close a mapping; while a view of it is still alive, it is unmapped when collected."""
    try:
        mm.close()
    except BufferError:
        pass


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    # not the change time: unlinking or renaming a file (which loads fine through its open
    # descriptor) moves it
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class RangeReader:
    """Reads byte ranges of named data files for other ranks (a server of node-local data)."""

    def __init__(self, path: str):
        self.path = path
        self._fds: dict[str, int] = {}

    def read_into(self, name: str, start: int, out: memoryview) -> None:
        fd = self._fds.get(name)
        if fd is None:
            fd = open_data(self.path, name)
            self._fds[name] = fd
        read_exact(fd, start, out, os.path.join(self.path, name), "a reader asked for")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
