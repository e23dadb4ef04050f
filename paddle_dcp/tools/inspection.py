"""The ``inspect`` command: a checkpoint directory's ids (complete, incomplete, temporary files)
and, for one checkpoint, every tensor, data file and plain value, as a table or as JSON."""
from __future__ import annotations

import json
from typing import Any, Sequence

from ..core import nested
from ..errors import DcpError, FormatError, StorageError
from ..io import open_storage
from ..io.storage import list_checkpoints, read_metadata
from .console import (
    EXIT_OK,
    EXIT_PROBLEMS,
    PROG,
    _directory,
    _err,
    _ids,
    _one_line,
    _out,
    choose_id,
    human,
    incomplete_ids,
)


def describe(path: str, unique_id: int | None = None) -> dict:
    """What ``inspect`` reports, as one JSON-ready dict: the ids in ``path`` and, for the chosen
    checkpoint, every tensor, data file and plain value. Entries of the metadata that fail
    validation are listed in ``problems`` (the rest is still described). A tensor stored
    quantized also has its ``encoding`` and ``stored_bytes`` (absent for the others); a derived
    one its ``encoding`` ``"derived"``, ``stored_bytes`` 0 and its ``source`` key."""
    listing = list_checkpoints(open_storage(path))
    doc: dict[str, Any] = {
        "path": path,
        "complete": sorted(listing.complete),
        "incomplete": incomplete_ids(listing),
        "temporary": list(listing.temporary),
        "checkpoint": None,
        "problems": [],
    }
    try:
        uid = choose_id(path, listing, unique_id)
        meta = read_metadata(open_storage(path), uid, lazy=True)
    except (FormatError, StorageError) as exc:
        doc["problems"].append(_one_line(exc))
        return doc
    tensors, tensor_bytes = {}, 0
    for key in meta.tensors:
        try:
            entry = meta.tensors[key]
        except DcpError as exc:
            doc["problems"].append(_one_line(exc))
            tensors[key] = {"error": _one_line(exc)}
            continue
        tensors[key] = {
            "shape": list(entry.shape),
            "dtype": entry.dtype,
            "pieces": entry.pieces.count,
            "bytes": entry.nbytes,
        }
        if entry.encoding is not None:
            tensors[key].update(encoding=entry.encoding, stored_bytes=int(entry.piece_nbytes().sum()))
        if entry.source is not None:
            tensors[key]["source"] = entry.source
        tensor_bytes += entry.nbytes
    doc["checkpoint"] = {
        "unique_id": uid,
        "format_version": meta.format_version,
        "world_size": meta.world_size,
        "created_by": meta.created_by,
        "checksum": meta.checksum_algorithm,
        "block_bytes": meta.block_bytes,
        "tensors": tensors,
        "files": [{"name": f.name, "bytes": f.nbytes} for f in meta.files],
        "values": meta.values(),
        "tensor_bytes": tensor_bytes,
        "file_bytes": sum(f.nbytes for f in meta.files),
    }
    return doc


def _table(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if rt else c.ljust(w) for c, w, rt in zip(r, widths, right)]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def render_inspect(doc: dict) -> list[str]:
    lines = [f"checkpoint directory {doc['path']}"]
    lines.append(f"  complete ids: {_ids(doc['complete'])}")
    if doc["incomplete"]:
        lines.append(f"  incomplete ids: {_ids(doc['incomplete'])} (data files without metadata)")
    if doc["temporary"]:
        lines.append(f"  temporary files of unfinished saves: {len(doc['temporary'])}")
        lines += [f"    {name}" for name in doc["temporary"]]
    ck = doc["checkpoint"]
    if ck is None:
        return lines
    lines.append(
        f"checkpoint {ck['unique_id']}: format_version {ck['format_version']}, world_size {ck['world_size']}, "
        f"created by {ck['created_by'] or 'unknown'}, {ck['checksum']} per {ck['block_bytes']}-byte block"
    )
    lines.append(f"tensors: {len(ck['tensors'])}")
    if ck["tensors"]:
        lines += _tensor_table(ck["tensors"])
    lines.append(f"files: {len(ck['files'])}")
    if ck["files"]:
        lines += _table([("name", "bytes")] + [(f["name"], str(f["bytes"])) for f in ck["files"]], (False, True))
    lines.append(f"values: {len(ck['values'])}")
    lines += [f"  {k} = {json.dumps(v)}" for k, v in ck["values"].items()]
    lines.append(
        f"total: {ck['tensor_bytes']} bytes ({human(ck['tensor_bytes'])}) in {len(ck['tensors'])} tensors; "
        f"{ck['file_bytes']} bytes in {len(ck['files'])} data files"
    )
    return lines


def _tensor_table(tensors: dict) -> list[str]:
    """One row per tensor; with an ``encoding`` and ``stored`` column when some tensor is
    stored quantized or derived (``-`` for those that are not; ``derived from <key>``)."""
    encoded = any("encoding" in t for t in tensors.values())
    extra = ("encoding", "stored") if encoded else ()
    rows = [("key", "shape", "dtype", "pieces", "bytes") + extra]
    for key, t in tensors.items():
        if "error" in t:
            rows.append((key, "?", "?", "?", "invalid entry") + ("?",) * len(extra))
            continue
        row = (key, str(tuple(t["shape"])), t["dtype"], str(t["pieces"]), str(t["bytes"]))
        if encoded:
            encoding = f"derived from {t['source']}" if "source" in t else t.get("encoding", "-")
            row += (encoding, str(t.get("stored_bytes", t["bytes"])))
        rows.append(row)
    return _table(rows, (False, False, False, True, True) + (False, True)[: len(extra)])


def cmd_inspect(args) -> int:
    path = _directory(args.path)
    doc = describe(path, args.unique_id)
    if args.json:
        if doc["checkpoint"] is not None:
            doc["checkpoint"]["values"] = {k: nested.json_plain(v) for k, v in doc["checkpoint"]["values"].items()}
        for line in json.dumps(doc, indent=1, allow_nan=False).split("\n"):  # escapes inside strings
            _out(line)
    else:
        for line in render_inspect(doc):
            _out(line)
        for problem in doc["problems"]:
            _err(f"{PROG}: {problem}")
    return EXIT_PROBLEMS if doc["problems"] else EXIT_OK
