"""The token cache and the revocation feed (lchat.home.revocation) on a ``task.Clock``, over a
real SQLite store: a token is trusted for the rest of its UTC day, the cache is LRU-bounded, a
revocation published by one process is applied by another at its next poll (and a check racing
it cannot re-add the token), and a feed that cannot be read makes the cache stop answering.

The end-to-end proof (two home processes on one moto bucket) is in tests/test_home.py."""

from __future__ import annotations

import datetime
import os
from typing import Any, cast

from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.logger import globalLogPublisher
from twisted.trial import unittest

from lchat.home.revocation import STALE_PERIODS, RevocationFeed, TokenCache
from lchat.home.sqlite_store import SQLiteVaultStore
from lchat.reactors import installed
from lchat.threads import thread_runner

reactor = installed()

# 2026-12-02 23:59:00 UTC: a minute before a UTC day ends.
LATE = datetime.datetime(2026, 12, 2, 23, 59, tzinfo=datetime.UTC).timestamp()
PERIOD = 5.0


def digest(n: int) -> str:
    return f"{n:064x}"


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class TokenCacheTests(unittest.TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(LATE)
        self.cache = TokenCache(self.clock.seconds, capacity=3)
        self.cache.trust_until(float("inf"))  # the feed's freshness is tested below

    def test_trusted_for_the_rest_of_its_utc_day(self) -> None:
        self.cache.put(digest(1), "uid", "device")
        self.clock.advance(59.9)  # 23:59:59.9
        self.assertEqual(self.cache.get(digest(1)), ("uid", "device"))
        expired = metric("lchat_home_token_cache_lookups_total", outcome="expired")
        self.clock.advance(0.1)  # 00:00:00 the next day: the first check of the day pays again
        self.assertIsNone(self.cache.get(digest(1)))
        self.assertEqual(
            metric("lchat_home_token_cache_lookups_total", outcome="expired"), expired + 1
        )
        self.assertEqual(len(self.cache), 0)
        self.cache.put(digest(1), "uid", "device")  # checked again: trusted the whole new day
        self.clock.advance(86399)
        self.assertEqual(self.cache.get(digest(1)), ("uid", "device"))

    def test_bounded_least_recently_used_first(self) -> None:
        evicted = metric("lchat_home_token_cache_evictions_total")
        for n in (1, 2, 3):
            self.cache.put(digest(n), f"uid{n}", "d")
        self.assertIsNotNone(self.cache.get(digest(1)))  # 1 is now the most recently used
        self.cache.put(digest(4), "uid4", "d")  # full: 2, the least recently used, goes
        self.assertEqual(len(self.cache), 3)
        self.assertIsNone(self.cache.get(digest(2)))
        for n in (1, 3, 4):
            self.assertEqual(self.cache.get(digest(n)), (f"uid{n}", "d"))
        self.assertEqual(metric("lchat_home_token_cache_evictions_total"), evicted + 1)

    def test_answers_only_while_the_feed_is_fresh(self) -> None:
        cache = TokenCache(self.clock.seconds)
        cache.put(digest(1), "uid", "d")
        self.assertIsNone(cache.get(digest(1)))  # no poll has succeeded yet
        cache.trust_until(self.clock.seconds() + 15)
        self.assertEqual(cache.get(digest(1)), ("uid", "d"))
        self.clock.advance(15)
        self.assertIsNone(cache.get(digest(1)))
        cache.trust_until(self.clock.seconds() + 15)
        self.assertEqual(cache.get(digest(1)), ("uid", "d"))  # kept, only not answered

    def test_a_revoked_token_is_never_cached_again(self) -> None:
        self.cache.put(digest(1), "uid", "d")
        self.cache.revoke(digest(1))
        self.assertIsNone(self.cache.get(digest(1)))
        # A check that read the user document before the revocation finishes after it.
        self.cache.put(digest(1), "uid", "d")
        self.assertIsNone(self.cache.get(digest(1)))


class FeedTests(unittest.TestCase):
    """Two "processes" (a cache and a feed each) on one SQLite file, polled by hand."""

    timeout = 60

    async def open_store(self, clock: Clock) -> SQLiteVaultStore:
        store = await SQLiteVaultStore.open(self.path, thread_runner(reactor), clock)
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))  # twice is fine
        return store

    def feed(self, store: SQLiteVaultStore) -> RevocationFeed:
        return RevocationFeed(store, TokenCache(self.clock.seconds), self.clock, PERIOD)

    def setUp(self) -> None:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        self.path = os.path.join(directory, "home.db")

    async def set_up(self) -> None:
        self.clock = Clock()
        self.clock.advance(LATE - 3600)
        self.store = await self.open_store(self.clock)

    async def test_a_revocation_reaches_the_other_process_at_its_next_poll(self) -> None:
        await self.set_up()
        a, b = self.feed(self.store), self.feed(await self.open_store(self.clock))
        await a.poll()
        await b.poll()
        for feed in (a, b):
            feed.cache.put(digest(1), "uid", "victim")
            feed.cache.put(digest(2), "uid", "other")
        await a.publish(digest(1), "uid", "victim")
        self.assertIsNone(a.cache.get(digest(1)))  # at once where it was revoked
        self.assertEqual(b.cache.get(digest(1)), ("uid", "victim"))  # until b polls
        self.clock.advance(PERIOD)
        await b.poll()
        self.assertIsNone(b.cache.get(digest(1)))
        self.assertEqual(b.cache.get(digest(2)), ("uid", "other"))
        # A check on b that read the user document before the revocation, finishing now:
        b.cache.put(digest(1), "uid", "victim")
        self.assertIsNone(b.cache.get(digest(1)))
        # A process started later learns every live marker at its first poll.
        c = self.feed(await self.open_store(self.clock))
        c.cache.put(digest(1), "uid", "victim")
        await c.poll()
        self.assertIsNone(c.cache.get(digest(1)))

    async def test_an_unreadable_feed_stops_the_cache_until_it_is_read(self) -> None:
        await self.set_up()
        events: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if "revocation feed" in str(event.get("log_format", "")):
                events.append(str(event["log_format"]))

        globalLogPublisher.addObserver(cast(Any, observe))
        self.addCleanup(globalLogPublisher.removeObserver, cast(Any, observe))
        feed = self.feed(self.store)
        await feed.poll()
        feed.cache.put(digest(1), "uid", "d")
        self.assertEqual(metric("lchat_home_revocation_feed_ok"), 1)
        await self.store.close()  # from now on every poll fails (StoreError)
        for _ in range(STALE_PERIODS - 1):
            self.clock.advance(PERIOD)
            await feed.poll()
            self.assertEqual(feed.cache.get(digest(1)), ("uid", "d"))  # within the window
        self.assertEqual(events, [])
        for _ in range(3):  # logged once, however many polls fail
            self.clock.advance(PERIOD)
            await feed.poll()
            self.assertIsNone(feed.cache.get(digest(1)))
        self.assertEqual(metric("lchat_home_revocation_feed_ok"), 0)
        self.assertEqual(len(events), 1, events)
        self.assertIn("not been readable", events[0])
        feed.store = await self.open_store(self.clock)  # the store answers again
        self.clock.advance(PERIOD)
        await feed.poll()
        self.assertEqual(feed.cache.get(digest(1)), ("uid", "d"))
        self.assertEqual(metric("lchat_home_revocation_feed_ok"), 1)
        self.assertEqual(len(events), 2, events)
        self.assertIn("readable again", events[1])

    async def test_a_marker_that_cannot_be_written_is_retried_at_each_poll(self) -> None:
        await self.set_up()
        other = self.feed(await self.open_store(self.clock))
        await other.poll()
        other.cache.put(digest(1), "uid", "victim")
        broken = await self.open_store(self.clock)
        await broken.close()
        feed = self.feed(broken)
        feed.cache.put(digest(1), "uid", "victim")
        await feed.publish(digest(1), "uid", "victim")  # the store fails: no exception
        self.assertIsNone(feed.cache.get(digest(1)))  # denied here at once all the same
        await other.poll()
        self.assertEqual(other.cache.get(digest(1)), ("uid", "victim"))  # no marker yet
        feed.store = self.store
        await feed.poll()  # writes the pending marker first
        await other.poll()
        self.assertIsNone(other.cache.get(digest(1)))

    async def test_started_it_polls_at_once_then_every_period(self) -> None:
        await self.set_up()
        feed = self.feed(self.store)
        ok = metric("lchat_home_revocation_polls_total", outcome="ok")

        async def polls(n: int) -> None:
            for _ in range(200):  # the store answers from a thread
                if metric("lchat_home_revocation_polls_total", outcome="ok") >= ok + n:
                    return
                await deferLater(reactor, 0.01)
            self.fail(f"no poll number {n}")

        feed.start()
        self.addCleanup(lambda: Deferred.fromCoroutine(feed.stop()))
        await polls(1)
        self.assertTrue(feed.cache.trusted)
        self.clock.advance(PERIOD - 0.1)
        self.assertEqual(metric("lchat_home_revocation_polls_total", outcome="ok"), ok + 1)
        self.clock.advance(0.1)
        await polls(2)
        await feed.stop()
        self.clock.advance(10 * PERIOD)
        await deferLater(reactor, 0.1)
        self.assertEqual(metric("lchat_home_revocation_polls_total", outcome="ok"), ok + 2)
