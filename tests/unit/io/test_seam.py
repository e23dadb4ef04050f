"""The storage interface is the only way save and load reach the files: an in-memory storage
(a fake written here from the Protocol alone) saves and loads a state dict with no file on
disk, byte for byte as the local disk does. And the one atomic writer: temporary name,
fsync of the file before its rename and of the directory after, only when durable."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp import api
from paddle_dcp import io as io_package
from paddle_dcp.core.metadata import aligned
from paddle_dcp.errors import IntegrityError, StorageError
from paddle_dcp.io import local, open_storage, storage
from paddle_dcp.tools import verify

from ..helpers import listdir
from .memory_storage import memory_storage
from ..checkpoints import fsync_log


def state() -> dict:
    w = np.arange(33 * 17, dtype=np.float32).reshape(33, 17) / 7
    return {"model": {"w": w, "b": np.arange(1001, dtype=np.int64)}, "step": 3}


def loads_the_state(path: str) -> None:
    target: dict[str, Any] = {"model": {"w": np.zeros((33, 17), np.float32), "b": np.zeros(1001, np.int64)}, "step": 0}
    paddle_dcp.load_state_dict(target, path)
    want = state()
    assert np.array_equal(target["model"]["w"], want["model"]["w"])
    assert np.array_equal(target["model"]["b"], want["model"]["b"])
    assert target["step"] == 3


@pytest.mark.parametrize("safetensors", [False, True])
def test_save_and_load_through_an_in_memory_storage_match_the_local_disk_byte_for_byte(
    tmp_path, monkeypatch, safetensors
):
    disk = str(tmp_path / "disk")
    paddle_dcp.save_state_dict(state(), disk, safetensors=safetensors)
    blobs: dict[str, bytes] = {}
    monkeypatch.setattr(api, "open_storage", lambda path, storage_options=None: memory_storage(path, blobs=blobs))
    mem = str(tmp_path / "mem")
    paddle_dcp.save_state_dict(state(), mem, safetensors=safetensors)
    assert not os.path.exists(mem)  # nothing reached the disk
    assert sorted(blobs) == listdir(disk)
    for name, data in blobs.items():
        with open(os.path.join(disk, name), "rb") as f:
            assert f.read() == data, name
    # a second save of the same id replaces the data files by generation, then tidies
    paddle_dcp.save_state_dict(state(), mem, unique_id=0, safetensors=safetensors)
    assert len([n for n in blobs if not n.endswith(".metadata")]) == 1, sorted(blobs)
    loads_the_state(mem)


def test_a_flipped_byte_in_the_in_memory_storage_is_an_integrity_error(tmp_path, monkeypatch):
    blobs: dict[str, bytes] = {}
    monkeypatch.setattr(api, "open_storage", lambda path, storage_options=None: memory_storage(path, blobs=blobs))
    paddle_dcp.save_state_dict(state(), "mem")
    data = bytearray(blobs["0_0.distcp"])
    data[100] ^= 1
    blobs["0_0.distcp"] = bytes(data)
    target = {"model": {"w": np.zeros((33, 17), np.float32), "b": np.zeros(1001, np.int64)}, "step": 0}
    with pytest.raises(IntegrityError, match="0_0.distcp"):
        paddle_dcp.load_state_dict(target, "mem")
    assert not target["model"]["w"].any()


def on_the_fake(monkeypatch, blobs: dict) -> None:
    """Every entry point's storage is the in-memory one: the directory load and save (api),
    single files (io.open_file), verify."""
    fake = lambda path, storage_options=None: memory_storage(path, blobs=blobs)  # noqa: E731
    monkeypatch.setattr(api, "open_storage", fake)
    monkeypatch.setattr(io_package, "open_storage", fake)
    monkeypatch.setattr(verify, "open_storage", fake)


def test_a_gathered_file_saves_and_loads_through_the_in_memory_storage_byte_for_byte(tmp_path, monkeypatch):
    disk = str(tmp_path / "disk.safetensors")
    paddle_dcp.save_gathered(state(), disk)
    blobs: dict[str, bytes] = {}
    on_the_fake(monkeypatch, blobs)
    mem = str(tmp_path / "mem.safetensors")
    paddle_dcp.save_gathered(state(), mem)
    assert not os.path.exists(mem) and sorted(blobs) == ["mem.safetensors"]
    with open(disk, "rb") as f:
        assert f.read() == blobs["mem.safetensors"]
    loads_the_state(mem)


def test_a_hugging_face_directory_loads_through_the_in_memory_storage(monkeypatch):
    from safetensors.numpy import save

    w, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5, dtype=np.int64)
    blobs = {
        "model-1.safetensors": save({"w": w}),
        "model-2.safetensors": save({"b": b}),
        "model.safetensors.index.json": b'{"weight_map": {"w": "model-1.safetensors", "b": "model-2.safetensors"}}',
    }
    on_the_fake(monkeypatch, blobs)
    target = {"w": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.int64)}
    paddle_dcp.load_state_dict(target, "hf", safetensors=True)
    assert np.array_equal(target["w"], w) and np.array_equal(target["b"], b)


def test_verify_reads_through_the_in_memory_storage(monkeypatch):
    blobs: dict[str, bytes] = {}
    on_the_fake(monkeypatch, blobs)
    paddle_dcp.save_state_dict(state(), "mem")
    problems, counts = verify.verify_checkpoint("mem", 0)
    assert problems == [] and counts["files"] == 1 and counts["bytes"] > 0
    data = bytearray(blobs["0_0.distcp"])
    data[100] ^= 1
    blobs["0_0.distcp"] = bytes(data)
    problems, _ = verify.verify_checkpoint("mem", 0)
    assert len(problems) == 1 and "0_0.distcp" in problems[0] and "checksum" in problems[0], problems
    del blobs["0_0.distcp"]
    problems, _ = verify.verify_checkpoint("mem", 0)
    assert len(problems) == 1 and "missing" in problems[0], problems


def test_open_storage_of_a_local_path_is_the_local_disk(tmp_path):
    assert isinstance(open_storage(str(tmp_path)), local.LocalStorage)


# ---------------------------------------------------------------------- the one atomic writer
def _data_writer(d: str, durable: bool) -> None:
    writer = local.DataWriter(d, "f", 64)
    writer.write(memoryview(b"abc"))
    writer.commit(durable)


def _atomic_file(d: str, durable: bool) -> None:
    atomic = local.AtomicFile(os.path.join(d, "f"))
    atomic.write(b"abc")
    atomic.commit(durable)


WRITERS = {
    "write_atomic": lambda d, durable: local.write_atomic(d, "f", b"abc", durable),
    "data_writer": _data_writer,
    "atomic_file": _atomic_file,
}


@pytest.mark.parametrize("durable", [False, True])
@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_the_atomic_writer_fsyncs_the_file_before_its_rename_and_the_directory_after_only_when_durable(
    tmp_path, monkeypatch, kind, durable
):
    d = str(tmp_path)
    events: list = []
    fsync_log(monkeypatch, events, d)
    WRITERS[kind](d, durable)
    monkeypatch.undo()
    final = os.path.join(d, "f")
    renames = [e for e in events if e[0] == "rename"]
    assert len(renames) == 1 and renames[0][2] == final, events
    tmp = renames[0][1]
    assert tmp.startswith(final + ".tmp.") and storage.TMP_RE.match(os.path.basename(tmp)) is None  # not a checkpoint name
    if durable:
        assert events == [("fsync", tmp), renames[0], ("fsync", d)], events
    else:
        assert events == renames, events
    assert listdir(d) == ["f"] and open(final, "rb").read() == b"abc"


def test_atomic_path_renames_on_success_and_removes_the_temporary_file_on_error(tmp_path):
    final = str(tmp_path / "out.npz")
    with pytest.raises(RuntimeError):
        with local.atomic_path(final) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"partial")
            raise RuntimeError("writer failed")
    assert listdir(str(tmp_path)) == []
    with local.atomic_path(final) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and tmp.startswith(final + ".tmp.")
        with open(tmp, "wb") as f:
            f.write(b"whole")
    assert listdir(str(tmp_path)) == ["out.npz"] and open(final, "rb").read() == b"whole"


def test_aligned_is_the_next_multiple_for_ints_and_arrays():
    assert [aligned(n) for n in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert aligned(5, 1) == 5
    assert aligned(np.array([0, 1, 64, 65])).tolist() == [0, 64, 64, 128]


def test_a_data_writer_whose_header_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full_disk(self, view, offset):
        raise StorageError(f"cannot write {self.tmp}: no space left", self.tmp)

    monkeypatch.setattr(local.AtomicFile, "pwrite", full_disk)
    with pytest.raises(StorageError, match="no space left"):
        local.DataWriter(str(tmp_path), "f", 64, header=b"head")
    assert listdir(str(tmp_path)) == []
