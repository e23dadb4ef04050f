"""Paddle tensors -> what this rank holds of them (key, dtype, global shape, box).

The only module that reads ``process_mesh`` and ``placements``. It reduces them to plain ints
and lets :func:`paddle_dcp.core.boxes.shard_box` compute the box, then checks the result against the
local value paddle holds, so a disagreement with paddle's own rule surfaces at once.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..core.boxes import Box, flat_range_boxes, shard_box
from .device import dtype_name
from ..core.dtypes import name_of_numpy
from ..core.job_layout import Mesh
from ..core.nested import flatten
from ..errors import DcpError, PlanError, UnsupportedError
from ..core.save_plan import LocalPiece
from .requests import Reduction


def is_tensor(value: Any) -> bool:
    """A state-dict leaf saved as a tensor: numpy array, paddle tensor, or ShardedWeight."""
    if isinstance(value, np.ndarray):
        return True
    try:
        import paddle
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, paddle.Tensor) or is_sharded_weight(value)


def is_sharded_weight(value: Any) -> bool:
    """paddle's ``ShardedWeight`` (flex_checkpoint): a local tensor with its box stated."""
    cls = _sharded_weight_class()
    return cls is not None and isinstance(value, cls)


def tensor_name(value: Any) -> str | None:
    """paddle's name of a state-dict tensor (a ShardedWeight's local tensor's), None for a
    numpy array or a tensor without one."""
    if isinstance(value, np.ndarray):
        return None
    if is_sharded_weight(value):
        value = value.local_tensor
    name = getattr(value, "name", None)
    return name if isinstance(name, str) and name else None


@functools.lru_cache(maxsize=None)
def _sharded_weight_class():
    try:
        from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    except ImportError:  # pragma: no cover - a paddle without flex_checkpoint
        return None
    return ShardedWeight


@dataclass(frozen=True)
class HeldTensor:
    """A state-dict tensor as this rank holds it.

    Attributes:
        piece: the description planning needs.
        local: the local dense data (paddle tensor or numpy array), None when the rank holds none.
        partial: (mesh dim, reduce type name) of every Partial placement.
        mesh_coord: this rank's coordinate in the tensor's mesh (None for plain tensors).
        parts: for a flattened ShardedWeight, every box (in_global) its flat range covers,
            with the index in the flat local tensor where that box's elements begin; its
            ``piece.box`` is then the whole box the range is taken from. None otherwise.
    """

    piece: LocalPiece
    local: Any
    partial: tuple[tuple[int, str], ...] = ()
    mesh_coord: tuple[int, ...] | None = None
    parts: tuple[tuple[Box, int], ...] | None = None

    def pieces(self) -> list[tuple[LocalPiece, int | None]]:
        """What this rank holds of the tensor as pieces to save, each with where its elements
        begin in the flat local tensor (None: the piece is the whole local tensor)."""
        if self.parts is None:
            return [(self.piece, None)]
        if not self.parts:
            return [(LocalPiece(self.piece.key, self.piece.dtype, self.piece.global_shape, None), None)]
        p = self.piece
        return [(LocalPiece(p.key, p.dtype, p.global_shape, box), at) for box, at in self.parts]


_SHARD_REPR = re.compile(r"Shard\(dim=(-?\d+)(?:, shard_order=(\d+))?(?:, split_factor=(\d+))?\)")
_PARTIAL_REPR = re.compile(r"Partial\(reduce_type=(\w+)\)")


def _shard_of(key: str, placement) -> tuple[int, int, int]:
    """(dim, co-shard order, split factor) of a Shard placement. paddle returns co-sharded
    placements as bare Placement objects that only show these in their repr."""
    if hasattr(placement, "get_dim"):
        return placement.get_dim(), placement.get_co_shard_order(), placement.get_split_factor()
    m = _SHARD_REPR.fullmatch(repr(placement))
    if m is None:
        raise PlanError(f"{key}: cannot read the placement {placement!r}")
    return int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 1)


def reduce_type(key: str, placement) -> str:
    """The reduce type of a Partial placement, lower case: sum, avg, max, min, prod, any, all."""
    if hasattr(placement, "reduce_type"):
        return str(placement.reduce_type()).split(".")[-1].replace("kRed", "").lower()
    m = _PARTIAL_REPR.fullmatch(repr(placement))
    if m is None:
        raise PlanError(f"{key}: cannot read the placement {placement!r}")
    return m.group(1).lower()


def _mesh_dims_of_tensor_dims(key: str, placements, ndim: int) -> tuple[list[list[int]], list[tuple[int, str]]]:
    dims: list[list[tuple[int, int]]] = [[] for _ in range(ndim)]
    partial = []
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            d, order, split = _shard_of(key, placement)
            d = d + ndim if d < 0 else d
            if not 0 <= d < ndim:
                raise PlanError(f"{key}: {placement!r} on a tensor of rank {ndim}")
            if split != 1:
                raise PlanError(f"{key}: Shard with split_factor={split} is not supported")
            dims[d].append((order, mesh_dim))
        elif placement.is_partial():
            partial.append((mesh_dim, reduce_type(key, placement)))
    return [[m for _, m in sorted(ds)] for ds in dims], partial


def _coord(index: int, mesh_shape: list[int]) -> tuple[int, ...]:
    """The mesh coordinate of the ``index``-th process id (C order), as np.unravel_index."""
    coord = []
    for extent in reversed(mesh_shape):
        index, c = divmod(index, extent)
        coord.append(c)
    return tuple(reversed(coord))


def describe(key: str, value: Any, rank: int, flat_ok: bool = False) -> HeldTensor:
    """What ``rank`` holds of the state-dict tensor ``value``.

    Args:
        flat_ok: the caller handles ``HeldTensor.parts`` (a flattened ShardedWeight); otherwise one
            raises UnsupportedError.

    Raises:
        PlanError: a placement we cannot express, or paddle's local shape differs from ours.
    """
    if is_sharded_weight(value):
        held = _describe_sharded(key, value)
        if held.parts is not None and not flat_ok:
            raise UnsupportedError(f"{key}: a flattened ShardedWeight is not supported here")
        return held
    if isinstance(value, np.ndarray):
        shape = tuple(int(s) for s in value.shape)
        return HeldTensor(LocalPiece(key, name_of_numpy(value.dtype), shape, Box.whole(shape)), value)
    shape = tuple(int(s) for s in value.shape)
    dtype = dtype_name(value)
    if not value.is_dist():
        return HeldTensor(LocalPiece(key, dtype, shape, Box.whole(shape)), value)
    mesh = value.process_mesh
    ids = [int(i) for i in mesh.process_ids]
    mesh_shape = [int(s) for s in mesh.shape]
    if rank not in ids or not value._is_initialized():
        return HeldTensor(LocalPiece(key, dtype, shape, None), None)
    coord = _coord(ids.index(rank), mesh_shape)
    dims, partial = _mesh_dims_of_tensor_dims(key, value.placements, len(shape))
    box = shard_box(shape, mesh_shape, dims, coord)
    local = value._local_value()
    if tuple(int(s) for s in local.shape) != box.shape:
        raise PlanError(
            f"{key}: paddle holds a local piece of shape {tuple(local.shape)} on rank {rank}, "
            f"but placements {value.placements} on mesh {mesh_shape} give {box.shape}"
        )
    return HeldTensor(LocalPiece(key, dtype, shape, box), local, tuple(partial), coord)


def _describe_sharded(key: str, sw) -> HeldTensor:
    """A ShardedWeight: the box ``global_offset`` + ``local_shape`` of ``global_shape``; a
    flattened one holds elements [start, stop) of that box's C-order flattening, saved as the
    boxes they make (:func:`flat_range_boxes`)."""
    shape = tuple(int(s) for s in sw.global_shape)
    box = Box(tuple(int(o) for o in sw.global_offset), tuple(int(s) for s in sw.local_shape))
    local = sw.local_tensor
    dtype = dtype_name(local)
    if box.ndim != len(shape) or not Box.whole(shape).contains(box) or min(box.offsets, default=0) < 0:
        raise PlanError(f"{key}: ShardedWeight box {box} is not inside its global shape {shape}")
    count = int(np.prod([int(s) for s in local.shape]))
    if not sw.is_flattened:
        if count != box.volume:
            raise PlanError(
                f"{key}: ShardedWeight local tensor has shape {tuple(local.shape)}, its local_shape is {box.shape}"
            )
        return HeldTensor(LocalPiece(key, dtype, shape, box if box.volume else None), local if box.volume else None)
    r = sw.flattened_range
    start, stop = int(r.start), int(r.stop)
    if count != stop - start or (r.step not in (None, 1)):
        raise PlanError(
            f"{key}: flattened ShardedWeight holds {count} elements for the range {r} of its box {box}"
        )
    parts, at = [], 0
    for rel in flat_range_boxes(box.shape, start, stop):
        parts.append((Box(tuple(o + q for o, q in zip(box.offsets, rel.offsets)), rel.shape), at))
        at += rel.volume
    return HeldTensor(LocalPiece(key, dtype, shape, box), local, parts=tuple(parts))


@dataclass(frozen=True, eq=False)
class PartialPiece:
    """A Partial dist tensor's local piece on its way to the value the tensor stands for: a
    host copy (``work``, float32 for float16 and bfloat16, int32 for bool) that ``reductions``
    all-reduce in place, one per partial mesh dim in order (the ranks along such a dim hold
    contributions to the same box), then :func:`reduced_value`. ``work`` is None for an empty
    piece (nothing to reduce)."""

    key: str
    local: Any
    work: np.ndarray | None
    reductions: tuple[Reduction, ...]


def partial_piece(key: str, value: Any, rank: int) -> PartialPiece:
    """This rank's share of reducing the Partial dist tensor ``value`` (sum, avg = sum / count,
    max, min, prod; any / all as max / min): its host copy and the reductions to run on it.
    The user's tensor is not modified. Raises PlanError for a reduce type we cannot do."""
    mesh = value.process_mesh
    ids = np.asarray(mesh.process_ids).reshape([int(s) for s in mesh.shape])
    coord = tuple(int(c) for c in np.argwhere(ids == rank)[0])
    _, partial = _mesh_dims_of_tensor_dims(key, value.placements, len(value.shape))
    local = value._local_value()
    ops = []
    for mesh_dim, kind in partial:
        op = {"any": "max", "all": "min"}.get(kind, kind)
        if op not in ("sum", "avg", "max", "min", "prod"):
            raise PlanError(f"{key}: Partial reduce type {kind!r} is not supported")
        line = list(coord)
        line[mesh_dim] = slice(None)
        ops.append((tuple(int(r) for r in ids[tuple(line)]), op))
    if int(np.prod(local.shape)) == 0:
        return PartialPiece(key, local, None, ())
    wide = {"float16": "float32", "bfloat16": "float32", "bool": "int32"}.get(dtype_name(value))
    # reduced in host memory over gloo (never on the job's NCCL group): one copy off the device
    work = (local.astype(wide) if wide else local).numpy()  # paddle's numpy() is a copy
    return PartialPiece(key, local, work, tuple(Reduction(members, work, op) for members, op in ops))


def reduced_value(piece: PartialPiece) -> Any:
    """The value a Partial tensor stands for, once ``piece``'s reductions ran: a host tensor
    of the local piece's dtype (float16 and bfloat16 rounded once, from float32)."""
    import paddle

    if piece.work is None:
        return piece.local
    host = paddle.to_tensor(piece.work, place=paddle.CPUPlace())
    return host.astype(piece.local.dtype) if host.dtype != piece.local.dtype else host


def partial_fill(held: HeldTensor) -> int | None:
    """For a target with Partial placements, off coordinate 0 of one of its partial mesh dims:
    the constant this rank holds instead of the value (0 for SUM, 1 for PROD; the rule of
    docs/loading.md), or None to load the value."""
    for mesh_dim, reduce_type in held.partial:
        if held.mesh_coord[mesh_dim] != 0 and reduce_type in ("sum", "prod"):
            return 0 if reduce_type == "sum" else 1
    return None


def has_partial(value: Any) -> bool:
    """A dist tensor with a Partial placement whose mesh holds this rank (even with an empty
    local piece: the reduction is a collective of the whole mesh)."""
    if isinstance(value, np.ndarray) or is_sharded_weight(value) or not value.is_dist():
        return False
    import paddle.distributed as dist

    return dist.get_rank() in value.process_mesh.process_ids and any(p.is_partial() for p in value.placements)


_OPTIMIZER_STATE = re.compile(r"moment|beta\d_pow|master|learning_rate|LR_Scheduler|velocity|accumulat", re.I)


def buffer_like(tensors: dict, keys) -> list[str]:
    """Those of ``keys`` whose value looks like a layer's buffer: a paddle tensor that is not a
    parameter, in a state dict that holds parameters, not named like an optimizer's state."""
    if not keys or all(isinstance(v, np.ndarray) for v in tensors.values()):  # no paddle needed
        return []
    from paddle.base.framework import EagerParamBase

    if not any(isinstance(v, EagerParamBase) for v in tensors.values()):
        return []
    return [
        k for k in keys
        if not isinstance(tensors[k], (np.ndarray, EagerParamBase)) and not is_sharded_weight(tensors[k])
        and not _OPTIMIZER_STATE.search(k)
    ]


# ---------------------------------------------------------------------- a save's preparation
def partial_pieces(tensors: dict[str, Any], rank: int) -> dict[str, PartialPiece]:
    """key -> this rank's share of reducing every Partial tensor of ``tensors``
    (:func:`partial_piece`), in their order: ``save_state_dict`` and ``save_gathered`` run
    their reductions as a protocol step, then hold :func:`reduced_value` (:func:`held_of`)."""
    return {key: partial_piece(key, value, rank) for key, value in tensors.items() if has_partial(value)}


def held_of(tensors: dict[str, Any], reduced: dict[str, Any], rank: int, flat_ok: bool = False) -> list[HeldTensor]:
    """What ``rank`` holds of every tensor of ``tensors`` (:func:`describe`), a Partial one's
    local piece replaced by its reduced value (``reduced``: key -> :func:`reduced_value`)."""
    held = [describe(key, value, rank, flat_ok) for key, value in tensors.items()]
    return [
        replace(h, local=reduced[h.piece.key]) if h.piece.key in reduced and h.local is not None else h for h in held
    ]


def meshes_of(state_dict: dict) -> tuple[Mesh, ...] | None:
    """The distinct process meshes of ``state_dict``'s dist tensors, reduced to ints and
    names, in the order of the first tensor on each (flat key order): the meshes of the layouts
    a CheckpointManager records and reports (:mod:`paddle_dcp.core.job_layout`); None when the
    state dict cannot be taken apart (the save or load it goes with says why)."""
    try:
        flat = flatten(state_dict, is_tensor, keep_values=False)
    except DcpError:
        return None
    seen: dict[Mesh, None] = {}
    for key in sorted(flat.tensors):
        mesh = _mesh(flat.tensors[key])
        if mesh is not None:
            seen.setdefault(mesh, None)
    return tuple(seen)


def _mesh(value: Any) -> Mesh | None:
    if isinstance(value, np.ndarray) or is_sharded_weight(value) or not value.is_dist():
        return None
    mesh = value.process_mesh
    return Mesh(tuple(int(s) for s in mesh.shape), tuple(int(i) for i in mesh.process_ids),
                tuple(str(n) for n in mesh.dim_names))
