"""Nested state dicts <-> flat keys, and the JSON skeleton that records their structure.

A state dict is a tree of dicts (str keys), lists and tuples whose leaves are tensors or plain
values (None, bool, int, float, str). A tensor leaf's flat key is its path joined by ``.``
(``{"model": {"w": t}}`` -> ``"model.w"``), as ``paddle.distributed`` names them.

The skeleton is the tree in JSON, one node per container or leaf::

    {"d": [[key, node], ...]}   dict, in insertion order
    {"l": [node, ...]}          list
    {"u": [node, ...]}          tuple
    {"t": 0}                    tensor leaf (its flat key is its path)
    {"v": value}                plain value: null, true/false, int, finite float, str
    {"f": "nan" | "inf" | "-inf"}  a float JSON cannot hold
    {"x": 0}                    a plain value left out (a non-coordinator rank's summary)
"""
from __future__ import annotations

import math
from itertools import repeat
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..errors import FormatError, MismatchError, StateDictError

Path = tuple  # of str (dict key) or int (list / tuple index)

_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def flat_key(path: Path) -> str:
    return ".".join(str(p) for p in path)


@dataclass
class Flat:
    """A state dict taken apart: tensors and values by flat key, and its skeleton."""

    tensors: dict[str, Any] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)
    skeleton: dict = field(default_factory=dict)


def flatten(state_dict: dict, is_tensor: Callable[[Any], bool], keep_values: bool = True) -> Flat:
    """Take a nested state dict apart.

    Args:
        state_dict: the nested dict.
        is_tensor: tells tensor leaves from plain values.
        keep_values: write plain values into the skeleton (else an ``{"x": 0}`` placeholder).

    Raises:
        StateDictError: a leaf that is neither a tensor nor a JSON-safe value, a non-str dict key,
            or two paths that flatten to the same key.
    """
    if not isinstance(state_dict, dict):
        raise StateDictError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    flat = Flat()

    def visit(node: Any, path: Path) -> dict:
        if isinstance(node, dict):
            items = []
            for k, v in node.items():
                if not isinstance(k, str):
                    raise StateDictError(
                        f"state dict keys must be str; {flat_key(path) or '<root>'} has key {k!r} "
                        f"of type {type(k).__name__}"
                    )
                items.append([k, visit(v, path + (k,))])
            return {"d": items}
        if isinstance(node, (list, tuple)) and not is_tensor(node):
            children = [visit(v, path + (i,)) for i, v in enumerate(node)]
            return {"u": children} if isinstance(node, tuple) else {"l": children}
        key = flat_key(path)
        if key in flat.paths:
            raise StateDictError(
                f"two entries of the state dict flatten to the same key {key!r}: "
                f"{flat.paths[key]} and {path}"
            )
        flat.paths[key] = path
        if is_tensor(node):
            flat.tensors[key] = node
            return {"t": 0}
        value = plain_value(node, key)
        flat.values[key] = value
        return encode_value(value) if keep_values else {"x": 0}

    flat.skeleton = visit(state_dict, ())
    return flat


def plain_value(value: Any, key: str) -> Any:
    """``value`` as a JSON-safe Python scalar, or StateDictError naming ``key``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.bool_, np.integer, np.floating)):
        return value.item()
    raise StateDictError(
        f"{key}: cannot save a value of type {type(value).__name__}; a state dict leaf must be a "
        f"tensor or None, bool, int, float or str (no pickle is used, so objects are refused)"
    )


def json_plain(value: Any) -> Any:
    """``value`` for strict JSON: a non-finite float as its name "nan", "inf" or "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def encode_value(value: Any) -> dict:
    plain = json_plain(value)
    return {"f": plain} if plain is not value else {"v": value}


def decode_value(node: dict, key: str) -> Any:
    if "v" in node:
        value = node["v"]
        if isinstance(value, float) and not math.isfinite(value):
            raise FormatError(f"{key}: a non-finite float must be written as {{\"f\": ...}}")
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise FormatError(f"{key}: value of type {type(value).__name__} in the metadata")
    if node.get("f") in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[node["f"]]
    raise FormatError(f"{key}: malformed value node {str(node)[:80]}")


_CONTAINERS = {"d", "l", "u"}
_LEAVES = {"t", "v", "f", "x"}


def kind(node: Any, key: str = "") -> str:
    """The node's tag (one of d, l, u, t, v, f, x), or FormatError."""
    if not isinstance(node, dict) or len(node) != 1:
        raise FormatError(f"{key or '<root>'}: malformed structure node {str(node)[:80]}")
    (tag,) = node
    if tag not in _CONTAINERS and tag not in _LEAVES:
        raise FormatError(f"{key or '<root>'}: unknown structure node {tag!r}")
    return tag


_TAGS = _CONTAINERS | _LEAVES


def _tag(node: Any, path: Path) -> str:
    """``kind(node)``, the key (for the error) worked out only when the node is malformed."""
    if type(node) is dict and len(node) == 1:
        for tag in node:
            if tag in _TAGS:
                return tag
    return kind(node, flat_key(path))


def walk(skeleton: dict) -> Iterator[tuple[Path, str, dict]]:
    """Every leaf of a skeleton as (path, tag, node), depth first, validating as it goes."""
    stack: list[tuple[Path, Any]] = [((), skeleton)]
    while stack:
        path, node = stack.pop()
        tag = _tag(node, path)
        body = node[tag]
        if tag == "d":
            if not isinstance(body, list):
                raise FormatError(f"{flat_key(path) or '<root>'}: dict node must hold a list")
            for item in reversed(body):
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                    raise FormatError(f"{flat_key(path) or '<root>'}: malformed dict item {str(item)[:80]}")
                stack.append((path + (item[0],), item[1]))
        elif tag in ("l", "u"):
            if not isinstance(body, list):
                raise FormatError(f"{flat_key(path) or '<root>'}: list node must hold a list")
            for i in reversed(range(len(body))):
                stack.append((path + (i,), body[i]))
        else:
            yield path, tag, node


def merge(base: dict, other: dict) -> dict:
    """Union of two skeletons (``base`` wins where both hold a plain value); see
    :class:`SkeletonUnion`, which folds any number of them.

    Raises:
        FormatError: the same path is a tensor on one side and something else on the other.
    """
    union = SkeletonUnion()
    union.add(*runs_of(base))
    union.add(*runs_of(other))
    return union.result()


def runs_of(skeleton: dict) -> tuple[dict, list[str]]:
    """A skeleton as an outline and its tensor keys (depth first): in the outline, every run of
    consecutive tensor leaves of a dict is one integer, its length (lists and tuples keep their
    ``{"t": 0}``). A state dict of a hundred thousand tensors is then a few nodes and a list of
    keys, which a rank sends and the coordinator merges at little cost per key."""
    keys: list[str] = []

    def visit(node: dict, key: str | None) -> dict:
        tag = kind(node, key or "")
        if tag == "t":
            keys.append(key or "")
            return node
        if tag not in _CONTAINERS:
            return node
        body = _body(node, tag, key)
        if tag != "d":
            return {tag: [visit(c, _join(key, str(i))) for i, c in enumerate(body)]}
        items: list = []
        prefix = "" if key is None else key + "."
        for name, child in body:
            if type(child) is dict and len(child) == 1 and "t" in child:
                keys.append(prefix + name)
                if items and type(items[-1]) is int:
                    items[-1] += 1
                else:
                    items.append(1)
            else:
                items.append([name, visit(child, prefix + name)])
        return {"d": items}

    return visit(skeleton, None), keys


def from_runs(outline: dict, keys: Sequence[str]) -> dict:
    """The skeleton :func:`runs_of` took apart.

    Raises:
        FormatError: a run whose keys do not lie in its dict, or keys left over or missing.
    """
    at = 0

    def visit(node: Any, key: str | None) -> dict:
        nonlocal at
        tag = kind(node, key or "")
        if tag == "t":
            if at >= len(keys):
                raise FormatError(f"{key or '<root>'}: more tensor leaves than keys")
            at += 1
            return node
        if tag not in _CONTAINERS:
            return node
        body = node[tag]
        if not isinstance(body, list):
            raise FormatError(f"{key or '<root>'}: malformed container")
        if tag != "d":
            return {tag: [visit(c, _join(key, str(i))) for i, c in enumerate(body)]}
        items: list = []
        for item in body:
            if type(item) is int:
                items.extend([name, {"t": 0}] for name in _run_names(keys, at, item, key))
                at += item
            elif isinstance(item, list) and len(item) == 2 and isinstance(item[0], str):
                items.append([item[0], visit(item[1], _join(key, item[0]))])
            else:
                raise FormatError(f"{key or '<root>'}: malformed dict item {str(item)[:80]}")
        return {"d": items}

    skeleton = visit(outline, None)
    if at != len(keys):
        raise FormatError(f"{len(keys)} tensor keys for {at} tensor leaves")
    return skeleton


def _run_names(keys: Sequence[str], at: int, n: int, key: str | None) -> list[str]:
    """The names, in their dict at ``key``, of the ``n`` tensor keys from ``at``."""
    if n < 1 or at + n > len(keys):
        raise FormatError(f"{key or '<root>'}: a run of {n} tensor leaves past the {len(keys)} keys")
    run = keys[at : at + n]
    if key is None:
        return list(run)
    prefix = key + "."
    if not all(map(str.startswith, run, repeat(prefix))):
        raise FormatError(f"{key}: a tensor key of its run does not lie in it")
    cut = len(prefix)
    return [k[cut:] for k in run]


_TENSOR_LEAF = {"t": 0}


class SkeletonUnion:
    """The union of many skeletons, each given as :func:`runs_of` takes it apart, built in
    place: each :meth:`add` costs its outline's nodes and, per tensor key, a few set and dict
    operations (a save of thousands of ranks whose layouts all differ adds thousands, of a
    hundred thousand tensors). The fold is the pairwise merge: dict items keep the order they
    were first seen in, lists and tuples keep their longer tail, a plain value beats a
    placeholder (``{"x": 0}``) and the first plain value wins.

    Inside, a dict is a ``[tag, index, items, tensors]`` list (``index``: name -> item
    position; ``tensors``: the names of its tensor leaves), a list or tuple ``[tag, None,
    items, None]``, a leaf its JSON node."""

    def __init__(self) -> None:
        self._root: Any = None
        self._keys: Sequence[str] = ()
        self._at = 0

    def add(self, outline: dict, keys: Sequence[str]) -> None:
        """Merge in a skeleton given as (outline, tensor keys), :func:`runs_of`'s.

        Raises:
            FormatError: a malformed node, a run of keys that does not lie in its dict, or a
                path that is a tensor here and something else in a skeleton added before.
        """
        self._keys, self._at = keys, 0
        self._root = self._merge(self._root, outline, None)
        if self._at != len(keys):
            raise FormatError(f"{len(keys)} tensor keys for {self._at} tensor leaves")

    def _merge(self, mine: Any, node: Any, key: str | None) -> Any:
        tag = kind(node, key or "")
        if mine is None:  # first seen: take it over (containers become mutable)
            mine = self._empty(tag, node)
        have = mine[0] if isinstance(mine, list) else kind(mine, key or "")
        if tag in ("v", "f", "x") and have in ("v", "f", "x"):
            return node if have == "x" else mine
        if tag != have:
            raise FormatError(f"{key or '<root>'}: ranks disagree on this entry's kind ({have} vs {tag})")
        if tag == "t":
            self._take(1, key)
            return mine
        if tag == "d":
            self._merge_dict(mine, node, key)
            return mine
        items = mine[2]
        for i, child in enumerate(_body(node, tag, key)):
            if i < len(items):
                items[i] = self._merge(items[i], child, _join(key, str(i)))
            else:
                items.append(self._merge(None, child, _join(key, str(i))))
        return mine

    def _empty(self, tag: str, node: Any) -> Any:
        if tag == "d":
            return ["d", {}, [], set()]
        if tag in ("l", "u"):
            return [tag, None, [], None]
        return node if tag != "t" else _TENSOR_LEAF

    def _take(self, n: int, key: str | None) -> None:
        """Account for ``n`` tensor leaves outside dict runs (in lists and tuples)."""
        if self._at + n > len(self._keys):
            raise FormatError(f"{key or '<root>'}: more tensor leaves than keys")
        self._at += n

    def _merge_dict(self, mine: list, node: dict, key: str | None) -> None:
        body = node["d"]
        if not isinstance(body, list):
            raise FormatError(f"{key or '<root>'}: dict node must hold a list")
        _, index, items, tensors = mine
        for item in body:
            if type(item) is int:  # a run of tensor leaves
                names = _run_names(self._keys, self._at, item, key)
                self._at += item
                fresh = [n for n in dict.fromkeys(names) if n not in index]
                if len(fresh) < len(names):
                    clash = [n for n in names if n in index and n not in tensors]
                    if clash:
                        raise FormatError(f"{_join(key, clash[0])}: ranks disagree on this entry's kind (a value or "
                                          f"container vs t)")
                for n in fresh:
                    index[n] = len(items)
                    items.append([n, _TENSOR_LEAF])
                tensors.update(fresh)
                continue
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise FormatError(f"{key or '<root>'}: malformed dict item {str(item)[:80]}")
            name, child = item
            at = index.get(name)
            if at is None:
                index[name] = len(items)
                items.append([name, self._merge(None, child, _join(key, name))])
                if items[-1][1] is _TENSOR_LEAF:
                    tensors.add(name)
            else:
                if name in tensors and kind(child, _join(key, name)) != "t":
                    raise FormatError(f"{_join(key, name)}: ranks disagree on this entry's kind (t vs "
                                      f"{kind(child, _join(key, name))})")
                items[at][1] = self._merge(items[at][1], child, _join(key, name))

    def result(self) -> dict:
        """The union as a skeleton (``{"d": []}`` when nothing was added)."""
        if self._root is None:
            return {"d": []}
        return _export(self._root)


def _join(prefix: str | None, name: str) -> str:
    """The flat key of item ``name`` of the node at ``prefix`` (None: the root)."""
    return name if prefix is None else f"{prefix}.{name}"


def _body(node: dict, tag: str, key: str | None) -> list:
    """A container node's items, checked to be well formed."""
    body = node[tag]
    if not isinstance(body, list):
        raise FormatError(f"{key or '<root>'}: {'dict' if tag == 'd' else 'list'} node must hold a list")
    if tag == "d":
        for item in body:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise FormatError(f"{key or '<root>'}: malformed dict item {str(item)[:80]}")
    return body


def _export(mine: Any) -> Any:
    if not isinstance(mine, list):
        return mine
    tag, _, items, _ = mine
    if tag == "d":
        return {"d": [[k, {"t": 0} if child is _TENSOR_LEAF else _export(child)] for k, child in items]}
    return {tag: [{"t": 0} if child is _TENSOR_LEAF else _export(child) for child in items]}


def placeholders(skeleton: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every ``{"x": 0}`` placeholder of a skeleton: (its flat key, the index of the item on the
    way in every container from the root), depth first: what :func:`fill_at` fills."""
    out: list[tuple[str, tuple[int, ...]]] = []

    def visit(node: dict, key: str | None, at: tuple[int, ...]) -> None:
        (tag, body), = node.items()
        if tag == "x":
            out.append((key or "", at))
        elif tag == "d":
            for i, (k, child) in enumerate(body):
                if not (type(child) is dict and "t" in child):
                    visit(child, _join(key, k), at + (i,))
        elif tag in ("l", "u"):
            for i, child in enumerate(body):
                visit(child, _join(key, str(i)), at + (i,))

    visit(skeleton, None, ())
    return out


def fill_at(skeleton: dict, places: Sequence[tuple[str, tuple[int, ...]]], values: dict[str, Any]) -> tuple[dict, list[str]]:
    """:func:`fill_values`, given its placeholders' places (:func:`placeholders` of the same
    skeleton): only the containers on their paths are copied, so a skeleton of a hundred
    thousand tensors costs its few plain values, not its size. The skeleton is not changed."""
    copies: dict[int, list] = {}  # id of an original container -> its body, copied
    dropped: list[str] = []
    for key, at in places:
        node = skeleton
        for depth, i in enumerate(at):
            (tag, body), = node.items()
            copy = copies.get(id(node))
            if copy is None:
                copy = copies[id(node)] = list(body)
            if depth < len(at) - 1:
                node = body[i][1] if tag == "d" else body[i]
                continue
            if key in values:
                value = encode_value(values[key])
            else:
                dropped.append(key)
                value = _GONE if tag == "d" else {"v": None}
            copy[i] = [body[i][0], value] if tag == "d" else value
    return _rebuild(skeleton, copies) if copies else skeleton, dropped


_GONE = {"gone": 0}  # a dict item whose placeholder had no value: left out


def _rebuild(node: dict, copies: dict[int, list]) -> dict:
    """``node`` with the bodies :func:`fill_at` copied, its dropped dict items left out."""
    copy = copies.get(id(node))
    if copy is None:
        return node
    (tag, _), = node.items()
    if tag == "d":
        return {"d": [[k, _rebuild(c, copies)] for k, c in copy if c is not _GONE]}
    return {tag: [_rebuild(c, copies) for c in copy]}


def fill_values(skeleton: dict, values: dict[str, Any]) -> tuple[dict, list[str]]:
    """Replace ``{"x": 0}`` placeholders whose flat key is in ``values``; returns the new
    skeleton and the keys of placeholders that had no value (they are dropped)."""
    dropped: list[str] = []

    def visit(node: dict, path: Path) -> Any:
        tag = _tag(node, path)
        if tag == "d":
            items = []
            for item in node["d"]:
                k, child = item
                if type(child) is dict and len(child) == 1 and "t" in child:  # most leaves: a tensor, kept
                    items.append(item)
                    continue
                new = visit(child, path + (k,))
                if new is not None:
                    items.append([k, new])
            return {"d": items}
        if tag in ("l", "u"):
            return {tag: [visit(c, path + (i,)) or {"v": None} for i, c in enumerate(node[tag])]}
        if tag == "x":
            key = flat_key(path)
            if key in values:
                return encode_value(values[key])
            dropped.append(key)
            return None
        return node

    return visit(skeleton, ()) or {"d": []}, dropped


def filled_with_keys(skeleton: dict, values: dict[str, Any]) -> tuple[dict, list[str]]:
    """``fill_values`` of a skeleton whose every plain value is a placeholder, and the flat keys
    of its tensor leaves, in one pass that costs little per leaf (a structure of a hundred
    thousand tensors).

    Raises:
        FormatError: a malformed node, or a plain value where only placeholders may be.
    """
    keys: list[str] = []

    def visit(node: Any, key: str | None) -> Any:
        if type(node) is not dict or len(node) != 1:
            kind(node, key or "")
        ((tag, body),) = node.items()
        if tag == "t":
            keys.append(key or "")
            return node
        if tag == "x":
            k = key or ""
            return encode_value(values[k]) if k in values else None
        if tag == "d":
            if type(body) is not list:
                _body(node, tag, key)
            items = []
            prefix = "" if key is None else key + "."
            for item in body:
                if type(item) is not list or len(item) != 2 or type(item[0]) is not str:
                    _body(node, tag, key)
                name, child = item
                if type(child) is dict and len(child) == 1 and "t" in child:  # most leaves: a tensor
                    keys.append(prefix + name)
                    items.append(item)
                    continue
                child = visit(child, prefix + name)
                if child is not None:
                    items.append([name, child])
            return {"d": items}
        if tag in ("l", "u"):
            return {tag: [visit(c, _join(key, str(i))) or {"v": None} for i, c in enumerate(_body(node, tag, key))]}
        raise FormatError(f"{key or '<root>'}: a {tag!r} node where only placeholders may be")

    return visit(skeleton, None) or {"d": []}, keys


def tensor_keys(skeleton: dict) -> list[str]:
    """Flat keys of the skeleton's tensor leaves, depth first."""
    return [flat_key(path) for path, tag, _ in walk(skeleton) if tag == "t"]


def values_of(skeleton: dict) -> dict[str, Any]:
    """Flat key -> plain value of every value leaf of a skeleton."""
    out = {}
    for path, tag, node in walk(skeleton):
        if tag in ("v", "f"):
            key = flat_key(path)
            out[key] = decode_value(node, key)
    return out


def set_values(state_dict: dict, flat: Flat, values: dict[str, Any]) -> list[str]:
    """Write checkpoint values into ``state_dict`` in place at the flat keys of ``flat.values``
    that ``values`` holds; returns the keys written. Tuples, being immutable, are rebuilt in
    their parent."""
    written = []
    for key in flat.values:
        if key not in values:
            continue
        _assign(state_dict, flat.paths[key], values[key])
        written.append(key)
    return written


def set_tensor(state_dict: dict, path: Path, tensor: Any) -> None:
    """Replace the tensor leaf at ``path`` (used when a loaded value must move, e.g. offload)."""
    _assign(state_dict, path, tensor)


def _assign(root: Any, path: Path, value: Any) -> None:
    if not path:
        raise MismatchError("cannot replace the root of a state dict")
    chain = [root]
    for p in path[:-1]:
        chain.append(chain[-1][p])
    for i in range(len(path) - 1, -1, -1):
        container = chain[i]
        if isinstance(container, tuple):
            items = list(container)
            items[path[i]] = value
            value = tuple(items)
            continue
        container[path[i]] = value
        return
    raise MismatchError("cannot replace a value inside a tuple at the root of a state dict")


def restrict(skeleton: dict, keys: set[str], whole: frozenset = frozenset()) -> dict:
    """The skeleton with only the leaves whose flat key is in ``keys`` and the subtrees whose
    path is in ``whole`` (and the containers on their paths); list and tuple positions are kept
    by turning dropped items into None."""

    def visit(node: dict, path: Path) -> Any:
        if path in whole:
            return node
        tag = _tag(node, path)
        if tag == "d":
            items = [[k, c] for k, c in ((k, visit(c, path + (k,))) for k, c in node["d"]) if c is not None]
            return {"d": items} if items or not path else None
        if tag in ("l", "u"):
            children = [visit(c, path + (i,)) for i, c in enumerate(node[tag])]
            if all(c is None for c in children):
                return None
            return {tag: [c if c is not None else {"v": None} for c in children]}
        return node if flat_key(path) in keys else None

    return visit(skeleton, ()) or {"d": []}


# ------------------------------------------------------------------ plain subtrees
def _children(node: dict, tag: str, path: Path) -> list[tuple[Path, dict]]:
    if tag == "d":
        return [(path + (k,), child) for k, child in node["d"]]
    return [(path + (i,), child) for i, child in enumerate(node[tag])]


def node_paths(skeleton: dict) -> dict[Path, bool]:
    """Every node of a skeleton, containers included, by path -> whether it holds a tensor."""
    out: dict[Path, bool] = {}

    def visit(node: dict, path: Path) -> bool:
        tag = _tag(node, path)
        if tag in _LEAVES:
            out[path] = tag == "t"
            return out[path]
        holds = False
        for child_path, child in _children(node, tag, path):
            holds = visit(child, child_path) or holds
        out[path] = holds
        return holds

    visit(skeleton, ())
    return out


def plain_subtrees(skeleton: dict, holds: dict[Path, bool] | None = None) -> list[tuple[Path, dict]]:
    """The largest subtrees below the root that hold no tensor, as (path, node): a load puts
    each into the state dict whole, whatever the state dict holds there. ``holds``: the
    skeleton's :func:`node_paths`, when the caller has it."""
    holds = node_paths(skeleton) if holds is None else holds
    out = []
    stack: list[tuple[Path, dict]] = [((), skeleton)]
    while stack:
        path, node = stack.pop()
        tag = _tag(node, path)
        if path and not holds[path]:
            out.append((path, node))
        elif tag in _CONTAINERS:
            stack.extend(reversed(_children(node, tag, path)))
    return out


def decode(node: dict, path: Path = ()) -> Any:
    """The Python value of a subtree that holds no tensor (dicts, lists, tuples, values)."""
    tag = kind(node, flat_key(path))
    if tag == "d":
        return {k: decode(child, path + (k,)) for k, child in node["d"]}
    if tag in ("l", "u"):
        items = [decode(child, child_path) for child_path, child in _children(node, tag, path)]
        return items if tag == "l" else tuple(items)
    if tag in ("v", "f"):
        return decode_value(node, flat_key(path))
    raise FormatError(f"{flat_key(path) or '<root>'}: a {tag!r} node where a plain value was expected")


def assign_subtree(state_dict: dict, path: Path, node: dict) -> None:
    """Put the plain subtree ``node`` into ``state_dict`` at ``path``: a dict or list there is
    updated in place (its other references see the checkpoint's contents), anything else
    replaced in its parent (a tuple parent is rebuilt)."""
    value = decode(node, path)
    current = state_dict
    for p in path:
        current = current[p]
    if isinstance(current, dict) and isinstance(value, dict):
        current.clear()
        current.update(value)
    elif isinstance(current, list) and isinstance(value, list):
        current[:] = value
    else:
        _assign(state_dict, path, value)
