"""Object storage on the session's real S3 server (SeaweedFS on 127.0.0.1): a rank's memory
stays within issue 17's bound, a save and a load make only the listing requests they need, and
"directory" entries (SeaweedFS keeps listing a prefix whose objects were all deleted) are no
files of a checkpoint.

Memory is the peak of Python's traced allocations during the call (tracemalloc: bytes,
bytearrays and numpy buffers, including those the S3 client allocates), so the figure does not
depend on the allocator or on what else runs on the machine. The state dict exists before the
measurement starts, as a training job's does.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp.io import storage as dcp_storage
from s3server import Requests

MiB = 1 << 20
SHARE = 96 * MiB  # one process: the whole checkpoint is its share
# small limits, so that copies per part or per range in flight show up clearly above them
OPTIONS = {
    "part_size": 5 * MiB, "parts_in_flight": 3,
    "read_chunk_bytes": 2 * MiB, "read_ahead_bytes": 8 * MiB, "read_cache_bytes": 4 * MiB,
}
MAX_READ = 32 * MiB  # the planner's largest read (load_plan.plan_reads' max_read_bytes)
MARGIN = 6 * MiB  # metadata, plans, the client's own buffers


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sd = {f"layer{i}.w": rng.standard_normal((768, 1024), dtype=np.float32) for i in range(24)}  # 3 MiB each
    sd["emb"] = rng.standard_normal((1536, 4096), dtype=np.float32)  # 24 MiB: one tensor of several parts
    assert sum(a.nbytes for a in sd.values()) == SHARE
    return sd


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def saved(s3_env):
    url = s3_env.url("bounds")
    sd = _state(0)
    paddle_dcp.save_state_dict(sd, url, storage_options=OPTIONS)  # warms the client up too
    return url, sd


def test_a_save_stays_within_the_disk_bound_plus_the_parts_in_flight(saved):
    url, _ = saved
    sd = _state(1)
    peak = _peak(lambda: paddle_dcp.save_state_dict(sd, url, storage_options=OPTIONS))
    bound = SHARE // 10 + OPTIONS["parts_in_flight"] * OPTIONS["part_size"] + MARGIN
    assert peak <= bound, f"save peak {peak / MiB:.1f} MiB > {bound / MiB:.1f} MiB"
    back = {k: np.zeros_like(v) for k, v in sd.items()}
    paddle_dcp.load_state_dict(back, url, storage_options=OPTIONS)
    assert all(np.array_equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_stays_within_the_disk_bound_plus_the_reads_in_flight(saved, verify):
    url, sd = saved
    back = {k: np.zeros_like(v) for k, v in sd.items()}
    peak = _peak(lambda: paddle_dcp.load_state_dict(back, url, storage_options=OPTIONS, verify=verify))
    in_flight = max(OPTIONS["read_ahead_bytes"], MAX_READ) + OPTIONS["read_cache_bytes"]
    bound = SHARE // 10 + in_flight + MARGIN
    assert peak <= bound, f"load peak {peak / MiB:.1f} MiB > {bound / MiB:.1f} MiB"
    assert all(np.array_equal(back[k], sd[k]) for k in sd)


def requests_of(url: str) -> Requests:
    """The requests of the client every call with OPTIONS shares (its fsspec part is the same)."""
    from paddle_dcp.io import open_storage

    return Requests(open_storage(url, OPTIONS).fs)


def test_a_save_and_a_load_list_the_prefix_once_and_uploads_only_when_saving(s3_env):
    url = s3_env.url("requests")
    sd = {"w": np.arange(1000, dtype=np.float32), "b": np.ones((3, 4), np.int64)}
    paddle_dcp.save_state_dict(sd, url, storage_options=OPTIONS)  # the client's first requests
    wire = requests_of(url)
    try:
        # a new id; the same id again (a new generation, the old data object deleted); a new id
        for unique_id, deletes in ((None, 0), (1, 1), (None, 0)):
            wire.clear()
            paddle_dcp.save_state_dict(sd, url, storage_options=OPTIONS, unique_id=unique_id)
            assert wire.count("ListObjectsV2") == 1 and wire.count("ListMultipartUploads") == 1, (unique_id, wire.seen)
            assert wire.count("DeleteObject") + wire.count("DeleteObjects") == deletes, (unique_id, wire.seen)
            assert wire.count("PutObject") == 3, (unique_id, wire.seen)  # the claim, the data object, the metadata
        wire.clear()
        back = {k: np.zeros_like(v) for k, v in sd.items()}
        paddle_dcp.load_state_dict(back, url, storage_options=OPTIONS)
        assert wire.count("ListObjectsV2") == 1 and wire.count("ListMultipartUploads") == 0, wire.seen
        assert all(np.array_equal(back[k], sd[k]) for k in sd)
        wire.clear()
        paddle_dcp.load_state_dict(back, url, storage_options=OPTIONS, unique_id=1)  # no listing needed
        assert wire.count("ListObjectsV2") == 0 and wire.count("ListMultipartUploads") == 0, wire.seen
        wire.clear()
        assert paddle_dcp.read_metadata(url, storage_options=OPTIONS).unique_id == 2
        assert wire.seen.count("ListObjectsV2") == 1 and wire.count("ListMultipartUploads") == 0, wire.seen
    finally:
        wire.close()
    from paddle_dcp.io import open_storage

    names = sorted(open_storage(url, OPTIONS).sizes())
    assert names == ["0.0.claim", "0.metadata", "0_0.distcp", "0_1.1.distcp", "0_2.distcp", "1.1.claim", "1.metadata",
                     "2.0.claim", "2.metadata"], names


def _leave_a_directory_entry(store, name: str) -> None:
    """Write an object below ``name``/ and delete it: SeaweedFS keeps listing ``name`` as a
    directory entry of the prefix."""
    full = f"{store.root}/{name}/x"
    store.fs.pipe_file(full, b"x")
    store.fs.rm_file(full)


def test_directory_entries_left_by_deleted_objects_are_no_files(s3_env, capsys):
    from paddle_dcp.io import is_file, open_storage
    from paddle_dcp.tools import cli

    url = s3_env.url("dirs")
    sd = {"w": np.arange(10, dtype=np.float32)}
    paddle_dcp.save_state_dict(sd, url, storage_options=OPTIONS)
    store = open_storage(url, OPTIONS)
    for name in ("5.metadata", "3_0.distcp", "0_0.distcp.tmp.abc", "sub"):
        _leave_a_directory_entry(store, name)
    entries = store.fs.ls(store.root, detail=True, refresh=True)
    assert {e["name"].rsplit("/", 1)[-1] for e in entries if e["type"] == "directory"} >= {"5.metadata", "sub"}, entries
    listing = dcp_storage.list_checkpoints(store)
    assert listing.complete == {0} and set(listing.data) == {0} and listing.temporary == (), listing
    assert listing.files == {"0.0.claim", "0.metadata", "0_0.distcp"}, listing.files
    assert store.size("5.metadata") is None and store.size("sub") is None
    assert paddle_dcp.read_metadata(url, storage_options=OPTIONS).unique_id == 0
    paddle_dcp.save_state_dict(sd, url, storage_options=OPTIONS)  # unique_id=None: 1, not 6
    assert paddle_dcp.read_metadata(url, storage_options=OPTIONS).unique_id == 1
    assert cli.main(["clean", "--incomplete", url]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    # a checkpoint prefix whose every object was deleted is an empty checkpoint directory
    store.remove(sorted(store.sizes()))
    assert store.fs.ls(f"{store.root.split('/')[0]}", refresh=True)  # weed still lists "dirs"
    assert not is_file(url, OPTIONS) and dcp_storage.list_checkpoints(store).files == frozenset()
    with pytest.raises(paddle_dcp.errors.FormatError, match="no complete checkpoint"):
        paddle_dcp.read_metadata(url, storage_options=OPTIONS)
    paddle_dcp.save_state_dict(sd, url, storage_options=OPTIONS)
    assert paddle_dcp.read_metadata(url, storage_options=OPTIONS).unique_id == 0


def test_bodies_are_not_hashed_for_the_signature_unless_asked(s3_env):
    """botocore signs a body's SHA-256 unless told not to (or over https with a checksum
    header); the checksums of every block make that work redundant, so it is off by default."""
    sd = {"w": np.arange(3000, dtype=np.float32)}
    for options, signed in ((OPTIONS, False), (dict(OPTIONS, config_kwargs={"s3": {"payload_signing_enabled": True}}), True)):
        url = s3_env.url(f"signing-{signed}")
        paddle_dcp.save_state_dict(sd, url, storage_options=options)  # the client's first requests
        from paddle_dcp.io import open_storage

        fs = open_storage(url, options).fs
        hashes: list[str] = []

        def hook(request, **kwargs):
            if request.method == "PUT":
                hashes.append(request.headers.get("X-Amz-Content-SHA256", b""))

        fs.s3.meta.events.register("before-send.s3", hook)
        try:
            paddle_dcp.save_state_dict(sd, url, storage_options=options)
        finally:
            fs.s3.meta.events.unregister("before-send.s3", hook)
        values = {h.decode() if isinstance(h, bytes) else h for h in hashes}
        assert hashes and (values == {"UNSIGNED-PAYLOAD"}) != signed, (signed, values)
        back = {"w": np.zeros(3000, np.float32)}
        paddle_dcp.load_state_dict(back, url, storage_options=options)
        assert np.array_equal(back["w"], sd["w"])


@pytest.mark.parametrize("spill", [True, False])
def test_a_verified_load_fetches_each_byte_once_when_it_can_spill(saved, tmp_path, spill):
    """The load checks every block before it copies; the ranges beyond read_cache_bytes wait
    in the spill file, so the share is fetched once; without one, they are fetched again."""
    url, sd = saved
    wire = requests_of(url)
    try:
        back = {k: np.zeros_like(v) for k, v in sd.items()}
        options = dict(OPTIONS, spill_dir=str(tmp_path) if spill else None)
        paddle_dcp.load_state_dict(back, url, storage_options=options)
        assert all(np.array_equal(back[k], sd[k]) for k in sd)
        if spill:
            assert SHARE <= wire.got < SHARE * 1.02, wire.got / SHARE
        else:
            assert wire.got > SHARE * 1.8, wire.got / SHARE
    finally:
        wire.close()
    assert list(tmp_path.iterdir()) == []  # the spill file has no name


def test_objects_are_deleted_in_batches_and_a_refused_key_is_named(s3_env, monkeypatch):
    from paddle_dcp.errors import StorageError
    from paddle_dcp.io import objects, open_storage

    store = open_storage(s3_env.url("batches"), OPTIONS)
    names = [f"0_{i}.distcp" for i in range(5)]
    for name in names:
        store.fs.pipe_file(store.full(name), b"x")
    monkeypatch.setattr(objects, "DELETE_BATCH", 2)
    wire = requests_of(s3_env.url("batches"))
    try:
        assert sorted(store.remove(names)) == names
        assert wire.count("DeleteObjects") == 3 and wire.count("DeleteObject") == 0, wire.seen
    finally:
        wire.close()
    assert store.sizes() == {}
    store.fs.pipe_file(store.full("0_9.distcp"), b"x")
    store.fs.pipe_file(store.full("0_8.distcp"), b"x")
    refused = {"Errors": [{"Key": store.key_prefix + "0_9.distcp", "Code": "AccessDenied", "Message": "no"}]}
    monkeypatch.setattr(store, "s3", lambda method, **kwargs: refused)
    with pytest.raises(StorageError, match=r"batches/0_9.distcp: AccessDenied no \(1 of 2 objects not deleted\)"):
        store.remove(["0_8.distcp", "0_9.distcp"])


def test_a_claim_is_a_conditional_put_that_one_of_two_racing_claimers_wins(s3_env):
    """On the S3 server, create_exclusive is a PUT with If-None-Match: the first creates the
    claim, a second (the same name) is told it exists, even from eight threads at once."""
    import threading

    from paddle_dcp.io import open_storage

    store = open_storage(s3_env.url("claims"), OPTIONS)
    assert store.create_exclusive("3.0.claim", b"") and not store.create_exclusive("3.0.claim", b"")
    won, start = [], threading.Barrier(8)

    def race(i):
        other = open_storage(s3_env.url("claims"), OPTIONS)
        start.wait()
        if other.create_exclusive("4.0.claim", b""):
            won.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1, won
    assert sorted(store.sizes()) == ["3.0.claim", "4.0.claim"]
