"""paddle_dcp.io.multipart: a data file streamed as a multipart upload to a fake S3 (parts of
part_size, a bounded number in flight, one PUT when small, an abort on failure, a lost reply
checked by the object's size), and the part body that views its buffer without a copy.
Oracle: the file's bytes laid out by hand (header, pieces at their alignment)."""
from __future__ import annotations

import numpy as np
import pytest

from paddle_dcp.errors import StorageError


class FakeS3:
    """The calls a MultipartWriter makes, recorded; parts held until ``release`` when
    ``gate`` is set (to count the parts in flight)."""

    limit: dict = {}  # no time limit per attempt

    def __init__(self, part_size: int, in_flight: int, fail_part: int | None = None):
        import threading

        from paddle_dcp.io.objects import ObjectOptions

        self.options = ObjectOptions(part_size=part_size, parts_in_flight=in_flight)
        self.key_prefix, self.calls, self.parts, self.puts = "run/", [], {}, {}
        self.fail_part = fail_part
        self.lost_reply = False  # the completion succeeds and its reply is lost: the retry finds no upload
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.active = self.most = 0
        self.fs = self

    def resolve(self, name):
        return f"s3://b/run/{name}"

    def full(self, name):
        return f"b/run/{name}"

    def call(self, what, fn, fatal=()):
        return fn()

    def write_atomic(self, name, data, durable=False):
        self.puts[self.full(name)] = bytes(data)

    def size(self, name):
        return len(self.objects[name]) if name in self.objects else None

    def abort_upload(self, key, upload_id, raising=False):
        self.calls.append(("abort", key, upload_id))

    def s3(self, method, **kw):
        import time

        self.calls.append((method, kw.get("PartNumber")))
        if method == "create_multipart_upload":
            return {"UploadId": "u1"}
        if method == "upload_part":
            with self.lock:
                self.active += 1
                self.most = max(self.most, self.active)
            time.sleep(0.01)
            with self.lock:
                self.active -= 1
            if kw["PartNumber"] == self.fail_part:
                raise StorageError("PUT part failed: HTTP 500")
            self.parts[kw["PartNumber"]] = bytes(kw["Body"])
            return {"ETag": f"e{kw['PartNumber']}"}
        if method == "complete_multipart_upload":
            assert [p["PartNumber"] for p in kw["MultipartUpload"]["Parts"]] == sorted(self.parts)
            if self.lost_reply:
                raise FileNotFoundError("NoSuchUpload")
            return {}
        raise AssertionError(method)


def _pieces(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]


def _expected(header: bytes, pieces, alignment: int) -> bytes:
    out = bytearray(header)
    for p in pieces:
        out += bytes(-len(out) % alignment)
        out += p.tobytes()
    return bytes(out)


def test_a_file_streams_as_parts_of_part_size_with_a_bounded_number_in_flight():
    from paddle_dcp.io.datafile import DataFileWriter
    from paddle_dcp.io.multipart import MultipartWriter
    from paddle_dcp.core.checksums import block_checksums

    fake = FakeS3(part_size=1000, in_flight=2)
    pieces = _pieces([2500, 3, 1700, 0, 999])
    w = DataFileWriter(MultipartWriter(fake, "0_0.distcp"), block_bytes=256, header=b"HEAD", alignment=64)
    for i, p in enumerate(pieces):
        assert w.write(memoryview(p), seed=i) == block_checksums(memoryview(p), 256, i)
    size = w.commit()
    expected = _expected(b"HEAD", pieces, 64)
    assert size == len(expected)
    body = b"".join(fake.parts[n] for n in sorted(fake.parts))
    assert body == expected
    assert all(len(fake.parts[n]) == 1000 for n in sorted(fake.parts)[:-1])  # all but the last: part_size
    assert 1 <= fake.most <= 2
    assert fake.calls[0][0] == "create_multipart_upload" and fake.calls[-1][0] == "complete_multipart_upload"


def test_a_file_smaller_than_a_part_is_one_put():
    from paddle_dcp.io.datafile import DataFileWriter
    from paddle_dcp.io.multipart import MultipartWriter

    fake = FakeS3(part_size=1000, in_flight=2)
    pieces = _pieces([10, 20])
    w = DataFileWriter(MultipartWriter(fake, "0_0.distcp"), block_bytes=0, alignment=8)
    assert w.write(memoryview(pieces[0])) == []
    w.write(memoryview(pieces[1]))
    w.commit()
    assert fake.puts == {"b/run/0_0.distcp": _expected(b"", pieces, 8)} and fake.calls == []


def test_a_failed_part_aborts_the_upload():
    from paddle_dcp.io.datafile import DataFileWriter
    from paddle_dcp.io.multipart import MultipartWriter

    fake = FakeS3(part_size=100, in_flight=2, fail_part=2)
    w = DataFileWriter(MultipartWriter(fake, "0_0.distcp"), block_bytes=0, alignment=1)
    with pytest.raises(StorageError, match="HTTP 500"):
        for p in _pieces([100] * 8):
            w.write(memoryview(p))
        w.commit()
    w.abort()
    assert ("abort", "run/0_0.distcp", "u1") in fake.calls
    assert not any(c[0] == "complete_multipart_upload" for c in fake.calls)


@pytest.mark.parametrize("found", ["whole", "short", "missing"])
def test_a_completion_whose_reply_was_lost_is_checked_by_the_object_size(found):
    from paddle_dcp.io.datafile import DataFileWriter
    from paddle_dcp.io.multipart import MultipartWriter

    fake = FakeS3(part_size=100, in_flight=2)
    fake.lost_reply = True
    w = DataFileWriter(MultipartWriter(fake, "0_0.distcp"), block_bytes=0, alignment=1)
    for p in _pieces([100] * 3):
        w.write(memoryview(p))
    if found != "missing":
        fake.objects["0_0.distcp"] = bytes(300 if found == "whole" else 299)
    if found == "whole":
        assert w.commit() == 300
        w.abort()  # nothing to abort: the upload completed
        assert not any(c[0] == "abort" for c in fake.calls)
    else:
        with pytest.raises(StorageError, match="upload is gone and the object has (299|None) bytes, not 300"):
            w.commit()


def test_a_part_body_reads_seeks_and_sizes_like_a_bytesio_without_copying_the_part():
    import io

    from paddle_dcp.io.multipart import PartBody

    buf = bytearray(b"0123456789")
    body = PartBody(memoryview(buf)[2:8])
    ref = io.BytesIO(bytes(buf[2:8]))
    for f in (body, ref):
        assert f.read(3) == b"234" and f.tell() == 3 and f.read() == b"567" and f.read(5) == b""
        assert f.seek(-2, 2) == 4 and f.read(10) == b"67"
        assert f.seek(1) == 1 and len(f.getbuffer()) == 6 and f.getvalue() == b"234567"
    buf[2] = ord("x")  # the body is a view of the part buffer, not a copy
    assert bytes(body) == b"x34567"
