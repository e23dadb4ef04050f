"""A checkpoint's full tensors exported to a Hugging Face style directory of safetensors shards.

``model-00001-of-0000N.safetensors`` ... each holding whole tensors, in checkpoint order, at
most ``max_shard_bytes`` of tensor data (a larger tensor gets a shard of its own, as
``transformers`` does), and ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``: tensor -> shard), written last; a single shard is ``model.safetensors`` with no
index. Each shard is written through :class:`paddle_dcp.storage.DataWriter` (a temporary name,
renamed when complete) from slabs of the checkpoint (every block's checksum checked), so
memory stays at one slab whatever the tensors' sizes. Plain values are not exported (a
Hugging Face directory has no place for them).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Sequence

from . import storage
from .consolidate import Progress, Selection, TensorReader, output_bytes, output_dtype, output_nbytes
from .errors import DcpError, StorageError
from .metadata import Metadata
from .safetensors_dir import INDEX_SUFFIX, SINGLE_FILE
from .safetensors_format import code_of, encode_header

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD = "5GB"  # transformers' default for save_pretrained
SHARD_METADATA = {"format": "pt"}  # transformers refuses shards without a format it knows


def plan_shards(meta: Metadata, keys: Sequence[str], max_shard_bytes: int, bf16_as_float32: bool = False) -> list[list[str]]:
    """The keys of every shard: in order, as many as fit ``max_shard_bytes`` of data; a tensor
    larger than that alone in its shard."""
    shards: list[list[str]] = []
    size = 0
    for key in keys:
        n = output_nbytes(meta.tensors[key], bf16_as_float32)
        if not shards or (size + n > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def shard_name(i: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def export(
    path: str,
    meta: Metadata,
    out: str,
    selection: Selection,
    max_shard_bytes: int,
    bf16_as_float32: bool = False,
    progress: Progress | None = None,
) -> list[str]:
    """Write the selected tensors of the checkpoint in ``path`` to the directory ``out``
    (created; it must hold no file yet). Returns the names written, the index last.

    Raises:
        DcpError: ``out`` is not empty; a dtype safetensors cannot hold, naming the key.
        FormatError / IntegrityError / StorageError: a damaged checkpoint or an I/O failure.
    """
    if max_shard_bytes <= 0:
        raise DcpError(f"the shard size must be positive, got {max_shard_bytes}")
    try:
        os.makedirs(out, exist_ok=True)
        if os.listdir(out):
            raise DcpError(f"{out} is not empty: export to a new directory")
    except OSError as exc:
        raise StorageError(f"cannot create {out}: {exc}", out) from exc
    keys = list(selection.keys)
    codes = {k: code_of(k, output_dtype(meta.tensors[k].dtype, bf16_as_float32)) for k in keys}
    shards = plan_shards(meta, keys, max_shard_bytes, bf16_as_float32) or [[]]
    names, weight_map = [], {}
    with TensorReader(path, meta) as reader:
        for i, shard in enumerate(shards):
            name = shard_name(i, len(shards))
            header = encode_header(
                ((k, codes[k], meta.tensors[k].shape, output_nbytes(meta.tensors[k], bf16_as_float32)) for k in shard),
                SHARD_METADATA,
            )
            # depth 0: each slab is written before the reader reuses its buffer
            writer = storage.DataWriter(out, name, 0, depth=0, header=header, alignment=1)
            try:
                for key in shard:
                    for data in output_bytes(reader, key, bf16_as_float32, progress):
                        writer.write(data, keep=data)
                writer.commit()
            except BaseException:
                writer.abort()
                raise
            names.append(name)
            weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        total = sum(output_nbytes(meta.tensors[k], bf16_as_float32) for k in keys)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        index_name = "model" + INDEX_SUFFIX
        storage.write_atomic(out, index_name, json.dumps(index, indent=2).encode())
        names.append(index_name)
    logger.info("exported %d tensors to %s in %d shards", len(keys), out, len(shards))
    return names
