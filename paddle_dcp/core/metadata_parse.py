"""Reading the checkpoint's metadata: JSON to :class:`~.metadata.Metadata`, validated.

Everything is validated before anything is allocated from it: the version, names of files,
dtypes, shapes and their products, piece boxes (inside the tensor, tiling it exactly) and byte
ranges (inside the files). Tensor entries are parsed one by one (:func:`_parse_tensor`, which
words every error) or many at once with numpy (:func:`_parse_many`, a load's lazy parse, the
validator of many entries; it calls the per-entry parse only to word an error).
"""
from __future__ import annotations

import base64
import binascii
import zlib
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import metafile, nested, quant
from .boxes import check_entry_tiling, check_inside
from .derive import DERIVED, DERIVED_DTYPES, SOURCE_DTYPES
from .dtypes import DTYPE_NAMES, itemsize
from ..errors import FormatError, PlanError
from .metadata import (
    _CHECKSUM,
    _HEX_DIGITS,
    _MAX_INT,
    CHECKSUM_ALGORITHMS,
    ENCODED_VERSION,
    FORMAT_NAME,
    JSON_VERSIONS,
    MAX_METADATA_BYTES,
    SUPPORTED_VERSIONS,
    FileEntry,
    LazyTensors,
    Metadata,
    PieceTable,
    TensorEntry,
    DigestVerdict,
    digest_matches,
    _frozen,
    blocks_of,
    check_file_name,
    stored_nbytes,
)
from .json_text import parse_json


def parse_metadata(
    data: bytes | str, source: str = "metadata", allow_subset: bool = False, lazy: bool = False
) -> Metadata:
    """Parse and validate metadata (the inverse of :meth:`Metadata.to_json`).

    The digest's verdict is part of the value returned (``Metadata.digest``); a full parse
    raises on a mismatch, a lazy one leaves that to :meth:`Metadata.check_digest`, which a
    load calls once the entries it uses have been validated.

    Args:
        data: the file's bytes.
        source: the file, as errors name it.
        allow_subset: accept the partial metadata ranks send each other (``subset``);
            never for a file read from disk.
        lazy: validate each tensor entry when it is first used instead of now (a load
            uses a few of a large checkpoint's tensors; errors name the key either way,
            and come before anything is read or allocated from the entry).

    Raises:
        FormatError: naming ``source`` and what is wrong, for anything malformed, out of
            bounds, or of an unsupported version.
    """
    if len(data) > MAX_METADATA_BYTES:
        raise FormatError(f"{source}: {len(data)} bytes is over the {MAX_METADATA_BYTES}-byte limit for metadata")
    if isinstance(data, str):
        data = data.encode()
    if metafile.has_head_line(data):  # version 3 and later: a head line, then packed sections
        if not metafile.is_packed(data):  # a later version: its head says which
            _check_format(_head_doc(data, source), source)
        try:
            return metafile.decode(data, source)
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError, IndexError) as exc:
            raise FormatError(f"{source}: malformed metadata ({type(exc).__name__}: {exc})") from None
    doc = parse_json(data, source, "the metadata")
    try:
        digest = DigestVerdict(digest_matches(data, doc), source)
        meta = _parse(doc, source, allow_subset, full=not lazy, size=len(data), digest=digest)
        if lazy:
            return meta
        meta.validate()
        meta.check_digest()
        return meta
    except (FormatError, PlanError) as exc:  # pieces that do not tile: a bad checkpoint
        if isinstance(exc, FormatError) and source in str(exc):
            raise
        raise FormatError(f"{source}: {exc}") from None
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise FormatError(f"{source}: malformed metadata ({type(exc).__name__}: {exc})") from None


# the packed ("z:") columns of one metadata file decode to at most this many times its size,
# plus PACKED_FLOOR bytes (docs/reliability.md, "Memory while refusing hostile metadata")
PACKED_RATIO = 64
PACKED_FLOOR = 4 << 20


class PackedBudget:
    """The bytes the packed columns of one metadata file may still decode to: every column is
    charged its length before it is decompressed (an entry that fails gets its charge back:
    its arrays are freed)."""

    def __init__(self, size: int):
        self.limit = PACKED_RATIO * size + PACKED_FLOOR
        self.left = self.limit
        self.size = size

    def take(self, nbytes: int, what: str) -> None:
        if nbytes > self.left:
            raise FormatError(
                f"{what}: {nbytes} bytes of packed columns would pass the bound of a {self.size}-byte metadata file "
                f"({PACKED_RATIO} times its size plus {PACKED_FLOOR >> 20} MiB, {self.limit - self.left} bytes used)"
            )
        self.left -= nbytes


def _decode_column(
    value: Any, count: int, what: str, hex_digits: bool = False, budget: PackedBudget | None = None
) -> np.ndarray:
    dtype = np.dtype("<u8") if hex_digits else np.dtype("<i8")
    if count < 0 or count > _MAX_INT // 8:
        raise FormatError(f"{what}: impossible length {count}")
    if isinstance(value, list):
        if len(value) != count:
            raise FormatError(f"{what}: {len(value)} entries, expected {count}")
        if hex_digits:
            if not all(isinstance(x, str) and _CHECKSUM.fullmatch(x) for x in value):
                raise FormatError(f"{what}: checksums must be 16 lowercase hex digits")
            return np.array([int(x, 16) for x in value], dtype=dtype)
        if not all(type(x) is int and -_MAX_INT <= x <= _MAX_INT for x in value):
            raise FormatError(f"{what}: entries must be integers")
        return np.array(value, dtype=dtype)
    if isinstance(value, str) and value.startswith("z:"):
        expected = count * 8
        if budget is not None:
            budget.take(expected, what)
        try:
            packed = base64.b64decode(value[2:], validate=True)
        except (binascii.Error, ValueError):
            raise FormatError(f"{what}: packed column is not base64") from None
        if expected > len(packed) * 1100 + 64:  # more than zlib can expand to: a lie
            raise FormatError(f"{what}: {count} entries cannot come from {len(packed)} packed bytes")
        try:
            d = zlib.decompressobj()
            raw = d.decompress(packed, expected)
            if d.unconsumed_tail or not d.eof:
                raise FormatError(f"{what}: packed column is longer than {count} entries")
        except zlib.error as exc:
            raise FormatError(f"{what}: packed column does not decompress ({exc})") from None
        if len(raw) != expected:
            raise FormatError(f"{what}: packed column holds {len(raw) // 8} entries, expected {count}")
        return np.frombuffer(raw, dtype=dtype)  # read-only, as every entry's arrays: no second copy
    raise FormatError(f"{what}: a column must be a list or a 'z:' packed string")


def _int(value: Any, what: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise FormatError(f"{what} must be an integer in [{lo}, {hi}], found {str(value)[:40]!r}")
    return value


def _parse(
    doc: Any, source: str, allow_subset: bool, full: bool = True, size: int = MAX_METADATA_BYTES,
    digest: DigestVerdict = DigestVerdict(),
) -> Metadata:
    """The metadata of the JSON document ``doc``: header, files and structure validated now,
    tensor entries when first used (all of them at once by :meth:`Metadata.validate`)."""
    version = _check_format(doc, source)
    unique_id = _int(doc["unique_id"], "unique_id")
    world_size = _int(doc["world_size"], "world_size", 1, 1 << 24)
    checksum = doc["checksum"]
    algorithm = checksum["algorithm"]
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise FormatError(f"{source}: unknown checksum algorithm {str(algorithm)[:40]!r}")
    block_bytes = _int(checksum["block_bytes"], "checksum.block_bytes", 64, 1 << 30)
    created_by = doc.get("created_by", "")
    if not isinstance(created_by, str):
        raise FormatError(f"{source}: created_by must be a string")
    files = _parse_files(doc["files"], source)
    file_sizes = np.array([f.nbytes for f in files], dtype=np.int64)
    tensors_doc = doc["tensors"]
    if not isinstance(tensors_doc, dict):
        raise FormatError(f"{source}: tensors must be an object")
    subset = _flag(doc, "subset", source)
    if subset and not allow_subset:
        raise FormatError(f"{source}: a metadata file on disk must describe whole tensors (subset is set)")
    replicas = _flag(doc, "replicas", source)
    holders = doc.get("holders", [])
    if holders and not subset or not isinstance(holders, list) or not all(
        isinstance(p, list) and len(p) <= 64 and all(type(c) in (str, int) for c in p) for p in holders
    ):
        raise FormatError(f"{source}: holders must be a list of paths, in a part of the metadata only")

    budget = PackedBudget(size)

    def parse_tensor(key: str, t: Any) -> TensorEntry:
        left = budget.left
        try:
            return _parse_tensor(
                key, t, file_sizes, block_bytes, tiling=full, require_cover=not subset, size=size, replicas=replicas,
                version=version, docs=tensors_doc, budget=budget,
            )
        except (FormatError, PlanError) as exc:  # pieces that do not tile: a bad checkpoint
            budget.left = left  # a refused entry keeps nothing it decoded
            raise FormatError(f"{source}: {exc}") from None
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            budget.left = left
            raise FormatError(f"{source}: tensor {key!r}: malformed entry ({type(exc).__name__}: {exc})") from None

    def parse_many(keys: list[str]) -> dict[str, TensorEntry]:
        if full:  # a full parse checks the tiling, tensor by tensor
            return {}
        return _parse_many(
            keys, tensors_doc, file_sizes, block_bytes, size, lambda k: parse_tensor(k, tensors_doc[k]), version
        )

    tensors = LazyTensors(tensors_doc, parse_tensor, parse_many)
    structure = doc["structure"]
    _check_structure(structure, tensors, source, subset)
    return Metadata(
        unique_id=unique_id,
        world_size=world_size,
        files=files,
        tensors=tensors,
        structure=structure,
        block_bytes=block_bytes,
        checksum_algorithm=algorithm,
        created_by=created_by,
        format_version=version,
        subset=subset,
        replicas=replicas,
        digest=digest,
        holders=frozenset(tuple(p) for p in holders),
    )


def _head_doc(data: bytes, source: str) -> Any:
    """The JSON of a head line (what a version after 3 is known by)."""
    end = data.find(b"\n")
    if end < 0:
        raise FormatError(f"{source}: the head line has no end")
    return parse_json(data[:end], source, "the head line")


def _check_format(doc: Any, source: str) -> int:
    """The document's format version, checked to be one this code reads as one JSON document."""
    if not isinstance(doc, dict):
        raise FormatError(f"{source}: metadata must be a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{source}: not a paddle_dcp metadata file (format={str(doc.get('format'))[:40]!r})")
    version = doc.get("format_version")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise FormatError(
            f"{source}: format_version {str(version)[:20]!r} is not supported; this paddle_dcp "
            f"reads versions {', '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    if version not in JSON_VERSIONS:
        raise FormatError(
            f"{source}: format_version {version} is written as a head line followed by packed sections, "
            f"not as one JSON document; this file is damaged or was not written by paddle_dcp"
        )
    return version


def _parse_files(files_doc: Any, source: str) -> tuple[FileEntry, ...]:
    """The data files: plain names, each listed once, with their sizes."""
    if not isinstance(files_doc, list):
        raise FormatError(f"{source}: files must be a list")
    files = []
    seen_names = set()
    for i, f in enumerate(files_doc):
        name = check_file_name(f["name"], f"{source}: files[{i}]")
        if name in seen_names:
            raise FormatError(f"{source}: file {name!r} is listed twice")
        seen_names.add(name)
        files.append(FileEntry(name, _int(f["bytes"], f"files[{i}].bytes")))
    return tuple(files)


def _flag(doc: dict, name: str, source: str) -> bool:
    """An optional boolean member of the document (false when absent)."""
    value = doc.get(name, False)
    if type(value) is not bool:
        raise FormatError(f"{source}: {name} must be true or false")
    return value


def _check_structure(structure: Any, tensors: Mapping[str, TensorEntry], source: str, subset: bool = False) -> None:
    """The structure's plain values decode, and its tensor leaves are the tensors' keys (of a
    part of the metadata, whose structure may be the checkpoint's outline, are any of them)."""
    leaves = set()
    for path, tag, node in nested.walk(structure):
        if tag == "t":
            leaves.add(nested.flat_key(path))
        elif tag in ("v", "f"):
            nested.decode_value(node, nested.flat_key(path))
        elif tag == "x":
            raise FormatError(f"{source}: value {nested.flat_key(path)!r} has no value")
    if not subset and leaves != set(tensors):
        extra = sorted(leaves ^ set(tensors))[:5]
        raise FormatError(f"{source}: structure and tensors disagree on keys {extra}")


def _shape_and_count(key: str, t: dict, size: int) -> tuple[tuple[int, ...], int]:
    """A tensor entry's global shape and piece count, validated (FormatError otherwise)."""
    shape_doc = t["shape"]
    if not isinstance(shape_doc, list) or len(shape_doc) > 64:
        raise FormatError(f"tensor {key!r}: shape must be a list of at most 64 integers")
    shape = tuple(_int(s, f"tensor {key!r}: shape entry") for s in shape_doc)
    volume = 1
    for s in shape:
        volume *= s
        if volume * 16 > _MAX_INT:
            raise FormatError(f"tensor {key!r}: shape {shape} has too many elements")
    count = _int(t["count"], f"tensor {key!r}: count", 0, 1 << 40)
    # every piece costs the file at least a byte: a larger count is a lie, refused before
    # anything is decompressed or allocated for it
    if count > size or count > max(volume, 1):
        raise FormatError(
            f"tensor {key!r}: {count} pieces cannot be described by a {size}-byte metadata file or "
            f"fit a tensor of {volume} elements"
        )
    return shape, count


def _parse_many(
    keys: list[str],
    docs: dict,
    file_sizes: np.ndarray,
    block_bytes: int,
    size: int,
    word: Callable[[str], TensorEntry],
    version: int = 1,
) -> dict[str, TensorEntry]:
    """Many tensor entries at once, validated as :func:`_parse_tensor` does without tiling,
    with numpy over the pieces of all of them rather than per tensor: this pass is the
    validator of the entries it returns. Entries whose columns are packed (``z:`` strings) are
    left to the per-entry parse on first use, which decodes them. Returns key -> entry."""
    rows, _, _ = _plain_rows(keys, docs, size, version)  # entries refused here: worded on first use
    entries = _vectorised(rows, file_sizes, block_bytes)
    if entries is not None:
        return entries
    # Some entry was refused: the per-entry parse (``word``) runs only to find which (left out,
    # their error worded by it on first use); the rest must pass again. Refused together but
    # accepted alone would mean the two disagree: an error, never a silent fallback.
    good = [r for r in rows if _parses(word, r[0])]
    entries = _vectorised(good, file_sizes, block_bytes) if len(good) < len(rows) else None
    if entries is None:
        raise FormatError(f"tensor entries {[r[0] for r in rows][:5]}: refused together, though each parses alone")
    return entries


def _parses(word: Callable[[str], TensorEntry], key: str) -> bool:
    try:
        word(key)
    except FormatError:
        return False
    return True


def _vectorised(rows: list["_Row"], file_sizes: np.ndarray, block_bytes: int) -> dict[str, TensorEntry] | None:
    """The entries of ``rows`` (see :func:`_plain_rows`), their columns checked together with
    numpy: integers in range, boxes inside their tensors, files in the list, byte ranges
    inside their files, checksums of the right count; None when any entry fails a check."""
    if not rows:
        return {}
    rows.sort(key=lambda r: len(r[2]))  # tensors of one rank are neighbours: their boxes stack
    columns = _stacked_columns(rows, len(file_sizes))
    if columns is None:
        return None
    off, shp, fil, byt, hex_digits = columns
    counts = np.array([r[3] for r in rows], dtype=np.int64)
    nbytes = _piece_nbytes(rows, counts, shp)
    if len(byt) and ((byt < 0) | (byt > file_sizes[fil] - nbytes)).any():
        return None
    nblocks = blocks_of(nbytes, block_bytes)
    piece_start = np.concatenate([[0], np.cumsum(counts)])
    block_start_all = np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int64)
    block_start = block_start_all[piece_start]
    if int(block_start[-1]) * 16 != len(hex_digits) or any(
        len(r[4][4]) != int(block_start[i + 1] - block_start[i]) for i, r in enumerate(rows)
    ):
        return None
    checksums = np.frombuffer(bytes.fromhex(hex_digits), dtype=">u8").astype("<u8")
    for a in (off, shp, fil, byt, checksums):
        a.flags.writeable = False
    # one entry per tensor: views of the arrays above
    out = {}
    box_at = 0
    for i, (key, dtype, shape, count, _, encoding) in enumerate(rows):
        p0, p1 = int(piece_start[i]), int(piece_start[i + 1])
        d = len(shape)
        box_end = box_at + count * d
        pieces = PieceTable(
            offsets=off[box_at:box_end].reshape(count, d),
            shapes=shp[box_at:box_end].reshape(count, d),
            files=fil[p0:p1],
            byte_offsets=byt[p0:p1],
            checksums=checksums[int(block_start[i]) : int(block_start[i + 1])],
        )
        box_at = box_end
        entry = out[key] = TensorEntry(
            key=key, dtype=dtype, shape=shape, pieces=pieces, block_bytes=block_bytes, encoding=encoding
        )
        starts = block_start_all[p0 : p1 + 1] - block_start_all[p0]
        object.__setattr__(entry, "_starts", _frozen(starts))
    return out


# a tensor entry taken by _parse_many: (key, dtype, shape, count, its five columns, encoding)
_Row = Tuple[str, str, Tuple[int, ...], int, List[list], Optional[str]]


def _plain_rows(
    keys: Sequence[str], docs: dict, size: int, version: int = 1
) -> tuple[list[_Row], list[str], list[str]]:
    """(the entries of ``keys`` whose columns are JSON lists, plain fields and column lengths
    checked as _parse_tensor checks them; keys whose columns are not lists; keys refused)."""
    rows: list[_Row] = []
    packed, refused = [], []
    for key in keys:
        t = docs.get(key)
        try:
            if not isinstance(t, dict) or t["dtype"] not in DTYPE_NAMES:
                refused.append(key)
                continue
            shape, count = _shape_and_count(key, t, size)
            encoding = _encoding(key, t, t["dtype"], version)
            cols = [t["offsets"], t["shapes"], t["file"], t["byte_offset"], t["checksums"]]
        except (KeyError, TypeError, ValueError, FormatError):
            refused.append(key)
            continue
        if encoding == DERIVED or "source" in t:  # no pieces to vectorise; its source checked on first use
            packed.append(key)
            continue
        if any(type(c) is not list for c in cols):
            packed.append(key)
            continue
        n = count * len(shape)
        if (not shape and count > 1) or len(cols[0]) != n or len(cols[1]) != n or len(cols[2]) != count or len(cols[3]) != count:
            refused.append(key)  # a scalar is one piece; columns of the count's lengths
            continue
        rows.append((key, t["dtype"], shape, count, cols, encoding))
    return rows, packed, refused


def _stacked_columns(
    rows: Sequence[_Row], nfiles: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str] | None:
    """Every column of every row in one array each (offsets, shapes, files, byte offsets)
    and the checksums' hex digits, checked: integers in range, boxes inside their tensors,
    files in the list, checksums 16 lowercase hex digits. None at the first doubt."""
    offsets, shapes, files, byte_offsets, sums = [], [], [], [], []
    limits: list[int] = []
    for _, _, shape, count, cols, _ in rows:
        offsets += cols[0]
        shapes += cols[1]
        limits += shape * count
        files += cols[2]
        byte_offsets += cols[3]
        sums += cols[4]
    ints = offsets + shapes + files + byte_offsets
    if not set(map(type, ints)) <= {int} or not set(map(type, sums)) <= {str} or not set(map(len, sums)) <= {16}:
        return None
    hex_digits = "".join(sums)
    if not _HEX_DIGITS.fullmatch(hex_digits):
        return None
    try:
        packed = np.array(ints, dtype=np.int64)
    except OverflowError:
        return None
    if len(packed) and ((packed < -_MAX_INT) | (packed > _MAX_INT)).any():
        return None
    n_box = len(offsets)
    off, shp = packed[:n_box], packed[n_box : 2 * n_box]
    fil = packed[2 * n_box : 2 * n_box + len(files)]
    byt = packed[2 * n_box + len(files) :]
    lim = np.array(limits, dtype=np.int64)
    # compared without forming offsets + shapes, which could wrap around (as check_inside)
    if n_box and ((off < 0) | (shp <= 0) | (shp > lim) | (off > lim - shp)).any():
        return None
    if len(fil) and ((fil < 0) | (fil >= nfiles)).any():
        return None
    return off, shp, fil, byt, hex_digits


def _piece_nbytes(rows: Sequence[_Row], counts: np.ndarray, shp: np.ndarray) -> np.ndarray:
    """Stored bytes of every piece: the product of its shape row times the item size (or the
    encoded blocks', for an entry with an encoding), the rows sorted by rank so that each
    rank's shapes form one matrix."""
    ndims = np.array([len(r[2]) for r in rows], dtype=np.int64)
    elements = np.ones(int(counts.sum()), dtype=np.int64)
    at = 0
    for d in sorted(set(ndims.tolist())):  # (np.unique imports numpy.ma on first use: 20 ms)
        m = int(counts[ndims == d].sum())
        if d and m:
            elements[at : at + m] = np.prod(shp[int(counts[ndims < d] @ ndims[ndims < d]) :][: m * d].reshape(m, d), axis=1)
        at += m
    nbytes = elements * np.repeat(np.array([itemsize(r[1]) for r in rows], dtype=np.int64), counts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for i, r in enumerate(rows):
        if r[5] is not None:
            lo, hi = int(starts[i]), int(starts[i + 1])
            nbytes[lo:hi] = stored_nbytes(elements[lo:hi], r[1], r[5])
    return nbytes


def check_entry(entry: TensorEntry, replicas: bool) -> None:
    """The pieces of a parsed entry tile its tensor (:func:`check_entry_tiling`); pieces that
    do not are a FormatError, as everywhere the metadata is read. A derived entry has none
    (its source's are checked as that tensor's)."""
    if entry.derived:
        return
    p = entry.pieces
    try:
        check_entry_tiling(entry.key, entry.shape, p.offsets, p.shapes, p.files, replicas)
    except PlanError as exc:
        raise FormatError(str(exc)) from None


def _parse_tensor(
    key: str,
    t: Any,
    file_sizes: np.ndarray,
    block_bytes: int,
    tiling: bool = True,
    require_cover: bool = True,
    size: int = MAX_METADATA_BYTES,
    replicas: bool = False,
    version: int = 1,
    docs: Mapping[str, Any] | None = None,
    budget: PackedBudget | None = None,
) -> TensorEntry:
    """One tensor entry, validated (its packed columns charged to ``budget``). With ``tiling`` off (a load's lazy parse) the pieces are
    checked to lie inside the tensor but not to tile it: a load then checks that the pieces it
    uses cover each of its boxes exactly, which is all it relies on. With ``replicas``, rows
    with exactly equal boxes are copies of one piece (each in another file); the distinct
    boxes must tile the tensor. A derived entry is checked against its source's entry in
    ``docs`` (every tensor's, as in the file) and has no pieces."""
    if not isinstance(t, dict):
        raise FormatError(f"tensor {key!r}: entry must be an object")
    dtype = t["dtype"]
    if dtype not in DTYPE_NAMES:
        raise FormatError(f"tensor {key!r}: unknown dtype {str(dtype)[:40]!r}; supported: {', '.join(DTYPE_NAMES)}")
    shape, count = _shape_and_count(key, t, size)
    encoding = _encoding(key, t, dtype, version)
    source = _source(key, t, shape, count, encoding, docs or {})
    ndim = len(shape)
    what = f"tensor {key!r}"
    offsets = _decode_column(t["offsets"], count * ndim, f"{what}: offsets", budget=budget).reshape(count, ndim)
    shapes = _decode_column(t["shapes"], count * ndim, f"{what}: shapes", budget=budget).reshape(count, ndim)
    files = _decode_column(t["file"], count, f"{what}: file", budget=budget)
    byte_offsets = _decode_column(t["byte_offset"], count, f"{what}: byte_offset", budget=budget)
    if tiling and source is None:
        check_entry_tiling(key, shape, offsets, shapes, files, replicas, require_cover)
    else:
        check_inside(key, shape, offsets, shapes)
    if count and ((files < 0) | (files >= len(file_sizes))).any():
        raise FormatError(f"{what}: a piece names a file index outside the file list")
    nbytes = stored_nbytes(np.prod(shapes, axis=1, dtype=np.int64), dtype, encoding)
    if count:
        # compared without forming byte_offsets + nbytes, which could wrap around
        bad = (byte_offsets < 0) | (byte_offsets > file_sizes[files] - nbytes)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise FormatError(
                f"{what}: piece {i} reads {int(nbytes[i])} bytes from offset {int(byte_offsets[i])}, "
                f"past the end of its file ({int(file_sizes[files[i]])} bytes)"
            )
    nblocks = int(blocks_of(nbytes, block_bytes).sum()) if count else 0
    checksums = _decode_column(t["checksums"], nblocks, f"{what}: checksums", hex_digits=True, budget=budget)
    pieces = PieceTable(
        offsets=_frozen(offsets),
        shapes=_frozen(shapes),
        files=_frozen(files),
        byte_offsets=_frozen(byte_offsets),
        checksums=_frozen(checksums),
    )
    return TensorEntry(
        key=key, dtype=dtype, shape=shape, pieces=pieces, block_bytes=block_bytes, encoding=encoding, source=source
    )


def _encoding(key: str, t: dict, dtype: str, version: int) -> str | None:
    """A tensor entry's encoding (None when absent: its pieces are raw bytes), checked: one
    this version reads, in a file of a version that has encodings, of a dtype it can store."""
    if "encoding" not in t:
        return None
    name = t["encoding"]
    what = f"tensor {key!r}: encoding {str(name)[:40]!r}"
    if version < ENCODED_VERSION:
        raise FormatError(f"{what} in a format_version {version} file: encodings came with version {ENCODED_VERSION}")
    if type(name) is not str or (name not in quant.ENCODINGS and name != DERIVED):
        raise FormatError(
            f"{what} is unknown: this paddle_dcp reads {', '.join(sorted(quant.ENCODINGS) + [DERIVED])}; "
            f"a newer paddle_dcp may read it"
        )
    holds = DERIVED_DTYPES if name == DERIVED else quant.ENCODABLE
    if dtype not in holds:
        raise FormatError(f"{what} cannot hold dtype {dtype}; it holds {', '.join(holds)}")
    return name


def _source(
    key: str, t: dict, shape: tuple[int, ...], count: int, encoding: str | None, docs: Mapping[str, Any]
) -> str | None:
    """A derived entry's source key, checked against the source's entry in ``docs``: another
    tensor of the checkpoint, stored (not derived: no chain, no cycle), float16 or bfloat16,
    of the same shape; and the derived entry has no pieces. None for any other entry."""
    what = f"tensor {key!r} (derived)"
    if encoding != DERIVED:
        if "source" in t:
            raise FormatError(f"tensor {key!r}: has a source but is not derived (encoding {str(encoding)[:40]!r})")
        return None
    source = t.get("source")
    if type(source) is not str:
        raise FormatError(f"{what}: its source must be a tensor key, found {str(source)[:40]!r}")
    if count:
        raise FormatError(f"{what} from {source[:200]!r} is stored too ({count} pieces): a derived tensor has none")
    entry = docs.get(source)
    if source == key or (isinstance(entry, dict) and entry.get("encoding") == DERIVED):
        raise FormatError(f"{what}: its source {source[:200]!r} is derived itself (a chain or a cycle)")
    if not isinstance(entry, dict):
        raise FormatError(f"{what}: its source {source[:200]!r} is not a tensor of the checkpoint")
    if entry.get("dtype") not in SOURCE_DTYPES:
        raise FormatError(
            f"{what}: its source {source[:200]!r} is {str(entry.get('dtype'))[:40]}; a tensor derives from "
            f"{' or '.join(SOURCE_DTYPES)}"
        )
    if entry.get("shape") != list(shape):
        raise FormatError(f"{what}: shape {shape}, its source {source[:200]!r} has shape {str(entry.get('shape'))[:80]}")
    return source
