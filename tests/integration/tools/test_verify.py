"""paddle_dcp.tools.verify (the verify command): a sound checkpoint passes; every damage (a
flipped byte, a short or missing file, overlapping pieces, unparsable or edited metadata) is
named by file, key and problem, as a load refuses it; every problem listed, every complete id
checked, the copies of save_replicas checked each."""
import os
import shutil

import numpy as np
import pytest

from paddle_dcp.io import local
from paddle_dcp.tools import consolidate
from paddle_dcp.io import storage as dcp_storage

from unit.helpers import save_checkpoint
from unit.tools.commands import (
    edit_value,
    flip_byte,
    garbage,
    overlap,
    piece_location,
    remove,
    remove_metadata,
    run,
    truncate,
)


def test_verify_good_checkpoint(saved, capsys):
    code, out, err = run(capsys, "verify", saved[0])
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("checkpoint 0: OK")
    assert err == ""  # stderr is not a terminal: no progress bar


def test_verify_progress_bar_on_request(saved, capsys):
    code, _, err = run(capsys, "verify", saved[0], "--progress")
    total = sum(a.nbytes for a in saved[1].values())
    assert code == 0
    assert "verify 0" in err and "/s" in err and ("100%" in err or "B/s" in err)
    assert f"{total}" in err or "B /" in err


@pytest.mark.parametrize("damage, what", [
    (flip_byte, "checksum"), (truncate, "bytes, the metadata says"), (remove, "missing"),
    (overlap, "overlap"), (garbage, "not valid JSON"),
])  # fmt: skip
def test_verify_names_file_key_and_problem(ck, capsys, damage, what):
    name = damage(ck, "model.w")
    code, out, err = run(capsys, "verify", ck)
    assert code == 1, out
    problems = [line for line in out.splitlines() if not line.startswith("checkpoint 0:")]
    assert problems, out
    hit = [p for p in problems if p.startswith(name) and what in p]
    assert hit, out
    if damage is not garbage:  # a metadata that does not parse names no key
        assert "model.w" in hit[0]
    assert "problem" in out.splitlines()[-1]


@pytest.mark.parametrize("damage, verify_says, load_raises", [
    (edit_value, "digest does not match", "digest does not match"),
    (flip_byte, "checksum", "checksum"),
    (truncate, "bytes, the metadata says", "model.w"),
    (remove, "missing", "model.w"),
    (remove_metadata, "no *.metadata file (incomplete ids: 0)", "no complete checkpoint"),
])  # fmt: skip
def test_each_damage_is_caught_by_verify_and_by_a_load(ck, capsys, damage, verify_says, load_raises):
    """What a load refuses, verify reports (it said OK to an edited metadata value that the
    load refused), and the other way round."""
    import paddle_dcp

    paddle_dcp.load_state_dict({"model": {"w": np.zeros((6, 10), np.float32)}}, ck)  # sound before
    name = damage(ck, "model.w")
    code, out, err = run(capsys, "verify", ck)
    assert code == 1, out + err
    assert verify_says in out + err, out + err
    assert name in out or damage is remove_metadata, out  # the file, where one is damaged
    target = {"model": {"w": np.zeros((6, 10), np.float32)}}
    with pytest.raises(paddle_dcp.DcpError) as info:
        paddle_dcp.load_state_dict(target, ck, unique_id=None if damage is remove_metadata else 0)
    assert load_raises in str(info.value), str(info.value)
    assert not target["model"]["w"].any()  # nothing loaded


def test_verify_lists_every_problem_and_reads_in_small_windows(ck, capsys, monkeypatch):
    monkeypatch.setattr(consolidate, "SLAB_BYTES", 64)  # one checksum block per read
    flipped = flip_byte(ck, "model.w")
    missing_name, _ = piece_location(ck, "model.q", 0)
    if missing_name == flipped:
        missing_name, _ = piece_location(ck, "model.q", 1)
    os.unlink(missing_name)
    code, out, _ = run(capsys, "verify", ck)
    assert code == 1
    assert any(line.startswith(flipped) and "model.w" in line for line in out.splitlines())
    assert any(line.startswith(missing_name) and "missing" in line and "model.q" in line for line in out.splitlines())


def test_verify_all_checks_every_complete_id(ck, capsys):
    shutil.copy(os.path.join(ck, "0.metadata"), os.path.join(ck, "1.metadata"))  # names id 0 inside
    code, out, _ = run(capsys, "verify", ck, "--all")
    assert code == 1
    assert "checkpoint 0: OK" in out and "checkpoint 1: 1 problem" in out
    assert "describes checkpoint 0, not 1" in out


def test_verify_takes_the_copies_of_a_save_replicas_checkpoint(tmp_path):
    """Every holder's copy of a replicated piece (save_replicas) is one box saved twice, in two
    files: verify checks each copy's bytes and does not call the copies an overlap."""
    from paddle_dcp.tools import verify

    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    saved = save_checkpoint(str(tmp_path), {"w": w}, {"w": "float32"}, (2,), {"w": (None,)}, replicas=True)
    assert saved.meta.replicas and saved.meta.tensors["model.w"].pieces.count == 2
    problems, counts = verify.verify_checkpoint(str(tmp_path), 0)
    assert problems == [] and counts["pieces"] == 2 and counts["files"] == 2
    with open(tmp_path / "1_0.distcp", "r+b") as f:  # damage the second copy only
        f.write(b"\xff")
    problems, _ = verify.verify_checkpoint(str(tmp_path), 0)
    assert len(problems) == 1 and "1_0.distcp" in problems[0] and "model.w" in problems[0], problems


def test_verify_checks_quantized_pieces_at_their_stored_sizes(compressed, tmp_path, capsys):
    """Every stored byte of a quantized piece is covered (its last block too), and a flip in
    its scales or codes is found."""
    code, out, _ = run(capsys, "verify", compressed[0])
    assert code == 0, out
    meta = dcp_storage.read_metadata(local.LocalStorage(compressed[0]), 0)
    for key in ("model.m1", "model.m2"):
        entry = meta.tensors[key]
        for i in range(entry.pieces.count):
            path = shutil.copytree(compressed[0], str(tmp_path / f"{key}-{i}"))
            name = os.path.join(path, meta.files[int(entry.pieces.files[i])].name)
            rows = entry.pieces.shapes[i]
            blocks = -(-int(np.prod(rows)) // 256)
            last = int(entry.pieces.byte_offsets[i]) + blocks * (264 if key == "model.m1" else 136) - 1
            with open(name, "r+b") as f:  # the piece's last stored byte, by the format's sizes
                f.seek(last)
                byte = f.read(1)
                f.seek(last)
                f.write(bytes([byte[0] ^ 1]))
            code, out, _ = run(capsys, "verify", path)
            assert code == 1 and "checksum" in out and key in out, out


def test_verify_checks_the_source_of_a_derived_tensor_and_counts_no_pieces_of_its_own(derived, tmp_path, capsys):
    code, out, _ = run(capsys, "verify", derived[0])
    assert code == 0 and "3 tensors, 3 pieces" in out, out  # model.p in 2 pieces, model.q in 1
    meta = dcp_storage.read_metadata(local.LocalStorage(derived[0]), 0)
    entry = meta.tensors["model.p"]
    path = shutil.copytree(derived[0], str(tmp_path / "bad"))
    with open(os.path.join(path, meta.files[int(entry.pieces.files[0])].name), "r+b") as f:
        f.seek(int(entry.pieces.byte_offsets[0]))
        byte = f.read(1)
        f.seek(int(entry.pieces.byte_offsets[0]))
        f.write(bytes([byte[0] ^ 1]))
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and "checksum" in out and "model.p" in out, out
