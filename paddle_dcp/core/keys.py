"""How a state dict's keys meet a checkpoint's: key pairing (master-weight spellings too),
plain subtrees restored whole, and the message of a strict load's missing keys.
"""
from __future__ import annotations

import logging

from dataclasses import dataclass
from typing import Sequence

from . import nested
from ..errors import MismatchError


def mw_compatible_name(key: str) -> str | None:
    """The other spelling of an optimizer master weight's key, as paddle.distributed's
    ``mw_name_compatibility`` maps them: ``opt.master_weights.w`` <-> ``opt.w_fp32_master_0``."""
    parts = key.split(".")
    if "master_weights" in parts:
        parts.remove("master_weights")
        return ".".join(parts) + "_fp32_master_0"
    if parts[-1].endswith("_fp32_master_0"):
        parts[-1] = parts[-1][: -len("_fp32_master_0")]
        parts.insert(1, "master_weights")
        return ".".join(parts)
    return None


@dataclass(frozen=True)
class KeyMatch:
    """How a state dict's keys meet a checkpoint's.

    Attributes:
        source: state-dict key -> checkpoint key to load it from.
        missing: state-dict keys the checkpoint lacks (left untouched).
        unexpected: checkpoint keys the state dict lacks (not loaded).
    """

    source: dict[str, str]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def match_keys(wanted: Sequence[str], available: Sequence[str], mw_name_compatibility: bool = True) -> KeyMatch:
    """Pair state-dict keys with checkpoint keys, trying the master-weight spelling of a key
    the checkpoint lacks when ``mw_name_compatibility`` is on."""
    have = set(available)
    source, missing = {}, []
    for key in wanted:
        if key in have:
            source[key] = key
            continue
        alt = mw_compatible_name(key) if mw_name_compatibility else None
        if alt is not None and alt in have:
            source[key] = alt
        else:
            missing.append(key)
    used = set(source.values())
    unexpected = tuple(k for k in available if k not in used)
    return KeyMatch(source, tuple(missing), unexpected)


@dataclass(frozen=True)
class Reconciled:
    """How a state dict meets a checkpoint (see :func:`reconcile`).

    Attributes:
        match: the tensors' pairing.
        missing: state-dict keys (tensors and plain values) the checkpoint lacks.
        unexpected: checkpoint keys the state dict lacks (not loaded).
        plain: the checkpoint's subtrees without tensors that a load puts into the state dict
            whole, as (path, skeleton node).
    """

    match: KeyMatch
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    plain: tuple[tuple[tuple, dict], ...]


def reconcile(
    tensor_keys: Sequence[str],
    skeleton: dict,
    saved_tensors: Sequence[str],
    saved_structure: dict,
    mw_name_compatibility: bool = True,
    where: str = "checkpoint",
) -> Reconciled:
    """How a state dict (its tensors' flat keys and its skeleton) meets a checkpoint's tensors
    and structure. Tensors pair by key (master-weight spelling too). Each largest subtree of
    the checkpoint that holds no tensor is restored whole where the state dict has that path and
    holds no tensor there, whatever it holds (a list of another length, None, a dict); a plain
    value of the state dict inside no such subtree is missing.

    Raises:
        MismatchError: a key that is a tensor on one side and a plain value on the other.
    """
    match = match_keys(list(tensor_keys), list(saved_tensors), mw_name_compatibility)
    saved_nodes = nested.node_paths(saved_structure)
    holds_tensor = {nested.flat_key(path): holds for path, holds in saved_nodes.items() if path}
    for key in match.missing:
        if not holds_tensor.get(key, True):
            raise MismatchError(f"{key}: the {where} holds a plain value here, the state_dict a tensor")
    target_nodes = nested.node_paths(skeleton)
    tensors = set(saved_tensors)
    plain, unexpected, restored = [], [], set()
    for path, node in nested.plain_subtrees(saved_structure, saved_nodes):
        if path not in target_nodes:
            unexpected.append(nested.flat_key(path))
        elif not target_nodes[path]:
            plain.append((path, node))
            restored.add(path)
    missing = list(match.missing)
    for path, tag, _ in nested.walk(skeleton):
        if tag == "t":
            continue
        key = nested.flat_key(path)
        if key in tensors:
            raise MismatchError(f"{key}: the {where} holds a tensor here, the state_dict a plain value")
        if not any(path[:i] in restored for i in range(1, len(path) + 1)):
            missing.append(key)
    return Reconciled(match, tuple(missing), tuple(match.unexpected) + tuple(unexpected), tuple(plain))


def report(
    missing: Sequence[str], unexpected: Sequence[str], where: str, strict: bool, log: logging.Logger
) -> None:
    """What a load says of keys on one side only: with ``strict`` a state-dict key the
    checkpoint lacks is a MismatchError, else a warning; a checkpoint key the state dict lacks
    is a warning (on ``log``, the calling module's logger)."""
    if missing and strict:
        raise MismatchError(missing_message(missing, where))
    if missing:
        log.warning("keys of the state_dict not found in %s (left unchanged): %s", where, list(missing))
    if unexpected:
        log.warning("keys of %s not in the state_dict (not loaded): %s", where, list(unexpected))


def missing_message(missing: Sequence[str], where: str) -> str:
    """The error of a strict load whose state dict has keys the checkpoint lacks."""
    shown = ", ".join(missing[:20])
    more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
    return (
        f"{len(missing)} key(s) of the state_dict are not in {where}: {shown}{more}. A load "
        f"leaves no tensor of a state dict unloaded silently; pass strict=False to leave these "
        f"keys unchanged (with a warning), or check the checkpoint and the key names"
    )
