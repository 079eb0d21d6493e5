"""Mesh membership (``lchat/mesh/membership.py``) against real stores: the file store and moto.

No store is faked. ``Counting`` only records the calls it forwards to a real store;
``BucketClockOff`` moves a real file store's clock as a whole (``now()`` and every
``Last-Modified`` alike, as ``ShiftedBucketClock`` in ``test_lease.py`` does) to show that
liveness is judged on the bucket's clock. Timings are real and short: heartbeats of a fraction of a
second, ``dead_after`` of under a second on the file store and a few seconds on moto (whose
``Last-Modified`` and ``Date`` have whole seconds only).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from attrs import evolve
from prometheus_client import REGISTRY
from twisted.internet import reactor as _reactor
from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import ILogObserver, LogEvent, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface import implementer

import lchat
from lchat.config import HibernateConfig, MeshConfig
from lchat.mesh import members
from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.members import (
    Member,
    decode_member_name,
    encode_member_name,
    member_key,
    members_prefix,
    read_members,
)
from lchat.mesh.membership import Membership, RegionsSeen
from lchat.objstore import NotFound, ObjectInfo, ObjectStore, StoredObject
from lchat.objstore.file import FileStore
from lchat.threads import thread_runner
from tests import fakes, s3servers

reactor: Any = _reactor
T = TypeVar("T")

HIB = HibernateConfig(bucket="file:/unused", region="", prefix="prod", endpoint="", idle=60.0)
A = "https://box-a.example.net"
B = "https://box-b.example.net"
C = "https://box-c.example.net:8443"


def d(coro: Coroutine[Any, Any, T]) -> Deferred[T]:
    return Deferred.fromCoroutine(coro)


async def sleep(seconds: float) -> None:
    await task.deferLater(reactor, seconds, lambda: None)


# The heartbeat keys of the boxes here (their MeshConfig token "t"): a body planted by a test as
# another member's is signed with them, as that member would.
KEYS = HeartbeatKeys.of("t")


async def until(
    check: Callable[[], bool], within: float, what: str, *, step: float = 0.02
) -> float:
    """Wait (real time) until ``check()``; returns how long that took."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > within:
            raise AssertionError(f"not within {within}s: {what}")
        await sleep(step)
    return time.monotonic() - start


def urls(members: list[Member]) -> set[str]:
    return {m.url for m in members}


def failures(op: str) -> float:
    value = REGISTRY.get_sample_value("lchat_mesh_heartbeat_failures_total", {"op": op})
    assert value is not None
    return value


def changes() -> float:
    value = REGISTRY.get_sample_value("lchat_mesh_membership_changes_total")
    assert value is not None
    return value


class Counting:
    """Wraps a real store and records each call it forwards (``name``, then ``name:done`` when it
    returns): no fake behaviour."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name in ("describe",) or not callable(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            result = await attr(*args, **kwargs)
            self.calls.append(f"{name}:done")
            return result

        return call

    def count(self, name: str) -> int:
        return self.calls.count(name)


class BucketClockOff:
    """A real store whose bucket clock is ``offset`` seconds off ours: ``now()`` and every
    ``Last-Modified`` move together. Everything else is the real store's."""

    def __init__(self, store: Any, offset: float) -> None:
        self._store = store
        self._shift = datetime.timedelta(seconds=offset)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _info(self, info: ObjectInfo) -> ObjectInfo:
        return evolve(info, last_modified=info.last_modified + self._shift)

    async def now(self) -> datetime.datetime:
        return await self._store.now() + self._shift

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return [self._info(i) for i in await self._store.list(prefix)]

    async def head(self, key: str) -> ObjectInfo:
        return self._info(await self._store.head(key))

    async def get(self, key: str) -> StoredObject:
        obj = await self._store.get(key)
        return StoredObject(self._info(obj.info), obj.body)


@implementer(IReactorTime)
class WrongWallClock:
    """The real reactor as seen by a box whose wall clock is ``offset`` seconds off."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def seconds(self) -> float:
        return float(reactor.seconds()) + self.offset

    def callLater(
        self, delay: float, callable: Callable[..., Any], *args: object, **kwargs: object
    ) -> IDelayedCall:
        call: IDelayedCall = reactor.callLater(delay, callable, *args, **kwargs)
        return call

    def getDelayedCalls(self) -> list[IDelayedCall]:
        calls: list[IDelayedCall] = reactor.getDelayedCalls()
        return calls


class Changes:
    """A subscriber: records every (old, new) it is called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[set[str], set[str]]] = []

    def __call__(self, old: list[Member], new: list[Member]) -> None:
        self.calls.append((urls(old), urls(new)))


# --- names and bodies, no store -----------------------------------------------------------------


class RegionsSeenTests(SynchronousTestCase):
    """Since when a region has had no live member (the regional failover's grace), on a plain
    clock: a region in the view has none; one that left counts from the first view without it;
    one never seen counts from this box's start."""

    @staticmethod
    def view(*members: tuple[str, str]) -> list[Member]:
        when = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
        return [
            Member(
                url=url,
                region=region,
                version="v",
                started_at=0.0,
                last_modified=when,
                age=0.0,
                key=url,
            )
            for url, region in members
        ]

    def test_a_region_is_empty_from_the_first_view_without_it(self) -> None:
        seen = RegionsSeen(started=100.0)
        self.assertEqual(seen.empty_since("fi"), 100.0)  # never seen: since this box started
        seen.saw(self.view((A, "ie"), (B, "fi")), 110.0)
        self.assertIsNone(seen.empty_since("fi"))
        self.assertIsNone(seen.empty_since("ie"))
        seen.saw(self.view((A, "ie"), (B, "fi")), 120.0)
        seen.saw(self.view((A, "ie")), 130.0)  # fi's last box left this view
        self.assertEqual(seen.empty_since("fi"), 130.0)
        seen.saw(self.view((A, "ie")), 140.0)  # still empty: the time does not move
        self.assertEqual(seen.empty_since("fi"), 130.0)
        seen.saw(self.view((A, "ie"), (C, "fi")), 150.0)  # back
        self.assertIsNone(seen.empty_since("fi"))
        seen.saw(self.view((A, "ie")), 160.0)  # gone again: a fresh grace
        self.assertEqual(seen.empty_since("fi"), 160.0)
        self.assertEqual(seen.empty_since("us"), 100.0)
        self.assertEqual(seen.empty_since(""), 100.0)  # (no region is never "live")

    def test_the_membership_reports_on_its_own_clock(self) -> None:
        clock = task.Clock()
        clock.advance(500.0)
        mesh = MeshConfig(
            self_url=A,
            domains=("example.com",),
            token="t",
            region="ie",
            heartbeat=1.0,
            dead_after=3.0,
        )
        m = Membership(
            clock,
            FileStore(clock, self.mktemp(), run_in_thread=fakes.inline),
            HIB,
            mesh,
            monotonic=clock.seconds,
        )
        self.assertIsNone(m.region_empty_since("ie"))  # this box is in its own first view
        self.assertEqual(m.region_empty_since("fi"), 500.0)


class NameTests(SynchronousTestCase):
    def test_key_is_base64url_of_the_normalised_url_without_padding(self) -> None:
        # The example in the mesh guide: `echo <name> | base64 -d` gives the URL.
        self.assertEqual(
            member_key(HIB, "HTTPS://Box-1.Example.NET:443/"),
            "prod/mesh/members/aHR0cHM6Ly9ib3gtMS5leGFtcGxlLm5ldA",
        )
        self.assertEqual(members_prefix(HIB), "prod/mesh/members/")
        self.assertEqual(
            member_key(evolve(HIB, prefix=""), "http://b:80"), "mesh/members/aHR0cDovL2I"
        )
        for url in (A, B, C, "http://[::1]:8080", "https://xn--bcher-kva.example"):
            name = encode_member_name(url)
            self.assertNotIn("=", name)
            self.assertEqual(decode_member_name(name), url)
            self.assertEqual(base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode(), url)
        with self.assertRaises(ValueError):
            member_key(HIB, "box-a.example.net")  # no scheme

    def test_names_that_are_not_ours_decode_to_none(self) -> None:
        canonical = encode_member_name("https://box-1.example.net")
        for name in (
            "",
            "not base64!",
            canonical + "=",  # padded
            canonical[:-1] + "B",  # same bytes, stray low bits: not what any box writes
            "a",  # impossible length
            encode_member_name("hello"),
            encode_member_name("HTTPS://Box-1.example.net"),  # not normalised
            encode_member_name("https://box-1.example.net:443"),
            encode_member_name("https://box-1.example.net/path"),
            encode_member_name("ftp://box-1.example.net"),
            base64.urlsafe_b64encode(b"\xff\xfe").decode().rstrip("="),  # not UTF-8
        ):
            self.assertIsNone(decode_member_name(name), name)

    def test_body_is_stable_json(self) -> None:
        beat = Heartbeat(url=A, region="ie", version="0.1.0", started_at=1789000000.5)
        body = beat.to_json()
        self.assertEqual(body, beat.to_json())
        self.assertEqual(
            json.loads(body),
            {"url": A, "region": "ie", "version": "0.1.0", "started_at": 1789000000.5},
        )
        self.assertEqual(Heartbeat.parse(body), beat)
        self.assertEqual(
            Heartbeat.parse(
                b'{"url":"u","region":"","version":"v","started_at":1,"x":2}'
            ).started_at,
            1.0,
        )
        for bad in (
            b"",
            b"not json",
            b"\xff",
            b"[]",
            b'{"url": "u", "region": "", "version": "v"}',
            b'{"url": "u", "region": 5, "version": "v", "started_at": 1}',
            b'{"url": "u", "region": "", "version": "v", "started_at": true}',
            b'{"url": "u", "region": "", "version": "v", "started_at": "1"}',
            b'{"url": null, "region": "", "version": "v", "started_at": 1}',
        ):
            with self.assertRaises(ValueError):
                Heartbeat.parse(bad)

    def test_member_is_a_placement_candidate(self) -> None:
        from lchat.mesh import placement

        now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
        members = [
            Member(u, "ie", "v", 0.0, now, 0.0, member_key(HIB, u), is_self=u == A)
            for u in (A, B, C)
        ]
        self.assertEqual([m.self for m in members], [True, False, False])
        self.assertIn(placement.owner("chat.example.com", members), members)


# --- scenarios, against every store -------------------------------------------------------------

if TYPE_CHECKING:
    _Mixin = TestCase
else:
    _Mixin = object  # not a TestCase itself, or trial would run the hook-less base


class Scenarios(_Mixin):
    """What membership promises, on a fresh bucket per test. Every box has its own store."""

    heartbeat: ClassVar[float]
    dead_after: ClassVar[float]
    slack: ClassVar[float]  # how far off an age may be on this store (Last-Modified rounding)
    timeout = 60

    async def make_store(self) -> ObjectStore:
        """Another box's store on this test's bucket."""
        raise NotImplementedError

    async def make_breakable(
        self,
    ) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        """Set up a bucket of this test's own that can fail as a whole: returns (break, heal)."""
        raise NotImplementedError

    async def breakable_store(self) -> ObjectStore:
        """Another box's store on the breakable bucket."""
        raise NotImplementedError

    def mesh(self, url: str, region: str = "") -> MeshConfig:
        return MeshConfig(
            self_url=url,
            domains=("example.com",),
            token="t",
            region=region,
            heartbeat=self.heartbeat,
            dead_after=self.dead_after,
        )

    async def box(
        self,
        url: str,
        region: str = "",
        *,
        store: Any = None,
        started_at: float | None = None,
        start: bool = True,
        clock: Any = None,
    ) -> Membership:
        if store is None:
            store = await self.make_store()
        m = Membership(clock or reactor, store, HIB, self.mesh(url, region), started_at=started_at)
        if start:
            m.startService()
        self.addCleanup(lambda: m.stopService() if m.running else None)
        return m

    def log_lines(self) -> list[str]:
        events: list[LogEvent] = []
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        self._events = events
        return self._lines

    @property
    def _lines(self) -> list[str]:
        return [
            formatEvent(e)
            for e in getattr(self, "_events", [])
            if e.get("log_namespace") == "lchat.mesh.membership"
        ]

    async def beats(self, m: Membership, n: int) -> None:
        """Wait for ``n`` more completed beats of ``m``."""
        target = m.beats + n
        await until(lambda: m.beats >= target, 10 + n * self.heartbeat * 3, f"{n} beats")

    async def test_members_see_each_other(self) -> None:
        self.log_lines()
        before = changes()
        seen = Changes()
        a = await self.box(A, "ie", started_at=1000.0, start=False)
        a.subscribe(seen)
        a.startService()
        b = await self.box(B, "ie", started_at=2000.0)
        c = await self.box(C, "fi", started_at=3000.0)
        everyone = {A, B, C}
        await until(lambda: all(urls(m.members) == everyone for m in (a, b, c)), 10, "all see all")
        for m in (a, b, c):
            self.assertEqual([x.url for x in m.members], sorted(everyone))
            self.assertEqual([x.url for x in m.members if x.self], [m.url])
            self.assertEqual(urls(m.peers()), everyone - {m.url})
            self.assertEqual(m.live(), m.members)
        by_url = {x.url: x for x in a.members}
        V = lchat.__version__
        self.assertEqual(
            [(x.region, x.started_at, x.version) for x in a.members],
            [("ie", 1000.0, V), ("ie", 2000.0, V), ("fi", 3000.0, V)],
        )
        self.assertEqual(by_url[C].key, member_key(HIB, C))
        for x in a.members:
            self.assertLessEqual(x.age, self.dead_after)
            self.assertGreaterEqual(x.age, -self.slack)
        # The subscriber saw the fleet grow to all three, each call a real change.
        self.assertTrue(seen.calls)
        self.assertEqual(seen.calls[-1][1], everyone)
        for old, new in seen.calls:
            self.assertNotEqual(old, new)
        self.assertGreaterEqual(changes() - before, 2)
        lines = self._lines
        self.assertIn(f"mesh: member joined {B} (region ie)", lines)
        self.assertIn(f"mesh: member joined {C} (region fi)", lines)

        # The CLI's read: one LIST from anywhere, self marked only when asked.
        store = await self.make_store()
        outside = await read_members(store, HIB, dead_after=self.dead_after, keys=KEYS)
        self.assertEqual(urls(outside), everyone)
        self.assertFalse(any(x.self for x in outside))
        marked = await read_members(
            store, HIB, dead_after=self.dead_after, keys=KEYS, self_url="HTTPS://box-b.example.net/"
        )
        self.assertEqual([x.url for x in marked if x.self], [B])

    async def test_first_beat_shows_self(self) -> None:
        a = await self.box(A, "ie", start=False)
        # Before any beat, placement still has a fleet: this box.
        self.assertEqual([(x.url, x.self, x.region) for x in a.members], [(A, True, "ie")])
        a.startService()
        await self.beats(a, 1)
        self.assertEqual([(x.url, x.self) for x in a.members], [(A, True)])
        self.assertEqual(a.members[0].key, member_key(HIB, A))
        self.assertEqual(a.peers(), [])
        self.assertEqual(REGISTRY.get_sample_value("lchat_mesh_members_live"), 1.0)

        # The body is the documented JSON, and it does not change between beats (same ETag).
        store = await self.make_store()
        obj = await store.get(a.key)
        self.assertEqual(
            json.loads(obj.body),
            {
                "url": A,
                "region": "ie",
                "version": lchat.__version__,
                "started_at": a.body.started_at,
                "epoch": a.epoch,
                "mac": a.body.mac,
            },
        )
        # The MAC is the mesh token's, over every other field (lchat.mesh.heartbeat).
        self.assertEqual(KEYS.check(Heartbeat.parse(obj.body)), "current")
        self.assertEqual(KEYS.sign(evolve(a.body, mac="")), a.body)
        self.assertRegex(a.epoch, "^[0-9a-f]{32}$")
        await self.beats(a, 3)
        self.assertEqual((await store.head(a.key)).etag, obj.info.etag)

    async def test_stopped_heartbeats_are_gone_after_dead_after(self) -> None:
        self.log_lines()
        seen = Changes()
        b = await self.box(B)
        b.subscribe(seen)
        store = await self.make_store()
        crashed = "https://crashed.example.net"
        key = member_key(HIB, crashed)
        # One beat of a box that then dies (no drain: its heartbeat is left to rot).
        await store.put(key, KEYS.sign(Heartbeat(crashed, "ie", "0.0.9", 5.0)).to_json())
        written = time.monotonic()
        await until(lambda: crashed in urls(b.members), 10, "the crashed box is seen")
        [seen_once] = [x for x in b.members if x.url == crashed]
        self.assertEqual(
            (seen_once.region, seen_once.version, seen_once.self), ("ie", "0.0.9", False)
        )
        await until(
            lambda: crashed not in urls(b.members),
            self.dead_after + 2 * self.slack + 10 * self.heartbeat + 5,
            "the crashed box is gone",
        )
        gone_after = time.monotonic() - written
        self.assertGreaterEqual(gone_after, self.dead_after - self.slack)
        self.assertEqual(urls(b.members), {B})
        await store.head(key)  # nobody deleted it: peers only stop counting it
        self.assertEqual(seen.calls[-1], ({B, crashed}, {B}))
        self.assertTrue(
            any(
                line.startswith(f"mesh: member gone {crashed} (last beat ") for line in self._lines
            ),
            self._lines,
        )
        # Not counted when we read on its own either: within a second, since a fresh store knows
        # the bucket's clock from one Date (up to 1 s behind it) and b's from the Dates of 2 s.
        deadline = time.monotonic() + 2.0
        while urls(await read_members(store, HIB, dead_after=self.dead_after, keys=KEYS)) != {B}:
            self.assertLess(time.monotonic(), deadline, "a reader on its own still counts it")
            await sleep(0.1)
        with_dead = await read_members(
            store, HIB, dead_after=self.dead_after, keys=KEYS, include_dead=True
        )
        self.assertEqual(urls(with_dead), {B, crashed})
        self.assertGreater(next(x for x in with_dead if x.url == crashed).age, self.dead_after)

    async def test_stop_deletes_the_heartbeat_first_and_peers_drop_it(self) -> None:
        self.log_lines()
        counting = Counting(await self.make_store())
        a = await self.box(A, store=counting)
        b = await self.box(B)
        await until(lambda: urls(a.members) == urls(b.members) == {A, B}, 10, "a and b")
        mark = len(counting.calls)
        fired: list[list[str]] = []
        stopped = a.stopService()
        stopped.addCallback(lambda _: fired.append(list(counting.calls[mark:])))
        await stopped
        # The delete was the first (and only) thing a did after being told to stop, and the
        # Deferred fired only once it was done.
        after = [call for call in fired[0] if not call.endswith(":done")]
        self.assertEqual(after, ["delete"])
        self.assertIn("delete:done", fired[0])
        with self.assertRaises(NotFound):
            await (await self.make_store()).head(member_key(HIB, A))
        # b drops a at its next read, long before a's beat could have gone stale.
        took = await until(lambda: urls(b.members) == {B}, 10, "b drops a")
        self.assertLess(took, self.dead_after)
        self.assertIn(f"mesh: heartbeat {a.key} deleted: peers drop {A} now", self._lines)
        self.assertTrue(any(line.startswith(f"mesh: member gone {A} ") for line in self._lines))
        await self.beats(b, 2)
        self.assertNotIn("put", counting.calls[mark:])  # and a never beat again

    async def test_garbage_under_the_prefix_is_ignored(self) -> None:
        self.log_lines()
        store = await self.make_store()
        prefix = members_prefix(HIB)
        canonical = encode_member_name("https://box-x.example.net")
        garbage: dict[str, bytes] = {
            prefix + "not base64!": b"{}",
            prefix: b"{}",  # an empty name
            prefix + encode_member_name("hello"): b"{}",
            prefix + encode_member_name("HTTPS://Box-X.example.net:443"): b"{}",
            prefix + canonical[:-1] + "B": b"{}",
            prefix + "nested/" + canonical: Heartbeat(
                "https://box-x.example.net", "", "v", 1.0
            ).to_json(),
            member_key(HIB, "https://not-json.example.net"): b"\x00 not json",
            member_key(HIB, "https://a-list.example.net"): b"[1, 2]",
            member_key(HIB, "https://fields.example.net"): json.dumps(
                {"url": "https://fields.example.net", "region": 5, "version": "v", "started_at": 1}
            ).encode(),
            member_key(HIB, "https://mismatch.example.net"): Heartbeat(
                "https://elsewhere.example.net", "", "v", 1.0
            ).to_json(),
            member_key(HIB, "https://big.example.net"): json.dumps(
                {
                    "url": "https://big.example.net",
                    "region": "",
                    "version": "v",
                    "started_at": 1,
                    "pad": "x" * 10000,
                }
            ).encode(),
        }
        for key, body in garbage.items():
            await store.put(key, body)
        # Outside the prefix altogether: never listed.
        await store.put(HIB.key("mesh", "membersX"), b"{}")

        counting = Counting(await self.make_store())
        b = await self.box(B, store=counting)
        await self.beats(b, 3)
        self.assertEqual(urls(b.members), {B})
        self.assertEqual(
            urls(await read_members(store, HIB, dead_after=self.dead_after, keys=KEYS)), {B}
        )
        # Each piece of garbage is logged once however many beats see it (the cache remembers),
        # and the oversized body and the keys that name no member are never even read.
        for key in garbage:
            lines = [line for line in self._lines if line.startswith(f"mesh: skipping {key!r}")]
            self.assertGreaterEqual(len(lines), 1, key)
            self.assertLessEqual(len(lines), 2, key)  # b's beats, and our own read above
        self.assertEqual(counting.count("get"), 5)  # b's body and the four parsed bodies

        # A box whose body is fixed is seen at once (the cache is keyed by ETag).
        fixed = "https://mismatch.example.net"
        await store.put(member_key(HIB, fixed), KEYS.sign(Heartbeat(fixed, "", "v", 1.0)).to_json())
        await until(lambda: urls(b.members) == {B, fixed}, 10, "the repaired member")

    async def test_bodies_are_not_read_again_while_their_etag_is_unchanged(self) -> None:
        counting = Counting(await self.make_store())
        a = await self.box(A, store=counting)
        b = await self.box(B, started_at=1.0)
        await until(lambda: urls(a.members) == {A, B}, 10, "a sees b")
        await self.beats(a, 5)
        self.assertEqual(counting.count("get"), 2)  # a's own body and b's, once each
        self.assertGreaterEqual(counting.count("list"), 6)
        self.assertLessEqual(abs(counting.count("list") - a.beats), 1)  # one LIST per beat

        # b restarts: a new process start, a new body, a new ETag: read once more.
        await b.stopService()
        await until(lambda: urls(a.members) == {A}, 10, "a drops b")
        b2 = await self.box(B, started_at=2.0)
        await until(
            lambda: [x.started_at for x in a.members if x.url == B] == [2.0], 10, "a sees new b"
        )
        await self.beats(a, 3)
        self.assertEqual(counting.count("get"), 3)
        self.assertEqual(urls(b2.members), {A, B})

        # The same cache, kept by a caller of read_members.
        reader = Counting(await self.make_store())
        bodies: members.BodyCache = {}
        first = await read_members(
            reader, HIB, dead_after=self.dead_after, keys=KEYS, bodies=bodies
        )
        self.assertEqual(reader.count("get"), 2)
        self.assertEqual(set(bodies), {member_key(HIB, A), member_key(HIB, B)})
        etag, parsed = bodies[member_key(HIB, B)]
        self.assertEqual(etag, (await reader.head(member_key(HIB, B))).etag)
        self.assertEqual(parsed, b2.body)
        again = await read_members(
            reader, HIB, dead_after=self.dead_after, keys=KEYS, bodies=bodies
        )
        self.assertEqual(reader.count("get"), 2)
        self.assertEqual(reader.count("list"), 2)
        self.assertEqual(
            [(x.url, x.region, x.started_at) for x in again],
            [(x.url, x.region, x.started_at) for x in first],
        )
        # A key no longer listed leaves the cache.
        await b2.stopService()
        await read_members(reader, HIB, dead_after=self.dead_after, keys=KEYS, bodies=bodies)
        self.assertEqual(set(bodies), {member_key(HIB, A)})

    async def test_a_failing_store_keeps_the_last_view_and_counts_failures(self) -> None:
        self.log_lines()
        break_it, heal = await self.make_breakable()
        seen = Changes()
        a = await self.box(A, store=await self.breakable_store())
        a.subscribe(seen)
        b = await self.box(B, store=await self.breakable_store())
        await until(lambda: urls(a.members) == urls(b.members) == {A, B}, 10, "a and b")
        calls_before = len(seen.calls)
        put_before, list_before = failures("put"), failures("list")
        await break_it()
        try:
            await until(
                lambda: failures("put") >= put_before + 4 and failures("list") >= list_before + 4,
                30,
                "failures counted",
                step=0.05,
            )
            # A box that starts now, with the bucket out, still has a fleet: itself.
            c = await self.box(C, store=await self.breakable_store())
            await self.beats(c, 1)
            self.assertEqual([(x.url, x.self) for x in c.members], [(C, True)])
            # Long past dead_after: the last view stays as it was.
            await sleep(self.dead_after + self.slack)
            self.assertEqual(urls(a.members), {A, B})
            self.assertEqual(urls(b.members), {A, B})
            self.assertEqual(len(seen.calls), calls_before)
        finally:
            await heal()
        self.assertTrue(
            any(line.startswith("mesh: heartbeat PUT failed (") for line in self._lines)
        )
        self.assertTrue(
            any(line.startswith("mesh: could not read the membership (") for line in self._lines)
        )
        # Healed: everyone beats again and sees everyone.
        await until(lambda: all(urls(m.members) == {A, B, C} for m in (a, b, c)), 30, "healed view")


class FileStoreMembershipTests(Scenarios, TestCase):
    """The scenarios on the file store (sub-second Last-Modified); a bucket breaks when its
    directory goes away."""

    heartbeat = 0.2
    dead_after = 0.6
    slack = 0.05

    def setUp(self) -> None:
        self.base = os.path.abspath(self.mktemp())
        self.root = os.path.join(self.base, "bucket")
        os.makedirs(self.root)

    async def make_store(self) -> ObjectStore:
        return FileStore(reactor, self.root, run_in_thread=thread_runner(reactor))

    async def make_breakable(
        self,
    ) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        root = self.breakable = os.path.join(self.base, "breakable")
        os.makedirs(root)

        async def break_it() -> None:
            os.rename(root, root + ".away")  # an unmounted directory: every call fails at once

        async def heal() -> None:
            os.rename(root + ".away", root)

        return break_it, heal

    async def breakable_store(self) -> ObjectStore:
        return FileStore(reactor, self.breakable, run_in_thread=thread_runner(reactor))

    async def test_liveness_is_judged_on_the_bucket_clock(self) -> None:
        # The bucket's clock an hour behind the boxes': judged by our clock every beat would be an
        # hour old (dead); on the bucket's, they are fresh.
        behind = [BucketClockOff(await self.make_store(), -3600.0) for _ in range(2)]
        a = await self.box(A, store=behind[0])
        b = await self.box(B, store=behind[1])
        await until(lambda: urls(a.members) == urls(b.members) == {A, B}, 10, "a and b")
        await self.beats(a, 2)
        local = datetime.datetime.now(datetime.UTC)
        for x in a.members:
            self.assertLess(x.age, self.dead_after)
            self.assertLess(x.last_modified, local - datetime.timedelta(minutes=59))
        await a.stopService()
        await b.stopService()

        # An hour ahead: a beat that stopped is in our future by our clock, yet it goes stale
        # after dead_after of the bucket's time.
        ahead = BucketClockOff(await self.make_store(), 3600.0)
        c = await self.box(C, store=ahead)
        crashed = "https://crashed.example.net"
        await ahead.put(
            member_key(HIB, crashed), KEYS.sign(Heartbeat(crashed, "", "v", 1.0)).to_json()
        )
        written = time.monotonic()
        await until(lambda: crashed in urls(c.members), 10, "c sees the crashed box")
        await until(lambda: crashed not in urls(c.members), 10, "the crashed box is gone")
        self.assertGreaterEqual(time.monotonic() - written, self.dead_after - self.slack)

        # A box whose own wall clock is a day off sees the same fleet as everyone else.
        d1 = await self.box(A, clock=WrongWallClock(86400.0))
        d2 = await self.box(B, clock=WrongWallClock(-86400.0))
        await until(lambda: urls(d1.members) == urls(d2.members) == {A, B, C}, 10, "all three")

    async def test_stop_is_bounded_when_the_delete_fails(self) -> None:
        self.log_lines()
        break_it, heal = await self.make_breakable()
        store = await self.breakable_store()
        a = await self.box(A, store=store)
        await self.beats(a, 1)
        before = failures("delete")
        await break_it()
        try:
            await a.stopService()  # fails fast: the directory is gone; fires anyway
        finally:
            await heal()
        self.assertEqual(failures("delete"), before + 1)
        self.assertTrue(
            any(
                line.startswith(f"mesh: could not delete heartbeat {a.key}") for line in self._lines
            )
        )
        # The heartbeat is still there: peers drop it after dead_after instead.
        await store.head(a.key)


class MotoMembershipTests(Scenarios, TestCase):
    """The scenarios over real HTTP against moto's server (whole-second Last-Modified and Date);
    a bucket breaks when a private moto server is paused (SIGSTOP: a hung store)."""

    heartbeat = 0.3
    dead_after = 2.5
    slack = 1.05

    def setUp(self) -> Deferred[None]:  # type: ignore[override]  # trial waits for it
        async def set_up() -> None:
            self.server = await s3servers.shared_server("moto")
            self.bucket = await self.server.new_bucket()

        return d(set_up())

    def s3(self, server: s3servers.S3Server, bucket: str, **kw: Any) -> ObjectStore:
        store = s3servers.store_for(server, bucket, **kw)
        self.addCleanup(lambda: d(store.close()))
        return store

    async def make_store(self) -> ObjectStore:
        return self.s3(self.server, self.bucket)

    async def make_breakable(
        self,
    ) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        server = self.private = await s3servers.start_server("moto")
        self.addCleanup(lambda: d(server.destroy()))

        async def pause() -> None:
            server.pause()  # SIGSTOP: connections stay open, nothing answers

        async def resume() -> None:
            server.resume()

        return pause, resume

    async def breakable_store(self) -> ObjectStore:
        return self.s3(self.private, self.private.bucket, timeout=5.0, retries=1)

    async def test_stop_is_bounded_when_the_store_hangs(self) -> None:
        self.log_lines()
        pause, resume = await self.make_breakable()
        a = await self.box(A, store=await self.breakable_store())
        await self.beats(a, 1)
        a.stop_timeout = 1.0
        before = failures("delete")
        await pause()
        try:
            start = time.monotonic()
            await a.stopService()
            took = time.monotonic() - start
        finally:
            await resume()
        self.assertGreaterEqual(took, 0.9)
        self.assertLess(took, 3.0)
        self.assertEqual(failures("delete"), before + 1)
        self.assertTrue(
            any(
                line.startswith(f"mesh: could not delete heartbeat {a.key} (no answer within 1s)")
                for line in self._lines
            ),
            self._lines,
        )
