"""The ``convert`` command: a checkpoint to one safetensors, pdparams or npz file, or to a
Hugging Face directory (optionally renamed by an AOA config)."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Iterator

from . import consolidate
from ..errors import ArgumentError, DcpError, UnsupportedError
from ..io import is_url, open_storage
from ..io.storage import list_checkpoints, read_metadata
from .console import EXIT_OK, ProgressBar, UsageError, _directory, _err, _one_line, _out, _progress_enabled, choose_id


FORMATS = ("safetensors", "pdparams", "npz", "hf")


@contextmanager
def _keys_option() -> Iterator[None]:
    """A bad key pattern, named by its option: the library says only what is wrong with it."""
    try:
        yield
    except ArgumentError as exc:
        raise ArgumentError(f"--keys {exc}") from None


def _convert_file(path: str, meta, out: str, to: str, selection, bf16_as_float32: bool, progress) -> int:
    """consolidate.convert; a tensor the format refuses gets the options that avoid it."""
    try:
        return consolidate.convert(path, meta, out, to, selection, bf16_as_float32, progress)
    except UnsupportedError as exc:
        if to != "safetensors":
            raise
        raise UnsupportedError(f"{exc}; leave it out with --keys or convert --to npz") from None


def cmd_convert(args) -> int:
    path = _directory(args.path)
    to = args.to
    if to is None:
        ext = os.path.splitext(args.out)[1].lstrip(".").lower()
        if ext not in FORMATS:
            raise UsageError(f"cannot tell the format from {args.out!r}: pass --to {'|'.join(FORMATS)}")
        to = ext
    if to == "hf":
        return _convert_hf(path, args)
    if args.max_shard_size is not None or args.aoa_config is not None:
        raise UsageError(f"{'--max-shard-size' if args.max_shard_size is not None else '--aoa-config'} applies to --to hf only")
    if not is_url(args.out) and os.path.isdir(args.out):
        raise UsageError(f"{args.out} is a directory; OUT is the file to write")
    listing = list_checkpoints(open_storage(path))
    uid = choose_id(path, listing, args.unique_id)
    meta = read_metadata(open_storage(path), uid, lazy=True)
    with _keys_option():
        selection = consolidate.select(meta, args.keys)
    if args.keys is not None and not selection.keys and not selection.values:
        raise UsageError(f"--keys {args.keys!r} matches no key of checkpoint {uid}")
    total = consolidate.selected_bytes(meta, selection, args.bf16_as_float32)
    with ProgressBar(total, f"convert {uid}", _progress_enabled(args)) as bar:
        size = _convert_file(path, meta, args.out, to, selection, args.bf16_as_float32, bar.update)
    _out(
        f"wrote {len(selection.keys)} tensors ({total} bytes) and {len(selection.values)} values of "
        f"checkpoint {uid} to {args.out} ({to}, {size} bytes)"
    )
    bf16 = [k for k in selection.keys if meta.tensors[k].dtype == "bfloat16"]
    if bf16 and not args.bf16_as_float32 and to == "npz":
        _err(f"note: {len(bf16)} bfloat16 tensors are stored as uint16 bit patterns (--bf16-as-float32 for values)")
    _note_dequantized(meta, selection.keys)
    return EXIT_OK


def _note_dequantized(meta, keys) -> None:
    """Say that tensors the checkpoint holds quantized were written as their dequantized values,
    and derived ones (not stored) as their sources' values cast to their dtype."""
    derived = [k for k in keys if meta.tensors[k].derived]
    encoded = sorted({meta.tensors[k].encoding for k in keys if not meta.tensors[k].derived} - {None})
    if encoded:
        count = sum(1 for k in keys if meta.tensors[k].encoding is not None and not meta.tensors[k].derived)
        _err(
            f"note: {count} tensors stored quantized ({', '.join(encoded)}) are written dequantized, in their dtype: "
            f"the values a load gives, not the values that were saved"
        )
    if derived:
        _err(
            f"note: {len(derived)} tensors the checkpoint derives (master weights it does not store, e.g. {derived[0]}) "
            f"are written as their parameters' values cast to their dtype: the values a load gives, not the master "
            f"weights that were trained (--keys leaves them out)"
        )


def _convert_hf(path: str, args) -> int:
    """convert --to hf: a Hugging Face directory of shards and their index."""
    from ..gather import parse_size
    from .hf_export import DEFAULT_MAX_SHARD, export

    try:
        max_bytes = parse_size(args.max_shard_size or DEFAULT_MAX_SHARD)
    except DcpError:
        raise UsageError(f"--max-shard-size must be a size like 5GB, 512MB, 64K; got {args.max_shard_size!r}") from None
    if not is_url(args.out) and os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise UsageError(f"{args.out} exists and is not an empty directory; --to hf writes a new directory")
    listing = list_checkpoints(open_storage(path))
    uid = choose_id(path, listing, args.unique_id)
    meta = read_metadata(open_storage(path), uid, lazy=True)
    if args.aoa_config is not None:
        return _convert_hf_remapped(path, uid, meta, args, max_bytes)
    with _keys_option():
        selection = consolidate.select(meta, args.keys)
    if args.keys is not None and not selection.keys:
        raise UsageError(f"--keys {args.keys!r} matches no tensor of checkpoint {uid}")
    total = consolidate.selected_bytes(meta, selection, args.bf16_as_float32)
    with ProgressBar(total, f"convert {uid}", _progress_enabled(args)) as bar:
        names = export(path, meta, args.out, selection, max_bytes, args.bf16_as_float32, bar.update)
    _out(f"wrote {len(selection.keys)} tensors ({total} bytes) of checkpoint {uid} to {args.out}: {', '.join(names)}")
    _note_dequantized(meta, selection.keys)
    if selection.values:
        _err(f"note: {len(selection.values)} plain values are not exported (a Hugging Face directory holds tensors only)")
    return EXIT_OK


def _convert_hf_remapped(path: str, uid: int, meta, args, max_bytes: int) -> int:
    """convert --to hf --aoa-config: the tensors under the names the config's load reads."""
    from ..core import aoa
    from .hf_export import export_remapped, remapped_outputs

    config = _aoa_config_file(args.aoa_config)
    try:
        from ..parallel.aoa_paddle import Reverse
    except ImportError as exc:
        raise UnsupportedError(f"--aoa-config needs paddle, whose AOA engine interprets the config ({exc})") from None
    try:
        remap = Reverse(config, aoa.source_shards(meta))
    except UnsupportedError as exc:
        raise UsageError(f"--aoa-config {args.aoa_config}: {_one_line(exc)}") from None
    with _keys_option():
        outputs = remapped_outputs(meta, remap, args.keys, args.bf16_as_float32)
    if not outputs:
        raise UsageError(f"--keys {args.keys!r} matches no tensor of the export" if args.keys else "the export has no tensor")
    total = sum(o.nbytes for o in outputs)
    with ProgressBar(total, f"convert {uid}", _progress_enabled(args)) as bar:
        names = export_remapped(path, meta, args.out, remap, outputs, max_bytes, bar.update)
    _out(
        f"wrote {len(outputs)} tensors ({total} bytes) of checkpoint {uid}, named by {args.aoa_config}, "
        f"to {args.out}: {', '.join(names)}"
    )
    if remap.skipped:
        _err(f"note: {len(remap.skipped)} optimizer states are not exported (with --aoa-config, model weights only)")
    if meta.values():
        _err(f"note: {len(meta.values())} plain values are not exported (a Hugging Face directory holds tensors only)")
    return EXIT_OK


def _aoa_config_file(name: str) -> dict:
    """The JSON config of --aoa-config, checked as load_state_dict checks aoa_config."""
    from ..core import aoa

    try:
        with open(name, "rb") as f:
            config = json.loads(f.read())
        aoa.check_config(config)
    except OSError as exc:
        raise UsageError(f"--aoa-config {name}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:  # JSON errors and UnsupportedError
        raise UsageError(f"--aoa-config {name}: not a config {{\"aoa_statements\": [...]}}: {_one_line(exc)}") from None
    if "aoa_statements" not in config:
        raise UsageError(f"--aoa-config {name}: no \"aoa_statements\" list")
    return config
