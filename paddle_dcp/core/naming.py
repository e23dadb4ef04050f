"""Names of a checkpoint's files: what is data, metadata, or a save's temporary file."""
from __future__ import annotations

import re

# every pattern matches a whole name: "\Z", not "$" (which also matches before a final newline),
# and ASCII digits only (int() would read other scripts' digits as the same number)
METADATA_RE = re.compile(r"^([0-9]+)\.metadata\Z")
# {rank}_{id}.distcp, or {rank}_{id}.{generation}.distcp for a save that replaced a checkpoint;
# .safetensors instead of .distcp for a save with safetensors=True (the same pieces, and a
# safetensors header naming them)
DATA_RE = re.compile(r"^([0-9]+)_([0-9]+)(?:\.([0-9]+))?\.(?:distcp|safetensors)\Z")
DATA_SUFFIXES = ("distcp", "safetensors")
TMP_MARK = ".tmp."
# {id}.{generation}.claim: a save's claim of the id and generation it writes (docs/format.md),
# created exclusively before any of its files: two saves never write under the same names
CLAIM_RE = re.compile(r"^([0-9]+)\.([0-9]+)\.claim\Z")
TMP_RE = re.compile(r"^(?:([0-9]+)_)?([0-9]+)(?:\.([0-9]+))?\.(?:distcp|safetensors|metadata)\.tmp\.[0-9a-f]+\Z")


def claim_name(unique_id: int, generation: int) -> str:
    return f"{unique_id}.{generation}.claim"


def parse_claim_name(name: str) -> tuple[int, int] | None:
    """(unique id, generation) of a claim's name, or None."""
    m = CLAIM_RE.match(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def metadata_name(unique_id: int) -> str:
    return f"{unique_id}.metadata"


def parse_data_name(name: str) -> tuple[int, int, int] | None:
    """(rank, unique id, generation) of a data file's name, or None."""
    m = DATA_RE.match(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def data_file_name(rank: int, unique_id: int, generation: int = 0, suffix: str = "distcp") -> str:
    """The name of a rank's data file: generation 0 is ``{rank}_{id}.distcp``; a save that
    replaces a checkpoint of the same id writes the next generation beside it, so the old one
    stays loadable until the new metadata lands. ``suffix`` is ``safetensors`` for a save with
    ``safetensors=True``."""
    if suffix not in DATA_SUFFIXES:
        raise ValueError(f"data file suffix {suffix!r} is not one of {DATA_SUFFIXES}")
    return f"{rank}_{unique_id}.{suffix}" if generation == 0 else f"{rank}_{unique_id}.{generation}.{suffix}"
