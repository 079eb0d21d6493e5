"""Tests for lchat.registry: schema migrations, rows, validation, snapshots and live reloads."""

from __future__ import annotations

import os
import re
import sqlite3
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import attrs
from twisted.internet import defer, task
from twisted.internet.defer import Deferred
from twisted.trial import unittest

from lchat import registry
from lchat.reactors import installed
from lchat.registry import (
    SCHEMA_VERSION,
    DuplicateHost,
    Registry,
    RegistryError,
    Route,
    RouteTable,
    UnknownHost,
)
from lchat.router import LocalSocket, RequestHead, Router
from lchat.routesource import RouteSource
from lchat.threads import thread_runner

reactor = installed()

HOST = "chat-a.example.com"
SOCK = "/run/lchat/chat-a.example.com.sock"

# Columns each schema version has (v1 is the original router's table).
V1_COLUMNS = (
    "host",
    "kind",
    "socket",
    "status",
    "last_error",
    "version",
    "prev_version",
    "created_at",
    "updated_at",
)
V2_COLUMNS = (*V1_COLUMNS, "hibernate", "next_due", "replication")


def route(host: str = HOST, **kw: Any) -> Route:
    kw.setdefault("kind", "instance")
    kw.setdefault("socket", f"/run/lchat/{host}.sock")
    return Route(host=host, **kw)


def sync_run(f: Callable[[], Any]) -> Deferred[Any]:
    return defer.maybeDeferred(f)


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingRegistry(Registry):
    """A Registry that counts full loads (the expensive part of a reload)."""

    def __init__(self, path: str, clock: Callable[[], float]) -> None:
        super().__init__(path, clock)
        self.loads = 0

    def load(self) -> RouteTable:
        self.loads += 1
        return super().load()


class Base(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.path = os.path.join(self.dir, "registry.db")
        self.clock = FakeClock()

    def registry(self, migrate: bool = True) -> Registry:
        reg = Registry(self.path, self.clock)
        if migrate:
            reg.migrate()
        return reg

    def raw(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None)
        self.addCleanup(conn.close)
        return conn

    def user_version(self) -> int:
        conn = sqlite3.connect(self.path)
        try:
            return int(conn.execute("PRAGMA user_version").fetchone()[0])
        finally:
            conn.close()

    def columns(self) -> list[str]:
        conn = sqlite3.connect(self.path)
        try:
            return [row[1] for row in conn.execute("PRAGMA table_info(routes)")]
        finally:
            conn.close()

    def dump(self) -> list[tuple[Any, ...]]:
        """Every row, every column: to prove a refused write changed nothing."""
        conn = sqlite3.connect(self.path)
        try:
            return conn.execute("SELECT * FROM routes ORDER BY host").fetchall()
        finally:
            conn.close()


# --- migrations ----------------------------------------------------------------------------------


class Migrations(Base):
    def test_from_empty(self) -> None:
        self.assertFalse(os.path.exists(self.path))
        reg = self.registry(migrate=False)
        self.assertEqual(reg.migrate(), 0)
        self.assertEqual(self.user_version(), SCHEMA_VERSION)
        conn = self.raw()
        self.assertEqual(conn.execute("PRAGMA journal_mode").fetchone()[0], "wal")
        self.assertEqual(sorted(self.columns()), sorted(registry._COLUMNS))
        table = reg.load()
        self.assertEqual(len(table), 0)
        # Idempotent: a second migration finds the current version and changes nothing.
        self.assertEqual(reg.migrate(), SCHEMA_VERSION)
        self.assertEqual(self.user_version(), SCHEMA_VERSION)

    def test_load_before_migrate_refuses(self) -> None:
        reg = self.registry(migrate=False)
        with self.assertRaises(RegistryError) as e:
            reg.load()
        self.assertIn("schema version 0", str(e.exception))

    def build(self, version: int) -> sqlite3.Connection:
        """A database at ``version``, built by hand the way that lchat release left it."""
        conn = self.raw()
        for step in registry.MIGRATIONS[:version]:
            for statement in step:
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {version}")
        return conn

    def test_from_v1(self) -> None:
        conn = self.build(1)
        self.assertEqual(self.columns(), list(V1_COLUMNS))
        conn.execute(
            "INSERT INTO routes (host, kind, socket, status, last_error, version, prev_version,"
            " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (HOST, "instance", SOCK, "ready", "", "1.2.3", "1.2.2", 100, 200),
        )
        conn.execute(
            "INSERT INTO routes (host, socket) VALUES (?, ?)", ("svc.example.com", "/run/svc.sock")
        )
        conn.close()
        self.assertEqual(self.registry(migrate=False).migrate(), 1)
        self.assertEqual(self.user_version(), SCHEMA_VERSION)
        table = self.registry(migrate=False).load()
        self.assertEqual(
            table.get(HOST),
            Route(
                host=HOST,
                kind="instance",
                socket=SOCK,
                status="ready",
                version="1.2.3",
                prev_version="1.2.2",
                created_at=100,
                updated_at=200,
                # every later column at its default
                hibernate=False,
                next_due=0,
                replication="stream",
                db_path="",
                home_region="",
                provider="",
            ),
        )
        svc = table.get("svc.example.com")
        assert svc is not None
        self.assertEqual((svc.kind, svc.status), ("instance", "creating"))

    def test_from_previous_version(self) -> None:
        previous = SCHEMA_VERSION - 1
        self.assertGreaterEqual(previous, 2)
        conn = self.build(previous)
        if previous == 2:
            self.assertEqual(self.columns(), list(V2_COLUMNS))
        conn.execute(
            "INSERT INTO routes (host, kind, socket, status, version, created_at, updated_at,"
            " hibernate, next_due, replication) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (HOST, "instance", SOCK, "ready", "2.0.0", 10, 20, 1, 1_800_000_000, "daily"),
        )
        conn.execute(
            "INSERT INTO routes (host, kind, socket, status) VALUES (?, ?, ?, ?)",
            ("b.example.com", "service", "/run/b.sock", "failed"),
        )
        conn.close()
        reg = self.registry(migrate=False)
        self.assertEqual(reg.migrate(), previous)
        self.assertEqual(self.user_version(), SCHEMA_VERSION)
        self.assertEqual(sorted(self.columns()), sorted(registry._COLUMNS))
        row = reg.get(HOST)
        assert row is not None
        self.assertTrue(row.hibernate)
        self.assertEqual(row.next_due, 1_800_000_000)
        self.assertEqual(row.replication, "daily")
        self.assertEqual((row.version, row.created_at, row.updated_at), ("2.0.0", 10, 20))
        self.assertEqual((row.db_path, row.home_region, row.provider), ("", "", ""))
        other = reg.get("b.example.com")
        assert other is not None
        self.assertEqual((other.kind, other.status, other.hibernate), ("service", "failed", False))
        self.assertEqual(len(reg.load()), 2)

    def test_from_every_older_version(self) -> None:
        for version in range(SCHEMA_VERSION):
            if os.path.exists(self.path):
                os.remove(self.path)
            conn = self.build(version)
            if version:
                conn.execute("INSERT INTO routes (host, socket) VALUES (?, ?)", (HOST, SOCK))
            conn.close()
            reg = self.registry(migrate=False)
            self.assertEqual(reg.migrate(), version)
            self.assertEqual(len(reg.load()), 1 if version else 0)

    def test_newer_version_refuses_and_changes_nothing(self) -> None:
        conn = self.build(SCHEMA_VERSION)
        conn.execute("INSERT INTO routes (host, socket) VALUES (?, ?)", (HOST, SOCK))
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
        conn.close()
        before = self.dump()
        reg = self.registry(migrate=False)
        with self.assertRaises(RegistryError) as e:
            reg.migrate()
        self.assertIn("newer", str(e.exception))
        self.assertIn(self.path, str(e.exception))
        self.assertEqual(self.user_version(), SCHEMA_VERSION + 1)
        self.assertEqual(self.dump(), before)
        self.assertRaises(RegistryError, reg.load)

    def test_migrations_are_additive(self) -> None:
        """docs/design.md §10 invariant 5: after v1, a step only adds: columns with defaults, new tables,
        rows in new tables, triggers. Nothing is dropped, renamed or rewritten."""
        additive = re.compile(
            r"^(ALTER TABLE routes ADD COLUMN \w+ .*NOT NULL DEFAULT "
            r"|CREATE TABLE (?!routes\b)\w+ "
            r"|INSERT INTO registry_changes "
            r"|CREATE TRIGGER \w+ AFTER (INSERT|UPDATE|DELETE) ON routes\s)",
            re.S,
        )
        for step in registry.MIGRATIONS[1:]:
            for statement in step:
                self.assertRegex(statement, additive)
                self.assertNotRegex(statement.upper(), r"\b(DROP|RENAME)\b")

    def test_garbage_file(self) -> None:
        with open(self.path, "wb") as f:
            f.write(b"this is not a database" * 100)
        with self.assertRaises(RegistryError) as e:
            self.registry(migrate=False).migrate()
        self.assertIn(self.path, str(e.exception))
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b"this is not a database" * 100)

    def test_missing_directory(self) -> None:
        reg = Registry(os.path.join(self.dir, "nope", "registry.db"), clock=time.time)
        with self.assertRaises(RegistryError) as e:
            reg.migrate()
        self.assertIn("does not exist", str(e.exception))

    def test_nul_in_path(self) -> None:
        for path in (self.path + "\x00x", os.path.join(self.dir + "\x00", "r.db")):
            with self.assertRaises(RegistryError) as e:
                Registry(path, clock=time.time)
            self.assertIn("NUL", str(e.exception))
        self.assertEqual(os.listdir(self.dir), [])


# --- rows ----------------------------------------------------------------------------------------


class Rows(Base):
    def test_insert_get(self) -> None:
        reg = self.registry()
        inserted = reg.insert(route(version="1.0", home_region="fi"))
        now = int(self.clock.now)
        self.assertEqual((inserted.created_at, inserted.updated_at), (now, now))
        self.assertEqual(reg.get(HOST), inserted)
        self.assertIsNone(reg.get("other.example.com"))
        self.assertIsNone(reg.get("../x"))

    def test_insert_keeps_given_created_at(self) -> None:
        reg = self.registry()
        inserted = reg.insert(route(created_at=5))
        self.assertEqual((inserted.created_at, inserted.updated_at), (5, int(self.clock.now)))

    def test_insert_normalises_host(self) -> None:
        reg = self.registry()
        inserted = reg.insert(route("Chat-A.Example.COM.", socket=SOCK))
        self.assertEqual(inserted.host, HOST)
        self.assertIsNotNone(reg.get(HOST))
        self.assertIsNone(reg.get("Chat-A.Example.COM."))

    def test_duplicate(self) -> None:
        reg = self.registry()
        reg.insert(route())
        before = self.dump()
        self.clock.now += 60
        with self.assertRaises(DuplicateHost) as e:
            reg.insert(route(status="ready"))
        self.assertIn(HOST, str(e.exception))
        self.assertRaises(DuplicateHost, reg.insert, route("CHAT-A.example.com", socket=SOCK))
        self.assertEqual(self.dump(), before)

    def test_update(self) -> None:
        reg = self.registry()
        reg.insert(route())
        self.clock.now += 30
        updated = reg.update(
            HOST, version="2.0", prev_version="1.0", hibernate=True, replication="batched"
        )
        self.assertEqual(reg.get(HOST), updated)
        self.assertEqual(updated.version, "2.0")
        self.assertTrue(updated.hibernate)
        self.assertEqual(updated.updated_at, int(self.clock.now))
        self.assertEqual(updated.created_at, int(self.clock.now) - 30)

    def test_update_refusals_change_nothing(self) -> None:
        reg = self.registry()
        reg.insert(route())
        before = self.dump()
        for changes in (
            {"nonsense": 1},
            {"socket": "relative.sock"},
            {"socket": "/run/a\x00b.sock"},
            {"db_path": "../x.db"},
            {"db_path": "/data/a\x00b.db"},
            {"kind": "daemon"},
            {"status": "asleep"},
            {"replication": "hourly"},
            {"kind": "service", "hibernate": True},
            {"version": "1\x00"},
            {"prev_version": "1\x00"},
            {"provider": "x" * 5000},
        ):
            self.assertRaises(RegistryError, reg.update, HOST, **changes)
        self.assertEqual(self.dump(), before)

    def test_update_unknown_host(self) -> None:
        reg = self.registry()
        self.assertRaises(UnknownHost, reg.update, "nobody.example.com", status="ready")
        self.assertRaises(UnknownHost, reg.update, "../x", status="ready")

    def test_set_status(self) -> None:
        reg = self.registry()
        reg.insert(route())
        ready = reg.set_status(HOST, "ready")
        assert ready is not None
        self.assertTrue(ready.serveable)
        failed = reg.set_status(HOST, "failed", "boom " * 2000)
        assert failed is not None
        self.assertEqual(failed.status, "failed")
        self.assertEqual(len(failed.last_error), 4096)
        self.assertFalse(failed.serveable)
        self.assertIsNone(reg.set_status("gone.example.com", "ready"))
        self.assertRaises(RegistryError, reg.set_status, HOST, "bogus")

    def test_delete(self) -> None:
        reg = self.registry()
        reg.insert(route())
        self.assertTrue(reg.delete(HOST))
        self.assertFalse(reg.delete(HOST))
        self.assertFalse(reg.delete("../x"))
        self.assertIsNone(reg.get(HOST))

    def test_load_is_immutable(self) -> None:
        reg = self.registry()
        reg.insert(route())
        reg.insert(route("b.example.com", status="ready"))
        table = reg.load()
        self.assertIsInstance(table.routes, MappingProxyType)
        with self.assertRaises(TypeError):
            table.routes["x.example.com"] = route("x.example.com")  # type: ignore[index]
        with self.assertRaises(TypeError):
            del table.routes[HOST]  # type: ignore[attr-defined]
        with self.assertRaises(attrs.exceptions.FrozenInstanceError):
            table.routes = {}  # type: ignore[misc]
        row = table.get(HOST)
        assert row is not None
        with self.assertRaises(attrs.exceptions.FrozenInstanceError):
            row.status = "ready"  # type: ignore[misc]
        # A later write does not leak into an existing snapshot.
        reg.delete(HOST)
        self.assertIsNotNone(table.get(HOST))
        self.assertEqual(len(table), 2)
        self.assertEqual([r.host for r in table], ["b.example.com", HOST])
        self.assertEqual(table.count_by_status(), {"creating": 1, "ready": 1, "failed": 0})

    def test_changed_hosts(self) -> None:
        reg = self.registry()
        reg.insert(route("a.example.com"))
        reg.insert(route("b.example.com"))
        old = reg.load()
        reg.delete("a.example.com")
        reg.set_status("b.example.com", "ready")
        reg.insert(route("c.example.com"))
        reg.insert(route("d.example.com"))
        new = reg.load()
        reg.insert(route("e.example.com"))
        self.assertEqual(
            list(registry.changed_hosts(old, new)),
            ["a.example.com", "b.example.com", "c.example.com", "d.example.com"],
        )
        self.assertEqual(list(registry.changed_hosts(new, new)), [])

    def test_fingerprint_follows_writes_not_reads(self) -> None:
        reg = self.registry()
        first = reg.fingerprint()
        reg.load()
        reg.get(HOST)
        self.assertEqual(reg.fingerprint(), first)
        reg.insert(route())
        self.assertNotEqual(reg.fingerprint(), first)
        self.assertEqual(
            Registry(os.path.join(self.dir, "none.db"), clock=time.time).fingerprint(),
            (None, None, None),
        )


class Validation(Base):
    def setUp(self) -> None:
        super().setUp()
        self.reg = self.registry()
        self.reg.insert(route("keep.example.com"))

    def assert_refused(self, bad: Route, why: str = "") -> None:
        before = self.dump()
        with self.assertRaises(RegistryError) as e:
            self.reg.insert(bad)
        self.assertTrue(str(e.exception))
        if why:
            self.assertIn(why, str(e.exception))
        self.assertEqual(self.dump(), before)
        self.assertRaises(RegistryError, registry.validate, bad)

    def test_bad_kind_status_replication(self) -> None:
        self.assert_refused(route(kind="daemon"), "kind")
        self.assert_refused(route(status="asleep"), "status")
        self.assert_refused(route(replication="hourly"), "replication")
        self.assert_refused(route(kind="service", hibernate=True), "service")

    def test_socket(self) -> None:
        for sock in ("", "relative.sock", "./x.sock", "../x.sock", "/run/a\x00b.sock"):
            self.assert_refused(route(socket=sock), "socket")

    def test_db_path(self) -> None:
        for path in ("x.db", "../x.db", "/data/a\x00b.db"):
            self.assert_refused(route(db_path=path), "db_path")
        self.assertEqual(registry.validate(route(db_path="/data/x.db")).db_path, "/data/x.db")

    def test_hostile_hosts(self) -> None:
        for host in (
            "../x",
            "a/b",
            "a/b.example.com",
            "a\x00b.com",
            "a" * 300 + ".example.com",
            "x." + "y" * 64,
            "localhost",
            "127.0.0.1",
            "",
            "chat.example-bot",
        ):
            self.assert_refused(route(host, socket=SOCK))

    def test_text_fields(self) -> None:
        for name in ("version", "prev_version", "home_region", "provider", "last_error"):
            self.assert_refused(route(**{name: "a\x00b"}), name)
            self.assert_refused(route(**{name: "x" * 4097}), name)

    def test_valid(self) -> None:
        ok = registry.validate(route("Chat-A.example.com", socket=SOCK, kind="service"))
        self.assertEqual(ok.host, HOST)


# --- the router's live view ----------------------------------------------------------------------


class Source(Base):
    """RouteSource driven by a task.Clock and a synchronous 'thread'."""

    def setUp(self) -> None:
        super().setUp()
        self.reg = CountingRegistry(self.path, self.clock)
        self.reg.migrate()
        self.reg.insert(route("a.example.com", status="ready"))
        self.reactor = task.Clock()
        self.events: list[tuple[RouteTable, RouteTable]] = []

    def source(self, run: Callable[[Callable[[], Any]], Deferred[Any]] = sync_run) -> RouteSource:
        src = RouteSource(
            self.reactor, self.reg, self.reg.load(), run_in_thread=run, poll_interval=2.0
        )
        src.subscribe(lambda old, new: self.events.append((old, new)))
        src.startService()
        self.addCleanup(src.stopService)
        self.reg.loads = 0
        return src

    def test_poll_picks_up_a_write_by_another_registry(self) -> None:
        src = self.source()
        writer = Registry(self.path, clock=time.time)  # a second object, as the CLI would be
        writer.insert(route("b.example.com", status="ready"))
        self.assertIsNone(src.table.get("b.example.com"))
        self.reactor.advance(2.0)
        self.assertIsNotNone(src.table.get("b.example.com"))
        self.assertEqual(self.reg.loads, 1)
        [(old, new)] = self.events
        self.assertIsNone(old.get("b.example.com"))
        self.assertIsNotNone(new.get("b.example.com"))
        self.assertIs(new, src.table)
        # Updates and deletes travel the same way.
        writer.set_status("a.example.com", "failed", "crashed")
        writer.delete("b.example.com")
        self.reactor.advance(2.0)
        a = src.table.get("a.example.com")
        assert a is not None
        self.assertEqual((a.status, a.last_error), ("failed", "crashed"))
        self.assertIsNone(src.table.get("b.example.com"))
        self.assertEqual(len(self.events), 2)

    def test_every_write_moves_the_change_counter(self) -> None:
        # The counter is what catches a write that leaves size and mtime as they were.
        first = self.reg.fingerprint()[2]
        self.reg.set_status("a.example.com", "failed", "x")
        self.reg.set_status("a.example.com", "ready")
        self.reg.delete("a.example.com")
        self.assertEqual(self.reg.fingerprint()[2], first + 3)

    def test_no_change_no_reload(self) -> None:
        src = self.source()
        table = src.table
        for _ in range(5):
            self.reactor.advance(2.0)
        self.assertEqual(self.reg.loads, 0)
        self.assertIs(src.table, table)
        self.assertEqual(self.events, [])

    def test_reload_without_changes_does_not_notify(self) -> None:
        src = self.source()
        results: list[RouteTable] = []
        src.reload("test").addCallback(results.append)
        self.assertEqual(self.reg.loads, 1)
        self.assertEqual(len(results), 1)
        self.assertIs(results[0], src.table)
        self.assertEqual(self.events, [])

    def test_poll_interval_is_respected(self) -> None:
        src = self.source()
        Registry(self.path, clock=time.time).insert(route("b.example.com"))
        self.reactor.advance(1.9)
        self.assertIsNone(src.table.get("b.example.com"))
        self.reactor.advance(0.1)
        self.assertIsNotNone(src.table.get("b.example.com"))

    def test_reload_coalesces(self) -> None:
        pending: list[tuple[Callable[[], Any], Deferred[Any]]] = []

        def run(f: Callable[[], Any]) -> Deferred[Any]:
            d: Deferred[Any] = Deferred()
            pending.append((f, d))
            return d

        def finish_one() -> None:
            f, d = pending.pop(0)
            d.callback(f())

        src = self.source(run)
        results: list[RouteTable] = []
        src.reload("first").addCallback(results.append)
        self.assertEqual(len(pending), 1)
        # Two writes and two reload requests while the first load is in flight.
        Registry(self.path, clock=time.time).insert(route("b.example.com"))
        src.reload("second").addCallback(results.append)
        Registry(self.path, clock=time.time).insert(route("c.example.com"))
        src.reload("third").addCallback(results.append)
        self.assertEqual(len(pending), 1)
        # The poll does not pile on while a load runs.
        self.reactor.advance(2.0)
        self.assertEqual(len(pending), 1)

        finish_one()
        self.assertEqual(self.reg.loads, 1)
        self.assertEqual(len(results), 1)
        self.assertEqual(len(pending), 1, "exactly one more load follows")
        finish_one()
        self.assertEqual(self.reg.loads, 2)
        self.assertEqual(pending, [])
        self.assertEqual(len(results), 3)
        self.assertTrue(all(isinstance(t, RouteTable) for t in results))
        # The follow-up load saw every write made before it was asked for.
        self.assertIs(results[1], results[2])
        self.assertIsNotNone(results[2].get("c.example.com"))
        self.assertIs(src.table, results[2])
        # Idle again: a new request starts a load at once.
        src.reload("fourth")
        self.assertEqual(len(pending), 1)
        finish_one()
        self.assertEqual(self.reg.loads, 3)

    def test_failed_reload_keeps_table_garbage_file(self) -> None:
        src = self.source()
        router = Router(src)
        before = src.table
        self.assertEqual(
            router.route(RequestHead(b"GET", b"/", "a.example.com")),
            LocalSocket(host="a.example.com", path="/run/lchat/a.example.com.sock"),
        )
        for suffix in ("-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.remove(self.path + suffix)
        with open(self.path, "wb") as f:
            f.write(os.urandom(8192))
        results: list[RouteTable] = []
        src.reload("test").addCallback(results.append)
        self.assertEqual(results, [before])
        self.assertIs(src.table, before)
        # The poll notices the changed file, fails the same way, and keeps serving; while the
        # file stays as broken it is not re-read (nor logged) on every tick.
        loads = self.reg.loads
        self.reactor.advance(2.0)
        self.assertIs(src.table, before)
        self.assertEqual(self.events, [])
        self.assertEqual(self.reg.loads, loads + 1)
        for _ in range(5):
            self.reactor.advance(2.0)
        self.assertEqual(self.reg.loads, loads + 1)
        self.assertEqual(
            router.route(RequestHead(b"GET", b"/", "a.example.com")),
            LocalSocket(host="a.example.com", path="/run/lchat/a.example.com.sock"),
        )

    def test_failed_reload_keeps_table_dropped_table(self) -> None:
        src = self.source()
        before = src.table
        conn = self.raw()
        conn.execute("DROP TABLE routes")
        conn.close()
        self.reactor.advance(2.0)
        self.assertEqual(self.reg.loads, 1)
        self.assertIs(src.table, before)
        self.assertEqual(self.events, [])
        self.assertIsInstance(
            Router(src).route(RequestHead(b"GET", b"/", "a.example.com")), LocalSocket
        )
        # Once the file is good again the next change is picked up.
        os.remove(self.path)
        self.reg.migrate()
        Registry(self.path, clock=time.time).insert(route("z.example.com", status="ready"))
        self.reactor.advance(2.0)
        self.assertIsNotNone(src.table.get("z.example.com"))
        self.assertIsNone(src.table.get("a.example.com"))

    def test_failed_listener_does_not_stop_the_swap(self) -> None:
        src = self.source()
        seen: list[RouteTable] = []

        def broken(old: RouteTable, new: RouteTable) -> None:
            raise ZeroDivisionError("listener bug")

        src.subscribe(broken)
        src.subscribe(lambda old, new: seen.append(new))
        Registry(self.path, clock=time.time).insert(route("b.example.com"))
        self.reactor.advance(2.0)
        self.assertIsNotNone(src.table.get("b.example.com"))
        self.assertEqual(seen, [src.table])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)

    def test_stop_service_stops_polling(self) -> None:
        src = self.source()
        self.assertEqual(len(self.reactor.getDelayedCalls()), 1)
        src.stopService()
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        Registry(self.path, clock=time.time).insert(route("b.example.com"))
        self.reactor.advance(10.0)
        self.assertEqual(self.reg.loads, 0)


class SourceOnRealThreads(Base):
    """The default run_in_thread: the reactor's thread pool, on trial's real reactor."""

    def setUp(self) -> None:
        super().setUp()
        self.reg = Registry(self.path, clock=time.time)
        self.reg.migrate()

    def test_reload_in_a_thread(self) -> Deferred[None]:
        src = RouteSource(reactor, self.reg, self.reg.load(), run_in_thread=thread_runner(reactor))
        Registry(self.path, clock=time.time).insert(route("b.example.com", status="ready"))
        changes: list[tuple[RouteTable, RouteTable]] = []
        src.subscribe(lambda old, new: changes.append((old, new)))
        d = src.reload("test")

        def check(table: RouteTable) -> None:
            self.assertIs(table, src.table)
            self.assertIsNotNone(table.get("b.example.com"))
            self.assertEqual(len(changes), 1)

        return d.addCallback(check)

    def test_poll_in_a_thread(self) -> Deferred[None]:
        src = RouteSource(
            reactor,
            self.reg,
            self.reg.load(),
            poll_interval=0.05,
            run_in_thread=thread_runner(reactor),
        )
        swapped: Deferred[RouteTable] = Deferred()

        def listener(old: RouteTable, new: RouteTable) -> None:
            if not swapped.called:
                swapped.callback(new)

        src.subscribe(listener)
        src.startService()
        self.addCleanup(src.stopService)
        Registry(self.path, clock=time.time).insert(route("b.example.com", status="ready"))

        def check(table: RouteTable) -> None:
            self.assertIsNotNone(table.get("b.example.com"))

        return swapped.addCallback(check)
