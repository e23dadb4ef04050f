"""An independent reader and writer of metadata files of format version 3, written from
docs/format.md and nothing else: the tests read what a save wrote, edit it as a document and
write it back (the way a damaged or hostile file is made), without the code under test.

A document is the version 1 JSON layout (docs/format.md, "Metadata"): ``tensors`` by key,
each with its dtype, shape, count and columns (``offsets``, ``shapes``, ``file``,
``byte_offset``, ``checksums`` as 16-digit hex strings), ``encoding`` and ``source`` when set.
:func:`write` stores every tensor's pieces with their boxes (the layout that is not a grid),
which any reader must accept as well.
"""
from __future__ import annotations

import json
import zlib

import numpy as np
import xxhash

DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128"]
ITEMSIZE = [1, 1, 1, 2, 4, 8, 2, 2, 4, 8, 8, 16]
ENCODINGS = [None, "int8", "int4", "derived"]
ENCODED_BLOCK = {"int8": 264, "int4": 136}  # bytes of a block of 256 elements
GROUP = 32


# ----------------------------------------------------------------------------- pieces
def _unshuffle(buf: bytes, n: int) -> list[int]:
    raw = np.frombuffer(buf, dtype=np.uint8, count=8 * n).reshape(8, n)
    return np.ascontiguousarray(raw.T).view("<i8").reshape(n).tolist()


def _shuffle(values) -> bytes:
    return np.asarray(values, dtype="<i8").reshape(-1).view(np.uint8).reshape(-1, 8).T.tobytes()


def _digest_line(body: bytes) -> bytes:
    return body[:-1] + b',"digest":"' + xxhash.xxh3_64_hexdigest(body).encode() + b'"}'


def _stored(dtype: str, encoding, shape) -> int:
    n = int(np.prod(shape)) if len(shape) else 1
    if encoding is None:
        return n * ITEMSIZE[DTYPES.index(dtype)]
    if encoding == "derived":
        return 0
    return -(-n // 256) * ENCODED_BLOCK[encoding]


# ----------------------------------------------------------------------------- reading
def read(data: bytes) -> dict:
    """A version 3 file (or a version 1 or 2 one, which is the document already) as a document
    (digests not checked: a test may read a damaged file)."""
    if b"\n" not in data:
        return json.loads(data)
    end = data.index(b"\n")
    head = json.loads(data[:end])
    body = data[end + 1 :]

    def section(name):
        at, n, raw, _ = head["sections"][name]
        return zlib.decompress(body[at : at + n])

    files = section("files")
    nf = int.from_bytes(files[:8], "little")
    sizes = _unshuffle(files[8:], nf)
    lens = _unshuffle(files[8 + 8 * nf :], nf)
    at = 8 + 16 * nf
    names = []
    for n in lens:
        names.append(files[at : at + n].decode())
        at += n
    index = section("index")
    np_ = int.from_bytes(index[:8], "little")
    cols = _unshuffle(index[8:], 5 * np_)
    part_len, packed_len = cols[np_ : 2 * np_], cols[2 * np_ : 3 * np_]
    area = {name: body[a : a + n] for name, (a, n) in head["areas"].items()}
    widths = (head["widths"]["file"], head["widths"]["offset"])
    tensors, at = {}, 0
    for p in range(np_):
        raw = zlib.decompress(area["parts"][at : at + packed_len[p]])
        at += part_len[p]
        tensors.update(_read_part(raw, area, widths))
    values = _values(head["outline"])
    doc = {k: head[k] for k in ("unique_id", "world_size", "checksum")}
    doc["created_by"] = head.get("created_by", "")  # optional, as the reader takes it
    doc.update(format="paddle_dcp", format_version=3, files=[{"name": n, "bytes": s} for n, s in zip(names, sizes)],
               structure=_fill(json.loads(section("structure")), values), tensors=tensors)
    if head.get("replicas"):
        doc["replicas"] = True
    return doc


def _join(key, k):
    return str(k) if key is None else f"{key}.{k}"


def _values(node, key=None, out=None):
    """Flat key -> value node of every plain value of an outline."""
    out = {} if out is None else out
    (tag, v), = node.items()
    if tag == "d":
        for k, c in v:
            _values(c, _join(key, k), out)
    elif tag in ("l", "u"):
        for i, c in enumerate(v):
            _values(c, _join(key, i), out)
    elif tag in ("v", "f"):
        out[key] = node
    return out


def _fill(node, values, key=None):
    """The structure section's placeholders replaced by the outline's values."""
    (tag, v), = node.items()
    if tag == "x":
        return values.get(key)
    if tag == "d":
        return {"d": [[k, f] for k, c in v if (f := _fill(c, values, _join(key, k))) is not None]}
    if tag in ("l", "u"):
        return {tag: [_fill(c, values, _join(key, i)) or {"v": None} for i, c in enumerate(v)]}
    return node


def _read_part(raw: bytes, area: dict, widths) -> dict:
    n = int.from_bytes(raw[:8], "little")
    at = 8
    cols = _unshuffle(raw[at:], 11 * n)
    at += 88 * n
    key_len, src_len, dtype, enc, ndim, layout, count, first_piece, first_block, blocks, first_box = (
        cols[i * n : (i + 1) * n] for i in range(11))
    shapes = _unshuffle(raw[at:], sum(ndim))
    at += 8 * sum(ndim)
    ns = int.from_bytes(raw[at : at + 8], "little")
    ncuts = _unshuffle(raw[at + 8 :], ns)
    at += 8 + 8 * ns
    ng = int.from_bytes(raw[at : at + 8], "little")
    gaps = _unshuffle(raw[at + 8 :], ng)
    at += 8 + 8 * ng
    keys, srcs = [], []
    for lengths, out in ((key_len, keys), (src_len, srcs)):
        for k in lengths:
            out.append(raw[at : at + k].decode())
            at += k
    out = {}
    shape_at = cut_at = gap_at = 0
    wf, wo = widths
    for t in range(n):
        shape = shapes[shape_at : shape_at + ndim[t]]
        shape_at += ndim[t]
        entry = {"dtype": DTYPES[dtype[t]], "shape": shape, "count": count[t]}
        if enc[t]:
            entry["encoding"] = ENCODINGS[enc[t]]
        if srcs[t]:
            entry["source"] = srcs[t]
        if layout[t] == 0:
            grid = []
            for d in range(ndim[t]):
                g = gaps[gap_at : gap_at + ncuts[cut_at] - 1]
                gap_at += ncuts[cut_at] - 1
                cut_at += 1
                grid.append([0] + [int(x) for x in np.cumsum(g)])
            boxes = _cells(grid) if count[t] else []
        else:
            vals = np.frombuffer(area["boxes"], dtype="<i8", count=2 * ndim[t] * count[t], offset=first_box[t])
            boxes = [(v[: ndim[t]], v[ndim[t] :]) for v in vals.reshape(count[t], 2 * ndim[t]).tolist()]
        w = wf + wo
        recs = [area["records"][(first_piece[t] + i) * w : (first_piece[t] + i + 1) * w] for i in range(count[t])]
        sums = np.frombuffer(area["sums"], dtype="<u8", count=blocks[t], offset=8 * first_block[t])
        entry.update(offsets=[x for o, _ in boxes for x in o], shapes=[x for _, s in boxes for x in s],
                     file=[int.from_bytes(r[:wf], "little") for r in recs],
                     byte_offset=[int.from_bytes(r[wf:], "little") for r in recs],
                     checksums=[f"{int(x):016x}" for x in sums])
        out[keys[t]] = entry
    return out


def _cells(grid):
    """The boxes of a grid's cells, row-major."""
    boxes = [([], [])]
    for cuts in grid:
        boxes = [(o + [cuts[i]], s + [cuts[i + 1] - cuts[i]]) for o, s in boxes for i in range(len(cuts) - 1)]
    return boxes


# ----------------------------------------------------------------------------- writing
def as_json(doc: dict) -> bytes:
    """A document as a metadata file of version 1 (or 2, when a tensor has an encoding): one
    JSON document, with its digest, as a save before version 3 wrote it."""
    version = 2 if any("encoding" in t for t in doc["tensors"].values()) else 1
    body = dict(doc, format_version=doc.get("json_version", version))
    body.pop("json_version", None)
    body.pop("digest", None)
    return _digest_line(json.dumps(body, separators=(",", ":")).encode())


def write(doc: dict, per_part: int = 16) -> bytes:
    """A document as a version 3 file, every tensor's pieces stored with their boxes."""
    keys = sorted(doc["tensors"])
    block_bytes = doc["checksum"]["block_bytes"]
    files = doc["files"]
    wf = max(1, (max(len(files) - 1, 0).bit_length() + 7) // 8)
    top = max([b for t in doc["tensors"].values() for b in t["byte_offset"]] + [0])
    wo = max(1, (top.bit_length() + 7) // 8)
    records, boxes, sums, rows, digests = b"", b"", b"", [], []
    for key in keys:
        t = doc["tensors"][key]
        nd, count = len(t["shape"]), t["count"]
        rec = [t["file"][i].to_bytes(wf, "little") + t["byte_offset"][i].to_bytes(wo, "little") for i in range(count)]
        box = [np.array(t["offsets"][i * nd : (i + 1) * nd] + t["shapes"][i * nd : (i + 1) * nd], "<i8").tobytes()
               for i in range(count)]
        nblocks = [max(1, -(-_stored(t["dtype"], t.get("encoding"), t["shapes"][i * nd : (i + 1) * nd]) // block_bytes))
                   for i in range(count)]
        cs = [int(x, 16) for x in t["checksums"]]
        rows.append((key, t, len(records) // (wf + wo), len(sums) // 8, len(cs), len(boxes)))
        taken = 0
        for g0 in range(0, count, GROUP):
            m = min(GROUP, count - g0)
            need = sum(nblocks[g0 : g0 + m])
            group = (b"".join(rec[g0 : g0 + m]) + b"".join(box[g0 : g0 + m])
                     + np.array(cs[taken : taken + need], "<u8").tobytes())
            digests.append(xxhash.xxh3_64_intdigest(group))
            taken += need
        records += b"".join(rec)
        boxes += b"".join(box)
        sums += np.array(cs, "<u8").tobytes()
    parts, index, g_at = [], [], 0
    for p0 in range(0, len(rows), per_part):
        chunk = rows[p0 : p0 + per_part]
        n_groups = sum(-(-t["count"] // GROUP) for _, t, *_ in chunk)
        kb = [k.encode() for k, *_ in chunk]
        sb = [t.get("source", "").encode() for _, t, *_ in chunk]
        cols = [[len(k) for k in kb], [len(s) for s in sb], [DTYPES.index(t["dtype"]) for _, t, *_ in chunk],
                [ENCODINGS.index(t.get("encoding")) for _, t, *_ in chunk], [len(t["shape"]) for _, t, *_ in chunk],
                [1] * len(chunk), [t["count"] for _, t, *_ in chunk]] + [[r[i] for r in chunk] for i in (2, 3, 4, 5)]
        raw = (len(chunk).to_bytes(8, "little") + _shuffle(sum(cols, [])) + _shuffle([x for _, t, *_ in chunk for x in t["shape"]])
               + (0).to_bytes(8, "little") + (0).to_bytes(8, "little") + b"".join(kb) + b"".join(sb))
        packed = zlib.compress(raw)
        part = packed + np.array(digests[g_at : g_at + n_groups], "<u8").tobytes()
        g_at += n_groups
        parts.append(part)
        index.append((kb[0], len(part), len(packed), len(raw), xxhash.xxh3_64_intdigest(part), len(chunk)))
    names = [f["name"].encode() for f in files]
    files_raw = (len(files).to_bytes(8, "little") + _shuffle([f["bytes"] for f in files]) + _shuffle([len(n) for n in names])
                 + b"".join(names))
    index_raw = (len(index).to_bytes(8, "little") + _shuffle([len(i[0]) for i in index] + [i[1] for i in index]
                 + [i[2] for i in index] + [i[3] for i in index] + [i[5] for i in index])
                 + np.array([i[4] for i in index], "<u8").tobytes() + b"".join(i[0] for i in index))
    outline, holders = _outline(doc["structure"])
    structure_raw = json.dumps(_blank(doc["structure"]), separators=(",", ":")).encode()
    body, sections = b"", {}
    for name, raw in (("files", files_raw), ("structure", structure_raw), ("index", index_raw)):
        packed = zlib.compress(raw)
        sections[name] = [len(body), len(packed), len(raw), xxhash.xxh3_64_hexdigest(packed)]
        body += packed
    areas = {}
    for name, blob in (("parts", b"".join(parts)), ("records", records), ("boxes", boxes), ("sums", sums)):
        areas[name] = [len(body), len(blob)]
        body += blob
    head = {"format": "paddle_dcp", "format_version": 3, "unique_id": doc["unique_id"], "world_size": doc["world_size"],
            "created_by": doc.get("created_by", ""), "checksum": doc["checksum"],
            "counts": {"tensors": len(keys), "pieces": sum(t["count"] for t in doc["tensors"].values()),
                       "blocks": len(sums) // 8, "files": len(files), "parts": len(parts)},
            "widths": {"file": wf, "offset": wo}, "outline": outline, "holders": holders, "sections": sections,
            "areas": areas}
    if doc.get("replicas"):
        head["replicas"] = True
    return _digest_line(json.dumps(head, separators=(",", ":")).encode()) + b"\n" + body


def _blank(node):
    """The structure with every plain value a placeholder."""
    (tag, v), = node.items()
    if tag == "d":
        return {"d": [[k, _blank(c)] for k, c in v]}
    if tag in ("l", "u"):
        return {tag: [_blank(c) for c in v]}
    return node if tag == "t" else {"x": 0}


def _outline(node, path=()):
    """(the structure without the tensors of dicts, the paths of its containers that hold
    tensors), as docs/format.md defines the head's ``outline`` and ``holders``."""
    holders = []

    def holds(n):
        (tag, v), = n.items()
        if tag == "t":
            return True
        if tag == "d":
            return any(holds(c) for _, c in v)
        if tag in ("l", "u"):
            return any(holds(c) for c in v)
        return False

    def visit(n, p):
        (tag, v), = n.items()
        if tag not in ("d", "l", "u") or not holds(n):
            return None if tag == "t" else n
        if p:
            holders.append(list(p))
        if tag == "d":
            kept = [[k, o] for k, c in v if (o := visit(c, p + (k,))) is not None]
            return {"d": kept} if kept or not p else None
        out = []
        for i, c in enumerate(v):
            ((ctag, _),) = c.items()
            o = visit(c, p + (i,))
            if o is None and ctag != "t":
                holders.append(list(p + (i,)))
            out.append(o if o is not None else ({"t": 0} if ctag == "t" else {ctag: []}))
        return {tag: out}

    outline = visit(node, path) or {"d": []}
    return outline, sorted(holders, key=lambda p: [str(c) for c in p])
