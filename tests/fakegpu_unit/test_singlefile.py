"""The single-file load (paddle_dcp/singlefile.py) into tensors on the fake GPU: every value
against numpy, filled in place, and never more host buffers alive at once than one batch
(the whole share's host copies at once was a regression of issue 28)."""
import weakref

import numpy as np
import paddle
import pytest

import paddle_dcp
from fakegpu import ACCOUNT
from paddle_dcp import singlefile
from paddle_dcp.parallel import device
from paddle_dcp.parallel.targets import host_batches

SHAPES = [(64, 32), (16,), (128, 16), (8, 8, 8), (32, 32), (300,)]  # float32: 8 KiB, 64 B, 8 KiB, 2 KiB, 4 KiB, 1.2 KiB


def value(i: int, shape) -> np.ndarray:
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1000 * i)


class HostBuffers:
    """The host arrays the load's TargetBuffers allocate (those that are not the tensor's own
    memory): bytes alive now and at most."""

    def __init__(self, monkeypatch):
        self.alive = self.peak = 0
        original = device.TargetBuffer.__init__

        def init(buffer, tensor, offload=False):
            original(buffer, tensor, offload)
            if not buffer.in_place:
                self.alive += buffer.array.nbytes
                self.peak = max(self.peak, self.alive)
                weakref.finalize(buffer.array, self._freed, buffer.array.nbytes)

        monkeypatch.setattr(device.TargetBuffer, "__init__", init)

    def _freed(self, nbytes: int) -> None:
        self.alive -= nbytes


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "model.safetensors")
    paddle_dcp.save_gathered({f"t{i}": value(i, s) for i, s in enumerate(SHAPES)} | {"step": 7}, path)
    return path


@pytest.mark.parametrize("limit, batches", [(10_000, 3), (1 << 30, 1)])  # 10 000: [8256], [8192], [7344] bytes
def test_device_targets_load_a_batch_of_host_buffers_at_a_time(saved, monkeypatch, limit, batches):
    targets = {f"t{i}": paddle.zeros(list(s), dtype="float32") for i, s in enumerate(SHAPES)}
    assert all(t.place.is_gpu_place() for t in targets.values())
    before = {k: t for k, t in targets.items()}
    state = dict(targets, step=0)
    held_sizes = [int(np.prod(s)) * 4 for s in SHAPES]
    assert len(host_batches(_held(state), limit)) == batches
    host = HostBuffers(monkeypatch)
    ACCOUNT.reset()
    singlefile.load_file(state, saved, host_batch_bytes=limit)
    for i, s in enumerate(SHAPES):
        assert state[f"t{i}"] is before[f"t{i}"] and state[f"t{i}"].place.is_gpu_place()  # in place
        np.testing.assert_array_equal(state[f"t{i}"].numpy(), value(i, s))
    assert state["step"] == 7  # the plain value, set once, by the last batch
    if batches == 1:
        assert host.peak == sum(held_sizes)
    else:  # one batch's buffers at a time: under the limit, or one larger tensor alone
        assert host.peak <= max(limit, max(held_sizes)) < sum(held_sizes)
    assert host.alive == 0 and ACCOUNT.peak["gpu"] == 0  # every buffer freed; no device copy of a tensor made


def test_host_targets_need_no_batches(saved):
    arrays = {f"t{i}": np.zeros(s, np.float32) for i, s in enumerate(SHAPES)}
    assert len(host_batches(_held(arrays), 1)) == 1
    singlefile.load_file(arrays, saved, host_batch_bytes=1)
    for i, s in enumerate(SHAPES):
        np.testing.assert_array_equal(arrays[f"t{i}"], value(i, s))


def test_a_strict_load_of_a_missing_key_fails_before_any_batch(saved):
    state = {"t0": paddle.zeros(list(SHAPES[0])), "absent": paddle.zeros([2])}
    with pytest.raises(paddle_dcp.MismatchError, match="absent"):
        singlefile.load_file(state, saved, host_batch_bytes=1)
    assert float(state["t0"].abs().sum()) == 0.0  # nothing changed


def _held(state: dict) -> list:
    from paddle_dcp.core import nested
    from paddle_dcp.parallel.placements import describe, is_tensor

    flat = nested.flatten(state, is_tensor)
    return [describe(k, v, 0, flat_ok=True) for k, v in flat.tensors.items()]
