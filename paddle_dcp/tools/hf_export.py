"""A checkpoint's full tensors exported to a Hugging Face style directory of safetensors shards.

``model-00001-of-0000N.safetensors`` ... each holding whole tensors, in checkpoint order, at
most ``max_shard_bytes`` of tensor data (a larger tensor gets a shard of its own, as
``transformers`` does), and ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``: tensor -> shard), written last; a single shard is ``model.safetensors`` with no
index. Each shard is written through :class:`paddle_dcp.io.datafile.DataFileWriter` (a temporary name,
renamed when complete) from slabs of the checkpoint (every block's checksum checked), so
memory stays at one slab whatever the tensors' sizes. Plain values are not exported (a
Hugging Face directory has no place for them).

With an ``aoa_config`` (the one a load takes to read a Hugging Face directory into the model's
names), the tensors are written under the Hugging Face names: paddle's AOA engine, run
backwards (:class:`paddle_dcp.parallel.aoa_paddle.Reverse`), says which boxes of which checkpoint
tensors make each slab of each output tensor, and with which permutation and cast; the slab
is read and finished by the load's own machinery (:func:`paddle_dcp.core.aoa.plan`).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from ..core import aoa
from ..io import open_storage
from ..io.datafile import data_writer
from ..io.storage import list_checkpoints
from ..core.boxes import Box, split_region
from .consolidate import Progress, Selection, TensorReader, counted_bytes, key_filter, output_bytes, output_dtype
from ..core.dtypes import bf16_to_float32, storage_dtype
from ..errors import ArgumentError, MismatchError
from ..core.metadata import Metadata
from ..format.hf_dir import INDEX_SUFFIX, SINGLE_FILE
from ..format.safetensors import code_of, encode_header

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD = "5GB"  # transformers' default for save_pretrained
SHARD_METADATA = {"format": "pt"}  # transformers refuses shards without a format it knows


class Remapped(Protocol):
    """What an export under other names needs (:class:`paddle_dcp.parallel.aoa_paddle.Reverse`)."""

    outputs: Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, global shape)
    sources: Mapping[str, tuple[str, ...]]  # name -> the checkpoint keys it is made of

    def maps(self, name: str, box: Box) -> list[aoa.SliceMap]: ...


@dataclass(frozen=True)
class Output:
    """One tensor of the directory: its name, and the dtype and shape it is written with."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * storage_dtype(self.dtype).itemsize


def plan_shards(outputs: Sequence[Output], max_shard_bytes: int) -> list[list[Output]]:
    """The tensors of every shard: in order, as many as fit ``max_shard_bytes`` of data; a
    tensor larger than that alone in its shard."""
    shards: list[list[Output]] = []
    size = 0
    for o in outputs:
        if not shards or (size + o.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(o)
        size += o.nbytes
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
        ArgumentError: ``out`` is not empty.
        UnsupportedError: a dtype safetensors cannot hold, naming the key.
        FormatError / IntegrityError / StorageError: a damaged checkpoint or an I/O failure.
    """
    outputs = [
        Output(k, output_dtype(meta.tensors[k].dtype, bf16_as_float32), tuple(meta.tensors[k].shape))
        for k in selection.keys
    ]
    return _write(
        path, meta, out, outputs, max_shard_bytes,
        lambda reader, o: output_bytes(reader, o.name, bf16_as_float32, progress),
    )


def remapped_outputs(meta: Metadata, remap: Remapped, pattern: str | None = None, bf16_as_float32: bool = False) -> list[Output]:
    """The tensors an export through ``remap`` writes: those whose name matches ``pattern``
    (``re.search``), in the checkpoint's order of their first source, then by name."""
    keep = key_filter(pattern)
    order = {k: i for i, k in enumerate(meta.tensors)}
    names = [n for n in remap.outputs if keep(n)]
    names.sort(key=lambda n: (min((order[s] for s in remap.sources[n]), default=len(order)), n))
    return [Output(n, output_dtype(remap.outputs[n][0], bf16_as_float32), remap.outputs[n][1]) for n in names]


def export_remapped(
    path: str,
    meta: Metadata,
    out: str,
    remap: Remapped,
    outputs: Sequence[Output],
    max_shard_bytes: int,
    progress: Progress | None = None,
) -> list[str]:
    """Like :func:`export`, for tensors made by ``remap`` (an :class:`aoa_paddle.Reverse`):
    each is built and written slab by slab (:func:`remapped_slabs`).

    Raises:
        MismatchError / PlanError: the config's answer does not fill a tensor exactly.
        UnsupportedError: paddle's engine refused a tensor.
    """

    def produce(reader: TensorReader, o: Output) -> Iterator[memoryview]:
        widen = o.dtype != remap.outputs[o.name][0]  # bfloat16 written as float32
        slabs = remapped_slabs(reader, remap, o.name, reader.slab_bytes // 2 if widen else None)
        return counted_bytes((bf16_to_float32(s) for s in slabs) if widen else slabs, progress)

    return _write(path, meta, out, outputs, max_shard_bytes, produce)


def remapped_slabs(reader: TensorReader, remap: Remapped, name: str, slab_bytes: int | None = None) -> Iterator[np.ndarray]:
    """Output ``name`` of ``remap`` as consecutive C-order slabs of at most ``slab_bytes``
    (default the reader's): for each, the engine says which boxes of which checkpoint tensors
    fill it and how they are permuted and cast; :func:`aoa.plan` turns that into reads and
    staging arrays, as on a load. Memory: one slab and its staging arrays."""
    dtype, shape = remap.outputs[name]
    limit = max(1, int(slab_bytes or reader.slab_bytes) // storage_dtype(dtype).itemsize)
    for box in split_region(Box.whole(shape), limit, shape):
        maps = remap.maps(name, box)
        if not maps:
            raise MismatchError(f"{name}: aoa_config fills nothing of box {box} (shape {shape})")
        reads = aoa.plan(reader.meta, [(aoa.LocalTarget(0, name, dtype, shape, box), maps)], first_slot=1)
        arrays = [np.empty(box.shape, dtype=storage_dtype(dtype))] + aoa.staging_arrays(reads.staged)
        reader.read_pieces(reads.pieces, reads.slots, arrays)
        aoa.apply(reads.staged, arrays)
        yield arrays[0]


def _write(
    path: str,
    meta: Metadata,
    out: str,
    outputs: Sequence[Output],
    max_shard_bytes: int,
    produce: Callable[[TensorReader, Output], Iterator[memoryview]],
) -> list[str]:
    """The directory: every shard through a DataFileWriter (``produce`` gives a tensor's bytes),
    then the index."""
    if max_shard_bytes <= 0:
        raise ArgumentError(f"the shard size must be positive, got {max_shard_bytes}")
    store = open_storage(out)  # a directory, or a URL prefix
    store.create()
    if list_checkpoints(store).files:
        raise ArgumentError(f"{out} is not empty: export to a new directory")
    codes = {o.name: code_of(o.name, o.dtype) for o in outputs}
    shards = plan_shards(outputs, max_shard_bytes) or [[]]
    names, weight_map = [], {}
    with TensorReader(path, meta) as reader:
        for i, shard in enumerate(shards):
            name = shard_name(i, len(shards))
            header = encode_header(((o.name, codes[o.name], o.shape, o.nbytes) for o in shard), SHARD_METADATA)
            # depth 0: each slab is written before the reader reuses its buffer
            writer = data_writer(store, name, 0, depth=0, header=header, alignment=1)
            try:
                for o in shard:
                    for data in produce(reader, o):
                        writer.write(data, keep=data)
                writer.commit()
            except BaseException:
                writer.abort()
                raise
            names.append(name)
            weight_map.update(dict.fromkeys((o.name for o in shard), name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(o.nbytes for o in outputs)}, "weight_map": weight_map}
        index_name = "model" + INDEX_SUFFIX
        store.write_atomic(index_name, json.dumps(index, indent=2).encode())
        names.append(index_name)
    logger.info("exported %d tensors to %s in %d shards", len(outputs), out, len(shards))
    return names
