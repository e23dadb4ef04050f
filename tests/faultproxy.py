"""A fault-injecting HTTP proxy on 127.0.0.1 in front of an S3 server, for the tests.

It forwards every request to the upstream server unchanged (the Host header too, so SigV4
signatures still match), streaming bodies both ways (Content-Length or chunked, keep-alive),
and, for the first ``count`` requests that match a rule, injects that rule's fault:

- ``slowdown``: HTTP 503 with S3's ``SlowDown`` XML error body (throttling);
- ``internal``: HTTP 500 with S3's ``InternalError`` XML error body;
- ``reset``: the connection is reset (RST) without a response, once the request is read;
- ``cut``: the connection is dropped in the middle of a body: of the request's body when it has
  one (a PUT or POST: half of it is read, then a reset), else of the response's (the status,
  the headers and half of the body are sent, then the connection is closed; a HEAD's: reset);
- ``slow``: the request waits ``delay`` seconds before it is forwarded (no byte of the response
  before that);
- ``trickle``: the response's status and headers come at once, then its body 1 KiB every
  ``delay`` seconds (a connection that never goes quiet long enough for a read timeout).

A rule (a dict, or a JSON object in a plan) matches on ``method`` (e.g. "PUT"), ``op`` (the S3
operation: see :func:`operation`) and ``path`` (a regular expression searched in the request
target, path and query) -- each optional -- and ``count`` (how many of the matching requests
get the fault; -1: all of them). The first rule, in plan order, that matches a request and has
faults left to give decides its fault; a request no rule takes is forwarded as it is.

In a test process::

    with FaultProxy(server.endpoint, [{"fault": "slowdown", "op": "put_part", "count": 2}]) as proxy:
        ... point AWS_ENDPOINT_URL at proxy.url ...
        proxy.counts()   # {"requests": {"put_part": 5, ...}, "faults": {"slowdown": 2}, "rules": [2],
                         #  "objects": {"PUT /ckpt/k#1": 3, ...}, "plan": [...]}

As a process of its own (for ranks started by a launcher)::

    python tests/faultproxy.py --upstream http://127.0.0.1:8333 --plan '[{"fault": "reset", "count": 1}]'

prints ``FAULTPROXY http://127.0.0.1:PORT`` once it listens, then serves until SIGTERM/SIGINT.
Either way, requests under ``/__faultproxy__/`` talk to the proxy itself (no S3 bucket name
starts with "_"): ``GET .../counts`` returns the counts as JSON, ``POST .../plan`` with a JSON
list of rules replaces the plan and zeroes the counts (:func:`remote_counts`, :func:`remote_plan`).
"""
from __future__ import annotations

import argparse
import http.client
import http.server
import json
import re
import signal
import socket
import struct
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

FAULTS = ("slowdown", "internal", "reset", "cut", "slow", "trickle")
TRICKLE = 1024  # bytes of a trickled body at a time
CONTROL = "/__faultproxy__/"
CHUNK = 1 << 20
# hop-by-hop headers: the proxy speaks for itself on each connection
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
ERRORS = {
    "slowdown": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "internal": (500, "Internal Server Error", "InternalError",
                 "We encountered an internal error. Please try again."),
}


def operation(method: str, target: str, headers) -> str:
    """The S3 operation of a request, for matching and counting: put_part, put_object,
    create_multipart, complete_multipart, abort_multipart, get_range, get_object, list, head,
    delete, or ``method.lower()`` for anything else."""
    parsed = urllib.parse.urlsplit(target)
    query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
    is_bucket = parsed.path.strip("/").count("/") == 0  # "/bucket" or "/": no key
    if method == "PUT":
        return "put_part" if "partNumber" in query else "put_object"
    if method == "POST":
        return "create_multipart" if "uploads" in query else "complete_multipart" if "uploadId" in query else "post"
    if method == "DELETE":
        return "abort_multipart" if "uploadId" in query else "delete"
    if method == "GET":
        if is_bucket or "uploads" in query or "uploadId" in query:
            return "list"
        return "get_range" if headers.get("Range") else "get_object"
    if method == "HEAD":
        return "head"
    return method.lower()


def object_of(method: str, target: str, headers) -> str:
    """What a request acts on, for counting attempts: "METHOD /bucket/key", with the part
    number of a multipart part ("PUT /bucket/key#3") or the range of a ranged read ("GET
    /bucket/key bytes=0-99"): a retry is the same string again."""
    parsed = urllib.parse.urlsplit(target)
    part = urllib.parse.parse_qs(parsed.query).get("partNumber")
    return f"{method} {parsed.path}" + (f"#{part[0]}" if part else "") + (f" {headers['Range']}" if headers.get("Range") else "")


@dataclass
class Rule:
    """One fault and the requests it hits (see the module docstring)."""

    fault: str
    count: int = 1
    method: str | None = None
    op: str | None = None
    path: str | None = None
    delay: float = 1.0
    hits: int = field(default=0, compare=False)

    @classmethod
    def of(cls, spec: dict) -> "Rule":
        unknown = set(spec) - {"fault", "count", "method", "op", "path", "delay"}
        if unknown or spec.get("fault") not in FAULTS:
            raise ValueError(f"bad fault rule {spec!r}: 'fault' one of {FAULTS}; keys count, method, op, path, delay")
        return cls(**spec)

    def matches(self, method: str, op: str, target: str) -> bool:
        return ((self.method is None or self.method.upper() == method)
                and (self.op is None or self.op == op)
                and (self.path is None or re.search(self.path, target) is not None))

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("fault", "count", "method", "op", "path", "delay")}


class _State:
    """The plan and the counts, shared by every connection's thread."""

    def __init__(self, plan):
        self.lock = threading.Lock()
        self.set_plan(plan)

    def set_plan(self, plan) -> None:
        rules = [r if isinstance(r, Rule) else Rule.of(r) for r in plan or ()]
        with self.lock:
            self.rules = rules
            self.requests: dict[str, int] = {}
            self.faults: dict[str, int] = {}
            self.objects: dict[str, int] = {}

    def decide(self, method: str, op: str, target: str, obj: str) -> Rule | None:
        """Count the request; the rule whose fault it gets, if any."""
        with self.lock:
            self.requests[op] = self.requests.get(op, 0) + 1
            self.objects[obj] = self.objects.get(obj, 0) + 1
            chosen = next((r for r in self.rules if r.matches(method, op, target)
                           and (r.count < 0 or r.hits < r.count)), None)
            if chosen is not None:
                chosen.hits += 1
                self.faults[chosen.fault] = self.faults.get(chosen.fault, 0) + 1
            return chosen

    def counts(self) -> dict:
        with self.lock:
            return {"requests": dict(self.requests), "faults": dict(self.faults), "objects": dict(self.objects),
                    "rules": [r.hits for r in self.rules], "plan": [r.as_dict() for r in self.rules]}


class _Reset(Exception):
    """End this connection with a TCP reset."""


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; 100-continue answered by the base class
    server: "_Server"

    def log_message(self, format, *args):  # noqa: A002 - quiet: tests read their own output
        pass

    def handle(self):
        self.upstream: http.client.HTTPConnection | None = None
        try:
            super().handle()
        except _Reset:
            _reset(self.connection)
        except (ConnectionError, socket.timeout, OSError):
            pass  # the client went away: nothing to answer
        finally:
            if self.upstream is not None:
                self.upstream.close()

    def _dispatch(self):
        if self.path.startswith(CONTROL):
            return self._control()
        op = operation(self.command, self.path, self.headers)
        rule = self.server.state.decide(self.command, op, self.path, object_of(self.command, self.path, self.headers))
        body = self._body_reader()
        if rule is None or rule.fault in ("slow", "trickle"):
            if rule is not None and rule.fault == "slow":
                time.sleep(rule.delay)
            return self._forward(body, trickle=rule.delay if rule is not None and rule.fault == "trickle" else None)
        if rule.fault == "cut" and body.length != 0:
            body.drain(limit=max(body.length // 2, 1) if body.length > 0 else CHUNK)
            raise _Reset()
        if rule.fault == "cut":
            return self._forward(body, cut=True)
        body.drain()
        if rule.fault == "reset":
            raise _Reset()
        self._error(*ERRORS[rule.fault])

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _dispatch

    # ------------------------------------------------------------------ answers
    def _error(self, status: int, reason: str, code: str, message: str) -> None:
        resource = urllib.parse.urlsplit(self.path).path
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                f"<Resource>{resource}</Resource><RequestId>faultproxy</RequestId></Error>").encode()
        self.send_response_only(status, reason)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    def _control(self) -> None:
        what = self.path[len(CONTROL):]
        body = self._body_reader().read_all()
        if self.command == "POST" and what == "plan":
            try:
                self.server.state.set_plan(json.loads(body or b"[]"))
            except (ValueError, TypeError) as exc:
                return self._reply(400, {"error": str(exc)})
            return self._reply(200, self.server.state.counts())
        if self.command == "GET" and what == "counts":
            return self._reply(200, self.server.state.counts())
        self._reply(404, {"error": f"unknown control request {self.command} {self.path}"})

    def _reply(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    # ------------------------------------------------------------------ forwarding
    def _body_reader(self) -> "_Body":
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return _Body(self.rfile, -1)
        return _Body(self.rfile, int(self.headers.get("Content-Length") or 0))

    def _connect(self) -> http.client.HTTPConnection:
        if self.upstream is None:
            host, port = self.server.upstream
            self.upstream = http.client.HTTPConnection(host, port, timeout=self.server.upstream_timeout)
        return self.upstream

    def _forward(self, body: "_Body", cut: bool = False, trickle: float | None = None) -> None:
        try:
            try:
                resp = self._send_upstream(body)
            except (OSError, http.client.HTTPException):
                if body.sent or self.upstream is None:
                    raise
                self.upstream.close()  # a kept-alive connection the server closed: once more, afresh
                self.upstream = None
                resp = self._send_upstream(body)
        except (OSError, http.client.HTTPException) as exc:
            if self.upstream is not None:
                self.upstream.close()
                self.upstream = None
            if body.left:  # the client's body is not read to its end: this connection is unusable
                raise _Reset() from exc
            return self._error(502, "Bad Gateway", "BadGateway", f"upstream: {exc}")
        self._relay(resp, cut, trickle)

    def _send_upstream(self, body: "_Body") -> http.client.HTTPResponse:
        conn = self._connect()
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in HOP:
                conn.putheader(name, value)
        if body.length < 0:
            conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for piece in body:
            body.sent = True
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece) if body.length < 0 else piece)
        if body.length < 0:
            conn.send(b"0\r\n\r\n")
        return conn.getresponse()

    def _relay(self, resp: http.client.HTTPResponse, cut: bool, trickle: float | None = None) -> None:
        """The upstream's answer to the client: its body as it comes (chunked when it was), all
        of it, or, for ``cut``, half of it and then a close; with ``trickle``, TRICKLE bytes
        every ``trickle`` seconds."""
        length = resp.getheader("Content-Length")
        no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        if cut and no_body:  # no body to cut in either direction: a reset before the response
            raise _Reset()
        self.send_response_only(resp.status, resp.reason)
        for name, value in resp.getheaders():
            if name.lower() not in HOP:
                self.send_header(name, value)
        chunked = resp.chunked and not no_body
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif length is None and not no_body:  # a body until the upstream closes: so does this one
            self.close_connection = True
        self.end_headers()
        left = None
        if cut:  # an unknown length: half a chunk's worth
            left = max(int(length) // 2, 1) if length is not None else CHUNK // 2
        while not no_body and left != 0:
            want = TRICKLE if trickle is not None else CHUNK if left is None else min(CHUNK, left)
            if trickle is not None:
                self.wfile.flush()
                time.sleep(trickle)
            piece = resp.read(want) if resp.chunked else resp.read1(want)
            if not piece:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            left = None if left is None else left - len(piece)
        if cut:
            # a plain close (FIN), not a reset: a reset makes the client's kernel drop the bytes
            # it has not read yet, headers included, and the cut would be a reset before a response
            self.wfile.flush()
            self.close_connection = True
            self.upstream.close()
            self.upstream = None
            return
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        resp.read()  # marks the response done (read1 never does for an empty body): the connection is reusable
        self.wfile.flush()
        if resp.will_close:
            self.upstream.close()
            self.upstream = None


class _Body:
    """A request body read from the client in pieces: ``length`` bytes, or chunked (-1)."""

    def __init__(self, rfile, length: int):
        self.rfile, self.length = rfile, length
        self.left = length if length >= 0 else 1  # chunked: "something left" until the last chunk
        self._chunk_left = 0
        self.sent = False  # some of it was forwarded (the request cannot be sent again)

    def __iter__(self):
        while True:
            piece = self._read(CHUNK)
            if not piece:
                return
            yield piece

    def _read(self, n: int) -> bytes:
        if self.length >= 0:
            piece = self.rfile.read(min(n, self.left)) if self.left else b""
            if self.left and not piece:
                raise ConnectionError("client closed the connection in the middle of a body")
            self.left -= len(piece)
            return piece
        if not self.left:
            return b""
        if not self._chunk_left:
            size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                self.left = 0
                return b""
            self._chunk_left = size
        piece = self.rfile.read(min(n, self._chunk_left))
        if not piece:
            raise ConnectionError("client closed the connection in the middle of a chunk")
        self._chunk_left -= len(piece)
        if not self._chunk_left:
            self.rfile.readline(1024)  # the CRLF after the chunk
        return piece

    def drain(self, limit: int | None = None) -> None:
        """Read (and drop) the body, or its first ``limit`` bytes."""
        got = 0
        while limit is None or got < limit:
            piece = self._read(CHUNK if limit is None else min(CHUNK, limit - got))
            if not piece:
                return
            got += len(piece)

    def read_all(self) -> bytes:
        return b"".join(self)


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0): the client sees a reset connection."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: tuple[str, int], state: _State, upstream_timeout: float):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream, self.state, self.upstream_timeout = upstream, state, upstream_timeout
        self._open: set = set()
        self._open_lock = threading.Lock()

    def process_request(self, request, client_address):
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._open_lock:
            socks = list(self._open)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname != "127.0.0.1":
        raise ValueError(f"upstream {url!r}: only http://127.0.0.1:PORT is allowed")
    return parts.hostname, parts.port or 80


class FaultProxy:
    """The proxy in a thread of this process; a context manager (see the module docstring).

    Attributes:
        url: ``http://127.0.0.1:PORT``, the endpoint clients use instead of the upstream's.
    """

    def __init__(self, upstream: str, plan=(), upstream_timeout: float = 120.0):
        self.upstream = upstream
        self.state = _State(plan)
        self._server = _Server(_host_port(upstream), self.state, upstream_timeout)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="faultproxy", daemon=True)
        self._thread.start()

    def set_plan(self, plan) -> None:
        """Replace the rules and zero the counts."""
        self.state.set_plan(plan)

    def counts(self) -> dict:
        """{"requests": {op: n}, "faults": {fault: n}, "objects": {object_of(): n}, "rules": [hits
        per rule], "plan": [...]}."""
        return self.state.counts()

    def close(self) -> None:
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _control(url: str, what: str, data: bytes | None = None) -> dict:
    req = urllib.request.Request(url.rstrip("/") + CONTROL + what, data=data, method="POST" if data is not None else "GET")
    with urllib.request.urlopen(req, timeout=30) as resp:  # 127.0.0.1 only: the proxy's own url
        return json.loads(resp.read())


def remote_counts(url: str) -> dict:
    """The counts of the proxy at ``url`` (another process's)."""
    return _control(url, "counts")


def remote_plan(url: str, plan) -> dict:
    """Replace the plan of the proxy at ``url`` (zeroing its counts); returns its counts."""
    return _control(url, "plan", json.dumps([r.as_dict() if isinstance(r, Rule) else r for r in plan]).encode())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="A fault-injecting HTTP proxy on 127.0.0.1 in front of an S3 server.")
    p.add_argument("--upstream", required=True, help="the S3 server, http://127.0.0.1:PORT")
    p.add_argument("--plan", default="[]", help="JSON list of rules, e.g. '[{\"fault\": \"slowdown\", \"count\": 2}]'")
    args = p.parse_args(argv)
    proxy = FaultProxy(args.upstream, json.loads(args.plan))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"FAULTPROXY {proxy.url}", flush=True)
    stop.wait()
    proxy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
