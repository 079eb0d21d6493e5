"""The home store conformance suite (``lchat/home/store.py``): one set of tests, every backend.

:class:`Conformance` holds the tests; each concrete TestCase says how to make its store:

- :class:`SQLiteTest`: :class:`lchat.home.sqlite_store.SQLiteVaultStore` on a fresh file per test;
- :class:`MotoTest`: :class:`lchat.home.s3_store.S3VaultStore` on moto's server;
- :class:`SeaweedFSTest`: ``S3VaultStore`` on SeaweedFS (``weed mini``).

The S3 servers are real processes on loopback ports (``tests/s3servers.py``): one shared server per
kind, a fresh versioned bucket per test, and a private server for the test that hangs and kills
it. The one backend-specific answer the contract allows is a version string the store never
issued: :class:`BadVersion` on SQLite, :class:`Conflict` on S3 (``bad_version_is_conflict``).

:class:`MotoVersionedObjects` and :class:`SeaweedFSVersionedObjects` test what the S3 store needed
added to our object-store client (``S3Store.versioning``, ``list_versions``, ``get_version``,
``delete_version``).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import json
import os
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from prometheus_client import REGISTRY
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, TimeoutError, gatherResults
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.trial import unittest
from twisted.web.resource import Resource
from twisted.web.server import Request, Site
from zope.interface import implementer

from lchat.home import sqlite_store
from lchat.home.s3_store import S3VaultStore, normalise_prefix
from lchat.home.sqlite_store import SQLiteVaultStore
from lchat.home.store import (
    KEEP_VERSIONS,
    MARKER_LIFETIME,
    MAX_USER_DOC,
    NO_VERSION,
    BadVersion,
    Blob,
    Conflict,
    DocumentTooLarge,
    PointerTaken,
    StoreError,
    UserDoc,
    VaultStore,
    resolve_checked,
)
from lchat.objstore import UTC, NotFound, ObjectStore
from lchat.objstore.s3 import S3Store
from lchat.reactors import installed
from lchat.threads import thread_runner
from tests import s3servers

reactor = installed()
T = TypeVar("T")

# Version strings no store issued: the S3 backend answers Conflict, SQLite BadVersion.
FOREIGN_VERSIONS = [
    "abc",
    "999999",
    "",
    "*",
    '"quoted"',
    "W/abc",
    "00",
    "-1",
    "1 2",
    "a,b",
    "9abcde3c584628a02620bf796dee1204",  # an MD5 (an ETag shape) of nothing we wrote
]


def new_uid() -> str:
    return secrets.token_urlsafe(12)


def in_thread(f: Callable[..., T], *args: Any) -> Deferred[T]:
    return deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _sqlite_backup(source: str, destination: str) -> None:
    with (
        contextlib.closing(sqlite3.connect(source)) as src,
        contextlib.closing(sqlite3.connect(destination)) as dst,
    ):
        src.backup(dst)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


if TYPE_CHECKING:
    _Mixin = unittest.TestCase
else:
    _Mixin = object  # not a TestCase itself, or trial would run the hook-less base


Operation = Callable[[VaultStore], Coroutine[Any, Any, object]]

# Every operation, on a user that exists (the failure tests seed one first).
OPERATIONS: dict[str, Operation] = {
    "get_blob": lambda s: s.get_blob("seeded"),
    "put_blob": lambda s: s.put_blob("seeded", b"x", "1"),
    "put_blob_new": lambda s: s.put_blob("fresh", b"x", NO_VERSION),
    "list_blob_versions": lambda s: s.list_blob_versions("seeded"),
    "get_blob_version": lambda s: s.get_blob_version("seeded", "1"),
    "get_user": lambda s: s.get_user("seeded"),
    "put_user": lambda s: s.put_user("seeded", {"n": 2}, NO_VERSION),
    "update_user": lambda s: s.update_user("seeded", lambda doc: {"n": 3}),
    "put_pointer": lambda s: s.put_pointer("creds", "new-cred", "seeded"),
    "resolve_pointer": lambda s: s.resolve_pointer("creds", "seeded-cred"),
    "check": lambda s: s.check(),
    "mark_revoked": lambda s: s.mark_revoked("ab" * 32, "seeded", "device-a"),
    "revoked_since": lambda s: s.revoked_since(""),
}
WRITES = (
    "put_blob",
    "put_blob_new",
    "put_user",
    "update_user",
    "put_pointer",
    "mark_revoked",
)


@implementer(IReactorTime)
class ShiftedClock:
    """The reactor's clock, ``shift`` seconds ahead (a store that lives two days later)."""

    def __init__(self, shift: float) -> None:
        self.shift = shift

    def seconds(self) -> float:
        return float(reactor.seconds()) + self.shift

    def callLater(
        self, delay: float, callable: Callable[..., Any], *args: object, **kwargs: object
    ) -> IDelayedCall:
        return reactor.callLater(delay, callable, *args, **kwargs)

    def getDelayedCalls(self) -> Any:
        return reactor.getDelayedCalls()


def digest(n: int) -> str:
    return f"{n:064x}"


class Conformance(_Mixin):
    """The tests. A subclass provides the hooks and mixes in ``unittest.TestCase``."""

    backend: ClassVar[str]
    bad_version_is_conflict: ClassVar[bool]
    failure_budget: ClassVar[float] = 30.0  # seconds for a failed store to say so, not hang
    timeout = 120

    store: VaultStore

    # -- hooks -----------------------------------------------------------------------------------

    async def make_store(self) -> VaultStore:
        """A store over fresh, empty storage."""
        raise NotImplementedError

    async def remove_user(self, uid: str) -> None:
        """Delete ``uid``'s blob (every version) and document from the backend itself, as an
        operator would; pointers stay."""
        raise NotImplementedError

    async def on_clock(self, clock: IReactorTime) -> VaultStore:
        """Another store over the same storage as ``self.store``, on ``clock``."""
        raise NotImplementedError

    async def failure_scenarios(
        self,
    ) -> AsyncIterator[tuple[str, VaultStore, tuple[str, ...]]]:
        """Stores whose backend fails: (what failed, the store, the operations that must raise
        StoreError). The store was seeded (user ``seeded``) while it still worked."""
        raise NotImplementedError
        yield  # an async generator

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

    @contextlib.asynccontextmanager
    async def raises(self, kind: type[Exception]) -> AsyncIterator[list[Exception]]:
        caught: list[Exception] = []
        try:
            yield caught
        except kind as e:
            caught.append(e)
            return
        raise AssertionError(f"{kind.__name__} not raised")

    async def conflict(self, work: Coroutine[Any, Any, object]) -> str:
        """Run ``work``, which must raise Conflict; return the current version it reports."""
        try:
            await work
        except Conflict as e:
            return e.current_version
        raise AssertionError("no Conflict")

    async def foreign_version_rejected(self, work: Coroutine[Any, Any, object]) -> None:
        """``work`` writes with a version this store never issued: BadVersion (SQLite) or
        Conflict (S3), whichever the backend promises."""
        expected: type[Exception] = Conflict if self.bad_version_is_conflict else BadVersion
        try:
            await work
        except (Conflict, BadVersion) as e:
            assert type(e) is expected, (self.backend, repr(e))
            return
        raise AssertionError("a write with a foreign version succeeded")

    @staticmethod
    async def seed(store: VaultStore) -> None:
        await store.put_blob("seeded", b"blob", NO_VERSION)
        await store.put_user("seeded", {"n": 1}, NO_VERSION)
        await store.put_pointer("creds", "seeded-cred", "seeded")

    # -- the vault blob --------------------------------------------------------------------------

    async def test_create_only_then_read(self) -> None:
        uid = new_uid()
        assert await self.store.get_blob(uid) is None
        assert await self.store.list_blob_versions(uid) == []
        v1 = await self.store.put_blob(uid, b"one", NO_VERSION)
        assert isinstance(v1, str) and v1 not in ("", NO_VERSION), v1
        got = await self.store.get_blob(uid)
        assert got == Blob(b"one", v1), got
        data, version = got  # unpacks as (bytes, version)
        assert (data, version) == (b"one", v1)
        # "0" creates only: the blob exists, so it is a conflict naming the current version.
        assert await self.conflict(self.store.put_blob(uid, b"two", NO_VERSION)) == v1
        assert await self.store.get_blob(uid) == Blob(b"one", v1)

    async def test_replace_only_the_expected_version(self) -> None:
        uid = new_uid()
        v1 = await self.store.put_blob(uid, b"one", NO_VERSION)
        v2 = await self.store.put_blob(uid, b"two", v1)
        assert v2 not in (v1, NO_VERSION)
        assert await self.conflict(self.store.put_blob(uid, b"stale", v1)) == v2
        v3 = await self.store.put_blob(uid, b"", v2)  # an empty blob is a blob
        assert await self.store.get_blob(uid) == Blob(b"", v3)
        # A conditional write to a user with no blob: the current version is "0".
        other = new_uid()
        await self.foreign_version_rejected(self.store.put_blob(other, b"x", v1 + "0"))
        assert await self.store.get_blob(other) is None

    async def test_racing_writers_one_wins_per_version(self) -> None:
        """N writers from one version: exactly one wins, and every loser is told the winner's
        version. Three rounds: from "0" (create) and from two real versions (replace)."""
        uid = new_uid()
        expected = NO_VERSION
        writers = 8
        for round_ in range(3):

            async def attempt(i: int, base: str, round_: int = round_) -> tuple[str, str]:
                try:
                    return ("won", await self.store.put_blob(uid, b"r%d-w%d" % (round_, i), base))
                except Conflict as e:
                    return ("lost", e.current_version)

            results = await gatherResults(
                [Deferred.fromCoroutine(attempt(i, expected)) for i in range(writers)],
                consumeErrors=True,
            )
            won = [(i, v) for i, (outcome, v) in enumerate(results) if outcome == "won"]
            assert len(won) == 1, (round_, results)
            winner, version = won[0]
            assert all(v == version for outcome, v in results if outcome == "lost"), results
            assert await self.store.get_blob(uid) == Blob(b"r%d-w%d" % (round_, winner), version)
            expected = version

    async def test_foreign_versions(self) -> None:
        """A version this store never issued: BadVersion on SQLite (400), Conflict on S3 (409);
        nothing is written either way."""
        uid = new_uid()
        v1 = await self.store.put_blob(uid, b"one", NO_VERSION)
        await self.store.put_user(uid, {"a": 1}, NO_VERSION)
        user = await self.store.get_user(uid)
        assert user is not None
        for foreign in FOREIGN_VERSIONS:
            await self.foreign_version_rejected(self.store.put_blob(uid, b"bad", foreign))
            await self.foreign_version_rejected(self.store.put_user(uid, {"a": 2}, foreign))
        if self.bad_version_is_conflict:
            assert await self.conflict(self.store.put_blob(uid, b"bad", "nope")) == v1
        assert await self.store.get_blob(uid) == Blob(b"one", v1)
        assert await self.store.get_user(uid) == user

    async def test_keeps_the_last_five_versions(self) -> None:
        uid = new_uid()
        before = datetime.datetime.now(UTC) - datetime.timedelta(seconds=5)
        versions = []
        current = NO_VERSION
        for i in range(KEEP_VERSIONS + 3):
            current = await self.store.put_blob(uid, b"v%d" % i + b"." * i, current)
            versions.append(current)
        after = datetime.datetime.now(UTC) + datetime.timedelta(seconds=5)
        listed = await self.store.list_blob_versions(uid)
        assert [v.version for v in listed] == versions[::-1][:KEEP_VERSIONS], (listed, versions)
        assert [v.size for v in listed] == [2 + i for i in range(len(versions))][::-1][:5]
        for newer, older in itertools.pairwise(listed):
            assert newer.modified >= older.modified, listed
        for entry in listed:
            assert entry.modified.utcoffset() == datetime.timedelta(0)
            assert before <= entry.modified <= after, entry
        for i, version in enumerate(versions):
            data = await self.store.get_blob_version(uid, version)
            if i >= len(versions) - KEEP_VERSIONS:
                assert data == b"v%d" % i + b"." * i, (i, data)
            else:
                assert data is None, (i, "an old version is still readable")
        for foreign in ("0", "", "abc", "999999"):
            assert await self.store.get_blob_version(uid, foreign) is None
        assert await self.store.get_blob_version(new_uid(), versions[-1]) is None

    async def test_sibling_uids(self) -> None:
        """uids that extend one another (``u``, ``u-a``, ``u_b``, ``ux``) keep separate
        histories, however many versions each has."""
        base = new_uid()
        uids = [base + "-a", base + "_b", base + "x", base]
        expected: dict[str, list[str]] = {}
        for uid in uids:
            current = NO_VERSION
            expected[uid] = []
            for i in range(KEEP_VERSIONS + 4):
                current = await self.store.put_blob(uid, f"{uid} {i}".encode(), current)
                expected[uid].append(current)
        for uid in uids:
            listed = [v.version for v in await self.store.list_blob_versions(uid)]
            assert listed == expected[uid][::-1][:KEEP_VERSIONS], (uid, listed)
            blob = await self.store.get_blob(uid)
            assert blob == Blob(f"{uid} {KEEP_VERSIONS + 3}".encode(), expected[uid][-1])
            oldest_kept = len(expected[uid]) - KEEP_VERSIONS
            data = await self.store.get_blob_version(uid, expected[uid][oldest_kept])
            assert data == f"{uid} {oldest_kept}".encode(), (uid, data)

    # -- the user document -----------------------------------------------------------------------

    async def test_user_document_cas(self) -> None:
        uid = new_uid()
        assert await self.store.get_user(uid) is None
        v1 = await self.store.put_user(uid, {"creds": {"c1": {"alg": -7}}, "devices": []}, "0")
        got = await self.store.get_user(uid)
        assert got == UserDoc({"creds": {"c1": {"alg": -7}}, "devices": []}, v1), got
        got.doc["creds"].clear()  # the caller's copy
        assert (await self.store.get_user(uid)) == UserDoc(
            {"creds": {"c1": {"alg": -7}}, "devices": []}, v1
        )
        assert await self.conflict(self.store.put_user(uid, {}, NO_VERSION)) == v1
        v2 = await self.store.put_user(uid, {"creds": {}, "devices": ["d1"]}, v1)
        assert await self.conflict(self.store.put_user(uid, {"stale": True}, v1)) == v2
        assert await self.store.get_user(uid) == UserDoc({"creds": {}, "devices": ["d1"]}, v2)
        # The blob and the document are separate objects with separate versions.
        assert await self.store.get_blob(uid) is None
        with self.assertRaises(ValueError):
            await self.store.put_user(uid, ["not", "an", "object"], v2)  # type: ignore[arg-type]
        with self.assertRaises(ValueError):
            await self.store.put_user(uid, {"not json": {1, 2}}, v2)

    async def test_update_user_creates_skips_and_aborts(self) -> None:
        uid = new_uid()
        seen: list[dict[str, Any] | None] = []

        def nothing(doc: dict[str, Any] | None) -> None:
            seen.append(doc)

        assert await self.store.update_user(uid, nothing) is None
        assert seen == [None]
        assert await self.store.get_user(uid) is None

        created = await self.store.update_user(uid, lambda doc: {"last_seen": "2026-01-01"})
        assert created is not None and created.doc == {"last_seen": "2026-01-01"}
        assert await self.store.get_user(uid) == created

        # A daily last_seen already set today: fn says "no write", the version does not move.
        def touch(doc: dict[str, Any] | None) -> dict[str, Any] | None:
            assert doc is not None
            return None if doc["last_seen"] == "2026-01-01" else {**doc, "last_seen": "2026-01-01"}

        assert await self.store.update_user(uid, touch) == created

        def broken(doc: dict[str, Any] | None) -> dict[str, Any]:
            assert doc is not None
            doc["half"] = "done"  # a fresh copy: this mutation must not leak into the store
            raise RuntimeError("fn failed")

        with self.assertRaises(RuntimeError):
            await self.store.update_user(uid, broken)
        assert await self.store.get_user(uid) == created

    async def test_update_user_loses_no_update(self) -> None:
        """N concurrent read-modify-writes of one document: all N land (each CAS loop retried
        past the others), whether the document existed first or not."""
        uid = new_uid()
        writers = 10
        calls = 0

        def add(i: int) -> Callable[[dict[str, Any] | None], dict[str, Any]]:
            def update(doc: dict[str, Any] | None) -> dict[str, Any]:
                nonlocal calls
                calls += 1
                doc = doc if doc is not None else {"count": 0, "devices": []}
                doc["count"] += 1
                doc["devices"].append(f"d{i}")
                return doc

            return update

        conflicts = metric(
            "lchat_home_cas_conflicts_total", backend=self.store_backend, kind="user"
        )
        results = await gatherResults(
            [Deferred.fromCoroutine(self.store.update_user(uid, add(i))) for i in range(writers)],
            consumeErrors=True,
        )
        final = await self.store.get_user(uid)
        assert final is not None
        assert final.doc["count"] == writers, final
        assert sorted(final.doc["devices"]) == sorted(f"d{i}" for i in range(writers)), final
        assert final in results, "the last writer's answer is what is stored"
        # They really raced: every loser re-ran its update after a conflict.
        assert calls > writers, calls
        after = metric("lchat_home_cas_conflicts_total", backend=self.store_backend, kind="user")
        assert after - conflicts >= calls - writers, (conflicts, after, calls)

    @property
    def store_backend(self) -> str:
        return "sqlite" if self.backend == "sqlite" else "s3"

    # -- pointers --------------------------------------------------------------------------------

    async def test_pointers_are_write_once(self) -> None:
        alice, bob = new_uid(), new_uid()
        assert await self.store.resolve_pointer("creds", "cred-1") is None
        await self.store.put_pointer("creds", "cred-1", alice)
        assert await self.store.resolve_pointer("creds", "cred-1") == alice
        await self.store.put_pointer("creds", "cred-1", alice)  # a retried registration
        async with self.raises(PointerTaken):
            await self.store.put_pointer("creds", "cred-1", bob)
        assert await self.store.resolve_pointer("creds", "cred-1") == alice
        # Kinds are separate namespaces.
        assert await self.store.resolve_pointer("tokens", "cred-1") is None
        token = "ab" * 32  # a SHA-256, hex
        await self.store.put_pointer("tokens", token, bob)
        assert await self.store.resolve_pointer("tokens", token) == bob
        for kind, name in (("devices", "x"), ("creds", "a/b"), ("creds", ""), ("tokens", "a b")):
            with self.assertRaises(ValueError):
                await self.store.put_pointer(kind, name, alice)  # type: ignore[arg-type]
            with self.assertRaises(ValueError):
                await self.store.resolve_pointer(kind, name)  # type: ignore[arg-type]

    async def test_racing_pointers_one_wins(self) -> None:
        uids = [new_uid() for _ in range(6)]

        async def claim(uid: str) -> str:
            try:
                await self.store.put_pointer("creds", "contested", uid)
            except PointerTaken:
                return "taken"
            return uid

        results = await gatherResults(
            [Deferred.fromCoroutine(claim(uid)) for uid in uids], consumeErrors=True
        )
        winners = [r for r in results if r != "taken"]
        assert len(winners) == 1, results
        assert await self.store.resolve_pointer("creds", "contested") == winners[0]

    async def test_revoked_pointer_denies(self) -> None:
        """Pointers outlive revocation and deletion; resolving one the safe way still denies."""
        uid = new_uid()
        token = "cd" * 32
        await self.store.put_user(
            uid, {"creds": {"c1": {}, "c2": {}}, "tokens": {token: {"device": "d1"}}}, "0"
        )
        for name in ("c1", "c2"):
            await self.store.put_pointer("creds", name, uid)
        await self.store.put_pointer("tokens", token, uid)

        def cred_listed(name: str) -> Callable[[Any], bool]:
            return lambda doc: name in doc.get("creds", {})

        def token_listed(doc: Any) -> bool:
            return token in doc.get("tokens", {})

        found = await resolve_checked(self.store, "creds", "c1", cred_listed("c1"))
        assert found is not None and found[0] == uid and "c1" in found[1].doc["creds"], found

        def revoke(doc: dict[str, Any] | None) -> dict[str, Any]:
            assert doc is not None
            del doc["creds"]["c1"]
            doc["tokens"] = {}
            return doc

        await self.store.update_user(uid, revoke)
        assert await self.store.resolve_pointer("creds", "c1") == uid  # left behind...
        assert await resolve_checked(self.store, "creds", "c1", cred_listed("c1")) is None
        assert await resolve_checked(self.store, "tokens", token, token_listed) is None
        assert await resolve_checked(self.store, "creds", "c2", cred_listed("c2")) is not None
        assert await resolve_checked(self.store, "creds", "nope", cred_listed("nope")) is None
        await self.remove_user(uid)
        assert await self.store.resolve_pointer("creds", "c2") == uid  # ...and after deletion
        assert await resolve_checked(self.store, "creds", "c2", cred_listed("c2")) is None

    # -- arguments, metrics, failures -------------------------------------------------------------

    # -- the revocation feed ---------------------------------------------------------------------

    async def test_revocation_feed_lists_new_markers(self) -> None:
        """mark_revoked publishes; revoked_since("") lists every live marker, and from the
        cursor it returned, at least every marker written since (S3 lists them all again)."""
        first = await self.store.revoked_since("")
        assert first.markers == [], first
        a, b, c = digest(1), digest(2), digest(3)
        await self.store.mark_revoked(a, "user-1", "device-1")
        await self.store.mark_revoked(b, "user-2", "device-2")
        listed = await self.store.revoked_since(first.cursor)
        assert {m.digest for m in listed.markers} == {a, b}, listed
        for marker in listed.markers:
            assert marker.marked.tzinfo is not None
            assert abs(marker.marked.timestamp() - reactor.seconds()) < 120, marker
        await self.store.mark_revoked(c, "user-1", "device-3")
        await self.store.mark_revoked(c, "user-1", "device-3")  # idempotent
        since = await self.store.revoked_since(listed.cursor)
        assert c in {m.digest for m in since.markers}, since
        assert {m.digest for m in since.markers} <= {a, b, c}, since
        assert len([m for m in since.markers if m.digest == c]) == 1, since
        everything = await self.store.revoked_since("")
        assert {m.digest for m in everything.markers} == {a, b, c}, everything
        with self.assertRaises(ValueError):
            await self.store.mark_revoked("not-a-digest", "user-1", "device-1")
        with self.assertRaises(ValueError):
            await self.store.mark_revoked(digest(0xABC).upper(), "user-1", "device-1")
        with self.assertRaises(ValueError):
            await self.store.mark_revoked(digest(4), "no/uid", "device-1")

    async def test_revocation_markers_expire_after_two_days(self) -> None:
        """A marker older than MARKER_LIFETIME is listed no more, and whoever lists it deletes
        it (S3: a conditional DELETE; SQLite: a DELETE of the expired rows)."""
        await self.store.mark_revoked(digest(10), "user-1", "device-1")
        await self.store.mark_revoked(digest(11), "user-1", "device-2")
        almost = await self.on_clock(ShiftedClock(MARKER_LIFETIME - 3600))
        listed = await almost.revoked_since("")
        assert {m.digest for m in listed.markers} == {digest(10), digest(11)}, listed
        later = await self.on_clock(ShiftedClock(MARKER_LIFETIME + 3600))
        assert (await later.revoked_since("")).markers == []
        assert await self.revocation_rows() == []  # gone from storage, not only hidden
        assert (await self.store.revoked_since("")).markers == []

    async def test_revocation_markers_live_a_cache_day_and_an_hour(self) -> None:
        """The feed is compacted to what a cache can still hold (issue 29): a cache entry lives
        at most to the end of its UTC day, so a marker 26 hours old is gone."""
        await self.store.mark_revoked(digest(12), "user-1", "device-1")
        day = await self.on_clock(ShiftedClock(24.5 * 3600))
        assert [m.digest for m in (await day.revoked_since("")).markers] == [digest(12)]
        later = await self.on_clock(ShiftedClock(26 * 3600))
        assert (await later.revoked_since("")).markers == []

    async def revocation_rows(self) -> list[str]:
        """The digests the backend holds markers for, expired or not."""
        raise NotImplementedError

    async def test_use_once_is_single_use_among_racers(self) -> None:
        """A challenge or proof is used once, whoever races for it (issue 29: replays)."""
        name = secrets.token_hex(32)
        won = await gatherResults(
            [Deferred.fromCoroutine(self.store.use_once(name, time.time() + 300)) for _ in range(5)]
        )
        assert sorted(won) == [False] * 4 + [True], won
        assert await self.store.use_once(name, time.time() + 300) is False
        assert await self.store.use_once(secrets.token_hex(32), time.time() + 300) is True
        with self.assertRaises(ValueError):
            await self.store.use_once("not-a-digest", time.time())

    async def test_user_documents_are_capped(self) -> None:
        """One account cannot make every call decode a huge document (issue 29)."""
        uid = new_uid()
        with self.assertRaises(DocumentTooLarge):
            await self.store.put_user(uid, {"pad": "x" * MAX_USER_DOC}, NO_VERSION)
        assert await self.store.get_user(uid) is None
        await self.store.put_user(uid, {"pad": "x" * (MAX_USER_DOC - 100)}, NO_VERSION)

    async def test_bad_arguments(self) -> None:
        for uid in ("", "a/b", "x" * 129, "../x", "dot.", "ü"):
            with self.assertRaises(ValueError):
                await self.store.get_blob(uid)
            with self.assertRaises(ValueError):
                await self.store.put_user(uid, {}, NO_VERSION)
            with self.assertRaises(ValueError):
                await self.store.put_pointer("creds", "c", uid)
        with self.assertRaises(ValueError):
            await self.store.put_blob(new_uid(), "text", NO_VERSION)  # type: ignore[arg-type]

    async def test_metrics(self) -> None:
        uid = new_uid()
        labels = {"backend": self.store_backend}
        before = {
            "ok": metric(
                "lchat_home_store_operations_total", operation="put_blob", outcome="ok", **labels
            ),
            "conflict": metric(
                "lchat_home_store_operations_total",
                operation="put_blob",
                outcome="conflict",
                **labels,
            ),
            "cas": metric("lchat_home_cas_conflicts_total", kind="blob", **labels),
            "latency": metric("lchat_home_store_seconds_count", operation="put_blob", **labels),
        }
        version = await self.store.put_blob(uid, b"1", NO_VERSION)
        await self.conflict(self.store.put_blob(uid, b"2", NO_VERSION))
        await self.store.put_blob(uid, b"3", version)
        after = {
            "ok": metric(
                "lchat_home_store_operations_total", operation="put_blob", outcome="ok", **labels
            ),
            "conflict": metric(
                "lchat_home_store_operations_total",
                operation="put_blob",
                outcome="conflict",
                **labels,
            ),
            "cas": metric("lchat_home_cas_conflicts_total", kind="blob", **labels),
            "latency": metric("lchat_home_store_seconds_count", operation="put_blob", **labels),
        }
        assert {k: after[k] - before[k] for k in before} == {
            "ok": 2,
            "conflict": 1,
            "cas": 1,
            "latency": 3,
        }, (before, after)

    async def test_check(self) -> None:
        await self.store.check()

    async def test_failing_backend_is_store_error(self) -> None:
        """The backend fails (S3: a bucket answering 500, refusing our key, hung, gone; SQLite:
        a file locked by another writer, a closed store): every operation that touches the
        failure raises StoreError within a bounded time, never a hang or another error."""
        scenarios = 0
        async for what, store, operations in self.failure_scenarios():
            scenarios += 1

            async def outcome(name: str, store: VaultStore = store, what: str = what) -> str:
                started = time.monotonic()
                try:
                    await self.within(self.failure_budget, OPERATIONS[name](store))
                except StoreError:
                    return "store_error"
                except Exception as e:
                    return f"{type(e).__name__}: {e}"
                finally:
                    elapsed = time.monotonic() - started
                    assert elapsed < self.failure_budget, (what, name, elapsed)
                return "succeeded"

            results = await gatherResults(
                [Deferred.fromCoroutine(outcome(name)) for name in operations],
                consumeErrors=True,
            )
            wrong = {n: r for n, r in zip(operations, results, strict=True) if r != "store_error"}
            assert not wrong, (what, wrong)
        assert scenarios > 0


# --- SQLite ---------------------------------------------------------------------------------------


class SQLiteTest(Conformance, unittest.TestCase):
    backend = "sqlite"
    bad_version_is_conflict = False

    def db_path(self) -> str:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        return os.path.join(directory, "home.db")

    async def open(self, path: str, **options: Any) -> SQLiteVaultStore:
        return await SQLiteVaultStore.open(path, thread_runner(reactor), reactor, **options)

    async def make_store(self) -> VaultStore:
        self.path = self.db_path()
        return await self.open(self.path)

    async def on_clock(self, clock: IReactorTime) -> VaultStore:
        store = await SQLiteVaultStore.open(self.path, thread_runner(reactor), clock)
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        return store

    async def revocation_rows(self) -> list[str]:
        def rows() -> list[str]:
            with contextlib.closing(sqlite3.connect(self.path)) as conn:
                return [d for (d,) in conn.execute("SELECT digest FROM revocations ORDER BY seq")]

        return await in_thread(rows)

    async def leftovers(self, uid: str) -> list[str]:
        def rows() -> list[str]:
            with contextlib.closing(sqlite3.connect(self.path)) as conn:
                blobs = conn.execute("SELECT version FROM blobs WHERE uid = ?", (uid,)).fetchall()
                users = conn.execute("SELECT version FROM users WHERE uid = ?", (uid,)).fetchall()
            return [f"blob {v}" for (v,) in blobs] + [f"user {v}" for (v,) in users]

        return await in_thread(rows)

    async def remove_user(self, uid: str) -> None:
        def delete() -> None:
            with contextlib.closing(sqlite3.connect(self.path, isolation_level=None)) as conn:
                conn.execute("DELETE FROM blobs WHERE uid = ?", (uid,))
                conn.execute("DELETE FROM users WHERE uid = ?", (uid,))

        await in_thread(delete)

    async def failure_scenarios(
        self,
    ) -> AsyncIterator[tuple[str, VaultStore, tuple[str, ...]]]:
        # Another process holds the write lock (a stuck CLI, a long backup): writes wait out the
        # busy timeout, then fail. Readers are not blocked under WAL: that is the point of it.
        path = self.db_path()
        store = await self.open(path, busy_timeout_ms=300)
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        await self.seed(store)
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            yield "the database is locked by another writer", store, WRITES
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert await store.get_blob("seeded") is not None  # it recovers once the lock goes
        await store.close()
        yield "the store is closed", store, tuple(OPERATIONS)

    # -- SQLite only -------------------------------------------------------------------------------

    async def test_versions_are_never_reissued(self) -> None:
        """One store-wide counter, floored by the clock: versions only grow, across users and
        kinds and past a deletion; "never issued" is BadVersion, "issued, not current" Conflict."""
        uid, other = new_uid(), new_uid()
        issued = [await self.store.put_blob(uid, b"a", NO_VERSION)]
        issued.append(await self.store.put_blob(uid, b"b", issued[-1]))
        issued.append(await self.store.put_user(uid, {}, NO_VERSION))
        issued.append(await self.store.put_blob(other, b"c", NO_VERSION))
        numbers = [int(v) for v in issued]
        assert numbers == sorted(set(numbers)), issued
        assert numbers[0] >= int((time.time() - 60) * 1_000_000), "no clock floor"
        async with self.raises(BadVersion):
            await self.store.put_blob(uid, b"c", str(numbers[-1] + 1))  # not issued yet
        assert await self.conflict(self.store.put_blob(uid, b"c", issued[0])) == issued[1]
        # Issued to someone else: a conflict for this user, not a bad version.
        assert await self.conflict(self.store.put_blob(uid, b"c", issued[3])) == issued[1]
        await self.remove_user(uid)
        # A client still holding the deleted blob's version: a conflict with "nothing yet".
        assert await self.conflict(self.store.put_blob(uid, b"d", issued[1])) == NO_VERSION
        again = await self.store.put_blob(uid, b"d", NO_VERSION)
        assert int(again) > numbers[-1]

    async def test_restored_database_never_reissues_a_version(self) -> None:
        """The file is restored from a replica that lost the last write (Litestream lags): a
        client holding the lost write's version must not have its CAS succeed against a new
        write that got the same number (a lost update); it is told the version is unknown."""
        uid = new_uid()
        first = await self.store.put_blob(uid, b"kept", NO_VERSION)
        await self.store.close()
        backup = self.path + ".replica"
        await in_thread(_sqlite_backup, self.path, backup)
        store = await self.open(self.path)
        lost = await store.put_blob(uid, b"lost in the crash", first)  # a client now holds it
        await store.close()
        await in_thread(os.replace, backup, self.path)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + suffix)
        restored = await self.open(self.path)
        self.addCleanup(lambda: Deferred.fromCoroutine(restored.close()))
        assert await restored.get_blob(uid) == Blob(b"kept", first)
        async with self.raises(BadVersion):  # a version this file never issued
            await restored.put_blob(uid, b"the stale client", lost)
        newer = await restored.put_blob(uid, b"written after the restore", first)
        assert newer != lost and int(newer) > int(lost), (newer, lost)
        assert await self.conflict(restored.put_blob(uid, b"the stale client", lost)) == newer
        assert await restored.get_blob(uid) == Blob(b"written after the restore", newer)

    async def test_schema_1_database_migrates(self) -> None:
        """A file from schema 1 (per-user counters from 1) keeps its data and versions; the new
        store-wide counter starts above every version it issued."""
        path = self.db_path()

        def make_schema_1() -> None:
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
                for statement in sqlite_store.MIGRATIONS[0]:
                    conn.execute(statement)
                conn.execute("PRAGMA user_version = 1")
                for version in (1, 2, 3):
                    conn.execute(
                        "INSERT INTO blobs VALUES ('old', ?, ?, 0)", (version, b"v%d" % version)
                    )
                conn.execute("INSERT INTO users VALUES ('old', 2, '{\"a\":1}')")

        await in_thread(make_schema_1)
        store = await self.open(path)
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        assert await store.get_blob("old") == Blob(b"v3", "3")
        assert await store.get_user("old") == UserDoc({"a": 1}, "2")
        assert await self.conflict(store.put_blob("old", b"x", "1")) == "3"
        async with self.raises(BadVersion):
            await store.put_blob("old", b"x", "4")
        newer = await store.put_blob("old", b"v4", "3")
        assert int(newer) > 3
        assert [v.version for v in await store.list_blob_versions("old")] == [newer, "3", "2", "1"]
        assert await store.put_user("old", {"a": 2}, "2") not in ("1", "2", "3", newer)

    async def test_file_keeps_at_most_five_rows_per_user(self) -> None:
        uid = new_uid()
        version = NO_VERSION
        for i in range(KEEP_VERSIONS * 2 + 1):
            version = await self.store.put_blob(uid, b"%d" % i, version)
        assert len(await self.leftovers(uid)) == KEEP_VERSIONS

    async def test_open_refuses_what_it_cannot_use(self) -> None:
        garbage = self.db_path()
        await in_thread(write_file, garbage, b"this is not a database, it is a text file" * 100)
        async with self.raises(StoreError):
            await self.open(garbage)
        async with self.raises(StoreError):
            await self.open(os.path.join(self.mktemp(), "missing-dir", "home.db"))
        newer = self.db_path()
        await (await self.open(newer)).close()  # created and migrated
        with contextlib.closing(sqlite3.connect(newer)) as conn:
            conn.execute("PRAGMA user_version = 99")
        async with self.raises(StoreError) as caught:
            await self.open(newer)
        assert "newer" in str(caught[0]), caught

    async def test_survives_reopen(self) -> None:
        uid = new_uid()
        version = await self.store.put_blob(uid, b"kept", NO_VERSION)
        await self.store.put_user(uid, {"k": 1}, NO_VERSION)
        await self.store.close()
        again = await self.open(self.path)
        self.addCleanup(lambda: Deferred.fromCoroutine(again.close()))
        assert await again.get_blob(uid) == Blob(b"kept", version)
        user = await again.get_user(uid)
        assert user is not None and user.doc == {"k": 1}, user
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


# --- S3 -------------------------------------------------------------------------------------------


class _Answers500(Resource):
    """A "bucket" whose every answer is 500 InternalError."""

    isLeaf = True

    def render(self, request: Request) -> bytes:
        request.setResponseCode(500)
        request.setHeader(b"content-type", b"application/xml")
        return (
            b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
            b"<Message>We encountered an internal error.</Message></Error>"
        )


async def versioned_bucket(server: s3servers.S3Server) -> str:
    bucket = await server.new_bucket()

    def enable() -> None:
        server.client().put_bucket_versioning(
            Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
        )

    await in_thread(enable)
    return bucket


class _S3Conformance(Conformance):
    kind: ClassVar[s3servers.Kind]
    bad_version_is_conflict = True
    prefix: ClassVar[str] = "/home-tests//"  # normalised to "home-tests/"
    server: s3servers.S3Server
    bucket: str
    objects: S3Store

    def s3_objects(self, server: s3servers.S3Server, bucket: str, **options: Any) -> S3Store:
        objects = s3servers.store_for(server, bucket, **options)
        return objects

    async def make_store(self) -> VaultStore:
        self.server = await s3servers.shared_server(self.kind)
        self.bucket = await versioned_bucket(self.server)
        self.objects = self.s3_objects(self.server, self.bucket)
        return S3VaultStore(self.objects, reactor, prefix=self.prefix)

    async def on_clock(self, clock: IReactorTime) -> VaultStore:
        return S3VaultStore(self.objects, clock, prefix=self.prefix)

    async def revocation_rows(self) -> list[str]:
        prefix = "home-tests/revoked/"
        return [i.key[len(prefix) :] for i in await self.objects.list(prefix)]

    async def test_revocation_feed_requests_and_layout(self) -> None:
        """A marker is one PUT of ``revoked/<sha256>`` (body uid, device, time); a poll is one
        LIST; a marker past its lifetime costs its lister one conditional DELETE."""
        token = digest(20)
        assert await self.counted(self.store.mark_revoked(token, "user-1", "device-1")) == {
            ("PutObject", "ok"): 1
        }
        stored = await self.objects.get(f"home-tests/revoked/{token}")
        body = json.loads(stored.body)
        assert set(body) == {"uid", "device", "time"}, body
        assert (body["uid"], body["device"]) == ("user-1", "device-1")
        assert await self.counted(self.store.revoked_since("")) == {("ListObjectsV2", "ok"): 1}
        # Not a digest under revoked/ (someone else's object): never taken for a revocation.
        await self.objects.put("home-tests/revoked/README", b"x")
        assert [m.digest for m in (await self.store.revoked_since("")).markers] == [token]
        later = await self.on_clock(ShiftedClock(MARKER_LIFETIME + 60))
        assert await self.counted(later.revoked_since("")) == {
            ("ListObjectsV2", "ok"): 1,
            ("DeleteObject", "ok"): 1,
        }
        assert await self.revocation_rows() == ["README"]

    async def remove_user(self, uid: str) -> None:
        for key in (f"home-tests/blobs/{uid}", f"home-tests/users/{uid}"):
            for version in await self.objects.list_versions(key):
                if version.key == key:
                    await self.objects.delete_version(key, version.version_id)

    async def failure_scenarios(
        self,
    ) -> AsyncIterator[tuple[str, VaultStore, tuple[str, ...]]]:
        fast: dict[str, Any] = {"timeout": 2.0, "retries": 1}
        # A bucket that answers 500 to everything.
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            Site(_Answers500())
        )
        self.addCleanup(port.stopListening)
        address = port.getHost()
        assert isinstance(address, IPv4Address)
        failing = S3Store(
            reactor,
            "home",
            run_in_thread=thread_runner(reactor),
            monotonic=time.monotonic,
            credentials=self.server.credentials,
            endpoint=f"http://127.0.0.1:{address.port}",
            region=s3servers.REGION,
            **fast,
        )
        store: VaultStore = S3VaultStore(failing, reactor)
        self.addCleanup(lambda: Deferred.fromCoroutine(failing.close()))
        yield "the bucket answers 500", store, tuple(OPERATIONS)

        # The right bucket, a wrong secret.
        wrong = copy.copy(self.server.credentials)
        wrong.secret_key = "not-the-secret-" + "x" * 25
        denied = s3servers.store_for(self.server, self.bucket, credentials=wrong, **fast)
        self.addCleanup(lambda: Deferred.fromCoroutine(denied.close()))
        yield "the bucket refuses our key", S3VaultStore(denied, reactor), tuple(OPERATIONS)

        # A private server, seeded, then hung (SIGSTOP), then gone (SIGKILL).
        server = await s3servers.start_server(self.kind)
        self.addCleanup(lambda: Deferred.fromCoroutine(server.destroy()))
        bucket = await versioned_bucket(server)
        doomed = s3servers.store_for(server, bucket, **fast)
        self.addCleanup(lambda: Deferred.fromCoroutine(doomed.close()))
        store = S3VaultStore(doomed, reactor)
        await self.seed(store)
        await store.check()
        server.pause()
        try:
            yield "the bucket hangs", store, tuple(OPERATIONS)
        finally:
            server.resume()
        await server.stop()
        yield "the bucket is gone", store, tuple(OPERATIONS)

    # -- S3 only ---------------------------------------------------------------------------------

    def s3_requests(self) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for family in REGISTRY.collect():
            if family.name != "lchat_s3_requests":
                continue
            for sample in family.samples:
                if sample.name == "lchat_s3_requests_total":
                    key = (sample.labels["operation"], sample.labels["outcome"])
                    out[key] = sample.value
        return out

    async def counted(self, work: Coroutine[Any, Any, object]) -> dict[tuple[str, str], int]:
        before = self.s3_requests()
        with contextlib.suppress(Conflict):
            await work
        after = self.s3_requests()
        return {k: int(v - before.get(k, 0)) for k, v in after.items() if v != before.get(k, 0)}

    async def test_requests_per_operation(self) -> None:
        """The benchmark's goal, counted: a read is one GET, a write one conditional PUT, a lost
        write one more request (a HEAD for the current version)."""
        uid = new_uid()
        assert await self.counted(self.store.put_blob(uid, b"1", NO_VERSION)) == {
            ("PutObject", "ok"): 1
        }
        assert await self.counted(self.store.get_blob(uid)) == {("GetObject", "ok"): 1}
        blob = await self.store.get_blob(uid)
        assert blob is not None
        assert await self.counted(self.store.put_blob(uid, b"2", blob.version)) == {
            ("PutObject", "ok"): 1
        }
        assert await self.counted(self.store.put_blob(uid, b"3", blob.version)) == {
            ("PutObject", "precondition"): 1,
            ("HeadObject", "ok"): 1,
        }
        assert await self.counted(self.store.list_blob_versions(uid)) == {
            ("ListObjectVersions", "ok"): 1
        }

    async def test_bucket_layout(self) -> None:
        uid = new_uid()
        token = "ef" * 32
        await self.store.put_blob(uid, b"ciphertext", NO_VERSION)
        await self.store.put_user(uid, {"creds": {"cred-a": {}}}, NO_VERSION)
        await self.store.put_pointer("creds", "cred-a", uid)
        await self.store.put_pointer("tokens", token, uid)
        keys = {info.key for info in await self.objects.list("")}
        assert keys == {
            f"home-tests/blobs/{uid}",
            f"home-tests/users/{uid}",
            "home-tests/creds/cred-a",
            f"home-tests/tokens/{token}",
        }, keys
        assert (await self.objects.get("home-tests/creds/cred-a")).body == uid.encode()
        assert (await self.objects.get(f"home-tests/tokens/{token}")).body == uid.encode()
        user = await self.objects.get(f"home-tests/users/{uid}")
        assert user.body == b'{"creds":{"cred-a":{}}}'
        assert (await self.objects.get(f"home-tests/blobs/{uid}")).body == b"ciphertext"
        # Another prefix is another store on the same bucket.
        other = S3VaultStore(self.objects, reactor, prefix="elsewhere")
        assert await other.get_blob(uid) is None

    async def test_check_refuses_an_unversioned_bucket(self) -> None:
        bucket = await self.server.new_bucket()
        objects = self.s3_objects(self.server, bucket)
        self.addCleanup(lambda: Deferred.fromCoroutine(objects.close()))
        async with self.raises(StoreError) as caught:
            await S3VaultStore(objects, reactor).check()
        assert "versioning" in str(caught[0]), caught

    async def test_a_delete_marker_on_top_hides_the_blob(self) -> None:
        """Someone deletes the blob outside home (a plain DELETE: a delete marker on top). The
        user has no blob and no versions; "0" creates afresh, and the versions from before the
        marker (the same user's) are history again."""
        uid = new_uid()
        v1 = await self.store.put_blob(uid, b"one", NO_VERSION)
        v2 = await self.store.put_blob(uid, b"two", v1)
        await self.objects.delete(f"home-tests/blobs/{uid}")
        assert await self.store.get_blob(uid) is None
        assert await self.store.list_blob_versions(uid) == []
        assert await self.store.get_blob_version(uid, v1) is None
        assert await self.conflict(self.store.put_blob(uid, b"x", v2)) == NO_VERSION
        fresh = await self.store.put_blob(uid, b"three", NO_VERSION)
        listed = [v.version for v in await self.store.list_blob_versions(uid)]
        assert listed == [fresh, v2, v1], listed
        assert await self.store.get_blob_version(uid, v1) == b"one"

    async def test_prefix_is_normalised(self) -> None:
        assert normalise_prefix("") == ""
        assert normalise_prefix("/") == ""
        assert normalise_prefix("a") == "a/"
        assert normalise_prefix("/a//b/") == "a/b/"
        with self.assertRaises(ValueError):
            normalise_prefix("a/../b")


class MotoTest(_S3Conformance, unittest.TestCase):
    backend = "moto"
    kind = "moto"


class SeaweedFSTest(_S3Conformance, unittest.TestCase):
    backend = "seaweedfs"
    kind = "seaweedfs"


# --- the object store's versioning additions ------------------------------------------------------


class VersionedObjects(_Mixin):
    """``S3Store.versioning``, ``list_versions``, ``get_version``, ``delete_version``."""

    kind: ClassVar[s3servers.Kind]
    timeout = 120

    async def objects_on(self, bucket: str, **options: Any) -> S3Store:
        objects = s3servers.store_for(self.server, bucket, **options)
        self.addCleanup(lambda: Deferred.fromCoroutine(objects.close()))
        return objects

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        return Deferred.fromCoroutine(self._set_up())

    async def _set_up(self) -> None:
        self.server = await s3servers.shared_server(self.kind)

    async def test_versioning_status(self) -> None:
        bucket = await self.server.new_bucket()
        objects = await self.objects_on(bucket)
        assert await objects.versioning() == ""

        def set_status(status: str) -> None:
            self.server.client().put_bucket_versioning(
                Bucket=bucket, VersioningConfiguration={"Status": status}
            )

        await in_thread(set_status, "Enabled")
        assert await objects.versioning() == "Enabled"
        await in_thread(set_status, "Suspended")
        assert await objects.versioning() == "Suspended"

    async def test_list_get_and_delete_versions(self) -> None:
        bucket = await versioned_bucket(self.server)
        # Two entries a page: every listing below pages through key and version-id markers. (No
        # key here extends another: SeaweedFS's truncated pages mishandle that shape, see the
        # quirks in lchat/objstore/s3.py and test_sibling_uids in the conformance suite.)
        objects = await self.objects_on(bucket, list_page_size=2)
        awkward = "h/c café +%"
        puts: dict[str, list[str]] = {"h/a": [], "h/b": [], awkward: []}
        for key, count in (("h/a", 4), ("h/b", 1), (awkward, 3)):
            for i in range(count):
                body = f"{key} #{i}".encode()
                puts[key].append((await objects.put(key, body)).etag)
        await objects.put("other/x", b"outside the prefix")
        await objects.delete("h/b")  # a delete marker on top of h/b's one version

        listed = await objects.list_versions("h/")
        assert [v.key for v in listed] == ["h/a"] * 4 + ["h/b"] * 2 + [awkward] * 3, listed
        for key in ("h/a", awkward):
            history = [v for v in listed if v.key == key]
            assert [v.etag for v in history] == puts[key][::-1]  # newest first
            assert [v.is_latest for v in history] == [True] + [False] * (len(history) - 1)
            assert not any(v.delete_marker for v in history)
            assert all(v.version_id and v.last_modified.tzinfo is not None for v in history)
            assert history[0].size == len(f"{key} #{len(history) - 1}".encode())
        marker, old_b = [v for v in listed if v.key == "h/b"]
        assert (marker.delete_marker, marker.is_latest, marker.etag) == (True, True, "")
        assert (old_b.delete_marker, old_b.is_latest, old_b.etag) == (False, False, puts["h/b"][0])
        assert len({v.version_id for v in listed}) == len(listed)

        for limit in (1, 3, 5, 9, 20):
            limited = await objects.list_versions("h/", limit=limit)
            assert [v.version_id for v in limited] == [v.version_id for v in listed[:limit]]
        assert [v.etag for v in await objects.list_versions(awkward, limit=2)] == puts[awkward][
            :0:-1
        ]
        assert await objects.list_versions("nothing/") == []
        with self.assertRaises(ValueError):
            await objects.list_versions("h/", limit=0)

        oldest = [v for v in listed if v.key == awkward][-1]
        got = await objects.get_version(awkward, oldest.version_id)
        assert (got.body, got.info.etag) == (f"{awkward} #0".encode(), puts[awkward][0])
        assert (await objects.get(awkward)).body == f"{awkward} #2".encode()
        # The deleted key's old version is still readable by id (what a purge must remove).
        assert (await objects.get_version("h/b", old_b.version_id)).body == b"h/b #0"

        await objects.delete_version(awkward, oldest.version_id)
        await objects.delete_version(awkward, oldest.version_id)  # gone already: fine
        with self.assertRaises(NotFound):
            await objects.get_version(awkward, oldest.version_id)
        for version in (marker, old_b):
            await objects.delete_version("h/b", version.version_id)
        left = await objects.list_versions("h/")
        assert [v.key for v in left] == ["h/a"] * 4 + [awkward] * 2, left

    async def test_unversioned_bucket_lists_one_version_per_key(self) -> None:
        bucket = await self.server.new_bucket()
        objects = await self.objects_on(bucket)
        await objects.put("k", b"1")
        second = await objects.put("k", b"2")
        (only,) = await objects.list_versions("k")
        assert (only.key, only.etag, only.is_latest) == ("k", second.etag, True)
        store: ObjectStore = objects  # still a plain ObjectStore
        assert (await store.get("k")).body == b"2"


class MotoVersionedObjects(VersionedObjects, unittest.TestCase):
    kind = "moto"


class SeaweedFSVersionedObjects(VersionedObjects, unittest.TestCase):
    kind = "seaweedfs"
