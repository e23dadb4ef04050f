"""get_state_dict / set_state_dict: a model and its optimizer as one state dict whose keys
survive a change of layout, of rank count and of paddle's generated names.

Paddle keys an optimizer's state by generated names (``linear_0.w_0_moment1_0``, with
``.dist`` inside under ``dist.shard_layer``) that depend on the order in which layers were
created and on the layout; a resumed job whose model was built in another order would not
find its state. Like ``torch.distributed.checkpoint.state_dict``, which keys optimizer state by
the parameter's fully qualified name, these helpers key it by the parameter's structured name
in the model plus the kind of state::

    {"model": model.state_dict(),
     "optim": {"fc1.weight.moment1": ..., "fc1.weight.moment2": ...,
               "fc1.weight.beta1_pow_acc": ..., "fc1.weight.beta2_pow_acc": ...,
               "fc1.weight.master_weight": ...,      # multi_precision only
               "LR_Scheduler": {"last_epoch": 5, "last_lr": 0.0025}}}

The tensors are the live ones (the model's parameters, the optimizer's accumulators), so
``paddle_dcp.load_state_dict`` fills them in place; ``set_state_dict`` then restores what is
not a tensor (the LR scheduler) and copies any tensor that is not the live one.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .core import keys
from .errors import MismatchError, StateDictError

logger = logging.getLogger(__name__)

MASTER_WEIGHT = "master_weight"


def _innermost(optimizer):
    """The optimizer that holds the state (``dist.shard_optimizer`` and fleet wrap one)."""
    seen = 0
    while "_inner_opt" in getattr(optimizer, "__dict__", {}) and seen < 8:
        optimizer = optimizer.__dict__["_inner_opt"]
        seen += 1
    return optimizer


def _parameters(base) -> list:
    params = list(base._parameter_list or [])
    if params and isinstance(params[0], dict):
        params = [p for group in base._param_groups for p in group["params"]]
    return params


def _ensure_accumulators(optimizer) -> None:
    """Create the optimizer's states for every trainable parameter that has none yet, without a
    step: paddle creates them lazily, in the first ``step()``, but a load needs them to exist.
    ``dist.shard_optimizer`` is called itself, so its states are sharded as a step would
    shard them. Parameters and the LR scheduler do not change."""
    import paddle

    base = _innermost(optimizer)
    have: set[str] = set()
    for by_param in base._accumulators.values():
        have.update(by_param)
    masters = getattr(base, "_master_weights", {}) or {}

    def created(p) -> bool:
        return p.name in have or (p.name in masters and masters[p.name].name in have)

    missing = [p for p in _parameters(base) if not p.stop_gradient and not created(p)]
    if missing:
        block = paddle.static.default_main_program().global_block()
        optimizer._create_accumulators(block, missing)


def _structured_names(model, base) -> dict[str, str]:
    """paddle's name of every parameter (and of its master weight) -> its structured name."""
    names = {}
    masters = getattr(base, "_master_weights", {}) or {}
    for structured, p in model.named_parameters():
        names.setdefault(p.name, structured)
        if p.name in masters:
            names.setdefault(masters[p.name].name, structured)
    return names


def _optim_entries(model, optimizer) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """(our key -> live tensor or plain entry, our key -> paddle's key for accumulators,
    our key -> parameter name for master weights)."""
    base = _innermost(optimizer)
    names = _structured_names(model, base)
    prefix = f"{base._name}_" if getattr(base, "_name", None) else ""
    out: dict[str, Any] = {}
    paddle_key: dict[str, str] = {}
    master_of: dict[str, str] = {}
    unnamed = []

    def put(key: str, value) -> None:
        if key in out:
            raise StateDictError(f"two optimizer states map to the key {key!r}; rename the parameters")
        out[key] = value

    for kind, by_param in base._accumulators.items():
        short = kind[len(prefix):] if prefix and kind.startswith(prefix) else kind
        for pname, var in by_param.items():
            structured = names.get(pname)
            if structured is None:
                unnamed.append(var.name)
                key = var.name
            else:
                key = f"{structured}.{short}"
            put(key, var)
            paddle_key[key] = var.name
    for pname, var in (getattr(base, "_master_weights", {}) or {}).items():
        structured = names.get(pname)
        if structured is None:
            unnamed.append(f"master_weights.{pname}")
        key = f"{structured}.{MASTER_WEIGHT}" if structured is not None else f"master_weights.{pname}"
        put(key, var)
        master_of[key] = pname
    if unnamed:
        logger.warning("optimizer states of parameters that are not in the model keep paddle's names: %s", unnamed)
    taken = set(paddle_key.values())
    for key, value in base.state_dict().items():  # the LR scheduler and whatever else is there
        if key != "master_weights" and key not in taken:
            put(key, value)
    return out, paddle_key, master_of


def model_state(model) -> dict:
    """``model.state_dict()`` without the buffers the model declared non-persistable and
    paddle's ``shard_layer`` made persistable (:mod:`paddle_dcp.patching`)."""
    from .patching import forgotten_keys

    state = model.state_dict()
    for key in forgotten_keys(model) & set(state):
        del state[key]
    return state


def get_state_dict(model, optimizer=None) -> dict:
    """The state of a model and its optimizer, keyed by names that survive a change of layout.

    Returns ``{"model": ..., "optim": {...}}``: the model's state dict without the buffers it
    declared non-persistable (paddle's ``dist.shard_layer`` registers them again as
    persistable; they are left out all the same, so every layout gives the same keys), and the
    optimizer's states keyed
    by the parameter's structured name plus the kind (``"fc1.weight.moment1"``,
    ``"fc1.weight.master_weight"``), and its other entries (``"LR_Scheduler"``) as they are.
    The tensors are the live ones: ``paddle_dcp.load_state_dict`` fills them in place and
    ``paddle_dcp.save_state_dict`` saves them. Optimizer states paddle has not created yet
    (before the first step) are created first, zero (beta powers at beta), without a step:
    no parameter changes.

    Args:
        model: a ``paddle.nn.Layer`` (``dist.shard_layer`` or not).
        optimizer: its optimizer (``dist.shard_optimizer`` or not), or None for the model only.

    Raises:
        StateDictError: two states map to the same key.
    """
    out = {"model": model_state(model)}
    if optimizer is not None:
        _ensure_accumulators(optimizer)
        out["optim"] = _optim_entries(model, optimizer)[0]
    return out


def set_state_dict(model, optimizer, state: dict) -> None:
    """Put ``state`` (as :func:`get_state_dict` returns it, loaded) back into the model and
    the optimizer.

    Tensors that are the live ones (loaded in place) are left as they are; others are copied
    into the live tensors, in their layout: a dist tensor of the same mesh and placements local
    piece to local piece, a whole (plain) tensor or numpy array by taking the box this rank
    holds. The LR scheduler's state and the optimizer's other entries go through the
    optimizer's own ``set_state_dict``. Keys on one side only are reported as warnings.

    Args:
        model: the model.
        optimizer: its optimizer, or None.
        state: ``{"model": {...}, "optim": {...}}``; other top-level keys are ignored.

    Raises:
        MismatchError: a tensor whose shape or dtype differs, or a dist tensor of another mesh.
    """
    live_model = model_state(model)
    _copy_all("model", live_model, state.get("model", {}))
    if optimizer is None:
        return
    _ensure_accumulators(optimizer)
    live, paddle_key, master_of = _optim_entries(model, optimizer)
    given = state.get("optim", {})
    live_tensors = {k: v for k, v in live.items() if _is_tensor(v)}
    _copy_all("optim", live_tensors, {k: v for k, v in given.items() if k in live_tensors or (k not in live and _is_tensor(v))})
    kept = [k for k in live if k not in live_tensors and k not in given]
    if kept:
        logger.warning("optim: entries not in the given state (the optimizer keeps its own): %s", kept)
    paddle_sd: dict[str, Any] = {}
    masters = {}
    for key, value in live.items():
        if key in paddle_key:
            paddle_sd[paddle_key[key]] = value
        elif key in master_of:
            masters[master_of[key]] = value
        else:
            paddle_sd[key] = given.get(key, value)
    if masters:
        paddle_sd["master_weights"] = masters
    _innermost(optimizer).set_state_dict(paddle_sd)


def _is_tensor(value) -> bool:
    from .parallel.placements import is_tensor

    return is_tensor(value)


def _copy_all(part: str, live: dict, given: dict) -> None:
    """Copy ``given`` into the ``live`` tensors of ``part``; keys on one side only are said as
    a load says them (:func:`paddle_dcp.core.keys.report`, paddle's contract: warnings)."""
    missing = [k for k in live if k not in given]
    unexpected = [k for k in given if k not in live]
    keys.report(missing, unexpected, f"the given {part} state", keys.MissingKeys(strict=False), logger)
    for key, target in live.items():
        if key in given and _is_tensor(target):
            _copy_into(target, given[key], f"{part}.{key}")


def _copy_into(target, source, key: str) -> None:
    """Copy ``source`` into the live tensor ``target`` in place, in ``target``'s layout."""
    if source is target:
        return
    import paddle
    import paddle.distributed as dist

    from .parallel.device import dtype_name, host_bytes
    from .parallel.targets import key_targets, target_buffer
    from .core.dtypes import name_of_numpy
    from .parallel.placements import describe

    if not _is_tensor(source):
        raise MismatchError(f"{key}: expected a tensor, got {type(source).__name__}")
    held = describe(key, target, dist.get_rank())
    src_dtype = name_of_numpy(source.dtype) if isinstance(source, np.ndarray) else dtype_name(source)
    src_shape = tuple(int(s) for s in source.shape)
    if src_dtype != held.piece.dtype or src_shape != held.piece.global_shape:
        raise MismatchError(
            f"{key}: the given state has {src_dtype} of shape {src_shape}, the live tensor "
            f"{held.piece.dtype} of shape {held.piece.global_shape}"
        )
    if held.local is None:
        return
    if held.partial:
        raise MismatchError(f"{key}: copying into a Partial tensor is not supported; load into it with load_state_dict")
    if isinstance(source, paddle.Tensor) and source.is_dist():
        if source.process_mesh != target.process_mesh:
            raise MismatchError(
                f"{key}: the given dist tensor lives on mesh {source.process_mesh}, the live one on "
                f"{target.process_mesh}; load into the live tensors with load_state_dict instead"
            )
        if [str(p) for p in source.placements] == [str(p) for p in target.placements]:
            piece = host_bytes(source._local_value()).array
        else:  # replicated, then sliced: paddle's CPU build has no all_to_all for Shard -> Shard
            whole = dist.reshard(source, source.process_mesh, [dist.Replicate()] * len(source.placements))
            piece = host_bytes(whole._local_value()).array[held.piece.box.slices() + (Ellipsis,)]
    else:
        piece = host_bytes(source).array[held.piece.box.slices() + (Ellipsis,)]
    buffer = target_buffer(held, offload=False)
    (_, view), = key_targets(held, buffer)  # one box: a live tensor is no flattened ShardedWeight
    view[...] = piece
    buffer.finish()
