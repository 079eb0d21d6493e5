"""``lchat_replica_lag_seconds`` is the age of the oldest commit not yet in the bucket, at scrape
time: it grows while an upload hangs on a frozen store (no event happens then at all), and while
the store refuses; it is 0 once everything is shipped.

The store is a real moto server, frozen with SIGSTOP; the replicator runs on a fake clock (its
disk work inline), so "30 s of freeze" costs no wall-clock time."""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from lchat.replica.replicator import Replicator
from tests import s3servers


def _inline(f: Any, *args: Any) -> Any:
    return maybeDeferred(f, *args)


class LagTests(TestCase):
    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.dir = tempfile.mkdtemp(prefix="lchat-lag-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.src = os.path.join(self.dir, "src.db")
        self.conn = sqlite3.connect(self.src, isolation_level=None)
        self.addCleanup(self.conn.close)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT)")
        self.server = await s3servers.start_server("moto")  # private: this test freezes it
        self.addCleanup(self.server.destroy)
        self.addCleanup(self.server.resume)
        bucket = await self.server.new_bucket()
        self.store = s3servers.store_for(self.server, bucket, timeout=120.0)
        self.addCleanup(self.store.close)
        self.clock = Clock()
        self.path = f"lag/{os.path.basename(self.dir)}"  # a label of its own in the registry
        self.rep = Replicator(
            self.clock, self.store, self.src, self.path, interval=1.0, run_in_thread=_inline
        )
        await Deferred.fromCoroutine(self.rep.start())
        self.addCleanup(lambda: Deferred.fromCoroutine(self.rep.stop()))

    def lag(self) -> float | None:
        return REGISTRY.get_sample_value("lchat_replica_lag_seconds", {"path": self.path})

    def advance(self, seconds: float, step: float = 0.1) -> None:
        for _ in range(round(seconds / step)):
            self.clock.advance(step)

    async def test_lag_grows_while_the_store_hangs(self) -> None:
        self.advance(2.0)
        self.assertEqual(self.lag(), 0.0, "everything committed so far is in the bucket")
        self.server.pause()
        self.conn.execute("INSERT INTO t(v) VALUES ('during the freeze')")
        self.advance(0.1)  # the watch notices the commit; its upload now hangs
        self.advance(30.0)
        lag = self.lag()
        assert lag is not None
        self.assertGreater(lag, 20.0)
        self.assertLessEqual(lag, 30.1)
        self.server.resume()
        await Deferred.fromCoroutine(self.rep.flush())
        self.assertEqual(self.lag(), 0.0)

    async def test_lag_counts_from_the_commit_not_from_the_upload(self) -> None:
        """A commit noticed while the next sync must wait out the gap is already lagging."""
        self.advance(2.0)
        self.conn.execute("INSERT INTO t(v) VALUES ('one')")
        await Deferred.fromCoroutine(self.rep.flush())  # a sync just ran: the gap starts now
        self.assertEqual(self.lag(), 0.0)
        self.conn.execute("INSERT INTO t(v) VALUES ('two')")
        self.clock.advance(0.1)  # noticed; its sync waits for the gap (0.85 s)
        self.clock.advance(0.5)
        lag = self.lag()
        assert lag is not None
        self.assertTrue(abs(lag - 0.5) < 0.01, lag)
        await Deferred.fromCoroutine(self.rep.flush())
        self.assertEqual(self.lag(), 0.0)
