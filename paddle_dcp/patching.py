"""Everything that patches paddle: :func:`patch_paddle` routes paddle.distributed's and
flex_checkpoint's save/load to paddle_dcp (on request); :func:`watch_buffers` (at import) notes
the buffers paddle's ``shard_layer`` makes persistable (section "buffers" below).

What :func:`patch_paddle` replaces, in every module loaded when it is called:

- paddle's ``save_state_dict`` (defined in ``paddle.distributed.flex_checkpoint.dcp.save_state_dict``,
  re-exported as ``paddle.distributed.save_state_dict``) -> :func:`paddle_dcp.save_state_dict`;
- paddle's ``load_state_dict`` (defined in ``paddle.distributed.flex_checkpoint.dcp.load_state_dict``,
  re-exported as ``paddle.distributed.load_state_dict``) -> :func:`paddle_dcp.load_state_dict`
  with paddle's contract for keys the checkpoint lacks (``patch_paddle(strict=True)``: ours);
- ``paddle.load`` (defined in ``paddle.framework.io``) -> the same function, except that a
  paddle_dcp ``{id}.metadata`` file (JSON, where paddle's is a pickle) gives
  :func:`read_state_dict_metadata` instead of failing to unpickle;
- ``paddle.distributed.shard_layer`` (defined in ``paddle.distributed.auto_parallel.api``) ->
  the same function, except that buffers a layer declared non-persistable stay so (paddle's
  registers every buffer again as persistable), so the model has the same state-dict keys on
  every layout.

Every module attribute named ``save_state_dict``, ``load_state_dict``, ``load`` or ``shard_layer`` that holds
paddle's function of that name is replaced (``paddle.distributed.load_state_dict``,
``paddle.load``, ``paddle.framework.load``, a ``from paddle.distributed import
load_state_dict`` in user code...), so code that looks the name up at call time (PaddleFormers'
``dist.load_state_dict(...)``, ``paddle.load(...)``) and code that imported it by name both
reach paddle_dcp; so do paddle's own helpers that call ``load_state_dict`` from their module
(``load_merged_state_dict``). Other references are left alone on purpose: a name bound under
another name (``import ... as``, ``builtin_load = dist.load_state_dict``: a way to keep
paddle's own), an object's attribute, a default argument or a closure made before the call
(patch before building them).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from .core.naming import METADATA_RE
from .core.nested import flat_key, walk
from .errors import ArgumentError, DcpError
from .io import is_file, open_file
from .io.reads import read_range

logger = logging.getLogger(__name__)

# (defining module, attribute): paddle's function that a route replaces
_SAVE = ("paddle.distributed.flex_checkpoint.dcp.save_state_dict", "save_state_dict")
_LOAD = ("paddle.distributed.flex_checkpoint.dcp.load_state_dict", "load_state_dict")
_PADDLE_LOAD = ("paddle.framework.io", "load")
_SHARD_LAYER = ("paddle.distributed.auto_parallel.api", "shard_layer")
_ORIGINALS: dict[tuple[str, str], Any] = {}  # paddle's own functions, found once
_REPLACEMENTS: dict[tuple[tuple[str, str], bool], Any] = {}  # (route, strict) -> ours, made once


# ============================================================ the metadata without pickle
@dataclass(frozen=True)
class TensorPieceMetadata:
    """One saved piece of a tensor, with the fields of paddle's ``LocalTensorMetadata``.

    Attributes:
        global_offset: where the piece starts in the whole tensor, in elements per dim.
        local_shape: the piece's shape, in elements.
        dtype: paddle's dtype name (``"float32"``, ``"bfloat16"``...).
        global_shape: the whole tensor's shape, in elements.
        is_flattened: always False (paddle_dcp saves pieces in their shape).
        flattened_range: always None.
    """

    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    global_shape: tuple[int, ...]
    is_flattened: bool = False
    flattened_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class StateDictMetadata:
    """What paddle's pickled ``Metadata`` tells about tensors, read from paddle_dcp's JSON.

    Attributes:
        state_dict_metadata: flat key -> its saved pieces, as paddle's attribute of that name.
        unique_id: the checkpoint's id.
        flat_mapping: flat key -> its path in the nested state dict that was saved
            (``"model.w"`` -> ``("model", "w")``), as paddle's attribute of that name; a list
            index is an int.
    """

    state_dict_metadata: dict[str, list[TensorPieceMetadata]]
    unique_id: int
    flat_mapping: dict[str, tuple] = field(default_factory=dict)


def state_dict_metadata(meta) -> StateDictMetadata:
    """paddle's ``Metadata.state_dict_metadata`` shape, built from a paddle_dcp Metadata."""
    out: dict[str, list[TensorPieceMetadata]] = {}
    for key in meta.tensors:
        entry = meta.tensors[key]
        # a derived tensor (stored as none) is laid out as the source it is read from
        pieces = meta.tensors[entry.source].pieces if entry.derived else entry.pieces
        out[key] = [
            TensorPieceMetadata(
                global_offset=tuple(int(x) for x in pieces.offsets[i]),
                local_shape=tuple(int(x) for x in pieces.shapes[i]),
                dtype=entry.dtype,
                global_shape=tuple(entry.shape),
            )
            for i in range(pieces.count)
        ]
    mapping = {flat_key(path): tuple(path) for path, tag, _ in walk(meta.structure) if tag == "t"}
    return StateDictMetadata(out, meta.unique_id, mapping)


def read_state_dict_metadata(path: str, unique_id: int | None = None) -> StateDictMetadata:
    """The tensors of a checkpoint in the shape of paddle's ``Metadata.state_dict_metadata``,
    from paddle_dcp's JSON metadata (no pickle).

    PaddleFormers' Trainer reads ``paddle.load(".../0.metadata").state_dict_metadata`` before
    it loads a flex checkpoint (to create the optimizer's states); under :func:`patch_paddle`
    that call returns this.

    Args:
        path: a checkpoint directory, or its ``{id}.metadata`` file.
        unique_id: which checkpoint of a directory (default: the highest complete one); for
            a file, its name gives it (another one is refused).

    Raises:
        FormatError: no complete checkpoint, or damaged metadata.
        StorageError: no metadata file for ``unique_id``.
        ArgumentError: a ``unique_id`` other than the metadata file's.
    """
    from .api import read_metadata

    path = os.fspath(path)
    match = METADATA_RE.match(os.path.basename(path))
    if match and is_file(path):
        if unique_id is not None and unique_id != int(match.group(1)):
            raise ArgumentError(f"{path} is checkpoint {match.group(1)}, not unique_id={unique_id}")
        path, unique_id = os.path.dirname(path) or ".", int(match.group(1))
    return state_dict_metadata(read_metadata(path, unique_id))


def is_dcp_metadata_file(path: Any) -> bool:
    """True for a paddle_dcp ``{id}.metadata`` file (JSON; paddle's own is a pickle)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    if not isinstance(path, str) or not METADATA_RE.match(os.path.basename(path)):
        return False
    try:
        store, name = open_file(path)
        size = store.size(name)
        head = read_range(store, name, 0, min(size, 64)) if size is not None else b""
    except DcpError:
        return False
    return head.lstrip().startswith(b"{")


# ============================================================ the patch
def _paddle_load_routed(original):
    def load(path, **configs):
        if is_dcp_metadata_file(path):
            if configs:
                raise ArgumentError(f"{path}: paddle_dcp metadata is read without options, got {sorted(configs)}")
            return read_state_dict_metadata(path)
        return original(path, **configs)

    load.__wrapped__ = original
    load.__doc__ = "paddle.load, except that a paddle_dcp metadata file gives paddle_dcp.read_state_dict_metadata(path)."
    return load


def _shard_layer_routed(original):
    """paddle's ``dist.shard_layer``, keeping the buffers each layer declared non-persistable
    non-persistable: paddle's re-registers every buffer with ``register_buffer(key, ...)``,
    persistable by default, so a tensor-parallel model's state dict gained keys (a rotary
    embedding's ``inv_freq``) that the same model's on one process does not have, and a
    checkpoint saved on one layout no longer loaded strictly on the other."""

    def shard_layer(layer, *args, **kwargs):
        out = original(layer, *args, **kwargs)
        restore_buffers(layer)
        return out

    shard_layer.__wrapped__ = original
    shard_layer.__doc__ = "paddle.distributed.shard_layer, keeping non-persistable buffers so (paddle_dcp.patch_paddle)."
    return shard_layer


def _load_routed(strict: bool):
    """paddle's ``load_state_dict`` as routed: :func:`paddle_dcp.load_state_dict` with paddle's
    contract for keys the checkpoint lacks (a warning naming them, those targets unchanged)
    unless the patch asked for ``strict``; a caller's own ``strict=`` wins."""
    from . import api

    def load_state_dict(state_dict, path, *args, **kwargs):
        kwargs.setdefault("strict", strict)
        return api.load_state_dict(state_dict, path, *args, **kwargs)

    load_state_dict.__wrapped__ = api.load_state_dict
    load_state_dict.__doc__ = (
        f"paddle_dcp.load_state_dict routed from paddle's name, strict={strict} by default "
        "(paddle_dcp.patch_paddle); see paddle_dcp.load_state_dict."
    )
    return load_state_dict


def _routes(strict: bool = False) -> dict[tuple[str, str], tuple[Any, Any]]:
    """(defining module, name) -> (paddle's function, its replacement)."""
    import importlib

    from . import api

    if not _ORIGINALS:
        for route in (_SAVE, _LOAD, _PADDLE_LOAD, _SHARD_LAYER):
            _ORIGINALS[route] = getattr(importlib.import_module(route[0]), route[1])
    if (_LOAD, strict) not in _REPLACEMENTS:
        _REPLACEMENTS[(_SAVE, strict)] = api.save_state_dict
        _REPLACEMENTS[(_LOAD, strict)] = _load_routed(strict)
        _REPLACEMENTS[(_PADDLE_LOAD, strict)] = _paddle_load_routed(_ORIGINALS[_PADDLE_LOAD])
        _REPLACEMENTS[(_SHARD_LAYER, strict)] = _shard_layer_routed(_ORIGINALS[_SHARD_LAYER])
    return {route: (_ORIGINALS[route], _REPLACEMENTS[(route, strict)]) for route in _ORIGINALS}


class PaddlePatch:
    """The replacements made by :func:`patch_paddle`; ``undo()`` (or leaving a ``with``
    block) puts paddle's functions back."""

    def __init__(self, changes: list[tuple[Any, str, Any, Any]]):
        self._changes = changes  # (module, attribute, paddle's function, replacement)

    @property
    def replaced(self) -> list[str]:
        """``module.attribute`` of every name this patch replaced, sorted."""
        return sorted(f"{m.__name__}.{name}" for m, name, _, _ in self._changes)

    def undo(self) -> None:
        """Restore paddle's functions where this patch put ours (a name set to something else
        since is left alone). Calling it again does nothing."""
        for module, name, original, replacement in reversed(self._changes):
            if vars(module).get(name) is replacement:
                setattr(module, name, original)
        self._changes = []

    def __enter__(self) -> "PaddlePatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch_paddle(strict: bool = False) -> PaddlePatch:
    """Point paddle.distributed's and flex_checkpoint's save/load (and ``paddle.load`` of a
    paddle_dcp metadata file) at paddle_dcp, in every module loaded now.

    Replaced, wherever a loaded module binds them under their own names (see the module
    docstring for what is and is not reached):
    paddle's ``save_state_dict`` -> :func:`paddle_dcp.save_state_dict`, paddle's
    ``load_state_dict`` -> :func:`paddle_dcp.load_state_dict` keeping paddle's contract for
    keys of the state dict that the checkpoint lacks (a warning naming them, those targets
    unchanged: code written for paddle expects it; ``strict=True`` makes them a
    ``MismatchError`` on every rank, paddle_dcp's own default), and ``paddle.load`` -> itself
    except for a paddle_dcp ``{id}.metadata`` file, which gives
    :func:`read_state_dict_metadata` (what PaddleFormers' Trainer reads from paddle's pickled
    metadata before it resumes), and ``dist.shard_layer`` -> itself keeping the buffers a
    layer declared non-persistable so (the same state-dict keys on every layout). Modules
    imported later that take the names from paddle get paddle_dcp's. Call it before building
    objects that keep a reference (PaddleFormers' Trainer keeps ``dist.load_state_dict`` in
    ``_load_ckpt_func`` when it is built) and before ``dist.shard_layer``.

    Args:
        strict: what routed loads do with keys the checkpoint lacks: False (paddle's
            contract: warn, leave unchanged) or True (raise, as direct calls of
            :func:`paddle_dcp.load_state_dict` do). A routed call's own ``strict=`` wins.

    Returns:
        a :class:`PaddlePatch`: ``undo()`` restores paddle's functions; also a context
        manager (``with paddle_dcp.patch_paddle(): ...``) that restores them on exit.
    """
    routes = _routes(bool(strict))
    changes = []
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for (_, name), (original, replacement) in routes.items():
            if names.get(name) is original:
                setattr(module, name, replacement)
                changes.append((module, name, original, replacement))
    patch = PaddlePatch(changes)
    logger.info("paddle_dcp routes %d names to itself: %s", len(changes), ", ".join(patch.replaced))
    return patch


# ====================================================================== buffers
# Buffers a layer declared non-persistable, remembered where paddle's ``shard_layer`` forgets.
#
# Paddle's ``dist.shard_layer`` puts every buffer on the mesh with ``register_buffer(name,
# shard_tensor(buffer, ...))``, whose ``persistable`` defaults to True: a buffer the model
# declared non-persistable (a rotary embedding's ``inv_freq``) joins the state dict on a sharded
# layout and not on one process, and a checkpoint no longer loads strictly across the two.
#
# Importing paddle_dcp wraps ``paddle.nn.Layer.register_buffer`` to notice exactly that call (no
# ``persistable`` given, the name non-persistable until now, a plain tensor replaced by a dist
# one) and notes the name on the layer. The wrapper changes nothing paddle does; it only notes.
# Readers: :func:`forgotten` (``paddle_dcp.get_state_dict`` leaves those buffers out) and
# :func:`restore_buffers` (``patch_paddle``'s ``shard_layer`` marks them non-persistable again). An
# explicit ``persistable=`` is the caller's choice and clears the note.
#
# If paddle's layers module is not loaded when paddle_dcp is imported, the wrapper is put in
# place when it is (an import hook that removes itself), so the import order does not matter.
LAYERS_MODULE = "paddle.nn.layer.layers"
_NOTE = "_paddle_dcp_forgotten_non_persistable"  # a set of names, in the layer's __dict__
_UNSET = object()


def forgotten(layer: Any) -> frozenset[str]:
    """Names of ``layer``'s own buffers (not its sublayers') that it declared non-persistable
    and that paddle's ``shard_layer`` has since registered as persistable."""
    names = vars(layer).get(_NOTE, ())
    non_persistable = layer._non_persistable_buffer_names_set
    return frozenset(n for n in names if n in layer._buffers and n not in non_persistable)


def forgotten_keys(model: Any) -> frozenset[str]:
    """:func:`forgotten` for every sublayer of ``model``, as keys of ``model.state_dict()``."""
    keys = set()
    for prefix, sub in model.named_sublayers(include_self=True):
        keys.update(f"{prefix}.{name}" if prefix else name for name in forgotten(sub))
    return frozenset(keys)


def restore_buffers(model: Any) -> None:
    """Mark every buffer of ``model`` that :func:`forgotten` names non-persistable again."""
    for sub in model.sublayers(include_self=True):
        sub._non_persistable_buffer_names_set.update(forgotten(sub))


def _is_dist(tensor: Any) -> bool:
    return tensor is not None and bool(tensor.is_dist())


def _noting(register_buffer):
    def register(self, name, tensor, persistable=_UNSET):
        own = vars(self)
        if persistable is not _UNSET:  # the caller's choice
            if isinstance(own.get(_NOTE), set):
                own[_NOTE].discard(name)
            return register_buffer(self, name, tensor, persistable)
        buffers = own.get("_buffers")
        old = buffers.get(name) if isinstance(buffers, dict) else None
        if (
            old is not None
            and name in own.get("_non_persistable_buffer_names_set", ())
            and not _is_dist(old)
            and _is_dist(tensor)
        ):
            own.setdefault(_NOTE, set()).add(name)
        return register_buffer(self, name, tensor)

    functools.update_wrapper(register, register_buffer)
    setattr(register, "paddle_dcp_notes", True)
    return register


def _install_buffer_note(layers: Any) -> None:
    layer = layers.Layer
    if not getattr(layer.register_buffer, "paddle_dcp_notes", False):
        layer.register_buffer = _noting(layer.register_buffer)
        logger.debug("paddle_dcp notes buffers that shard_layer makes persistable")


class _WhenLoaded(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when paddle's layers module is about to load, it lets the normal
    finder find it, asks its loader to call :func:`_install_buffer_note` after the module ran, and leaves
    ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != LAYERS_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            _install_buffer_note(module)

        setattr(spec.loader, "exec_module", exec_then_install)
        return spec


def watch_buffers() -> None:
    """Wrap ``register_buffer`` now if paddle's layers module is loaded, else when it is."""
    layers = sys.modules.get(LAYERS_MODULE)
    if layers is not None:
        _install_buffer_note(layers)
    elif not any(isinstance(f, _WhenLoaded) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenLoaded())
