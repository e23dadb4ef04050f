"""The storage interface is the only way save and load reach the files: an in-memory storage
(a fake written here from the Protocol alone) saves and loads a state dict with no file on
disk, byte for byte as the local disk does."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp import api
from paddle_dcp import io as io_package
from paddle_dcp.errors import IntegrityError
from paddle_dcp.tools import verify

from unit.helpers import listdir
from unit.io.memory_storage import memory_storage


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
    assert len([n for n in blobs if not n.endswith((".metadata", ".claim"))]) == 1, sorted(blobs)
    assert [n for n in blobs if n.endswith(".claim")] == ["0.1.claim"], sorted(blobs)
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
