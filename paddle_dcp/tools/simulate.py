"""Every rank of a job in one process: the real save and load protocols run on layouts alone.

No tensors and no files: each simulated rank holds a layout (its skeleton and the boxes of its
pieces); writing returns the checksum count a real write would produce; the metadata is built,
serialized and parsed for real. The collectives are :class:`paddle_dcp.parallel.simworld.SimWorld`'s, which
hand each rank what the real collective would and count its bytes with the real comm's cost
functions, so the figures predict a real job's planning traffic (``python scripts/bench scale``; a
multi-process test checks the prediction against a real 4-rank run).
"""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..core.compress import Policy
from ..core import load_plan, metafile, save_plan
from ..parallel import protocol
from ..parallel.loadwork import LoadPlan
from ..io import storage
from ..core.boxes import Box
from ..parallel.comm import Traffic
from ..parallel.simworld import SimWorld
from ..core.metadata import DEFAULT_BLOCK_BYTES, LazyTensors, Metadata, blocks_of
from ..core.metadata_parse import parse_metadata
from ..core.dtypes import itemsize


@dataclass
class RankLayout:
    """What one rank holds: its skeleton (a flat dict of tensor leaves unless given) and
    its pieces in skeleton order."""

    skeleton: dict
    pieces: list[save_plan.LocalPiece]

    @classmethod
    def flat(cls, pieces: Sequence[tuple]) -> "RankLayout":
        """From (key, global_shape, dtype, global_offset, local_shape) tuples: a state dict
        with one tensor leaf per key."""
        local = [
            save_plan.LocalPiece(key, dtype, tuple(shape), Box(tuple(off), tuple(ls)))
            for key, shape, dtype, off, ls in pieces
        ]
        return cls({"d": [[p.key, {"t": 0}] for p in local]}, local)


@dataclass
class SaveSim:
    metadata: Metadata
    metadata_json: bytes
    traffic: dict[int, Traffic]
    coordinator_seconds: float
    peak_rss_growth_mib: float
    plan_reused: bool
    coordinator_gc_seconds: float = 0.0  # of coordinator_seconds, in the garbage collector
    coordinator_kernel_seconds: float = 0.0  # of coordinator_seconds, in the kernel (page faults)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _SimSaveRank:
    """A rank of a simulated save (a protocol.SaveRankProtocol): it describes its layout and
    reports what a real write would, without writing."""

    created_by = ""
    replicas = False
    staged = False
    layout: Callable[[save_plan.SavePlan], save_plan.SavePlan] | None = None
    compress: Policy | None = None  # a simulation writes no bytes: stored sizes are the plain ones

    def __init__(self, rank, ranks, coordinator, layout: RankLayout, values, block_bytes, cache, unique_id, published):
        self.rank, self.ranks, self.coordinator = rank, ranks, coordinator
        self.pieces_of, self._values, self.block_bytes, self.cache = layout, values, block_bytes, cache
        self.unique_id, self.published = unique_id, published

    def prepare(self) -> tuple[None, tuple]:
        return None, ()

    def describe(self, prepared) -> protocol.Described:
        return protocol.Described(self.pieces_of.skeleton, tuple(self.pieces_of.pieces))

    def choose_id(self) -> tuple[int, None]:
        return self.unique_id, None

    def prepare_id(self, uid: int, listing) -> tuple[int, None]:
        return -1, None

    def claim_id(self, uid: int, generation: int, listing) -> tuple[int, int]:
        return uid, generation

    def can_stage(self, described, leaves: np.ndarray) -> bool:
        return False  # never asked: the simulation does not stage (``staged`` False)

    def stage(self, described, leaves) -> protocol.Described:
        return described

    def reserve(self, described, leaves) -> None:
        pass

    def write(self, described, uid, generation, leaves):  # what a real write returns: the file's size and checksums
        pieces = [self.pieces_of.pieces[i] for i in leaves.tolist()]
        nbytes = np.array([p.box.volume * itemsize(p.dtype) for p in pieces], dtype=np.int64)
        _, size = save_plan.layout_offsets(nbytes)
        count = int(blocks_of(nbytes, self.block_bytes).sum()) if len(nbytes) else 0
        # checksums are incompressible: random ones keep the metadata's size honest
        return size, np.random.default_rng(self.rank).integers(0, 2**63, count, dtype=np.int64).tolist()

    def values(self, prepared) -> dict:
        return self._values

    def publish(self, meta: Metadata, generation: int) -> None:
        self.published.append(meta)

    def tidy(self, uid, generation, listing) -> None:
        pass


def simulate_save(
    layouts: dict[int, RankLayout],
    coordinator: int = 0,
    values: dict[str, Any] | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    cache: dict | None = None,
    unique_id: int = 0,
) -> SaveSim:
    """Run the save protocol for every rank of ``layouts``. Pass the same ``cache`` to a second
    call to simulate a save whose plan is reused."""
    ranks = tuple(sorted(layouts))
    world = SimWorld(ranks, coordinator)
    published: list[Metadata] = []
    caches = cache if cache is not None else {}
    values = values or {}
    if values:  # every rank's state dict holds the plain values (saved from the coordinator's)
        extra = [[k, {"x": 0}] for k in values]
        layouts = {r: RankLayout({"d": l.skeleton["d"] + extra}, l.pieces) for r, l in layouts.items()}

    def side_of(r: int) -> protocol.SaveRankProtocol:  # mypy checks that the simulated rank is one
        return _SimSaveRank(r, ranks, coordinator, layouts[r], values, block_bytes, caches.setdefault(r, {}),
                            unique_id, published)

    before = _peak_rss_mib()
    results = world.run({r: protocol.save(side_of(r)) for r in ranks}, timed=(coordinator,))
    t0 = time.perf_counter()
    meta_json = metafile.encode(published[0])  # the coordinator's publish serializes it
    world.seconds[coordinator] += time.perf_counter() - t0
    return SaveSim(
        metadata=published[0],
        metadata_json=meta_json,
        traffic=world.traffic,
        coordinator_seconds=world.seconds[coordinator],
        peak_rss_growth_mib=max(0.0, _peak_rss_mib() - before),
        plan_reused=results[coordinator].plan_reused,
        coordinator_gc_seconds=world.gc_seconds[coordinator],
        coordinator_kernel_seconds=world.kernel_seconds[coordinator],
    )


@dataclass
class LoadSim:
    """A simulated load: every rank's traffic, the coordinator's time in its steps (of which
    ``coordinator_gc_seconds`` was Python's garbage collector), the metadata's parse time, and
    how many tensor entries the coordinator parsed (its own targets' only)."""

    traffic: dict[int, Traffic]
    coordinator_seconds: float
    metadata_parse_seconds: float
    coordinator_gc_seconds: float = 0.0
    coordinator_entries_parsed: int = 0
    coordinator_calls: int = 0  # function calls in the coordinator's steps (count_calls=True)
    metadata_read: dict[int, int] = field(default_factory=dict)  # bytes of the metadata file each planning rank read


class NoWork:
    """A rank's load work when only its messages matter: it reads nothing itself, and asks the
    servers the coordinator names for ``elsewhere`` (ops on files of ``meta`` it cannot read)
    for nothing."""

    def __init__(self, ops=(), elsewhere=(), meta=None):
        self.plan = LoadPlan(meta=meta, ops=tuple(ops), elsewhere=tuple(elsewhere))

    def serve_from(self, answer):
        self.plan = self.plan.served(answer)

    def open_local(self):
        pass

    def verify_local(self, share):
        pass

    def read_local(self):
        pass

    def verify_remote(self, comm, clients):
        pass

    def exchange(self, comm, clients):
        pass

    def finish(self):
        pass


def plan_rank(meta: Metadata, targets: Sequence[load_plan.TargetPiece]) -> list:
    """One rank's load planning as a real rank does it: the entries of its tensors parsed
    together, then its reads."""
    meta.prefetch(t.key for t in targets)
    return load_plan.plan_reads(meta, targets)


def targets_of(layout: RankLayout) -> list[load_plan.TargetPiece]:
    return [load_plan.TargetPiece(p.key, p.dtype, p.global_shape, p.box) for p in layout.pieces if p.box is not None]


class SimLoadRank:
    """A rank of a simulated load (a protocol.LoadRankProtocol) on a shared file system, or on
    object storage (``lists_for_all``: the coordinator alone lists and reads the metadata, whose
    bytes it broadcasts). With a ``layout``, it parses the metadata and plans its reads for
    real; without, it reuses the parsed ``shared`` metadata and plans nothing."""

    unique_id: int | None = None
    path = "<simulated>"
    shares_targets = False
    near: frozenset = frozenset()

    def __init__(self, rank, ranks, coordinator, listing, metadata_json, shared, layout, parsed, lists_for_all,
                 wanted, read_bytes, starts):
        self.rank, self.ranks, self.coordinator = rank, ranks, coordinator
        self.listing, self.metadata_json, self.shared, self.layout, self.parsed = listing, metadata_json, shared, layout, parsed
        self.lists_for_all, self._wanted, self.read_bytes, self.starts = lists_for_all, wanted, read_bytes, starts

    def inspect(self):
        if self.lists_for_all and self.rank != self.coordinator:
            return None, storage.Listing(frozenset(), {})
        return None, self.listing

    def read_metadata(self, view, uid: int) -> Metadata:
        """As a rank on a shared file system reads it: a large version 3 file in parts (the
        bytes read counted), any other whole."""
        data = self.metadata_json
        if self.layout is None:
            return self.shared
        if metafile.is_packed(data) and metafile.worth_parts(len(data)):
            view_ = memoryview(data)

            def fetch(ranges):
                self.read_bytes[self.rank] = self.read_bytes.get(self.rank, 0) + sum(b - a for a, b in ranges)
                return [view_[a:b] for a, b in ranges]

            self.parsed[self.rank] = metafile.read_part(fetch, len(data), self.wanted(view))
            return self.parsed[self.rank]
        self.read_bytes[self.rank] = len(data)
        return self.parse_metadata(uid, b"M" + data)

    def metadata_bytes(self, view, uid: int) -> bytes:
        return b"M" + self.metadata_json

    def wanted(self, view):
        return self._wanted

    def metadata_start(self, blob: bytes, source: str) -> metafile.Start:
        """Every simulated rank receives the same bytes: parsed once for all of them (each of
        thousands of real ranks parses its own)."""
        found = self.starts.get(blob)
        if found is None:
            found = self.starts[blob] = protocol.start_of(blob, source)
        return found

    def in_parts(self, data: bytes) -> memoryview | None:
        body = memoryview(data)[1:]
        return body if metafile.is_packed(body) and metafile.worth_parts(len(body)) else None

    def parse_metadata(self, uid: int, data: bytes) -> Metadata:
        if self.layout is None:
            return self.shared
        self.parsed[self.rank] = parse_metadata(data[1:], lazy=True)
        return self.parsed[self.rank]

    def metadata_from_helpers(self, view, readers, meta):
        return None

    def plan(self, view, meta, uid, listing, every_target):
        if self.layout is None:
            return NoWork()
        self.parsed[self.rank] = meta
        return NoWork(plan_rank(meta, targets_of(self.layout)))

    def targets(self, view) -> bytes:
        return b""

    def all_targets(self, blobs) -> None:
        return None


def simulate_load(
    layouts: dict[int, RankLayout],
    metadata_json: bytes,
    coordinator: int = 0,
    unique_id: int = 0,
    plan_ranks: Sequence[int] = (),
    object_storage: bool = False,
    count_calls: bool = False,
) -> LoadSim:
    """Run the load protocol for every rank of ``layouts`` on a shared file system (every rank
    sees the metadata and every data file), or with ``object_storage`` as on an s3:// URL (the
    coordinator reads the metadata and broadcasts it). The coordinator parses the metadata and
    plans its reads for real (timed); so do the ranks in ``plan_ranks``; the others reuse the
    parsed metadata and skip planning, which sends no message. ``count_calls`` counts the
    function calls of the coordinator's steps (slower)."""
    ranks = tuple(sorted(layouts))
    world = SimWorld(ranks, coordinator)
    parsed: dict[int, Metadata] = {}
    t0 = time.perf_counter()
    shared = parse_metadata(metadata_json, lazy=True)
    parse_seconds = time.perf_counter() - t0
    writers = [w for w in (storage.parse_data_name(f.name) for f in shared.files) if w is not None]
    listing = storage.Listing(frozenset({unique_id}), {unique_id: frozenset((r, g) for r, _, g in writers)})

    read_bytes: dict[int, int] = {}
    starts: dict[bytes, metafile.Start] = {}

    def side_of(r: int) -> protocol.LoadRankProtocol:  # mypy checks that the simulated rank is one
        real = r == coordinator or r in plan_ranks
        # on object storage every rank asks the coordinator for its part of a large file
        wanted = wanted_of(layouts[r]) if real or object_storage else None
        return SimLoadRank(r, ranks, coordinator, listing, metadata_json, shared, layouts[r] if real else None, parsed,
                            object_storage, wanted, read_bytes, starts)

    world.run({r: protocol.load(side_of(r)) for r in ranks}, timed=(coordinator,), count_calls=count_calls)
    tensors = parsed[coordinator].tensors
    entries = tensors.parsed_count if isinstance(tensors, LazyTensors) else len(tensors)
    return LoadSim(world.traffic, world.seconds[coordinator], parse_seconds, world.gc_seconds[coordinator], entries,
                   world.calls[coordinator], read_bytes)


def wanted_of(layout: RankLayout) -> dict[str, list[Box]]:
    """The keys a rank of this layout reads and the boxes it fills (what it reads of a large
    metadata file)."""
    out: dict[str, list[Box]] = {}
    for p in layout.pieces:
        out.setdefault(p.key, []).extend([p.box] if p.box is not None else [])
    return out
