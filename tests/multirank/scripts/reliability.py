"""Integrity on every rank (issue 6, point 3), 2 ranks under paddle.distributed.launch.

Usage: reliability.py DIR [case ...]

Each case damages a checkpoint the ranks just saved (rank 0 edits, behind barriers), then every
rank loads it: every rank raises CollectiveError whose text names the damaged data file (or
the metadata) and the key, and its state dict is exactly as it was. verify=False shows what
turning checksums off does: a flipped byte is loaded as it is.
(tests/multirank/scripts/errors.py covers a flipped byte, a truncated and a deleted file, a future
format version and a negative shape the same way.)
"""
import os
import sys

import numpy as np

import common as c
import metadoc
import paddle_dcp
from paddle_dcp.io import local
from paddle_dcp.io import storage as dcp_storage

ROOT = c.init()
R = c.rank()
MESH = c.Mesh([0, 1])
S0 = (("S", 0),)
# even rows: the two data files have the same size, so a swap is caught by the checksums alone
LEAVES = [
    c.Leaf(("t", "w"), (8, 5), "float32", MESH, S0, index=0),
    c.Leaf(("t", "b"), (6, 4), "int64", MESH, S0, index=1),
]


def save(name):
    p = os.path.join(ROOT, name)
    paddle_dcp.save_state_dict(c.build(LEAVES, 0, {"step": 3}), p)
    c.dist.barrier()
    return p


def target():
    return c.build(LEAVES, 0, {"step": 0}, target=True)


def on_rank0(fn):
    c.dist.barrier()
    if R == 0:
        fn()
    c.dist.barrier()


def every_rank_fails(p, *needles, any_of=(), **kwargs):
    sd = target()
    before = c.snapshot(sd)
    try:
        paddle_dcp.load_state_dict(sd, p, **kwargs)
    except paddle_dcp.CollectiveError as exc:
        text = str(exc)
        print(f"rank {R}: got the expected CollectiveError: {text[:600]}", flush=True)
        assert exc.failures, exc
        for needle in needles:
            assert needle in text, (needle, text)
        if any_of:
            assert any(n in text for n in any_of), (any_of, text)
        c.assert_unchanged(sd, before)
        return exc
    raise AssertionError("the load did not raise")


def edit_metadata(p, fn):
    def edit():
        full = os.path.join(p, "0.metadata")
        with open(full, "rb") as f:
            doc = metadoc.read(f.read())
        fn(doc)
        # written with matching digests, as by a writer that meant it, so the load reaches the
        # check under test (an edit without them is refused by them: tests/unit)
        with open(full, "wb") as f:
            f.write(metadoc.write(doc))

    on_rank0(edit)


def swapped_data_files():
    p = save("swap")
    a, b = os.path.join(p, "0_0.distcp"), os.path.join(p, "1_0.distcp")
    assert os.path.getsize(a) == os.path.getsize(b)

    def swap():
        os.rename(a, a + ".x")
        os.rename(b, a)
        os.rename(a + ".x", b)

    on_rank0(swap)
    exc = every_rank_fails(p, "IntegrityError", "checksum", "'t.", any_of=("0_0.distcp", "1_0.distcp"))
    assert sorted(exc.failures) == [0, 1], exc.failures  # each rank reads its own rows


def edited_checksum():
    p = save("checksum")

    def edit(doc):
        sums = doc["tensors"]["t.w"]["checksums"]
        sums[-1] = ("0" if sums[-1][0] != "0" else "1") + sums[-1][1:]  # rank 1's rows

    edit_metadata(p, edit)
    every_rank_fails(p, "IntegrityError", "1_0.distcp", "'t.w'", "checksum")


def edited_byte_offset():
    p = save("offset")

    def edit(doc):
        t = doc["tensors"]["t.b"]
        t["byte_offset"] = [t["byte_offset"][0] - 64, t["byte_offset"][1]]  # t.w's bytes instead

    edit_metadata(p, edit)
    every_rank_fails(p, "IntegrityError", "0_0.distcp", "'t.b'", "checksum")


def overlapping_pieces():
    p = save("overlap")
    edit_metadata(p, lambda doc: doc["tensors"]["t.w"].update(offsets=[0, 0, 3, 0]))
    every_rank_fails(p, "t.w", "overlap")


def verify_false_loads_a_flipped_bit():
    """The first byte of t.w's piece in 1_0.distcp (w[4, 0]) flipped: verify=True raises on
    every rank; verify=False loads it as it is on the rank holding it, the rest exactly."""
    p = save("noverify")

    def damage():
        meta = dcp_storage.read_metadata(local.LocalStorage(p), 0)
        pieces = meta.tensors["t.w"].pieces
        i = [k for k in range(pieces.count) if meta.files[int(pieces.files[k])].name == "1_0.distcp"][0]
        with open(os.path.join(p, "1_0.distcp"), "r+b") as f:
            f.seek(int(pieces.byte_offsets[i]))
            first = f.read(1)
            f.seek(int(pieces.byte_offsets[i]))
            f.write(bytes([first[0] ^ 0x01]))

    on_rank0(damage)
    every_rank_fails(p, "IntegrityError", "1_0.distcp", "'t.w'")
    sd = target()
    paddle_dcp.load_state_dict(sd, p, verify=False)
    w = LEAVES[0]
    damaged = w.glob(0).copy()
    damaged.reshape(-1).view(np.uint8)[4 * 5 * 4] ^= 0x01
    c.check_tensor(sd["t"]["w"], damaged, "float32", MESH, S0, R, "t.w (damaged)")
    c.check_tensor(sd["t"]["b"], LEAVES[1].glob(0), "int64", MESH, S0, R, "t.b")
    if R == 1:
        assert c.held(sd["t"]["w"])[0, 0] != w.glob(0)[4, 0]
    assert sd["step"] == 3


def deleted_after_listing():
    """1_0.distcp disappears after every rank listed the directory, before planning opens it:
    the ranks that read it raise IntegrityError naming it; every rank raises; nothing changes."""
    p = save("vanish")
    real_list = local.list_names
    calls = [0]

    def list_then_vanish(path, *args, **kwargs):
        out = real_list(path, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 1:
            c.dist.barrier()  # every rank has listed
            if R == 0:
                os.remove(os.path.join(p, "1_0.distcp"))
            c.dist.barrier()
        return out

    local.list_names = list_then_vanish
    try:
        exc = every_rank_fails(p, "IntegrityError", "1_0.distcp", "missing")
    finally:
        local.list_names = real_list
    assert 1 in exc.failures, exc.failures


CASES = {
    "swapped_data_files": swapped_data_files,
    "edited_checksum": edited_checksum,
    "edited_byte_offset": edited_byte_offset,
    "overlapping_pieces": overlapping_pieces,
    "verify_false_loads_a_flipped_bit": verify_false_loads_a_flipped_bit,
    "deleted_after_listing": deleted_after_listing,
}

c.run_cases(CASES, sys.argv[2:])
