"""Units of the benchmarks: bytes and speeds, sizes and counts as the command line takes them,
and sizes as the reports print them."""
from __future__ import annotations

import re

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9  # speeds: GB/s = bytes / seconds / 1e9

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", re.I)
_COUNT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)\s*", re.I)


def _scaled(text: str, pattern: re.Pattern, scales: tuple, what: str) -> int:
    """A number with an optional K, M or G suffix, times its scale (``scales``: K's, M's, G's)."""
    m = pattern.fullmatch(text)
    if not m:
        raise ValueError(f"{what} {text!r}: expected a number with an optional K, M or G suffix")
    return int(float(m.group(1)) * dict(zip(("", "K", "M", "G"), (1, *scales)))[m.group(2).upper()])


def parse_size(text: str) -> int:
    """'1G', '256M', '64MiB', '1.5G', '1048576' -> bytes (K, M and G are powers of 1024).

    Raises:
        ValueError: ``text`` is not a number with an optional K, M or G.
    """
    return _scaled(text, _SIZE, (KiB, MiB, GiB), "size")


def parse_count(text: str) -> int:
    """'16M', '10k', '1.5K', '300' -> a count (k or K, M and G are powers of 1000).

    Raises:
        ValueError: ``text`` is not a number with an optional k, M or G.
    """
    return _scaled(text, _COUNT, (10**3, 10**6, 10**9), "count")


def parse_counts(text: str, what: str = "count", example: str = "10k,30k,100k") -> list[int]:
    """'10k,30k,100k' -> [10000, 30000, 100000] (k = 1000), sorted, each at least 1 (``what``
    and ``example`` word the errors).

    Raises:
        ValueError: an item is no count or below 1, or ``text`` lists none.
    """
    out = set()
    for item in (x.strip() for x in text.split(",") if x.strip()):
        n = parse_count(item)
        if n < 1:
            raise ValueError(f"{what} {item!r}: at least 1")
        out.add(n)
    if not out:
        raise ValueError(f"give at least one {what}, e.g. {example}")
    return sorted(out)


def human(nbytes: float) -> str:
    """Bytes as printed: '1 GiB', '64 MiB', '192 B'."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"
