"""Object storage without a server: its options, and the object storage on fsspec's in-memory
filesystem (memory://), against numpy oracles."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp.errors import ArgumentError, FormatError, IntegrityError, StorageError, UnsupportedError
from paddle_dcp.io import open_storage
from paddle_dcp.io import storage as dcp_storage


# ---------------------------------------------------------------------- options
def test_an_attempt_is_cut_at_the_retry_deadline_on_asynchronous_filesystems(s3_env):
    s3 = open_storage(s3_env.url("limit"), {"retry_deadline": 7.5})
    assert s3.limit == {"timeout": 7.5}
    assert open_storage("memory://b/limit").limit == {}  # fsspec cannot cut a synchronous call


@pytest.mark.parametrize("options", [{"part_size": 0}, {"retries": 0}, {"part_size": 1 << 20}, {"read_concurrency": "4"}, {"spill_dir": 3}, {"spill_dir": "/no/such/dir"}])
def test_bad_storage_options_are_argument_errors(options):
    with pytest.raises(ArgumentError):
        open_storage("s3://bucket/run1", options)


def test_s3fs_missing_says_how_to_install_it(monkeypatch):
    import fsspec

    def missing(protocol):
        raise ImportError("Install s3fs to access S3", name="s3fs")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(UnsupportedError, match=r"pip install paddle-dcp\[s3\]"):
        open_storage("s3://bucket/run1")


# ---------------------------------------------------------------------- memory://
def state(variant: int = 0) -> dict:
    return {
        "model": {"w": np.arange(33 * 17, dtype=np.float32).reshape(33, 17) + variant, "b": np.arange(1001) * 3},
        "step": variant,
    }


def empty() -> dict:
    return {"model": {"w": np.zeros((33, 17), np.float32), "b": np.zeros(1001, np.int64)}, "step": -1}


def check(sd: dict, variant: int) -> None:
    expected = state(variant)
    assert np.array_equal(sd["model"]["w"], expected["model"]["w"])
    assert np.array_equal(sd["model"]["b"], expected["model"]["b"])
    assert sd["step"] == variant


@pytest.fixture
def url():
    u = f"memory://bucket/{uuid.uuid4().hex}"
    yield u
    import fsspec

    fsspec.filesystem("memory").rm(u[len("memory://"):], recursive=True)


def test_round_trip_numbering_and_generations_on_memory(url):
    paddle_dcp.save_state_dict(state(0), url)
    paddle_dcp.save_state_dict(state(1), url)  # unique_id=None: 1
    paddle_dcp.save_state_dict(state(2), url, unique_id=1)  # replaces 1 by a new generation
    store = open_storage(url)
    assert sorted(store.sizes()) == ["0.0.claim", "0.metadata", "0_0.distcp", "0_1.1.distcp", "1.1.claim", "1.metadata"]
    for uid, variant in ((0, 0), (1, 2), (None, 2)):
        sd = empty()
        paddle_dcp.load_state_dict(sd, url, unique_id=uid)
        check(sd, variant)
    assert paddle_dcp.read_metadata(url).unique_id == 1


def _replace(url: str, name: str, data: bytes) -> None:
    import fsspec

    fsspec.filesystem("memory").pipe_file(f"{url[len('memory://'):]}/{name}", data)


def test_a_short_or_damaged_object_is_an_integrity_error_and_the_target_is_unchanged(url):
    paddle_dcp.save_state_dict(state(0), url)
    store = open_storage(url)
    data = store.fs.cat_file(store.full("0_0.distcp"))
    _replace(url, "0_0.distcp", data[:-8])
    sd = empty()
    with pytest.raises(IntegrityError, match="0_0.distcp has .* bytes, the metadata says"):
        paddle_dcp.load_state_dict(sd, url)
    flipped = bytearray(data)
    flipped[200] ^= 1
    _replace(url, "0_0.distcp", bytes(flipped))
    with pytest.raises(IntegrityError, match="checksum"):
        paddle_dcp.load_state_dict(sd, url)
    assert not sd["model"]["w"].any() and sd["step"] == -1


def test_missing_checkpoint_and_bad_metadata_on_memory(url):
    with pytest.raises(FormatError, match="no complete checkpoint"):
        paddle_dcp.read_metadata(url)
    with pytest.raises(StorageError, match="no metadata file"):
        dcp_storage.read_metadata(open_storage(url), 3)
    paddle_dcp.save_state_dict(state(0), url)
    _replace(url, "0.metadata", b"{not json")
    with pytest.raises(FormatError):
        paddle_dcp.read_metadata(url)


def test_remove_and_resolve_on_memory(url):
    paddle_dcp.save_state_dict(state(0), url)
    store = open_storage(url)
    assert store.resolve("0_0.distcp") == f"{url}/0_0.distcp"
    with pytest.raises(FormatError):
        store.resolve("../other/0_0.distcp")
    assert store.size("0_0.distcp") == paddle_dcp.read_metadata(url).files[0].nbytes
    assert store.size("9_9.distcp") is None
    assert store.remove(["0_0.distcp", "9_9.distcp"]) == ["0_0.distcp"]
    assert sorted(store.sizes()) == ["0.0.claim", "0.metadata"]
