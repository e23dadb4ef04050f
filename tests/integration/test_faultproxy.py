"""tests/faultproxy.py, the fault-injecting proxy the S3 fault tests stand behind: it forwards
byte-exactly (s3fs multipart uploads, ranged reads, listings; chunked bodies both ways), each
fault kind happens to exactly the first N matching requests, and it counts what it saw.

Clients are s3fs and botocore themselves (no paddle_dcp code); the S3 server is the session's
SeaweedFS (tests/s3server.py). botocore's retry sleeps are cut to 10 ms here: what is tested is
the proxy, not botocore's backoff.
"""
from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import faultproxy  # noqa: E402
from faultproxy import FaultProxy, remote_counts, remote_plan  # noqa: E402

botocore = pytest.importorskip("botocore")
s3fs = pytest.importorskip("s3fs")
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError, ResponseStreamingError  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def fast_retries(monkeypatch):
    """botocore's standard-mode retries without their backoff sleeps."""
    from botocore.retries import standard

    monkeypatch.setattr(standard.ExponentialBackoff, "delay_amount", lambda self, context: 0.01)


def client(endpoint: str, attempts: int = 1):
    """A botocore S3 client of ``endpoint`` making at most ``attempts`` attempts per call."""
    from s3server import ACCESS_KEY, SECRET_KEY

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=Config(retries={"total_max_attempts": attempts, "mode": "standard"}, s3={"addressing_style": "path"},
                      connect_timeout=10, read_timeout=60),
    )


def s3fs_of(endpoint: str):
    from s3server import ACCESS_KEY, SECRET_KEY

    return s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=endpoint, skip_instance_cache=True,
                             use_listings_cache=False)


def key() -> str:
    return f"faultproxy/{uuid.uuid4().hex}"


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ everywhere (a shifted or dropped piece would show)."""
    out = bytearray()
    block = 0
    while len(out) < n:
        out += hashlib.sha256(b"%d:%d" % (seed, block)).digest()
        block += 1
    return bytes(out[:n])


# ------------------------------------------------------------------------------ forwarding
def test_forwards_multipart_ranges_and_listings_byte_exactly(s3_server):
    """A 64 MiB multipart upload through the proxy (s3fs, 3 parts), then whole and ranged reads
    and a listing through it: every byte as written, read back the same directly from the
    server; with no faults planned each request is made once (nothing failed and was retried)."""
    data = payload(64 * MiB)
    name = f"{s3_server.bucket}/{key()}/object"  # a prefix of its own: the listing below holds it alone
    with FaultProxy(s3_server.endpoint) as proxy:
        fs = s3fs_of(proxy.url)
        with fs.open(name, "wb", block_size=24 * MiB) as f:
            for i in range(0, len(data), 24 * MiB):  # three writes: a part each
                f.write(data[i : i + 24 * MiB])
        assert fs.cat_file(name, start=5, end=5 + 3 * MiB) == data[5 : 5 + 3 * MiB]
        assert fs.cat_file(name, start=len(data) - 100) == data[-100:]
        assert fs.ls(name.rsplit("/", 1)[0]) == [name]
        whole = fs.cat_file(name)
        counts = proxy.counts()
    assert hashlib.sha256(whole).digest() == hashlib.sha256(data).digest()
    assert s3fs_of(s3_server.endpoint).cat_file(name) == data  # what the server holds
    req = counts["requests"]
    assert (req["create_multipart"], req["put_part"], req["complete_multipart"]) == (1, 3, 1), req
    assert [counts["objects"][f"PUT /{name}#{n}"] for n in (1, 2, 3)] == [1, 1, 1], counts["objects"]
    assert req["get_range"] >= 2 and req["list"] >= 1, req
    assert counts["faults"] == {}, counts


class _Echo(http.server.BaseHTTPRequestHandler):
    """An upstream that answers every PUT with the sha256 of the body it received and the
    body itself, chunked."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_PUT(self):
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            body = b""
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if not size:
                    self.rfile.readline()
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("X-Sha256", hashlib.sha256(body).hexdigest())
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(0, len(body), 1000):
            piece = body[i : i + 1000]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")


def test_chunked_bodies_both_ways_on_one_kept_alive_connection():
    """A chunked request body reaches the upstream whole, its chunked answer comes back whole;
    a second request (Content-Length) goes over the same client connection."""
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}") as proxy:
            conn = http.client.HTTPConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]), timeout=30)
            data = payload(3 * MiB + 17, seed=1)
            pieces = (data[i : i + 100_003] for i in range(0, len(data), 100_003))
            conn.request("PUT", "/b/k", body=pieces, encode_chunked=True)
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read() == data
            assert resp.getheader("X-Sha256") == hashlib.sha256(data).hexdigest()
            conn.request("PUT", "/b/k2", body=data[:999])
            resp = conn.getresponse()
            assert resp.read() == data[:999]
            conn.close()
            assert proxy.counts()["requests"] == {"put_object": 2}
    finally:
        upstream.shutdown()
        upstream.server_close()


# ------------------------------------------------------------------------------ faults
@pytest.mark.parametrize("fault", ["slowdown", "internal", "reset", "cut"])
def test_each_fault_hits_the_first_n_matching_requests(s3_server, fast_retries, fault):
    """N = 2 faults of a kind on PUT: botocore's third attempt succeeds, the proxy counts
    exactly 2 faults and 3 PUTs, and the object holds exactly the bytes sent. GETs (no rule
    for them) pass untouched."""
    name, data = key(), payload(300_000, seed=2)
    with FaultProxy(s3_server.endpoint, [{"fault": fault, "count": 2, "method": "PUT"}]) as proxy:
        s3 = client(proxy.url, attempts=3)
        s3.put_object(Bucket=s3_server.bucket, Key=name, Body=data)
        assert s3.get_object(Bucket=s3_server.bucket, Key=name)["Body"].read() == data
        counts = proxy.counts()
    assert counts["faults"] == {fault: 2}, counts
    assert counts["requests"] == {"put_object": 3, "get_object": 1}, counts
    assert counts["rules"] == [2]
    assert counts["objects"] == {f"PUT /{s3_server.bucket}/{name}": 3, f"GET /{s3_server.bucket}/{name}": 1}, counts
    direct = client(s3_server.endpoint).get_object(Bucket=s3_server.bucket, Key=name)["Body"].read()
    assert direct == data


def test_throttling_and_internal_errors_are_s3_errors(s3_server):
    """Without retries the client sees S3's own errors: code SlowDown with HTTP 503, then
    InternalError with HTTP 500, then the object; a rule for every request (count -1) never
    runs out; requests no rule matches get the server's own answer."""
    name = key()
    s3 = client(s3_server.endpoint)
    s3.put_object(Bucket=s3_server.bucket, Key=name, Body=b"x")
    plan = [{"fault": "slowdown", "count": 1, "op": "get_object"}, {"fault": "internal", "count": 1, "op": "get_object"},
            {"fault": "internal", "count": -1, "op": "head"}]
    with FaultProxy(s3_server.endpoint, plan) as proxy:
        s3 = client(proxy.url, attempts=1)
        seen = []
        for _ in range(2):
            with pytest.raises(ClientError) as info:
                s3.get_object(Bucket=s3_server.bucket, Key=name)
            seen.append((info.value.response["Error"]["Code"], info.value.response["ResponseMetadata"]["HTTPStatusCode"]))
        assert seen == [("SlowDown", 503), ("InternalError", 500)]
        assert s3.get_object(Bucket=s3_server.bucket, Key=name)["Body"].read() == b"x"
        for _ in range(3):
            with pytest.raises(ClientError) as info:
                s3.head_object(Bucket=s3_server.bucket, Key=name)
            assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
        with pytest.raises(ClientError) as info:
            s3.get_object(Bucket=s3_server.bucket, Key=name + "-missing")
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404  # the server's own answer
        counts = proxy.counts()
    assert counts["faults"] == {"slowdown": 1, "internal": 4}, counts
    assert counts["rules"] == [1, 1, 3], counts


def test_a_cut_response_is_short_and_the_next_read_is_whole(s3_server):
    """``cut`` on a GET sends the headers and half the body, then closes: the client reads a
    short body (never a whole one), and the next GET reads every byte."""
    name, data = key(), payload(2 * MiB, seed=3)
    client(s3_server.endpoint).put_object(Bucket=s3_server.bucket, Key=name, Body=data)
    with FaultProxy(s3_server.endpoint, [{"fault": "cut", "count": 1, "op": "get_range"}]) as proxy:
        s3 = client(proxy.url, attempts=1)
        resp = s3.get_object(Bucket=s3_server.bucket, Key=name, Range=f"bytes=1000-{MiB + 999}")
        with pytest.raises(ResponseStreamingError, match="IncompleteRead"):
            resp["Body"].read()
        resp = s3.get_object(Bucket=s3_server.bucket, Key=name, Range=f"bytes=1000-{MiB + 999}")
        assert resp["Body"].read() == data[1000 : MiB + 1000]
        assert proxy.counts()["faults"] == {"cut": 1}


def test_slow_responses_wait_before_the_first_byte(s3_server):
    """``slow`` delays the matching requests (only those: the path predicate) and then answers
    them correctly."""
    slow, fast = key(), key()
    s3 = client(s3_server.endpoint)
    for name in (slow, fast):
        s3.put_object(Bucket=s3_server.bucket, Key=name, Body=name.encode())
    plan = [{"fault": "slow", "count": 2, "delay": 0.4, "method": "GET", "path": slow.rsplit("/")[-1]}]
    with FaultProxy(s3_server.endpoint, plan) as proxy:
        s3 = client(proxy.url)
        t0 = time.monotonic()
        assert s3.get_object(Bucket=s3_server.bucket, Key=fast)["Body"].read() == fast.encode()
        fast_seconds = time.monotonic() - t0
        t0 = time.monotonic()
        for _ in range(3):
            assert s3.get_object(Bucket=s3_server.bucket, Key=slow)["Body"].read() == slow.encode()
        slow_seconds = time.monotonic() - t0
        assert proxy.counts()["faults"] == {"slow": 2}
    assert slow_seconds >= 0.8 and fast_seconds < 0.4, (slow_seconds, fast_seconds)


def test_a_trickled_body_comes_whole_and_slowly(s3_server):
    """``trickle`` sends the status and headers, then the body 1 KiB at a time."""
    name, data = key(), bytes(range(256)) * 16  # 4 KiB: four pieces
    s3 = client(s3_server.endpoint)
    s3.put_object(Bucket=s3_server.bucket, Key=name, Body=data)
    with FaultProxy(s3_server.endpoint, [{"fault": "trickle", "count": 1, "delay": 0.2, "op": "get_object"}]) as proxy:
        s3 = client(proxy.url)
        t0 = time.monotonic()
        resp = s3.get_object(Bucket=s3_server.bucket, Key=name)
        headers_seconds = time.monotonic() - t0
        assert resp["Body"].read() == data
        body_seconds = time.monotonic() - t0
        assert s3.get_object(Bucket=s3_server.bucket, Key=name)["Body"].read() == data  # count 1: once
        assert proxy.counts()["faults"] == {"trickle": 1}
    assert headers_seconds < 0.4 <= 0.8 <= body_seconds, (headers_seconds, body_seconds)


def test_bad_rules_are_refused():
    with pytest.raises(ValueError, match="fault"):
        faultproxy.Rule.of({"fault": "teapot"})
    with pytest.raises(ValueError, match="keys"):
        faultproxy.Rule.of({"fault": "reset", "cuont": 2})
    with pytest.raises(ValueError, match="127.0.0.1"):
        FaultProxy("http://example.com:80")


# ------------------------------------------------------------------------------ as a process
def test_as_a_process_with_its_plan_and_counts_over_http(s3_server, fast_retries):
    """``python tests/faultproxy.py --upstream URL --plan JSON`` prints its URL, injects its
    plan, reports counts over HTTP, takes a new plan over HTTP, and stops on SIGTERM."""
    plan = [{"fault": "reset", "count": 1, "op": "put_object"}]
    proc = subprocess.Popen([sys.executable, str(TESTS / "faultproxy.py"), "--upstream", s3_server.endpoint,
                             "--plan", json.dumps(plan)], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        line = proc.stdout.readline().split()
        assert line[0] == "FAULTPROXY" and line[1].startswith("http://127.0.0.1:"), line
        url = line[1]
        name = key()
        s3 = client(url, attempts=2)
        s3.put_object(Bucket=s3_server.bucket, Key=name, Body=b"abc")
        counts = remote_counts(url)
        assert counts["faults"] == {"reset": 1} and counts["requests"] == {"put_object": 2}, counts
        assert remote_plan(url, [{"fault": "slowdown", "count": 1}])["requests"] == {}
        assert s3.get_object(Bucket=s3_server.bucket, Key=name)["Body"].read() == b"abc"
        assert remote_counts(url)["faults"] == {"slowdown": 1}
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
