"""Object storage behind the storage interface: a checkpoint "directory" is a URL prefix
(``s3://bucket/run1``, or any fsspec protocol with ranged reads), its files are the objects
under it. Imported only for a URL, so a local path never imports fsspec or s3fs.

Commit without rename: an object store has no rename, so every file is written under its final
name and is invisible until its write completes: a data file is a multipart upload (the object
appears at CompleteMultipartUpload, whole, or never; see :mod:`paddle_dcp.io.multipart`), the
metadata one PUT, written last. No ``*.tmp.*`` object is ever created: the "temporary files" of
an object store are the multipart uploads still open under the prefix (of saves in progress or
killed), listed as ``{name}.tmp.{hash of the upload id}`` and aborted by removing that name
(``clean``, and a save of the same id by the same rank).

Every request goes through :func:`paddle_dcp.io.retry.retrying`: transient failures are retried
with backoff, then become a StorageError naming the object and the HTTP status.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import xxhash

from ..core.metadata import FileEntry, check_member_name
from ..core.naming import TMP_MARK
from ..errors import ArgumentError, FormatError, StorageError, UnsupportedError
from .object_reads import ObjectFiles, ObjectRangeReader
from .retry import RetryPolicy, http_status, retrying

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install paddle-dcp[s3]"
S3_PROTOCOLS = ("s3", "s3a")
DELETE_BATCH = 1000  # S3's most keys per DeleteObjects


@dataclass(frozen=True)
class ObjectOptions:
    """paddle_dcp's own keys of ``storage_options`` (the others go to fsspec).

    Attributes:
        part_size: bytes of each multipart upload part but the last (S3: at least 5 MiB).
        parts_in_flight: parts of one file being uploaded at once (each holds part_size bytes).
        read_concurrency: ranged GETs of one rank in flight at once.
        read_chunk_bytes: the largest ranged GET (a longer range is fetched as several).
        read_ahead_bytes: bytes of ranges a load fetches ahead of use, the range in use
            included (a single longer range alone): the reads' memory in flight.
        read_cache_bytes: without a spill directory, bytes of ranges a load keeps in memory
            between checking their checksums and copying them (the rest are fetched again).
        spill_dir: a local directory where a load keeps the ranges it checked until their
            copy, in unnamed files (see :mod:`paddle_dcp.io.spill`); "auto": the temporary
            directory unless it is in memory; None or "": none.
        retries: attempts of each request in all, the first included.
        retry_deadline: seconds after a request's first attempt when no new attempt starts;
            also the longest one attempt may last (on asynchronous fsspec filesystems such as
            s3fs), so a request ends within twice this.
    """

    part_size: int = 32 << 20
    parts_in_flight: int = 4
    read_concurrency: int = 8
    read_chunk_bytes: int = 16 << 20
    read_ahead_bytes: int = 64 << 20
    read_cache_bytes: int = 32 << 20
    spill_dir: str | None = "auto"
    retries: int = 6
    retry_deadline: float = 60.0

    @classmethod
    def split(cls, storage_options: dict | None) -> tuple["ObjectOptions", dict]:
        """(our options, fsspec's) from a user's ``storage_options``."""
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ArgumentError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
        rest = dict(storage_options or {})
        ours = {k: rest.pop(k) for k in cls.__dataclass_fields__ if k in rest}
        for key in ("part_size", "parts_in_flight", "read_concurrency", "read_chunk_bytes", "read_ahead_bytes", "read_cache_bytes"):
            value = ours.get(key, 1)
            if type(value) is not int or value < (0 if key == "read_cache_bytes" else 1):
                raise ArgumentError(f"storage_options[{key!r}] must be a positive int, got {value!r}")
        spill = ours.get("spill_dir")
        if spill is not None and not isinstance(spill, (str, os.PathLike)):
            raise ArgumentError(f"storage_options['spill_dir'] must be a directory, 'auto' or None, got {spill!r}")
        if spill not in (None, "", "auto") and not os.path.isdir(spill):
            raise ArgumentError(f"storage_options['spill_dir'] {spill!r} is not a directory")
        if spill is not None:
            ours["spill_dir"] = os.fspath(spill)
        opts = cls(**ours)
        opts.policy  # checks retries and retry_deadline
        return opts, rest

    @property
    def policy(self) -> RetryPolicy:
        return RetryPolicy(attempts=self.retries, deadline=float(self.retry_deadline))


_FILESYSTEMS: dict = {}


def _filesystem(protocol: str, fs_options: dict):
    """The fsspec filesystem of ``protocol`` (one per set of options in this process); our
    retry loop does the retrying, so fsspec's and botocore's are turned off."""
    try:
        import fsspec
    except ImportError:
        raise UnsupportedError(f"a {protocol}:// path needs fsspec: {INSTALL_HINT}") from None
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        raise UnsupportedError(f"a {protocol}:// path needs {exc.name or 'a missing package'}: {INSTALL_HINT}") from None
    except ValueError:
        raise UnsupportedError(f"fsspec knows no protocol {protocol!r} (for S3: s3://bucket/prefix, {INSTALL_HINT})") from None
    options = dict(fs_options)
    if protocol in S3_PROTOCOLS:
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", 60)
        # every block of a checkpoint has a checksum of ours, checked on load: botocore's CRC of
        # every part and GET would hash each byte once more (about half the speed)
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        # nor a SHA-256 of every body for the request's signature (botocore signs bodies unless
        # a checksum header is sent over https): TLS protects bodies in transit, our checksums
        # their content; {"s3": {"payload_signing_enabled": True}} in config_kwargs signs them
        s3_config = dict(config.get("s3") or {})
        s3_config.setdefault("payload_signing_enabled", False)
        config["s3"] = s3_config
        options["config_kwargs"] = config
        options.setdefault("use_listings_cache", False)
    # a changed environment (AWS_ENDPOINT_URL...) gets a new client
    key = (protocol, repr(sorted(options.items())), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        try:
            fs = cls(skip_instance_cache=True, **options)
        except TypeError as exc:
            raise ArgumentError(f"storage_options not accepted by fsspec's {protocol} filesystem: {exc}") from None
        if hasattr(fs, "retries"):
            fs.retries = 1  # s3fs's own loop: one attempt; ours retries
        _FILESYSTEMS[key] = fs
    return fs


def open_url(url: str, storage_options: dict | None = None) -> "ObjectStorage":
    """The storage of the checkpoint at ``url`` ("protocol://bucket/prefix")."""
    protocol, _, rest = url.partition("://")
    root = rest.strip("/")
    if not protocol or not root:
        raise ArgumentError(f"{url!r} is not a URL of a checkpoint: expected protocol://bucket/prefix")
    opts, fs_options = ObjectOptions.split(storage_options)
    if protocol in S3_PROTOCOLS and opts.part_size < 5 << 20:
        raise ArgumentError(f"storage_options['part_size'] is {opts.part_size} bytes; S3 needs at least 5 MiB (5242880)")
    return ObjectStorage(f"{protocol}://{root}", _filesystem(protocol, fs_options), root, opts, protocol)


class ObjectStorage:
    """The :class:`paddle_dcp.io.storage.Storage` of the objects under a URL prefix."""

    seen_by_all = True  # one bucket for every rank: the coordinator lists and cleans for all

    def __init__(self, url: str, fs: Any, root: str, options: ObjectOptions, protocol: str):
        self.path, self.fs, self.root, self.options, self.protocol = url, fs, root, options, protocol
        self.is_s3 = protocol in S3_PROTOCOLS
        self._uploads: dict[str, tuple[str, str]] = {}  # temporary name -> (key, upload id)
        self._present: set[str] | None = None  # the objects of the last listing, less those removed since
        # no attempt of a request outlasts retry_deadline (fsspec's timeout of its asynchronous
        # filesystems, s3fs's among them): a read timeout only bounds the silences, and a server
        # that trickles a few bytes at a time would hold an attempt for ever
        self.limit: dict = {"timeout": float(options.retry_deadline)} if getattr(fs, "async_impl", False) else {}

    # ------------------------------------------------------------------ names and requests
    def full(self, name: str) -> str:
        """The fsspec path of object ``name`` ("bucket/prefix/name")."""
        return f"{self.root}/{check_member_name(name)}"

    def resolve(self, name: str) -> str:
        return f"{self.path}/{check_member_name(name)}"

    def call(self, what: str, fn: Callable[[], Any], fatal: tuple = (FileNotFoundError,)) -> Any:
        """``fn()`` with the retries of :mod:`paddle_dcp.io.retry` (``what``: the request and
        its object's URL, for messages)."""
        return retrying(fn, what, self.options.policy, fatal=fatal)

    def s3(self, method: str, **kwargs) -> Any:
        """One S3 API call (through s3fs's client) on this storage's bucket."""
        bucket = self.root.split("/", 1)[0]
        return self.fs.call_s3(method, Bucket=bucket, **self.limit, **kwargs)

    @property
    def key_prefix(self) -> str:
        """The prefix of this checkpoint's object keys inside the bucket ("prefix/")."""
        parts = self.root.split("/", 1)
        return parts[1] + "/" if len(parts) > 1 else ""

    # ------------------------------------------------------------------ the interface
    def create(self) -> None:
        if self.protocol in ("file", "local"):
            self.call(f"MKDIR {self.path}", lambda: self.fs.makedirs(self.root, exist_ok=True))

    def sizes(self) -> dict[str, dict]:
        """name -> fsspec info of every object directly under the prefix (one LIST). Only
        objects count: a "directory" entry (a longer prefix with objects under it, or one that
        had some: SeaweedFS keeps listing a prefix after its last object is deleted) is none."""
        try:
            entries = self.call(f"LIST {self.path}/", lambda: self.fs.ls(self.root, detail=True, refresh=True, **self.limit))
        except FileNotFoundError:
            entries = []
        out = {}
        for e in entries:
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            if e.get("type", "file") == "file" and not e["name"].endswith("/"):
                out[name] = e
        self._present = set(out)
        return out

    def list_names(self, temporary: bool = True) -> list[str]:
        """What the prefix holds: one LIST, and with ``temporary`` (the default) a second one
        of the multipart uploads open under it (only cleaning up needs those)."""
        names = list(self.sizes())
        if self.is_s3 and temporary:
            names += self._pending_uploads()
        return names

    def _pending_uploads(self) -> list[str]:
        """The multipart uploads open under the prefix, as temporary names."""
        prefix = self.key_prefix
        try:
            reply = self.call(f"LIST UPLOADS {self.path}/", lambda: self.s3("list_multipart_uploads", Prefix=prefix))
        except StorageError as exc:  # a store without the call: no uploads to list (only cleanup needs them)
            logger.warning("cannot list the open multipart uploads of %s: %s", self.path, exc)
            return []
        names = []
        for up in reply.get("Uploads", []):
            name = up["Key"][len(prefix):]
            if "/" in name:
                continue
            tmp = f"{name}{TMP_MARK}{xxhash.xxh3_64_hexdigest(up['UploadId'].encode())}"
            self._uploads[tmp] = (up["Key"], up["UploadId"])
            names.append(tmp)
        return names

    def size(self, name: str) -> int | None:
        """The size in bytes of object ``name`` (a HEAD), or None when there is none (a
        prefix with objects under it is not one)."""
        full = self.full(name)
        if self.is_s3:  # s3fs's info() follows a missing object with a LIST (is it a prefix?)
            key = self.key_prefix + check_member_name(name)
            try:
                reply = self.call(f"HEAD {self.resolve(name)}", lambda: self.s3("head_object", Key=key))
            except FileNotFoundError:
                return None
            return int(reply["ContentLength"])
        try:
            info = self.call(f"HEAD {self.resolve(name)}", lambda: self.fs.info(full, refresh=True, **self.limit))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type", "file") == "file" else None

    def open_files(self, entries: Sequence[FileEntry], whose: str = "") -> "ObjectFiles":
        return ObjectFiles(self, entries, whose)

    def range_reader(self) -> "ObjectRangeReader":
        return ObjectRangeReader(self)

    def write_atomic(self, name: str, data: bytes, durable: bool = False) -> None:
        """One PUT: the object appears whole or not at all (``durable`` changes nothing: a
        completed PUT is durable)."""
        full = self.full(name)
        self.call(f"PUT {self.resolve(name)}", lambda: self.fs.pipe_file(full, bytes(data), **self.limit))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """A conditional PUT (``If-None-Match: *``): the store creates the object only when
        there is none, atomically (AWS S3, SeaweedFS, MinIO and others). A store that answers
        501 Not Implemented, or a protocol other than S3, is asked whether the object exists
        first, then written: two writers in the same moment may both succeed
        (docs/reliability.md)."""
        full, url = self.full(name), self.resolve(name)
        if self.is_s3:
            def put() -> bool:
                try:
                    self.fs.pipe_file(full, bytes(data), mode="create", **self.limit)
                    return True
                except OSError as exc:
                    if http_status(exc) in (409, 412):  # there is one / another conditional PUT of it is under way
                        return False
                    raise

            try:
                return self.call(f"PUT {url} (if absent)", put)
            except StorageError as exc:
                if http_status(exc) != 501:
                    raise
                logger.warning("%s: the store has no conditional PUT; the claim is checked, then written", url)
        if self.size(name) is not None:
            return False
        self.write_atomic(name, data)
        return True

    def read_file(self, name: str, limit: int | None = None) -> bytes | None:
        """One GET of a small object (a metadata file, a manager's manifest), cut one byte
        after ``limit``; None when there is none."""
        full, url = self.full(name), self.resolve(name)
        end = {} if limit is None else {"start": 0, "end": limit + 1}
        try:
            data = self.call(f"GET {url}", lambda: self.fs.cat_file(full, **end, **self.limit))
        except FileNotFoundError:
            return None
        if limit is not None and len(data) > limit:
            raise FormatError(f"{url}: over the {limit}-byte limit for this object")
        return data

    def open_stream(self, name: str, depth: int = 2):
        """An S3 multipart upload, or an fsspec file for other protocols (``depth``: the
        upload's own ``parts_in_flight`` applies instead)."""
        from .multipart import MultipartWriter, StreamWriter

        return (MultipartWriter if self.is_s3 else StreamWriter)(self, name)

    def remove(self, names: Iterable[str]) -> list[str]:
        """Delete objects and abort uploads by name; names known from this storage's last
        listing need no new one."""
        names = list(names)
        if not names:
            return []
        known = self._present is not None and all(n in self._present or n in self._uploads for n in names)
        present = set(self._present) if known and self._present is not None else set(self.sizes())
        if any(n not in present and n not in self._uploads for n in names) and self.is_s3:
            self._pending_uploads()
        removed, objects = [], []
        for name in names:
            if name in self._uploads:
                key, upload_id = self._uploads.pop(name)
                self.abort_upload(key, upload_id, raising=True)
                removed.append(name)
            elif name in present:
                objects.append(name)
        self._delete(objects)
        if self._present is not None:
            self._present.difference_update(objects)
        return removed + objects

    def _delete(self, names: list[str]) -> None:
        """Delete objects: on S3 1,000 per request (DeleteObjects), else one at a time."""
        if not self.is_s3 or len(names) == 1:
            for name in names:
                full = self.full(name)
                self.call(f"DELETE {self.resolve(name)}", lambda: self.fs.rm_file(full, **self.limit))
            return
        for at in range(0, len(names), DELETE_BATCH):
            batch = names[at : at + DELETE_BATCH]
            keys = [{"Key": self.key_prefix + check_member_name(n)} for n in batch]
            what = f"DELETE {len(batch)} objects under {self.path}/ ({batch[0]}...)"
            answer = self.call(what, lambda: self.s3("delete_objects", Delete={"Objects": keys, "Quiet": True}))
            failed = answer.get("Errors") or []
            if failed:
                first = failed[0]
                raise StorageError(
                    f"DELETE {self.path}/{first.get('Key', '?')[len(self.key_prefix):]}: {first.get('Code')} "
                    f"{first.get('Message', '')} ({len(failed)} of {len(batch)} objects not deleted)",
                    self.path,
                )

    def abort_upload(self, key: str, upload_id: str, raising: bool = False) -> None:
        """Abort multipart upload ``upload_id`` of ``key`` (its parts are dropped)."""
        url = f"{self.protocol}://{self.root.split('/', 1)[0]}/{key}"
        try:
            self.call(f"ABORT UPLOAD {url}", lambda: self.s3("abort_multipart_upload", Key=key, UploadId=upload_id))
        except (StorageError, FileNotFoundError) as exc:
            if raising and not isinstance(exc, FileNotFoundError):
                raise
            logger.warning("could not abort the multipart upload of %s: %s", url, exc)
