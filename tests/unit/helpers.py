"""Oracles and builders shared by the unit tests.

Everything here is written from the definitions (paddle's chunking rule, the documented file
format), not by calling the functions under test, so that the tests compare two independent
computations. The one exception is :func:`save_checkpoint` / :func:`load_rank`, which drive the
real pipeline (planner -> storage -> metadata) the way ``api.py`` does, with numpy arrays.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from paddle_dcp.core import checksums, derive, quant
from paddle_dcp.core.compress import policy_of
from paddle_dcp.io import datafile
from paddle_dcp.io import reads
from paddle_dcp.core.dtypes import as_bytes
from paddle_dcp.core import load_plan, nested, save_plan
from paddle_dcp.parallel import wire
from paddle_dcp.io import local, storage
from paddle_dcp.core.boxes import Box
from paddle_dcp.core.metadata_parse import parse_metadata
from paddle_dcp.io import storage as dcp_storage

# No example database: the suite leaves no .hypothesis directory behind and runs the same way
# on a fresh clone.
def fast(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, database=None)


def is_tensor(x) -> bool:
    return isinstance(x, np.ndarray)


STORAGE = {
    "bool": np.dtype("|b1"),
    "uint8": np.dtype("|u1"),
    "int8": np.dtype("|i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "complex64": np.dtype("<c8"),
    "complex128": np.dtype("<c16"),
}


# ------------------------------------------------------------------ paddle's chunking rule
def ref_chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """[lo, hi) of chunk i of n elements cut in k chunks, by the definition: every chunk
    has ceil(n / k) elements, offsets clamped to n."""
    c = -(-n // k)
    return min(i * c, n), min((i + 1) * c, n)


def mesh_dims_of(placements: Sequence[int | None], ndim: int) -> list[list[int]]:
    """placements[m] is the tensor dim mesh dim m shards (Shard(d)), or None (Replicate)."""
    return [[m for m, p in enumerate(placements) if p == d] for d in range(ndim)]


def ref_indices(global_shape, mesh, placements, coord) -> list[np.ndarray]:
    """The global indices a rank holds, per tensor dim: start from every index and cut it by
    each mesh dim that shards this dim, in mesh-dim order."""
    out = []
    for d, n in enumerate(global_shape):
        idx = np.arange(n)
        for m, p in enumerate(placements):
            if p == d:
                lo, hi = ref_chunk(len(idx), mesh[m], coord[m])
                idx = idx[lo:hi]
        out.append(idx)
    return out


def ref_box(global_shape, mesh, placements, coord) -> Box:
    """The rank's box (shape 0 somewhere when it holds nothing; offsets then 0)."""
    idx = ref_indices(global_shape, mesh, placements, coord)
    if any(len(i) == 0 for i in idx):
        return Box((0,) * len(idx), tuple(len(i) for i in idx))
    for i in idx:
        assert (np.diff(i) == 1).all()
    return Box(tuple(int(i[0]) for i in idx), tuple(len(i) for i in idx))


def coords(mesh: Sequence[int]):
    return [tuple(int(c) for c in np.unravel_index(r, mesh)) for r in range(math.prod(mesh))]


# ------------------------------------------------------------------ strategies
@st.composite
def meshes(draw, max_world: int = 8, max_ndim: int = 3):
    ndim = draw(st.integers(1, max_ndim))
    mesh = []
    for _ in range(ndim):
        room = max_world // max(1, math.prod(mesh))
        mesh.append(draw(st.integers(1, max(1, min(4, room)))))
    return tuple(mesh)


def placements_for(mesh_ndim: int, tensor_ndim: int):
    choice = st.none() if tensor_ndim == 0 else st.one_of(st.none(), st.integers(0, tensor_ndim - 1))
    return st.lists(choice, min_size=mesh_ndim, max_size=mesh_ndim).map(tuple)


def shapes(max_ndim: int = 3, max_side: int = 9, min_ndim: int = 0, allow_zero: bool = True):
    side = st.integers(0 if allow_zero else 1, max_side)
    return st.lists(side, min_size=min_ndim, max_size=max_ndim).map(tuple)


# ------------------------------------------------------------------ data
def random_array(rng: np.random.Generator, dtype: str, shape) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads included) for every dtype but bool (0 / 1)."""
    dt = STORAGE[dtype]
    n = math.prod(shape)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def garbage_like(shape, dtype: str) -> np.ndarray:
    """An array of 0xA5 bytes: whatever a load leaves unwritten shows up."""
    dt = STORAGE[dtype]
    raw = np.full(math.prod(shape) * dt.itemsize, 0xA5, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


# ------------------------------------------------------------------ a save, as api.py does it
@dataclass
class Saved:
    path: str
    unique_id: int
    world: int
    summaries: list
    plan: object
    meta: object


def state_dict_of(tensors: dict[str, np.ndarray], values: dict | None = None) -> dict:
    sd = {"model": dict(tensors)}
    if values is not None:
        sd.update(values)
    return sd


def rank_states(arrays, dtypes, mesh, placements, values=None, via_wire=False, policy=None):
    """What every rank of ``mesh`` holds of the global ``arrays`` under ``placements[name]``:
    a list, by rank, of (Flat of its state dict, its LocalPieces, its SaveSummary); a summary
    names the parameters of the keys ``policy`` derives, as a rank finds them (by key)."""
    out = []
    cache: dict = {}
    for r, coord in enumerate(coords(mesh)):
        boxes = {name: ref_box(a.shape, mesh, placements[name], coord) for name, a in arrays.items()}
        local = {name: np.ascontiguousarray(a[boxes[name].slices()]) for name, a in arrays.items()}
        flat = nested.flatten(state_dict_of(local, values), is_tensor, keep_values=(r == 0))
        pieces = []
        for key in flat.tensors:
            name = key.split(".", 1)[1]
            pieces.append(save_plan.LocalPiece(key, dtypes[name], arrays[name].shape, boxes[name]))
        found = {}
        if policy is not None and policy.derives:
            seen = [derive.Candidate(p.key, p.dtype, tuple(p.global_shape)) for p in pieces]
            found = derive.find_sources(seen, [c.key for c in seen if policy.encoding_of(c.key, c.dtype) == derive.DERIVED])
        s = save_plan.SaveSummary.from_pieces(r, flat.skeleton, pieces, found)
        if via_wire:
            s = wire.decode_summary(wire.encode_summary(s), r, cache)
        out.append((flat, pieces, s))
    return out


def save_checkpoint(
    path: str,
    arrays: dict[str, np.ndarray],
    dtypes: dict[str, str],
    mesh: Sequence[int],
    placements: dict[str, Sequence[int | None]],
    block_bytes: int = 64,
    values: dict | None = None,
    unique_id: int = 0,
    via_wire: bool = True,
    replicas: bool = False,
    compress: dict | None = None,
) -> Saved:
    """Save the global ``arrays`` (state dict ``{"model": arrays, **values}``) as the ranks of
    ``mesh`` with ``placements[name]`` would hold them; every step the pipeline's own (the
    keys ``compress`` names encoded as a rank's write encodes them)."""
    policy = policy_of(compress)
    ranks = rank_states(arrays, dtypes, mesh, placements, values, via_wire, policy)
    summaries = [s for _, _, s in ranks]
    plan = save_plan.plan_save(summaries, replicas, policy)
    sums = {}
    for r, leaves in plan.writes.items():
        flat, pieces, _ = ranks[r]
        w = datafile.data_writer(local.LocalStorage(path), storage.data_file_name(r, unique_id), block_bytes)
        cs: list[int] = []
        for leaf in leaves.tolist():
            p = pieces[leaf]
            seed = checksums.piece_seed(p.key, p.dtype, p.box.offsets, p.box.shape)
            data = np.ascontiguousarray(flat.tensors[p.key])
            encoding = policy.encoding_of(p.key, p.dtype) if policy is not None else None
            if encoding is not None:
                data = quant.encode_piece(data, p.dtype, encoding, p.key)
            cs += w.write(as_bytes(data), seed=seed)
        assert w.commit() == plan.file_bytes[r]
        sums[r] = np.array(cs, dtype=np.uint64)
    structure, _ = nested.fill_values(plan.skeleton, ranks[0][0].values)
    meta = save_plan.build_metadata(plan, sums, structure, unique_id, len(ranks), block_bytes)
    local.write_atomic(path, storage.metadata_name(unique_id), meta.to_json())
    return Saved(path, unique_id, len(ranks), summaries, plan, meta)


def load_rank(path: str, unique_id: int, targets: Sequence[load_plan.TargetPiece], restrict: bool = False, **plan_kw):
    """Read a rank's target pieces (into arrays prefilled with garbage); returns (arrays, ops).
    With ``restrict``, plan from the part of the metadata these targets need, sent as JSON (as a
    rank that cannot read the metadata file gets it)."""
    meta = dcp_storage.read_metadata(local.LocalStorage(path), unique_id)
    if restrict:
        part = load_plan.restrict(meta, targets)
        meta = parse_metadata(part.to_json(), source="part", allow_subset=True)
        assert meta.subset and len(meta.files) <= len(part.files)
    ops = load_plan.plan_reads(meta, targets, **plan_kw)
    out = [garbage_like(t.box.shape, t.dtype) for t in targets]
    files = local.FileSet(path, meta.files)
    try:
        reads.execute_reads(ops, meta, files, out)
    finally:
        files.close()
    return out, ops


def count_copies(ops, targets) -> list[np.ndarray]:
    """How many times the copies of ``ops`` write each element of each target."""
    counts = [np.zeros(t.box.shape, dtype=np.int64) for t in targets]
    for op in ops:
        for seg in op.segments:
            for c in seg.copies:
                counts[c.target][c.region_in_target.slices()] += 1
    return counts


def listdir(path: str) -> list[str]:
    return sorted(os.listdir(path))


# ------------------------------------------------------------------ JSON documents
def nodes(doc, path=()):
    """Every path into a JSON document (the root first), depth first."""
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from nodes(v, path + (i,))


def get(doc, path):
    """The node of ``doc`` at ``path`` (a tuple of keys and indices)."""
    for p in path:
        doc = doc[p]
    return doc


def paddle_builtin_save(paddle, path):
    """A checkpoint of paddle.distributed.save_state_dict (one process), and its oracle."""
    import paddle.distributed as dist

    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    e = paddle.to_tensor(rng.standard_normal((3, 5)).astype(np.float32)).astype("bfloat16")
    n = rng.integers(-9, 9, size=(5,)).astype(np.int64)
    state = {"model": {"w": paddle.to_tensor(w), "e": e}, "opt": {"n": paddle.to_tensor(n)}}
    dist.save_state_dict(state, str(path))
    return {"model.w": w, "model.e": e.numpy(), "opt.n": n}


# dtypes the plan tests draw from, and their sizes in bytes, from the format's definition
DTYPES = ["float32", "int64", "bool", "float16", "uint8"]
ITEMSIZE = {"float32": 4, "int64": 8, "bool": 1, "float16": 2, "uint8": 1, "float64": 8}


@st.composite
def layouts(draw, max_world=8, max_tensors=3, max_side=7):
    """(shapes, dtypes, mesh, placements) of up to ``max_tensors`` tensors saved on a random mesh."""
    n = draw(st.integers(1, max_tensors))
    names = [f"t{i}" for i in range(n)]
    shape = {k: draw(shapes(max_ndim=3, max_side=max_side)) for k in names}
    dtypes = {k: draw(st.sampled_from(DTYPES)) for k in names}
    mesh = draw(meshes(max_world))
    placements = {k: draw(placements_for(len(mesh), len(shape[k]))) for k in names}
    return shape, dtypes, mesh, placements


def arrays_for(shape, dtypes, seed):
    """Random arrays of the given shapes and dtypes, the same for the same seed."""
    rng = np.random.default_rng(seed)
    return {k: random_array(rng, dtypes[k], s) for k, s in shape.items()}


# ------------------------------------------------------------------ the reference quantizer
# From the format's definition (docs/format.md, "Tensors stored quantized"): a piece's elements
# in C order, in blocks of 256, each its float32 minimum and step and codes
# round((x - min) / step); read back as min + code * step in float32, then cast to the dtype.
BLOCK = 256
LEVELS = {"int8": 255, "int4": 15}
BLOCK_BYTES = {"int8": 8 + 256, "int4": 8 + 128}


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # the high half of a float32's bits
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # round to nearest, ties to even, on the bits
        bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return values.astype(STORAGE[dtype])


def dequantized(piece: np.ndarray, encoding: str) -> np.ndarray:
    """What a piece of float32 values reads back as: block by block over its C order."""
    flat = np.ascontiguousarray(piece, np.float32).reshape(-1)
    out = np.empty_like(flat)
    levels = np.float32(LEVELS[encoding])
    for at in range(0, flat.size, BLOCK):
        block = flat[at : at + BLOCK]
        low = block.min()
        step = np.float32((block.max() - low) / levels)
        if step == 0:
            out[at : at + BLOCK] = low
        else:
            codes = np.clip(np.rint((block - low) / step), 0, levels).astype(np.float32)
            out[at : at + BLOCK] = low + codes * step
    return out.reshape(piece.shape)


def saved_boxes(shape, mesh, placements) -> list[Box]:
    boxes = {ref_box(shape, mesh, placements, c) for c in coords(mesh)}
    return sorted((b for b in boxes if b.volume), key=lambda b: b.offsets)


def expected_tensor(array: np.ndarray, dtype: str, encoding: str, boxes) -> np.ndarray:
    """The whole tensor as a load of it gives it: each saved piece dequantized on its own."""
    out = np.empty_like(array)
    for box in boxes:
        out[box.slices()] = from_float32(dequantized(to_float32(array[box.slices()], dtype), encoding), dtype)
    return out
