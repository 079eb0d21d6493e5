"""The heartbeat janitor (``lchat/mesh/members.py`` ``Janitor``, a step of each ``Membership`` beat).

Long-dead members' heartbeat keys are deleted by the live box with the lowest URL, one per beat,
each DELETE conditional on the ETag it listed. Time is the point here, so the boxes run on a
``task.Clock`` and the bucket's clock runs ``clock.seconds()`` ahead of the real one
(``ShiftedBucketClock`` from ``test_lease.py``: ``now()`` and every ``Last-Modified`` move
together, a version keeping the shift in force when it was written). Everything else (LIST,
ETags, the conditional DELETE) is a real store's: the file store, and moto over HTTP.

Virtual time uses the defaults: a 15 s heartbeat, 45 s dead-after, so the janitor deletes a key
whose last write is more than 450 s old. Real time keeps passing underneath, by milliseconds per
beat (moto's whole-second dates move ages by up to a second), far inside the 15 s margins below.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from attrs import evolve
from prometheus_client import REGISTRY
from twisted.internet import reactor as _reactor
from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.logger import ILogObserver, LogEvent, formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from lchat.config import MeshConfig
from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.members import (
    JANITOR_DEAD_AFTERS,
    encode_member_name,
    member_key,
    members_prefix,
    stale_keys,
)
from lchat.mesh.membership import Membership
from lchat.objstore import NotFound, ObjectInfo, ObjectStore, StoreUnavailable
from lchat.objstore.file import FileStore
from lchat.threads import thread_runner
from tests import s3servers
from tests.test_lease import ShiftedBucketClock
from tests.test_membership import HIB, Counting, d, until

reactor: Any = _reactor

A = "https://box-a.example.net"  # the lowest URL: the janitor
B = "https://box-b.example.net"
DEAD = "https://box-dead.example.net"
HEARTBEAT = 15.0
DEAD_AFTER = 45.0
THRESHOLD = JANITOR_DEAD_AFTERS * DEAD_AFTER  # 450 virtual seconds


def deletes(outcome: str) -> float:
    value = REGISTRY.get_sample_value("lchat_mesh_janitor_deletes_total", {"outcome": outcome})
    assert value is not None
    return value


def beat_of(url: str, started_at: float = 1.0) -> bytes:
    # Signed as that member would (the boxes' token "t"): an unsigned body is no member.
    heartbeat = Heartbeat(url=url, region="", version="0.0.9", started_at=started_at)
    return HeartbeatKeys.of("t").sign(heartbeat).to_json()


class LateBeat:
    """A real store, except that just before the first DELETE of ``key`` it is forwarded,
    ``beat()`` runs (another box's PUT): the interleaving LIST -> that box beats -> our
    DELETE, made certain rather than hoped for."""

    def __init__(self, store: Any, key: str, beat: Callable[[], Awaitable[object]]) -> None:
        self._store = store
        self._key = key
        self._beat = beat
        self.beaten = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        if key == self._key and not self.beaten:
            self.beaten = True
            await self._beat()
        await self._store.delete(key, if_match=if_match)


class FailingDeletes:
    """A real store whose first ``times`` DELETEs fail as an unreachable store's would (typed
    :class:`StoreUnavailable`), without reaching it. Everything else is forwarded."""

    def __init__(self, store: Any, times: int) -> None:
        self._store = store
        self.left = times

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        if self.left > 0:
            self.left -= 1
            raise StoreUnavailable("injected: the store did not answer", key=key)
        await self._store.delete(key, if_match=if_match)


class LaggingList:
    """A real store whose LIST shows ``key`` ``lag`` seconds older than it is, as an eventually
    consistent LIST that has not caught up with the latest PUT would."""

    def __init__(self, store: Any, key: str, lag: float) -> None:
        self._store = store
        self._key = key
        self._lag = lag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        shift = datetime.timedelta(seconds=self._lag)
        return [
            evolve(i, last_modified=i.last_modified - shift) if i.key == self._key else i
            for i in await self._store.list(prefix)
        ]


class StaleKeysTests(TestCase):
    """The pure selection, no store."""

    def test_oldest_first_over_the_threshold_garbage_marked(self) -> None:
        now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
        prefix = members_prefix(HIB)

        def info(key: str, age: float) -> ObjectInfo:
            return ObjectInfo(key, 95, "e-" + key[-4:], now - datetime.timedelta(seconds=age))

        listed = [
            info(member_key(HIB, A), 10.0),
            info(member_key(HIB, B), 500.0),
            info(member_key(HIB, DEAD), 9000.0),
            info(prefix + "junk!", 600.0),
            info(prefix + "nested/" + encode_member_name(A), 700.0),
            info(member_key(HIB, "https://edge.example.net"), 450.0),  # not *older* than
        ]
        got = stale_keys(listed, now, prefix, older_than=450.0)
        self.assertEqual(
            [(k.url, k.age) for k in got],
            [(DEAD, 9000.0), (None, 700.0), (None, 600.0), (B, 500.0)],
        )
        self.assertEqual(got[0].etag, listed[2].etag)


if TYPE_CHECKING:
    _Mixin = TestCase
else:
    _Mixin = object  # not a TestCase itself, or trial would run the hook-less base


class Scenarios(_Mixin):
    """The janitor's promises, on a fresh bucket per test, every box with its own store."""

    timeout = 60

    def setUp(self) -> Any:
        self.clock = task.Clock()
        self.shifts: dict[str, float] = {}  # by ETag, shared by every box's view of the bucket
        self.events: list[LogEvent] = []
        observer = cast(ILogObserver, self.events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        return self.set_up_store()

    def set_up_store(self) -> Any:
        raise NotImplementedError

    def real_store(self) -> ObjectStore:
        """Another box's connection to this test's bucket, on real time."""
        raise NotImplementedError

    def bucket(self) -> ShiftedBucketClock:
        """Another box's connection to this test's bucket, on the shifted bucket clock."""
        return ShiftedBucketClock(self.real_store(), self.clock, self.shifts)

    @property
    def lines(self) -> list[str]:
        return [
            formatEvent(e) for e in self.events if e.get("log_namespace") == "lchat.mesh.membership"
        ]

    def janitor_lines(self) -> list[str]:
        return [line for line in self.lines if line.startswith("mesh: janitor ")]

    def box(self, url: str, store: Any = None) -> Membership:
        mesh = MeshConfig(
            self_url=url,
            domains=("example.com",),
            token="t",
            region="",
            heartbeat=HEARTBEAT,
            dead_after=DEAD_AFTER,
        )
        m = Membership(self.clock, store if store is not None else self.bucket(), HIB, mesh)
        self.addCleanup(lambda: m.stopService() if m.running else None)
        return m

    async def start(self, *boxes: Membership) -> None:
        for m in boxes:
            m.startService()  # beats at once
        await self.settle(*boxes, n=1)

    async def settle(self, *boxes: Membership, n: int) -> None:
        """Wait (real time) until every box has finished ``n`` beats, janitor step included."""
        await until(lambda: all(m.janitor_beats >= n for m in boxes), 15, f"{n} beats")

    async def advance_to(self, t: float, *boxes: Membership) -> None:
        """Move virtual time to ``t`` (a multiple of the heartbeat) and let each box beat once."""
        assert t % HEARTBEAT == 0 and t > self.clock.seconds(), t
        targets = [m.janitor_beats + 1 for m in boxes]
        self.clock.advance(t - self.clock.seconds())
        await until(
            lambda: all(m.janitor_beats >= n for m, n in zip(boxes, targets, strict=True)),
            15,
            f"the beat at {t:g}",
        )

    async def beat_until(self, t: float, *boxes: Membership) -> None:
        """:meth:`advance_to` one heartbeat at a time, up to ``t``."""
        while self.clock.seconds() < t:
            await self.advance_to(self.clock.seconds() + HEARTBEAT, *boxes)

    @property
    def outside(self) -> ShiftedBucketClock:
        """The test's own connection to the bucket (shifted clock), made once."""
        if getattr(self, "_outside", None) is None:
            self._outside = self.bucket()
        return self._outside

    async def exists(self, key: str) -> bool:
        try:
            await self.outside.head(key)
        except NotFound:
            return False
        return True

    async def test_a_dead_member_is_deleted_after_the_threshold_and_not_before(self) -> None:
        dead_key = member_key(HIB, DEAD)
        await self.outside.put(dead_key, beat_of(DEAD))  # its last beat, at virtual 0
        counting = Counting(self.bucket())
        a = self.box(A, counting)
        await self.start(a)
        self.assertEqual(a.janitor_after, THRESHOLD)
        before = deletes("deleted")

        # 435 s old: dead for long (and not in anybody's view), but not yet the janitor's.
        await self.advance_to(THRESHOLD - HEARTBEAT, a)
        self.assertTrue(await self.exists(dead_key))
        self.assertEqual(counting.count("delete"), 0)
        self.assertEqual(deletes("deleted"), before)
        self.assertEqual(self.janitor_lines(), [])

        # Over the threshold by more than any rounding: deleted at this beat.
        await self.advance_to(THRESHOLD + HEARTBEAT, a)
        self.assertFalse(await self.exists(dead_key))
        self.assertEqual(counting.count("delete"), 1)
        self.assertEqual(deletes("deleted"), before + 1)
        [line] = self.janitor_lines()
        self.assertTrue(
            line.startswith(f"mesh: janitor deleted the heartbeat of {DEAD}, dead for 7m "),
            line,
        )
        self.assertTrue(line.endswith(f"(key {dead_key})"), line)
        [event] = [e for e in self.events if "janitor deleted" in e.get("log_format", "")]
        self.assertGreater(event["age"], THRESHOLD)
        self.assertLess(event["age"], THRESHOLD + 2 * HEARTBEAT)
        # Our own heartbeat is untouched, and nothing more is deleted.
        self.assertTrue(await self.exists(a.key))
        await self.advance_to(THRESHOLD + 2 * HEARTBEAT, a)
        self.assertEqual(counting.count("delete"), 1)

    async def test_a_member_that_beats_again_before_the_delete_survives(self) -> None:
        dead_key = member_key(HIB, DEAD)
        await self.outside.put(dead_key, beat_of(DEAD, started_at=1.0))
        back = beat_of(DEAD, started_at=2.0)  # it came back: a new process, a new body

        async def comes_back() -> None:
            await self.outside.put(dead_key, back)

        late = LateBeat(self.bucket(), dead_key, comes_back)
        a = self.box(A, late)
        await self.start(a)
        changed, deleted = deletes("changed"), deletes("deleted")
        await self.advance_to(THRESHOLD + HEARTBEAT, a)
        self.assertTrue(late.beaten)  # the janitor did try, on the ETag it listed
        self.assertEqual(deletes("changed"), changed + 1)
        self.assertEqual(deletes("deleted"), deleted)
        self.assertEqual((await self.outside.get(dead_key)).body, back)
        self.assertEqual(
            self.janitor_lines(),
            [
                f"mesh: janitor left the heartbeat of {DEAD}: it changed since the listing (the "
                "box beat again, or a peer deleted it first)"
            ],
        )
        # At the next beat it is a live member again, and no longer the janitor's business.
        await self.advance_to(THRESHOLD + 2 * HEARTBEAT, a)
        self.assertEqual([m.url for m in a.members], [A, DEAD])
        self.assertEqual(deletes("changed"), changed + 1)
        self.assertTrue(await self.exists(dead_key))

    async def test_a_box_back_with_the_same_body_loses_one_beat_at_most(self) -> None:
        # The documented edge: a box silent for 450 s that did not restart writes the same body,
        # so the same ETag, and a DELETE racing its first beat back goes through. Its next beat
        # brings it back.
        dead_key = member_key(HIB, DEAD)
        body = beat_of(DEAD)
        await self.outside.put(dead_key, body)

        async def comes_back() -> None:
            await self.outside.put(dead_key, body)

        a = self.box(A, LateBeat(self.bucket(), dead_key, comes_back))
        await self.start(a)
        await self.advance_to(THRESHOLD + HEARTBEAT, a)
        self.assertFalse(await self.exists(dead_key))
        await self.outside.put(dead_key, body)  # its next beat
        await self.advance_to(THRESHOLD + 2 * HEARTBEAT, a)
        self.assertEqual([m.url for m in a.members], [A, DEAD])

    async def test_our_own_key_is_never_deleted(self) -> None:
        # Our LIST lags our PUTs by an hour: our own key looks older than anything. The janitor
        # skips it and deletes the genuinely dead key behind it.
        dead_key = member_key(HIB, DEAD)
        await self.outside.put(dead_key, beat_of(DEAD))
        counting = Counting(LaggingList(self.bucket(), member_key(HIB, A), 3600.0))
        a = self.box(A, counting)
        await self.start(a)
        await self.advance_to(THRESHOLD + HEARTBEAT, a)
        self.assertEqual(counting.count("delete"), 1)
        self.assertFalse(await self.exists(dead_key))
        for t in range(2, 5):
            await self.advance_to(THRESHOLD + t * HEARTBEAT, a)
        self.assertEqual(counting.count("delete"), 1)  # never our own
        self.assertTrue(await self.exists(a.key))
        self.assertEqual([m.url for m in a.members], [A])  # and we are still in our own view

    async def test_at_most_one_delete_per_beat_oldest_first(self) -> None:
        dead = [f"https://dead-{i}.example.net" for i in range(3)]
        a_store = Counting(self.bucket())
        a = self.box(A, a_store)
        await self.start(a)
        # Three crashes, 15 s apart: dead-2 first, dead-0 last.
        for i, url in enumerate(reversed(dead)):
            if i:
                await self.advance_to(i * HEARTBEAT, a)
            await self.outside.put(member_key(HIB, url), beat_of(url))
        first = THRESHOLD + 3 * HEARTBEAT  # all three over the threshold by then
        per_beat = []
        for n in range(4):
            before = a_store.count("delete")
            await self.advance_to(first + n * HEARTBEAT, a)
            per_beat.append(a_store.count("delete") - before)
        self.assertEqual(per_beat, [1, 1, 1, 0])
        self.assertEqual(
            [line.split(",")[0] for line in self.janitor_lines()],
            [f"mesh: janitor deleted the heartbeat of {url}" for url in reversed(dead)],
        )
        listed = await self.outside.list(members_prefix(HIB))
        self.assertEqual([i.key for i in listed], [a.key])

    async def test_a_failed_delete_is_soft_and_tried_again_next_beat(self) -> None:
        dead_key = member_key(HIB, DEAD)
        await self.outside.put(dead_key, beat_of(DEAD))
        failing = FailingDeletes(self.bucket(), times=2)
        a = self.box(A, failing)
        await self.start(a)
        failed, deleted = deletes("failed"), deletes("deleted")
        await self.advance_to(THRESHOLD + HEARTBEAT, a)
        await self.advance_to(THRESHOLD + 2 * HEARTBEAT, a)
        self.assertEqual(deletes("failed"), failed + 2)
        self.assertTrue(await self.exists(dead_key))
        # The beat itself went on: we are beating, and our view is whole.
        self.assertEqual([m.url for m in a.members], [A])
        self.assertEqual(a.beats, 3)
        await self.advance_to(THRESHOLD + 3 * HEARTBEAT, a)
        self.assertEqual(deletes("deleted"), deleted + 1)
        self.assertFalse(await self.exists(dead_key))
        lines = self.janitor_lines()
        self.assertEqual(len(lines), 3, lines)
        for line in lines[:2]:
            self.assertTrue(
                line.startswith(f"mesh: janitor could not delete the heartbeat of {DEAD}, dead ")
                and line.endswith(
                    "(StoreUnavailable: injected: the store did not answer (key "
                    f"'{dead_key}')); trying again at the next beat"
                ),
                line,
            )
        self.assertTrue(lines[2].startswith(f"mesh: janitor deleted the heartbeat of {DEAD}"))

    async def test_garbage_keys_are_left_and_logged_once(self) -> None:
        prefix = members_prefix(HIB)
        garbage = [
            prefix + "not base64!",
            prefix + "nested/" + encode_member_name(DEAD),
            prefix + encode_member_name("HTTPS://Box-Dead.example.net:443"),  # not normalised
        ]
        for key in garbage:
            await self.outside.put(key, b"{}")
        # A well-formed member key is judged by its name and age, never its body.
        bad_body = member_key(HIB, "https://bad-body.example.net")
        await self.outside.put(bad_body, b"\x00 not json")
        counting = Counting(self.bucket())
        a = self.box(A, counting)
        await self.start(a)
        for t in range(1, 5):
            await self.advance_to(THRESHOLD + t * HEARTBEAT, a)
        self.assertEqual(counting.count("delete"), 1)
        self.assertFalse(await self.exists(bad_body))
        for key in garbage:
            self.assertTrue(await self.exists(key), key)
            left = [line for line in self.janitor_lines() if repr(key) in line]
            self.assertEqual(len(left), 1, left)  # once, however many beats see it
            self.assertTrue(
                left[0].startswith(f"mesh: janitor leaves {key!r} under the members prefix")
                and left[0].endswith(
                    "ago): it is not a member key; delete it by hand if nobody needs it"
                ),
                left[0],
            )

    async def test_only_the_lowest_url_live_box_deletes(self) -> None:
        dead_key = member_key(HIB, DEAD)
        await self.outside.put(dead_key, beat_of(DEAD))
        a_store, b_store = Counting(self.bucket()), Counting(self.bucket())
        a, b = self.box(A, a_store), self.box(B, b_store)
        await self.start(a, b)
        await self.advance_to(HEARTBEAT, a, b)
        self.assertEqual([m.url for m in b.members], [A, B, DEAD])  # the crash is recent
        # Beat by beat, as boxes do: a jump past dead_after would lapse both boxes' liveness and
        # leave each one's view to the race between the other's PUT and its own LIST.
        await self.beat_until(THRESHOLD + HEARTBEAT, a, b)
        self.assertFalse(await self.exists(dead_key))
        # a, the lowest URL, deleted it. b may have tried once in a beat whose view lacked a (the
        # documented harmless case: its conditional DELETE is then refused), never more.
        self.assertEqual(a_store.count("delete"), 1)
        self.assertLessEqual(b_store.count("delete"), 1)
        b_before = b_store.count("delete")

        # a drains (its own delete: not the janitor's); b is now the lowest URL and takes over.
        await a.stopService()
        dead_2 = member_key(HIB, "https://box-dead-2.example.net")
        await self.outside.put(dead_2, beat_of("https://box-dead-2.example.net"))
        start = self.clock.seconds()
        await self.advance_to(start + HEARTBEAT, b)
        self.assertEqual(b.members[0].url, B)  # a is gone: b is the lowest URL now
        await self.beat_until(start + THRESHOLD + HEARTBEAT, b)
        self.assertFalse(await self.exists(dead_2))
        self.assertEqual(b_store.count("delete") - b_before, 1)  # its first phase's try aside


class FileStoreJanitorTests(Scenarios, TestCase):
    """On the file store (sub-second Last-Modified)."""

    def set_up_store(self) -> None:
        self.root = os.path.abspath(self.mktemp())
        os.makedirs(self.root)

    def real_store(self) -> ObjectStore:
        return FileStore(reactor, self.root, run_in_thread=thread_runner(reactor))


class MotoJanitorTests(Scenarios, TestCase):
    """Over real HTTP against moto's server: S3's conditional DELETE (If-Match), whole-second
    Last-Modified and Date."""

    def set_up_store(self) -> Deferred[None]:
        async def set_up() -> None:
            self.server = await s3servers.shared_server("moto")
            self.bucket_name = await self.server.new_bucket()

        return d(set_up())

    def real_store(self) -> ObjectStore:
        store = s3servers.store_for(self.server, self.bucket_name)
        self.addCleanup(lambda: d(store.close()))
        return store
