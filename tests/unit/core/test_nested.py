"""Nested state dicts <-> flat keys and the JSON skeleton (numpy arrays stand in for tensors)."""
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paddle_dcp.core import nested
from paddle_dcp.errors import FormatError, MismatchError, StateDictError

from ..helpers import fast, is_tensor

A, B, C = np.zeros(2), np.ones((2, 2)), np.arange(3)


def flatten(sd, keep_values=True):
    return nested.flatten(sd, is_tensor, keep_values=keep_values)


# ------------------------------------------------------------------ flatten
def test_flatten_joins_paths_with_dots_and_records_the_skeleton():
    sd = {
        "model": {"w": A, "b": B},
        "opt": {"lr": 0.1, "m": [C, (A, 5)]},
        "step": 3,
        "name": "run",
        "none": None,
        "flag": True,
    }
    flat = flatten(sd)
    assert list(flat.tensors) == ["model.w", "model.b", "opt.m.0", "opt.m.1.0"]
    assert flat.tensors["opt.m.1.0"] is A
    assert flat.values == {"opt.lr": 0.1, "opt.m.1.1": 5, "step": 3, "name": "run", "none": None, "flag": True}
    assert flat.paths["opt.m.1.0"] == ("opt", "m", 1, 0)
    assert flat.skeleton == {
        "d": [
            ["model", {"d": [["w", {"t": 0}], ["b", {"t": 0}]]}],
            ["opt", {"d": [["lr", {"v": 0.1}], ["m", {"l": [{"t": 0}, {"u": [{"t": 0}, {"v": 5}]}]}]]}],
            ["step", {"v": 3}],
            ["name", {"v": "run"}],
            ["none", {"v": None}],
            ["flag", {"v": True}],
        ]
    }
    assert nested.tensor_keys(flat.skeleton) == list(flat.tensors)
    assert nested.values_of(flat.skeleton) == flat.values


def test_flatten_without_values_leaves_placeholders():
    flat = flatten({"w": A, "step": 3, "l": [1.5]}, keep_values=False)
    assert flat.skeleton == {"d": [["w", {"t": 0}], ["step", {"x": 0}], ["l", {"l": [{"x": 0}]}]]}
    assert flat.values == {"step": 3, "l.0": 1.5}  # still known locally


def test_flatten_turns_numpy_scalars_into_python_values():
    flat = flatten({"a": np.float32(1.5), "b": np.int64(7), "c": np.bool_(True)})
    assert flat.values == {"a": 1.5, "b": 7, "c": True}
    assert [type(flat.values[k]) for k in "abc"] == [float, int, bool]
    json.dumps(flat.skeleton, allow_nan=False)


def test_flatten_of_empty_containers():
    flat = flatten({"a": {}, "b": [], "c": ()})
    assert flat.tensors == {} and flat.values == {}
    assert flat.skeleton == {"d": [["a", {"d": []}], ["b", {"l": []}], ["c", {"u": []}]]}


@pytest.mark.parametrize(
    "sd, words",
    [
        ({1: A}, ["<root>", "1", "int"]),
        ({"model": {("a",): A}}, ["model", "('a',)", "tuple"]),
        ({"model": {"opt": [{None: 1}]}}, ["model.opt.0", "None"]),
    ],
)
def test_flatten_refuses_non_str_keys_naming_where(sd, words):
    with pytest.raises(FormatError) as info:
        flatten(sd)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("leaf", [object(), {1, 2}, b"bytes", 1j, np.zeros(2).tolist, frozenset()])
def test_flatten_refuses_leaves_that_are_neither_tensors_nor_plain_values(leaf):
    with pytest.raises(FormatError, match=r"model\.bad"):
        flatten({"model": {"ok": 1, "bad": leaf}})


@pytest.mark.parametrize("leaf", [np.complex64(1 + 2j), np.bytes_(b"ab"), np.datetime64("2020-01-01")])
def test_flatten_refuses_numpy_scalars_json_cannot_hold(leaf):
    with pytest.raises(FormatError, match=r"model\.bad"):
        flatten({"model": {"bad": leaf}})


@pytest.mark.parametrize(
    "sd, key",
    [
        ({"a.b": A, "a": {"b": B}}, "a.b"),
        ({"a": [A], "a.0": 3}, "a.0"),
        ({"a": {"b.c": 1}, "a.b": {"c": 2}}, "a.b.c"),
    ],
)
def test_flatten_refuses_two_paths_with_the_same_flat_key(sd, key):
    with pytest.raises(FormatError, match="same key") as info:
        flatten(sd)
    assert repr(key) in str(info.value)


def test_flatten_refuses_a_root_that_is_not_a_dict():
    with pytest.raises(FormatError):
        flatten([A])


@pytest.mark.parametrize("x, node", [(math.nan, {"f": "nan"}), (math.inf, {"f": "inf"}), (-math.inf, {"f": "-inf"})])
def test_non_finite_floats_encode_and_decode(x, node):
    assert nested.encode_value(x) == node
    back = nested.decode_value(json.loads(json.dumps(node, allow_nan=False)), "k")
    assert (math.isnan(back) and math.isnan(x)) or back == x
    flat = flatten({"k": x, "l": [np.float64(x)]})
    json.dumps(flat.skeleton, allow_nan=False)  # JSON proper: no NaN tokens
    values = nested.values_of(json.loads(json.dumps(flat.skeleton)))
    assert math.isnan(values["k"]) if math.isnan(x) else values["k"] == x


# ------------------------------------------------------------------ hypothesis: any tree
plain = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=4)
)
names = st.text(alphabet="ab0._", min_size=1, max_size=3)  # dots and digits: collisions happen
trees = st.recursive(
    st.one_of(plain, st.just("TENSOR")),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(names, kids, max_size=3),
    ),
    max_leaves=12,
)


def with_tensors(tree, counter=[0]):
    if tree == "TENSOR":
        counter[0] += 1
        return np.full(1, counter[0])
    if isinstance(tree, dict):
        return {k: with_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(with_tensors(v) for v in tree)
    return tree


def leaves(tree, path=()):
    """(path, leaf) of every leaf, depth first: the oracle for flatten."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, path + (i,))
    else:
        yield path, tree


def same_value(a, b):
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or (
        a == b and type(a) is type(b)
    )


@fast(200)
@given(st.dictionaries(names, trees, max_size=4))
def test_flatten_of_any_tree_matches_its_leaves(tree):
    sd = with_tensors(tree)
    expected = list(leaves(sd))
    keys = [".".join(map(str, p)) for p, _ in expected]
    if len(set(keys)) != len(keys):
        with pytest.raises(FormatError, match="same key"):
            flatten(sd)
        return
    flat = flatten(sd)
    want_tensors = {k: leaf for k, (p, leaf) in zip(keys, expected) if isinstance(leaf, np.ndarray)}
    assert list(flat.tensors) == list(want_tensors)
    assert all(flat.tensors[k] is v for k, v in want_tensors.items())
    want_values = {k: leaf for k, (p, leaf) in zip(keys, expected) if not isinstance(leaf, np.ndarray)}
    assert list(flat.values) == list(want_values)
    assert all(same_value(flat.values[k], v) for k, v in want_values.items())
    assert {k: flat.paths[k] for k in keys} == {k: p for k, (p, _) in zip(keys, expected)}
    # the skeleton is strict JSON and gives back the same keys and values
    skeleton = json.loads(json.dumps(flat.skeleton, allow_nan=False))
    assert nested.tensor_keys(skeleton) == list(want_tensors)
    back = nested.values_of(skeleton)
    assert list(back) == list(want_values)
    assert all(same_value(back[k], v) for k, v in want_values.items())


# ------------------------------------------------------------------ merge
T, X = {"t": 0}, {"x": 0}


def test_merge_is_a_union_in_order():
    base = {"d": [["a", T], ["s", X], ["o", {"d": [["m", T]]}]]}
    other = {"d": [["s", {"v": 3}], ["b", T], ["o", {"d": [["v", T]]}]]}
    assert nested.merge(base, other) == {
        "d": [["a", T], ["s", {"v": 3}], ["o", {"d": [["m", T], ["v", T]]}], ["b", T]]
    }


def test_merge_value_beats_placeholder_and_base_wins_between_values():
    assert nested.merge(X, {"v": 1}) == {"v": 1}
    assert nested.merge({"v": 1}, X) == {"v": 1}
    assert nested.merge({"f": "nan"}, X) == {"f": "nan"}
    assert nested.merge({"v": 1}, {"v": 2}) == {"v": 1}
    assert nested.merge(X, X) == X


def test_merge_of_lists_of_different_lengths_keeps_the_longer_tail():
    assert nested.merge({"l": [X]}, {"l": [{"v": 1}, T]}) == {"l": [{"v": 1}, T]}
    assert nested.merge({"u": [T, {"v": 2}]}, {"u": [T]}) == {"u": [T, {"v": 2}]}


@pytest.mark.parametrize(
    "base, other",
    [
        ({"d": [["w", T]]}, {"d": [["w", {"v": 1}]]}),
        ({"d": [["w", {"v": 1}]]}, {"d": [["w", T]]}),
        ({"d": [["w", X]]}, {"d": [["w", T]]}),
        ({"d": [["w", {"l": []}]]}, {"d": [["w", {"u": []}]]}),
        ({"d": [["w", {"d": []}]]}, {"d": [["w", T]]}),
    ],
)
def test_merge_refuses_a_tensor_against_anything_else(base, other):
    with pytest.raises(FormatError, match="w") as info:
        nested.merge(base, other)
    assert "disagree" in str(info.value)


# ------------------------------------------------------------------ fill_values
def test_fill_values_fills_placeholders_and_reports_those_without_value():
    skeleton = {"d": [["w", T], ["step", X], ["gone", X], ["o", {"d": [["lr", X], ["x", X]]}], ["l", {"l": [X, X]}]]}
    filled, dropped = nested.fill_values(skeleton, {"step": 3, "o.lr": math.inf, "l.0": "a"})
    assert filled == {
        "d": [["w", T], ["step", {"v": 3}], ["o", {"d": [["lr", {"f": "inf"}]]}], ["l", {"l": [{"v": "a"}, {"v": None}]}]]
    }
    assert sorted(dropped) == ["gone", "l.1", "o.x"]
    assert nested.fill_values({"d": []}, {}) == ({"d": []}, [])


# ------------------------------------------------------------------ set_values
def test_set_values_writes_into_dicts_lists_and_tuples():
    inner_list = [1, 2]
    sd = {"a": {"lr": 0.1}, "l": inner_list, "t": (1, (2, 3)), "w": A, "lt": [(0, 0)], "keep": "x"}
    flat = flatten(sd)
    written = nested.set_values(sd, flat, {"a.lr": 0.5, "l.1": 9, "t.1.0": 7, "lt.0.1": 4, "w": 1, "nope": 2})
    assert sorted(written) == ["a.lr", "l.1", "lt.0.1", "t.1.0"]
    assert sd["a"]["lr"] == 0.5
    assert sd["l"] is inner_list and inner_list == [1, 9]  # in place
    assert sd["t"] == (1, (7, 3)) and isinstance(sd["t"][1], tuple)  # tuples rebuilt
    assert sd["lt"] == [(0, 4)]
    assert sd["w"] is A and sd["keep"] == "x"


def test_set_tensor_replaces_a_leaf_and_refuses_the_root():
    sd = {"m": {"w": A}, "t": (A, B)}
    nested.set_tensor(sd, ("m", "w"), C)
    nested.set_tensor(sd, ("t", 1), C)
    assert sd["m"]["w"] is C and sd["t"][1] is C and sd["t"][0] is A
    with pytest.raises(MismatchError):
        nested.set_tensor(sd, (), C)


# ------------------------------------------------------------------ walk
@pytest.mark.parametrize(
    "skeleton",
    [{"q": 1}, {"d": "x"}, {"d": [["a"]]}, {"d": [[1, T]]}, {"l": 3}, {"u": {"a": 1}}, [], {"t": 0, "v": 1}, "t"],
)
def test_walk_refuses_malformed_skeletons(skeleton):
    with pytest.raises(FormatError):
        list(nested.walk(skeleton))


@pytest.mark.parametrize("node", [{"v": [1]}, {"v": {"a": 1}}, {"f": "NaN"}, {"f": 1}])
def test_decode_value_refuses_malformed_values(node):
    with pytest.raises(FormatError, match="key"):
        nested.decode_value(node, "key")


# ------------------------------------------------------------------ plain subtrees
def _skeleton(sd):
    return nested.flatten(sd, lambda v: isinstance(v, np.ndarray)).skeleton


def test_plain_subtrees_are_the_largest_ones_without_tensors():
    t = np.zeros(1)
    sk = _skeleton({"m": {"w": t, "cfg": {"a": [1, 2]}}, "sched": {"milestones": [3, 1]}, "opt": [t, 5, (None,)], "e": []})
    got = {path: nested.decode(node, path) for path, node in nested.plain_subtrees(sk)}
    assert got == {("m", "cfg"): {"a": [1, 2]}, ("sched",): {"milestones": [3, 1]}, ("opt", 1): 5, ("opt", 2): (None,), ("e",): []}


def test_a_state_dict_without_tensors_is_matched_below_its_root():
    sk = _skeleton({"a": 1, "b": [2.0, float("inf")]})
    got = {path: nested.decode(node, path) for path, node in nested.plain_subtrees(sk)}
    assert got == {("a",): 1, ("b",): [2.0, float("inf")]}


def test_node_paths_say_which_nodes_hold_a_tensor():
    sk = _skeleton({"m": {"w": np.zeros(1), "n": 3}, "l": []})
    assert nested.node_paths(sk) == {(): True, ("m",): True, ("m", "w"): True, ("m", "n"): False, ("l",): False}


def test_assign_subtree_updates_dicts_and_lists_in_place_and_rebuilds_tuples():
    sched, hist = {"milestones": [], "old": 1}, [9, 9, 9]
    sd = {"sched": sched, "hist": hist, "t": (0, [1]), "n": None}
    nested.assign_subtree(sd, ("sched",), {"d": [["milestones", {"l": [{"v": 3}, {"v": 1.5}]}]]})
    nested.assign_subtree(sd, ("hist",), {"l": []})
    nested.assign_subtree(sd, ("t", 0), {"u": [{"v": 1}, {"v": "x"}]})
    nested.assign_subtree(sd, ("n",), {"d": [["k", {"f": "nan"}]]})
    assert sd["sched"] is sched and sched == {"milestones": [3, 1.5]}
    assert sd["hist"] is hist and hist == []
    assert sd["t"] == ((1, "x"), [1]) and math.isnan(sd["n"]["k"])


def test_decode_refuses_a_tensor_leaf():
    with pytest.raises(FormatError, match="plain value"):
        nested.decode({"l": [{"t": 0}]})


@pytest.mark.parametrize(
    "state_dict, needle",
    [({"a": {"bad": object()}}, "a.bad"), ({"a": {3: 1}}, "key 3"), ({"a.b": 1, "a": {"b": 2}}, "same key")],
)
def test_a_state_dict_flatten_cannot_take_is_a_state_dict_error(state_dict, needle):
    with pytest.raises(StateDictError, match=needle) as info:
        nested.flatten(state_dict, lambda v: False)
    assert isinstance(info.value, MismatchError) and isinstance(info.value, FormatError)


def test_json_plain_names_non_finite_floats_and_keeps_every_other_value():
    assert [nested.json_plain(v) for v in (math.nan, math.inf, -math.inf)] == ["nan", "inf", "-inf"]
    for v in (1.5, 0, None, "nan", True):
        assert nested.json_plain(v) is v
    assert nested.encode_value(-math.inf) == {"f": "-inf"} and nested.encode_value("inf") == {"v": "inf"}


# ------------------------------------------------------------------ union of many skeletons
def _reference_merge(base, other, path=()):
    """The pairwise merge as docs/architecture.md states it, written here plainly."""
    tb, to = nested.kind(base), nested.kind(other)
    if tb in ("v", "f", "x") and to in ("v", "f", "x"):
        return other if tb == "x" else base
    if tb != to:
        raise FormatError("kinds differ")
    if tb == "t":
        return base
    if tb == "d":
        items = [list(i) for i in base["d"]]
        at = {k: i for i, (k, _) in enumerate(items)}
        for k, node in other["d"]:
            if k in at:
                items[at[k]][1] = _reference_merge(items[at[k]][1], node, path + (k,))
            else:
                at[k] = len(items)
                items.append([k, node])
        return {"d": items}
    a, b = base[tb], other[tb]
    merged = [_reference_merge(x, y) for x, y in zip(a, b)]
    return {tb: merged + list((a if len(a) >= len(b) else b)[len(merged):])}


@st.composite
def _skeletons(draw, depth=0):
    leaf = st.sampled_from([T, X, {"v": 1}, {"v": 2}])
    if depth > 2:
        return draw(leaf)
    choice = draw(st.integers(0, 9))
    if choice < 3:
        return draw(leaf)
    if choice < 8:
        names = draw(st.lists(st.sampled_from("abcd"), max_size=4, unique=True))
        return {"d": [[n, draw(_skeletons(depth + 1))] for n in names]}
    return {draw(st.sampled_from("lu")): [draw(_skeletons(depth + 1)) for _ in range(draw(st.integers(0, 3)))]}


@settings(max_examples=400, deadline=None)
@given(st.lists(_skeletons(), min_size=1, max_size=4))
def test_the_union_of_many_skeletons_is_the_pairwise_merge_folded(skeletons):
    try:
        want = skeletons[0]
        for other in skeletons[1:]:
            want = _reference_merge(want, other)
    except FormatError:
        want = None
    union = nested.SkeletonUnion()
    try:
        for sk in skeletons:
            outline, keys = nested.runs_of(sk)
            assert keys == nested.tensor_keys(sk)
            assert nested.from_runs(outline, keys) == sk
            union.add(outline, keys)
        got = union.result()
    except FormatError:
        got = None
    assert got == want


def test_a_union_of_many_layouts_costs_what_they_hold_not_layouts_times_the_union():
    """Layouts that share 50 dense tensors and hold 50 experts of their own each: ten times
    the layouts, ten times the work (adding a layout costs what it holds, not the union so
    far, which grows with the layouts: a merge that walks it would cost a hundred times)."""
    from .metadata_cases import calls_of

    def work(n_layouts):
        sks = [nested.runs_of({"d": [["m", {"d": [[f"d{i}", T] for i in range(50)] + [[f"e{r}.{j}", T] for j in range(50)]}],
                                     ["step", X]]}) for r in range(n_layouts)]
        union = nested.SkeletonUnion()

        def add_all():
            for outline, keys in sks:
                union.add(outline, keys)

        return calls_of(add_all)

    assert work(300) <= 10.5 * work(30)


@settings(max_examples=300, deadline=None)
@given(_skeletons(), st.dictionaries(st.sampled_from(["a", "b", "a.b", "c.0", "0", "a.c", "b.a"]), st.integers(0, 9)))
def test_filling_the_placeholders_at_their_places_is_filling_them(skeleton, values):
    if nested.kind(skeleton) != "d":
        skeleton = {"d": [["a", skeleton]]}
    before = json.dumps(skeleton)
    want = nested.fill_values(skeleton, values)
    got = nested.fill_at(skeleton, nested.placeholders(skeleton), values)
    assert got == want
    assert json.dumps(skeleton) == before  # the skeleton itself is not changed
