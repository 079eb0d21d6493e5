"""The embedded object store: a local directory as the bucket (``file:PATH``).

The default for a single box and for ``make run``. It keeps the semantics of
:mod:`lchat.objstore` (ETags, conditional writes, Last-Modified, prefix listing, streaming) and its
conditional writes are atomic across every process on *one machine*. It is **not** for a fleet of
boxes: nothing here coordinates across machines, and network filesystems (NFS, SMB) give none of
the guarantees it relies on (``flock``, atomic ``rename``). Several boxes need a real bucket.

Layout under the root (which must exist, unless ``create=True``; a missing root is
:class:`StoreUnavailable`, so a vanished mount never turns silently into an empty bucket)::

    <root>/objects/<seg>@d/<seg>@d/<seg>@o    one object per key
    <root>/locks/00 .. 3f                     flock stripes for check-and-write

**Key -> path.** A key is split on ``/`` and each segment is percent-encoded: every UTF-8 byte
outside ``[A-Za-z0-9._-]`` becomes ``%XX`` (upper-case hex). Directories get the suffix ``@d`` and
objects ``@o`` (``@`` never survives encoding, so the suffix is unambiguous). Every path component is
therefore non-empty and never ``.`` or ``..``, contains no ``/`` or NUL, and a key can never name
anything outside ``<root>/objects``. Keys ``a`` and ``a/b`` coexist (``a@o`` next to ``a@d/``);
empty segments (``a//b``, ``/abs``, ``dir/``) are kept (``@d``, ``@o``). Keys over 1,024 UTF-8
bytes (S3's limit), empty keys, text that is not valid unicode, and segments whose encoding exceeds
a file name (~80 non-ASCII or ~250 ASCII bytes) are refused with :class:`KeyRefused`. The encoding
is case-sensitive: the root must live on a case-sensitive filesystem.

**Object file.** The body, then a JSON trailer (key, size, ETag, Last-Modified, user metadata,
content type), then 8 bytes: ``LCHO`` and the trailer's length (big-endian). Body and metadata live
in one file so that one ``rename`` publishes a whole version: a reader that opened the file reads a
consistent version even while it is being replaced or deleted.

**Writes.** The body streams into a temp file (``@t…``) in the key's directory and is fsynced
outside any lock. Then, holding an exclusive ``flock`` on the key's lock stripe: check the
condition, append the trailer (Last-Modified is taken here), fsync, ``rename`` over the object,
fsync the directory. Leftover temp files from a crash are never listed or read. Deletes take the same
lock, then prune empty directories (writers retry if a directory disappears under them).

**Clock.** ``last_modified`` is this machine's clock at commit (UTC), never older than the version
it replaces; ``now()`` is this machine's clock too: the "bucket's clock" of a local directory is
the box's own.

All disk work runs in a thread (``run_in_thread``), never on the reactor. :class:`FileBucket` is the
same store as plain blocking calls, for threads and for other processes.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import errno
import fcntl
import hashlib
import io
import json
import os
import secrets
import stat
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import IO, TypeVar, Unpack
from urllib.parse import unquote_to_bytes

import attrs
from attrs import define, field
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat.files import Replacement, fsync_directory
from lchat.objstore import (
    UTC,
    AccessDenied,
    NotFound,
    ObjectInfo,
    ObjectStoreError,
    PreconditionFailed,
    PutOptions,
    PutResult,
    StoredObject,
    StoreUnavailable,
)
from lchat.threads import RunInThread

_log = Logger()
_T = TypeVar("_T")

MAX_KEY_BYTES = 1024  # S3's limit; kept so a key that works here works on a real bucket
CHUNK = 1024 * 1024  # streaming unit: memory per stream stays around this
LOCK_STRIPES = 64
_NAME_MAX = 255
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_MAGIC = b"LCHO"
_FOOTER = struct.Struct(">4sI")
_OBJ, _DIR = "@o", "@d"
_TEMP = "@t"
_TRAILER_MAX = 1024 * 1024  # a key and S3-sized metadata need a few KB; more is not ours


class KeyRefused(ObjectStoreError):
    """A key this store cannot hold (empty, over 1,024 bytes, not unicode, a segment too long)."""


# --- key <-> path -----------------------------------------------------------------------------


def encode_segment(segment: str) -> str:
    """Percent-encode one ``/``-free key segment into a file-name stem (see the module docstring)."""
    raw = segment.encode("utf-8")
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)


def decode_segment(stem: str) -> str | None:
    """The inverse of :func:`encode_segment`; ``None`` for a stem this store did not write."""
    try:
        segment = unquote_to_bytes(stem).decode("utf-8")
    except ValueError:  # not UTF-8 (or, from a file name, not even unicode)
        return None
    return segment if encode_segment(segment) == stem else None  # canonical names only


def _segments(key: str) -> list[str]:
    if not isinstance(key, str) or key == "":
        raise KeyRefused("empty key", key=str(key))
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise KeyRefused("key is not valid unicode", key=key) from None
    if size > MAX_KEY_BYTES:
        raise KeyRefused(f"key is longer than {MAX_KEY_BYTES} bytes", key=key)
    return key.split("/")


def _stem(segment: str, key: str) -> str:
    try:
        stem = encode_segment(segment)
    except UnicodeEncodeError:
        raise KeyRefused("key is not valid unicode", key=key) from None
    if len(stem) + 2 > _NAME_MAX:
        raise KeyRefused("a key segment is too long for a file name", key=key)
    return stem


# --- object files ----------------------------------------------------------------------------


@define
class _Version:
    """One object file's trailer, and where its body ends."""

    key: str
    size: int
    etag: str
    last_modified: float
    metadata: dict[str, str]
    content_type: str

    def info(self, *, metadata: bool = True) -> ObjectInfo:
        return ObjectInfo(
            key=self.key,
            size=self.size,
            etag=self.etag,
            last_modified=datetime.datetime.fromtimestamp(self.last_modified, UTC),
            metadata=dict(self.metadata) if metadata else {},
        )


class _Corrupt(Exception):
    pass


def _read_version(f: IO[bytes]) -> _Version:
    total = os.fstat(f.fileno()).st_size
    if total < _FOOTER.size:
        raise _Corrupt("shorter than its footer")
    f.seek(total - _FOOTER.size)
    magic, length = _FOOTER.unpack(f.read(_FOOTER.size))
    if magic != _MAGIC or length > min(total - _FOOTER.size, _TRAILER_MAX):
        raise _Corrupt("bad footer")
    f.seek(total - _FOOTER.size - length)
    try:
        t = json.loads(f.read(length))
        v = _Version(
            key=str(t["key"]),
            size=int(t["size"]),
            etag=str(t["etag"]),
            last_modified=float(t["last_modified"]),
            metadata={str(k): str(x) for k, x in t["metadata"].items()},
            content_type=str(t["content_type"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _Corrupt(f"bad trailer: {e}") from None
    if v.size != total - _FOOTER.size - length:
        raise _Corrupt("size does not match")
    f.seek(0)
    return v


def _trailer(v: _Version) -> bytes:
    t = json.dumps(attrs.asdict(v), ensure_ascii=True, sort_keys=True).encode("ascii")
    return t + _FOOTER.pack(_MAGIC, len(t))


def _copy_body(src: IO[bytes], size: int | None, dst: IO[bytes] | _Sink) -> tuple[int, str]:
    """Copy ``size`` bytes (``None``: to the end) in chunks; how many there were, and their hex MD5."""
    md5 = hashlib.md5(usedforsecurity=False)
    copied = 0
    while size is None or copied < size:
        chunk = src.read(CHUNK if size is None else min(CHUNK, size - copied))
        if not chunk and size is None:
            break
        if not chunk:
            raise _Corrupt("body is shorter than its trailer says")
        md5.update(chunk)
        dst.write(chunk)
        copied += len(chunk)
    return copied, md5.hexdigest()


class _SinkFailed(Exception):
    """An exception from a caller's sink (the one argument), carried through the store's error
    mapping unchanged."""


class _Sink:
    """A caller's sink whose own failures are marked as such (see :class:`_SinkFailed`)."""

    def __init__(self, sink: IO[bytes]) -> None:
        self._sink = sink

    def rewind(self) -> None:
        try:
            self._sink.seek(0)
            self._sink.truncate()
        except Exception as e:
            raise _SinkFailed(e) from e

    def write(self, data: bytes) -> None:
        try:
            self._sink.write(data)
        except Exception as e:
            raise _SinkFailed(e) from e


# --- the blocking store ----------------------------------------------------------------------


def _absolute(path: str) -> str:
    return os.path.abspath(path)


@define
class FileBucket:
    """The file store as blocking calls: safe from many threads and many processes at once.

    Raises the typed errors of :mod:`lchat.objstore`: a missing or vanished root (or any other
    I/O failure) is :class:`StoreUnavailable`, a permission problem :class:`AccessDenied`.
    """

    root: str = field(converter=_absolute)
    create: bool = False  # make the root (mode 0700) if it is missing, instead of failing
    lock_timeout: float = 10.0  # a lock stripe held longer than this by someone else is a fault

    @property
    def objects(self) -> str:
        return os.path.join(self.root, "objects")

    # reads

    def head(self, key: str) -> ObjectInfo:
        with self._guard(key), self._open(key) as (_f, v):
            return v.info()

    def get(self, key: str) -> StoredObject:
        with self._guard(key), self._open(key) as (f, v):
            body = f.read(v.size)
            if len(body) != v.size:
                raise _Corrupt("body is shorter than its trailer says")
            if hashlib.md5(body, usedforsecurity=False).hexdigest() != v.etag:
                raise _Corrupt("body does not match its ETag")
            return StoredObject(info=v.info(), body=body)

    def get_to_file(self, key: str, path: str) -> ObjectInfo:
        """A destination that cannot be created is the caller's raw ``OSError``."""
        out = Replacement(path)  # outside the error mapping: a bad destination is the caller's
        try:
            with self._guard(key), self._open(key) as (f, v):
                if _copy_body(f, v.size, out.file)[1] != v.etag:
                    raise _Corrupt("body does not match its ETag")
        except BaseException:
            out.discard()
            raise
        out.commit()
        return v.info()

    def get_into(self, key: str, sink: IO[bytes]) -> int:
        out = _Sink(sink)
        try:
            with self._guard(key), self._open(key) as (f, v):
                out.rewind()
                if _copy_body(f, v.size, out)[1] != v.etag:
                    raise _Corrupt("body does not match its ETag")
                return v.size
        except _SinkFailed as e:
            raise e.args[0] from None

    def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        *dirs, last = prefix.split("/")
        with self._guard(prefix):
            try:
                base = self._dir_path(dirs, prefix)
            except KeyRefused:
                return []  # no key can be under a prefix no key can have
            found: builtins.list[ObjectInfo] = []
            stack: builtins.list[tuple[str, str, str]] = [(base, "/".join(dirs), last)]
            while stack:
                directory, key_dir, want = stack.pop()
                for name in self._scan(directory, top=directory == base):
                    stem, at, kind = name.rpartition("@")
                    segment = decode_segment(stem) if at else None
                    if segment is None or not segment.startswith(want):
                        continue
                    key = f"{key_dir}/{segment}" if directory != self.objects else segment
                    if kind == "d":
                        stack.append((os.path.join(directory, name), key, ""))
                    elif kind == "o":
                        info = self._list_entry(os.path.join(directory, name), key)
                        if info is not None:
                            found.append(info)
            # str order is code-point order, which is UTF-8 byte order: S3's order.
            found.sort(key=lambda i: i.key)
            return found

    def now(self) -> datetime.datetime:
        """This machine's clock, once the root answers (so a vanished root fails here too)."""
        with self._guard(""):
            try:
                os.stat(self.objects)
            except FileNotFoundError:
                self._check_root()
            return datetime.datetime.now(UTC)

    # writes

    def put(self, key: str, body: bytes, **options: Unpack[PutOptions]) -> PutResult:
        with self._guard(key):
            return self._write(key, lambda out: _copy_body(io.BytesIO(body), None, out), **options)

    def put_file(
        self, key: str, path: str, *, metadata: Mapping[str, str] | None = None
    ) -> PutResult:
        """Stream ``path`` in (any readable file, read to its end). Source errors are raw OSError."""
        src = open(path, "rb")  # outside the error mapping: a bad source is the caller's
        with src, self._guard(key):
            return self._write(key, lambda out: _copy_body(src, None, out), metadata=metadata)

    def copy(self, source: str, destination: str) -> PutResult:
        """A new version of ``destination`` with ``source``'s body, metadata and content type."""
        with self._guard(source), self._open(source) as (f, v):
            _segments(destination)

            def fill(out: IO[bytes]) -> tuple[int, str]:
                size, etag = _copy_body(f, v.size, out)
                if etag != v.etag:
                    raise _Corrupt(f"{source!r}: body does not match its ETag")
                return size, etag

            return self._write(destination, fill, metadata=v.metadata, content_type=v.content_type)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        with self._guard(key):
            directory, path = self._object_path(key)
            try:
                with self._locked(key):
                    if if_match is not None:
                        current = self._current(path)
                        if current is None or current.etag != if_match:
                            raise PreconditionFailed("ETag does not match", key=key)
                    os.unlink(path)
                    fsync_directory(directory)
            except (FileNotFoundError, NotADirectoryError):
                self._check_root()
                return  # a missing key is already deleted
            self._prune(directory)

    # internals

    @contextlib.contextmanager
    def _guard(self, key: str) -> Iterator[None]:
        """Turn OS errors into the store's typed errors."""
        try:
            yield
        except (PreconditionFailed, NotFound):
            # "Not there" from a root that is itself gone is an outage, not an answer.
            self._check_root()
            raise
        except ObjectStoreError:
            raise
        except _Corrupt as e:
            _log.error(
                "file store {root}: corrupt object {key!r}: {e}", root=self.root, key=key, e=e
            )
            raise StoreUnavailable(f"file store {self.root}: corrupt object: {e}", key=key) from e
        except OSError as e:
            raise self._mapped(e, key) from e

    def _mapped(self, e: OSError, key: str) -> ObjectStoreError:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return AccessDenied(f"file store {self.root}: {e.strerror}", key=key)
        if e.errno == errno.ENAMETOOLONG:
            return KeyRefused("key is too long for this filesystem", key=key)
        try:
            self._check_root()
        except ObjectStoreError as root_problem:
            return root_problem
        return StoreUnavailable(f"file store {self.root}: {e}", key=key)

    def _check_root(self) -> None:
        """Raise the typed error for a root that is missing, not a directory, or unreachable."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            raise StoreUnavailable(
                f"file store root {self.root} does not exist (create it, or fix the path)"
            ) from None
        except PermissionError:
            raise AccessDenied(f"file store root {self.root} is not accessible") from None
        except OSError as e:
            raise StoreUnavailable(f"file store root {self.root}: {e}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise StoreUnavailable(f"file store root {self.root} is not a directory")
        try:
            os.stat(os.path.join(self.root, "locks"))
        except FileNotFoundError:
            pass
        except PermissionError:
            raise AccessDenied(f"file store root {self.root} is not accessible") from None

    def _dir_path(self, segments: builtins.list[str], key: str) -> str:
        return os.path.join(self.objects, *(_stem(s, key) + _DIR for s in segments))

    def _object_path(self, key: str) -> tuple[str, str]:
        segments = _segments(key)
        directory = self._dir_path(segments[:-1], key)
        return directory, os.path.join(directory, _stem(segments[-1], key) + _OBJ)

    @contextlib.contextmanager
    def _open(self, key: str) -> Iterator[tuple[IO[bytes], _Version]]:
        """Open the current version of ``key``; the open file stays that version to the end."""
        _, path = self._object_path(key)
        try:
            f = open(path, "rb")
        except (FileNotFoundError, NotADirectoryError):
            self._check_root()
            raise NotFound("no such key", key=key) from None
        with f:
            v = _read_version(f)
            v.key = key  # the path is the truth (a trailer only records it, for recovery)
            yield f, v

    def _current(self, path: str) -> _Version | None:
        try:
            with open(path, "rb") as f:
                return _read_version(f)
        except FileNotFoundError:
            return None

    def _scan(self, directory: str, *, top: bool) -> builtins.list[str]:
        try:
            with os.scandir(directory) as it:
                return [e.name for e in it]
        except (FileNotFoundError, NotADirectoryError):
            if top:
                self._check_root()
            return []  # nothing there yet, or pruned while we walked

    def _list_entry(self, path: str, key: str) -> ObjectInfo | None:
        try:
            v = self._current(path)  # None: deleted while we walked
        except _Corrupt as e:
            _log.error(
                "file store {root}: skipping corrupt {path}: {e}", root=self.root, path=path, e=e
            )
            return None
        if v is None:
            return None
        v.key = key  # the path is the truth
        return v.info(metadata=False)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """Hold the key's lock stripe (an exclusive flock: every process on this machine agrees)."""
        stripe = zlib.crc32(key.encode("utf-8")) % LOCK_STRIPES
        locks = os.path.join(self.root, "locks")
        path = os.path.join(locks, f"{stripe:02x}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            self._check_root()
            with contextlib.suppress(FileExistsError):
                os.mkdir(locks, 0o700)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreUnavailable(
                            f"file store {self.root}: lock {path} busy for {self.lock_timeout}s",
                            key=key,
                        ) from None
                    time.sleep(0.002)  # FileBucket runs in worker threads, never the reactor
            yield  # closing the descriptor releases the lock
        finally:
            os.close(fd)

    def _make_dirs(self, directory: str) -> None:
        """Create ``directory`` and its parents under ``objects``, fsyncing each new entry."""
        if not os.path.isdir(self.root):
            if not self.create:
                self._check_root()
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        rel = os.path.relpath(directory, self.root)
        current = self.root
        for part in rel.split(os.sep):
            parent, current = current, os.path.join(current, part)
            try:
                os.mkdir(current, 0o700)
            except FileExistsError:
                continue
            fsync_directory(parent)

    def _write(
        self,
        key: str,
        fill: Callable[[IO[bytes]], tuple[int, str]],
        *,
        metadata: Mapping[str, str] | None = None,
        content_type: str = "application/octet-stream",
        if_match: str | None = None,
        if_none_match: bool = False,
    ) -> PutResult:
        directory, path = self._object_path(key)
        meta = {str(k).lower(): str(v) for k, v in (metadata or {}).items()}
        tmp, out = self._temp(directory)
        try:
            with out:
                size, etag = fill(out)
                out.flush()
                os.fsync(out.fileno())  # the bulk of the data, outside the lock
                with self._locked(key):
                    current = self._current(path)
                    if if_none_match and current is not None:
                        raise PreconditionFailed("key already exists", key=key)
                    if if_match is not None and (current is None or current.etag != if_match):
                        raise PreconditionFailed("ETag does not match", key=key)
                    # Last-Modified is the commit time, never older than the version it replaces.
                    stamp = time.time()
                    if current is not None:
                        stamp = max(stamp, current.last_modified)
                    version = _Version(key, size, etag, stamp, meta, content_type)
                    out.write(_trailer(version))
                    out.flush()
                    os.fsync(out.fileno())
                    os.rename(tmp, path)
                    fsync_directory(directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return PutResult(key=key, etag=etag)

    def _temp(self, directory: str) -> tuple[str, IO[bytes]]:
        """A new temp file in ``directory``, retrying if a delete prunes the directory under us."""
        for _ in range(10):
            tmp = os.path.join(directory, f"{_TEMP}{os.getpid()}.{secrets.token_hex(8)}")
            try:
                self._make_dirs(directory)
                return tmp, open(tmp, "xb")
            except FileNotFoundError:
                continue
        self._check_root()
        raise StoreUnavailable(f"file store {self.root}: directory keeps vanishing")

    def _prune(self, directory: str) -> None:
        """Remove now-empty directories up to ``objects`` (best effort: racing writers retry)."""
        while directory != self.objects and directory.startswith(self.objects + os.sep):
            try:
                os.rmdir(directory)
            except OSError:
                return
            directory = os.path.dirname(directory)


# --- the asynchronous store ------------------------------------------------------------------


@define
class FileStore:
    """:class:`lchat.objstore.ObjectStore` over a local directory; every disk call in a thread.

    ``timeout`` bounds each call that does not stream (a hung disk or mount becomes
    :class:`StoreUnavailable` instead of a hang; the thread itself cannot be stopped).
    ``get_to_file``, ``put_file`` and ``copy`` are not bounded: their time grows with the object.
    """

    _reactor: IReactorTime
    root: str = field(converter=_absolute)
    _run_in_thread: RunInThread
    create: bool = False
    timeout: float | None = 60.0
    bucket: FileBucket = field(init=False)

    def __attrs_post_init__(self) -> None:
        self.bucket = FileBucket(self.root, create=self.create)

    def describe(self) -> str:
        return f"file:{self.root}"

    async def _run(self, f: Callable[[], _T], *, bounded: bool = True) -> _T:
        d: Deferred[_T] = self._run_in_thread(f)
        if bounded and self.timeout is not None:
            d.addTimeout(self.timeout, self._reactor)
        try:
            return await d
        except TimeoutError:
            raise StoreUnavailable(
                f"file store {self.root}: no answer from the disk within {self.timeout}s"
            ) from None

    async def get(self, key: str) -> StoredObject:
        return await self._run(lambda: self.bucket.get(key))

    async def get_to_file(self, key: str, path: str) -> ObjectInfo:
        return await self._run(lambda: self.bucket.get_to_file(key, path), bounded=False)

    async def get_into(self, key: str, sink: IO[bytes]) -> int:
        return await self._run(lambda: self.bucket.get_into(key, sink), bounded=False)

    async def head(self, key: str) -> ObjectInfo:
        return await self._run(lambda: self.bucket.head(key))

    async def put(self, key: str, body: bytes, **options: Unpack[PutOptions]) -> PutResult:
        return await self._run(lambda: self.bucket.put(key, body, **options))

    async def put_file(
        self, key: str, path: str, *, metadata: Mapping[str, str] | None = None
    ) -> PutResult:
        return await self._run(
            lambda: self.bucket.put_file(key, path, metadata=metadata), bounded=False
        )

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        await self._run(lambda: self.bucket.delete(key, if_match=if_match))

    async def copy(self, source: str, destination: str) -> PutResult:
        return await self._run(lambda: self.bucket.copy(source, destination), bounded=False)

    async def now(self) -> datetime.datetime:
        return await self._run(self.bucket.now)

    async def close(self) -> None:
        """Nothing to release: the threads are the thread runner's."""

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        return await self._run(lambda: self.bucket.list(prefix))
