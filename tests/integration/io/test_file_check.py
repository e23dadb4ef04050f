"""paddle_dcp.io.file_check: which data files hold exactly the bytes their metadata describes. Real
checkpoints are damaged one file at a time; the oracle of where a piece lies is a search of
the file's bytes for the piece's own values (not the metadata's byte offsets), the oracle of a
reason the file damaged and the block the flipped byte falls in."""
from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import save_file

import paddle_dcp
from paddle_dcp import api
from paddle_dcp.errors import ArgumentError
from paddle_dcp.io import local, safetensors_files, file_check
from paddle_dcp.io import storage as dcp_storage

from unit.helpers import random_array, save_checkpoint
from unit.io.memory_storage import memory_storage

BLOCK = 64  # the checksum block of the checkpoints saved with save_checkpoint


def located(path: str, piece: np.ndarray) -> tuple[str, int]:
    """(data file, byte offset) where the bytes of ``piece`` lie, found by searching every
    data file of ``path`` (the values are random: they occur once)."""
    want = np.ascontiguousarray(piece).tobytes()
    hits = []
    for name in sorted(os.listdir(path)):
        if name.endswith(".distcp"):
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
            at = data.find(want)
            if at >= 0:
                assert data.find(want, at + 1) < 0, "a piece's bytes occur twice"
                hits.append((name, at))
    assert len(hits) == 1, hits
    return hits[0]


def flip(path: str, name: str, at: int) -> None:
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def data_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".distcp"))


def check(path: str, **kw) -> dict[str, str | None]:
    store = local.LocalStorage(path)
    return file_check.check_files(store, dcp_storage.read_metadata(store, 0), **kw)


@pytest.fixture
def one_file(tmp_path):
    """A one-process save (one data file holding one piece of each of three keys)."""
    rng = np.random.default_rng(3)
    arrays = {"a": random_array(rng, "float32", (7, 5)), "b": random_array(rng, "int64", (11,)),
              "c": random_array(rng, "float64", (3, 4))}  # fmt: skip
    paddle_dcp.save_state_dict({"model": arrays, "step": 2}, str(tmp_path))
    return str(tmp_path), arrays


@pytest.fixture
def two_files(tmp_path):
    """Two ranks' files, each holding a piece of w and of b (split on dim 0), 64-byte blocks."""
    rng = np.random.default_rng(5)
    arrays = {"w": random_array(rng, "float32", (8, 16)), "b": random_array(rng, "int64", (6,))}
    dtypes, placements = {"w": "float32", "b": "int64"}, {"w": (0,), "b": (0,)}
    save_checkpoint(str(tmp_path), arrays, dtypes, (2,), placements, block_bytes=BLOCK)
    return str(tmp_path), arrays


def test_an_intact_checkpoint_has_every_file_none(one_file, two_files):
    for path, _ in (one_file, two_files):
        assert check(path) == {n: None for n in data_files(path)}


def test_a_flipped_byte_names_its_file_key_and_block(two_files):
    path, arrays = two_files
    name, at = located(path, arrays["w"][4:])  # the second rank's rows: 4 blocks of 64 bytes
    flip(path, name, at + 100)  # inside the piece's second block
    got = check(path)
    assert sorted(got) == data_files(path)
    assert got[name] is not None and got[name].startswith(os.path.join(path, name))
    assert "model.w" in got[name] and f"[{at + BLOCK}, {at + 2 * BLOCK})" in got[name], got[name]
    assert "model.b" not in got[name]
    assert all(reason is None for n, reason in got.items() if n != name)


def test_each_key_of_a_file_holding_several_is_named_alone(one_file):
    path, arrays = one_file
    (name,) = data_files(path)
    for key in arrays:
        _, at = located(path, arrays[key])
        flip(path, name, at + 3)
        reason = check(path)[name]
        assert reason is not None and f"model.{key}" in reason, reason
        assert f"[{at}, {at + arrays[key].nbytes})" in reason  # one block: the whole piece
        assert [k for k in arrays if f"model.{k}:" in reason] == [key]
        flip(path, name, at + 3)  # mended
        assert check(path) == {name: None}


def test_damage_in_two_pieces_of_one_file_is_one_line_counting_the_rest(one_file):
    path, arrays = one_file
    (name,) = data_files(path)
    for key in ("a", "c"):
        flip(path, name, located(path, arrays[key])[1])
    reason = check(path)[name]
    assert reason is not None and "\n" not in reason and "1 more" in reason
    store = local.LocalStorage(path)
    (found,) = file_check.check_each_file(store, dcp_storage.read_metadata(store, 0))
    assert found.readable and len(found.problems) == 2
    assert "model.a" in found.problems[0] and "model.c" in found.problems[1]


def test_a_truncated_file_is_named_with_both_sizes(two_files):
    path, arrays = two_files
    name, _ = located(path, arrays["b"][:3])
    size = os.path.getsize(os.path.join(path, name))
    os.truncate(os.path.join(path, name), size - 3)
    got = check(path)
    assert f"has {size - 3} bytes, the metadata says {size}" in got[name], got[name]
    assert "model.w" in got[name] and "model.b" in got[name]  # the keys it holds pieces of
    assert [n for n, reason in got.items() if reason] == [name]


def test_a_missing_file_is_named_missing(two_files):
    path, arrays = two_files
    name, _ = located(path, arrays["w"][:4])
    os.unlink(os.path.join(path, name))
    got = check(path)
    assert sorted(got) == sorted(data_files(path) + [name])
    assert "missing" in got[name] and "model.w" in got[name]
    assert [n for n, reason in got.items() if reason] == [name]


def test_names_restrict_the_check(two_files):
    path, arrays = two_files
    damaged, at = located(path, arrays["w"][:4])
    flip(path, damaged, at)
    (other,) = [n for n in data_files(path) if n != damaged]
    assert check(path, names=[other]) == {other: None}
    assert list(check(path, names=[damaged])) == [damaged] and check(path, names=[damaged])[damaged]
    assert check(path, names=[]) == {}
    with pytest.raises(ArgumentError, match="9_0.distcp"):
        check(path, names=[other, "9_0.distcp"])


def test_every_window_size_finds_the_same_and_progress_counts_every_piece_byte(two_files):
    path, arrays = two_files
    name, at = located(path, arrays["w"][4:])
    flip(path, name, at + 200)
    want = check(path)
    total = arrays["w"].nbytes + arrays["b"].nbytes
    for window in (1, BLOCK, 100, 1 << 20):
        calls: list[tuple[int, int]] = []
        assert check(path, window_bytes=window, progress=lambda done, all_: calls.append((done, all_))) == want
        assert calls[-1] == (total, total) and all(t == total for _, t in calls)
        assert all(a < b for (a, _), (b, _) in zip(calls, calls[1:]))
    assert "[{}, {})".format(at + 192, at + 256) in want[name]


def test_the_in_memory_storage_is_checked_through_the_interface(monkeypatch):
    blobs: dict[str, bytes] = {}
    monkeypatch.setattr(api, "open_storage", lambda path, storage_options=None: memory_storage(path, blobs=blobs))
    w = np.arange(300, dtype=np.float32)
    paddle_dcp.save_state_dict({"w": w}, "mem")
    store = memory_storage("mem", blobs=blobs)
    meta = dcp_storage.read_metadata(store, 0)
    (name,) = [n for n in blobs if n.endswith(".distcp")]
    assert file_check.check_files(store, meta) == {name: None}
    at = blobs[name].find(w.tobytes())
    blobs[name] = blobs[name][: at + 5] + bytes([blobs[name][at + 5] ^ 1]) + blobs[name][at + 6 :]
    assert ": w: piece 0 " in file_check.check_files(store, meta)[name]
    del blobs[name]
    assert "missing" in file_check.check_files(store, meta)[name]


def test_a_hugging_face_directory_has_only_its_files_sizes_checked(tmp_path):
    """Its files carry no checksums: a flipped byte passes, a short file does not."""
    save_file({"w": np.arange(40, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    store = local.LocalStorage(str(tmp_path))
    meta = safetensors_files.directory_metadata(store)
    assert meta.checksum_algorithm == "none"
    size = os.path.getsize(tmp_path / "model.safetensors")
    flip(str(tmp_path), "model.safetensors", size - 10)
    assert file_check.check_files(store, meta) == {"model.safetensors": None}
    os.truncate(tmp_path / "model.safetensors", size - 1)
    reason = file_check.check_files(store, meta)["model.safetensors"]
    assert reason is not None and f"the metadata says {size}" in reason and "holds pieces of w" in reason


def test_a_local_file_is_checked_from_the_page_cache_one_bounded_window_at_a_time(two_files, monkeypatch):
    """No read copies the bytes (they are mapped, as a load maps them); each window spans at
    most ``window_bytes`` (or one block), one is held at a time, and none is left after."""
    path, arrays = two_files
    name, at = located(path, arrays["w"][4:])
    flip(path, name, at + 200)
    want = check(path, window_bytes=1 << 20)

    def no_copies(*args, **kwargs):
        raise AssertionError("a data file was read into a buffer")

    monkeypatch.setattr(local.FileSet, "read_into", no_copies)
    real_map, spans, held = local.map_range, [], [0, 0]

    def counted(fd, start, stop, name_):
        spans.append(stop - start)
        held[0] += 1
        held[1] = max(held)
        try:
            with real_map(fd, start, stop, name_) as data:
                yield data
        finally:
            held[0] -= 1

    monkeypatch.setattr(local, "map_range", __import__("contextlib").contextmanager(counted))
    for window in (1, 100, 1 << 20):
        spans.clear()
        assert check(path, window_bytes=window) == want
        assert spans and max(spans) <= max(window, BLOCK)
    assert held == [0, 1]
    assert "[{}, {})".format(at + 192, at + 256) in want[name]


def test_files_checked_on_several_threads_find_the_same_and_count_every_byte_once(two_files, monkeypatch):
    path, arrays = two_files
    name, at = located(path, arrays["w"][4:])
    flip(path, name, at + 200)
    want = check(path)
    import threading

    threads: set = set()
    real = file_check._read_pieces
    together = threading.Barrier(2, timeout=5)  # a serial check would wait here in vain

    def spy(*args, **kwargs):
        threads.add(threading.get_ident())
        together.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(file_check, "_read_pieces", spy)
    calls: list[tuple[int, int]] = []
    assert check(path, workers=2, progress=lambda done, all_: calls.append((done, all_))) == want
    total = arrays["w"].nbytes + arrays["b"].nbytes
    assert len(data_files(path)) == 2 and len(threads) == 2
    assert calls[-1] == (total, total) and all(a < b for (a, _), (b, _) in zip(calls, calls[1:]))
