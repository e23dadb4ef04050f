"""A metadata file of format version 3 cut into its fields and put back together, written from
docs/format.md ("Version 3") alone: the fuzz (tests/integration/test_fuzz_v3.py) edits one
field, any value of any type, then writes the file again with every length, offset and digest
made to match (so that the edit reaches the reader's checks behind the digests), or with one
of them left stale.

:func:`split` gives a :class:`Fields`; :func:`join` its bytes. Group digests are recomputed
over the byte ranges the groups had in the file :func:`split` read (``Fields.groups``): an
edit of the records, boxes or checksums then passes the digests, an edit of a row that moves
them does not.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

import numpy as np
import xxhash

import metadoc

GROUP = 32


def unshuffle(buf: bytes, n: int) -> list[int]:
    raw = np.frombuffer(buf, dtype=np.uint8, count=8 * n).reshape(8, n)
    return np.ascontiguousarray(raw.T).view("<i8").reshape(n).tolist()


def shuffle(values) -> bytes:
    return np.asarray(values, dtype=np.int64).astype("<i8").reshape(-1).view(np.uint8).reshape(-1, 8).T.tobytes()


def u64(n: int) -> bytes:
    return int(n % 2**64).to_bytes(8, "little")


def take_names(blob: bytes, at: int, lengths) -> tuple[list[bytes], int]:
    out = []
    for n in lengths:
        out.append(blob[at : at + n])
        at += n
    return out, at


@dataclass
class Part:
    cols: list[list[int]]  # the 11 columns of the rows (docs/format.md's order)
    shapes: list[int]
    ncuts: list[int]
    gaps: list[int]
    keys: list[bytes]
    sources: list[bytes]
    digests: list[int]
    counts: dict = field(default_factory=dict)  # "n", "ncuts", "gaps": a count written instead of the true one


@dataclass
class Fields:
    head: dict
    sizes: list[int]  # the files section
    names: list[bytes]
    structure: bytes  # raw JSON
    index_cols: list[list[int]]  # key_len, size, packed, raw, count (recomputed but for the ones edited)
    index_digests: list[int]
    first_keys: list[bytes]
    parts: list[Part]
    records: bytes
    boxes: bytes
    sums: bytes
    groups: list[tuple[int, int, int, int, int, int]]  # each group's record, box and checksum ranges
    counts: dict = field(default_factory=dict)  # "files", "index": a count written instead of the true one
    fixed: set = field(default_factory=set)  # ("index", col, part) values kept as edited
    stale: set = field(default_factory=set)  # "head", "files", "structure", "index", ("part", i), "groups"
    tail: bytes = b""  # bytes after the body
    record_width: int = 0  # as the file split had it


def split(data: bytes, groups: bool = True) -> Fields:
    end = data.index(b"\n")
    head = json.loads(data[:end])
    head.pop("digest")
    body = data[end + 1 :]

    def section(name):
        at, n, _, _ = head["sections"][name]
        return zlib.decompress(body[at : at + n])

    files = section("files")
    nf = int.from_bytes(files[:8], "little")
    sizes, lens = unshuffle(files[8:], nf), unshuffle(files[8 + 8 * nf :], nf)
    names, _ = take_names(files, 8 + 16 * nf, lens)
    index = section("index")
    np_ = int.from_bytes(index[:8], "little")
    flat = unshuffle(index[8:], 5 * np_)
    icols = [flat[i * np_ : (i + 1) * np_] for i in range(5)]
    at = 8 + 40 * np_
    idig = np.frombuffer(index[at : at + 8 * np_], "<u8").tolist()
    first_keys, _ = take_names(index, at + 8 * np_, icols[0])
    area = {name: body[a : a + n] for name, (a, n) in head["areas"].items()}
    parts, at = [], 0
    for p in range(np_):
        blob = area["parts"][at : at + icols[1][p]]
        at += icols[1][p]
        raw = zlib.decompress(blob[: icols[2][p]])
        n = int.from_bytes(raw[:8], "little")
        flat = unshuffle(raw[8:], 11 * n)
        cols = [flat[i * n : (i + 1) * n] for i in range(11)]
        k = 8 + 88 * n
        shapes = unshuffle(raw[k:], sum(cols[4]))
        k += 8 * sum(cols[4])
        ns = int.from_bytes(raw[k : k + 8], "little")
        ncuts = unshuffle(raw[k + 8 :], ns)
        k += 8 + 8 * ns
        ng = int.from_bytes(raw[k : k + 8], "little")
        gaps = unshuffle(raw[k + 8 :], ng)
        k += 8 + 8 * ng
        keys, k = take_names(raw, k, cols[0])
        sources, k = take_names(raw, k, cols[1])
        parts.append(Part(cols, shapes, ncuts, gaps, keys, sources, np.frombuffer(blob[icols[2][p] :], "<u8").tolist()))
    return Fields(head, sizes, names, section("structure"), icols, idig, first_keys, parts, area["records"],
                  area["boxes"], area["sums"], _groups(data, head, parts) if groups else [],
                  record_width=head["widths"]["file"] + head["widths"]["offset"])


def _groups(data: bytes, head: dict, parts: list[Part]) -> list[tuple]:
    """Every group's byte ranges in the records, boxes and sums areas, in key order (each
    piece's checksum count from its box, as docs/format.md counts them)."""
    doc = metadoc.read(data)
    w = head["widths"]["file"] + head["widths"]["offset"]
    bb = head["checksum"]["block_bytes"]
    out = []
    rows = [(c, p) for p in parts for c in zip(*p.cols)]
    keys = sorted(doc["tensors"])
    for key, (row, _) in zip(keys, rows):
        t = doc["tensors"][key]
        nd, count, fp, fb, fx = row[4], row[6], row[7], row[8], row[10]
        nblocks = [max(1, -(-metadoc._stored(t["dtype"], t.get("encoding"), t["shapes"][i * nd : (i + 1) * nd]) // bb))
                   for i in range(count)]
        cum = np.concatenate([[0], np.cumsum(nblocks)]).astype(int).tolist()
        box_w = 16 * nd if row[5] == 1 else 0
        for g0 in range(0, count, GROUP):
            g1 = min(g0 + GROUP, count)
            out.append(((fp + g0) * w, (fp + g1) * w, fx + box_w * g0, fx + box_w * g1, 8 * (fb + cum[g0]), 8 * (fb + cum[g1])))
    return out


def _part_raw(p: Part) -> bytes:
    n = p.counts.get("n", len(p.cols[0]))
    return b"".join([
        u64(n), shuffle([x for c in p.cols for x in c]), shuffle(p.shapes),
        u64(p.counts.get("ncuts", len(p.ncuts))), shuffle(p.ncuts), u64(p.counts.get("gaps", len(p.gaps))), shuffle(p.gaps),
        b"".join(p.keys), b"".join(p.sources),
    ])  # fmt: skip


def join(f: Fields, original: bytes | None = None) -> bytes:
    """The file of ``f``: lengths, offsets and digests made to match, but those in ``f.stale``
    (kept as in ``original``, the file :func:`split` read) and the values ``f.fixed``."""
    old = json.loads(original[: original.index(b"\n")]) if original is not None else None
    if "groups" not in f.stale:  # digests over the groups' ranges, split among the parts as they were
        new = [_group_digest(f, g) for g in f.groups]
        at = 0
        for p in f.parts:
            k = len(p.digests)
            p.digests = new[at : at + k] + p.digests[len(new[at : at + k]) :]
            at += k
    blobs, icols = [], [list(c) for c in f.index_cols]
    for i, p in enumerate(f.parts):
        raw = _part_raw(p)
        packed = zlib.compress(raw)
        blob = packed + b"".join(u64(d) for d in p.digests)
        blobs.append(blob)
        for c, value in ((1, len(blob)), (2, len(packed)), (3, len(raw)), (4, len(p.cols[0]))):
            if ("index", c, i) not in f.fixed and i < len(icols[c]):
                icols[c][i] = value
        if ("part", i) not in f.stale and i < len(f.index_digests):
            f.index_digests[i] = xxhash.xxh3_64_intdigest(blob)
    n_idx = f.counts.get("index", len(f.first_keys))
    index_raw = b"".join([u64(n_idx), shuffle([x for c in icols for x in c]), b"".join(u64(d) for d in f.index_digests),
                          b"".join(f.first_keys)])  # fmt: skip
    files_raw = b"".join([u64(f.counts.get("files", len(f.names))), shuffle(f.sizes), shuffle([len(n) for n in f.names]),
                          b"".join(f.names)])  # fmt: skip
    head = f.head
    body = b""
    sections = head.get("sections") if isinstance(head.get("sections"), dict) else None
    for name, raw in (("files", files_raw), ("structure", f.structure), ("index", index_raw)):
        packed = zlib.compress(raw)
        if sections is not None and ("sections", name) not in f.fixed:
            digest = xxhash.xxh3_64_hexdigest(packed)
            if name in f.stale and old is not None:
                digest = old["sections"][name][3]
            sections[name] = [len(body), len(packed), len(raw), digest]
        body += packed
    areas = head.get("areas") if isinstance(head.get("areas"), dict) else None
    for name, blob in (("parts", b"".join(blobs)), ("records", f.records), ("boxes", f.boxes), ("sums", f.sums)):
        if areas is not None and ("areas", name) not in f.fixed:
            areas[name] = [len(body), len(blob)]
        body += blob
    line = json.dumps(head, separators=(",", ":")).encode()
    digest = xxhash.xxh3_64_hexdigest(line)
    if "head" in f.stale and old is not None:
        digest = old["digest"]
    line = line[:-1] + b',"digest":"' + digest.encode() + b'"}'
    return line + b"\n" + body + f.tail


def _group_digest(f: Fields, g: tuple) -> int:
    ra, rb, ba, bb, sa, sb = g
    return xxhash.xxh3_64_intdigest(f.records[ra:rb] + f.boxes[ba:bb] + f.sums[sa:sb])
