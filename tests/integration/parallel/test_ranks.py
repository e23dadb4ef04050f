"""A real rank's side of a save and a load (parallel/ranks.py): each step's result a value, the
rank holding only its inputs; and a directory of safetensors files (a Hugging Face checkpoint)
on storage every rank sees alike (object storage): the coordinator alone lists it and reads its index and headers, every rank
parses what it broadcast, and each rank then reads only the tensors' bytes. The real
LocalLoadRank on ranks that are threads, over an in-memory storage that records every call."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save

from paddle_dcp.parallel import protocol
from paddle_dcp.parallel.comm import SoloComm
from paddle_dcp.parallel.ranks import LocalLoadRank, LocalSaveRank
from paddle_dcp.parallel.options import LoadOptions, SaveOptions
from paddle_dcp.errors import CollectiveError
from paddle_dcp.io import safetensors_files

from unit.io.memory_storage import MemoryStorage
from unit.parallel.fakes import ThreadWorld

SIZE = 3
SHARDS = {"model-00001-of-00002.safetensors": ["embed.weight"], "model-00002-of-00002.safetensors": ["layers.0.w", "layers.0.b"]}
SHAPES = {"embed.weight": ((8, 6), np.float32), "layers.0.w": ((6, 10), np.int64), "layers.0.b": ((4, 2), np.float64)}


def oracle(key: str) -> np.ndarray:
    shape, dtype = SHAPES[key]
    return (np.arange(int(np.prod(shape))) * (list(SHAPES).index(key) + 3) % 1000).astype(dtype).reshape(shape)


def hf_directory(index: bool = True) -> dict[str, bytes]:
    """A Hugging Face directory written by the safetensors package: two shards (and their index)."""
    blobs = {name: save({k: oracle(k) for k in keys}) for name, keys in SHARDS.items()}
    if index:
        weight_map = {k: name for name, keys in SHARDS.items() for k in keys}
        blobs["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    blobs["config.json"] = b"{}"
    return blobs


class SharedStorage(MemoryStorage):
    """Every rank sees the same blobs (object storage's contract); one instance per rank, each
    recording the calls its rank makes."""

    seen_by_all = True

    def __init__(self, blobs: dict):
        super().__init__("s3://bucket/model", blobs)
        self.calls: list[str] = []

    def list_names(self, temporary: bool = True):
        self.calls.append("list")
        return super().list_names()

    def size(self, name: str):
        self.calls.append(f"size {name}")
        return super().size(name)

    def range_reader(self):
        self.calls.append("range")
        return super().range_reader()

    def read_file(self, name: str, limit: int | None = None):
        if name.endswith(".metadata"):
            self.calls.append("metadata")
        return super().read_file(name, limit)

    def open_files(self, entries, whose=""):
        self.calls.append("data")
        return super().open_files(entries, whose)


def targets() -> dict:
    return {"embed": {"weight": np.zeros((8, 6), np.float32)},
            "layers": {"0": {"w": np.zeros((6, 10), np.int64), "b": np.zeros((4, 2), np.float64)}}}


def load_on_threads(blobs: dict, unique_id=None):
    stores = [SharedStorage(blobs) for _ in range(SIZE)]
    state = [targets() for _ in range(SIZE)]

    def one(comm):
        side = LocalLoadRank(comm, state[comm.rank], "s3://bucket/model", stores[comm.rank], unique_id, LoadOptions(safetensors=True))
        return protocol.run(comm, protocol.load(side))[0]

    return ThreadWorld(SIZE).run(one), stores, state


@pytest.mark.parametrize("index", [True, False])
def test_the_coordinator_alone_reads_the_directory_and_every_rank_loads_it(index):
    results, stores, state = load_on_threads(hf_directory(index))
    assert results == {r: 0 for r in range(SIZE)}, results
    for sd in state:
        assert np.array_equal(sd["embed"]["weight"], oracle("embed.weight"))
        assert np.array_equal(sd["layers"]["0"]["w"], oracle("layers.0.w"))
        assert np.array_equal(sd["layers"]["0"]["b"], oracle("layers.0.b"))
    coordinator = stores[0].calls
    assert coordinator.count("list") == 1, coordinator  # once: the id and the directory's files
    sizes = sorted(c for c in coordinator if c.startswith("size"))
    assert sizes == sorted(f"size {n}" for n in list(SHARDS) + (["model.safetensors.index.json"] if index else [])), coordinator
    assert "metadata" not in coordinator  # no metadata file of ours was asked for
    for other in stores[1:]:
        assert other.calls == ["data"], other.calls  # no list, no index, no header: only the tensors' bytes


def test_a_given_id_of_a_directory_is_still_found_by_the_coordinator_alone():
    results, stores, _ = load_on_threads(hf_directory(), unique_id=0)
    assert results == {r: 0 for r in range(SIZE)}, results
    assert stores[0].calls.count("list") == 1 and all(s.calls == ["data"] for s in stores[1:])


def test_an_index_naming_a_missing_shard_fails_every_rank_at_the_coordinators_read():
    blobs = hf_directory()
    del blobs["model-00002-of-00002.safetensors"]
    results, stores, state = load_on_threads(blobs)
    assert {type(e) for e in results.values()} == {CollectiveError}, results
    assert {e.step for e in results.values()} == {"read metadata"}
    assert all(sorted(e.failures) == [0] for e in results.values())
    assert all("model-00002-of-00002.safetensors, which is missing" in e.failures[0] for e in results.values())
    assert all(not sd["embed"]["weight"].any() for sd in state)


def test_a_truncated_header_is_the_same_format_error_on_every_rank():
    blobs = hf_directory()
    name = "model-00001-of-00002.safetensors"
    blobs[name] = blobs[name][:20]
    results, _, _ = load_on_threads(blobs)
    assert {type(e) for e in results.values()} == {CollectiveError}, results
    assert {e.step for e in results.values()} == {"parse metadata"}
    assert all(len(e.failures) == SIZE for e in results.values())
    assert all(f"s3://bucket/model/{name}" in m and "truncated" in m for e in results.values() for m in e.failures.values())


def test_the_blob_holds_the_headers_and_not_the_tensors():
    blobs = hf_directory()
    store = MemoryStorage("d", blobs)
    blob = safetensors_files.directory_blob(store, *safetensors_files.shard_names(store))
    headers = sum(8 + int.from_bytes(blobs[n][:8], "little") for n in SHARDS)
    assert headers < len(blob) < headers + 1024  # the names, sizes and index: a few hundred bytes
    meta = safetensors_files.metadata_from_blob(blob, "d", 4)
    assert meta.unique_id == 4 and sorted(meta.tensors) == sorted(SHAPES)
    assert [f.nbytes for f in meta.files] == [len(blobs[n]) for n in SHARDS]


def test_a_checkpoint_of_ours_claiming_no_checksums_is_refused():
    """Only the coordinator's mark makes a rank take metadata for a directory's, whose files
    carry no checksums: metadata of ours that says so is a format error, not a load without
    checks."""
    store = MemoryStorage("d", hf_directory())
    meta = safetensors_files.directory_metadata(store)
    side = LocalLoadRank.__new__(LocalLoadRank)
    side.store = store
    with pytest.raises(Exception, match="unknown checksum algorithm 'none'"):
        side.parse_metadata(0, b"M" + meta.to_json())


def test_a_checkpoint_of_ours_saved_with_safetensors_loads_with_safetensors_from_shared_storage(monkeypatch):
    """safetensors=True on a checkpoint of ours (rank files in safetensors format, metadata of
    ours) on storage every rank sees: the coordinator's listing finds the metadata, so it is
    no directory; its bytes are broadcast and checked as any checkpoint's."""
    import paddle_dcp
    from paddle_dcp import api

    blobs: dict[str, bytes] = {}
    stores: list[SharedStorage] = []

    def shared(path, storage_options=None):
        stores.append(SharedStorage(blobs))
        return stores[-1]

    monkeypatch.setattr(api, "open_storage", shared)
    want = {k: oracle(k) for k in SHAPES}
    paddle_dcp.save_state_dict({"embed": {"weight": want["embed.weight"]},
                                "layers": {"0": {"w": want["layers.0.w"], "b": want["layers.0.b"]}}}, "shared-ckpt", safetensors=True)
    assert "0.metadata" in blobs and any(n.endswith(".safetensors") for n in blobs), sorted(blobs)
    sd = targets()
    paddle_dcp.load_state_dict(sd, "shared-ckpt", safetensors=True, unique_id=0)
    assert np.array_equal(sd["embed"]["weight"], want["embed.weight"])
    assert np.array_equal(sd["layers"]["0"]["w"], want["layers.0.w"]) and np.array_equal(sd["layers"]["0"]["b"], want["layers.0.b"])
    assert stores[-1].calls.count("list") == 1 and "metadata" in stores[-1].calls, stores[-1].calls


# ---------------------------------------------------------------------- the save rank
class CountingStorage(MemoryStorage):
    """The in-memory storage, counting its listings."""

    def __init__(self, path: str, blobs: dict):
        super().__init__(path, blobs)
        self.listings = 0

    def list_names(self, temporary: bool = True):
        self.listings += 1
        return super().list_names(temporary)


def test_a_save_rank_s_steps_return_values_and_leave_the_rank_and_the_state_dict_as_they_were():
    """Each step's result is a value the protocol carries (issue 28): staging returns a new
    description, the first one and the caller's arrays stay as they were, and the rank object
    holds nothing after the save but its inputs."""
    w, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(3, dtype=np.int64)
    store = CountingStorage("mem", {})
    rank = LocalSaveRank(SoloComm(), {"w": w, "b": b, "step": 3}, store, None, {}, SaveOptions(staged=True))
    attributes = dict(vars(rank))
    prepared, reductions = rank.prepare()
    assert reductions == ()  # no Partial tensor
    described = rank.describe(prepared)
    assert [p.key for p in described.pieces] == ["w", "b"] and described.skeleton == prepared.flat.skeleton
    leaves = np.array([0, 1])
    staged = rank.stage(described, leaves)
    assert staged is not described and all(h.local is not s.local for h, s in zip(described.sources.held, staged.sources.held))
    assert described.sources.held[0].local is w  # the description made before staging still names the caller's array
    w[...] = -1  # the caller changes its tensor after the stage: the staged copy keeps the values
    np.testing.assert_array_equal(staged.sources.held[0].local, np.arange(12, dtype=np.float32).reshape(3, 4))
    result = protocol.run(SoloComm(), protocol.save(LocalSaveRank(SoloComm(), {"w": w, "b": b}, store, None, {})))
    assert result.unique_id == 0 and store.listings == 1  # one listing: the id's choice, its preparation and the tidy
    assert vars(rank) == attributes  # no step stored anything on the rank


def test_a_load_rank_s_inspection_is_a_value_it_keeps_nothing_of():
    blobs: dict = {}
    store = MemoryStorage("mem", blobs)
    paddle_dcp_save({"w": np.arange(4.0)}, store)
    rank = LocalLoadRank(SoloComm(), {"w": np.zeros(4)}, "mem", store, None)
    attributes = dict(vars(rank))
    view, listing = rank.inspect()
    assert listing.latest == 0 and view.shards is None and [h.piece.key for h in view.held] == ["w"]
    assert vars(rank) == attributes


def paddle_dcp_save(state: dict, store) -> None:
    protocol.run(SoloComm(), protocol.save(LocalSaveRank(SoloComm(), state, store, None, {})))


def test_a_helper_that_read_its_part_of_a_packed_file_sends_a_part_the_client_parses():
    """A node without the metadata gets its part from a helper; when the helper read only its
    own part of a large version 3 file, the part it reads for the client was sent as a JSON
    document still saying version 3, which every client refused."""
    from paddle_dcp.core import metafile
    from paddle_dcp.core.metadata_parse import parse_metadata
    from paddle_dcp.core.save_plan import SaveSummary
    from paddle_dcp.parallel.ranks import helper_answer
    from paddle_dcp.tools.simulate import RankLayout, simulate_save, wanted_of

    layouts = {r: RankLayout.flat([("w", (8, 4), "float32", (2 * r, 0), (2, 4)), ("b", (4,), "float32", (0,), (4,))])
               for r in range(4)}
    data = simulate_save(layouts, unique_id=5).metadata_json
    assert metafile.is_packed(data)
    view = memoryview(data)
    fetch = lambda ranges: [view[a:b] for a, b in ranges]  # noqa: E731
    helper_meta = metafile.read_part(fetch, len(data), wanted_of(layouts[0]))
    client = layouts[3]
    summary = SaveSummary.from_pieces(3, client.skeleton, client.pieces)
    reply = helper_answer(helper_meta, summary, False, lambda uid, wanted: metafile.read_part(fetch, len(data), wanted))
    part = parse_metadata(reply, source="the helper's reply", allow_subset=True)
    assert part.subset and part.unique_id == 5
    assert [6, 0] in part.tensors["w"].pieces.offsets.tolist() and part.tensors["b"].pieces.count == 1  # rank 3 reads these
