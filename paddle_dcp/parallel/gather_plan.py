"""The plan of a gathered save (:func:`paddle_dcp.gather.save_gathered`): one safetensors file,
its layout, and the groups in which the gathering rank receives it. Pure: no I/O, no paddle.

The gathering rank plans from every rank's summary: one holder per distinct piece (itself when
it holds the piece), the file's layout (tensors in the state dict's order), and the groups:
each tensor cut along its outer dims into contiguous chunks of at most ``max_grouped_size``
bytes, chunks packed in file order into groups of at most ``max_grouped_size`` bytes. Each rank
receives the list of messages it must send.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Sequence

from ..core import nested, save_plan
from ..core.boxes import Box, element_span, split_region
from ..core.dtypes import itemsize
from ..errors import FormatError, MismatchError
from ..format.safetensors import SAFETENSORS_DTYPES, encode_header
from ..version import __version__

# the file's __metadata__ names its writer's format (read back by paddle_dcp.singlefile)
METADATA_FORMAT = "paddle_dcp.gathered"
METADATA_VERSION = "1"


# ============================================================================ the plan
@dataclass(frozen=True)
class Region:
    """A box of one tensor that one rank sends, and where it lands.

    Attributes:
        key: flat state-dict key.
        box: the region, in global coordinates (elements).
        chunk: the chunk of the tensor it lies in, in global coordinates.
        at: the chunk's first byte in its group's buffer, in bytes.
        itemsize: bytes per element.
    """

    key: str
    box: Box
    chunk: Box
    at: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.box.volume * self.itemsize


@dataclass
class Group:
    """A run of the file's data section assembled in memory at once.

    Attributes:
        start / stop: its bytes in the data section (from the end of the header), in bytes.
        own: regions the gathering rank copies from its own pieces.
        messages: sender rank -> its messages, in order; a message is the concatenated
            bytes of its regions.
    """

    start: int
    stop: int
    own: list[Region] = field(default_factory=list)
    messages: dict[int, list[list[Region]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TensorLayout:
    """A tensor of the file: its key, dtype name, global shape, and bytes in the data section."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int


@dataclass
class GatherPlan:
    """The gathering rank's plan: the file's header and groups, and each sender's part."""

    tensors: list[TensorLayout]
    skeleton: dict
    groups: list[Group]
    header: bytes

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].begin + self.tensors[-1].nbytes if self.tensors else 0

    def assignment(self, rank: int) -> bytes:
        """What ``rank`` sends: per group, its messages, each a list of [key, offsets, shape]."""
        out = [
            [[[r.key, list(r.box.offsets), list(r.box.shape)] for r in msg] for msg in g.messages.get(rank, ())]
            for g in self.groups
        ]
        return json.dumps(out, separators=(",", ":")).encode()


def _limits(limit: int) -> tuple[int, int, int]:
    """(batch, small, part) in bytes: small regions travel together in messages of at most
    ``batch`` bytes; larger ones are cut into messages of at most ``part`` bytes, which bounds
    the gathering rank's staging buffer (strided places) to a quarter of a group or so."""
    batch = min(max(limit // 4, 64 << 10), 4 << 20)
    return batch, max(batch // 4, 1), max(batch, limit // 4)


def plan_gather(
    summaries: Sequence[save_plan.SaveSummary], ranks: tuple[int, ...], root: int, state_type: str, limit: int
) -> GatherPlan:
    """Plan a gathered save from every rank's summary (in group order; the summaries a save
    sends, :func:`paddle_dcp.parallel.wire.decode_summary`). Pure: no I/O. The distinct pieces
    and their holders are a save plan's (:func:`paddle_dcp.core.save_plan.distinct_pieces`),
    who sends each its holder policy for a gathered save
    (:func:`paddle_dcp.core.save_plan.gather_senders`).

    Raises:
        MismatchError: ranks disagree on a tensor's dtype or shape, on what is a tensor, or (for
            ``state_type="params"``) on which tensors there are.
        FormatError: a dtype safetensors cannot hold, or the reserved key ``__metadata__``.
        PlanError: pieces that overlap or leave a gap.
    """
    skeleton = _skeleton(summaries, ranks, root, state_type)
    distinct = save_plan.distinct_pieces(summaries)
    if "__metadata__" in distinct.keys:
        raise FormatError("the key '__metadata__' is reserved by safetensors; rename that entry of the state dict")
    tensors = _file_layout(nested.tensor_keys(skeleton), distinct)
    chosen = save_plan.gather_senders(distinct, [t.key for t in tensors], root)
    groups = _pack_groups(tensors, chosen, root, limit)
    return GatherPlan(tensors, skeleton, groups, _header(tensors, skeleton))


def _skeleton(summaries: Sequence[save_plan.SaveSummary], ranks: tuple[int, ...], root: int, state_type: str) -> dict:
    """The file's structure: the gathering rank's skeleton ("params": every rank must hold the
    same tensors), or every rank's merged ("opt": optimizer states split by key)."""
    docs = dict(zip(ranks, summaries))
    skeleton = docs[root].skeleton
    root_keys = set(docs[root].keys)
    for r in [r for r in ranks if r != root]:
        summary = docs[r]
        if state_type == "params" and set(summary.keys) != root_keys:
            lacks = sorted(root_keys - set(summary.keys))[:5]
            extra = sorted(set(summary.keys) - root_keys)[:5]
            raise MismatchError(
                f"state_type='params' needs the same tensors on every rank: rank {r} lacks {lacks} and "
                f"has {extra} that rank {root} lacks; for optimizer states split by key across ranks "
                f"(sharding), pass state_type='opt'"
            )
        if state_type == "opt":
            try:
                skeleton = nested.merge(skeleton, summary.skeleton)
            except FormatError as exc:
                raise MismatchError(f"rank {r} and rank {root}: {exc}") from None
    return skeleton


def _file_layout(order: list[str], distinct: save_plan.DistinctPieces) -> list[TensorLayout]:
    """The file's layout, in the state dict's order."""
    tensors, at = [], 0
    for key in order:
        k = distinct.position(key)
        dtype, shape = distinct.dtypes[k], distinct.shapes[k]
        if dtype not in SAFETENSORS_DTYPES:
            raise FormatError(
                f"{key}: {dtype} has no safetensors dtype (supported: {', '.join(SAFETENSORS_DTYPES)}); "
                f"save it with save_state_dict instead"
            )
        nbytes = math.prod(shape) * itemsize(dtype)
        tensors.append(TensorLayout(key, dtype, shape, at, nbytes))
        at += nbytes
    return tensors


def _pack_groups(tensors: list[TensorLayout], chosen: dict, root: int, limit: int) -> list[Group]:
    """Chunks (contiguous, at most ``limit`` bytes) packed into groups (at most ``limit``
    bytes), each chunk's regions assigned to the rank that sends them."""
    batch, small, part = _limits(limit)
    groups: list[Group] = []
    pending: dict[int, list[Region]] = {}
    for t in tensors:
        isz = itemsize(t.dtype)
        whole = Box.whole(t.shape)
        chunks = [whole] if t.nbytes <= limit else split_region(whole, max(1, limit // isz), t.shape)
        for chunk in chunks:
            first, stop = element_span(t.shape, chunk)
            cstart, cbytes = t.begin + first * isz, (stop - first) * isz
            if cbytes == 0:
                continue
            if not groups or groups[-1].nbytes + cbytes > limit:
                if groups:
                    _flush_batches(groups[-1], pending, batch)
                groups.append(Group(cstart, cstart))
            g = groups[-1]
            at_in_group = cstart - g.start
            g.stop = cstart + cbytes
            for r, box in chosen[t.key]:
                inter = chunk.intersect(box)
                if inter is None:
                    continue
                reg = Region(t.key, inter, chunk, at_in_group, isz)
                if r == root:
                    g.own.append(reg)
                elif reg.nbytes <= small:
                    pending.setdefault(r, []).append(reg)
                else:
                    origin = Box((0,) * inter.ndim, inter.shape)
                    for p in split_region(origin, max(1, part // isz), inter.shape):
                        shifted = Box(tuple(a + b for a, b in zip(p.offsets, inter.offsets)), p.shape)
                        g.messages.setdefault(r, []).append([Region(t.key, shifted, chunk, at_in_group, isz)])
    if groups:
        _flush_batches(groups[-1], pending, batch)
    return groups


def _flush_batches(group: Group, pending: dict[int, list[Region]], batch: int) -> None:
    """The small regions pending per sender, as messages of at most ``batch`` bytes of ``group``."""
    for r, regions in pending.items():
        msgs = group.messages.setdefault(r, [])
        cur, size = [], 0
        for reg in regions:
            if cur and size + reg.nbytes > batch:
                msgs.append(cur)
                cur, size = [], 0
            cur.append(reg)
            size += reg.nbytes
        if cur:
            msgs.append(cur)
    pending.clear()


def _header(tensors: list[TensorLayout], skeleton: dict) -> bytes:
    """The safetensors header: 8-byte length, then JSON padded with spaces to 8 bytes."""
    metadata = {
        "format": METADATA_FORMAT,
        "format_version": METADATA_VERSION,
        "created_by": f"paddle_dcp {__version__}",
        "structure": json.dumps(skeleton, separators=(",", ":")),
    }
    # Tensors without elements are described in the metadata only: safetensors 0.8's paddle
    # backend (paddle.load(..., safetensors=True)) fails on a zero-byte tensor.
    empty = {t.key: {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape)} for t in tensors if t.nbytes == 0}
    if empty:
        metadata["empty_tensors"] = json.dumps(empty, separators=(",", ":"))
    stored = sorted((t for t in tensors if t.nbytes), key=lambda t: t.begin)
    at = 0
    for t in stored:  # encode_header places them back to back: the plan's layout must agree
        if t.begin != at:
            raise AssertionError(f"{t.key}: the plan puts it at byte {t.begin}, after {at} bytes")
        at += t.nbytes
    return encode_header(((t.key, SAFETENSORS_DTYPES[t.dtype], t.shape, t.nbytes) for t in stored), metadata)
