"""Wake-free stats (lchat.spacestats, ``GET /stats/<host>``, ``lchat stats``).

On a mesh (``MeshStats*``): the answer of the box that holds or owns a space, or the bucket's,
never an empty local view — on three real routers and a moto bucket (the key promise on SeaweedFS
too), with the decision's logic on a real moto bucket and a fake clock (``MeshAnswerTests``).

Databases are written by the reference space's own store (:class:`lchat.space.store.Store`), or
by real ``lchat space`` processes under a real router (built as twistd builds it, in this
process, on a ``file:`` bucket), asked over its admin socket. Each read is checked to create and
change nothing (sha, size, mtime of the database and its ``-wal``/``-shm``; no new file) and,
under a router, to wake nothing (the activator's state, no lease in the bucket, no wake counted).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from types import MappingProxyType
from typing import Any, cast

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.logger import ILogObserver, LogEvent, LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import admin_client, spacestats
from lchat.cli.main import main as cli_main
from lchat.cli.stats import describe
from lchat.hibernation.localdb import MARKER_SUFFIX, local_state
from lchat.mesh.client import MeshCallError
from lchat.mesh.placement import in_scope, normalise_member_url
from lchat.objstore import ObjectInfo, open_store
from lchat.objstore.where import Where
from lchat.reactors import installed
from lchat.registry import Registry, Route, RouteTable
from lchat.replica.db import ReplicaDB
from lchat.replica.restore import restore
from lchat.routesource import RouteSource
from lchat.space import store as store_module
from lchat.space.store import Store
from lchat.spacestats import (
    Counts,
    LocalView,
    MeshStats,
    SpaceStats,
    StatsError,
    judge,
    read_database,
    stats_of,
)
from lchat.threads import thread_runner
from tests import meshnet, s3servers
from tests.fakes import inline
from tests.test_activator import ROOT, _bucket_keys, _Harness, metric
from tests.test_mesh import DOMAIN, Box, MeshTestCase, _members

reactor = installed()


def files_of(directory: str) -> dict[str, tuple[int, int, str]]:
    """Every file under ``directory``: (size, mtime_ns, sha256) — what "nothing changed" means.

    The digests are taken by another process: a descriptor this process opened and closed on a
    database would drop the locks its SQLite connections hold on it (the router's registry, a
    store left open), which is the very hazard lchat.spacestats avoids."""
    names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    if not names:
        return {}
    digests = subprocess.run(
        ["sha256sum", *names], cwd=directory, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    out = {}
    for name, line in zip(names, digests, strict=False):
        st = os.stat(os.path.join(directory, name))
        out[name] = (st.st_size, st.st_mtime_ns, line.split()[0])
    return out


async def write_space(db: str, posts: int = 0, scheduled: int = 0) -> None:
    """A database as the reference space leaves it: opened, written, closed (WAL folded in)."""
    store = await Store.open(reactor, db)
    for n in range(posts):
        await store.post("lobby", f"m{n}", 1000 + n)
    for n in range(scheduled):
        await store.schedule("lobby", f"s{n}", 2_000_000_000 + n)
    await store.close()


def route(host: str, **fields: Any) -> Route:
    return Route(host=host, kind="instance", socket=f"/run/{host}.sock", **fields)


class ReadDatabaseTests(TestCase):
    """:func:`read_database` on files the reference store wrote: the contract's answers, and the
    files exactly as they were."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="stats", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.db = os.path.join(self.dir, "s.example.db")

    def assertUntouched(self, before: dict[str, Any]) -> None:
        self.assertEqual(files_of(self.dir), before)

    async def test_a_fresh_space_is_not_set_up_and_has_nothing(self) -> None:
        await write_space(self.db)
        self.assertEqual(sorted(os.listdir(self.dir)), ["s.example.db"])  # no -wal: closed
        before = files_of(self.dir)
        self.assertEqual(read_database(self.db), Counts(False, 0, False))
        # Read-only and WAL-mode: a plain mode=ro open would have created a -wal and a -shm.
        self.assertUntouched(before)

    async def test_a_message_makes_it_set_up_with_content(self) -> None:
        await write_space(self.db, posts=2)
        before = files_of(self.dir)
        self.assertEqual(read_database(self.db), Counts(True, 0, True))
        self.assertUntouched(before)

    async def test_a_scheduled_message_alone_is_content(self) -> None:
        await write_space(self.db, scheduled=1)
        self.assertEqual(read_database(self.db), Counts(True, 0, True))

    async def test_a_running_space_is_read_under_its_writer(self) -> None:
        store = await Store.open(reactor, self.db)  # the space, running: it holds the WAL
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        self.assertEqual(read_database(self.db), Counts(False, 0, False))
        await store.post("lobby", "hi", 1000)
        self.assertTrue(os.path.exists(self.db + "-wal"))  # noqa: ASYNC240 (a stat)
        before = files_of(self.dir)
        self.assertEqual(read_database(self.db), Counts(True, 0, True))  # seen in the WAL
        # The database and its WAL are untouched. The -shm is SQLite's shared lock table: this
        # process's writer mapped it writable, SQLite shares one mapping per process, and the
        # read records its read mark there as every WAL reader must (out of process, or with
        # no writer here, it is not written at all: the crash test below).
        after = files_of(self.dir)
        for name in ("s.example.db", "s.example.db-wal"):
            self.assertEqual(after[name], before[name])
        self.assertEqual(sorted(after), sorted(before))

    def test_commits_left_in_a_crashed_writers_wal_are_seen(self) -> None:
        self._v1_schema()  # then the full reference schema, by a writer that dies uncleanly
        script = (
            "import os, sqlite3, sys; sys.path.insert(0, sys.argv[2])\n"
            "from lchat.space import store\n"
            "conn = store._connect(sys.argv[1])\n"
            "store._post(conn, 'lobby', 'x', 1, 1)\n"
            "os._exit(0)\n"
        )
        subprocess.run([sys.executable, "-c", script, self.db, ROOT], check=True)
        self.assertGreater(os.path.getsize(self.db + "-wal"), 0)
        before = files_of(self.dir)
        self.assertEqual(read_database(self.db), Counts(True, 0, True))
        self.assertUntouched(before)

    def test_a_wal_without_its_shm_is_refused_without_creating_one(self) -> None:
        self._v1_schema()
        script = (
            "import os, sqlite3, sys; sys.path.insert(0, sys.argv[2])\n"
            "from lchat.space import store\n"
            "conn = store._connect(sys.argv[1])\n"
            "store._post(conn, 'lobby', 'x', 1, 1)\n"
            "os._exit(0)\n"
        )
        subprocess.run([sys.executable, "-c", script, self.db, ROOT], check=True)
        os.unlink(self.db + "-shm")
        before = files_of(self.dir)
        with self.assertRaises(StatsError) as caught:
            read_database(self.db)
        self.assertEqual((caught.exception.code, caught.exception.reason), (409, "wal_without_shm"))
        self.assertUntouched(before)

    async def test_a_replicators_read_transaction_in_this_process_survives_the_read(self) -> None:
        # The router's replicator holds a read transaction on an awake space's database, in the
        # router's process. POSIX drops every lock a process holds on a file when any descriptor
        # of it closes: a raw open()/close() by the stats read would release that transaction.
        await write_space(self.db, posts=1)
        replica = ReplicaDB(self.db)
        await deferToThread(replica.open)
        self.addCleanup(replica.close)
        self.assertEqual(read_database(self.db), Counts(True, 0, True))
        # Another process writes and asks for a TRUNCATE checkpoint: the replicator's read
        # transaction must still pin the WAL (busy), else frames it has not shipped are gone.
        script = (
            "import sqlite3, sys\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=0.2)\n"
            "c.execute('INSERT INTO meta (key, value) VALUES (\\'k\\', 1)')\n"
            "print(c.execute('PRAGMA wal_checkpoint(TRUNCATE)').fetchone()[0])\n"
            "c.close()\n"
        )
        done = await deferToThread(
            subprocess.run,
            [sys.executable, "-c", script, self.db],
            capture_output=True,
            text=True,
            check=True,
        )
        self.assertEqual(done.stdout.strip(), "1", "the replicator's read lock was lost")
        self.assertGreater(os.path.getsize(self.db + "-wal"), 0)  # noqa: ASYNC240

    async def test_a_rollback_journal_beside_it_is_busy_not_read(self) -> None:
        await write_space(self.db, posts=1)
        with open(self.db + "-journal", "wb"):  # noqa: ASYNC230 (a writer outside WAL mode)
            pass
        before = files_of(self.dir)
        with self.assertRaises(StatsError) as caught:
            read_database(self.db)
        self.assertEqual((caught.exception.code, caught.exception.reason), (503, "busy"))
        self.assertUntouched(before)

    def test_a_database_without_the_view_has_no_contract(self) -> None:
        self._v1_schema()  # a reference database from before the view (or a space without one)
        with self.assertRaises(StatsError) as caught:
            read_database(self.db)
        self.assertEqual((caught.exception.code, caught.exception.reason), (409, "no_contract"))
        self.assertIn("docs/hibernation.md", caught.exception.message)

    def test_a_view_that_breaks_the_contract_is_refused(self) -> None:
        for view, why in (
            (
                "SELECT 1 AS setup_complete, 0 AS members, 1 AS has_content UNION ALL "
                "SELECT 1, 0, 1",
                "2 rows",
            ),
            ("SELECT 2 AS setup_complete, 0 AS members, 1 AS has_content", "0 or 1"),
            ("SELECT 1 AS setup_complete, 'many' AS members, 1 AS has_content", "a count"),
        ):
            self._with_view(view)
            with self.assertRaises(StatsError) as caught:
                read_database(self.db)
            self.assertEqual(caught.exception.reason, "bad_contract")
            self.assertIn(why, caught.exception.message)

    def test_a_slow_view_is_interrupted_within_its_budget(self) -> None:
        self._with_view(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
            "SELECT 0 AS setup_complete, (SELECT count(*) FROM n) AS members, 0 AS has_content"
        )
        started = time.monotonic()
        with self.assertRaises(StatsError) as caught:
            read_database(self.db, budget=0.2)
        self.assertEqual(caught.exception.reason, "unreadable")
        self.assertIn("took over", caught.exception.message)
        self.assertLess(time.monotonic() - started, 30)  # not forever (normally ~0.2 s)

    async def test_a_writer_that_starts_during_an_immutable_read_is_read_again_under_locks(
        self,
    ) -> None:
        await write_space(self.db)
        writer: list[sqlite3.Connection] = []

        def clock() -> float:
            # Called as the query starts (after the files were looked at): a space opens the
            # database and commits, as a wake racing the read would.
            if not writer:
                conn = store_module._connect(self.db)
                store_module._post(conn, "lobby", "raced", 1, 1)
                writer.append(conn)
            return time.monotonic()

        def close_writer() -> None:
            for conn in writer:
                conn.close()

        self.addCleanup(close_writer)
        self.assertEqual(read_database(self.db, clock=clock), Counts(True, 0, True))

    def _v1_schema(self) -> None:
        conn = sqlite3.connect(self.db, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        for statement in store_module.MIGRATIONS[0]:
            conn.execute(statement)
        conn.execute("PRAGMA user_version = 1")
        conn.close()

    def _with_view(self, select: str) -> None:
        if os.path.exists(self.db):
            os.unlink(self.db)
        self._v1_schema()
        conn = sqlite3.connect(self.db, isolation_level=None)
        conn.execute(f"CREATE VIEW lchat_stats AS {select}")
        conn.close()


class StatsOfTests(TestCase):
    """:func:`stats_of`: what the registry row and the data directory decide."""

    def setUp(self) -> None:
        self.data = tempfile.mkdtemp(prefix="stats", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.data, True)

    def refused(self, row: Route | None, host: str, state: str | None = None) -> StatsError:
        with self.assertRaises(StatsError) as caught:
            stats_of(row, host, self.data, state)
        return caught.exception

    def test_unknown_host(self) -> None:
        e = self.refused(None, "nobody.example")
        self.assertEqual((e.code, e.reason), (404, "unknown_host"))

    def test_a_service_row_is_refused(self) -> None:
        row = Route(host="svc.example", kind="service", socket="/run/svc.sock")
        e = self.refused(row, "svc.example")
        self.assertEqual((e.code, e.reason), (409, "service"))

    def test_an_always_on_space_without_its_database_is_an_error(self) -> None:
        e = self.refused(route("on.example", status="ready"), "on.example")
        self.assertEqual((e.code, e.reason), (404, "no_database"))
        self.assertIn(os.path.join(self.data, "on.example.db"), e.message)

    def test_a_never_woken_hibernating_space_answers_from_its_row(self) -> None:
        stats = stats_of(route("h.example", hibernate=True), "h.example", self.data, "asleep")
        self.assertEqual(
            stats.to_json(),
            {
                "host": "h.example",
                "setup_complete": False,
                "members": 0,
                "has_content": False,
                "source": "registry",
                "db": os.path.join(self.data, "h.example.db"),
                "hibernate": True,
                "state": "asleep",
            },
        )
        self.assertEqual(os.listdir(self.data), [])

    def test_a_hibernating_space_that_ran_here_before_is_not_never_woken(self) -> None:
        db = os.path.join(self.data, "h.example.db")
        row = route("h.example", hibernate=True)
        with open(db + ".lease-lost-20260101T000000", "wb"):
            pass
        e = self.refused(row, "h.example")
        self.assertEqual((e.code, e.reason), (409, "not_local"))
        self.assertIn("lease-lost", e.message)
        os.unlink(db + ".lease-lost-20260101T000000")
        with open(db + MARKER_SUFFIX, "w") as f:
            f.write("{}")
        self.assertEqual(self.refused(row, "h.example").reason, "not_local")

    async def test_a_lives_elsewhere_row_names_its_box_and_reads_no_local_file(self) -> None:
        # The copy left here from when it hibernated on this box is stale: never its answer.
        db = os.path.join(self.data, "away.example.db")
        await write_space(db, posts=1)
        before = files_of(self.data)
        row = route("away.example", status="ready", lives_at="https://box-b.example:8443")
        e = self.refused(row, "away.example")
        self.assertEqual((e.code, e.reason), (409, "elsewhere"))
        self.assertIn("runs always-on on https://box-b.example:8443", e.message)
        self.assertEqual(
            e.to_json("away.example"),
            {
                "host": "away.example",
                "error": e.message,
                "reason": "elsewhere",
                "lives_at": "https://box-b.example:8443",
            },
        )
        os.unlink(db)  # and without a local file: the same answer, not "no_database"
        self.assertEqual(self.refused(row, "away.example").reason, "elsewhere")
        self.assertNotIn("lives_at", self.refused(route("on.example"), "on.example").to_json("x"))
        self.assertEqual(sorted(files_of(self.data)), sorted(set(before) - {"away.example.db"}))

    def test_a_space_being_restored_is_asked_again(self) -> None:
        e = self.refused(route("h.example", hibernate=True), "h.example", "waking")
        self.assertEqual((e.code, e.reason), (409, "waking"))

    async def test_a_database_is_read_whichever_the_flag(self) -> None:
        await write_space(os.path.join(self.data, "on.example.db"), posts=1)
        stats = stats_of(route("on.example", status="ready"), "on.example", self.data)
        self.assertEqual((stats.source, stats.counts), ("database", Counts(True, 0, True)))
        self.assertNotIn("state", stats.to_json())


class RouterStatsTests(_Harness):
    """``GET /stats/<host>`` on a real router's admin socket, with real spaces."""

    def stats(self, host: str) -> Any:
        def ask() -> tuple[int, dict[str, Any]]:
            got = admin_client.request(self.cfg.admin_socket, "GET", f"/stats/{host}")
            return got.status, got.json()

        return deferToThread(ask)

    @inlineCallbacks
    def test_a_sleeping_space_is_read_without_waking_it(self):
        host = "sleepy.example"
        self.add_space(host)
        self.start(self.config(LCHAT_HIBERNATE_IDLE="60s"))
        yield self.request(host, "/api/rooms/r/messages", b"POST", b'{"body": "hello"}')
        yield self.activator.sleep(host, "test")
        db = os.path.join(self.data, f"{host}.db")
        marker = local_state(db).marker_txid
        self.assertIsNotNone(marker)
        before, bucket = files_of(self.data), sorted(_bucket_keys(self.bucket, host))
        wakes = metric("lchat_wakes_total", reason="admin", outcome="ok") + metric(
            "lchat_wakes_total", reason="request", outcome="ok"
        )
        code, body = yield self.stats(host)
        self.assertEqual(code, 200, body)
        self.assertEqual(
            body,
            {
                "host": host,
                "setup_complete": True,
                "members": 0,
                "has_content": True,
                "source": "database",
                "db": db,
                "hibernate": True,
                "state": "asleep",
            },
        )
        # Not woken: still asleep, no lease taken, nothing counted, nothing in the bucket moved.
        self.assertEqual(self.state(host), "asleep")
        self.assertFalse(self.lock_exists(host))
        self.assertEqual(
            metric("lchat_wakes_total", reason="admin", outcome="ok")
            + metric("lchat_wakes_total", reason="request", outcome="ok"),
            wakes,
        )
        self.assertEqual(sorted(_bucket_keys(self.bucket, host)), bucket)
        # Nothing on disk changed, so the clean-sleep marker still vouches for the file: the
        # next wake resumes the replica instead of shipping a snapshot.
        self.assertEqual(files_of(self.data), before)
        self.assertEqual(local_state(db).marker_txid, marker)

    @inlineCallbacks
    def test_an_awake_space_is_read_while_its_replicator_holds_it(self):
        host = "awake.example"
        self.add_space(host)
        self.start(self.config(LCHAT_HIBERNATE_IDLE="60s"))
        yield self.request(host, "/api/rooms/r/messages", b"POST", b'{"body": "1"}')
        self.assertEqual(self.state(host), "awake")
        code, body = yield self.stats(host)
        self.assertEqual((code, body["has_content"], body["state"]), (200, True, "awake"))
        # The space and its replication carry on: a write after the read reaches the bucket
        # through the same replicator, and the sleep flushes it all.
        yield self.request(host, "/api/rooms/r/messages", b"POST", b'{"body": "2"}')
        yield self.activator.sleep(host, "test")
        self.assertEqual(self.state(host), "asleep")
        out = os.path.join(self.dir, "awake.restored")
        yield Deferred.fromCoroutine(self._restore(host, out))
        conn = sqlite3.connect(f"file:{out}?mode=ro", uri=True)
        try:
            bodies = [r[0] for r in conn.execute("SELECT body FROM messages ORDER BY id")]
        finally:
            conn.close()
        self.assertEqual(bodies, ["1", "2"])

    async def _restore(self, host: str, out: str) -> None:
        store = open_store(
            reactor, Where(f"file:{self.bucket}"), thread_runner(reactor), monotonic=time.monotonic
        )
        try:
            await restore(store, host, out, run_in_thread=thread_runner(reactor))
        finally:
            await store.close()

    @inlineCallbacks
    def test_never_woken_unknown_service_and_missing_database(self):
        self.add_space("new.example")
        self.add_space("on.example", hibernate=False, status="ready")
        registry = Registry(self.config().registry, clock=time.time)
        registry.insert(Route(host="svc.example", kind="service", socket="/run/x.sock"))
        # systemd units: the router starts no always-on child, so on.example keeps no database.
        self.start(self.config(LCHAT_UNITS="systemd"))
        before = files_of(self.data)
        code, body = yield self.stats("new.example")
        self.assertEqual(code, 200, body)
        self.assertEqual(
            (body["source"], body["setup_complete"], body["members"], body["has_content"]),
            ("registry", False, 0, False),
        )
        self.assertEqual(self.state("new.example"), "asleep")
        self.assertFalse(self.lock_exists("new.example"))
        self.assertEqual(files_of(self.data), before)  # no database appeared
        for host, code_reason in (
            ("nobody.example", (404, "unknown_host")),
            ("svc.example", (409, "service")),
            ("on.example", (404, "no_database")),
        ):
            code, body = yield self.stats(host)
            self.assertEqual((code, body.get("reason")), code_reason, body)
            self.assertIn(host, body["error"])
        code, body = yield self.stats("bad..host")
        self.assertEqual((code, body.get("reason")), (400, "bad_host"))

    @inlineCallbacks
    def test_a_lives_elsewhere_row_is_answered_with_its_box(self):
        host = "away.example"
        registry = Registry(self.config().registry, clock=time.time)
        registry.migrate()
        registry.insert(
            Route(
                host=host,
                kind="instance",
                socket=f"/run/{host}.sock",
                status="ready",
                lives_at="https://box-b.example:8443",
            )
        )
        self.start(self.config(LCHAT_UNITS="systemd"))
        code, body = yield self.stats(host)
        self.assertEqual((code, body.get("reason")), (409, "elsewhere"), body)
        self.assertEqual(body["lives_at"], "https://box-b.example:8443")
        self.assertIn(f"`lchat stats {host}` on that box", body["error"])

    @inlineCallbacks
    def test_the_cli_asks_the_router(self):
        host = "cli.example"
        self.add_space(host)
        self.start(self.config(LCHAT_HIBERNATE_IDLE="60s"))
        yield self.request(host, "/api/rooms/r/messages", b"POST", b'{"body": "x"}')
        yield self.activator.sleep(host, "test")
        got = yield deferToThread(_lchat, "stats", host, "--json", "--env-file", self.env)
        self.assertEqual(got.returncode, 0, got.stderr)
        self.assertEqual(json.loads(got.stdout)["state"], "asleep")  # only the router knows
        self.assertTrue(json.loads(got.stdout)["has_content"])
        got = yield deferToThread(_lchat, "stats", host, "--env-file", self.env)
        self.assertIn("has content     yes", got.stdout)
        self.assertEqual(self.state(host), "asleep")
        got = yield deferToThread(_lchat, "stats", "nobody.example", "--env-file", self.env)
        self.assertEqual(got.returncode, 1)
        self.assertIn("nobody.example is not registered", got.stderr)


# -- on a mesh ------------------------------------------------------------------------------------


def _obj(key: str) -> ObjectInfo:
    return ObjectInfo(key, 1, "e", datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))


def _ltx(host: str, lo: int, hi: int, level: int = 0) -> ObjectInfo:
    return _obj(f"p/{host}/ltx/{level:04x}/{lo:016x}-{hi:016x}.ltx")


class JudgeTests(SynchronousTestCase):
    """:func:`judge`: which copy a mesh box answering for a sleeping space may trust."""

    H = "h.mesh.test"

    def test_an_empty_prefix_and_nothing_here_is_never_woken(self) -> None:
        self.assertEqual(judge(LocalView(False, None), []), ("never_woken", ""))

    def test_anything_under_the_prefix_is_not_never_woken(self) -> None:
        for listing in ([_ltx(self.H, 1, 1, 9)], [_obj(f"p/{self.H}/lock.json")]):
            verdict, why = judge(LocalView(False, None), listing)
            self.assertEqual(verdict, "not_local", listing)
        self.assertIn("a lease", why)

    def test_traces_of_an_earlier_run_here_are_not_never_woken(self) -> None:
        verdict, why = judge(LocalView(False, None, ("/d/h.db-lchat.json",)), [])
        self.assertEqual(verdict, "not_local")
        self.assertIn("h.db-lchat.json", why)

    def test_a_local_copy_is_read_only_when_a_wake_here_would_use_it(self) -> None:
        listing = [_ltx(self.H, 1, 5, 9), _ltx(self.H, 6, 7)]
        self.assertEqual(judge(LocalView(True, 7), listing)[0], "database")  # marker = newest
        self.assertEqual(judge(LocalView(True, 3), [])[0], "database")  # the bucket forgot
        self.assertEqual(judge(LocalView(True, None), [])[0], "database")  # all there is
        # Another box wrote it since; or a copy nobody vouches for beside a replica.
        verdict, why = judge(LocalView(True, 5), listing)
        self.assertEqual(verdict, "not_local")
        self.assertIn("txid 5", why)
        self.assertIn("txid 7", why)
        self.assertEqual(judge(LocalView(True, None), listing)[0], "not_local")
        self.assertEqual(
            judge(LocalView(True, None), [_obj(f"p/{self.H}/lock.json")])[0], "not_local"
        )


SELF = "https://a.example:8443"
PEER = "https://b.example:8443"


class MeshAnswerTests(TestCase):
    """:class:`SpaceStats` on a mesh box: a real moto bucket for the LIST, the peer's answer as
    the seam gives it (status and body, or an error), the timeouts on a fake clock."""

    H = f"h.{DOMAIN}"

    async def setUp(self) -> None:  # type: ignore[override]
        self.data = tempfile.mkdtemp(prefix="stats", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.data, True)
        self.server = await s3servers.shared_server("moto")
        self.store = s3servers.store_for(self.server, await self.server.new_bucket(), retries=0)
        self.addCleanup(self.store.close)
        self.asked: list[tuple[str, str]] = []
        self.answers: dict[str, Any] = {}  # peer -> (status, body), an exception, or a Deferred
        self.box = SELF  # what answering_box says
        self.clock = Clock()
        self.states: dict[str, str] = {}
        self.out_of_reach: set[str] = set()  # peers whose beats go unanswered

    def stats(self, *rows: Route, store: Any = None) -> SpaceStats:
        registry = Registry(os.path.join(self.data, "registry.db"), clock=time.time)
        table = RouteTable(routes=MappingProxyType({r.host: r for r in rows}))
        routes = RouteSource(reactor, registry, table, run_in_thread=inline)

        async def answering_box(route: Route) -> str:
            return self.box

        async def ask(peer: str, host: str) -> tuple[int, dict[str, Any]]:
            self.asked.append((peer, host))
            answer = self.answers[peer]
            if isinstance(answer, Exception):
                raise answer
            if isinstance(answer, Deferred):
                return await answer
            return answer

        seam = MeshStats(
            self_url=SELF,
            in_scope=lambda host: in_scope(host, (DOMAIN,)),
            answering_box=answering_box,
            ask=ask,
            store=store or self.store,
            replica=lambda host: f"p/{host}",
            clock=self.clock,
            unreachable=lambda url: url in self.out_of_reach,
        )
        return SpaceStats(routes, self.data, lambda h: self.states.get(h, "asleep"), seam)

    def row(self, host: str = H, **fields: Any) -> Route:
        return route(host, hibernate=True, status="ready", **fields)

    async def test_awake_here_is_read_here_asking_nobody(self) -> None:
        await write_space(os.path.join(self.data, f"{self.H}.db"), posts=1)
        self.states[self.H] = "awake"
        self.box = PEER
        code, body = await self.stats(self.row()).answer(self.H)
        self.assertEqual((code, body["source"], body["has_content"]), (200, "database", True))
        self.assertEqual(self.asked, [])

    async def test_a_peer_that_holds_or_owns_it_answers(self) -> None:
        self.box = PEER
        theirs = {
            "host": self.H,
            "setup_complete": True,
            "members": 2,
            "has_content": True,
            "source": "database",
            "db": "/elsewhere.db",
            "hibernate": True,
            "state": "awake",
            "box": PEER,
        }
        self.answers[PEER] = (200, theirs)
        before = metric("lchat_stats_answers_total", source="owner", outcome="ok")
        code, body = await self.stats(self.row()).answer(self.H)
        self.assertEqual(code, 200)
        self.assertEqual(body, {**theirs, "source": "owner", "owner_source": "database"})
        self.assertEqual(self.asked, [(PEER, self.H)])
        self.assertEqual(
            metric("lchat_stats_answers_total", source="owner", outcome="ok"), before + 1
        )
        # Its errors are passed on as they are, naming the box.
        self.answers[PEER] = (409, {"host": self.H, "error": "x", "reason": "not_local"})
        code, body = await self.stats(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"], body["box"]), (409, "not_local", PEER))

    async def test_no_answer_from_the_owner_is_an_error_never_never_woken(self) -> None:
        self.box = PEER
        self.answers[PEER] = MeshCallError(PEER, "connection refused")
        code, body = await self.stats(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"], body["box"]), (503, "owner_unreachable", PEER))
        self.assertNotIn("has_content", body)
        # A peer that never answers: the 5 s timeout, on the clock.
        self.answers[PEER] = Deferred()
        d = Deferred.fromCoroutine(self.stats(self.row()).answer(self.H))
        self.assertNoResult(d)
        self.clock.advance(spacestats.OWNER_TIMEOUT)
        code, body = self.successResultOf(d)
        self.assertEqual((code, body["reason"]), (503, "owner_unreachable"))
        # A peer whose beats go unanswered: at once, without asking it.
        self.out_of_reach.add(PEER)
        asked = len(self.asked)
        code, body = await self.stats(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"]), (503, "owner_unreachable"))
        self.assertIn("its beats go unanswered", body["error"])
        self.assertEqual(len(self.asked), asked)
        self.out_of_reach.clear()
        # An older lchat: 404 without a reason.
        self.answers[PEER] = (404, {"error": "not found"})
        code, body = await self.stats(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"]), (503, "peer_too_old"))
        # ...but a 404 of the stats endpoint itself (the row is not on that box) is its answer.
        self.answers[PEER] = (404, {"host": self.H, "error": "x", "reason": "unknown_host"})
        code, body = await self.stats(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"], body["box"]), (404, "unknown_host", PEER))

    async def test_an_unreachable_owner_is_warned_of_once_a_minute(self) -> None:
        events: list[LogEvent] = []
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

        def warnings() -> list[str]:
            return [
                formatEvent(e)
                for e in events
                if e.get("log_namespace") == "lchat.stats" and e["log_level"] == LogLevel.warn
            ]

        self.box = PEER
        self.answers[PEER] = MeshCallError(PEER, "connection refused")
        stats = self.stats(self.row())
        for _ in range(3):
            await stats.answer(self.H)
        self.assertEqual(len(warnings()), 1, warnings())
        self.assertIn(
            f"stats: {self.H} asked of its owner {PEER}: owner_unreachable", warnings()[0]
        )
        self.clock.advance(spacestats.WARN_EVERY)
        await stats.answer(self.H)
        self.assertEqual(len(warnings()), 2)

    async def test_answer_here_never_asks_a_peer(self) -> None:
        self.box = PEER
        code, body = await self.stats(self.row()).answer_here(self.H)
        self.assertEqual((code, body["source"], body["has_content"]), (200, "bucket", False))
        self.assertEqual(self.asked, [])

    async def test_this_box_answers_from_the_bucket_or_refuses(self) -> None:
        stats = self.stats(self.row())
        code, body = await stats.answer(self.H)
        self.assertEqual(code, 200, body)
        self.assertEqual(
            (body["source"], body["setup_complete"], body["members"], body["has_content"]),
            ("bucket", False, 0, False),
        )
        self.assertEqual(os.listdir(self.data), [])  # nothing written here
        # A replica in the bucket and no copy here: never a guess.
        await self.store.put(f"p/{self.H}/ltx/0009/{1:016x}-{3:016x}.ltx", b"x")
        code, body = await stats.answer(self.H)
        self.assertEqual((code, body["reason"]), (409, "not_local"), body)
        self.assertIn("txid 3", body["error"])
        # A local copy nobody vouches for, beside that replica: the same.
        await write_space(os.path.join(self.data, f"{self.H}.db"), posts=1)
        code, body = await stats.answer(self.H)
        self.assertEqual((code, body["reason"]), (409, "not_local"), body)

    async def test_a_local_copy_and_an_empty_bucket_is_read(self) -> None:
        await write_space(os.path.join(self.data, f"{self.H}.db"), posts=1)
        code, body = await self.stats(self.row()).answer(self.H)
        self.assertEqual((code, body["source"], body["has_content"]), (200, "database", True))

    async def test_a_bucket_out_of_reach_is_an_error(self) -> None:
        port = s3servers.free_ports(1)[0]
        # (A real S3 client, at a port nothing listens on.)
        nowhere = s3servers.store_for(
            self.server, "b", endpoint=f"http://127.0.0.1:{port}", retries=0, timeout=2.0
        )
        self.addCleanup(nowhere.close)
        code, body = await self.stats(self.row(), store=nowhere).answer(self.H)
        self.assertEqual((code, body["reason"]), (503, "bucket_unreachable"), body)

    async def test_rows_outside_the_mesh_answer_as_on_one_box(self) -> None:
        self.box = PEER
        code, body = await self.stats(self.row("h.elsewhere.example")).answer("h.elsewhere.example")
        self.assertEqual((code, body["source"]), (200, "registry"))
        self.assertEqual(self.asked, [])


def _stats_of(box: Box, host: str) -> tuple[int, dict[str, Any]]:
    """``GET /stats/<host>`` on ``box``'s admin socket."""
    code, body = box.admin_call("GET", f"/stats/{host}", timeout=30)
    answer: dict[str, Any] = json.loads(body)
    return code, answer


class MeshStatsTests(MeshTestCase):
    """The issue's report (issue 32, item 4), on three real routers: a non-owner said "not set
    up, no content, asleep" of a space awake and written on its owner."""

    @inlineCallbacks
    def test_a_non_owner_answers_the_owners_truth(self):
        """...and a space never woken anywhere is "never woken" on every box, from the bucket
        (the one answer a reaper may act on)."""
        host, never = f"s.{DOMAIN}", f"n.{DOMAIN}"
        boxes = self.boxes(3)
        for box in boxes:
            box.add_space(host)
            box.add_space(never)
        yield self.start(*boxes)
        status, body, _ = yield self.req(
            boxes[0], host, "/api/rooms/r/messages", "POST", b'{"body": "hi"}'
        )
        self.assertEqual(status, 201, body)
        owner = next(b for b in boxes if b.awake(host))
        owner_url = normalise_member_url(owner.url)
        for box in boxes:
            if box is owner:
                code, answer = yield deferToThread(_stats_of, owner, host)
                self.assertEqual((code, answer["source"]), (200, "database"), answer)
                self.assertNotIn("box", answer)
            else:
                got = yield deferToThread(
                    _lchat, "stats", host, "--json", "--env-file", box.env_file
                )
                self.assertEqual(got.returncode, 0, got.stderr + box.log()[-3000:])
                answer = json.loads(got.stdout)
            self.assertEqual(
                (answer["has_content"], answer["setup_complete"], answer["state"]),
                (True, True, "awake"),
                answer,
            )
            if box is not owner:
                self.assertEqual((answer["box"], answer["source"]), (owner_url, "owner"))
        for box in boxes:
            code, answer = yield deferToThread(_stats_of, box, never)
            self.assertEqual(code, 200, answer)
            self.assertEqual(
                (answer["setup_complete"], answer["members"], answer["has_content"]),
                (False, 0, False),
            )
            # Answered by the box that owns it, from the bucket (asked by the others).
            self.assertEqual(answer.get("owner_source", answer["source"]), "bucket", answer)
        self.assertFalse(any(b.awake(never) for b in boxes))  # nothing woken


class SeaweedFSMeshStatsTests(MeshStatsTests):
    """The same on SeaweedFS."""

    skip = None if meshnet.weed_available() else "SeaweedFS's weed is not installed"

    async def _bucket(self) -> None:
        self.server = await s3servers.shared_server("seaweedfs")
        self.bucket = await self.server.new_bucket()


class MeshStatsErrorsTests(MeshTestCase):
    """What a mesh box answers when the owner cannot, and when its own copy is stale (moto)."""

    @inlineCallbacks
    def test_an_unreachable_owner_is_an_error_never_never_woken(self):
        host = f"u.{DOMAIN}"
        _boxes, owner, others = yield self.one_space(host, message="hi")
        assert owner.proc is not None
        owner.proc.send_signal(signal.SIGSTOP)
        try:
            code, answer = yield deferToThread(_stats_of, others[0], host)
            self.assertEqual((code, answer.get("reason")), (503, "owner_unreachable"), answer)
            self.assertEqual(answer["box"], normalise_member_url(owner.url))
            self.assertNotIn("has_content", answer)
            # Once it has left the view, the box that now answers for it knows only that the
            # bucket holds it: still an error, never "never woken".
            yield self.wait_for(lambda: _members(others[1]) == 2, timeout=20)
            for box in others:
                code, answer = yield deferToThread(_stats_of, box, host)
                self.assertNotEqual(code, 200, answer)
                self.assertNotIn("has_content", answer)
        finally:
            owner.proc.send_signal(signal.SIGCONT)

    @inlineCallbacks
    def test_a_stale_local_copy_is_not_answered(self):
        """A box holds a cleanly slept copy (read, no content); the space is written elsewhere
        while it is away. Back, it answers what the other box wrote, never its own copy."""
        host = f"st.{DOMAIN}"
        boxes = self.boxes(2)
        for box in boxes:
            box.add_space(host)
        yield self.start(*boxes)
        status, body, _ = yield self.req(boxes[0], host)  # a GET: woken on its owner, no content
        self.assertEqual(status, 200, body)
        a = next(b for b in boxes if b.awake(host))
        b = next(b for b in boxes if b is not a)
        yield deferToThread(a.admin_call, "POST", f"/sleep?host={host}", 30)
        yield deferToThread(a.stop, signal.SIGTERM)
        self.assertTrue(os.path.exists(os.path.join(a.data, f"{host}.db")))
        status, body, _ = yield self.req(b, host, "/api/rooms/r/messages", "POST", b'{"body":"x"}')
        self.assertEqual(status, 201, body)
        a.start(a.settings)  # type: ignore[attr-defined]
        yield self.wait_for(lambda: _members(a) == 2 and _members(b) == 2, timeout=20)
        code, answer = yield deferToThread(_stats_of, a, host)
        self.assertEqual((code, answer["has_content"], answer["source"]), (200, True, "owner"))
        self.assertEqual(answer["box"], normalise_member_url(b.url))
        # Slept there too. While b's beats still say it holds the space, b may answer (from its
        # copy, the newest); then a, which owns it by the hash, answers: its own copy is older
        # than the bucket's, so it says it does not know. Never the stale copy's numbers.
        yield deferToThread(b.admin_call, "POST", f"/sleep?host={host}", 30)

        def settled() -> bool:
            answers = [_stats_of(box, host) for box in (a, b)]
            for code, answer in answers:
                assert code == 409 or answer["has_content"] is True, answer
            return all(code == 409 and answer["reason"] == "not_local" for code, answer in answers)

        yield self.wait_for(settled, timeout=10)


class CliWithoutRouterTests(TestCase):
    """``lchat stats`` on a box whose router is not running reads the files itself."""

    def box(self) -> tuple[str, str, Registry]:
        """A box's data directory, env file and registry, and no router."""
        root = tempfile.mkdtemp(prefix="stats", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        data, run = os.path.join(root, "d"), os.path.join(root, "r")
        os.mkdir(data)
        env = os.path.join(root, "router.env")
        with open(env, "w") as f:
            f.write(f"LCHAT_DATA_DIR={data}\nLCHAT_RUN_DIR={run}\n")
        registry = Registry(os.path.join(data, "registry.db"), clock=time.time)
        registry.migrate()
        return data, env, registry

    async def test_reads_the_database_and_the_registry_itself(self) -> None:
        data, env, registry = self.box()
        registry.insert(route("a.example", hibernate=True, status="ready"))
        registry.insert(route("b.example", hibernate=True, status="ready"))
        await write_space(os.path.join(data, "a.example.db"), posts=1)
        before = files_of(data)
        got = await deferToThread(_lchat, "stats", "a.example", "--json", "--env-file", env)
        self.assertEqual(got.returncode, 0, got.stderr)
        self.assertIn("no router answers", got.stderr)
        answer = json.loads(got.stdout)
        self.assertEqual((answer["source"], answer["has_content"]), ("database", True))
        self.assertEqual(answer["state"], "asleep")  # no router: nothing can be awake
        got = await deferToThread(_lchat, "stats", "b.example", "--json", "--env-file", env)
        self.assertEqual(json.loads(got.stdout)["source"], "registry")
        after = files_of(data)  # (the CLI opens the registry as every command does)
        self.assertEqual(after["a.example.db"], before["a.example.db"])
        self.assertEqual(sorted(after), sorted(before))

    async def test_a_lives_elsewhere_row_says_which_box_to_ask(self) -> None:
        data, env, registry = self.box()
        registry.insert(route("away.example", status="ready", lives_at="https://b.example:8443"))
        await write_space(os.path.join(data, "away.example.db"), posts=1)  # stale, from before
        got = await deferToThread(_lchat, "stats", "away.example", "--env-file", env)
        self.assertEqual(got.returncode, 1, got.stdout)
        self.assertEqual(got.stdout, "")  # no numbers at all, not the stale copy's
        self.assertIn(
            "lchat: error: away.example runs always-on on https://b.example:8443", got.stderr
        )
        self.assertIn("`lchat stats away.example` on that box", got.stderr)
        got = await deferToThread(_lchat, "stats", "away.example", "--json", "--env-file", env)
        answer = json.loads(got.stdout)
        self.assertEqual(
            (answer["reason"], answer["lives_at"]), ("elsewhere", "https://b.example:8443")
        )

    def test_help_lists_the_command(self) -> None:
        self.assertEqual(cli_main(["stats", "--help"]), 0)

    def test_the_lines_say_where_a_mesh_answer_came_from(self) -> None:
        base = {"host": "h", "hibernate": True, "setup_complete": True, "members": 1}
        owner = describe({**base, "source": "owner", "box": PEER, "owner_source": "database"})
        self.assertIn(f"from {PEER}, which holds or owns it (database)", owner[0])
        bucket = describe({**base, "source": "bucket"})
        self.assertIn("from the bucket: it has never woken on any box of the mesh", bucket[0])

    async def test_mesh_box_without_router_refuses(self) -> None:
        _data, env, registry = self.box()
        _append(
            env,
            "LCHAT_HIBERNATE_BUCKET=file:/tmp/nowhere\nLCHAT_MESH_SELF=https://a.example:8443\n"
            f"LCHAT_MESH_DOMAINS={DOMAIN}\nLCHAT_MESH_TOKEN={'t' * 32}\n",
        )
        registry.insert(route(f"h.{DOMAIN}", hibernate=True, status="ready"))
        registry.insert(route("b.example", hibernate=True, status="ready"))
        got = await deferToThread(_lchat, "stats", f"h.{DOMAIN}", "--json", "--env-file", env)
        self.assertEqual(got.returncode, 1, got.stdout)
        self.assertEqual(json.loads(got.stdout)["reason"], "no_router_mesh")
        self.assertIn("is a mesh space and no router answers here", got.stderr)
        # Outside the mesh's domains, the files here are still the truth.
        got = await deferToThread(_lchat, "stats", "b.example", "--json", "--env-file", env)
        self.assertEqual((got.returncode, json.loads(got.stdout)["source"]), (0, "registry"))


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}


def _lchat(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from lchat.cli.main import run; run()", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**_clean_env(), "PYTHONPATH": ROOT},
        timeout=60,
    )


_ = spacestats  # the module under test, named for readers
