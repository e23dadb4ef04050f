"""A local scratch file for byte ranges fetched from object storage and needed again soon.

A verified load checks every block of its share before any tensor changes, then copies. From a
local disk the copy re-reads the page cache; from object storage it would GET the share a second
time (the share does not fit the memory bound). Instead the checked ranges are written to an
unnamed files on a local disk (:class:`SpillFiles`; the GETs write straight into them) and the
copy maps them from there: one GET per byte, the page cache's speed for the second pass, and
process memory still bounded (the pages are the kernel's page cache, written back and dropped
under pressure like any file's).

Where: ``storage_options["spill_dir"]``; by default ("auto") the system's temporary directory
unless it is a memory filesystem (tmpfs, ramfs: the pages would be memory after all) or too full.
The files have no names (``tempfile.TemporaryFile``), so nothing is left behind by a killed load.
A region that cannot be allocated (a full disk) turns spilling off for the rest of the load with a warning:
the ranges are then fetched again, as without a spill directory.
"""
from __future__ import annotations

import bisect
import logging
import mmap
import os
import shutil
import tempfile
from typing import IO, ContextManager

import numpy as np

from .local import map_range, unmap

logger = logging.getLogger(__name__)

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
NOTHING = np.empty(0, dtype=np.uint8)  # a buffer once its mapping is gone
MIN_FREE_BYTES = 1 << 30  # a spill never leaves less free space than this on its disk


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the filesystem holding ``path`` (Linux's mount table), None when unknown."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, kind = -1, None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        point = parts[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), rest.split()[0]
    return kind


def spill_directory(option: str | None) -> str | None:
    """The directory a load spills into for the ``spill_dir`` option, or None for none."""
    if not option:
        return None
    if option != "auto":
        return option
    directory = tempfile.gettempdir()
    kind = filesystem_type(directory)
    if kind in MEMORY_FILESYSTEMS:
        logger.info("not spilling checked ranges into %s: it is a %s (memory); set storage_options spill_dir", directory, kind)
        return None
    return directory


class Intervals:
    """A set of byte ranges [start, stop), kept as disjoint sorted runs."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []

    def add(self, start: int, stop: int) -> None:
        lo = bisect.bisect_left(self.stops, start)  # first run ending at or after start
        hi = bisect.bisect_right(self.starts, stop)  # runs from lo to hi touch [start, stop)
        if lo < hi:
            start, stop = min(start, self.starts[lo]), max(stop, self.stops[hi - 1])
        self.starts[lo:hi], self.stops[lo:hi] = [start], [stop]

    def covers(self, start: int, stop: int) -> bool:
        at = bisect.bisect_right(self.starts, start) - 1
        return at >= 0 and self.stops[at] >= stop


class Region:
    """Bytes [start, stop) of a spill file mapped for writing (``buf``) until :meth:`close`."""

    def __init__(self, runs: Intervals, start: int, stop: int, mm: mmap.mmap, base: int):
        self.runs, self.start, self.stop, self.mm = runs, start, stop, mm
        self.buf: np.ndarray = np.frombuffer(mm, dtype=np.uint8, count=stop - start, offset=start - base)

    def close(self, kept: bool) -> None:
        """Unmap; ``kept``: the bytes are whole and may be read back (:meth:`SpillFiles.covers`)."""
        if kept:
            self.runs.add(self.start, self.stop)
        self.buf = NOTHING
        unmap(self.mm)


class SpillFiles:
    """Bytes of data files kept in unnamed local files, one sparse file per data file with
    every byte at its own offset, so a range is found whichever reads kept it. A range is
    fetched straight into a mapped region of its file (:meth:`region`): keeping it costs no copy,
    and the copy reads it back from the page cache."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._files: dict[int, tuple[IO[bytes], Intervals]] = {}
        self.enabled = True

    def region(self, index: int, start: int, stop: int) -> Region | None:
        """Bytes [start, stop) of file ``index``'s spill file, allocated on the disk and mapped
        for writing; None when they cannot be (and, after a failure, nothing more is). The
        blocks are allocated first, so a full disk is an error here, not a SIGBUS later."""
        if not self.enabled:
            return None
        try:
            if shutil.disk_usage(self.directory).free < stop - start + MIN_FREE_BYTES:
                raise OSError(f"less than {MIN_FREE_BYTES >> 20} MiB would stay free")
            if index not in self._files:
                self._files[index] = (tempfile.TemporaryFile(dir=self.directory), Intervals())
            f, runs = self._files[index]
            os.posix_fallocate(f.fileno(), start, stop - start)
            base = start - start % mmap.ALLOCATIONGRANULARITY
            mm = mmap.mmap(f.fileno(), stop - base, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
        except OSError as exc:
            logger.warning("spilling checked ranges into %s stopped (%s): the rest are fetched again", self.directory, exc)
            self.enabled = False
            return None
        return Region(runs, start, stop, mm, base)

    def covers(self, index: int, start: int, stop: int) -> bool:
        return index in self._files and self._files[index][1].covers(start, stop)

    def mapped(self, index: int, start: int, stop: int) -> ContextManager[np.ndarray]:
        """The kept bytes [start, stop) of file ``index`` (see :meth:`covers`), mapped."""
        return map_range(self._files[index][0].fileno(), start, stop, f"the spill file in {self.directory}")

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files.clear()
