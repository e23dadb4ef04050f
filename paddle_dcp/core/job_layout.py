"""The layout of a job as a CheckpointManager records and reports it: its number of ranks, the
meshes its state lives on and the ranks that share each node."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import FormatError


@dataclass(frozen=True)
class Mesh:
    """A process mesh, reduced to ints and names.

    Attributes:
        shape: the number of ranks along each mesh dim.
        process_ids: the mesh's ranks, in C order of their coordinates.
        dim_names: the mesh dims' names.
    """

    shape: tuple[int, ...]
    process_ids: tuple[int, ...]
    dim_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobLayout:
    """How a job's state was laid out when a step was saved, or when it was restored.

    Attributes:
        world_size: the number of ranks of the job (of the manager's group).
        meshes: the distinct meshes of the state dict's dist tensors, in the order of the
            first tensor on each (flat key order); () for a state of plain tensors; None when
            not recorded (a step saved before paddle_dcp recorded it).
        nodes: the ranks of each node (ranks that share the node-local tier's directory), in
            rank order; None when unknown (no node-local tier, or not recorded).
    """

    world_size: int
    meshes: tuple[Mesh, ...] | None = None
    nodes: tuple[tuple[int, ...], ...] | None = None

    def to_json(self) -> dict:
        """The layout as JSON values (docs/format.md, "The manager's records")."""
        meshes = None if self.meshes is None else [
            {"shape": list(m.shape), "process_ids": list(m.process_ids), "dim_names": list(m.dim_names)}
            for m in self.meshes
        ]
        nodes = None if self.nodes is None else [list(n) for n in self.nodes]
        return {"world_size": self.world_size, "meshes": meshes, "nodes": nodes}

    @staticmethod
    def from_json(doc: Any, source: str) -> "JobLayout":
        """The layout :meth:`to_json` wrote; FormatError naming ``source`` when it is not one."""
        try:
            world = doc["world_size"]
            meshes = None if doc.get("meshes") is None else tuple(
                Mesh(_ints(m["shape"]), _ints(m["process_ids"]), tuple(str(n) for n in m.get("dim_names", ())))
                for m in doc["meshes"]
            )
            nodes = None if doc.get("nodes") is None else tuple(_ints(n) for n in doc["nodes"])
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise FormatError(f"{source}: not a layout ({exc}): {doc!r:.200}") from exc
        if type(world) is not int or world < 1:
            raise FormatError(f"{source}: a layout's world_size must be a positive int, got {world!r}")
        return JobLayout(world, meshes, nodes)


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise ValueError(f"expected a list of ints, got {values!r:.100}")
    return tuple(values)
