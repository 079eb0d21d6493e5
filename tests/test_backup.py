"""The fleet backup's parts: the layout, the choice of databases, and the service that keeps one
replicator per database — on real SQLite files, a real registry and real stores (FileStore for
speed, moto for a bucket that fails and recovers)."""

from __future__ import annotations

import datetime
import os
import sqlite3
import time
from typing import Any, cast

import attrs
from twisted.internet import reactor as _reactor
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from lchat import hosts
from lchat.backup import envfiles, layout, selection
from lchat.backup.layout import REGISTRY_NAME, Layout, catalogue
from lchat.backup.lock import ReplicaLock, lock_path
from lchat.backup.service import HELD_ELSEWHERE, Backup
from lchat.backup.unit import ROLE, UnitReplicator
from lchat.config import BackupConfig, ConfigError
from lchat.config.hibernate import EVERY_DB
from lchat.hibernation import localdb
from lchat.objstore import UTC, ObjectInfo
from lchat.objstore.file import FileStore
from lchat.registry import Registry, Route
from lchat.replica.db import PageFds, ReplicaDB
from lchat.replica.replicator import Replicator
from lchat.replica.restore import restore
from lchat.routesource import RouteSource
from lchat.threads import thread_runner
from lchat.units import Claims
from tests import s3servers
from tests.replicas import dump

reactor: Any = _reactor


def _info(key: str) -> ObjectInfo:
    return ObjectInfo(key, 10, "e", datetime.datetime(2026, 1, 1, tzinfo=UTC))


def _make_db(path: str, rows: int = 1) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT)")
    for i in range(rows):
        conn.execute("INSERT INTO t(v) VALUES (?)", (f"row {i}",))
    conn.close()


def replicating(service: Backup) -> dict[str, str]:
    """name -> path of every database with a replicator in ``service``."""
    return {n: db.chosen.path for n, db in service._dbs.items() if db.replicator is not None}


def _text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _write(path: str, value: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=10)
    conn.execute("INSERT INTO t(v) VALUES (?)", (value,))
    conn.close()


class LayoutTests(TestCase):
    def test_names_are_plain_file_names(self) -> None:
        for good in ("registry.db", "chat.example.com.db", "home_1.db", "a"):
            self.assertEqual(layout.check_name(good), good)
        for bad in (
            "",
            "../x.db",
            "a/b.db",
            ".hidden",
            "x.db-wal",
            "x.db-shm",
            "x.",
            "a b",
            "é.db",
        ):
            with self.assertRaises(layout.BadName, msg=bad) as caught:
                layout.check_name(bad)
            self.assertIn("not a database name", str(caught.exception))

    def test_keys(self) -> None:
        where = Layout("backup", "box1")
        self.assertEqual(where.replica_path("a.example.db"), "backup/box1/a.example.db")
        self.assertEqual(where.box_path(), "backup/box1/")
        self.assertEqual(where.probe_key(), "backup/.lchat/probe/box1")
        self.assertEqual(where.root(), "backup/")
        self.assertEqual(Layout("", "b").replica_path("x.db"), "b/x.db")
        self.assertEqual(Layout("", "b").root(), "")

    def test_catalogue_groups_by_name_and_box_and_skips_strays(self) -> None:
        listing = [
            _info("bk/box1/registry.db/0009/0000000000000001-0000000000000001.ltx"),
            _info("bk/box1/registry.db/0000/0000000000000002-0000000000000003.ltx"),
            _info("bk/box2/registry.db/0009/0000000000000001-0000000000000005.ltx"),
            _info("bk/box1/a.example.db/0009/0000000000000001-0000000000000001.ltx"),
            _info("bk/.lchat/probe/box1"),
            _info("bk/box1/a.example.db/lock.json"),
            _info("bk/box1/stray.txt"),
            _info("bk/box1/..bad/0009/0000000000000001-0000000000000001.ltx"),
            _info("other/box1/x.db/0009/0000000000000001-0000000000000001.ltx"),
        ]
        found = catalogue("bk", listing)
        self.assertEqual(
            [(s.name, s.box, s.txid, len(s.files)) for s in found],
            [
                ("a.example.db", "box1", 1, 1),
                ("registry.db", "box1", 3, 2),
                ("registry.db", "box2", 5, 1),
            ],
        )
        self.assertEqual(found[1].path, "bk/box1/registry.db")
        self.assertIsNotNone(found[1].last_snapshot)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class SelectionTests(TestCase):
    def setUp(self) -> None:
        self.data = os.path.abspath(self.mktemp())
        os.makedirs(self.data)
        self.registry = os.path.join(self.data, "registry.db")
        _make_db(self.registry)

    def route(self, host: str, **kw: Any) -> Route:
        return Route(host=host, kind=kw.pop("kind", "instance"), socket=f"/run/{host}.sock", **kw)

    def choice(
        self, routes: list[Route], patterns: tuple[str, ...] = (), claimed: Any = ()
    ) -> selection.Choice:
        paths = selection.candidates(routes, self.registry, self.data)
        present, extra = selection.scan(self.data, patterns, paths)
        return selection.choose(
            routes,
            registry=self.registry,
            data_dir=self.data,
            present=present,
            extra=extra,
            claimed=claimed,
        )

    def choose(self, routes: list[Route], patterns: tuple[str, ...] = (), claimed: Any = ()) -> Any:
        choice = self.choice(routes, patterns, claimed)
        return choice.chosen, choice.problems

    def test_the_default_is_every_top_level_database_but_never_a_stale_copy(self) -> None:
        """LCHAT_BACKUP_EXTRA's default (*.db): the box's own databases (home, push, cloud, a
        service's), never an instance's (the instance rule's, or the activator's), a removed
        space's leftover, a copy its row no longer names, or a copy moved aside."""
        stamp = "20260101T000000"
        names = [
            "on.example.db",  # an always-on instance: the instance rule's
            "hib.example.db",  # a hibernating instance: the activator's
            "gone.example.db",  # no row: a removed space's leftover cache
            "moved.example.db",  # its row's database is now in spaces/ (a relayout's leftover)
            "svc.example.db",  # a service row's own database: current
            "home.db",
            "push.db",
            "cloud.db",
            f"on.example.db.stale-{stamp}",
            f"hib.example.db.lease-lost-{stamp}",
        ]
        for name in names:
            _make_db(os.path.join(self.data, name))
        # (Not under spaces/: that directory would make the box an isolating one.)
        elsewhere = os.path.join(self.data, "moved", "moved.example.db")
        os.makedirs(os.path.dirname(elsewhere))
        _make_db(elsewhere)
        routes = [
            self.route("on.example"),
            self.route("hib.example", hibernate=True),
            self.route("moved.example", db_path=elsewhere),
            self.route("svc.example", kind="service"),
        ]
        for patterns in ((EVERY_DB,), (EVERY_DB, "*")):  # "*": the moved-aside copies too
            choice = self.choice(routes, patterns)
            self.assertEqual(choice.problems, [])
            self.assertEqual(
                {n: (c.why, c.host) for n, c in choice.chosen.items()},
                {
                    REGISTRY_NAME: ("registry", ""),
                    "on.example.db": ("instance", "on.example"),
                    "moved.example.db": ("instance", "moved.example"),
                    "svc.example.db": ("extra", ""),
                    "home.db": ("extra", ""),
                    "push.db": ("extra", ""),
                    "cloud.db": ("extra", ""),
                },
            )
            self.assertEqual(choice.chosen["moved.example.db"].path, elsewhere)
            skipped = {os.path.basename(p): why for p, why in choice.skipped.items()}
            self.assertIn("gone.example has no row here", skipped.pop("gone.example.db"))
            self.assertIn(f"its row's database is {elsewhere}", skipped.pop("moved.example.db"))
            for name in names[-2:] if "*" in patterns else ():
                self.assertIn("moved aside", skipped.pop(name))
            self.assertEqual(skipped, {}, patterns)

    def test_a_space_database_name_has_two_labels(self) -> None:
        self.assertEqual(selection.space_named("a.example.db"), "a.example")
        for name in ("home.db", "push.db", "registry.db", "a.example.db-wal", "A.example.db"):
            self.assertIsNone(selection.space_named(name), name)
        self.assertTrue(localdb.is_moved_aside("a.example.db.stale-20260101T000000-wal"))
        self.assertTrue(localdb.is_moved_aside("a.example.db.lease-lost-20260101T000000"))
        for name in ("a.example.db", ".stale-20260101T000000", "x.stale-2026.db"):
            self.assertFalse(localdb.is_moved_aside(name), name)

    def test_registry_always_on_instances_and_extras_never_a_hibernating_host(self) -> None:
        for name in ("on.example.db", "hib.example.db", "home.db", "notes.txt"):
            path = os.path.join(self.data, name)
            if name.endswith(".db"):
                _make_db(path)
            else:
                with open(path, "w") as f:
                    f.write("not a database")
        routes = [
            self.route("on.example"),
            self.route("hib.example", hibernate=True),
            self.route("new.example"),  # no database yet
            self.route("svc.example", kind="service"),
        ]
        chosen, problems = self.choose(routes, ("*.db", "*.txt", "*-wal"))
        self.assertEqual(problems, [])
        self.assertEqual(
            {n: (c.why, c.host) for n, c in chosen.items()},
            {
                REGISTRY_NAME: ("registry", ""),
                "on.example.db": ("instance", "on.example"),
                "home.db": ("extra", ""),
            },
            "a glob that matches a hibernating host's database must not choose it",
        )
        self.assertEqual(chosen["on.example.db"].path, hosts.db_path(self.data, "on.example"))

    def test_a_host_the_activator_holds_is_not_chosen(self) -> None:
        _make_db(os.path.join(self.data, "on.example.db"))
        chosen, _ = self.choose([self.route("on.example")], claimed={"on.example"})
        self.assertEqual(set(chosen), {REGISTRY_NAME})

    def test_two_databases_with_one_name_keep_the_first_and_say_so(self) -> None:
        os.mkdir(os.path.join(self.data, "sub"))
        _make_db(os.path.join(self.data, "home.db"))
        _make_db(os.path.join(self.data, "sub", "home.db"))
        _make_db(os.path.join(self.data, "sub", "registry.db"))
        chosen, problems = self.choose([], (EVERY_DB, "sub/*.db"))
        self.assertEqual(chosen["home.db"].path, os.path.join(self.data, "home.db"))
        self.assertEqual(len(problems), 2, problems)
        self.assertIn("has the same name home.db", problems[0])
        self.assertIn("cannot be named", problems[1])


class KeyPolicyTests(TestCase):
    """No LCHAT_BACKUP_KEY while space env files exist: refused unless LCHAT_BACKUP_ENV says
    unprotected (the router at start, lchat bootstrap's checks)."""

    def setUp(self) -> None:
        self.data = os.path.abspath(self.mktemp())
        os.makedirs(self.data)
        for name in ("router.env", "home.env", "notes.txt"):
            _text(os.path.join(self.data, name), "LCHAT_X=1\n")

    def test_only_space_env_files_count(self) -> None:
        self.assertEqual(envfiles.on_disk(self.data), [])
        self.assertEqual(envfiles.refuse_unprotected(self.data, key=b"", unprotected_ok=False), [])
        for host in ("a.example", "b.example"):
            _text(hosts.env_path(self.data, host), "LCHAT_ADMIN_TOKEN=x\n")
        _text(hosts.bot_env_path(self.data, "a.example"), "LCHAT_BOT_TOKEN=x\n")
        files = ["a.example-bot.env", "a.example.env", "b.example.env"]
        self.assertEqual(envfiles.on_disk(self.data), files)
        with self.assertRaises(ConfigError) as e:
            envfiles.refuse_unprotected(self.data, key=b"", unprotected_ok=False)
        for said in ("LCHAT_BACKUP_KEY", "LCHAT_BACKUP_ENV=unprotected", "3 env files"):
            self.assertIn(said, str(e.exception))
        self.assertEqual(
            envfiles.refuse_unprotected(self.data, key=b"", unprotected_ok=True), files
        )
        self.assertEqual(
            envfiles.refuse_unprotected(self.data, key=b"k" * 32, unprotected_ok=False), []
        )

    def test_bootstrap_says_it_as_the_router_would(self) -> None:
        from lchat.cli.bootstrap.probe import probe

        env_file = os.path.join(self.data, "router.env")
        settings = {
            "LCHAT_DATA_DIR": self.data,
            "LCHAT_RUN_DIR": self.data,
            "LCHAT_ACME_DIRECTORY": "off",
            "LCHAT_BACKUP_BUCKET": "file:" + os.path.join(self.data, "bucket"),
        }
        _text(env_file, "".join(f"{k}={v}\n" for k, v in settings.items()))
        self.assertEqual(probe(env_file, file_buckets=False)[1], [])
        _text(hosts.env_path(self.data, "a.example"), "LCHAT_ADMIN_TOKEN=x\n")
        _, left = probe(env_file, file_buckets=False)
        self.assertEqual(len(left), 1, left)
        self.assertIn("LCHAT_BACKUP_ENV=unprotected", left[0])
        with open(env_file, "a") as f:
            f.write("LCHAT_BACKUP_ENV=unprotected\n")
        ok, left = probe(env_file, file_buckets=False)
        self.assertEqual(left, [])
        self.assertIn(
            "LCHAT_BACKUP_ENV=unprotected: 1 env file(s) (space secrets) are NOT in the backup "
            "(no LCHAT_BACKUP_KEY)",
            ok,
        )


class UnprotectedReminderTests(TestCase):
    """Without the key (LCHAT_BACKUP_ENV=unprotected) the service says how many env files the
    backup does not hold: at its first scan, whenever the count changes, and daily (a Clock)."""

    def test_said_at_start_on_change_and_daily(self) -> None:
        from prometheus_client import REGISTRY
        from twisted.internet.task import Clock
        from twisted.logger import ILogObserver, globalLogPublisher

        from lchat.backup import service as service_module
        from tests.fakes import inline

        data = os.path.abspath(self.mktemp())
        os.makedirs(data)
        registry = Registry(os.path.join(data, "registry.db"), time.time)
        registry.migrate()
        clock = Clock()
        routes = RouteSource(clock, registry, registry.load(), run_in_thread=inline)
        cfg = BackupConfig(
            bucket="file:" + data,
            region="",
            prefix="bk",
            endpoint="",
            box="b",
            env_unprotected=True,
        )
        backup = Backup(
            clock,
            FileStore(clock, data, inline),
            cfg,
            routes,
            Claims(),
            registry=registry.path,
            data_dir=data,
            run_in_thread=inline,
        )
        said: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if "NOT backed up" in event.get("log_format", ""):
                said.append(f"{event['count']}: {event['files']}")

        observer = cast(ILogObserver, observe)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

        def count() -> None:
            self.successResultOf(Deferred.fromCoroutine(backup._count_unprotected()))

        _text(hosts.env_path(data, "a.example"), "x")
        count()
        self.assertEqual(said, ["1: a.example.env"])
        self.assertEqual(REGISTRY.get_sample_value("lchat_backup_unprotected_env_files"), 1.0)
        clock.advance(3600)
        count()
        self.assertEqual(len(said), 1, "unchanged within the day: said once")
        _text(hosts.env_path(data, "b.example"), "x")
        count()
        self.assertEqual(said[-1], "2: a.example.env, b.example.env")
        self.assertEqual(REGISTRY.get_sample_value("lchat_backup_unprotected_env_files"), 2.0)
        clock.advance(service_module.UNPROTECTED_REMINDER)
        count()
        self.assertEqual(len(said), 3, "a day later: said again")
        self.assertEqual(backup.status()["env_files"], {"sealed": False, "unprotected": 2})


class ScanKeepsLocksTests(TestCase):
    """Reading a header closes a descriptor, and POSIX then drops every lock this process holds on
    the file: a replicator's read transaction would vanish and the space's last close would delete
    the WAL under it (found by the flip test in tests/test_backup_box.py)."""

    CLOSE_AS_A_SPACE_DOES = (
        "import sqlite3, sys\n"
        "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "conn.execute(\"INSERT INTO t(v) VALUES ('from the space')\")\n"
        "conn.close()\n"
    )

    def wal_after_the_space_closes(self, scan_sees_it_open: bool) -> bool:
        data = os.path.abspath(self.mktemp())
        os.makedirs(data)
        path = os.path.join(data, "home.db")
        _make_db(path)
        replica = ReplicaDB(path)
        replica.open()  # holds its read transaction, as a running replicator does
        try:
            open_here = {path} if scan_sees_it_open else set()
            _, extra = selection.scan(data, ("*.db",), (), open_here)
            self.assertEqual(extra, [path])
            import subprocess
            import sys

            subprocess.run([sys.executable, "-c", self.CLOSE_AS_A_SPACE_DOES, path], check=True)
            return os.path.exists(path + "-wal")
        finally:
            replica.close()

    def test_a_database_open_here_is_only_stat_ed(self) -> None:
        self.assertTrue(self.wal_after_the_space_closes(scan_sees_it_open=True))

    def test_a_glob_never_opens_sidecars_or_another_name_of_a_database_open_here(self) -> None:
        data = os.path.abspath(self.mktemp())
        os.makedirs(data)
        path = os.path.join(data, "home.db")
        _make_db(path)
        os.link(path, os.path.join(data, "alias.db"))
        opened: list[str] = []
        real = selection.is_sqlite

        def spied(p: str) -> bool:
            opened.append(p)
            return real(p)

        self.patch(selection, "is_sqlite", spied)
        replica = ReplicaDB(path)
        replica.open()
        try:
            _, extra = selection.scan(data, ("*",), (), {path})
        finally:
            replica.close()
        self.assertEqual(extra, [path])
        self.assertEqual(opened, [], "a -wal/-shm or a hard link of an open database was opened")

    def test_page_descriptors_outlive_their_replicators(self) -> None:
        data = os.path.abspath(self.mktemp())
        os.makedirs(data)
        path = os.path.join(data, "registry.db")
        _make_db(path)
        fds = PageFds()
        first = ReplicaDB(path, page_fds=fds)
        first.open()
        first.close()
        second = ReplicaDB(path, page_fds=fds)
        second.open()
        second.close()
        self.assertEqual(len(fds), 1, "one descriptor per file, kept across replicators")
        fd = fds.fd(path)
        os.fstat(fd)  # still open after both closes
        os.replace(path, path + ".old")
        _make_db(path)  # a new file under the name: a new descriptor
        self.assertNotEqual(fds.fd(path), fd)
        os.unlink(path + ".old")
        fds.fd(path)  # the old file has no name left: its descriptor is closed now
        self.assertEqual(len(fds), 1)
        with self.assertRaises(OSError):
            os.fstat(fd)

    def test_why_reading_its_header_would_be_a_bug(self) -> None:
        self.assertFalse(
            self.wal_after_the_space_closes(scan_sees_it_open=False),
            "reading the header left the lock in place: the hazard this guards against is gone",
        )


class EnvFileSealTests(TestCase):
    PLACE = layout.Layout("bk", "box1")

    def test_sealed_for_one_place_name_and_key(self) -> None:
        key, other = b"k" * 32, b"o" * 32
        blob = envfiles.seal(self.PLACE, "a.example.env", b"LCHAT_ADMIN_TOKEN=secret\n", key, 7)
        self.assertNotIn(b"secret", blob)
        opened = envfiles.unseal(self.PLACE, "a.example.env", blob, key)
        self.assertEqual((opened.content, opened.generation), (b"LCHAT_ADMIN_TOKEN=secret\n", 7))
        for place, name, k in (
            (self.PLACE, "b.example.env", key),  # another file's
            (self.PLACE, "a.example.env", other),  # another key's
            (layout.Layout("bk", "box2"), "a.example.env", key),  # another box's
            (layout.Layout("other", "box1"), "a.example.env", key),  # another prefix's
        ):
            with self.assertRaises(envfiles.SealError) as e:
                envfiles.unseal(place, name, blob, k)
            self.assertIn("LCHAT_BACKUP_KEY", str(e.exception))
            self.assertIn("moved here", str(e.exception))
        with self.assertRaises(envfiles.SealError):
            envfiles.unseal(self.PLACE, "a.example.env", b"plain text", key)
        self.assertEqual(
            envfiles.key_for("bk/box1/", "a.example.env"), "bk/box1/.env/a.example.env"
        )
        with self.assertRaises(ValueError):
            envfiles.key_for("bk/box1/", "../x")
        with self.assertRaises(ValueError):
            envfiles.key_for("bk/box1/", envfiles.MANIFEST_NAME)  # no env file can take it

    def test_the_generation_is_authenticated_and_an_older_one_refused(self) -> None:
        key = b"k" * 32
        blob = envfiles.seal(self.PLACE, "a.example.env", b"X=1\n", key, 1000)
        # A header edited to claim a newer generation no longer opens.
        forged = blob.replace(envfiles._GEN.pack(1000), envfiles._GEN.pack(5000), 1)
        with self.assertRaises(envfiles.SealError) as e:
            envfiles.unseal(self.PLACE, "a.example.env", forged, key)
        self.assertIn("altered", str(e.exception))
        with self.assertRaises(envfiles.SealError) as e:
            envfiles.unseal(self.PLACE, "a.example.env", blob, key, not_before=1001)
        self.assertIn("rolled back", str(e.exception))
        self.assertEqual(
            envfiles.unseal(self.PLACE, "a.example.env", blob, key, not_before=1000).content,
            b"X=1\n",
        )

    def test_a_first_format_seal_opens_only_when_accepted(self) -> None:
        key = b"k" * 32
        nonce = b"n" * 12
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        old = envfiles.MAGIC_V1 + nonce + AESGCM(key).encrypt(nonce, b"X=1\n", b"a.example.env")
        with self.assertRaises(envfiles.SealError) as e:
            envfiles.unseal(self.PLACE, "a.example.env", old, key)
        self.assertIn("--accept-unpinned-env", str(e.exception))
        opened = envfiles.unseal(self.PLACE, "a.example.env", old, key, accept_legacy=True)
        self.assertEqual((opened.content, opened.legacy), (b"X=1\n", True))

    def test_the_manifest_is_bound_to_its_box(self) -> None:
        key = b"k" * 32
        manifest = envfiles.Manifest(9, {"a.example.env": 7})
        blob = envfiles.seal_manifest(self.PLACE, manifest, key)
        self.assertEqual(envfiles.unseal_manifest(self.PLACE, blob, key), manifest)
        with self.assertRaises(envfiles.SealError):
            envfiles.unseal_manifest(layout.Layout("bk", "box2"), blob, key)
        with self.assertRaises(envfiles.SealError):  # an env file is not a manifest
            envfiles.unseal_manifest(
                self.PLACE, envfiles.seal(self.PLACE, "a.example.env", b"{}", key, 9), key
            )


class _BackupFixture(TestCase):
    """Real files, a real registry, a FileStore bucket, the real reactor (no tests of its own)."""

    timeout = 60

    def setUp(self) -> None:
        self.root = os.path.abspath(self.mktemp())
        self.data = os.path.join(self.root, "data")
        os.makedirs(self.data)
        self.in_thread = thread_runner(reactor)
        self.registry_path = os.path.join(self.data, "registry.db")
        self.registry = Registry(self.registry_path, time.time)
        self.registry.migrate()
        self.routes = RouteSource(
            reactor,
            self.registry,
            self.registry.load(),
            run_in_thread=self.in_thread,
            poll_interval=3600,
        )
        self.claims = Claims()
        os.makedirs(os.path.join(self.root, "bucket"))  # the router's boot probe does this
        self.store = FileStore(
            reactor, os.path.join(self.root, "bucket"), self.in_thread, create=True
        )
        self.cfg = BackupConfig(
            bucket="file:" + os.path.join(self.root, "bucket"),
            region="",
            prefix="bk",
            endpoint="",
            box="box1",
            interval=0.2,
            extra=("home.db",),
            external_config=os.path.join(self.root, "litestream.yml"),  # absent: lists nothing
        )

    def backup(self, store: Any = None, **kw: Any) -> Backup:
        service = Backup(
            reactor,
            store or self.store,
            self.cfg,
            self.routes,
            self.claims,
            registry=self.registry_path,
            data_dir=self.data,
            run_in_thread=self.in_thread,
            **kw,
        )
        service.startService()
        self.addCleanup(lambda: service.stopService() if service.running else None)
        return service

    def add(self, host: str, hibernate: bool = False) -> str:
        db = hosts.db_path(self.data, host)
        _make_db(db)
        self.registry.insert(
            Route(host=host, kind="instance", socket=f"/tmp/{host}.sock", hibernate=hibernate)
        )
        return db

    async def until(self, what: Any, within: float = 15.0) -> None:
        deadline = time.monotonic() + within
        while not what():
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what}")
            await deferLater(reactor, 0.02, lambda: None)

    async def keys(self, name: str) -> list[str]:
        return [i.key for i in await self.store.list(f"bk/box1/{name}/")]

    async def restored(self, name: str) -> str:
        out = os.path.join(self.root, f"restored-{name}")
        await restore(
            self.store, f"bk/box1/{name}", out, overwrite=True, run_in_thread=self.in_thread
        )
        return dump(out)


class BackupServiceTests(_BackupFixture):
    """The service on the real reactor: real files, a real registry, a FileStore bucket."""

    async def test_backs_up_the_registry_instances_and_extras_and_ships_commits(self) -> None:
        on = self.add("on.example")
        self.add("hib.example", hibernate=True)
        _make_db(os.path.join(self.data, "home.db"))
        await self.routes.reload("test")
        service = self.backup()
        await self.until(lambda: len(replicating(service)) == 3)
        self.assertEqual(set(replicating(service)), {REGISTRY_NAME, "on.example.db", "home.db"})
        self.assertEqual(await self.keys("hib.example.db"), [], "a hibernating host is not ours")
        _write(on, "after start")
        await self.until(
            lambda: service.status()["databases"]["on.example.db"]["txid"] != f"{1:016x}"
        )
        await Deferred.fromCoroutine(service._dbs["on.example.db"].replicator.flush())  # type: ignore[union-attr]
        self.assertEqual(await self.restored("on.example.db"), dump(on))
        status = service.status()
        self.assertEqual(status["box"], "box1")
        entry = status["databases"]["on.example.db"]
        self.assertEqual(
            (entry["state"], entry["why"], entry["host"]), ("running", "instance", "on.example")
        )
        self.assertGreater(entry["requests"], 0)
        self.assertGreater(entry["bytes_up"], 0)

    async def test_a_database_an_external_litestream_lists_is_left_to_it(self) -> None:
        """LCHAT_BACKUP_CONFIG: an operator who runs Litestream for some databases (its config
        lists them) must not get a second replicator on them from the router: two on one
        database corrupt each other. Listed while backed up here: stopped; unlisted: taken up
        again; unreadable: the last list read stands."""
        on = self.add("on.example")
        home = os.path.join(self.data, "home.db")
        _make_db(home)
        await self.routes.reload("test")
        external = self.cfg.external_config
        _write_text(external, f"dbs:\n  - path: {home}\n    replicas:\n      - url: s3://x/h\n")
        service = self.backup()
        await self.until(lambda: len(replicating(service)) == 2)
        self.assertEqual(set(replicating(service)), {REGISTRY_NAME, "on.example.db"})
        self.assertEqual(await self.keys("home.db"), [])
        # Listed later (`{path: ...}` flow style): its replicator here stops.
        _write_text(external, f"dbs: [{{path: '{home}'}}, {{path: {on}}}]\n")
        await service.rescan()
        await self.until(lambda: set(replicating(service)) == {REGISTRY_NAME})
        # Unreadable (a directory in its place): what it listed last stays out.
        os.remove(external)
        os.mkdir(external)
        await service.rescan()
        await deferLater(reactor, 0.3, lambda: None)
        self.assertEqual(set(replicating(service)), {REGISTRY_NAME})
        # Gone (the operator stopped running it): the router backs them up again.
        os.rmdir(external)
        await service.rescan()
        await self.until(
            lambda: set(replicating(service)) == {REGISTRY_NAME, "on.example.db", "home.db"}
        )

    async def test_a_flip_to_hibernate_stops_the_replicator_after_a_final_sync(self) -> None:
        on = self.add("on.example")
        await self.routes.reload("test")
        service = self.backup()
        await self.until(lambda: "on.example.db" in replicating(service))
        _write(on, "the last write before the flip")
        self.registry.update("on.example", hibernate=True)
        await self.routes.reload("flip")
        await self.until(lambda: "on.example.db" not in service.status()["databases"])
        self.assertEqual(
            await self.restored("on.example.db"), dump(on), "the final sync shipped it"
        )
        before = await self.keys("on.example.db")
        _write(on, "the activator's now")
        await deferLater(reactor, 0.6, lambda: None)  # three intervals
        self.assertEqual(await self.keys("on.example.db"), before, "nothing written after the stop")
        await service.release("on.example", on)  # nothing to hand over: at once

    async def test_release_hands_over_even_while_the_replicator_starts(self) -> None:
        on = self.add("on.example")
        await self.routes.reload("test")
        gate: Deferred[None] = Deferred()

        class Gated(Replicator):
            async def start(self, *args: Any, **kwargs: Any) -> None:
                if self.db_path == on:
                    await gate  # a slow start: the hand-over arrives in the middle of it
                await super().start(*args, **kwargs)

        service = self.backup(
            replicator=lambda store, db, path: Gated(reactor, store, db, path, interval=0.2)
        )
        await self.until(lambda: "on.example.db" in service.status()["databases"])
        self.assertEqual(service.status()["databases"]["on.example.db"]["state"], "starting")
        # The activator claims the host first, then awaits the release (Lifecycle.wake's order).
        self.claims.claim("on.example")
        released = service.release("on.example", on)
        self.assertFalse(released.called, "the release waits for the start in progress")
        gate.callback(None)
        await released
        self.assertNotIn("on.example.db", replicating(service))
        before = await self.keys("on.example.db")
        _write(on, "the activator's")
        await service.rescan()
        await deferLater(reactor, 0.6, lambda: None)
        self.assertNotIn("on.example.db", service.status()["databases"], "claimed: not ours")
        self.assertEqual(await self.keys("on.example.db"), before)
        # The activator lets go (its stand-down ended, the flag is off): ours again.
        self.claims.release("on.example")
        await self.until(lambda: "on.example.db" in replicating(service))
        self.assertEqual(await self.restored("on.example.db"), dump(on))

    async def test_a_cancelled_hand_over_still_stops_the_start_in_progress(self) -> None:
        # A wake awaiting the hand-over may be cancelled (its budget, a flip back, the drain):
        # the stop it asked for must go on (found by review: it used to be abandoned, and the
        # next wake's hand-over then returned at once beside a running backup replicator).
        on = self.add("on.example")
        await self.routes.reload("test")
        gate: Deferred[None] = Deferred()

        class Gated(Replicator):
            async def start(self, *args: Any, **kwargs: Any) -> None:
                if self.db_path == on:
                    await gate
                await super().start(*args, **kwargs)

        service = self.backup(
            replicator=lambda store, db, path: Gated(reactor, store, db, path, interval=0.2)
        )
        await self.until(lambda: "on.example.db" in service.status()["databases"])
        self.claims.claim("on.example")
        waiting = service.release("on.example", on)
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        gate.callback(None)
        await self.until(lambda: "on.example.db" not in service.status()["databases"])
        self.assertNotIn("on.example.db", replicating(service))
        await service.release("on.example", on)  # the next wake's: nothing left to stop

    async def test_a_database_the_activator_took_is_never_ours_even_when_its_row_goes(
        self,
    ) -> None:
        # An awake hibernating space whose row is removed (lchat remove, a mesh tombstone) while
        # the activator still stands it down: LCHAT_BACKUP_EXTRA=*.db must not pick it up.
        self.cfg = attrs.evolve(self.cfg, extra=("*.db",))
        hib = self.add("hib.example", hibernate=True)
        await self.routes.reload("test")
        service = self.backup()
        self.claims.claim("hib.example")
        await service.release("hib.example", hib)
        self.registry.delete("hib.example")
        await self.routes.reload("removed")
        await service.rescan()
        self.assertNotIn("hib.example.db", service.status()["databases"])
        # Its stand-down ended: a removed space's leftover now, stale, never backed up either.
        self.claims.release("hib.example")
        await service.rescan()
        await service.rescan()
        self.assertNotIn("hib.example.db", service.status()["databases"])
        self.assertIn("has no row here", service.status()["skipped"][hib])

    async def test_a_bucket_that_fails_at_start_is_retried_until_it_works(self) -> None:
        server = await s3servers.shared_server("moto")
        bucket = "bk-missing-" + os.urandom(4).hex()
        store = s3servers.store_for(server, bucket)
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        service = self.backup(store)
        await self.until(
            lambda: service.status()["databases"].get(REGISTRY_NAME, {}).get("state") == "failed"
        )
        entry = service.status()["databases"][REGISTRY_NAME]
        self.assertIn("last_error", entry)
        await server.new_bucket(bucket)
        await self.until(lambda: REGISTRY_NAME in replicating(service), within=20)
        self.assertNotIn("retry_in", service.status()["databases"][REGISTRY_NAME])

    async def test_env_files_go_sealed_once_per_change_only_with_a_key(self) -> None:
        self.add("on.example")
        self.add("hib.example", hibernate=True)  # the activator's: its env file goes too
        _text(hosts.env_path(self.data, "hib.example"), "LCHAT_ADMIN_TOKEN=asleep\n")
        env = hosts.env_path(self.data, "on.example")
        _text(env, "LCHAT_ADMIN_TOKEN=first\n")
        await self.routes.reload("test")
        key = f"bk/box1/.env/{os.path.basename(env)}"
        service = self.backup()  # no LCHAT_BACKUP_KEY: not backed up
        await self.until(lambda: "on.example.db" in replicating(service))
        await service.rescan()
        self.assertEqual([i.key for i in await self.store.list("bk/box1/.env/")], [])
        await service.stopService()
        self.store = FileStore(reactor, os.path.join(self.root, "bucket"), self.in_thread)
        self.cfg = attrs.evolve(self.cfg, env_key=b"k" * 32)
        service = self.backup()
        await self.until(lambda: "on.example.db" in replicating(service))
        await service.rescan()
        asleep = await self.store.get("bk/box1/.env/hib.example.env")
        self.assertEqual(
            envfiles.unseal(service.layout, "hib.example.env", asleep.body, b"k" * 32).content,
            b"LCHAT_ADMIN_TOKEN=asleep\n",
        )
        first = await self.store.get(key)
        self.assertEqual(
            envfiles.unseal(service.layout, os.path.basename(env), first.body, b"k" * 32).content,
            b"LCHAT_ADMIN_TOKEN=first\n",
        )
        await service.rescan()
        self.assertEqual(
            (await self.store.head(key)).etag, first.info.etag, "unchanged: not re-sent"
        )
        _text(env, "LCHAT_ADMIN_TOKEN=second\n")
        await service.rescan()
        second = await self.store.get(key)
        self.assertEqual(
            envfiles.unseal(service.layout, os.path.basename(env), second.body, b"k" * 32).content,
            b"LCHAT_ADMIN_TOKEN=second\n",
        )
        # The manifest pins each file to its newest seal; a restart carries it forward.
        gens = {
            name: envfiles.unseal(service.layout, name, blob.body, b"k" * 32).generation
            for name, blob in (("hib.example.env", asleep), ("on.example.env", second))
        }
        first_gen = envfiles.unseal(service.layout, "on.example.env", first.body, b"k" * 32)
        self.assertGreater(gens["on.example.env"], first_gen.generation)
        manifest_key = envfiles.manifest_key("bk/box1/")
        manifest = envfiles.unseal_manifest(
            service.layout, (await self.store.get(manifest_key)).body, b"k" * 32
        )
        self.assertEqual(dict(manifest.files), gens)
        await service.stopService()
        service = self.backup()
        await self.until(lambda: "on.example.db" in replicating(service))
        await service.rescan()
        again = envfiles.unseal_manifest(
            service.layout, (await self.store.get(manifest_key)).body, b"k" * 32
        )
        self.assertGreater(again.generation, manifest.generation)
        for name, generation in gens.items():
            self.assertGreater(again.files[name], generation)  # re-sealed at the start

    async def test_stop_ships_everything_and_stops_every_replicator(self) -> None:
        on = self.add("on.example")
        await self.routes.reload("test")
        service = self.backup()
        await self.until(lambda: len(replicating(service)) == 2)
        _write(on, "at shutdown")
        await service.stopService()
        self.assertEqual(service.status()["databases"], {})
        store = FileStore(reactor, os.path.join(self.root, "bucket"), self.in_thread)
        self.store = store
        self.assertEqual(await self.restored("on.example.db"), dump(on))


class ReplicaLockTests(_BackupFixture):
    """One replicator per database, enforced by ``<data>/.backup/<name>.lock`` (lchat/backup/lock.py):
    the router's backup and ``lchat backup replicate`` (lchat/backup/unit.py) on real files, a real
    registry and a FileStore bucket."""

    def new_store(self) -> Any:
        """Another client of the same bucket (each process has its own; a service closes its)."""
        return FileStore(reactor, os.path.join(self.root, "bucket"), self.in_thread)

    def unit(self, db: str, **kw: Any) -> UnitReplicator:
        store = self.new_store()
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        return UnitReplicator(
            reactor,
            store,
            self.cfg,
            data_dir=self.data,
            db_path=db,
            name=os.path.basename(db),
            run_in_thread=self.in_thread,
            **kw,
        )

    def run_unit(self, unit: UnitReplicator) -> Deferred[bool]:
        running = Deferred.fromCoroutine(unit.run())

        def stop() -> Deferred[bool]:
            unit.stop()
            return running

        self.addCleanup(stop)
        return running

    async def test_lock_held_elsewhere_is_skipped(self) -> None:
        on = self.add("on.example")
        await self.routes.reload("test")
        elsewhere = ReplicaLock(lock_path(self.data, "on.example.db"), "a unit")
        self.assertTrue(elsewhere.acquire())
        self.addCleanup(elsewhere.release)
        service = self.backup()
        await self.until(
            lambda: (
                service.status()["databases"].get("on.example.db", {}).get("state")
                == HELD_ELSEWHERE
            )
        )
        entry = service.status()["databases"]["on.example.db"]
        self.assertEqual(entry["held_by"], f"{os.getpid()} a unit")
        self.assertNotIn("retry_in", entry, "held elsewhere is not a failure")
        await self.until(lambda: REGISTRY_NAME in replicating(service))  # the others start
        await service.rescan()
        self.assertEqual(await self.keys("on.example.db"), [], "never opened here")
        # Its holder lets go: the next rescan takes it.
        elsewhere.release()
        await service.rescan()
        await self.until(lambda: "on.example.db" in replicating(service))
        _write(on, "the router's again")
        await Deferred.fromCoroutine(service._dbs["on.example.db"].replicator.flush())  # type: ignore[union-attr]
        self.assertEqual(await self.restored("on.example.db"), dump(on))
        # The router holds it now: a second holder is refused.
        self.assertFalse(ReplicaLock(lock_path(self.data, "on.example.db"), "x").acquire())
        await service.stopService()
        self.assertTrue(elsewhere.acquire(), "released at the router's stop")

    async def test_the_unit_waits_for_the_router_and_takes_over_when_it_stops(self) -> None:
        on = self.add("on.example")
        await self.routes.reload("test")
        service = self.backup()
        await self.until(lambda: "on.example.db" in replicating(service))
        unit = self.unit(on)
        running = self.run_unit(unit)
        await deferLater(reactor, 0.6, lambda: None)
        self.assertEqual(unit.state, "waiting", "the router holds it")
        self.assertIsNone(unit.replicator)
        # The router stops (systemctl stop lchat-router): its final sync, then the lock is free.
        _write(on, "before the router stops")
        await service.stopService()
        await self.until(lambda: unit.state == "running", within=10)
        _write(on, "while the router is down")
        # A router that starts now finds the database held and leaves it alone.
        self.store = self.new_store()
        again = self.backup()
        await self.until(
            lambda: (
                again.status()["databases"].get("on.example.db", {}).get("state") == HELD_ELSEWHERE
            )
        )
        self.assertIn(ROLE, again.status()["databases"]["on.example.db"]["held_by"])
        # The unit stops (SIGTERM): a final sync, the lock released, the router's rescan takes it.
        _write(on, "the unit's last")
        unit.stop()
        self.assertTrue(await running)
        self.assertFalse(unit.lock.held)
        self.assertEqual(await self.restored("on.example.db"), dump(on))
        await again.rescan()
        await self.until(lambda: "on.example.db" in replicating(again))

    async def test_stop_while_waiting_ends_at_once_and_a_missing_database_is_waited_for(
        self,
    ) -> None:
        unit = self.unit(os.path.join(self.data, "home.db"))
        running = self.run_unit(unit)
        await deferLater(reactor, 0.3, lambda: None)
        self.assertEqual(unit.state, "waiting")
        self.assertFalse(unit.lock.held, "no lock taken for a database that is not there")
        _make_db(os.path.join(self.data, "home.db"))
        await self.until(lambda: unit.state == "running", within=10)
        self.assertTrue(await self.keys("home.db"))
        unit.stop()
        self.assertTrue(await running)
        waiting = ReplicaLock(lock_path(self.data, "home.db"), "x")
        self.assertTrue(waiting.acquire())
        second = self.unit(os.path.join(self.data, "home.db"))
        ended = self.run_unit(second)
        await deferLater(reactor, 0.3, lambda: None)
        second.stop()
        self.assertTrue(await ended, "nothing started: nothing left unsynced")
        self.assertTrue(waiting.held)
        waiting.release()


class ReplicaLockOnS3Tests(ReplicaLockTests):
    """The same hand-overs on a real S3 over HTTP (moto)."""

    async def _setup_s3(self) -> None:
        self.s3_server = await s3servers.shared_server("moto")
        self.s3_bucket = "bk-lock-" + os.urandom(4).hex()
        await self.s3_server.new_bucket(self.s3_bucket)
        self.store = self.new_store()

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        super().setUp()
        return Deferred.fromCoroutine(self._setup_s3())

    def new_store(self) -> Any:
        return s3servers.store_for(self.s3_server, self.s3_bucket)


class UnitBesideTheActivatorTests(_BackupFixture):
    """The activator replicates a hibernating space without the lock: the unit's own check."""

    async def test_a_hibernating_space_is_never_opened_by_the_unit(self) -> None:
        on = self.add("on.example")
        flag = [True]
        store = FileStore(reactor, os.path.join(self.root, "bucket"), self.in_thread)
        unit = UnitReplicator(
            reactor,
            store,
            self.cfg,
            data_dir=self.data,
            db_path=on,
            name="on.example.db",
            run_in_thread=self.in_thread,
            hibernating=lambda: flag[0],
        )
        running = Deferred.fromCoroutine(unit.run())
        await deferLater(reactor, 0.6, lambda: None)
        self.assertEqual((unit.state, unit.lock.held), ("waiting", False))
        self.assertEqual(await self.keys("on.example.db"), [])
        flag[0] = False  # `hibernate --off`: the space is the unit's again
        await self.until(lambda: unit.state == "running", within=10)
        unit.stop()
        self.assertTrue(await running)
        await store.close()
