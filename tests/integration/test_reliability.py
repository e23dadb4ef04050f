"""Issue 6 in one process: the commit protocol of a save (temporary names, the metadata renamed
last, incomplete and temporary files ignored and cleaned, durable fsyncs), integrity checks on
the load path (flipped, truncated, deleted, swapped files, edited metadata, verify=False),
hostile metadata refused before any data file is opened, and files that change under a load.

Everything goes through the public ``paddle_dcp.save_state_dict`` / ``load_state_dict`` in a
single process (a world of one, no launcher), with numpy arrays as tensors. Checkpoints of two
ranks are written by ``helpers.save_checkpoint`` (the real planner, writer and metadata).
The multi-process side (every rank raises, crashes, a dying server) is in
tests/multirank/test_reliability.py.
"""
from __future__ import annotations

import base64
import json
import mmap
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import tracemalloc
import zlib

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp.parallel import loadwork
from paddle_dcp.core import metadata, metadata_parse
from paddle_dcp.io import datafile
from paddle_dcp.io import local, storage
from paddle_dcp.errors import DcpError, FormatError, IntegrityError, MismatchError, StorageError
from paddle_dcp.core.naming import TMP_RE

from unit.checkpoints import (
    W, assert_loaded, assert_untouched, assert_variant, flip, load_fails, load_values, piece_of, read_doc, sd_of, target, two_rank_checkpoint, write_doc, fsync_log,
)
from unit.helpers import listdir, save_checkpoint

@pytest.fixture
def ck(tmp_path) -> str:
    return two_rank_checkpoint(str(tmp_path / "ck"))


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so nothing on the way handles it."""


@pytest.fixture
def opened(monkeypatch):
    """Paths of data files opened (os.open, when it succeeds: an O_NOFOLLOW open of a link
    opens nothing) or mapped (mmap) while the fixture is active."""
    seen = {"open": [], "mmap": 0, "pread": 0}
    real_open, real_mmap, real_preadv = os.open, mmap.mmap, os.preadv

    def rec_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if str(path).endswith(".distcp") or ".distcp" in os.path.basename(str(path)):
            seen["open"].append(os.path.basename(str(path)))
        return fd

    def rec_mmap(*args, **kwargs):
        seen["mmap"] += 1
        return real_mmap(*args, **kwargs)

    def rec_preadv(*args, **kwargs):
        seen["pread"] += 1
        return real_preadv(*args, **kwargs)

    monkeypatch.setattr(os, "open", rec_open)
    monkeypatch.setattr(mmap, "mmap", rec_mmap)
    monkeypatch.setattr(os, "preadv", rec_preadv)
    return seen


# ================================================================== 1. atomic commit
def test_data_files_exist_only_under_temporary_names_until_renamed_and_the_metadata_is_renamed_last(tmp_path, monkeypatch):
    """Every write lands in a ``*.tmp.{hex}`` file while the final name does not exist; each
    data file is renamed into place before the metadata; the metadata rename is the last
    rename, and when it replaces checkpoint N the old metadata and data files are still there
    until it happens (a crash before it leaves the old N complete)."""
    path = str(tmp_path / "ck")
    paddle_dcp.save_state_dict(sd_of(0), path, unique_id=1)  # the checkpoint being replaced
    events = []
    real_replace, real_write = os.replace, datafile.DataFileWriter.write

    def rec_replace(src, dst, *args, **kwargs):
        if os.path.dirname(os.fspath(dst)) == path:
            events.append(("rename", os.path.basename(src), os.path.basename(dst), listdir(path)))
        return real_replace(src, dst, *args, **kwargs)

    def rec_write(self, data, *args, **kwargs):
        events.append(("write", os.path.basename(self.stream.tmp), os.path.basename(self.stream.final), listdir(path)))
        return real_write(self, data, *args, **kwargs)

    monkeypatch.setattr(os, "replace", rec_replace)
    monkeypatch.setattr(datafile.DataFileWriter, "write", rec_write)
    paddle_dcp.save_state_dict(sd_of(1), path, unique_id=1)
    monkeypatch.undo()

    writes = [e for e in events if e[0] == "write"]
    renames = [e for e in events if e[0] == "rename"]
    assert writes and len(renames) == 2, events
    for _, tmp, final, seen in writes:
        assert TMP_RE.match(tmp) and tmp.startswith(final + ".tmp."), tmp
        assert tmp in seen and final not in seen, (tmp, final, seen)
    (_, data_tmp, data_final, before_data), (_, meta_tmp, meta_final, before_meta) = renames
    assert data_final == "0_1.1.distcp" and data_tmp.startswith("0_1.1.distcp.tmp."), renames
    assert meta_final == "1.metadata" and meta_tmp.startswith("1.metadata.tmp."), renames
    # before the commit: the old checkpoint whole, the new data file in place, the metadata
    # still temporary
    assert before_meta == sorted(["0_1.distcp", "0_1.1.distcp", "1.0.claim", "1.1.claim", "1.metadata", meta_tmp]), before_meta
    assert "0_1.1.distcp" not in before_data
    # after it: the old generation removed with its claim, no temporary file left
    assert listdir(path) == ["0_1.1.distcp", "1.1.claim", "1.metadata"]
    assert_variant(load_values(path), 1)


def test_a_checkpoint_without_metadata_is_never_picked(tmp_path, monkeypatch):
    """A save whose metadata never lands (its write fails) leaves data files of an incomplete
    id: load(unique_id=None) takes the previous complete id, asking for the incomplete one is a
    clear error, and the next save without an id takes an id the directory shows nothing of."""
    path = str(tmp_path / "ck")
    paddle_dcp.save_state_dict(sd_of(0), path)
    real = local.write_atomic

    def no_metadata(dirpath, name, *args, **kwargs):
        raise StorageError(f"cannot write {name}: injected", name)

    monkeypatch.setattr(local, "write_atomic", no_metadata)
    with pytest.raises(StorageError, match="injected"):
        paddle_dcp.save_state_dict(sd_of(1), path)
    monkeypatch.setattr(local, "write_atomic", real)
    # an incomplete id higher still, written by hand
    with open(os.path.join(path, "0_9.distcp"), "wb") as f:
        f.write(b"\xff" * 100)
    assert listdir(path) == ["0.0.claim", "0.metadata", "0_0.distcp", "0_1.distcp", "0_9.distcp", "1.0.claim"]
    assert_variant(load_values(path), 0)
    assert paddle_dcp.read_metadata(path).unique_id == 0
    for uid in (1, 9):
        err = load_fails(path, StorageError, f"{uid}.metadata", "not complete", unique_id=uid)
        assert "complete checkpoints this rank sees: [0]" in str(err), err
    # the next save without an id takes 2: the failed save's files and claim of 1 could be a
    # save still running (issue 38); they stay for ``clean``
    paddle_dcp.save_state_dict(sd_of(2), path)
    assert listdir(path) == ["0.0.claim", "0.metadata", "0_0.distcp", "0_1.distcp", "0_2.distcp", "0_9.distcp",
                             "1.0.claim", "2.0.claim", "2.metadata"]
    assert_variant(load_values(path), 2)
    assert_variant(load_values(path, 0), 0)


def test_temporary_files_of_a_crashed_save_are_ignored_by_load_and_left_for_clean_by_the_next_save_of_that_id(
    tmp_path, monkeypatch, opened
):
    """A save that dies while writing its data file (id 1), and one that dies after writing
    the metadata to its temporary name but before the rename (id 2): both leave ``*.tmp.*``
    files and their claims. A load ignores them (never opens one) and takes the previous
    checkpoint. The next save of an id writes the next generation (the crashed one's claim
    stays taken) and removes no temporary file: one could be another save's, still running
    (issue 38); ``clean`` removes them."""
    path = str(tmp_path / "ck")
    paddle_dcp.save_state_dict(sd_of(0), path)

    # id 1: dies in the middle of its data file (after the first piece)
    real_write = datafile.DataFileWriter.write

    def dies_after_first_piece(self, data, *args, **kwargs):
        if self.offset:
            self._flush()  # the first piece in the file (small pieces wait in a batch until then)
            self.stream._pending[-1].result()
            raise Crash()
        return real_write(self, data, *args, **kwargs)

    real_abort = datafile.DataFileWriter.abort
    monkeypatch.setattr(datafile.DataFileWriter, "write", dies_after_first_piece)
    # a dead process cleans nothing up (the writer's thread is still stopped)
    monkeypatch.setattr(datafile.DataFileWriter, "abort", lambda self: self.stream._drain())
    with pytest.raises(Crash):
        paddle_dcp.save_state_dict(sd_of(1), path, unique_id=1)
    monkeypatch.setattr(datafile.DataFileWriter, "write", real_write)
    monkeypatch.setattr(datafile.DataFileWriter, "abort", real_abort)

    # id 2: dies between the metadata's temporary file and its rename
    real_replace = os.replace

    def dies_before_metadata_rename(src, dst, *args, **kwargs):
        if str(dst).endswith(".metadata"):
            raise Crash()
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", dies_before_metadata_rename)
    with pytest.raises(Crash):
        paddle_dcp.save_state_dict(sd_of(2), path, unique_id=2)
    monkeypatch.setattr(os, "replace", real_replace)

    names = listdir(path)
    tmp1 = [n for n in names if n.startswith("0_1.distcp.tmp.")]
    tmp2 = [n for n in names if n.startswith("2.metadata.tmp.")]
    assert len(tmp1) == 1 and len(tmp2) == 1, names
    assert names == sorted(["0.0.claim", "0.metadata", "0_0.distcp", "0_2.distcp", "1.0.claim", "2.0.claim"] + tmp1 + tmp2), names
    assert os.path.getsize(os.path.join(path, tmp1[0])) > 0 and os.path.getsize(os.path.join(path, tmp2[0])) > 0
    assert storage.list_checkpoints(local.LocalStorage(path)).complete == {0}
    # others' temporary files: another id's, another rank's of id 1 (garbage bytes)
    others = ["0_7.distcp.tmp.0a0b0c0d", "7.metadata.tmp.0a0b0c0d", "1_1.distcp.tmp.0e0f0a0b"]
    for other in others:
        with open(os.path.join(path, other), "wb") as f:
            f.write(b"\x80garbage")

    opened["open"].clear()
    assert_variant(load_values(path), 0)
    assert opened["open"] == ["0_0.distcp"], opened
    for uid in (1, 2):
        load_fails(path, StorageError, "not complete", unique_id=uid)

    paddle_dcp.save_state_dict(sd_of(3), path, unique_id=1)  # generation 1: the crashed save claimed 0
    assert listdir(path) == sorted(["0.0.claim", "0.metadata", "0_0.distcp", "0_1.1.distcp", "1.1.claim", "1.metadata",
                                    "0_2.distcp", "2.0.claim"] + tmp1 + tmp2 + others)  # fmt: skip
    paddle_dcp.save_state_dict(sd_of(4), path, unique_id=2)  # beside 0_2.distcp, then removes it
    assert listdir(path) == sorted(["0.0.claim", "0.metadata", "0_0.distcp", "0_1.1.distcp", "1.1.claim", "1.metadata",
                                    "0_2.1.distcp", "2.1.claim", "2.metadata"] + tmp1 + tmp2 + others)  # fmt: skip
    assert_variant(load_values(path), 4)
    assert_variant(load_values(path, 1), 3)
    assert_variant(load_values(path, 0), 0)


def test_the_cli_removes_temporary_files(tmp_path):
    """``python -m paddle_dcp clean DIR`` (docs/format.md) removes every temporary file a
    crashed save left and nothing of a complete checkpoint."""
    pytest.importorskip("paddle_dcp.tools.cli", reason="paddle_dcp.tools.cli does not exist yet")
    path = str(tmp_path / "ck")
    paddle_dcp.save_state_dict(sd_of(0), path)
    for other in ("0_1.distcp.tmp.0a0b0c0d", "1.metadata.tmp.0a0b0c0d", "3_0.1.distcp.tmp.aa"):
        with open(os.path.join(path, other), "wb") as f:
            f.write(b"x")
    proc = subprocess.run([sys.executable, "-m", "paddle_dcp", "clean", path], timeout=120,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert listdir(path) == ["0.0.claim", "0.metadata", "0_0.distcp"]
    assert_variant(load_values(path), 0)


def test_durable_fsyncs_every_data_file_the_metadata_and_the_directory(tmp_path, monkeypatch):
    """durable=True: every file is fsynced under its temporary name before its rename, and the
    directory after each rename; durable=False (the default) calls fsync not once."""
    path = os.path.realpath(str(tmp_path / "ck"))
    events: list = []
    fsync_log(monkeypatch, events, path)
    paddle_dcp.save_state_dict(sd_of(0), path)
    assert not [e for e in events if e[0] == "fsync"], events

    events.clear()
    paddle_dcp.save_state_dict(sd_of(1), path, unique_id=0, durable=True)  # a replacement, too
    monkeypatch.undo()
    renames = [e for e in events if e[0] == "rename"]
    assert [os.path.basename(dst) for _, _, dst in renames] == ["0_0.1.distcp", "0.metadata"], events
    for _, src, dst in renames:
        at = events.index(("rename", src, dst))
        assert ("fsync", src) in events[:at], (src, events)  # the file's bytes before its name
        assert ("fsync", path) in events[at + 1 :], (dst, events)  # the name after
    assert listdir(path) == ["0.1.claim", "0.metadata", "0_0.1.distcp"]
    assert_variant(load_values(path), 1)


# ================================================================== 3. integrity
@pytest.mark.parametrize("key, index, at", [
    ("model.w", 0, 0), ("model.w", 1, 79), ("model.b", 0, 0), ("model.b", 0, 1199),
    ("model.b", 1, 640), ("model.b", 1, 1199),
])  # fmt: skip
def test_a_flipped_bit_is_an_integrity_error_naming_file_and_key_and_nothing_changes(ck, key, index, at):
    name, offset = piece_of(ck, key, index)
    flip(os.path.join(ck, name), offset + at, bit=3)
    load_fails(ck, IntegrityError, name, repr(key), "checksum")


def test_verify_false_loads_a_flipped_bit_silently(ck):
    """What verify=False does: no checksum is computed, so a damaged byte is loaded as is."""
    name, offset = piece_of(ck, "model.w", 1)  # rows 4..7
    flip(os.path.join(ck, name), offset + 0, bit=0)  # lowest byte of w[4, 0]
    load_fails(ck, IntegrityError, name, "'model.w'")
    sd = target()
    paddle_dcp.load_state_dict(sd, ck, verify=False)
    damaged = W.copy()
    damaged.reshape(-1).view(np.uint8)[4 * 5 * 4] ^= 1
    assert_loaded(sd, w=damaged)
    assert sd["model"]["w"][4, 0] != W[4, 0]


def test_a_truncated_file_is_an_integrity_error_naming_the_file(ck):
    name = os.path.join(ck, "1_0.distcp")
    os.truncate(name, os.path.getsize(name) - 1)
    load_fails(ck, IntegrityError, "1_0.distcp", "bytes")
    load_fails(ck, IntegrityError, "1_0.distcp", verify=False)  # sizes are checked whatever verify says


def test_a_truncated_file_error_names_the_keys_it_holds(ck):
    name = os.path.join(ck, "1_0.distcp")
    os.truncate(name, os.path.getsize(name) // 2)
    load_fails(ck, IntegrityError, "1_0.distcp", "model.w", "model.b")


def test_a_deleted_file_is_a_storage_error_naming_file_and_keys(ck):
    os.remove(os.path.join(ck, "1_0.distcp"))
    load_fails(ck, StorageError, "1_0.distcp", "'model.w'", "'model.b'")


def test_two_swapped_data_files_fail_their_checksums(ck):
    a, b = os.path.join(ck, "0_0.distcp"), os.path.join(ck, "1_0.distcp")
    assert os.path.getsize(a) == os.path.getsize(b)  # so that only the checksums can tell
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    err = load_fails(ck, IntegrityError, "checksum", "'model.")
    assert "0_0.distcp" in str(err) or "1_0.distcp" in str(err), err


def test_swapped_data_files_of_different_sizes_fail_the_size_check(tmp_path):
    path = str(tmp_path / "ck")
    os.makedirs(path)
    w = np.arange(35, dtype=np.float32).reshape(7, 5)  # 4 rows and 3 rows
    save_checkpoint(path, {"w": w}, {"w": "float32"}, (2,), {"w": (0,)}, block_bytes=64)
    a, b = os.path.join(path, "0_0.distcp"), os.path.join(path, "1_0.distcp")
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    sd = {"model": {"w": np.zeros((7, 5), np.float32)}}
    with pytest.raises(IntegrityError, match="_0.distcp has .* bytes, the metadata says"):
        paddle_dcp.load_state_dict(sd, path)
    assert not sd["model"]["w"].any()


def _edit(key, column, fn):
    def edit(doc):
        t = doc["tensors"][key]
        t[column] = fn(t[column])
    return edit


def _hex_flip(sums):
    first = sums[0]
    return [("0" if first[0] != "0" else "1") + first[1:]] + sums[1:]


@pytest.mark.parametrize("edit, kind, needles", [
    # a piece's checksum: the bytes no longer match it
    (_edit("model.w", "checksums", _hex_flip), IntegrityError, ["0_0.distcp", "'model.w'", "checksum"]),
    # a piece's byte offset moved by one block: other bytes
    (_edit("model.w", "byte_offset", lambda v: [v[0], v[1] + 64]), IntegrityError, ["1_0.distcp", "'model.w'", "checksum"]),
    (lambda d: d["tensors"]["model.w"].update(byte_offset=[0, d["files"][1]["bytes"] - 64]), FormatError,
     ["0.metadata", "'model.w'", "past the end"]),
    (_edit("model.b", "byte_offset", lambda v: [v[0] - 64, v[1]]), IntegrityError, ["0_0.distcp", "'model.b'", "checksum"]),
    # a piece read from the other file
    (_edit("model.w", "file", lambda v: [1, 1]), IntegrityError, ["1_0.distcp", "'model.w'", "checksum"]),
    # a piece's offset or shape: the pieces no longer tile the tensor
    (_edit("model.w", "offsets", lambda v: [0, 0, 3, 0]), DcpError, ["model.w", "overlap"]),  # PlanError: see below
    (_edit("model.w", "offsets", lambda v: [0, 0, 5, 0]), FormatError, ["0.metadata", "model.w"]),
    (_edit("model.w", "shapes", lambda v: [4, 5, 3, 5]), FormatError, ["0.metadata", "model.w"]),
    # the tensor's shape or dtype: differs from the state dict's
    (_edit("model.w", "shape", lambda v: [9, 5]), DcpError, ["model.w"]),
    (_edit("model.w", "shape", lambda v: [5, 8]), DcpError, ["model.w"]),
    (_edit("model.w", "dtype", lambda v: "int32"), MismatchError, ["model.w", "int32", "float32"]),
    # a file's size
    (lambda d: d["files"][1].update(bytes=d["files"][1]["bytes"] + 64), IntegrityError, ["1_0.distcp", "bytes"]),
    # the checksum block size
    (lambda d: d["checksum"].update(block_bytes=128), FormatError, ["0.metadata", "checksums"]),
    (lambda d: d["checksum"].update(block_bytes=65), FormatError, ["0.metadata", "checksums"]),
])  # fmt: skip
def test_an_edited_metadata_is_a_clear_error_and_nothing_changes(ck, edit, kind, needles):
    doc = read_doc(ck)
    edit(doc)
    write_doc(ck, doc)
    load_fails(ck, kind, *needles)


def test_metadata_with_permuted_piece_offsets_never_gives_wrong_values(ck):
    doc = read_doc(ck)
    t = doc["tensors"]["model.w"]
    assert t["offsets"] == [0, 0, 4, 0], t["offsets"]
    t["offsets"] = [4, 0, 0, 0]
    write_doc(ck, doc)
    sd = target()
    try:
        paddle_dcp.load_state_dict(sd, ck)
    except DcpError:
        assert_untouched(sd)
        return
    assert_loaded(sd)  # fails: rows 0..3 and 4..7 exchanged


# ================================================================== 4. hostile checkpoints
def _outside_copy(ck: str, name: str) -> str:
    """A copy of a data file outside the checkpoint directory (so that a read of it would
    succeed and show)."""
    outside = os.path.join(os.path.dirname(ck), "outside_" + name)
    shutil.copy(os.path.join(ck, name), outside)
    return outside


def _set(path, value):
    def edit(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
    return edit


def _zlib_bomb(count: int) -> str:
    return "z:" + base64.b64encode(zlib.compress(b"\0" * 8 * count, 9)).decode()


HOSTILE = {
    # names of files outside the directory
    "dotdot_name": (_set(("files", 0, "name"), "../outside_0_0.distcp"), "not a plain file name"),
    "dotdot_only": (_set(("files", 0, "name"), ".."), "not a plain file name"),
    "absolute_name": (_set(("files", 0, "name"), "@ABS@"), "not a plain file name"),
    "nested_name": (_set(("files", 0, "name"), "sub/0_0.distcp"), "not a plain file name"),
    "nul_in_name": (_set(("files", 0, "name"), "0_0.distcp\0x"), "not a plain file name"),
    # offsets and shapes: negative, overflowing, outside the tensor
    "negative_offset": (_set(("tensors", "model.w", "offsets"), [-4, 0, 4, 0]), "model.w"),
    "huge_offset": (_set(("tensors", "model.w", "offsets"), [0, 0, 2**62, 0]), "model.w"),
    "overflowing_offset": (_set(("tensors", "model.w", "offsets"), [0, 0, 2**63, 0]), "model.w"),
    "negative_piece_shape": (_set(("tensors", "model.w", "shapes"), [4, 5, -4, 5]), "model.w"),
    "overflowing_piece_box": (_set(("tensors", "model.w", "shapes"), [4, 5, 2**62, 5]), "model.w"),
    "negative_shape": (_set(("tensors", "model.w", "shape"), [-8, 5]), "model.w"),
    "overflowing_shape": (_set(("tensors", "model.w", "shape"), [2**64, 5]), "model.w"),
    "shape_product_overflows": (_set(("tensors", "model.w", "shape"), [2**31, 2**31, 2**10]), "too many elements"),
    "too_many_dims": (_set(("tensors", "model.w", "shape"), [1] * 65), "model.w"),
    # byte ranges
    "negative_byte_offset": (_set(("tensors", "model.b", "byte_offset"), [-128, 128]), "model.b"),
    "byte_range_past_the_end": (_set(("tensors", "model.b", "byte_offset"), [128, 192]), "past the end"),
    "byte_offset_2_62": (_set(("tensors", "model.b", "byte_offset"), [128, 2**62]), "past the end"),
    "byte_offset_2_63": (_set(("tensors", "model.b", "byte_offset"), [128, 2**63]), "model.b"),
    "file_index_out_of_range": (_set(("tensors", "model.b", "file"), [0, 2]), "file index"),
    "negative_file_index": (_set(("tensors", "model.b", "file"), [0, -1]), "file index"),
    # counts and packed columns that would ask for huge allocations
    "huge_count": (_set(("tensors", "model.b", "count"), 2**40), "model.b"),
    "zlib_bomb": (_set(("tensors", "model.b", "byte_offset"), _zlib_bomb(1 << 20)), "model.b"),
    "count_beyond_limit": (_set(("tensors", "model.b", "count"), 2**62), "model.b"),
    # dtypes, versions, algorithms
    "unknown_dtype": (_set(("tensors", "model.w", "dtype"), "float128"), "unknown dtype"),
    "numpy_object_dtype": (_set(("tensors", "model.w", "dtype"), "object"), "unknown dtype"),
    "dtype_not_a_string": (_set(("tensors", "model.w", "dtype"), ["float32"]), "model.w"),
    "future_version": (_set(("format_version",), 3), "format_version"),
    "version_zero": (_set(("format_version",), 0), "format_version"),
    "version_as_string": (_set(("format_version",), "1"), "format_version"),
    "version_as_float": (_set(("format_version",), 1.0), "format_version"),
    "other_format": (_set(("format",), "torch_dcp"), "not a paddle_dcp metadata"),
    "unknown_checksum": (_set(("checksum", "algorithm"), "crc32"), "checksum algorithm"),
    "subset_on_disk": (_set(("subset",), True), "subset"),
    "other_unique_id": (_set(("unique_id",), 5), "describes checkpoint 5"),
    "deep_structure": (_set(("structure",), "@DEEP@"), "0.metadata"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_metadata_is_refused_before_any_data_file_is_opened(ck, case, opened):
    edit, needle = HOSTILE[case]
    outside = _outside_copy(ck, "0_0.distcp")
    doc = read_doc(ck)
    edit(doc)
    text = json.dumps(doc).replace('"@ABS@"', json.dumps(outside))
    text = text.replace('"@DEEP@"', '{"l":[' * 5000 + '{"v":1}' + "]}" * 5000)
    write_doc(ck, text)
    opened["open"].clear()
    err = load_fails(ck, FormatError, needle)
    assert "0.metadata" in str(err), err
    assert opened == {"open": [], "mmap": 0, "pread": 0}, opened


# Refused, naming the field and the metadata file (test below).
UNNAMED = {
    "negative_file_size": (_set(("files", 1, "bytes"), -1), "files[1].bytes"),
    "zero_block_bytes": (_set(("checksum", "block_bytes"), 0), "block_bytes"),
    "negative_unique_id": (_set(("unique_id",), -1), "unique_id"),
    "zero_world_size": (_set(("world_size",), 0), "world_size"),
}


@pytest.mark.parametrize("case", sorted(UNNAMED))
def test_hostile_header_fields_are_refused_before_any_data_file_is_opened(ck, case, opened):
    edit, needle = UNNAMED[case]
    doc = read_doc(ck)
    edit(doc)
    write_doc(ck, doc)
    opened["open"].clear()
    load_fails(ck, FormatError, needle)
    assert opened == {"open": [], "mmap": 0, "pread": 0}, opened


@pytest.mark.parametrize("case", sorted(UNNAMED))
def test_hostile_header_field_errors_name_the_metadata_file(ck, case):
    edit, needle = UNNAMED[case]
    doc = read_doc(ck)
    edit(doc)
    write_doc(ck, doc)
    load_fails(ck, FormatError, needle, "0.metadata")


def test_overlapping_pieces_are_a_format_error_naming_the_metadata_file(ck):
    doc = read_doc(ck)
    doc["tensors"]["model.w"]["offsets"] = [0, 0, 3, 0]
    write_doc(ck, doc)
    sd = target()
    with pytest.raises(FormatError) as info:
        paddle_dcp.load_state_dict(sd, ck)
    assert "0.metadata" in str(info.value) and "model.w" in str(info.value), info.value
    assert_untouched(sd)


def test_a_file_size_that_lies_is_refused_when_opened_before_any_byte_is_read(ck, opened):
    """Metadata consistent in itself but for a file 2**62 bytes long (a piece far inside it):
    the size on disk differs, found by fstat when the file is opened, before any read."""
    doc = read_doc(ck)
    doc["files"][1]["bytes"] = 2**62
    doc["tensors"]["model.b"]["byte_offset"] = [128, 2**61]
    write_doc(ck, doc)
    load_fails(ck, IntegrityError, "1_0.distcp", str(2**62))
    assert opened["mmap"] == 0 and opened["pread"] == 0, opened


@pytest.mark.parametrize("relative", [False, True])
def test_a_data_file_that_is_a_symlink_out_of_the_directory_is_refused(ck, opened, relative):
    outside = _outside_copy(ck, "0_0.distcp")
    os.remove(os.path.join(ck, "0_0.distcp"))
    os.symlink(os.path.relpath(outside, ck) if relative else outside, os.path.join(ck, "0_0.distcp"))
    opened["open"].clear()
    load_fails(ck, FormatError, "0_0.distcp", "outside the checkpoint directory")
    assert "outside_0_0.distcp" not in opened["open"] and "0_0.distcp" not in opened["open"], opened
    assert opened["mmap"] == 0, opened


def test_a_data_file_symlinked_inside_the_directory_loads(ck):
    os.rename(os.path.join(ck, "0_0.distcp"), os.path.join(ck, "moved.bin"))
    os.symlink("moved.bin", os.path.join(ck, "0_0.distcp"))
    sd = target()
    paddle_dcp.load_state_dict(sd, ck)
    assert_loaded(sd)


def _within(seconds: float, fn):
    """``fn()``'s result or exception, or an AssertionError when it has not returned in
    ``seconds`` (a thread: a hung open cannot hang the test run)."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("name", ["0_0.distcp", "0.metadata"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_a_storage_error_at_once(ck, name):
    """A FIFO (tar archives carry them) where a data file or the metadata should be: the
    load, verify and a manager's restore refuse it as not a regular file, naming it, without
    waiting for a writer that never comes."""
    os.remove(os.path.join(ck, name))
    os.mkfifo(os.path.join(ck, name))
    _within(20, lambda: load_fails(ck, StorageError, name, "a FIFO, not a regular file"))
    from paddle_dcp.tools.verify import verify_checkpoint

    problems, _ = _within(20, lambda: verify_checkpoint(ck, 0))
    wanted = "a FIFO, not a regular file" if name.endswith(".metadata") else "missing"  # no file to read
    assert any(name in p and wanted in p for p in problems), problems


def test_a_directory_that_only_looks_like_a_hub_snapshot_gets_no_exception(tmp_path):
    """The hub cache's links from snapshots/REV into ../../blobs are followed only in a real
    hub layout (a models--org--name repository with blobs and refs): a directory merely named
    snapshots/x whose files link to a sibling "blobs" is refused like any link out."""
    from unit.helpers import save_checkpoint as save

    fake = tmp_path / "anything" / "snapshots" / "x"
    fake.mkdir(parents=True)
    blobs = tmp_path / "anything" / "blobs"
    blobs.mkdir()
    save(str(blobs), {"w": np.arange(8, dtype=np.float32)}, {"w": "float32"}, (1,), {"w": (None,)})
    for name in os.listdir(blobs):
        os.symlink(f"../../blobs/{name}", fake / name)
    sd = {"model": {"w": np.zeros(8, np.float32)}}
    with pytest.raises(FormatError, match="outside the checkpoint directory"):
        paddle_dcp.load_state_dict(sd, str(fake))
    assert not sd["model"]["w"].any()
    # the same files under a hub-shaped repository load through the links
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    os.rename(blobs, repo / "blobs")
    (repo / "snapshots").mkdir()
    os.rename(fake, repo / "snapshots" / "x")
    paddle_dcp.load_state_dict(sd, str(repo / "snapshots" / "x"))
    assert np.array_equal(sd["model"]["w"], np.arange(8, dtype=np.float32))


def _peak_allocated(fn) -> int:
    """The peak of Python heap allocations (tracemalloc) while ``fn()`` runs, in bytes."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("sparse", [False, True])
def test_enormous_metadata_is_refused_without_reading_it(ck, monkeypatch, sparse):
    """Over the size limit: refused from its size, before it is read. ``sparse``: a real file
    one byte over the 1 GiB limit (sparse, so nothing is written), with the Python heap watched;
    else the limit lowered to below the real metadata's size."""
    full = os.path.join(ck, "0.metadata")
    if sparse:
        os.truncate(full, metadata.MAX_METADATA_BYTES + 1)
    else:
        monkeypatch.setattr(storage, "MAX_METADATA_BYTES", os.path.getsize(full) - 1)
    peak = _peak_allocated(lambda: load_fails(ck, FormatError, "0.metadata", "limit"))
    assert peak < 16 << 20, f"{peak} bytes allocated to refuse an over-sized metadata file"


def test_a_packed_column_claiming_millions_of_pieces_is_refused_without_inflating_it(ck, tmp_path):
    _warm_load(tmp_path)
    doc = read_doc(ck)
    count = 1 << 22  # 2 dims: 64 MiB of zeros, 65 KB packed
    doc["tensors"]["model.w"].update(count=count, offsets=_zlib_bomb(2 * count))
    write_doc(ck, doc)
    assert os.path.getsize(os.path.join(ck, "0.metadata")) < 100_000
    peak = _peak_allocated(lambda: load_fails(ck, FormatError, "0.metadata", "model.w"))
    assert peak < 16 << 20, f"{peak >> 20} MiB allocated to refuse a {os.path.getsize(os.path.join(ck, '0.metadata'))}-byte metadata file"


def _warm_load(tmp_path) -> None:
    """A first load of a clean checkpoint: what paddle and the library allocate once is not
    counted against the next one."""
    paddle_dcp.load_state_dict(target(), two_rank_checkpoint(str(tmp_path / "warm")))


def _crafted_columns(doc: dict, case: str) -> None:
    w, b = doc["tensors"]["model.w"], doc["tensors"]["model.b"]
    if case == "64 dims":  # count x ndim entries of zeros in each box column
        c = 20000
        w.update(shape=[1 << 20] + [1] * 63, count=c, offsets=_zlib_bomb(64 * c), shapes=_zlib_bomb(64 * c),
                 file=_zlib_bomb(c), byte_offset=_zlib_bomb(c), checksums=_zlib_bomb(c))
    elif case == "checksums":  # a 256 MiB piece in a file claimed a terabyte: 4M checksums, under zlib's own bound
        doc["files"][0]["bytes"] = 1 << 40
        w.update(shape=[1 << 16, 1 << 10], count=1, offsets=[0, 0], shapes=[1 << 16, 1 << 10], file=[0],
                 byte_offset=[0], checksums=_zlib_bomb(1 << 22))
    else:  # two entries, each under the bound alone, over it together: the first a valid one
        c, nd = 8000, 64  # 8.4 MB of columns each
        offsets = np.zeros((c, nd), np.int64)
        offsets[:, 0] = np.arange(c)
        doc["files"][0]["bytes"] = 1 << 40
        first, second = (doc["tensors"][k] for k in list(doc["tensors"])[:2])  # parsed in this order
        first.update(dtype="float32", shape=[c] + [1] * (nd - 1), count=c, offsets=_packed(offsets),
                 shapes=_packed(np.ones((c, nd), np.int64)), file=_packed(np.zeros(c, np.int64)),
                 byte_offset=_packed(np.arange(c) * 64), checksums=_packed(np.arange(c)))
        second.update(shape=[c] + [1] * (nd - 1), count=c, offsets=_zlib_bomb(nd * c), shapes=_zlib_bomb(nd * c),
                 file=_zlib_bomb(c), byte_offset=_zlib_bomb(c), checksums=_zlib_bomb(c))


def _packed(values: np.ndarray) -> str:
    return "z:" + base64.b64encode(zlib.compress(values.astype("<i8").tobytes(), 9)).decode()


@pytest.mark.parametrize("case", ["64 dims", "checksums", "two entries"])
def test_packed_columns_decode_to_at_most_the_bound_the_docs_state(ck, tmp_path, case):
    """docs/reliability.md: the packed columns of a version 1 or 2 metadata file decode to at
    most PACKED_RATIO times its size plus PACKED_FLOOR; a crafted file that claims more is
    refused before the rest is decompressed. Measured with tracemalloc: before the bound, the
    first case allocated 32 MiB for a 29 KB file, the second 64 MiB for a 45 KB one (both
    0.2 MiB with it), the third 21 MiB for an 86 KB one (13 MiB, its first entry a valid one)."""
    doc = read_doc(ck)
    _crafted_columns(doc, case)
    write_doc(ck, doc)
    size = os.path.getsize(os.path.join(ck, "0.metadata"))
    _warm_load(tmp_path)
    def refused():
        if case == "two entries":  # every entry parsed: read_metadata (a load stops at the first one's shape)
            with pytest.raises(FormatError, match=rf"0\.metadata: tensor '{list(doc['tensors'])[1]}': offsets: .* would pass the bound"):
                paddle_dcp.read_metadata(ck)
        else:
            load_fails(ck, FormatError, "0.metadata", "packed columns would pass the bound")

    peak = _peak_allocated(refused)
    # what the columns decode to, and as much again for validation's temporaries; the JSON parse
    decoded = metadata_parse.PACKED_RATIO * size + metadata_parse.PACKED_FLOOR
    bound = 2 * decoded + 8 * size + (1 << 20)
    assert peak <= bound, f"{peak >> 20} MiB allocated to refuse a {size}-byte metadata file (bound {bound >> 20} MiB)"


class _Bomb:
    """Unpickling this would create a file: a pickle that runs code."""

    def __init__(self, flag: str):
        self.flag = flag

    def __reduce__(self):
        return (open, (self.flag, "w"))


def test_a_pickle_in_place_of_the_metadata_runs_no_code(ck, monkeypatch):
    """The load path never unpickles: a pickled payload as N.metadata (or as a data file) is
    refused as not JSON (or fails its checksums) and its code never runs."""
    flag = os.path.join(os.path.dirname(ck), "pwned")

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on the load path")

    payload = pickle.dumps(_Bomb(flag), protocol=2)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    # as a data file of the right size: bytes, checksummed, never interpreted
    data = os.path.join(ck, "1_0.distcp")
    size = os.path.getsize(data)
    with open(data, "wb") as f:
        f.write((payload * (size // len(payload) + 1))[:size])
    load_fails(ck, IntegrityError, "1_0.distcp", "checksum")
    # as the metadata
    write_doc(ck, payload)
    load_fails(ck, FormatError, "0.metadata", "not valid JSON")
    assert not os.path.exists(flag)


# ================================================================== 5. files changing under a load
def _before_verify(monkeypatch, fn):
    real = loadwork.LocalLoadWork.verify_local

    def hooked(self, *args, **kwargs):
        fn()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(loadwork.LocalLoadWork, "verify_local", hooked)


def test_a_file_deleted_after_planning_opened_it_still_loads_exactly(ck, monkeypatch):
    """Planning opens every data file a rank reads (and checks its size): a file unlinked after
    that is still read whole through its open descriptor."""
    _before_verify(monkeypatch, lambda: os.remove(os.path.join(ck, "1_0.distcp")))
    sd = target()
    paddle_dcp.load_state_dict(sd, ck)
    assert_loaded(sd)
    assert not os.path.exists(os.path.join(ck, "1_0.distcp"))


def test_a_file_deleted_between_listing_and_planning_is_an_integrity_error_naming_it(ck, monkeypatch):
    real = local.FileSet.fd

    def deleted_first(self, index, *args, **kwargs):
        victim = os.path.join(ck, "1_0.distcp")
        if os.path.exists(victim):
            os.remove(victim)
        return real(self, index, *args, **kwargs)

    monkeypatch.setattr(local.FileSet, "fd", deleted_first)
    load_fails(ck, IntegrityError, "1_0.distcp", "missing")


def test_a_file_truncated_after_planning_is_a_storage_error_and_nothing_changes(ck, monkeypatch):
    """Truncated after it was opened and measured, before it is mapped: mapping past the end
    of the file is refused (StorageError naming it); nothing was copied yet."""
    _before_verify(monkeypatch, lambda: os.truncate(os.path.join(ck, "1_0.distcp"), 100))
    load_fails(ck, StorageError, "1_0.distcp", "cannot map")



def test_bytes_written_in_place_after_the_verify_step_are_an_integrity_error_naming_the_file(ck, monkeypatch):
    """The copy does not hash the bytes again: a file written since planning opened it (its
    modification time moved) is refused once the copy ends, rather than loaded silently."""
    name = os.path.join(ck, "1_0.distcp")
    os.utime(name, ns=(1_000_000_000, 1_000_000_000))  # an old checkpoint: any write moves its time
    real = loadwork.LocalLoadWork.verify_local

    def verified_then_written(self, *args, **kwargs):
        real(self, *args, **kwargs)
        with open(name, "r+b") as f:
            f.seek(40)
            f.write(b"\xff" * 8)  # same size, other bytes

    monkeypatch.setattr(loadwork.LocalLoadWork, "verify_local", verified_then_written)
    sd = target()
    with pytest.raises(IntegrityError, match="1_0.distcp was modified while it was being loaded"):
        paddle_dcp.load_state_dict(sd, ck)


def test_a_file_renamed_and_deleted_after_planning_is_not_taken_for_a_modified_one(ck, monkeypatch):
    """Unlinking or renaming moves a file's change time, not its modification time."""
    name = os.path.join(ck, "0_0.distcp")
    os.utime(name, ns=(1_000_000_000, 1_000_000_000))

    def rename_then_delete():
        os.rename(name, name + ".moved")
        os.remove(name + ".moved")

    _before_verify(monkeypatch, rename_then_delete)
    sd = target()
    paddle_dcp.load_state_dict(sd, ck)
    assert_loaded(sd)


SIGBUS_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import paddle_dcp
    from paddle_dcp.io import local, reads
    ck = sys.argv[1]
    real = reads.check_blocks
    def truncate_while_mapped(meta, seg, data, where):
        for name in ("0_0.distcp", "1_0.distcp"):
            os.truncate(os.path.join(ck, name), 0)
        return real(meta, seg, data, where)
    reads.check_blocks = truncate_while_mapped
    sd = {"model": {"w": np.zeros((8, 5), np.float32), "b": np.zeros(600, np.int64)}, "step": 0}
    try:
        paddle_dcp.load_state_dict(sd, ck)
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    print("LOADED", flush=True)
""")


def test_a_file_truncated_while_mapped_kills_the_process_with_sigbus(ck, tmp_path):
    """Not promised: a data file truncated while a load has it mapped. The pages past the new
    end are gone; touching them raises SIGBUS, which kills the process (documented in
    docs/reliability.md). This test pins that behaviour down."""
    script = tmp_path / "sigbus.py"
    script.write_text(SIGBUS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(paddle_dcp.__file__))]
                                                       + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))  # fmt: skip
    proc = subprocess.run([sys.executable, str(script), ck], capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert "RAISED" not in out and "LOADED" not in out, out[-3000:]
    # killed by the signal (-7), or by paddle's fatal-signal handler re-raising it (128 + 7)
    assert proc.returncode in (-7, 135), (proc.returncode, out[-3000:])
    assert "SIGBUS" in out or proc.returncode == -7, out[-3000:]


def test_a_metadata_edited_without_its_digest_is_refused_before_any_byte_moves(ck, opened):
    """A metadata file edited by hand (here: a plain value and the pieces' order, both still
    well-formed) no longer matches its digest: every load refuses it, naming the file."""
    doc = read_doc(ck)
    doc["structure"]["d"].append(["injected", {"v": 1}])
    doc["tensors"]["model.w"]["offsets"] = [4, 0, 0, 0]
    write_doc(ck, doc, digest=False)
    load_fails(ck, FormatError, "0.metadata", "digest")
    assert not [p for p in opened if p.endswith(".distcp")], opened


def test_a_bool_tensor_holding_bytes_other_than_0_and_1_is_a_format_error(tmp_path):
    """A stranger's safetensors file whose BOOL tensor holds bytes 2 and 255 (paddle would call
    both true, and their negation true too): refused naming the key and the file; through a
    directory checkpoint's bool piece read without checksums too."""
    import struct

    header = json.dumps({"flags": {"dtype": "BOOL", "shape": [4], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes([0, 1, 2, 255]))
    sd = {"flags": np.zeros(4, np.bool_)}
    with pytest.raises(FormatError, match=r"bad\.safetensors.*'flags' holds bytes other than 0 and 1"):
        paddle_dcp.load_state_dict(sd, str(path))
    assert not sd["flags"].any()
    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    save_checkpoint(ck, {"b": np.array([True, False, True])}, {"b": "bool"}, (1,), {"b": (None,)})
    name = os.path.join(ck, "0_0.distcp")
    raw = bytearray(open(name, "rb").read())
    at = raw.index(bytes([1, 0, 1]))
    raw[at + 1] = 7
    open(name, "wb").write(bytes(raw))
    with pytest.raises(FormatError, match=r"0_0\.distcp.*'model\.b' holds bytes other than 0 and 1"):
        paddle_dcp.load_state_dict({"model": {"b": np.zeros(3, np.bool_)}}, ck, verify=False)
