"""Buffers a layer declared non-persistable, remembered where paddle's ``shard_layer`` forgets.

Paddle's ``dist.shard_layer`` puts every buffer on the mesh with ``register_buffer(name,
shard_tensor(buffer, ...))``, whose ``persistable`` defaults to True: a buffer the model
declared non-persistable (a rotary embedding's ``inv_freq``) joins the state dict on a sharded
layout and not on one process, and a checkpoint no longer loads strictly across the two.

Importing paddle_dcp wraps ``paddle.nn.Layer.register_buffer`` to notice exactly that call (no
``persistable`` given, the name non-persistable until now, a plain tensor replaced by a dist
one) and notes the name on the layer. The wrapper changes nothing paddle does; it only notes.
Readers: :func:`forgotten` (``paddle_dcp.get_state_dict`` leaves those buffers out) and
:func:`restore` (``patch_paddle``'s ``shard_layer`` marks them non-persistable again). An
explicit ``persistable=`` is the caller's choice and clears the note.

If paddle's layers module is not loaded when paddle_dcp is imported, the wrapper is put in
place when it is (an import hook that removes itself), so the import order does not matter.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

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


def restore(model: Any) -> None:
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


def _install(layers: Any) -> None:
    layer = layers.Layer
    if not getattr(layer.register_buffer, "paddle_dcp_notes", False):
        layer.register_buffer = _noting(layer.register_buffer)
        logger.debug("paddle_dcp notes buffers that shard_layer makes persistable")


class _WhenLoaded(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when paddle's layers module is about to load, it lets the normal
    finder find it, asks its loader to call :func:`_install` after the module ran, and leaves
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
            _install(module)

        setattr(spec.loader, "exec_module", exec_then_install)
        return spec


def watch() -> None:
    """Wrap ``register_buffer`` now if paddle's layers module is loaded, else when it is."""
    layers = sys.modules.get(LAYERS_MODULE)
    if layers is not None:
        _install(layers)
    elif not any(isinstance(f, _WhenLoaded) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenLoaded())
