"""Object storage without a server: the retry loop on a fake clock, URL dispatch, and the
object storage on fsspec's in-memory filesystem (memory://), against numpy oracles."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp.errors import ArgumentError, FormatError, IntegrityError, StorageError, UnsupportedError
from paddle_dcp.io import is_url, open_storage
from paddle_dcp.io.retry import RetryPolicy, describe_failure, retrying

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ---------------------------------------------------------------------- retries
class FakeClock:
    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class ClientError(Exception):
    """Shaped as botocore's: a ``response`` dict."""

    def __init__(self, status: int, code: str):
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


def failing(errors, value="ok"):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return value

    return fn, calls


def run(fn, policy, clock):
    return retrying(fn, "GET s3://b/k", policy, clock=clock, sleep=clock.sleep, rand=lambda: 1.0)


def test_transient_failures_are_retried_with_doubling_backoff_until_one_succeeds():
    clock = FakeClock()
    # s3fs raises an OSError caused by botocore's ClientError: the status is found through the cause
    wrapped = OSError("slow down")
    wrapped.__cause__ = ClientError(503, "SlowDown")
    fn, calls = failing([wrapped, ClientError(500, "InternalError"), ConnectionResetError("reset")])
    assert run(fn, RetryPolicy(attempts=6, deadline=60, base=0.5, cap=1.5), clock) == "ok"
    assert len(calls) == 4
    assert clock.sleeps == [0.5, 1.0, 1.5]  # doubling, capped (rand() = 1: the jitter's upper bound)


def test_after_the_last_attempt_the_error_names_the_object_and_the_status():
    clock = FakeClock()
    fn, calls = failing([ClientError(503, "SlowDown")] * 10)
    with pytest.raises(StorageError, match=r"GET s3://b/k failed after 3 attempt\(s\): HTTP 503 SlowDown") as info:
        run(fn, RetryPolicy(attempts=3, deadline=60, base=0.1), clock)
    assert len(calls) == 3 and info.value.path == "GET s3://b/k"


def test_the_deadline_bounds_the_total_time():
    clock = FakeClock()
    fn, calls = failing([TimeoutError("read timed out")] * 100)
    with pytest.raises(StorageError, match="within the 5 s retry deadline: TimeoutError"):
        run(fn, RetryPolicy(attempts=100, deadline=5, base=1, cap=2), clock)
    assert clock.now - 100.0 < 5 and len(calls) < 10


@pytest.mark.parametrize("exc", [ClientError(403, "AccessDenied"), ClientError(400, "InvalidPart"), ValueError("bug")])
def test_a_failure_that_is_not_transient_is_not_retried(exc):
    clock = FakeClock()
    fn, calls = failing([exc])
    with pytest.raises(StorageError):
        run(fn, RetryPolicy(), clock)
    assert len(calls) == 1 and clock.sleeps == []


def test_fatal_errors_pass_through_unchanged():
    fn, calls = failing([FileNotFoundError("b/k")])
    with pytest.raises(FileNotFoundError):
        retrying(fn, "GET", RetryPolicy(), fatal=(FileNotFoundError,), sleep=lambda s: None)
    assert len(calls) == 1


def test_classification():
    assert describe_failure(ClientError(429, "TooManyRequests")) == (True, "HTTP 429 TooManyRequests")
    assert describe_failure(ClientError(404, "NoSuchKey"))[0] is False
    assert describe_failure(ClientError(501, "NotImplemented"))[0] is False
    assert describe_failure(type("EndpointConnectionError", (Exception,), {})("refused"))[0] is True
    from fsspec.exceptions import FSTimeoutError  # an attempt cut at its time limit

    assert describe_failure(FSTimeoutError()) == (True, "FSTimeoutError: no answer within the attempt's time limit")


def test_an_attempt_is_cut_at_the_retry_deadline_on_asynchronous_filesystems(s3_env):
    s3 = open_storage(s3_env.url("limit"), {"retry_deadline": 7.5})
    assert s3.limit == {"timeout": 7.5}
    assert open_storage("memory://b/limit").limit == {}  # fsspec cannot cut a synchronous call


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"deadline": 0}])
def test_bad_retry_bounds_are_argument_errors(kwargs):
    with pytest.raises(ArgumentError):
        RetryPolicy(**kwargs)


# ---------------------------------------------------------------------- dispatch
def test_a_url_is_never_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_url("s3://bucket/run1") and is_url("memory://x") and not is_url("run1") and not is_url("/a/s3:/b")
    with pytest.raises(UnsupportedError, match="nosuchproto"):
        paddle_dcp.save_state_dict({"w": np.zeros(3, np.float32)}, "nosuchproto://bucket/run1")
    assert os.listdir(tmp_path) == []  # no "nosuchproto:" directory


def test_storage_options_on_a_local_path_are_refused(tmp_path):
    with pytest.raises(UnsupportedError, match="storage_options"):
        open_storage(str(tmp_path), {"part_size": 1 << 20})


@pytest.mark.parametrize("options", [{"part_size": 0}, {"retries": 0}, {"part_size": 1 << 20}, {"read_concurrency": "4"}, {"spill_dir": 3}, {"spill_dir": "/no/such/dir"}])
def test_bad_storage_options_are_argument_errors(options):
    with pytest.raises(ArgumentError):
        open_storage("s3://bucket/run1", options)


def test_a_local_path_never_imports_fsspec_or_s3fs(tmp_path):
    code = (
        "import sys, numpy as np, paddle_dcp\n"
        f"paddle_dcp.save_state_dict({{'w': np.arange(4.0)}}, {str(tmp_path / 'c')!r})\n"
        "sd = {'w': np.zeros(4)}\n"
        f"paddle_dcp.load_state_dict(sd, {str(tmp_path / 'c')!r})\n"
        "from paddle_dcp.tools import cli\n"
        f"assert cli.main(['inspect', {str(tmp_path / 'c')!r}]) == 0\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fsspec', 's3fs', 'botocore', 'aiobotocore'))\n"
        "assert not bad, bad\n"
        "assert (sd['w'] == np.arange(4.0)).all()\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_s3fs_missing_says_how_to_install_it(monkeypatch):
    import fsspec

    def missing(protocol):
        raise ImportError("Install s3fs to access S3", name="s3fs")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(UnsupportedError, match=r"pip install paddle-dcp\[s3\]"):
        open_storage("s3://bucket/run1")


# ---------------------------------------------------------------------- memory://
def state(variant: int = 0) -> dict:
    return {
        "model": {"w": np.arange(33 * 17, dtype=np.float32).reshape(33, 17) + variant, "b": np.arange(1001) * 3},
        "step": variant,
    }


def empty() -> dict:
    return {"model": {"w": np.zeros((33, 17), np.float32), "b": np.zeros(1001, np.int64)}, "step": -1}


def check(sd: dict, variant: int) -> None:
    expected = state(variant)
    assert np.array_equal(sd["model"]["w"], expected["model"]["w"])
    assert np.array_equal(sd["model"]["b"], expected["model"]["b"])
    assert sd["step"] == variant


@pytest.fixture
def url():
    u = f"memory://bucket/{uuid.uuid4().hex}"
    yield u
    import fsspec

    fsspec.filesystem("memory").rm(u[len("memory://"):], recursive=True)


def test_round_trip_numbering_and_generations_on_memory(url):
    paddle_dcp.save_state_dict(state(0), url)
    paddle_dcp.save_state_dict(state(1), url)  # unique_id=None: 1
    paddle_dcp.save_state_dict(state(2), url, unique_id=1)  # replaces 1 by a new generation
    store = open_storage(url)
    assert sorted(store.sizes()) == ["0.metadata", "0_0.distcp", "0_1.1.distcp", "1.metadata"]
    for uid, variant in ((0, 0), (1, 2), (None, 2)):
        sd = empty()
        paddle_dcp.load_state_dict(sd, url, unique_id=uid)
        check(sd, variant)
    assert paddle_dcp.read_metadata(url).unique_id == 1


def _replace(url: str, name: str, data: bytes) -> None:
    import fsspec

    fsspec.filesystem("memory").pipe_file(f"{url[len('memory://'):]}/{name}", data)


def test_a_short_or_damaged_object_is_an_integrity_error_and_the_target_is_unchanged(url):
    paddle_dcp.save_state_dict(state(0), url)
    store = open_storage(url)
    data = store.fs.cat_file(store.full("0_0.distcp"))
    _replace(url, "0_0.distcp", data[:-8])
    sd = empty()
    with pytest.raises(IntegrityError, match="0_0.distcp has .* bytes, the metadata says"):
        paddle_dcp.load_state_dict(sd, url)
    flipped = bytearray(data)
    flipped[200] ^= 1
    _replace(url, "0_0.distcp", bytes(flipped))
    with pytest.raises(IntegrityError, match="checksum"):
        paddle_dcp.load_state_dict(sd, url)
    assert not sd["model"]["w"].any() and sd["step"] == -1


def test_missing_checkpoint_and_bad_metadata_on_memory(url):
    with pytest.raises(FormatError, match="no complete checkpoint"):
        paddle_dcp.read_metadata(url)
    with pytest.raises(StorageError, match="no metadata object"):
        open_storage(url).read_metadata(3)
    paddle_dcp.save_state_dict(state(0), url)
    _replace(url, "0.metadata", b"{not json")
    with pytest.raises(FormatError):
        paddle_dcp.read_metadata(url)


def test_remove_and_resolve_on_memory(url):
    paddle_dcp.save_state_dict(state(0), url)
    store = open_storage(url)
    assert store.resolve("0_0.distcp") == f"{url}/0_0.distcp"
    with pytest.raises(FormatError):
        store.resolve("../other/0_0.distcp")
    assert store.size("0_0.distcp") == paddle_dcp.read_metadata(url).files[0].nbytes
    assert store.size("9_9.distcp") is None
    assert store.remove(["0_0.distcp", "9_9.distcp"]) == ["0_0.distcp"]
    assert sorted(store.sizes()) == ["0.metadata"]


# ---------------------------------------------------------------------- multipart writes
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
    from paddle_dcp.io.multipart import MultipartWriter
    from paddle_dcp.core.checksums import block_checksums

    fake = FakeS3(part_size=1000, in_flight=2)
    pieces = _pieces([2500, 3, 1700, 0, 999])
    w = MultipartWriter(fake, "0_0.distcp", block_bytes=256, header=b"HEAD", alignment=64)
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
    from paddle_dcp.io.multipart import MultipartWriter

    fake = FakeS3(part_size=1000, in_flight=2)
    pieces = _pieces([10, 20])
    w = MultipartWriter(fake, "0_0.distcp", block_bytes=0, alignment=8)
    assert w.write(memoryview(pieces[0])) == []
    w.write(memoryview(pieces[1]))
    w.commit()
    assert fake.puts == {"b/run/0_0.distcp": _expected(b"", pieces, 8)} and fake.calls == []


def test_a_failed_part_aborts_the_upload():
    from paddle_dcp.io.multipart import MultipartWriter

    fake = FakeS3(part_size=100, in_flight=2, fail_part=2)
    w = MultipartWriter(fake, "0_0.distcp", block_bytes=0)
    with pytest.raises(StorageError, match="HTTP 500"):
        for p in _pieces([100] * 8):
            w.write(memoryview(p))
        w.commit()
    w.abort()
    assert ("abort", "run/0_0.distcp", "u1") in fake.calls
    assert not any(c[0] == "complete_multipart_upload" for c in fake.calls)


@pytest.mark.parametrize("found", ["whole", "short", "missing"])
def test_a_completion_whose_reply_was_lost_is_checked_by_the_object_size(found):
    from paddle_dcp.io.multipart import MultipartWriter

    fake = FakeS3(part_size=100, in_flight=2)
    fake.lost_reply = True
    w = MultipartWriter(fake, "0_0.distcp", block_bytes=0)
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
