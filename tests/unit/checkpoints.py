"""A small two-rank checkpoint and the tools the reliability tests damage it with: its
arrays, a target full of a sentinel, loads expected to fail, the metadata document read and
written by hand, a byte flipped, fsyncs and renames recorded."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp.core.metadata import with_digest
from paddle_dcp.errors import DcpError

from .helpers import save_checkpoint

# ------------------------------------------------------------------ a two-file checkpoint
# w (8 x 5 float32) and b (600 int64) both split in two row halves over 2 ranks: two data files
# of equal size (so that swapping them is caught by the checksums, not by the sizes), 64-byte
# checksum blocks (many blocks per piece; b's checksum column is long enough to be packed).
W = np.arange(40, dtype=np.float32).reshape(8, 5) * 1.5 - 7
B = np.arange(600, dtype=np.int64) * 3 - 1000
SENTINEL = -7
STEP = 3


def two_rank_checkpoint(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    save_checkpoint(path, {"w": W, "b": B}, {"w": "float32", "b": "int64"}, (2,), {"w": (0,), "b": (0,)},
                    block_bytes=64, values={"step": STEP})  # fmt: skip
    return path


def target() -> dict:
    return {"model": {"w": np.full(W.shape, SENTINEL, W.dtype), "b": np.full(B.shape, SENTINEL, B.dtype)}, "step": 0}


def assert_loaded(sd: dict, w=W, b=B, step=STEP) -> None:
    assert sd["model"]["w"].tobytes() == w.tobytes(), sd["model"]["w"]
    assert sd["model"]["b"].tobytes() == b.tobytes(), sd["model"]["b"]
    assert sd["step"] == step, sd["step"]


def assert_untouched(sd: dict) -> None:
    assert_loaded(sd, np.full(W.shape, SENTINEL, W.dtype), np.full(B.shape, SENTINEL, B.dtype), 0)


def load_fails(path: str, kind, *needles, **kwargs) -> DcpError:
    """load_state_dict raises ``kind`` whose message holds every needle, and the state dict
    is left exactly as it was."""
    sd = target()
    with pytest.raises(kind) as info:
        paddle_dcp.load_state_dict(sd, path, **kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    assert_untouched(sd)
    return info.value


def read_doc(path: str, uid: int = 0) -> dict:
    with open(os.path.join(path, f"{uid}.metadata")) as f:
        return json.load(f)


def write_doc(path: str, doc, uid: int = 0, digest: bool = True) -> None:
    """Write a metadata document; a dict gets a matching digest (as a writer that means the
    edit would write it), so each test reaches the check it is about; raw text is written as is."""
    if isinstance(doc, dict):
        body = {k: v for k, v in doc.items() if k != "digest"}
        text = json.dumps(body, separators=(",", ":"))
        data = with_digest(text.encode()) if digest else json.dumps(doc)
    else:
        data = doc
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(os.path.join(path, f"{uid}.metadata"), mode) as f:
        f.write(data)


def flip(name: str, at: int, bit: int = 0) -> None:
    with open(name, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << bit)]))


def piece_of(path: str, key: str, index: int) -> tuple[str, int]:
    """(data file name, byte offset) of piece ``index`` of ``key``, from the metadata."""
    doc = read_doc(path)
    t = doc["tensors"][key]
    return doc["files"][t["file"][index]]["name"], t["byte_offset"][index]


# ------------------------------------------------------------------ single-process saves
def sd_of(variant: int) -> dict:
    return {"model": {"w": W + 100 * variant, "b": B + 100 * variant}, "step": variant}


def load_values(path: str, unique_id=None) -> dict:
    sd = target()
    paddle_dcp.load_state_dict(sd, path, unique_id=unique_id)
    return sd


def assert_variant(sd: dict, variant: int) -> None:
    assert_loaded(sd, W + 100 * variant, B + 100 * variant, variant)


def fsync_log(monkeypatch, events, path):
    real_fsync, real_replace = os.fsync, os.replace

    def rec_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rec_replace(src, dst, *args, **kwargs):
        events.append(("rename", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", rec_fsync)
    monkeypatch.setattr(os, "replace", rec_replace)
