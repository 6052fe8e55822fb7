"""The S3 side of an object-store shared tier: ``s3://bucket/prefix`` URLs, their options, and a
client (boto3, imported only when an ``s3://`` target is used) that retries under a deadline which
refreshes on progress, uploads large files in parts with bounded concurrency (aborting the upload on
failure, so no parts are left billed), and writes objects with ``If-None-Match: *``.

Credentials and the endpoint come from where boto3 finds them (environment, ``~/.aws``,
``AWS_ENDPOINT_URL``); an explicit ``endpoint_url`` wins. Nothing here writes or logs them.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import fastio

__all__ = ["ObjectStore", "ObjectStoreError", "S3Client", "S3Url", "is_object_url", "parse_s3_url"]

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# What the server or the network may get wrong for a while: retried under the deadline.
_RETRY_CODES = {"connection", "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
                "ThrottlingException", "RequestTimeTooSkewed", "503", "500", "502", "504"}
# The retries' jitter draws from a generator of its own: the drainer's thread must never move the
# training's `random` state, which a step boundary captures and resume restores (exactness).
_JITTER = random.Random()


class ObjectStoreError(OSError):
    """An object-store request failed for good (after retries); names the URL and the operation.
    ``code``: the store's error code ("NoSuchKey", "AccessDenied", ...; "connection" for the
    network)."""

    code: str | None = None

    @property
    def missing(self) -> bool:
        """Whether the object (not the store) is the problem: it does not exist."""
        return self.code in ("NoSuchKey", "404")


def is_object_url(target) -> bool:
    return isinstance(target, str) and target.startswith("s3://")


@dataclasses.dataclass(frozen=True)
class S3Url:
    bucket: str
    prefix: str          # no leading or trailing slash; "" for the bucket's root

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def name(self, key: str) -> str | None:
        """The name under the prefix of ``key`` (None: not directly under it)."""
        head = f"{self.prefix}/" if self.prefix else ""
        if not key.startswith(head) or "/" in key[len(head):]:
            return None
        return key[len(head):]

    def child(self, name: str) -> S3Url:
        return S3Url(self.bucket, self.key(name))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_s3_url(url: str) -> S3Url:
    """``s3://bucket[/prefix]`` checked (ValueError naming the URL and what is wrong)."""
    if not is_object_url(url):
        raise ValueError(f"{url!r} is not an s3:// URL")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise ValueError(f"{url!r}: {bucket!r} is not a valid bucket name (3-63 characters: a-z, 0-9, '.', '-')")
    prefix = prefix.strip("/")
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{url!r}: the prefix {prefix!r} has an empty, '.' or '..' segment")
    if any(ord(c) < 32 for c in prefix):
        raise ValueError(f"{url!r}: the prefix has a control character")
    return S3Url(bucket, prefix)


@dataclasses.dataclass(frozen=True)
class ObjectStore:
    """How an object-store tier is written. ``part_bytes``: the part size of multipart uploads
    (files larger than it are sent in parts; S3 requires 5 MiB or more for every part but the
    last); ``max_concurrency``: parts in flight per file; ``deadline_s``: how long a request may go
    on failing (or a multipart upload make no progress) before the upload gives up; a completed
    part restarts it; ``connect_timeout_s``/``read_timeout_s``: per request (a stalled transfer
    counts as a failure and is retried); ``endpoint_url``: None takes boto3's (``AWS_ENDPOINT_URL``,
    the AWS config)."""

    part_bytes: int = 64 << 20
    max_concurrency: int = 4
    deadline_s: float = 300.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    endpoint_url: str | None = None

    def __post_init__(self):
        for name in ("part_bytes", "max_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ObjectStore({name}={value!r}) must be an int >= 1")
        for name in ("deadline_s", "connect_timeout_s", "read_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ObjectStore({name}={value!r}) must be a number > 0")
        if self.endpoint_url is not None and not re.match(r"^https?://", str(self.endpoint_url)):
            raise ValueError(f"ObjectStore(endpoint_url={self.endpoint_url!r}) must start with http:// or https://")


class _Deadline:
    """Expires ``seconds`` after the last progress (thread-safe: parts report from their threads)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def progress(self) -> None:
        with self._lock:
            self._last = time.monotonic()

    def left(self) -> float:
        with self._lock:
            return self.seconds - (time.monotonic() - self._last)


def _boto():
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as exc:
        raise ImportError("an s3:// shared tier needs boto3: pip install 'lowdiff[s3]'") from exc
    return boto3, botocore


class S3Client:
    """One bucket's client. Every request goes through ``call``: retried with exponential backoff
    and jitter while the error is transient and the deadline has not expired."""

    def __init__(self, url: S3Url, options: ObjectStore):
        boto3, botocore = _boto()
        self.url, self.options = url, options
        self._errors = botocore.exceptions
        config = botocore.config.Config(
            # The retries are ours (deadline, progress). ("max_attempts": 1 still let botocore retry once,
            # drawing its jitter from the global `random` in the drainer's thread.)
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=options.connect_timeout_s, read_timeout=options.read_timeout_s,
            max_pool_connections=options.max_concurrency + 2)
        self._s3 = boto3.session.Session().client("s3", endpoint_url=options.endpoint_url, config=config)
        self.endpoint = self._s3.meta.endpoint_url

    # ------------------------------------------------------------ requests
    def call(self, what: str, operation: str, *, deadline: _Deadline | None = None, **kwargs):
        return self.retrying(what, lambda: getattr(self._s3, operation)(**kwargs), deadline)

    def retrying(self, what: str, fn: Callable, deadline: _Deadline | None = None):
        """``fn()``, retried with exponential backoff and jitter while its error is transient and
        ``deadline`` (a fresh one: ``deadline_s``) has not expired; each success is progress."""
        deadline = deadline or _Deadline(self.options.deadline_s)
        attempt = 0
        while True:
            try:
                result = fn()
                deadline.progress()
                return result
            except Exception as exc:   # botocore raises many unrelated types; classified below
                code = self.code(exc)
                if code is None or code not in _RETRY_CODES or deadline.left() <= 0:
                    raise self._error(what, exc, code) from exc
                attempt += 1
                time.sleep(min(max(deadline.left(), 0.0), min(0.05 * 2 ** attempt, 2.0) * _JITTER.uniform(0.5, 1.0)))

    def code(self, exc: BaseException) -> str | None:
        """The error's S3 code, "500"-like for bare HTTP statuses, "connection" for network
        failures; None for errors that are ours (not the store's)."""
        errors = self._errors
        if isinstance(exc, errors.ClientError):
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(error.get("Code") or status)
            return code if code not in ("None", "") else str(status)
        if isinstance(exc, (errors.ConnectionError, errors.HTTPClientError, errors.ResponseStreamingError,
                            errors.IncompleteReadError)):
            return "connection"
        return None

    def _error(self, what: str, exc: BaseException, code: str | None) -> BaseException:
        if code is None:
            return exc
        if code == "NoSuchBucket":
            why = f"the bucket {self.url.bucket!r} does not exist"
        elif code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            why = "access denied (check the credentials and the bucket's policy)"
        elif code == "connection":
            why = f"cannot reach the endpoint {self.endpoint} ({type(exc).__name__})"
        else:
            why = f"{code}: {exc}"
        error = ObjectStoreError(f"{what} {self.url} failed: {why}")
        error.code = code
        return error

    # ------------------------------------------------------------ objects
    def put(self, name: str, body: bytes, *, if_none_match: bool = False) -> None:
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_none_match else {}
        self.call(f"writing {name} to", "put_object", Bucket=self.url.bucket, Key=self.url.key(name), Body=body,
                  **extra)

    def get(self, name: str) -> bytes:
        return self.retrying(f"reading {name} from", lambda: self._s3.get_object(
            Bucket=self.url.bucket, Key=self.url.key(name))["Body"].read())

    def get_range(self, name: str, offset: int, nbytes: int) -> bytes:
        """Bytes ``offset .. offset + nbytes`` of the object ``name`` (a ranged GET): a file's
        index read without its records (lowdiff.tiers.fetch.ObjectRanges)."""
        if nbytes <= 0:
            return b""
        wanted = f"bytes={offset}-{offset + nbytes - 1}"
        return self.retrying(f"reading {name} from", lambda: self._s3.get_object(
            Bucket=self.url.bucket, Key=self.url.key(name), Range=wanted)["Body"].read())

    def listing(self) -> dict:
        """{name: size} of the objects directly under the prefix."""
        found: dict = {}
        kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Prefix": self.url.key("")}
        while True:
            page = self.call("listing", "list_objects_v2", **kwargs)
            for item in page.get("Contents", []):
                name = self.url.name(item["Key"])
                if name:
                    found[name] = item["Size"]
            if not page.get("IsTruncated"):
                return found
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def children(self, start: str = "") -> list:
        """The names beginning with ``start`` of the "folders" directly under the prefix (keys
        holding a further "/"), found by listing the keys under ``prefix/start`` (no delimiter:
        some S3-compatible servers mis-sign a query holding "/")."""
        head = self.url.key("")
        found: set = set()
        kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Prefix": head + start}
        while True:
            page = self.call("listing", "list_objects_v2", **kwargs)
            found |= {rest.split("/", 1)[0] for item in page.get("Contents", [])
                      if "/" in (rest := item["Key"][len(head):])}
            if not page.get("IsTruncated"):
                return sorted(found)
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def delete(self, names) -> None:
        names = list(names)
        for first in range(0, len(names), 1000):
            chunk = names[first:first + 1000]
            self.call("deleting from", "delete_objects", Bucket=self.url.bucket,
                      Delete={"Objects": [{"Key": self.url.key(n)} for n in chunk], "Quiet": True})

    def uploads(self) -> list:
        """[(key, upload id)] of the multipart uploads begun under the prefix and not finished."""
        found: list = []
        kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Prefix": self.url.key("")}
        while True:
            page = self.call("listing the uploads of", "list_multipart_uploads", **kwargs)
            found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
            if not page.get("IsTruncated"):
                return found
            kwargs.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])

    def abort(self, key: str, upload_id: str) -> None:
        self.call(f"aborting the upload of {key} to", "abort_multipart_upload", Bucket=self.url.bucket, Key=key,
                  UploadId=upload_id)

    # ------------------------------------------------------------ files
    def upload_file(self, path: str, name: str) -> tuple[int, int]:
        """Upload the file ``path`` as ``name``; returns (bytes, CRC-32C of the bytes read). Files
        over ``part_bytes`` go in parts, at most ``max_concurrency`` in flight; a failed multipart
        upload is aborted before the error is raised."""
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size <= self.options.part_bytes:
                body = f.read()
                if len(body) != size:
                    raise OSError(f"{path} changed size while it was read ({len(body)} of {size} bytes)")
                self.put(name, body)
                return size, fastio.crc32c(body)
            return size, self._multipart(f, size, name)

    def _multipart(self, f, size: int, name: str) -> int:
        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

        key = self.url.key(name)
        deadline = _Deadline(self.options.deadline_s)
        upload_id = self.call(f"starting the upload of {name} to", "create_multipart_upload",
                              deadline=deadline, Bucket=self.url.bucket, Key=key)["UploadId"]
        crc, parts, pending = 0, cast(dict, {}), cast(set, set())
        try:
            with ThreadPoolExecutor(self.options.max_concurrency, thread_name_prefix="lowdiff-s3-part") as pool:
                for number, offset in enumerate(range(0, size, self.options.part_bytes), start=1):
                    # Read in order (the CRC runs over the file), upload in parallel; at most
                    # max_concurrency parts are held in memory.
                    while len(pending) >= self.options.max_concurrency:
                        done, pending = wait(pending, return_when=FIRST_COMPLETED)
                        for future in done:
                            parts.update([future.result()])
                    body = os.pread(f.fileno(), min(self.options.part_bytes, size - offset), offset)
                    crc = fastio.crc32c(body, crc)
                    pending.add(pool.submit(self._part, name, key, upload_id, number, body, deadline))
                for future in pending:
                    parts.update([future.result()])
            self.call(f"completing the upload of {name} to", "complete_multipart_upload", deadline=deadline,
                      Bucket=self.url.bucket, Key=key, UploadId=upload_id,
                      MultipartUpload={"Parts": [{"PartNumber": n, "ETag": parts[n]} for n in sorted(parts)]})
        except BaseException:
            try:
                self.abort(key, upload_id)
            except Exception:   # the next run's cleaning lists and aborts it (lowdiff.tiers.bucket)
                pass
            raise
        return crc

    def _part(self, name, key, upload_id, number, body, deadline) -> tuple[int, str]:
        result = self.call(f"uploading part {number} of {name} to", "upload_part", deadline=deadline,
                           Bucket=self.url.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
        return number, result["ETag"]

    def download(self, name: str, path: str, chunk_bytes: int = 8 << 20) -> tuple[int, int]:
        """Stream the object ``name`` into the new file ``path``; returns (bytes, CRC-32C)."""
        def fetch():
            body = self._s3.get_object(Bucket=self.url.bucket, Key=self.url.key(name))["Body"]
            crc = nbytes = 0
            with open(path, "wb") as out:
                while chunk := body.read(chunk_bytes):
                    crc = fastio.crc32c(chunk, crc)
                    nbytes += len(chunk)
                    out.write(chunk)
            return nbytes, crc
        return self.retrying(f"reading {name} from", fetch)
