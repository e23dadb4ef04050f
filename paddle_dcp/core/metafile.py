"""Metadata files of format version 3: a JSON head line, then packed sections that a reader
may read whole or in parts (docs/format.md, "Version 3").

Versions 1 and 2 wrote every tensor's entry into one JSON document: at a hundred thousand
tensors and a million pieces that is a hundred megabytes every rank reads and parses whole.
Version 3 holds the same content in a form whose cost grows with what is used:

* the head (the first line, JSON): the checkpoint's fields, its plain values (``outline``) and
  where everything else lies, under its own digest;
* the ``files``, ``structure`` and ``index`` sections, zlib-compressed, each under a digest the
  head holds: the data files, the nesting (plain values as placeholders), the directory of the
  tensor parts;
* the tensor parts, sorted by key, each its rows zlib-compressed followed by the digests of its
  tensors' groups, under a digest the index holds: per tensor its dtype, shape, encoding, where
  its pieces lie and their layout, the cuts of its grid (:mod:`~paddle_dcp.core.grids`) or, for
  any other layout, its boxes in the ``boxes`` area;
* fixed-width areas read by byte range: ``records`` (every piece's file and byte offset),
  ``boxes`` and ``sums`` (every block checksum); every group of 32 pieces of a tensor, its
  records, boxes and checksums, is under a digest its tensor's row holds.

A rank that loads a few hundred tensors of a large checkpoint reads the head, the files, the
index, the parts that hold its keys and the groups that hold its pieces (:func:`read_part`);
a tool reads everything (:func:`decode`). Every number the file claims is checked against the
bytes there are before anything is allocated from it. This module is the front of three:
:mod:`.metafile_layout` (what the file is made of), :mod:`.metafile_write`,
:mod:`.metafile_read`.
"""
from __future__ import annotations

from .metafile_layout import (  # noqa: F401 - the format's interface
    GROUP, PARTS_FROM, VERSION, Fetch, has_head_line, is_packed, read_head, worth_parts,
)
from .metafile_read import Rounds, Start, decode, part_rounds, read_part, read_start  # noqa: F401
from .metafile_write import columns_of, encode, outline_of  # noqa: F401
