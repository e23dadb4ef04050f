"""Master weights derived on load: the float32 tensors a save leaves out because they are their
float16 / bfloat16 parameter cast up, the parameter each one is found to derive from, and the
checks the coordinator makes of what the ranks found.

``save_state_dict(..., compress={MASTER_WEIGHTS: "derived"})``: a float32 tensor whose key the
regex matches is not stored. Each rank finds, at save time, the parameter of every such key it
holds (:func:`find_sources`); the metadata records it as the entry's ``source``, so a load
needs no guessing: it reads the parameter's pieces for its box and casts them to float32.

How a master weight's parameter is found, first rule that finds one:

1. by paddle's tensor names: a key ``<...>.master_weights.<name>`` (paddle's optimizer
   ``state_dict()["master_weights"]`` is ``{param.name: tensor}``), or a tensor whose own name
   is ``<name>_fp32_master_<n>`` (the name paddle gives a master weight, which its flex
   ``sharded_state_dict`` and ``paddle_dcp.get_state_dict`` keep): the parameter is the saved
   tensor named ``<name>``;
2. by the key: ``<stem>.w_0`` (flex ``sharded_state_dict``, PaddleFormers) or
   ``<stem>.master_weight`` (``paddle_dcp.get_state_dict``): the parameter is the saved key
   ``<stem>``, or the key that differs from ``<stem>`` only in its first component
   (``opt.fc.weight.w_0`` -> ``model.fc.weight``).

The parameter must be float16 or bfloat16 and of the master weight's global shape. A master
weight whose parameter the save does not hold is an error naming both (never saved plain
silently: the caller asked for a smaller checkpoint).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..errors import MismatchError

DERIVED = "derived"  # the encoding name of a tensor derived from another (no stored pieces)
DERIVED_DTYPES = ("float32",)  # what a derived tensor may be
SOURCE_DTYPES = ("float16", "bfloat16")  # what it may derive from
# master weights as paddle's optimizer keys them (``opt.master_weights.linear_0.w_0``), as flex
# checkpoints and PaddleFormers do (``llama.embed_tokens.weight.w_0``), as paddle_dcp's
# get_state_dict does (``fc1.weight.master_weight``)
MASTER_WEIGHTS = r"(?:^|\.)master_weights\.|\.w_0$|\.master_weight$"
_MASTER_NAME = re.compile(r"^(.+)_fp32_master(?:_\d+)?$")
_STEM_SUFFIXES = (".w_0", ".master_weight")


@dataclass(frozen=True)
class Candidate:
    """A tensor of a rank's state dict, as the search for parameters sees it.

    Attributes:
        key: flat state-dict key.
        dtype: the format's dtype name.
        shape: global shape, in elements.
        name: paddle's name of the tensor (``linear_0.w_0``), None when it has none (numpy).
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    name: str | None = None


def param_name(key: str, name: str | None) -> str | None:
    """paddle's name of the parameter of master weight ``key`` (tensor name ``name``), when the
    key (``...master_weights.<name>``) or the tensor's own name (``<name>_fp32_master_0``) says."""
    parts = key.split(".")
    if "master_weights" in parts[:-1]:
        return ".".join(parts[parts.index("master_weights") + 1 :])
    found = _MASTER_NAME.match(name) if name else None
    return found.group(1) if found else None


def stem_keys(key: str, keys: Iterable[str]) -> list[str]:
    """The keys among ``keys`` that master weight ``key`` (``<stem>.w_0`` or
    ``<stem>.master_weight``) names as its parameter: ``<stem>`` itself, or a key that differs
    from it only in the first component; equal ones first."""
    stem = next((key[: -len(s)] for s in _STEM_SUFFIXES if key.endswith(s)), None)
    if not stem:
        return []
    rest = stem.split(".", 1)[1] if "." in stem else None
    same = [k for k in keys if k == stem]
    near = [k for k in keys if rest is not None and k != stem and "." in k and k.split(".", 1)[1] == rest]
    return same + sorted(near)


def find_sources(tensors: Sequence[Candidate], derives: Iterable[str]) -> dict[str, str]:
    """The parameter key of every master weight among ``tensors`` whose key is in ``derives``
    (the keys a policy stores as derived).

    Raises:
        MismatchError: a master weight whose parameter the state dict does not hold (naming
            both), or whose only candidates have another dtype or shape (naming both and
            their shapes and dtypes), or two keys it could be.
    """
    by_key = {t.key: t for t in tensors}
    by_name: dict[str, list[Candidate]] = {}
    for t in tensors:
        if t.name:
            by_name.setdefault(t.name, []).append(t)
    out = {}
    for key in derives:
        master = by_key[key]
        out[key] = _source_of(master, by_key, by_name)
    return out


def _source_of(master: Candidate, by_key: Mapping[str, Candidate], by_name: Mapping[str, list[Candidate]]) -> str:
    pname = param_name(master.key, master.name)
    named = sorted((t for t in by_name.get(pname, ()) if t.key != master.key), key=lambda t: t.key) if pname else []
    if named:  # several keys of one name hold one tensor (tied weights): any of them will do
        return _fitting(master, named, f"named {pname!r}")[0]
    stems = [by_key[k] for k in stem_keys(master.key, by_key)]
    if stems:
        fit = _fitting(master, stems, "by its key")
        stem = master.key.rsplit(".", 1)[0]
        if len(fit) > 1 and fit[0] != stem:
            raise MismatchError(
                f"{master.key}: compress derives this master weight from its parameter, and the keys {fit} could "
                f"each be it: save one of them, or leave {master.key} out of compress"
            )
        return fit[0]
    sought = f"named {pname!r}" if pname else "keyed as its stem (<stem>.w_0 or <stem>.master_weight)"
    raise MismatchError(
        f"{master.key}: compress derives this master weight from its float16/bfloat16 parameter, but the save "
        f"holds no tensor {sought}: save the parameter in the same call, or leave {master.key} out of compress"
    )


def _fitting(master: Candidate, found: Sequence[Candidate], how: str) -> list[str]:
    """The keys of ``found`` that a master weight can derive from (float16/bfloat16 tensors of
    the master's shape), in order; raises MismatchError naming both when there is none."""
    fit = [t.key for t in found if t.dtype in SOURCE_DTYPES and tuple(t.shape) == tuple(master.shape)]
    if not fit:
        t = found[0]
        raise MismatchError(
            f"{master.key}: compress derives this master weight ({master.dtype}, shape {tuple(master.shape)}) from "
            f"its parameter {t.key} ({how}), which is {t.dtype}, shape {tuple(t.shape)}: a master weight derives "
            f"from a float16 or bfloat16 parameter of its shape"
        )
    return fit


def check_sources(
    found: Iterable[tuple[int, Mapping[str, str]]],
    info: Mapping[str, Sequence[Any]],
    derives: Iterable[str],
) -> dict[str, str]:
    """The coordinator's view of what every rank found: master weight key -> parameter key.

    Args:
        found: (rank, its master weight -> parameter) for every rank.
        info: every key of the save -> (dtype, global shape, ...).
        derives: the keys the policy stores as derived.

    Raises:
        MismatchError: two ranks that found different parameters for one key (naming both),
            a key to derive that no rank found a parameter for, or a parameter that is not a
            float16/bfloat16 tensor of its master weight's shape.
    """
    sources: dict[str, str] = {}
    by: dict[str, int] = {}
    for rank, pairs in found:
        for master, param in pairs.items():
            if sources.setdefault(master, param) != param:
                raise MismatchError(
                    f"{master}: rank {by[master]} derives it from {sources[master]}, rank {rank} from {param}: "
                    f"the ranks' parameters of one name differ (name the parameters alike on every rank)"
                )
            by.setdefault(master, rank)
    for key in derives:
        if key not in sources:
            raise MismatchError(f"{key}: compress derives it, but no rank found its parameter")
    for master, param in sources.items():
        m, p = info.get(master), info.get(param)
        if m is None or p is None or m[0] not in DERIVED_DTYPES or p[0] not in SOURCE_DTYPES or m[1] != p[1]:
            said = lambda key, i: f"{key} ({i[0]}, shape {tuple(i[1])})" if i else f"{key} (not in the save)"  # noqa: E731
            raise MismatchError(
                f"{said(master, m)} cannot derive from {said(param, p)}: a float32 master weight derives from a "
                f"float16 or bfloat16 parameter of its shape"
            )
    return sources
