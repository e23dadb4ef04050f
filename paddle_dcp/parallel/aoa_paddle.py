"""paddle's AOA engine over our shard descriptions: the only module that calls it.

The engine (``paddle.distributed.flex_checkpoint.aoa``) reads the config's statements with
their macros (``$LAYER_ID``, ``$EXPERT_ID``, ``*``, ``^T``, ``fused_qkv``, ``fused_ffn``,
``permute``, ``dtype``), propagates shapes from the checkpoint's tensors, and answers, for a
box of a state-dict tensor, which boxes of which checkpoint tensors fill it. We never parse
the language ourselves; :mod:`paddle_dcp.core.aoa` turns the answers into reads. :class:`Remap`
runs it for a load; :class:`Reverse` runs the same config backwards for an export of a
checkpoint under Hugging Face names (:mod:`paddle_dcp.tools.hf_export`).
"""
from __future__ import annotations

import logging
from typing import Container, Mapping, Sequence

from ..core import aoa
from ..core.boxes import Box
from ..errors import MismatchError, UnsupportedError

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

        self._split = split_optimizer_state_key
        config = {"enable_traceback": False, **dict(aoa.check_config(aoa_config))}
        src, dst = _descs(sources), _descs(targets)
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
        return _slice_maps(self.engine, key, dtype, global_shape, box)

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


def _slice_maps(engine, key: str, dtype: str, global_shape: tuple[int, ...], box: Box) -> list[aoa.SliceMap]:
    """The engine's answer for ``box`` of its output ``key`` as slice maps."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    desc = ShardedWeightDesc(key, tuple(box.shape), tuple(global_shape), tuple(box.offsets), dtype)
    try:
        entries = engine.find_shard_sources(desc)
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


class Reverse:
    """The engine run backwards over a checkpoint, for an export: the config is the one a load
    takes (Hugging Face names -> the checkpoint's names); the outputs are the tensors that load
    would read, each made from boxes of the checkpoint's tensors, as PaddleFormers saves
    Hugging Face weights (``aoa_config_reverse``).

    Only model states are given to the engine (optimizer states and master weights, whose keys
    end in ``.moment1_0``, ``.w_0``... are left out); a checkpoint tensor no statement reads
    is an output of its own name.

    Args:
        aoa_config: the load-direction config (``{"aoa_statements": [...]}``).
        sources: checkpoint key -> (dtype, global shape, saved boxes) (:func:`aoa.source_shards`).

    Attributes:
        outputs: output name -> (dtype, global shape), in the engine's order.
        sources: output name -> the checkpoint keys it is made of.
        skipped: the checkpoint keys left out (optimizer states).

    Raises:
        UnsupportedError: the engine cannot run the config backwards; names the first statement
            (from the end) it refuses, with the engine's message.
    """

    def __init__(self, aoa_config: Mapping, sources: Shards):
        from paddle.distributed.flex_checkpoint.aoa.aoa_engine import split_optimizer_state_key

        config = dict(aoa.check_config(aoa_config))
        config["aoa_config_reverse"] = not bool(config.get("aoa_config_reverse", False))
        config["enable_traceback"] = False
        models = {k: v for k, v in sources.items() if split_optimizer_state_key(k)[1] is None}
        self.skipped = tuple(k for k in sources if k not in models)
        try:
            self.engine = _reverse_engine(config, models)
            made = {k: v for k, v in self.engine.output_vars.items() if v is not None}
            self.outputs = {k: (self._dtype(k, v), tuple(v.shape)) for k, v in made.items()}
        except _ENGINE_ERRORS as exc:
            raise UnsupportedError(_refusal(config, models, exc)) from None
        self.sources = {k: tuple(dict.fromkeys(s[0] for s in v.slices)) for k, v in made.items()}

    def _dtype(self, name: str, tensor) -> str:
        """The output's dtype: its sources' after their casts (paddle's engine keeps the
        source's dtype on the tensor and puts the cast in the postprocess list)."""
        dtypes = set()
        for key, src_slices, _, postprocess in tensor.slices:
            shape = tuple(s.stop - s.start for s in src_slices)
            dtypes.add(aoa.after_steps(shape, self.engine.input_vars[key].dtype, aoa.steps_of(postprocess))[1])
        if len(dtypes) > 1:
            raise ValueError(f"{name} would be made of parts of dtypes {sorted(dtypes)}")
        return dtypes.pop() if dtypes else tensor.dtype

    def maps(self, name: str, box: Box) -> list[aoa.SliceMap]:
        """Where each part of ``box`` of output ``name`` comes from.

        Raises:
            UnsupportedError: the engine refused the request (its message included).
        """
        dtype, shape = self.outputs[name]
        return _slice_maps(self.engine, name, dtype, shape, box)


def _reverse_engine(config: Mapping, sources: Shards):
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine

    return AOAEngine(aoa_config=config, source_state_shard_info=_descs(sources), destination_state_shard_info=None)


def _descs(shards: Shards) -> dict:
    """Shard descriptions as the engine takes them: key -> one ShardedWeightDesc per box."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    return {k: [ShardedWeightDesc(k, b.shape, g, b.offsets, d) for b in boxes] for k, (d, g, boxes) in shards.items()}


def _refusal(config: Mapping, sources: Shards, exc: BaseException) -> str:
    """The engine's refusal of a reversed config, naming the statement: run backwards, the
    statements go last first, so the shortest failing tail of the list starts with it."""
    statements = list(config.get("aoa_statements", []))
    culprit = None
    for i in range(len(statements) - 1, -1, -1):
        try:
            _reverse_engine({**config, "aoa_statements": statements[i:]}, sources)
        except _ENGINE_ERRORS:
            culprit = statements[i]
            break
    where = f" statement {culprit!r}" if culprit is not None else ""
    return f"aoa_config: paddle's AOA engine cannot run{where} backwards: {type(exc).__name__}: {exc}"
