"""One file copied from one storage to another, in bounded chunks, appearing whole under its
name in the target only at the end."""
from __future__ import annotations

import numpy as np

from ..errors import StorageError
from .datafile import data_writer
from .storage import Storage

CHUNK = 64 << 20  # bytes read and written at a time


def copy_file(source: Storage, target: Storage, name: str, durable: bool = False, chunk: int = CHUNK) -> int:
    """Copy the file ``name`` of ``source`` to ``target`` under the same name; returns its
    size. The copy appears only once complete (a rename, or the end of a multipart upload).

    Raises:
        StorageError: the file is missing in ``source``, or reading or writing fails.
    """
    size = source.size(name)
    if size is None:
        raise StorageError(f"{source.resolve(name)} is missing: it cannot be copied", source.path)
    reader = source.range_reader()
    # the next chunk is read while the writer still writes the last two (three buffers in turn)
    writer = data_writer(target, name, block_bytes=0, depth=2, alignment=1)
    bufs = [np.empty(min(chunk, size), np.uint8) for _ in range(min(3, -(-size // chunk)))]
    try:
        for i, start in enumerate(range(0, size, chunk)):
            n, buf = min(chunk, size - start), bufs[i % len(bufs)]
            reader.read_into(name, start, buf[:n].data)
            writer.write(buf[:n].data, keep=buf)
        writer.commit(durable)
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()
    return size
