"""How a state dict's keys meet a checkpoint's: key pairing (master-weight spellings too),
plain subtrees restored whole, and the message of a strict load's missing keys.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Sequence

from . import nested
from ..errors import ArgumentError, MismatchError


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
    holders: frozenset = frozenset(),
) -> Reconciled:
    """How a state dict (its tensors' flat keys and its skeleton) meets a checkpoint's tensors
    and structure. Tensors pair by key (master-weight spelling too). Each largest subtree of
    the checkpoint that holds no tensor is restored whole where the state dict has that path and
    holds no tensor there, whatever it holds (a list of another length, None, a dict); a plain
    value of the state dict inside no such subtree is missing. ``holders``: paths of the
    structure's containers that hold tensors it does not show (a part of the metadata).

    Raises:
        MismatchError: a key that is a tensor on one side and a plain value on the other.
    """
    match = match_keys(list(tensor_keys), list(saved_tensors), mw_name_compatibility)
    saved_nodes = nested.node_paths(saved_structure)
    for path in holders:
        if path in saved_nodes:
            saved_nodes[path] = True
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


@dataclass(frozen=True)
class MissingKeys:
    """What a load does with keys of the state dict that the checkpoint lacks.

    Attributes:
        strict: True: such a key is a MismatchError on every rank, unless ``allowed`` names
            it; False: a warning, and the target is left as it was (paddle's contract).
        allowed: regular expressions, each searched in the flat key: keys they match may be
            missing (a warning) while ``strict`` holds for the rest.
    """

    strict: bool = True
    allowed: tuple[str, ...] = ()

    @classmethod
    def of(cls, strict: bool, allow_missing: "str | Sequence[str] | None") -> "MissingKeys":
        """From ``load_state_dict``'s arguments: ``allow_missing`` is None, a regular
        expression or a sequence of them (each checked here: a bad one is an ArgumentError)."""
        if allow_missing is None:
            patterns: tuple[str, ...] = ()
        elif isinstance(allow_missing, str):
            patterns = (allow_missing,)
        elif isinstance(allow_missing, (list, tuple, set, frozenset)):
            patterns = tuple(allow_missing)
        else:
            raise ArgumentError(f"allow_missing takes a regular expression or a list of them, got {allow_missing!r}")
        for pattern in patterns:
            compiled_regex(pattern, "allow_missing")
        return cls(bool(strict), patterns)

    def allows(self, key: str) -> bool:
        return any(re.search(p, key) for p in self.allowed)


def compiled_regex(pattern: Any, what: str) -> "re.Pattern[str]":
    """``pattern`` compiled, for the argument ``what``.

    Raises:
        ArgumentError: not a str, or not a regular expression (naming ``what`` and why).
    """
    if not isinstance(pattern, str):
        raise ArgumentError(f"{what} takes regular expressions (str), got {type(pattern).__name__}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ArgumentError(f"{what}: {pattern!r} is not a regular expression: {exc}") from None


def report(
    missing: Sequence[str], unexpected: Sequence[str], where: str, policy: MissingKeys, log: logging.Logger,
    buffers: Sequence[str] = (),
) -> None:
    """What a load says of keys on one side only: a state-dict key the checkpoint lacks is a
    MismatchError under a strict ``policy`` unless it allows the key, else a warning; a
    checkpoint key the state dict lacks is a warning (on ``log``, the calling module's logger).
    ``buffers``: keys of the state dict that look like buffers (the error says so)."""
    refused = [k for k in missing if policy.strict and not policy.allows(k)]
    if refused:
        buffered = set(buffers)  # once: a key is looked up in it, not the list rebuilt per key
        raise MismatchError(missing_message(refused, where, [k for k in refused if k in buffered]))
    if missing:
        log.warning("keys of the state_dict not found in %s (left unchanged): %s", where, list(missing))
    if unexpected:
        log.warning("keys of %s not in the state_dict (not loaded): %s", where, list(unexpected))


_ANY_PREFIX = r"(^|\.)"  # a key's last component, at the top level or under any prefix


def missing_message(missing: Sequence[str], where: str, buffers: Sequence[str] = ()) -> str:
    """The error of a strict load whose state dict has keys the checkpoint lacks."""
    shown = ", ".join(missing[:20])
    more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
    text = (
        f"{len(missing)} key(s) of the state_dict are not in {where}: {shown}{more}. A load "
        f"leaves no tensor of a state dict unloaded silently; pass allow_missing=[regular "
        f"expressions] to let the keys they match be missing while the rest stays strict, "
        f"strict=False to leave every missing key unchanged (with a warning), or check the "
        f"checkpoint and the key names"
    )
    if buffers:
        patterns = [_ANY_PREFIX + re.escape(n) + "$" for n in sorted({k.rsplit(".", 1)[-1] for k in buffers})]
        text += (
            f". {len(buffers)} of them look like buffers, not parameters ({', '.join(buffers[:5])}): a "
            f"buffer the model declared non-persistable is in the state dict of a model made "
            f"parallel with paddle's dist.shard_layer (which registers every buffer as persistable) "
            f"and not in one saved on one process; if that is so, allow them: allow_missing="
            f"{patterns!r}"
        )
    return text
