"""Paddle tensors -> what this rank holds of them (key, dtype, global shape, box).

The only module that reads ``process_mesh`` and ``placements``. It reduces them to plain ints
and lets :func:`paddle_dcp.boxes.shard_box` compute the box, then checks the result against the
local value paddle holds, so a disagreement with paddle's own rule surfaces at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .boxes import Box, shard_box
from .device import dtype_name
from .dtypes import name_of_numpy
from .errors import PlanError
from .planner import LocalPiece


def is_tensor(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return True
    try:
        import paddle
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, paddle.Tensor)


@dataclass
class Held:
    """A state-dict tensor as this rank holds it.

    Attributes:
        piece: the description planning needs.
        local: the local dense data (paddle tensor or numpy array), None when the rank holds none.
        partial: (mesh dim, reduce type name) of every Partial placement.
        mesh_coord: this rank's coordinate in the tensor's mesh (None for plain tensors).
    """

    piece: LocalPiece
    local: Any
    partial: tuple[tuple[int, str], ...] = ()
    mesh_coord: tuple[int, ...] | None = None


def _mesh_dims_of_tensor_dims(key: str, placements, ndim: int) -> tuple[list[list[int]], list[tuple[int, str]]]:
    dims: list[list[tuple[int, int]]] = [[] for _ in range(ndim)]
    partial = []
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            d = placement.get_dim()
            d = d + ndim if d < 0 else d
            if not 0 <= d < ndim:
                raise PlanError(f"{key}: Shard({placement.get_dim()}) on a tensor of rank {ndim}")
            if placement.get_split_factor() != 1:
                raise PlanError(
                    f"{key}: Shard with split_factor={placement.get_split_factor()} is not supported"
                )
            dims[d].append((placement.get_co_shard_order(), mesh_dim))
        elif placement.is_partial():
            partial.append((mesh_dim, str(placement.reduce_type()).split(".")[-1]))
    return [[m for _, m in sorted(ds)] for ds in dims], partial


def describe(key: str, value: Any, rank: int) -> Held:
    """What ``rank`` holds of the state-dict tensor ``value``.

    Raises:
        PlanError: a placement we cannot express, or paddle's local shape differs from ours.
    """
    if isinstance(value, np.ndarray):
        shape = tuple(int(s) for s in value.shape)
        return Held(LocalPiece(key, name_of_numpy(value.dtype), shape, Box.whole(shape)), value)
    shape = tuple(int(s) for s in value.shape)
    dtype = dtype_name(value)
    if not value.is_dist():
        return Held(LocalPiece(key, dtype, shape, Box.whole(shape)), value)
    mesh = value.process_mesh
    ids = [int(i) for i in mesh.process_ids]
    mesh_shape = [int(s) for s in mesh.shape]
    if rank not in ids or not value._is_initialized():
        return Held(LocalPiece(key, dtype, shape, None), None)
    coord = tuple(int(c) for c in np.unravel_index(ids.index(rank), mesh_shape))
    dims, partial = _mesh_dims_of_tensor_dims(key, value.placements, len(shape))
    box = shard_box(shape, mesh_shape, dims, coord)
    local = value._local_value()
    if tuple(int(s) for s in local.shape) != box.shape:
        raise PlanError(
            f"{key}: paddle holds a local piece of shape {tuple(local.shape)} on rank {rank}, "
            f"but placements {value.placements} on mesh {mesh_shape} give {box.shape}"
        )
    return Held(LocalPiece(key, dtype, shape, box), local, tuple(partial), coord)


def reduce_partial(value: Any):
    """The tensor with its Partial placements reduced to Replicate by paddle's reshard (a
    collective over the mesh's partial dims, with the placement's reduce type). float16 and
    bfloat16 are reduced in float32 and rounded once (gloo has no half-precision reduction)."""
    import paddle.distributed as dist

    placements = [dist.Replicate() if p.is_partial() else p for p in value.placements]
    dtype = value.dtype
    half = dtype_name(value) in ("float16", "bfloat16")
    if half:
        value = value.astype("float32")
    reduced = dist.reshard(value, value.process_mesh, placements)
    return reduced.astype(dtype) if half else reduced


def has_partial(value: Any) -> bool:
    return (
        not isinstance(value, np.ndarray)
        and value.is_dist()
        and value._is_initialized()
        and any(p.is_partial() for p in value.placements)
    )


def rewrap(value: Any):
    """A function turning a local tensor into a dist tensor laid out as ``value`` (for offload,
    whose loaded local values live in host memory); None for plain tensors."""
    if isinstance(value, np.ndarray) or not value.is_dist():
        return None
    from paddle.distributed.auto_parallel.api import dtensor_from_local

    mesh, placements = value.process_mesh, value.placements
    return lambda local: dtensor_from_local(local, mesh, placements)
