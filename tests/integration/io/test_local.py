"""paddle_dcp.io.local, files on disk: listings, atomic writes (the one atomic writer: temporary
name, fsync of the file before its rename and of the directory after, only when durable),
integrity checks, paths that stay inside the checkpoint directory, and a load path without
pickle."""
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import xxhash
from safetensors.numpy import save_file

import paddle_dcp
from paddle_dcp.io import datafile
from paddle_dcp.io import reads
from paddle_dcp.core.dtypes import as_bytes
from paddle_dcp.core import load_plan
from paddle_dcp.io import local, storage
from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import FormatError, IntegrityError, StorageError
from paddle_dcp.io import storage as dcp_storage

from unit.checkpoints import fsync_log
from unit.format.hf_dirs import ARRAYS, hf_directory
from unit.helpers import listdir, load_rank, save_checkpoint


W = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
B = np.arange(300, dtype=np.int64)


@pytest.fixture
def ckpt(tmp_path):
    """model.w sharded over 2 ranks by rows, model.b replicated: two data files."""
    path = str(tmp_path / "ck")
    os.makedirs(path)
    save_checkpoint(
        path, {"w": W, "b": B}, {"w": "float32", "b": "int64"}, (2,), {"w": (0,), "b": (None,)}, block_bytes=64,
        values={"step": 3},
    )  # fmt: skip
    return path


def whole_targets():
    return [
        load_plan.TargetPiece("model.w", "float32", (7, 5), Box.whole((7, 5))),
        load_plan.TargetPiece("model.b", "int64", (300,), Box.whole((300,))),
    ]


def data_file_of(path, key):
    meta = dcp_storage.read_metadata(local.LocalStorage(path), 0)
    p = meta.tensors[key].pieces
    return os.path.join(path, meta.files[int(p.files[0])].name), int(p.byte_offsets[0])


# ------------------------------------------------------------------ listing
def test_list_checkpoints_complete_means_metadata_and_data_files_by_id(tmp_path):
    for name in ["3.metadata", "0_3.distcp", "1_3.distcp", "0_5.distcp", "9.metadata.tmp.ab12",
                 "2_9.distcp.tmp.cd34", "notes.txt", "x.metadata", "1_x.distcp", "12.metadata",
                 "0_3.2.distcp", "1_3.2.distcp.tmp.0a1b"]:  # fmt: skip
        (tmp_path / name).write_bytes(b"")
    listing = storage.list_checkpoints(local.LocalStorage(str(tmp_path)))
    assert listing.complete == {3, 12}
    assert listing.data == {3: {(0, 0), (1, 0), (0, 2)}, 5: {(0, 0)}}
    assert listing.generations(3) == {0: [0, 1], 2: [0]}
    assert listing.temporary == ("1_3.2.distcp.tmp.0a1b", "2_9.distcp.tmp.cd34", "9.metadata.tmp.ab12")
    assert listing.latest == 12


def test_list_checkpoints_of_a_missing_or_empty_directory(tmp_path):
    for path in (tmp_path / "nope", tmp_path):
        listing = storage.list_checkpoints(local.LocalStorage(str(path)))
        assert listing.complete == frozenset() and listing.data == {} and listing.latest is None


def test_list_checkpoints_of_a_file_is_a_storage_error(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(StorageError) as info:
        storage.list_checkpoints(local.LocalStorage(str(tmp_path / "f")))
    assert info.value.path == str(tmp_path / "f")


def test_a_save_lists_as_complete(ckpt):
    listing = storage.list_checkpoints(local.LocalStorage(ckpt))
    assert listing.complete == {0} and listing.data == {0: {(0, 0), (1, 0)}}
    assert not [n for n in listdir(ckpt) if storage.TMP_MARK in n]


# ------------------------------------------------------------------ writing
def test_write_atomic_leaves_only_the_final_file(tmp_path):
    local.write_atomic(str(tmp_path), "0.metadata", b"first")
    local.write_atomic(str(tmp_path), "0.metadata", b"second", durable=True)
    assert listdir(str(tmp_path)) == ["0.metadata"]
    assert (tmp_path / "0.metadata").read_bytes() == b"second"


def test_write_atomic_failure_is_a_storage_error_and_leaves_nothing(tmp_path):
    (tmp_path / "0.metadata").mkdir()  # a directory in the way: the rename fails
    with pytest.raises(StorageError) as info:
        local.write_atomic(str(tmp_path), "0.metadata", b"x")
    assert "0.metadata" in str(info.value)
    assert listdir(str(tmp_path)) == ["0.metadata"]
    with pytest.raises(StorageError):
        local.write_atomic(str(tmp_path / "missing"), "0.metadata", b"x")


def test_data_writer_aligns_pieces_and_checksums_blocks(tmp_path):
    w = datafile.data_writer(local.LocalStorage(str(tmp_path)), "0_0.distcp", 64)
    a = np.arange(30, dtype=np.uint8)
    b = np.arange(100, dtype=np.uint8)
    sums_a = w.write(as_bytes(a))
    assert [n for n in listdir(str(tmp_path))][0].startswith("0_0.distcp" + storage.TMP_MARK)
    sums_b = w.write(as_bytes(b))
    assert w.commit() == 64 + 100
    raw = (tmp_path / "0_0.distcp").read_bytes()
    assert raw[:30] == a.tobytes() and raw[30:64] == bytes(34) and raw[64:] == b.tobytes()
    # block k of a piece is hashed with seed (piece seed + k); the piece seed is 0 here
    assert sums_a == [xxhash.xxh3_64_intdigest(a.tobytes(), seed=0)]
    assert sums_b == [xxhash.xxh3_64_intdigest(b.tobytes()[:64], seed=0), xxhash.xxh3_64_intdigest(b.tobytes()[64:], seed=1)]
    assert listdir(str(tmp_path)) == ["0_0.distcp"]


def _pieces_written(tmp_path, sizes, monkeypatch):
    """Write pieces of ``sizes`` bytes (piece i: bytes i, i+1, ... mod 251) through a
    data writer, counting its writes to the file and its hand-offs to the writing thread; (the
    file's bytes, the bytes expected, computed by hand: every piece at the next multiple of 64,
    zeros between, writes, hand-offs)."""
    count = {"pwrite": 0, "submit": 0}
    real_pwrite, real_submit = local.AtomicFile.pwrite, local.FileStream.write_at

    def pwrite(self, view, offset):
        count["pwrite"] += 1
        return real_pwrite(self, view, offset)

    def submit(self, view, offset, keep=None):
        count["submit"] += 1
        return real_submit(self, view, offset, keep)

    monkeypatch.setattr(local.AtomicFile, "pwrite", pwrite)
    monkeypatch.setattr(local.FileStream, "write_at", submit)
    w = datafile.data_writer(local.LocalStorage(str(tmp_path)), "0_0.distcp", 4096)
    want = bytearray()
    for i, n in enumerate(sizes):
        piece = ((np.arange(n) + i) % 251).astype(np.uint8)
        want += bytes(-len(want) % 64) + piece.tobytes()
        w.write(as_bytes(piece), keep=piece)
    assert w.commit() == len(want)
    monkeypatch.undo()
    return (tmp_path / "0_0.distcp").read_bytes(), bytes(want), count["pwrite"], count["submit"]


def test_data_writer_writes_small_pieces_in_batches_whatever_their_number(tmp_path, monkeypatch):
    per_piece = []
    for n in (1_000, 10_000):
        d = tmp_path / str(n)
        d.mkdir()
        got, want, writes, handoffs = _pieces_written(d, [2000 + i % 97 for i in range(n)], monkeypatch)
        assert got == want
        assert writes == handoffs <= -(-len(want) // datafile.DataFileWriter.BATCH_BYTES) + 1
        per_piece.append(handoffs / n)
    # one hand-off and one system call per batch of about 2,000 pieces, at 1k as at 10k
    assert per_piece[1] <= per_piece[0] and per_piece[0] <= 1 / 500, per_piece


def test_data_writer_writes_large_pieces_alone_between_batches_of_small_ones(tmp_path, monkeypatch):
    big = datafile.DataFileWriter.SMALL_PIECE
    sizes = [10, 3000, big, 7, big + 5, 64, 1, 3 * datafile.DataFileWriter.BATCH_BYTES // 2, 5]
    got, want, writes, handoffs = _pieces_written(tmp_path, sizes, monkeypatch)
    assert got == want
    # batches [10, 3000], [7], [64, 1], [5] and the three large pieces alone
    assert writes == handoffs == 7


def test_data_writer_abort_removes_its_temporary_file(tmp_path):
    w = datafile.data_writer(local.LocalStorage(str(tmp_path)), "0_0.distcp", 64)
    w.write(as_bytes(np.zeros(3, np.uint8)))
    w.abort()
    assert listdir(str(tmp_path)) == []


# ------------------------------------------------------------------ reading and integrity
def test_a_clean_checkpoint_loads(ckpt):
    (w, b), _ = load_rank(ckpt, 0, whole_targets())
    assert np.array_equal(w, W) and np.array_equal(b, B)
    assert dcp_storage.read_metadata(local.LocalStorage(ckpt), 0).values() == {"step": 3}


def test_file_set_refuses_a_file_whose_size_differs_from_the_metadata(ckpt):
    name, _ = data_file_of(ckpt, "model.b")
    with open(name, "ab") as f:
        f.write(b"\0")
    with pytest.raises(IntegrityError) as info:
        load_rank(ckpt, 0, whole_targets())
    assert os.path.basename(name) in str(info.value) and "bytes" in str(info.value)


def test_file_set_refuses_a_truncated_file(ckpt):
    name, _ = data_file_of(ckpt, "model.b")
    os.truncate(name, os.path.getsize(name) - 1)
    with pytest.raises(IntegrityError, match=os.path.basename(name)):
        load_rank(ckpt, 0, whole_targets())


def test_a_missing_data_file_is_an_integrity_error(ckpt):
    name, _ = data_file_of(ckpt, "model.w")
    os.unlink(name)
    with pytest.raises(IntegrityError, match="missing"):
        load_rank(ckpt, 0, whole_targets())


@pytest.mark.parametrize("direct_min_bytes", [0, 1 << 20])  # bytes landing in place, or staged
@pytest.mark.parametrize("key, at", [("model.b", 0), ("model.b", 2399), ("model.b", 1000), ("model.w", 70)])
def test_a_flipped_byte_is_an_integrity_error_naming_file_and_key(ckpt, key, at, direct_min_bytes):
    name, offset = data_file_of(ckpt, key)
    with open(name, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)
        f.seek(offset + at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(IntegrityError) as info:
        load_rank(ckpt, 0, whole_targets(), direct_min_bytes=direct_min_bytes)
    message = str(info.value)
    assert os.path.basename(name) in message and repr(key) in message


def test_a_flipped_byte_outside_the_target_is_not_read(ckpt):
    name, offset = data_file_of(ckpt, "model.b")
    with open(name, "r+b") as f:
        f.seek(offset + 8 * 299)  # the last element of model.b
        f.write(b"\xff")
    target = [load_plan.TargetPiece("model.b", "int64", (300,), Box((0,), (100,)))]
    (b,), _ = load_rank(ckpt, 0, target)
    assert np.array_equal(b, B[:100])


def test_read_metadata_of_a_missing_id_or_the_wrong_id(ckpt):
    with pytest.raises(StorageError, match="no metadata"):
        dcp_storage.read_metadata(local.LocalStorage(ckpt), 1)
    os.rename(os.path.join(ckpt, "0.metadata"), os.path.join(ckpt, "4.metadata"))
    with pytest.raises(FormatError, match="checkpoint 0, not 4"):
        dcp_storage.read_metadata(local.LocalStorage(ckpt), 4)


def test_read_metadata_of_a_truncated_file_is_a_format_error(ckpt):
    full = os.path.join(ckpt, "0.metadata")
    os.truncate(full, os.path.getsize(full) // 2)
    with pytest.raises(FormatError, match="0.metadata"):
        dcp_storage.read_metadata(local.LocalStorage(ckpt), 0)


# ------------------------------------------------------------------ paths
def test_inside_accepts_plain_names_and_symlinks_within(tmp_path):
    (tmp_path / "a").write_bytes(b"")
    os.symlink("a", tmp_path / "b")
    assert local.inside(str(tmp_path), "a") == os.path.join(str(tmp_path), "a")
    assert local.inside(str(tmp_path), "b") == os.path.join(str(tmp_path), "b")


def test_inside_refuses_a_symlink_pointing_outside(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (tmp_path / "secret").write_bytes(b"x")
    os.symlink(tmp_path / "secret", ck / "0_0.distcp")
    os.symlink("../secret", ck / "1_0.distcp")
    for name in ("0_0.distcp", "1_0.distcp"):
        with pytest.raises(FormatError, match="outside the checkpoint directory"):
            local.inside(str(ck), name)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "", "a/b", ".."])
def test_inside_refuses_names_that_are_not_plain(tmp_path, name):
    with pytest.raises(FormatError):
        local.inside(str(tmp_path), name)


def test_a_data_file_symlinked_outside_is_refused_at_load(ckpt, tmp_path):
    name, _ = data_file_of(ckpt, "model.w")
    moved = str(tmp_path / "elsewhere.distcp")
    os.rename(name, moved)
    os.symlink(moved, name)
    with pytest.raises(FormatError, match="outside"):
        load_rank(ckpt, 0, whole_targets())


# ------------------------------------------------------------------ no pickle
def test_the_load_path_never_unpickles(ckpt, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on the load path")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    meta = dcp_storage.read_metadata(local.LocalStorage(ckpt), 0)
    targets = whole_targets() + [load_plan.TargetPiece("model.w", "float32", (7, 5), Box((2, 1), (4, 3)))]
    ops = load_plan.plan_reads(meta, targets, max_read_bytes=1)
    out = [np.zeros(t.box.shape, dtype={"float32": np.float32, "int64": np.int64}[t.dtype]) for t in targets]
    files = local.FileSet(ckpt, meta.files)
    try:
        reads.execute_reads(ops, meta, files, out)
    finally:
        files.close()
    assert np.array_equal(out[0], W) and np.array_equal(out[1], B) and np.array_equal(out[2], W[2:6, 1:4])
    assert meta.values() == {"step": 3}


def test_read_metadata_refuses_a_file_marked_as_a_subset(ckpt):
    full = os.path.join(ckpt, "0.metadata")
    with open(full) as f:
        doc = json.load(f)
    t = doc["tensors"]["model.w"]  # two pieces: drop the second, leaving a gap
    t.update(count=1, offsets=t["offsets"][:2], shapes=t["shapes"][:2], file=t["file"][:1],
             byte_offset=t["byte_offset"][:1], checksums=t["checksums"][:2])  # 80 bytes: 2 blocks  # fmt: skip
    doc["subset"] = True
    with open(full, "w") as f:
        json.dump(doc, f)
    with pytest.raises(FormatError):
        dcp_storage.read_metadata(local.LocalStorage(ckpt), 0)


# ------------------------------------------------------------------ the one atomic writer
def _data_writer(d: str, durable: bool) -> None:
    writer = datafile.data_writer(local.LocalStorage(d), "f", 64)
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


def test_a_data_writer_whose_header_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full_disk(self, view, offset):
        raise StorageError(f"cannot write {self.tmp}: no space left", self.tmp)

    monkeypatch.setattr(local.AtomicFile, "pwrite", full_disk)
    writer = datafile.data_writer(local.LocalStorage(str(tmp_path)), "f", 64, header=b"head")
    with pytest.raises(StorageError, match="no space left"):  # written by the file's thread: known by the commit
        writer.commit()
    writer.abort()
    assert listdir(str(tmp_path)) == []


# ------------------------------------------------------------------ a Hugging Face hub cache
def hub_cache_snapshot(cache: Path, arrays: dict, shards: list[list[str]]) -> Path:
    """A Hugging Face hub cache as huggingface_hub lays it out: every file's bytes in
    ``models--org--tiny/blobs/<sha256>``, the snapshot's files relative symlinks to them."""
    import hashlib

    plain = hf_directory(cache.parent / f"{cache.name}-files", arrays, shards)
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in sorted(plain.iterdir()):
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / f.name)
    return snapshot


def test_a_snapshot_of_the_hugging_face_cache_loads_through_its_symlinks(tmp_path):
    from huggingface_hub import scan_cache_dir

    cache = tmp_path / "hub"
    snapshot = hub_cache_snapshot(cache, ARRAYS, [["embed.w", "norm"], ["head.b"]])
    repos = scan_cache_dir(cache).repos  # huggingface_hub's own reading of the layout
    assert [r.repo_id for r in repos] == ["org/tiny"] and len(next(iter(repos)).revisions) == 1
    sd = {"embed.w": np.zeros((8, 6), np.float32), "head.b": np.zeros(5, np.int64), "norm": np.zeros(7, np.float16)}
    paddle_dcp.load_state_dict(sd, str(snapshot), safetensors=True)
    assert all(np.array_equal(sd[k], ARRAYS[k]) for k in ARRAYS)


def test_a_snapshot_link_out_of_its_repository_is_still_refused(tmp_path):
    snapshot = hub_cache_snapshot(tmp_path / "hub", ARRAYS, None)
    elsewhere = tmp_path / "elsewhere.safetensors"
    save_file(ARRAYS, str(elsewhere))
    (snapshot / "model.safetensors").unlink()
    os.symlink(elsewhere, snapshot / "model.safetensors")
    sd = {"norm": np.zeros(7, np.float16)}
    with pytest.raises(FormatError, match="outside the checkpoint directory"):
        paddle_dcp.load_state_dict(sd, str(snapshot), safetensors=True)
    # a blobs directory of another repository is no better
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    os.rename(elsewhere, other / "x")
    (snapshot / "model.safetensors").unlink()
    os.symlink("../../../models--org--other/blobs/x", snapshot / "model.safetensors")
    with pytest.raises(FormatError, match="outside the checkpoint directory"):
        paddle_dcp.load_state_dict(sd, str(snapshot), safetensors=True)


def test_the_atomic_writer_never_writes_through_a_name_planted_before_it(tmp_path, monkeypatch):
    """The temporary name is created by the writer itself (O_EXCL|O_NOFOLLOW): a link or a
    file planted under it (the random part guessed) is a StorageError, its target untouched."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(local.secrets, "token_hex", lambda n: "abcd1234")
    os.symlink(victim, tmp_path / "f.tmp.abcd1234")
    with pytest.raises(StorageError, match="cannot create"):
        local.AtomicFile(str(tmp_path / "f"))
    os.remove(tmp_path / "f.tmp.abcd1234")
    os.link(victim, tmp_path / "f.tmp.abcd1234")
    with pytest.raises(StorageError, match="cannot create"):
        local.write_atomic(str(tmp_path), "f", b"new")
    assert victim.read_bytes() == b"precious" and not (tmp_path / "f").exists()
