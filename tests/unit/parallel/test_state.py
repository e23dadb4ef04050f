"""What paddle_dcp keeps between calls (parallel/state.py): reset() empties it, and what the
caller sees through paddle_dcp.process_state() is what paddle_dcp.close() releases."""
import numpy as np

from paddle_dcp.parallel.state import ProcessState


def test_reset_forgets_plans_and_traffic_and_frees_staging():
    state = ProcessState()
    state.save_plans[("k",)] = {"digest": b"x"}
    state.traffic["save"] = object()
    state.staging.buf = np.empty(4000, np.uint8)  # what an async save staged into
    state.reset()
    assert state.save_plans == {} and state.traffic == {} and state.staging.buf.nbytes == 0 and len(state.groups) == 0


def test_close_releases_what_the_caller_sees():
    import paddle_dcp

    seen = paddle_dcp.process_state()
    seen.save_plans[("layout",)] = {"digest": b"x"}  # as a save leaves it
    seen.traffic["load"] = object()
    paddle_dcp.close()
    assert paddle_dcp.process_state().save_plans == {} and paddle_dcp.process_state().traffic == {}
