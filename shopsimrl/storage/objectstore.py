"""The object-store primitives under a sharded run: a local directory or S3 through fsspec.

:class:`ObjectStore` reads, lists, creates (create-only), overwrites and deletes whole objects
under one run location (``./runs/x``, ``file:///…``, ``s3://bucket/prefix/x``); the run layout
on top of it is :mod:`shopsimrl.storage.sharded`.

Object storage has neither append nor atomic rename. Writes are create-only where the store
supports it (``O_EXCL``-style hard link locally, ``If-None-Match: *`` on S3); a retried write
whose first try did land is recognised by comparing the bytes, so a lost response is not an
error.

S3 goes through s3fs with the standard ``AWS_*`` variables (``AWS_ENDPOINT_URL`` for MinIO or
SeaweedFS). ``region_name`` is deliberately never passed in ``client_kwargs``: s3fs would send
it as a bucket location constraint (set ``AWS_DEFAULT_REGION`` instead). Transient store
errors (503/SlowDown, throttling, connection resets, timeouts) are retried with capped
exponential backoff (:mod:`shopsimrl.retry`); a store that stays down raises
:class:`StoreUnavailableError` (exit 3).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import errno
import itertools
import json
import math
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Self, TypeVar
from urllib.parse import unquote, urlsplit

import orjson
from fsspec.implementations.local import LocalFileSystem

from shopsimrl.manifest import ManifestError
from shopsimrl.retry import Attempt, Backoff, Jitter, retry_sync
from shopsimrl.schemas import redact_uri

__all__ = [
    "TEMP_PREFIX",
    "ConcurrentCreateError",
    "ObjectStore",
    "RetryPolicy",
    "RunLocationError",
    "StoreUnavailableError",
    "is_create_conflict",
]

TEMP_PREFIX = ".tmp-"
"""Objects being written locally (hard-linked to their name once complete)."""

T = TypeVar("T")


class StoreUnavailableError(RuntimeError):
    """The object store kept failing after every retry; the work is safe to retry later (exit 3)."""


class ConcurrentCreateError(RuntimeError):
    """A create-only write lost to another conditional write that has not landed yet (retried)."""


class RunLocationError(ValueError):
    """The run location cannot be used as given: no bucket, access denied, not a run (exit 2)."""


# --------------------------------------------------------------------------- retries

# Errors that mean "the request may never have been processed or the store is overloaded".
_TRANSIENT_NAMES = {
    "ConnectionError",
    "ConnectionResetError",
    "ConnectionAbortedError",
    "BrokenPipeError",
    "TimeoutError",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ClientPayloadError",
    "ServerTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
}
_TRANSIENT_TEXT = re.compile(
    r"SlowDown|Throttl|ServiceUnavailable|\b50[0234]\b|InternalError|RequestTimeout|reduce your request rate", re.I
)


# How each backend answers a create-only write (``If-None-Match: *``) whose key exists, as s3fs
# hands it to us: AWS and moto send 412 PreconditionFailed with <Condition>If-None-Match</Condition>
# (s3fs: FileExistsError); SeaweedFS sends the 412 without the Condition element (s3fs:
# OSError(EINVAL)); AWS answers 409 ConditionalRequestConflict while another conditional write
# of the key is in flight (s3fs: OSError(EIO), which would otherwise look transient).
_CREATE_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})


def is_create_conflict(exc: BaseException) -> bool:
    """True when a create-only write failed because the object exists (or is being created)."""
    if isinstance(exc, FileExistsError):
        return True
    cause = exc.__cause__
    for _ in range(4):  # the botocore ClientError is the direct cause; a short chain is enough
        if cause is None:
            return False
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return code in _CREATE_CONFLICT_CODES or (not code and status == 412)
        cause = cause.__cause__
    return False


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code (``NoSuchBucket``, ``SignatureDoesNotMatch``…) behind an s3fs error."""
    cause: BaseException | None = exc
    for _ in range(4):  # the botocore ClientError is the direct cause; a short chain is enough
        if cause is None:
            return None
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            return code if isinstance(code, str) else None
        cause = cause.__cause__
    return None


_DENIED_REASONS = {
    "InvalidAccessKeyId": "the store knows no access key AWS_ACCESS_KEY_ID names (InvalidAccessKeyId); check AWS_ACCESS_KEY_ID",
    "SignatureDoesNotMatch": (
        "AWS_SECRET_ACCESS_KEY is not the secret of the access key AWS_ACCESS_KEY_ID names (SignatureDoesNotMatch); "
        "check AWS_SECRET_ACCESS_KEY"
    ),
    "InvalidToken": "AWS_SESSION_TOKEN is not valid (InvalidToken); check the AWS_* credentials",
    "ExpiredToken": "the session token has expired (ExpiredToken); renew the AWS_* credentials",
    "AccessDenied": "these credentials may not do that (AccessDenied); check the bucket's policy for them",
}


def _doing(what: str) -> str:
    """``"read manifest.json in"`` (worded for "… in s3://…") as ``"read manifest.json"``."""
    return what.removesuffix(" in")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ConcurrentCreateError):
        return True
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    for klass in type(exc).__mro__:
        if klass.__name__ in _TRANSIENT_NAMES:
            return True
    if isinstance(exc, OSError) and exc.errno in (errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.EBUSY):
        return True
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        return True  # a full or read-only disk (or a file size limit) may pass; give it the retry budget, then exit 3
    return bool(_TRANSIENT_TEXT.search(f"{type(exc).__name__}: {exc}"))


@dataclass(frozen=True)
class RetryPolicy(Backoff):
    """The store's retries: capped exponential backoff with proportional jitter, bounded by
    attempts and by a wall-clock budget per operation."""

    attempts: int = 8
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    budget_s: float = 60.0
    jitter: Jitter = "proportional"

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The default policy; ``SHOPSIMRL_STORE_RETRY_BUDGET_S`` caps the seconds spent retrying one operation."""
        budget = os.environ.get("SHOPSIMRL_STORE_RETRY_BUDGET_S")
        if not budget:
            return cls()
        try:
            seconds = float(budget)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds >= 0):
            raise RunLocationError(f"SHOPSIMRL_STORE_RETRY_BUDGET_S must be a finite number of seconds >= 0, got {budget!r}")
        return cls(budget_s=seconds)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried while it fails transiently; :class:`StoreUnavailableError` once retries run out."""

        def exhausted(last: Attempt, elapsed_s: float) -> StoreUnavailableError:
            error = StoreUnavailableError(
                f"{what}: object store still failing after {last.number} attempts "
                f"({elapsed_s:.1f} s): {type(last.error).__name__}: {last.error}"
            )
            error.__cause__ = last.error
            return error

        return retry_sync(lambda attempt: fn(), self, retryable=_is_transient, exhausted=exhausted)


# --------------------------------------------------------------------------- the file system


_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_BUCKET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_LOCATION_FORMS = "a directory path, file:///absolute/path or s3://bucket/prefix"


def _shown(uri: str) -> str:
    """The location for an error message: redacted, and anything before a stray ``@`` hidden.

    ``redact_uri`` removes a well-formed ``user:password@``; a password with an unencoded ``/``
    ends up outside the host part, so whatever precedes an ``@`` is hidden as well.
    """
    shown = redact_uri(uri)
    if "@" not in shown:
        return shown
    scheme = _URL_SCHEME.match(shown)
    return f"{scheme.group(0) + '//' if scheme else ''}…@{shown.rpartition('@')[2]}"


def _open_fs(uri: str) -> tuple[Any, str]:
    """The file system and root path of a run location, or RunLocationError saying why not.

    Only local directories and S3 are accepted: the commit protocol relies on their create-only
    writes. A location with credentials is refused (they belong in the ``AWS_*`` variables), and
    no message repeats them.
    """
    if not uri.strip():
        raise RunLocationError(f"the run location is empty; give {_LOCATION_FORMS}")
    match = _URL_SCHEME.match(uri)
    if match is None:
        return _open_local(uri, uri)
    scheme = match.group(1).lower()
    if not uri[match.end() :].startswith("//"):
        raise RunLocationError(
            f"{_shown(uri)}: '{scheme}:' without '//' is neither a URL nor a plain path; "
            f"write {scheme}://… (or ./{scheme}:… for a local directory with a colon in its name)"
        )
    try:
        parts = urlsplit(uri)
    except ValueError:
        raise RunLocationError(f"{_shown(uri)}: not a valid URL; give {_LOCATION_FORMS}") from None
    if scheme not in ("s3", "s3a", "file", "local"):
        raise RunLocationError(f"{_shown(uri)}: unsupported run location scheme '{scheme}://'; give {_LOCATION_FORMS}")
    if "@" in parts.netloc:
        hint = "S3 credentials belong in the AWS_* variables" if scheme in ("s3", "s3a") else "a local path takes none"
        raise RunLocationError(f"{_shown(uri)}: a run location must not contain user:password@ credentials; {hint}")
    if parts.query or parts.fragment or uri.endswith(("?", "#")):
        raise RunLocationError(f"{_shown(uri)}: a run location takes no ?query or #fragment")
    if scheme in ("file", "local"):
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise RunLocationError(f"{_shown(uri)}: a {scheme}:// location names an absolute path, e.g. {scheme}:///data/runs/x")
        return _open_local(unquote(parts.path), uri)
    if not parts.netloc:
        raise RunLocationError(f"{_shown(uri)}: an S3 run location needs a bucket, e.g. s3://bucket/runs/x")
    if not _BUCKET_NAME.match(parts.netloc):
        raise RunLocationError(
            f"{_shown(uri)}: the part after {scheme}:// must be a bucket name (letters, digits, '.', '-', '_'); "
            f"an S3 endpoint goes in AWS_ENDPOINT_URL"
        )
    import s3fs

    # Credentials come from the AWS_* variables through botocore's own chain and are never
    # copied anywhere; only the endpoint is passed explicitly (older botocore ignores
    # AWS_ENDPOINT_URL).
    client_kwargs: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    # One try per call below us (botocore and s3fs would otherwise each retry with their
    # own backoff, up to ~25 s per call): RetryPolicy owns retries, backoff and the budget.
    fs = s3fs.S3FileSystem(
        use_listings_cache=False,
        skip_instance_cache=True,
        client_kwargs=client_kwargs,
        config_kwargs={"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 1, "mode": "standard"}},
    )
    fs.retries = 1  # a class attribute in s3fs, not a constructor argument
    return fs, (parts.netloc + parts.path).rstrip("/")


def _open_local(path_text: str, uri: str) -> tuple[Any, str]:
    """A local run directory; refused when it, or the nearest part of it that exists, is no directory."""
    path = os.path.abspath(os.path.expanduser(path_text))
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if existing == path:
            raise RunLocationError(f"{_shown(uri)}: exists and is not a directory; a run location is a directory")
        raise RunLocationError(f"{_shown(uri)}: cannot be a directory, because {existing} exists and is not one")
    return LocalFileSystem(auto_mkdir=True), path


# --------------------------------------------------------------------------- the store


def _write_local_temp(path: str, data: bytes) -> str:
    """``data`` written and fsynced to a new temporary file beside ``path`` (a name readers skip:
    ``TEMP_PREFIX``); returns its path. A failed write removes it: a full disk must not leave a
    temporary file behind on every retry."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{TEMP_PREFIX}{os.getpid()}-{random.getrandbits(48):012x}")
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


READ_CONCURRENCY = 16
"""Object reads a reader keeps in flight by default (``SHOPSIMRL_STORE_READ_CONCURRENCY``)."""


def read_concurrency_from_env() -> int:
    """``SHOPSIMRL_STORE_READ_CONCURRENCY``: how many objects a reader fetches at once (1: one by one)."""
    value = os.environ.get("SHOPSIMRL_STORE_READ_CONCURRENCY")
    if not value:
        return READ_CONCURRENCY
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 1 <= number <= 256:
        raise RunLocationError(f"SHOPSIMRL_STORE_READ_CONCURRENCY must be a whole number from 1 to 256, got {value!r}")
    return number


class ObjectStore:
    """Whole objects under one run location, every call retried as :class:`RetryPolicy` allows."""

    def __init__(self, uri: str, *, retry: RetryPolicy | None = None, read_concurrency: int | None = None) -> None:
        self.uri = uri.rstrip("/") or uri
        self.display_uri = redact_uri(self.uri)
        self.retry = retry or RetryPolicy.from_env()
        self.read_concurrency = read_concurrency if read_concurrency is not None else read_concurrency_from_env()
        """Objects :meth:`read_many` keeps in flight."""
        if self.read_concurrency < 1:
            raise RunLocationError(f"read_concurrency must be at least 1, got {self.read_concurrency}")
        try:
            self.fs, self.root = _open_fs(uri)  # the unstripped form: "s3://" is not the path "s3:"
        except ImportError as exc:  # s3fs is not installed
            raise RunLocationError(f"{self.display_uri}: {exc}") from exc
        self.local = isinstance(self.fs, LocalFileSystem)

    # -- paths ------------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _call(self, what: str, fn: Callable[[], T], *, retry: bool = True) -> T:
        """``fn()`` with the store's retries (``retry=False``: one try), its errors worded with the location."""
        try:
            return self.retry.call(f"{what} {self.display_uri}", fn) if retry else fn()
        except PermissionError as exc:
            if self.local:
                raise RunLocationError(
                    f"{self.display_uri}: access denied ({what}); check the directory's permissions: {exc}"
                ) from exc
            raise RunLocationError(f"{self.display_uri}: access denied to {_doing(what)}: {self._denied_reason(exc)}") from exc
        except (FileNotFoundError, NotADirectoryError) as exc:
            if not self.local:
                raise
            # A directory that cannot be created where it was asked for (e.g. under /proc).
            raise RunLocationError(f"{self.display_uri}: cannot {what} it: {exc}") from exc
        except Exception as exc:
            if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):  # botocore's, raised as they are
                raise RunLocationError(
                    f"{self.display_uri}: no usable S3 credentials to {_doing(what)} ({exc}); "
                    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                ) from exc
            raise

    def _denied_reason(self, exc: BaseException) -> str:
        """What a 403 means, in words. A HEAD request's 403 has no body, so no code: then one
        listing of the location asks again, for an answer that carries it."""
        code = _error_code(exc)
        if code not in _DENIED_REASONS:
            try:
                self.fs.ls(self.root)
            except Exception as probe:
                code = _error_code(probe) or code
        return _DENIED_REASONS.get(code or "", f"HTTP 403 ({code or exc}); check the AWS_* credentials")

    def _missing_bucket(self, exc: FileNotFoundError) -> RunLocationError | None:
        """The error to raise when ``exc`` says the bucket itself is missing (not just an object)."""
        if _error_code(exc) != "NoSuchBucket":
            return None
        bucket = self.root.split("/", 1)[0]
        return RunLocationError(
            f"{self.display_uri}: the bucket '{bucket}' does not exist (NoSuchBucket); "
            "create it, or check the bucket name and AWS_ENDPOINT_URL"
        )

    # -- raw objects ------------------------------------------------------------------------

    def read_bytes(self, rel: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        path = self.path(rel)

        def read() -> bytes | None:
            try:
                return bytes(self.fs.cat_file(path))
            except FileNotFoundError as exc:
                if (missing := self._missing_bucket(exc)) is not None:
                    raise missing from exc  # not "no manifest": nothing can be there
                return None

        return self._call(f"read {rel} in", read)

    def read_head(self, rel: str, size: int) -> bytes | None:
        """The object's first ``size`` bytes (one ranged GET on S3), or None when it does not exist."""
        path = self.path(rel)

        def read() -> bytes | None:
            try:
                return bytes(self.fs.cat_file(path, start=0, end=size))
            except FileNotFoundError as exc:
                if (missing := self._missing_bucket(exc)) is not None:
                    raise missing from exc
                return None

        return self._call(f"read {rel} in", read)

    def read_many(self, rels: Iterable[str]) -> Iterator[tuple[str, bytes | None]]:
        """``(rel, read_bytes(rel))`` for each object, in the order given, fetched up to
        :attr:`read_concurrency` at a time.

        On S3 a reader's start-up is mostly the round trips of thousands of small GETs; here they
        overlap. The window is bounded: at most ``read_concurrency`` objects are fetched ahead of
        the one the caller is on, so a slow consumer holds no more than that. A read that fails
        (after its retries) raises when its turn comes, as reading one by one would; the reads
        still pending are then cancelled or waited for, never left running."""
        pending = iter(rels)
        if self.read_concurrency == 1:
            for rel in pending:
                yield rel, self.read_bytes(rel)
            return
        window: collections.deque[tuple[str, Future[bytes | None]]] = collections.deque()
        with ThreadPoolExecutor(self.read_concurrency, thread_name_prefix="store-read") as pool:
            try:
                for rel in itertools.islice(pending, self.read_concurrency):
                    window.append((rel, pool.submit(self.read_bytes, rel)))
                while window:
                    rel, future = window.popleft()
                    data = future.result()
                    for more in itertools.islice(pending, 1):  # one in, one out: the window stays full
                        window.append((more, pool.submit(self.read_bytes, more)))
                    yield rel, data
            finally:
                for _, future in window:
                    future.cancel()

    def read_json(self, rel: str) -> Any | None:
        data = self.read_bytes(rel)
        return None if data is None else self._parse_json(rel, data)

    def _parse_json(self, rel: str, data: bytes) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # orjson refuses what json reads (NaN): the standard parser decides, and words the error
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{self.display_uri}/{rel} is not valid JSON: {exc}") from exc

    def listdir(self, rel: str) -> list[str]:
        """Base names under ``rel`` (empty when it does not exist)."""
        path = self.path(rel)

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError as exc:
                if (missing := self._missing_bucket(exc)) is not None:
                    raise missing from exc
                return []
            return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") != "directory")

        return self._call(f"list {rel} in", ls)

    def list_entries(self, rel: str = "") -> tuple[list[str], list[str]]:
        """Base names of the objects and of the folders (common prefixes) directly under ``rel``,
        each sorted; both empty when it does not exist. One listing request on S3."""
        path = self.path(rel) if rel else self.root

        def ls() -> tuple[list[str], list[str]]:
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError as exc:
                if (missing := self._missing_bucket(exc)) is not None:
                    raise missing from exc
                return [], []
            files: list[str] = []
            folders: list[str] = []
            for entry in entries:
                name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                if entry["name"].rstrip("/") == path.rstrip("/"):
                    continue  # some stores list the folder itself
                (folders if entry.get("type") == "directory" else files).append(name)
            return sorted(files), sorted(folders)

        return self._call(f"list {rel or 'the top of'} in", ls)

    def beneath(self, rel: str) -> Self:
        """The same kind of store at ``rel`` under this one, sharing its file system (and so its
        connections): no new S3 client per run when many are read."""
        store = copy.copy(self)
        store.uri = f"{self.uri}/{rel}"
        store.display_uri = redact_uri(store.uri)
        store.root = self.path(rel)
        return store

    def create(self, rel: str, data: bytes, *, read_back: bool = True) -> bool:
        """Write ``data`` unless the object exists. True: written (or an identical copy was
        already there from a retried write). False: another object is already there.

        ``read_back=False``: skip reading the object back after an S3 write. The read-back only
        matters on stores that ignore ``If-None-Match`` and for names that two writers may
        create; a part's name carries its writer's random id, so no one else writes it."""
        path = self.path(rel)

        def attempt() -> bool:
            try:
                self._create_once(path, data, read_back=read_back)
                return True
            except Exception as exc:
                if not is_create_conflict(exc):
                    raise
            try:
                existing = bytes(self.fs.cat_file(path))
            except FileNotFoundError:
                # A 409 for a conditional write still in flight, which may yet fail: ask again.
                raise ConcurrentCreateError(f"{rel} is being created by another writer") from None
            return existing == data

        return self._call(f"write {rel} in", attempt)

    def _create_once(self, path: str, data: bytes, *, read_back: bool) -> None:
        if self.local:
            # A hard link is the local create-only primitive that also never exposes a torn
            # object: the data is complete and fsynced before the final name appears.
            tmp = _write_local_temp(path, data)
            try:
                os.link(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            with contextlib.suppress(OSError):
                fd = os.open(os.path.dirname(path), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileNotFoundError as exc:
            raise self._missing_bucket(exc) or RunLocationError(f"{self.display_uri}: the bucket does not exist ({exc})") from exc
        # Stores that ignore If-None-Match overwrite silently: read back, and if the bytes are
        # not ours a concurrent writer won the race.
        if read_back and bytes(self.fs.cat_file(path)) != data:
            raise FileExistsError(path)

    def overwrite(self, rel: str, data: bytes, *, retry: bool = True) -> None:
        """Replace the object whole (only derived data is ever replaced: summary.json and the
        progress objects). ``retry=False``: one try, for objects that the next write replaces."""
        path = self.path(rel)

        def put() -> None:
            if self.local:
                tmp = _write_local_temp(path, data)
                try:
                    os.replace(tmp, path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            else:
                try:
                    self.fs.pipe_file(path, data)
                except FileNotFoundError as exc:
                    raise self._missing_bucket(exc) or RunLocationError(
                        f"{self.display_uri}: the bucket does not exist ({exc})"
                    ) from exc

        self._call(f"write {rel} in", put, retry=retry)

    def delete(self, rel: str) -> None:
        """Remove one object; a missing object is not an error."""
        path = self.path(rel)

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)

        self._call(f"delete {rel} in", rm)
