"""What paddle_dcp keeps between calls (parallel/state.py) is one object, and reset() empties it."""
import numpy as np

from paddle_dcp.parallel.state import STATE, ProcessState


def test_reset_forgets_plans_and_traffic_and_frees_staging():
    state = ProcessState()
    state.save_plans[("k",)] = {"digest": b"x"}
    state.traffic["save"] = object()
    state.staging.buf = np.empty(4000, np.uint8)  # what an async save staged into
    state.reset()
    assert state.save_plans == {} and state.traffic == {} and state.staging.buf.nbytes == 0 and len(state.groups) == 0


def test_the_process_has_one():
    import paddle_dcp

    assert paddle_dcp.process_state() is STATE
