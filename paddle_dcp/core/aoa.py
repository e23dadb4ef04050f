"""aoa_config on load: paddle's source -> target slice mappings turned into our reads.

Paddle's AOA engine (called by :mod:`paddle_dcp.parallel.aoa_paddle`) interprets the config and says,
for a box of a state-dict tensor, which boxes of which checkpoint tensors fill which parts
of it, and what to do with them on the way (permute the axes, cast the dtype). This module
holds that answer as plain data (:class:`SliceMap`) and turns the maps of one rank's targets
into what the planner reads: a part filled as it is saved (same box shape, dtype, no step)
whose part is the whole target is read straight into the target's buffer, as without a config;
any other part is read into a staging array shaped as its source box, then permuted and cast
with numpy and copied into its place (:func:`apply`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from .boxes import Box
from .dtypes import cast, storage_dtype
from ..errors import MismatchError, PlanError, UnsupportedError
from .metadata import Metadata
from .load_plan import TargetPiece


@dataclass(frozen=True)
class Step:
    """One postprocess step: ``perm`` (permute the axes: ``np.transpose(x, perm)``) or
    ``dtype`` (cast to that dtype); exactly one of them is set."""

    perm: tuple[int, ...] | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class SliceMap:
    """One part of a target tensor filled from one box of a checkpoint tensor.

    Attributes:
        target_key: the state dict's key.
        target_box: the part filled, in the target's global coordinates (elements).
        source_key: the checkpoint's key.
        source_box: the box read, in the source's global coordinates (elements); its shape,
            permuted by the steps, is ``target_box``'s.
        steps: applied to the source box in order.
    """

    target_key: str
    target_box: Box
    source_key: str
    source_box: Box
    steps: tuple[Step, ...] = ()


def steps_of(postprocess: Sequence[str] | None) -> tuple[Step, ...]:
    """Paddle's postprocess list (``"[1, 0]"`` permutes, ``"bfloat16"`` casts) as steps.

    Raises:
        UnsupportedError: an entry that is neither.
    """
    steps = []
    for entry in postprocess or ():
        text = str(entry).strip()
        if text.startswith("["):
            try:
                perm = tuple(int(i) for i in json.loads(text))
            except (ValueError, TypeError):
                raise UnsupportedError(f"aoa_config: postprocess {entry!r} is not a permutation") from None
            if sorted(perm) != list(range(len(perm))):
                raise UnsupportedError(f"aoa_config: postprocess {entry!r} is not a permutation")
            steps.append(Step(perm=perm))
        else:
            storage_dtype(text)  # a dtype name we know, else FormatError naming it
            steps.append(Step(dtype=text))
    return tuple(steps)


def after_steps(shape: tuple[int, ...], dtype: str, steps: Sequence[Step]) -> tuple[tuple[int, ...], str]:
    """The shape and dtype of a source box once the steps are applied."""
    for s in steps:
        if s.perm is not None:
            if len(s.perm) != len(shape):
                raise PlanError(f"permutation {list(s.perm)} applied to a box of shape {shape}")
            shape = tuple(shape[i] for i in s.perm)
        elif s.dtype is not None:
            dtype = s.dtype
    return shape, dtype


def postprocess(array: np.ndarray, dtype: str, steps: Sequence[Step]) -> np.ndarray:
    """Apply the steps to ``array`` (storage dtype of ``dtype``) with numpy; casts round as
    paddle's do (see :func:`paddle_dcp.core.dtypes.cast`)."""
    for s in steps:
        if s.perm is not None:
            array = np.transpose(array, s.perm)
        elif s.dtype is not None:
            array = cast(array, dtype, s.dtype)
            dtype = s.dtype
    return array


@dataclass(frozen=True)
class Staged:
    """A part read into staging array ``slot``, then finished into buffer ``target``.

    Attributes:
        slot: the staging array's slot (after every buffer's), shaped as the source box, in
            the source's storage dtype.
        source_dtype: the source's dtype name.
        target: the buffer it is copied into.
        region: where, relative to the target's local box (elements).
        steps: applied before the copy.
    """

    slot: int
    shape: tuple[int, ...]
    source_dtype: str
    target: int
    region: Box
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class LocalTarget:
    """One buffer of this rank to fill: its key, dtype, global shape and local box."""

    slot: int
    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box


@dataclass
class ReadPlan:
    """What the planner reads for this rank's targets, and what is finished afterwards.

    Attributes:
        pieces / slots: planner targets (source keys and boxes) and the slot each fills.
        staged: parts that need a postprocess or do not fill a whole target.
        sources: the checkpoint keys read.
    """

    pieces: list[TargetPiece]
    slots: list[int]
    staged: list[Staged]

    @property
    def sources(self) -> list[str]:
        return sorted({p.key for p in self.pieces})


def plan(meta: Metadata, targets: Sequence[tuple[LocalTarget, Sequence[SliceMap]]], first_slot: int) -> ReadPlan:
    """The reads for every target from its maps; staging slots are numbered from ``first_slot``.

    Raises:
        MismatchError: a map's source is not in the checkpoint, its dtype or shape (after the
            steps) differs from the target's, or the maps do not fill the target exactly.
    """
    out = ReadPlan([], [], [])
    for t, maps in targets:
        if not maps:
            continue  # the config fills nothing of it (``_ -> key``)
        _check_maps(meta, t, maps)
        if len(maps) == 1 and _is_identity(t, maps[0]):
            m = maps[0]
            entry = meta.tensors[m.source_key]
            out.pieces.append(TargetPiece(m.source_key, entry.dtype, tuple(entry.shape), m.source_box))
            out.slots.append(t.slot)
            continue
        for m in maps:
            entry = meta.tensors[m.source_key]
            slot = first_slot + len(out.staged)
            out.pieces.append(TargetPiece(m.source_key, entry.dtype, tuple(entry.shape), m.source_box))
            out.slots.append(slot)
            region = m.target_box.relative_to(t.box)
            out.staged.append(Staged(slot, m.source_box.shape, entry.dtype, t.slot, region, m.steps))
    return out


def _is_identity(t: LocalTarget, m: SliceMap) -> bool:
    return not m.steps and m.target_box == t.box and m.source_box.shape == t.box.shape


def _check_maps(meta: Metadata, t: LocalTarget, maps: Sequence[SliceMap]) -> None:
    filled = 0
    for m in maps:
        entry = meta.tensors.get(m.source_key)
        if entry is None:
            raise MismatchError(f"{t.key}: aoa_config reads {m.source_key}, which the checkpoint lacks")
        if not Box.whole(entry.shape).contains(m.source_box) or len(m.source_box.shape) != len(entry.shape):
            raise MismatchError(
                f"{t.key}: aoa_config reads box {m.source_box} of {m.source_key}, whose shape is {tuple(entry.shape)}"
            )
        shape, dtype = after_steps(m.source_box.shape, entry.dtype, m.steps)
        if dtype != t.dtype:
            raise MismatchError(
                f"{t.key}: aoa_config gives dtype {dtype} (from {m.source_key}, {entry.dtype}), state_dict has {t.dtype}"
            )
        if shape != m.target_box.shape or not t.box.contains(m.target_box):
            raise MismatchError(
                f"{t.key}: aoa_config fills box {m.target_box} from box {m.source_box} of {m.source_key}; "
                f"the state_dict's box is {t.box}"
            )
        filled += m.target_box.volume
    if filled != t.box.volume:
        raise MismatchError(
            f"{t.key}: aoa_config fills {filled} of the {t.box.volume} elements of box {t.box} "
            f"(state_dict shape {t.global_shape})"
        )


def apply(staged: Iterable[Staged], arrays: Sequence[np.ndarray]) -> None:
    """Permute and cast every staged part and copy it into its target's array."""
    for s in staged:
        target = arrays[s.target]
        target[s.region.slices()] = postprocess(arrays[s.slot], s.source_dtype, s.steps)


def staging_arrays(staged: Sequence[Staged]) -> list[np.ndarray]:
    """One empty array per staged part, in slot order."""
    return [np.empty(s.shape, dtype=storage_dtype(s.source_dtype)) for s in staged]


# ---------------------------------------------------------------- shard descriptions
def source_shards(meta: Metadata) -> dict[str, tuple[str, tuple[int, ...], list[Box]]]:
    """Every checkpoint tensor as (dtype, global shape, saved boxes): what the engine needs
    to know of the source (keys for its patterns, shapes, shard counts)."""
    out = {}
    for key, entry in meta.tensors.items():
        p = entry.pieces
        boxes = [Box(tuple(o), tuple(s)) for o, s in zip(p.offsets.tolist(), p.shapes.tolist())]
        out[key] = (entry.dtype, tuple(entry.shape), boxes or [Box.whole(entry.shape)])
    return out


def encode_targets(targets: Iterable[tuple[str, str, tuple[int, ...], Box]]) -> list:
    """A rank's targets (key, dtype, global shape, box) as JSON-ready lists."""
    return [[k, d, list(g), list(b.offsets), list(b.shape)] for k, d, g, b in targets]


def merge_targets(per_rank: Iterable[list]) -> dict[str, tuple[str, tuple[int, ...], list[Box]]]:
    """Every rank's targets (from :func:`encode_targets`) as key -> (dtype, global shape,
    distinct boxes in order of first appearance)."""
    out: dict[str, tuple[str, tuple[int, ...], list[Box]]] = {}
    seen: set[tuple[str, Box]] = set()
    for rows in per_rank:
        for key, dtype, gshape, offsets, shape in rows:
            box = Box(tuple(offsets), tuple(shape))
            if key not in out:
                out[key] = (dtype, tuple(gshape), [])
            if (key, box) not in seen:
                seen.add((key, box))
                out[key][2].append(box)
    return out


def check_config(aoa_config: object) -> Mapping:
    """A config as paddle takes it: a dict whose ``"aoa_statements"`` is a list of strings.

    Raises:
        UnsupportedError: anything else.
    """
    if not isinstance(aoa_config, Mapping):
        raise UnsupportedError(f"aoa_config must be a dict with 'aoa_statements', got {type(aoa_config).__name__}")
    statements = aoa_config.get("aoa_statements", [])
    if not isinstance(statements, (list, tuple)) or not all(isinstance(s, str) for s in statements):
        raise UnsupportedError("aoa_config['aoa_statements'] must be a list of strings")
    return aoa_config
