"""What every command shares: exit codes, usage errors, choosing a checkpoint in a directory,
and what people see (lines on stdout and stderr, byte counts, progress)."""
from __future__ import annotations

import os
import re
import sys
import time
from typing import Iterable

from ..core.naming import metadata_name
from ..errors import FormatError
from ..io import is_url, storage

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
PROG = "paddle-dcp"  # the command line's name, as errors and logs begin


# what a checkpoint's names and strings may hold that a terminal would act on: C0 and C1 controls
# (a newline too: one line of output stays one line), DEL, and the bidirectional overrides
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every control character written as an escape (``\\x1b``, ``\\u202e``)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1] if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def _out(line: str = "") -> None:
    """One line on stdout, its control characters escaped (it may quote a checkpoint)."""
    sys.stdout.write(printable(line) + "\n")


def _err(line: str) -> None:
    sys.stderr.write(printable(line) + "\n")


def human(n: float) -> str:
    """Bytes for people: ``12.3 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def _one_line(message: str) -> str:
    return re.sub(r"\s*\n\s*", "; ", str(message).strip())


class ProgressBar:
    """Bytes done / total and rate on stderr: tqdm when installed, else one line redrawn at
    most five times a second. Draws nothing unless ``enabled``."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.done = int(total), desc, 0
        self.enabled = bool(enabled) and self.total > 0
        self._tqdm = None
        self._start = self._drawn = time.monotonic()
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._tqdm = tqdm(
                    total=self.total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
                )

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.update(n)
            return
        now = time.monotonic()
        if now - self._drawn >= 0.2:
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._drawn = now
        rate = self.done / max(now - self._start, 1e-9)
        pct = 100.0 * self.done / self.total
        sys.stderr.write(f"\r{self.desc}: {human(self.done)} / {human(self.total)} ({pct:3.0f}%) {human(rate)}/s ")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        else:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.enabled = False


def _progress_enabled(args) -> bool:
    if args.progress is not None:
        return args.progress
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _ids(ids: Iterable[int]) -> str:
    return ", ".join(str(i) for i in sorted(ids)) or "none"


class UsageError(Exception):
    """Bad usage: exit code 2."""


def _directory(path: str) -> str:
    """``path``, a local directory that exists, or a URL (its objects are listed later)."""
    path = os.fspath(path)
    if is_url(path):
        return path.rstrip("/")
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is not a directory"
        raise UsageError(f"{path} {what}")
    return path


def incomplete_ids(listing: storage.Listing) -> list[int]:
    """Ids with data files but no metadata: crashed saves, saves in progress, or (node-local
    disks) checkpoints whose metadata lives on another node."""
    return sorted(set(listing.data) - set(listing.complete))


def choose_id(path: str, listing: storage.Listing, unique_id: int | None) -> int:
    """The checkpoint a command works on: ``unique_id``, or the highest complete one."""
    if unique_id is None:
        if listing.latest is None:
            extra = f" (incomplete ids: {_ids(incomplete_ids(listing))})" if listing.data else ""
            raise FormatError(f"no complete checkpoint in {path}: no *.metadata file{extra}")
        return listing.latest
    if unique_id in listing.complete:
        return unique_id
    if unique_id in listing.data:
        raise FormatError(
            f"checkpoint {unique_id} in {path} is incomplete: data files but no {metadata_name(unique_id)} "
            f"(a save that crashed or is in progress, or the metadata is on another node)"
        )
    raise UsageError(f"no checkpoint {unique_id} in {path}; complete ids: {_ids(listing.complete)}")
