"""Failures raise on every rank, with messages that name what went wrong; none hangs.

Usage (under paddle.distributed.launch, 2 ranks): errors.py DIR [case ...]

Every case runs the failing call on every rank, catches the expected exception, and checks
its type, the ranks that failed and the message; the launcher's timeout guards against a
rank left waiting. Every load that fails before bytes move (shape / dtype / kind mismatch, no
directory, no checkpoint, unknown id, a data file missing or short, a damaged metadata file)
must leave the state dict exactly as it was on every rank: every container and tensor object,
every tensor's local bytes and every plain value (:func:`load_fails`).
"""
import copy
import os
import sys

import numpy as np
import paddle

import common as c
import metadoc
import paddle_dcp
from paddle_dcp.core import checksums
from paddle_dcp.core.metadata import SUPPORTED_VERSIONS
from paddle_dcp import CollectiveError
from paddle_dcp.io import datafile
from paddle_dcp.io import storage

ROOT = c.init()
R = c.rank()
MESH = c.Mesh([0, 1])
S0 = (("S", 0),)
LEAVES = [
    c.Leaf(("w",), (7, 5), "float32", MESH, S0, index=0),
    c.Leaf(("b",), (6, 4), "bfloat16", MESH, (("S", 1),), index=1),
    c.Leaf(("p",), (3,), "int64", index=2),
]


def path(name):
    return os.path.join(ROOT, name)


SAVED_VALUES = {"step": 3, "lrs": [0.1, 0.2], "meta": {"name": "x", "flag": True}}
BLANK_VALUES = {"step": 0, "lrs": [0.0, 0.0], "meta": {"name": "", "flag": None}}


def good_save(name):
    paddle_dcp.save_state_dict(c.build(LEAVES, 0, dict(SAVED_VALUES)), path(name))
    return path(name)


def target(**replace):
    """A load target like LEAVES, with some tensors replaced by others."""
    sd = c.build(LEAVES, 0, {k: copy.deepcopy(v) for k, v in BLANK_VALUES.items()}, target=True)
    sd.update(replace)
    return sd


def expect(fn, failing, *needles, kind=CollectiveError):
    """``fn()`` raises ``kind`` here; for CollectiveError: exactly the ranks ``failing``
    failed (None: any non-empty set of ranks), and each of their messages contains every
    needle."""
    try:
        fn()
    except kind as exc:
        if kind is CollectiveError:
            if failing is None:
                failing = sorted(exc.failures)
                assert failing, exc.failures
            assert sorted(exc.failures) == sorted(failing), (exc.failures, failing)
            for r in failing:
                for needle in needles:
                    assert needle in exc.failures[r], (needle, r, exc.failures[r])
            text = str(exc)
            assert all(f"rank {r}:" in text for r in failing), text
        else:
            for needle in needles:
                assert needle in str(exc), (needle, str(exc))
        print(f"rank {R}: got the expected {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return exc
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def load_fails(sd, p, failing, *needles, kind=CollectiveError, **kwargs):
    """Loading ``p`` into ``sd`` raises as :func:`expect` checks, and leaves ``sd`` exactly as
    it was on this rank."""
    before = c.snapshot(sd)
    exc = expect(lambda: paddle_dcp.load_state_dict(sd, p, **kwargs), failing, *needles, kind=kind)
    c.assert_unchanged(sd, before)
    return exc


def files(p):
    return sorted(os.listdir(p)) if os.path.isdir(p) else []


# ------------------------------------------------------------------------------ load
def shape_mismatch():
    p = good_save("shape")
    w = c.make(c.global_array((6, 5), "float32"), "float32", MESH, S0)
    exc = load_fails(target(w=w), p, [0, 1], "MismatchError", "w:", "(7, 5)", "(6, 5)")
    assert isinstance(exc.__cause__, paddle_dcp.MismatchError), repr(exc.__cause__)


def dtype_mismatch():
    p = good_save("dtype")
    w = c.make(c.global_array((7, 5), "float64"), "float64", MESH, S0)
    load_fails(target(w=w), p, [0, 1], "MismatchError", "w:", "float32", "float64")


def mismatch_on_one_rank():
    """A plain tensor whose shape differs on rank 1 only: rank 1 fails, both raise."""
    p = good_save("one_rank")
    sd = target(p=paddle.zeros([4] if R == 1 else [3], dtype="int64"))
    exc = load_fails(sd, p, [1], "MismatchError", "p:", "(3,)", "(4,)")
    if R == 1:
        assert isinstance(exc.__cause__, paddle_dcp.MismatchError), repr(exc.__cause__)


def tensor_where_value_was_saved():
    p = good_save("kind")
    sd = target(step=paddle.zeros([1]))
    load_fails(sd, p, [0, 1], "MismatchError", "step")


def empty_directory():
    p = path("empty")
    os.makedirs(p, exist_ok=True)
    load_fails(target(), p, [0, 1], "FormatError", "no complete checkpoint", p)


def missing_directory():
    p = path("does_not_exist")
    load_fails(target(), p, [0, 1], "FormatError", "no complete checkpoint", p)


def missing_unique_id():
    p = good_save("ids")
    load_fails(target(), p, [0, 1], "7.metadata", unique_id=7)


def bad_unique_id():
    p = path("ids")
    for bad in (-1, "0", 1.0):
        load_fails(target(), p, [0, 1], "unique_id", unique_id=bad)
        expect(lambda: paddle_dcp.save_state_dict(target(), p, unique_id=bad), [0, 1], "unique_id")
    assert files(p) == ["0.0.claim", "0.metadata", "0_0.distcp", "1_0.distcp"], files(p)


def truncated_shard():
    p = good_save("truncated")
    c.dist.barrier()
    if R == 0:
        name = os.path.join(p, "1_0.distcp")
        os.truncate(name, os.path.getsize(name) - 1)
    c.dist.barrier()
    # every rank that needs a byte of 1_0.distcp (rank 1 at least) finds it short when it opens
    # the file, before any byte moves
    exc = load_fails(target(), p, None, "IntegrityError", "1_0.distcp", "bytes")
    assert 1 in exc.failures, exc.failures


def corrupted_byte():
    p = good_save("corrupted")
    c.dist.barrier()
    if R == 0:
        with open(os.path.join(p, "0_0.distcp"), "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0x01]))
    c.dist.barrier()
    # the checksums are checked before any target changes: the state dict stays as it was
    load_fails(target(), p, None, "IntegrityError", "0_0.distcp", "checksum")



RESHARD_SAVED = [c.Leaf(("big",), (256, 256), "float32", MESH, S0, index=0)]
RESHARD_TARGET = [c.Leaf(("big",), (256, 256), "float32", MESH, (("S", 1),), index=0)]


def checks_shared_in_a_reshard():
    """Loaded Shard(0) -> Shard(1), each rank reads half of both saved pieces: the two ranks
    hash each block once between them (half the bytes each), and the values are exact."""
    p = path("shared_checks")
    paddle_dcp.save_state_dict(c.build(RESHARD_SAVED, 0), p)
    real, hashed = checksums.checksum, []  # what every check of bytes hashes with (checksums.hashed)

    def counting(buf, seed=0):
        hashed.append(len(buf))
        return real(buf, seed)

    checksums.checksum = counting
    try:
        sd = c.build(RESHARD_TARGET, 0, target=True)
        paddle_dcp.load_state_dict(sd, p)
    finally:
        checksums.checksum = real
    c.check_state(sd, RESHARD_TARGET, 0, R)
    total = 256 * 256 * 4
    assert 0 < sum(hashed) <= total // 2, (sum(hashed), total)


def corrupted_byte_in_a_reshard():
    """A flipped byte that only one rank's share of the checks covers: every rank refuses the
    load and no rank's state dict changes."""
    p = path("shared_corrupted")
    paddle_dcp.save_state_dict(c.build(RESHARD_SAVED, 0), p)
    c.dist.barrier()
    if R == 0:
        with open(os.path.join(p, "1_0.distcp"), "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0x40]))
    c.dist.barrier()
    exc = load_fails(c.build(RESHARD_TARGET, 0, target=True), p, None, "IntegrityError", "1_0.distcp", "checksum")
    assert len(exc.failures) == 1, exc.failures  # one rank checked that block


FUTURE_VERSION = max(SUPPORTED_VERSIONS) + 1  # a newer writer's (version 3 is this one's)


def future_format_version():
    p = good_save("future")
    c.dist.barrier()
    if R == 0:
        meta = os.path.join(p, "0.metadata")
        with open(meta, "rb") as f:
            data = f.read()
        head = b'"format_version":%d,' % max(SUPPORTED_VERSIONS)
        assert head in data[:100], data[:100]
        with open(meta, "wb") as f:  # a newer writer's head line
            f.write(data.replace(head, b'"format_version":%d,' % FUTURE_VERSION, 1))
    c.dist.barrier()
    load_fails(target(), p, [0, 1], "FormatError", "format_version", str(FUTURE_VERSION))


def damaged_metadata():
    """A metadata file cut in half, then one that gives a tensor a negative dimension: every
    rank raises FormatError naming the file; nothing is loaded."""
    p = good_save("damaged")
    meta = os.path.join(p, "0.metadata")
    c.dist.barrier()
    with open(meta, "rb") as f:
        original = f.read()
    if R == 0:
        with open(meta, "wb") as f:
            f.write(original[: len(original) // 2])
    c.dist.barrier()
    load_fails(target(), p, [0, 1], "FormatError", "0.metadata")
    c.dist.barrier()
    if R == 0:
        doc = metadoc.read(original)
        entry = doc["tensors"]["w"] if isinstance(doc.get("tensors"), dict) else None
        assert entry is not None and "shape" in entry, sorted(doc)
        entry["shape"] = [-7, 5]
        with open(meta, "wb") as f:
            f.write(metadoc.write(doc))
    c.dist.barrier()
    load_fails(target(), p, [0, 1], "FormatError", "0.metadata", "tensor 'w'", "-7")


def data_file_missing():
    """A data file deleted: every rank needs the plain tensor p or a piece of w, b that only it
    holds; the ranks that need 1_0.distcp raise StorageError naming it, before any byte moves."""
    p = good_save("nofile")
    c.dist.barrier()
    if R == 0:
        os.remove(os.path.join(p, "1_0.distcp"))
    c.dist.barrier()
    exc = load_fails(target(), p, None, "StorageError", "1_0.distcp")
    assert 1 in exc.failures, exc.failures


def unknown_keys_are_left_alone():
    """With strict=False, keys the checkpoint lacks are not an error: they keep their values."""
    p = good_save("extra")
    extra = c.Leaf(("extra",), (3, 2), "float32", MESH, S0, index=9)
    sd = target(extra=extra.tensor(0, target=True), other=5)
    paddle_dcp.load_state_dict(sd, p, strict=False)
    c.check_state(sd, LEAVES, 0, R)
    assert sd["step"] == 3 and sd["other"] == 5, (sd["step"], sd["other"])
    assert sd["lrs"] == [0.1, 0.2] and sd["meta"] == {"name": "x", "flag": True}, (sd["lrs"], sd["meta"])
    c.check_tensor(sd["extra"], np.full((3, 2), -7, np.float32), "float32", MESH, S0, R, "extra")


def missing_keys_raise_on_every_rank():
    """Keys the checkpoint lacks (a dist tensor, a plain tensor, a plain value): a
    MismatchError on every rank naming them and the checkpoint, before any tensor changes."""
    p = good_save("missing")
    extra = c.Leaf(("extra",), (3, 2), "float32", MESH, S0, index=9)
    sd = target(extra=extra.tensor(0, target=True), solo=paddle.zeros([2]), other=5)
    exc = load_fails(sd, p, [0, 1], "MismatchError", "3 key(s)", "extra", "solo", "other", p, "strict=False")
    assert isinstance(exc, paddle_dcp.MismatchError), type(exc)


def missing_key_on_one_rank_raises_on_every_rank():
    """Only rank 1's state dict has a key the checkpoint lacks: every rank raises a
    MismatchError (rank 1's names the key), and no rank's state dict changes."""
    p = good_save("missing1")
    sd = target(**({"only_here": paddle.zeros([2])} if R == 1 else {}))
    exc = load_fails(sd, p, [1], "MismatchError", "only_here")
    assert isinstance(exc, paddle_dcp.MismatchError), type(exc)


def many_missing_keys_are_counted():
    """The error names the first 20 missing keys and counts them all."""
    p = good_save("missing_many")
    sd = target(**{f"gone{i:02d}": paddle.zeros([1]) for i in range(25)})
    exc = load_fails(sd, p, [0, 1], "25 key(s)", "gone19", "and 5 more")
    assert "gone20" not in str(exc), str(exc)


def plain_values_are_restored_whole():
    """Lists, tuples and dicts of plain values replace the target's, whatever their length or
    type there (an LR scheduler's milestones saved [3, 1, 4, 1.5], target []); containers
    that hold tensors still match element by element."""
    p = path("plain_whole")
    saved = {"sched": {"milestones": [3, 1, 4, 1.5], "gamma": (0.1, None)}, "hist": [], "cfg": {"a": [1, {"b": "x"}]},
             "mixed": [None, 7], **SAVED_VALUES}
    sd = c.build(LEAVES, 0, saved)
    sd["mixed"][0] = LEAVES[2].tensor(0)
    paddle_dcp.save_state_dict(sd, p)
    sd = target(sched={"milestones": []}, hist=[1, 2, 3], cfg=None, mixed=[LEAVES[2].tensor(0, target=True), 0])
    milestones = sd["sched"]  # a dict the caller may hold: filled in place
    paddle_dcp.load_state_dict(sd, p)
    assert sd["sched"] is milestones and sd["sched"] == {"milestones": [3, 1, 4, 1.5], "gamma": (0.1, None)}, sd["sched"]
    assert sd["hist"] == [] and sd["cfg"] == {"a": [1, {"b": "x"}]} and sd["mixed"][1] == 7, sd
    LEAVES[2].check(sd["mixed"][0], 0, R, "mixed.0")


def load_waits_for_this_process_async_save():
    """An async save followed at once by a load of the same directory loads the new
    checkpoint, not the one before it."""
    p = good_save("async_then_load")
    paddle_dcp.save_state_dict(c.build(LEAVES, 1, {**SAVED_VALUES, "step": 4}), p, async_save=True)
    sd = target()
    paddle_dcp.load_state_dict(sd, p)
    c.check_state(sd, LEAVES, 1, R)
    assert sd["step"] == 4, sd["step"]


# ------------------------------------------------------------------------------ save
def object_on_one_rank():
    p = path("object1")
    sd = c.build(LEAVES, 0, {"step": 3, "bad": object() if R == 1 else 1})
    expect(lambda: paddle_dcp.save_state_dict(sd, p), [1], "FormatError", "bad", "object")
    assert files(p) == [], files(p)
    # the failed save used no id: the next one is 0
    good_save("object1")
    assert files(p) == ["0.0.claim", "0.metadata", "0_0.distcp", "1_0.distcp"], files(p)


def object_on_coordinator():
    p = path("object0")
    sd = c.build(LEAVES, 0, {"step": 3, "opt": {"state": object() if R == 0 else 1}})
    expect(lambda: paddle_dcp.save_state_dict(sd, p), [0], "FormatError", "opt.state", "object")
    assert not [f for f in files(p) if f.endswith(".metadata")], files(p)


def write_fails_on_one_rank():
    """A rank whose write fails mid-save: every rank raises, no metadata, no temporary file."""
    p = path("write")
    original = datafile.DataFileWriter.write

    def broken(self, data, *args, **kwargs):
        raise paddle_dcp.StorageError(f"cannot write {self.stream.tmp}: injected failure", self.stream.tmp)

    if R == 1:
        datafile.DataFileWriter.write = broken
    try:
        expect(lambda: paddle_dcp.save_state_dict(c.build(LEAVES, 0), p), [1], "StorageError", "injected failure")
    finally:
        datafile.DataFileWriter.write = original
    c.dist.barrier()
    names = files(p)
    assert not [f for f in names if f.endswith(".metadata")], names
    assert not [f for f in names if storage.TMP_MARK in f], names
    assert "1_0.distcp" not in names, names
    # the directory is still usable: a good save gets id 0 and loads
    good_save("write")
    sd = target()
    paddle_dcp.load_state_dict(sd, p)
    c.check_state(sd, LEAVES, 0, R)


def async_save_completes(leaves, name):
    """async_save=True (no longer refused: it writes in the background): once waited for,
    the checkpoint is complete (metadata last) and loads like a synchronous one."""
    p = path(name)
    handle = paddle_dcp.save_state_dict(c.build(leaves, 0, dict(SAVED_VALUES)), p, async_save=True)
    assert isinstance(handle, paddle_dcp.AsyncSave), handle
    assert handle.wait(timeout=60) == 0
    c.dist.barrier()
    assert files(p) == ["0.0.claim", "0.metadata", "0_0.distcp", "1_0.distcp"], files(p)
    sd = c.build(leaves, 0, {k: copy.deepcopy(v) for k, v in BLANK_VALUES.items()}, target=True)
    paddle_dcp.load_state_dict(sd, p)
    c.check_state(sd, leaves, 0, R)
    assert sd["step"] == 3 and sd["lrs"] == [0.1, 0.2], (sd["step"], sd["lrs"])


CASES = {
    "missing_keys_raise_on_every_rank": missing_keys_raise_on_every_rank,
    "missing_key_on_one_rank_raises_on_every_rank": missing_key_on_one_rank_raises_on_every_rank,
    "many_missing_keys_are_counted": many_missing_keys_are_counted,
    "plain_values_are_restored_whole": plain_values_are_restored_whole,
    "load_waits_for_this_process_async_save": load_waits_for_this_process_async_save,
    "shape_mismatch": shape_mismatch,
    "dtype_mismatch": dtype_mismatch,
    "mismatch_on_one_rank": mismatch_on_one_rank,
    "tensor_where_value_was_saved": tensor_where_value_was_saved,
    "empty_directory": empty_directory,
    "missing_directory": missing_directory,
    "missing_unique_id": missing_unique_id,
    "bad_unique_id": bad_unique_id,
    "truncated_shard": truncated_shard,
    "corrupted_byte": corrupted_byte,
    "checks_shared_in_a_reshard": checks_shared_in_a_reshard,
    "corrupted_byte_in_a_reshard": corrupted_byte_in_a_reshard,
    "future_format_version": future_format_version,
    "damaged_metadata": damaged_metadata,
    "data_file_missing": data_file_missing,
    "unknown_keys_are_left_alone": unknown_keys_are_left_alone,
    "object_on_one_rank": object_on_one_rank,
    "object_on_coordinator": object_on_coordinator,
    "write_fails_on_one_rank": write_fails_on_one_rank,
    "async_save_without_bfloat16": lambda: async_save_completes([lf for lf in LEAVES if lf.dtype != "bfloat16"], "async"),
}
if "async_save_bfloat16" in sys.argv[2:]:  # a known bug (known_bugs.ASYNC_BF16_BUG): run only when asked
    CASES["async_save_bfloat16"] = lambda: async_save_completes(LEAVES, "async_bf16")

c.run_cases(CASES, sys.argv[2:])
