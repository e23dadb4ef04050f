"""Which tensors a save stores quantized or leaves to be derived: a policy of regular
expressions over flat keys, each naming an encoding of :mod:`~paddle_dcp.core.quant` or
``"derived"`` (:mod:`~paddle_dcp.core.derive`), and the ready policies for AdamW's moments and
master weights.

``save_state_dict(..., compress={regex: "int8" | "int4" | "derived"})``: each regex is searched
(``re.search``) in a tensor's flat key, in the mapping's order; the first that matches names
its encoding. A matched tensor of a dtype that cannot be encoded (integers, bool, float64,
complex) is saved plain: only float16, bfloat16 and float32 tensors are quantized, and only
float32 tensors derived (from their float16 / bfloat16 parameter).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from . import quant
from .derive import DERIVED, DERIVED_DTYPES, MASTER_WEIGHTS
from .keys import compiled_regex
from ..errors import ArgumentError

# AdamW's first and second moments, as paddle's optimizers key them (``linear_0.w_0_moment1_0``),
# as flex checkpoints and PaddleFormers' sharded state dicts do (``llama.embed_tokens.weight.moment1_0``),
# as PaddleFormers' unified checkpoint does (``llama.embed_tokens.weight/moment1_0``), and as
# paddle_dcp.get_state_dict does (``fc1.weight.moment1``). AMSGrad's ``moment2_max`` is included.
ADAMW_MOMENTS = r"[._/]moment(?:1|2|2_max)(?:_\d+)?$"
ADAMW_MOMENTS_INT8: Mapping[str, str] = MappingProxyType({ADAMW_MOMENTS: "int8"})
ADAMW_MOMENTS_INT4: Mapping[str, str] = MappingProxyType({ADAMW_MOMENTS: "int4"})
# master weights left out of the checkpoint and derived on load from their parameter
MASTER_WEIGHTS_DERIVED: Mapping[str, str] = MappingProxyType({MASTER_WEIGHTS: DERIVED})
ENCODING_NAMES = tuple(sorted(quant.ENCODINGS)) + (DERIVED,)


@dataclass(frozen=True)
class Policy:
    """A checked ``compress`` argument: (pattern, encoding) rules, first match wins.

    Attributes:
        rules: the regexes as given, with their encodings' names, in order.
    """

    rules: tuple[tuple[str, str], ...]

    def encoding_of(self, key: str, dtype: str) -> str | None:
        """The encoding tensor ``key`` of dtype ``dtype`` is stored with (None: plain;
        ``"derived"``: not stored, derived from its parameter)."""
        if dtype not in quant.ENCODABLE:
            return None
        for pattern, name in self._compiled():
            if pattern.search(key) is not None:
                return name if name != DERIVED or dtype in DERIVED_DTYPES else None
        return None

    @property
    def derives(self) -> bool:
        """Whether some rule derives tensors (a save then looks for their parameters)."""
        return any(name == DERIVED for _, name in self.rules)

    def _compiled(self) -> tuple[tuple[re.Pattern, str], ...]:
        compiled = self.__dict__.get("_regexes")
        if compiled is None:
            compiled = tuple((re.compile(p), n) for p, n in self.rules)
            object.__setattr__(self, "_regexes", compiled)
        return compiled


def policy_of(compress: Any) -> Policy | None:
    """The policy of a ``compress`` argument (None or an empty mapping: nothing compressed).

    Raises:
        ArgumentError: not a mapping of regex strings to encoding names, a regex that does
            not compile, or an encoding this version does not have.
    """
    if compress is None or isinstance(compress, Policy):
        return compress
    if not isinstance(compress, Mapping):
        raise ArgumentError(
            f"compress must be a mapping {{regex: encoding}} (e.g. paddle_dcp.ADAMW_MOMENTS_INT8), "
            f"got {type(compress).__name__}"
        )
    rules = []
    for pattern, name in compress.items():
        compiled_regex(pattern, "compress")
        if name not in ENCODING_NAMES:
            raise ArgumentError(f"compress: {pattern!r} names encoding {name!r}; the encodings are {', '.join(ENCODING_NAMES)}")
        rules.append((pattern, name))
    return Policy(tuple(rules)) if rules else None
