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
        key = np.array(data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), dtype=np.int64)
        if -(2**31) <= lo and hi < 2**31 and data.draw(st.booleans()):
            key = key.astype(np.int32)  # a coordinator's table of box values may be int32
        keys.append(key)
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


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_groups_with_dependent_keys_equal_the_full_sort(data):
    n = data.draw(st.integers(0, 60))
    others = [np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=np.int64)
              for _ in range(data.draw(st.integers(1, 3)))]
    follows = data.draw(st.booleans())  # the dependent keys a function of the others, or drawn freely
    dependent = [(others[0] * 7 + 1) if follows else
                 np.array(data.draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n)), dtype=np.int64)
                 for _ in range(data.draw(st.integers(1, 2)))]
    keys = dependent + others
    order, new = sorting.groups(keys, dependent=len(dependent))
    want_order, want_new = sorting.groups(keys)
    assert np.array_equal(order, np.lexsort(keys))
    assert np.array_equal(new, want_new)


def test_groups_sort_once_when_the_dependent_keys_follow(monkeypatch):
    rng = np.random.default_rng(0)
    key, offset = rng.integers(0, 50, 5000), rng.integers(0, 40, 5000)  # many rows alike
    shape = offset * 3 + key  # decided by the others
    packed = []
    real = sorting._packed
    monkeypatch.setattr(sorting, "_packed", lambda keys: packed.append(len(keys)) or real(keys))
    order, _ = sorting.groups([shape, offset, key], dependent=1)
    assert packed == [2] and np.array_equal(order, np.lexsort([shape, offset, key]))
    packed.clear()
    shape[order[np.flatnonzero(np.diff(key[order] * 64 + offset[order]) == 0)[0]]] += 1  # one row of a group
    order, new = sorting.groups([shape, offset, key], dependent=1)
    assert packed == [2, 3]  # not decided after all: sorted again by every key
    assert np.array_equal(order, np.lexsort([shape, offset, key]))
    assert np.array_equal(new, sorting.groups([shape, offset, key])[1])


def test_groups_of_columns_past_int64_beside_int64_ones_keep_every_value_exact():
    """Such columns are compared one by one, each in its own dtype: 2**63 + 1 and 2**63 + 2
    are two groups (in float64, one buffer for both dtypes would make them one)."""
    big = np.array([2**63 + 2, 2**63 + 1, 2**63 + 1, 2**63 + 2], dtype=np.uint64)
    small = np.array([0, 0, 0, 0], dtype=np.int64)
    order, new = sorting.groups([small, big])
    assert order.tolist() == [1, 2, 0, 3] and new.tolist() == [True, False, True, False]
