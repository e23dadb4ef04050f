"""The process meshes of a state dict's dist tensors, reduced to ints and names: the meshes of
the layouts a CheckpointManager records and reports (:mod:`paddle_dcp.core.job_layout`).

Reading ``process_mesh`` is :mod:`paddle_dcp.parallel.placements`'s job; this function reads
it here only because that module was being changed by another branch when it was written, and
belongs there."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..core.job_layout import Mesh
from ..core.nested import flatten
from ..errors import DcpError
from .placements import is_sharded_weight, is_tensor


def meshes_of(state_dict: dict) -> tuple[Mesh, ...] | None:
    """The distinct meshes of ``state_dict``'s dist tensors, in the order of the first tensor
    on each (flat key order); None when the state dict cannot be taken apart (the save or
    load it goes with says why)."""
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
