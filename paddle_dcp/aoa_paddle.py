"""paddle's AOA engine over our shard descriptions: the only module that calls it.

The engine (``paddle.distributed.flex_checkpoint.aoa``) reads the config's statements with
their macros (``$LAYER_ID``, ``$EXPERT_ID``, ``*``, ``^T``, ``fused_qkv``, ``fused_ffn``,
``permute``, ``dtype``), propagates shapes from the checkpoint's tensors, and answers, for a
box of a state-dict tensor, which boxes of which checkpoint tensors fill it. We never parse
the language ourselves; :mod:`paddle_dcp.aoa` turns the answers into reads.
"""
from __future__ import annotations

import logging
from typing import Container, Mapping, Sequence

from . import aoa
from .boxes import Box
from .errors import MismatchError, UnsupportedError

logger = logging.getLogger(__name__)

_ENGINE_ERRORS = (AssertionError, ValueError, KeyError, SyntaxError, RuntimeError, IndexError, TypeError)

Shards = Mapping[str, tuple[str, tuple[int, ...], list[Box]]]


class Remap:
    """The engine built for one load: checkpoint (sources) and every rank's targets.

    Args:
        aoa_config: paddle's config (``{"aoa_statements": [...]}``, optionally
            ``"aoa_config_reverse"``); paddle's traceback printing is off unless asked for.
        sources: checkpoint key -> (dtype, global shape, saved boxes) (:func:`aoa.source_shards`).
        targets: state-dict key -> (dtype, global shape, every rank's boxes) (:func:`aoa.merge_targets`).

    Attributes:
        engine_keys: target keys the engine answers for.
        unmapped: target keys the config does not produce and the checkpoint lacks: left to the
            ordinary key matching (master-weight names), and missing if that fails too.

    Raises:
        UnsupportedError: the engine refused the config (its message included).
    """

    def __init__(self, aoa_config: Mapping, sources: Shards, targets: Shards):
        from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine, split_optimizer_state_key
        from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

        self._desc = ShardedWeightDesc
        self._split = split_optimizer_state_key
        config = {"enable_traceback": False, **dict(aoa.check_config(aoa_config))}
        src = {k: [ShardedWeightDesc(k, b.shape, g, b.offsets, d) for b in boxes] for k, (d, g, boxes) in sources.items()}
        dst = {k: [ShardedWeightDesc(k, b.shape, g, b.offsets, d) for b in boxes] for k, (d, g, boxes) in targets.items()}
        try:
            produced = _produced(config, src, dst)
            models = {split_optimizer_state_key(k)[0] for k in src}
            known = produced | models
            self.unmapped = frozenset(k for k in dst if split_optimizer_state_key(k)[0] not in known)
            kept = {k: v for k, v in dst.items() if k not in self.unmapped}
            self.engine_keys = frozenset(kept)
            self.engine = AOAEngine(aoa_config=config, source_state_shard_info=src, destination_state_shard_info=kept)
        except _ENGINE_ERRORS as exc:
            raise UnsupportedError(f"aoa_config: paddle's AOA engine refused it: {type(exc).__name__}: {exc}") from None
        self._targets = targets

    def maps(self, key: str, dtype: str, global_shape: tuple[int, ...], box: Box) -> list[aoa.SliceMap]:
        """The parts of ``box`` (of state-dict tensor ``key``) and where each comes from.

        Raises:
            MismatchError: the config gives ``key`` another shape than the state dict's.
            UnsupportedError: the engine refused the request (its message included).
        """
        model_key, opt_suffix = self._split(key)
        out = self.engine.output_vars.get(model_key)
        if out is not None and opt_suffix is None and tuple(out.shape) != tuple(global_shape):
            raise MismatchError(f"{key}: aoa_config gives shape {tuple(out.shape)}, state_dict has {tuple(global_shape)}")
        desc = self._desc(key, tuple(box.shape), tuple(global_shape), tuple(box.offsets), dtype)
        try:
            entries = self.engine.find_shard_sources(desc)
        except _ENGINE_ERRORS as exc:
            raise UnsupportedError(f"{key}: paddle's AOA engine: {type(exc).__name__}: {exc}") from None
        return [
            aoa.SliceMap(
                key,
                Box(tuple(e.target_slice.global_offset), tuple(e.target_slice.local_shape)),
                e.source_slice.key,
                Box(tuple(e.source_slice.global_offset), tuple(e.source_slice.local_shape)),
                aoa.steps_of(e.postprocess_list),
            )
            for e in entries
        ]

    def sources_of(self, key: str) -> set[str]:
        """The checkpoint keys the config reads for the whole of ``key``."""
        dtype, shape, _ = self._targets[key]
        return {m.source_key for m in self.maps(key, dtype, shape, Box.whole(shape))}

    def filled(self, keys: Sequence[str], saved: Container[str]) -> tuple[set[str], set[str]]:
        """(the state-dict keys among ``keys`` the config fills, the checkpoint keys it reads
        for them); a key whose sources the checkpoint lacks is not filled: it is missing, as
        without a config."""
        mapped, used = set(), set()
        for key in keys:
            if key in self.unmapped or key not in self.engine_keys:
                continue
            sources = self.sources_of(key)
            if all(s in saved for s in sources):
                mapped.add(key)
                used |= sources
        return mapped, used


def _produced(config: Mapping, src: dict, dst: dict) -> set[str]:
    """Names the statements assign, once the engine's macros have expanded them (the engine
    itself raises a bare KeyError for a target it neither produces nor finds)."""
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAShardInfoContext
    from paddle.distributed.flex_checkpoint.aoa.lexer import Lexer
    from paddle.distributed.flex_checkpoint.aoa.parser import Parser

    reverse = bool(config.get("aoa_config_reverse", False))
    context = AOAShardInfoContext(src, dst, reverse)
    statements = Parser(Lexer(context).all_tokens(list(config.get("aoa_statements", [])))).parse_program()
    return {v.name for s in statements for v in (s.left_vars if reverse else s.right_vars)}
