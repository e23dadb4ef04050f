"""Writing one data file to object storage, streamed from the tensors' memory.

:class:`MultipartWriter` (S3): the pieces' bytes are copied into a buffer of one part
(``part_size``, 32 MiB by default); each full part is uploaded by a thread while the next one
fills, at most ``parts_in_flight`` at once; :meth:`~MultipartWriter.commit` uploads the last
(shorter) part and completes the upload, the moment the object appears under its final name,
whole. A file smaller than one part is one PUT. :meth:`~MultipartWriter.abort` aborts the
upload, so a failed save leaves no parts behind. Memory: one part being filled plus the parts
in flight; the whole file is never built.

:class:`StreamWriter` (other fsspec protocols): the file written through ``fs.open(..., "wb")``;
whether it is invisible until closed depends on the filesystem.
"""
from __future__ import annotations

import io
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import StorageError

logger = logging.getLogger(__name__)


class _Appending:
    """What both streams share: writes at increasing offsets turned into appends, the gaps
    between them as zeros."""

    url: str  # set by each stream

    def __init__(self) -> None:
        self.offset = 0  # bytes appended so far

    def write_at(self, data: memoryview, offset: int, keep=None) -> None:
        """Append ``data`` at ``offset`` (zeros up to it first); the bytes are copied or sent
        before it returns, so ``keep`` need not outlive the call."""
        view = data.cast("B") if data.format != "B" else data
        if offset < self.offset:
            raise StorageError(f"a write at byte {offset} of {self.url}, before its end {self.offset}", self.url)
        if offset > self.offset:
            self._append(memoryview(bytes(offset - self.offset)))
        self._append(view)
        self.offset = offset + len(view)

    def _append(self, view: memoryview) -> None:
        raise NotImplementedError

    def _check_size(self, size: int) -> None:
        if size != self.offset:
            raise StorageError(f"{self.url}: committed as {size} bytes, {self.offset} written", self.url)


class PartBody(io.BytesIO):
    """The bytes of one part as the request body botocore and aiohttp stream from, read 64 KiB
    at a time straight out of the part's buffer: given bytes, aiohttp slices and joins the
    whole body (three transient copies of every part in flight); given a file, it reads it."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view, self._pos = view, 0

    def getbuffer(self) -> memoryview:  # as BytesIO's: the whole content, whatever the position
        return self._view[:]

    def read(self, size: int | None = -1) -> bytes:
        stop = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        out = bytes(self._view[self._pos : stop])
        self._pos = max(self._pos, stop)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def getvalue(self) -> bytes:
        return bytes(self._view)

    def __bytes__(self) -> bytes:
        return bytes(self._view)


class MultipartWriter(_Appending):
    """One file as an S3 multipart upload (a :class:`~paddle_dcp.io.storage.ByteStream`).

    Memory: ``parts_in_flight + 1`` buffers of ``part_size`` bytes, made once and reused (one
    filling, the others uploading); the bytes of a piece are copied once, into a buffer, and
    streamed to the socket from there."""

    def __init__(self, store, name: str):
        super().__init__()
        self.store, self.name = store, name
        self.url = store.resolve(name)
        self.key = store.key_prefix + name
        self.part_size = store.options.part_size
        self.in_flight = store.options.parts_in_flight
        self._free: list[bytearray] = []  # buffers not in use
        self._buf, self._fill = bytearray(), 0  # the buffer being filled, bytes in it
        self._parts: list[Future] = []
        self._pending: deque[tuple[Future, bytearray]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self.upload_id: str | None = None

    def _append(self, view: memoryview) -> None:
        at = 0
        while at < len(view):
            if not self._buf:
                self._buf, self._fill = (self._free.pop() if self._free else bytearray(self.part_size)), 0
            take = min(self.part_size - self._fill, len(view) - at)
            self._buf[self._fill : self._fill + take] = view[at : at + take]
            self._fill += take
            at += take
            if self._fill == self.part_size:
                self._ship()

    def _ship(self) -> None:
        """Hand the filled buffer to an upload thread; wait while too many parts are in flight
        (their buffers then come back for reuse)."""
        if self.upload_id is None:
            reply = self.store.call(f"CREATE UPLOAD {self.url}", lambda: self.store.s3("create_multipart_upload", Key=self.key))
            self.upload_id = reply["UploadId"]
            self._pool = ThreadPoolExecutor(self.in_flight, thread_name_prefix="paddle_dcp-part")
        buf, size = self._buf, self._fill
        self._buf, self._fill = bytearray(), 0
        number = len(self._parts) + 1
        assert self._pool is not None  # made with the upload
        fut = self._pool.submit(self._upload_part, number, memoryview(buf)[:size])
        self._parts.append(fut)
        self._pending.append((fut, buf))
        while len(self._pending) >= self.in_flight:
            done, buf = self._pending.popleft()
            done.result()
            self._free.append(buf)

    def _upload_part(self, number: int, body: memoryview) -> dict:
        what = f"PUT part {number} of {self.url}"
        reply = self.store.call(what, lambda: self.store.s3(
            "upload_part", Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=PartBody(body)))
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def commit(self, size: int, durable: bool = False) -> None:
        """Upload what is left and complete the upload: the object appears, whole."""
        self._check_size(size)
        if self.upload_id is None:  # smaller than one part: one PUT
            self.store.write_atomic(self.name, bytes(memoryview(self._buf)[: self._fill]))
            self._buf, self._fill, self._free = bytearray(), 0, []
            return
        if self._fill or not self._parts:
            if not self._buf:
                self._buf = self._free.pop() if self._free else bytearray(self.part_size)
            self._ship()
        parts = [fut.result() for fut in self._parts]
        self._pending.clear()
        self._free = []
        self._shutdown()
        try:
            self.store.call(f"COMPLETE UPLOAD {self.url}", lambda: self.store.s3(
                "complete_multipart_upload", Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": parts}))
        except FileNotFoundError:  # NoSuchUpload: a retry after a completion whose reply was lost
            self._check_completed()
        logger.debug("wrote %s: %d bytes in %d parts", self.url, self.offset, len(parts))
        self.upload_id = None

    def _check_completed(self) -> None:
        """The object exists with this file's size (else the upload is lost: StorageError)."""
        size = self.store.size(self.name)
        if size != self.offset:
            raise StorageError(f"COMPLETE UPLOAD {self.url} failed: the upload is gone and the object has "
                               f"{size} bytes, not {self.offset}", self.url)
        self.upload_id = None  # completed: nothing to abort

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def abort(self) -> None:
        """Stop uploading and abort the upload (never raises)."""
        self._buf, self._fill, self._free = bytearray(), 0, []
        self._shutdown()
        if self.upload_id is not None:
            self.store.abort_upload(self.key, self.upload_id)
            self.upload_id = None


class StreamWriter(_Appending):
    """One file written through fsspec's file interface (protocols other than S3)."""

    def __init__(self, store, name: str):
        super().__init__()
        self.store, self.name, self.url = store, name, store.resolve(name)
        try:
            self.file = store.fs.open(store.full(name), "wb")
        except Exception as exc:  # noqa: BLE001 - fsspec raises what its backend raises
            raise StorageError(f"cannot create {self.url}: {exc}", self.url) from exc

    def _append(self, view: memoryview) -> None:
        try:
            self.file.write(view)
        except Exception as exc:  # noqa: BLE001
            raise StorageError(f"cannot write {self.url}: {exc}", self.url) from exc

    def commit(self, size: int, durable: bool = False) -> None:
        self._check_size(size)
        try:
            self.file.close()
        except Exception as exc:  # noqa: BLE001
            raise StorageError(f"cannot write {self.url}: {exc}", self.url) from exc

    def abort(self) -> None:
        try:
            discard = getattr(self.file, "discard", None)
            if discard is not None:
                discard()
            else:
                self.file.close()
                self.store.fs.rm_file(self.store.full(self.name))
        except Exception:  # noqa: BLE001 - the save already failed
            pass
