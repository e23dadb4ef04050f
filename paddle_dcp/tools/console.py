"""What the command line shows people: lines on stdout and stderr, byte counts, progress."""
from __future__ import annotations

import re
import sys
import time
from typing import Iterable


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")


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
