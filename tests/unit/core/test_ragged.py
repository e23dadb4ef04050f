"""core.ragged: the positions and indices of runs of given lengths, against Python loops."""
import numpy as np
from hypothesis import given, settings, strategies as st

from paddle_dcp.core import ragged


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 6)), max_size=20))
def test_positions_and_indices_of_runs(runs):
    starts = np.array([s for s, _ in runs], dtype=np.int64)
    counts = np.array([n for _, n in runs], dtype=np.int64)
    assert ragged.positions(counts).tolist() == [i for _, n in runs for i in range(n)]
    assert ragged.indices(starts, counts).tolist() == [s + i for s, n in runs for i in range(n)]
    assert ragged.indices(starts, counts).dtype == np.int64
