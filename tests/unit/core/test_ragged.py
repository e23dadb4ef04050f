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


def test_joined_takes_consecutive_rows_of_one_array_as_they_are():
    table = np.arange(30, dtype=np.int64).reshape(10, 3)
    parts = [table[0:2], table[2:2], table[2:7], table[7:10]]
    got = ragged.joined(parts)
    assert np.shares_memory(got, table) and np.array_equal(got, table)
    assert np.array_equal(ragged.joined(parts[1:]), table[2:])


def test_joined_copies_what_is_not_end_to_end():
    table = np.arange(30, dtype=np.int64).reshape(10, 3)
    for parts in ([table[0:2], table[3:5]], [table[2:4], table[0:2]], [table[0:2], np.ones((2, 3), np.int64)], [table[::2]]):
        got = ragged.joined(parts)
        assert np.array_equal(got, np.concatenate(parts)) and not np.shares_memory(got, table)
