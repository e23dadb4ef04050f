"""core.sorting.lexsort gives numpy's lexsort permutation, whatever the columns' ranges."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from paddle_dcp.core import sorting

BOUNDS = [(0, 1), (0, 7), (-5, 5), (0, 2**20), (0, 2**40), (-(2**62), 2**62), (-(2**63), 2**63 - 1)]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_equals_numpys_lexsort(data):
    n = data.draw(st.integers(0, 60))
    ncols = data.draw(st.integers(1, 6))
    keys = []
    for _ in range(ncols):
        lo, hi = data.draw(st.sampled_from(BOUNDS))
        keys.append(np.array(data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), dtype=np.int64))
    assert np.array_equal(sorting.lexsort(keys), np.lexsort(keys))


@pytest.mark.parametrize("ncols,bits", [(2, 20), (6, 17), (9, 30)])
def test_equals_numpys_lexsort_on_many_rows_with_ties(ncols, bits):
    rng = np.random.default_rng(ncols)
    keys = [rng.integers(0, 1 << rng.integers(1, bits), size=20_000) for _ in range(ncols)]
    assert np.array_equal(sorting.lexsort(keys), np.lexsort(keys))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_groups_mark_where_the_sorted_rows_change(data):
    n = data.draw(st.integers(0, 60))
    keys = []
    for _ in range(data.draw(st.integers(1, 4))):
        lo, hi = data.draw(st.sampled_from(BOUNDS + [(0, 2)]))
        keys.append(np.array(data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), dtype=np.int64))
    order, new = sorting.groups(keys)
    assert np.array_equal(order, np.lexsort(keys))
    rows = [tuple(int(k[i]) for k in keys) for i in order.tolist()]
    assert new.tolist() == [i == 0 or rows[i] != rows[i - 1] for i in range(n)]
