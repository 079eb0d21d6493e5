"""lchat.relayout: an existing box's flat space files moved into each space's own directory and
its registry rows rewritten, on real files, real chowns (as root) and a real registry."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import stat
import tempfile
import time

from twisted.trial.unittest import SynchronousTestCase

from lchat import hosts, isolation, relayout
from lchat.hibernation import localdb
from lchat.registry import Registry, Route

UIDS = (45000, 45099)
A = "a.example.com"
B = "b.example.com"


class Box(SynchronousTestCase):
    """A box from before isolation: flat databases, rows naming them."""

    def setUp(self) -> None:
        if os.geteuid() != 0:
            self.skipTest("needs root (a moved database is chowned to its space's uid)")
        self.top = tempfile.mkdtemp()
        os.chmod(self.top, 0o711)
        self.addCleanup(shutil.rmtree, self.top)
        self.data = os.path.join(self.top, "data")
        self.rundir = os.path.join(self.top, "run")
        os.mkdir(self.data, 0o750)
        os.mkdir(self.rundir, 0o755)
        self.registry = Registry(os.path.join(self.data, "registry.db"), time.time)
        self.registry.migrate()
        with open(os.path.join(self.data, "router.env"), "w") as f:
            f.write("LCHAT_MESH_TOKEN=secret\n")

    def flat(self, host: str, suffix: str = ".db") -> str:
        return os.path.join(self.data, host + suffix)

    def new(self, host: str, suffix: str = ".db") -> str:
        return os.path.join(self.data, "spaces", host, host + suffix)

    def add(self, host: str, *, db_path: str | None = None, **fields: object) -> None:
        self.registry.insert(
            Route(
                host=host,
                kind="instance",
                socket=hosts.socket_path(self.rundir, host),
                db_path=self.flat(host) if db_path is None else db_path,
                status="ready",
                **fields,  # type: ignore[arg-type]
            )
        )

    def database(self, path: str, rows: int = 3) -> None:
        """A WAL database with ``rows`` rows, left with its -wal and -shm (as a space leaves it
        when killed)."""
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("CREATE TABLE t (n INTEGER)")
        conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(rows)])
        conn.commit()
        # Not closed cleanly: a close checkpoints and removes the WAL; the file is copied instead.
        copy = path + ".copy"
        for suffix in ("", "-wal", "-shm"):
            shutil.copyfile(path + suffix, copy + suffix)
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            os.replace(copy + suffix, path + suffix)

    def run_it(self, *, dry_run: bool = False) -> list[str]:
        return relayout.relayout(self.data, self.rundir, UIDS, self.registry, dry_run=dry_run)

    def tree(self) -> dict[str, tuple[int, int, int, bytes | str | None]]:
        """Every entry under the box (the registry's files aside: reading rows touches its
        shared memory): mode, owner, group and contents."""
        found: dict[str, tuple[int, int, int, bytes | str | None]] = {}
        for base in (self.data, self.rundir):
            for directory, dirs, names in os.walk(base):
                for name in [*dirs, *names]:
                    path = os.path.join(directory, name)
                    if name.startswith("registry.db"):
                        continue
                    st = os.lstat(path)
                    body: bytes | str | None = None
                    if stat.S_ISLNK(st.st_mode):
                        body = os.readlink(path)
                    elif stat.S_ISREG(st.st_mode):
                        with open(path, "rb") as f:
                            body = f.read()
                    found[path] = (st.st_mode, st.st_uid, st.st_gid, body)
            st = os.lstat(base)
            found[base] = (st.st_mode, st.st_uid, st.st_gid, None)
        return found

    def rows(self) -> dict[str, Route]:
        return dict(self.registry.load().routes)


class MoveTests(Box):
    def test_flat_databases_move_into_their_spaces_and_rows_follow(self) -> None:
        self.add(A)
        self.database(self.flat(A), rows=5)
        self.add(B, db_path="")  # an old row: the default database
        self.database(self.flat(B), rows=2)
        lines = self.run_it()

        self.assertTrue(hosts.isolated(self.data))
        self.assertEqual(stat.S_IMODE(os.stat(self.data).st_mode), 0o711)
        for host, count in ((A, 5), (B, 2)):
            for suffix in ("", "-wal", "-shm"):
                self.assertFalse(os.path.lexists(self.flat(host, ".db" + suffix)))
                st = os.lstat(self.new(host, ".db" + suffix))
                self.assertTrue(UIDS[0] <= st.st_uid <= UIDS[1], st.st_uid)
                self.assertEqual(st.st_gid, st.st_uid)
            owner = os.stat(hosts.space_dir(self.data, host))
            self.assertEqual(owner.st_uid, os.stat(self.new(host)).st_uid)
            self.assertEqual(stat.S_IMODE(owner.st_mode), 0o700)
            row = self.registry.get(host)
            assert row is not None
            self.assertEqual(row.db_path, self.new(host))
            self.assertEqual(row.socket, hosts.socket_path(self.rundir, host, isolated=True))
            # The moved database opens, with its rows (the WAL came along).
            conn = sqlite3.connect(self.new(host))
            try:
                self.assertEqual(conn.execute("SELECT count(*) FROM t").fetchone()[0], count)
            finally:
                conn.close()
        uid = os.stat(self.new(A)).st_uid
        self.assertIn(f"move {self.flat(A)} -> {self.new(A)} (uid {uid})", lines)
        self.assertIn(
            f"row {A}: socket {hosts.socket_path(self.rundir, A)} -> "
            f"{hosts.socket_path(self.rundir, A, isolated=True)}, db_path {self.flat(A)} -> "
            f"{self.new(A)}",
            lines,
        )
        self.assertIn(f"db_path (default) -> {self.new(B)}", "\n".join(lines))
        # The router's own file stays where it is, no longer open to others.
        self.assertEqual(
            stat.S_IMODE(os.stat(os.path.join(self.data, "router.env")).st_mode) & 7, 0
        )

    def test_a_second_run_does_nothing_and_says_so(self) -> None:
        self.add(A)
        self.database(self.flat(A))
        self.run_it()
        before, rows = self.tree(), self.rows()
        lines = self.run_it()
        self.assertEqual(
            lines, ["relayout: nothing to do: every space's files are in its own directory"]
        )
        self.assertEqual(self.tree(), before)
        self.assertEqual(self.rows(), rows)

    def test_a_dry_run_changes_nothing(self) -> None:
        self.add(A)
        self.database(self.flat(A))
        self.add(B, hibernate=True)
        before, rows = self.tree(), self.rows()
        lines = self.run_it(dry_run=True)
        self.assertEqual(self.tree(), before)
        self.assertEqual(self.rows(), rows)
        self.assertFalse(hosts.isolated(self.data))
        self.assertTrue(lines[0].startswith("lay out "), lines)
        self.assertIn(f"move {self.flat(A)} -> {self.new(A)} (uid ", "\n".join(lines))
        self.assertIn(f"row {B}: socket ", "\n".join(lines))

    def test_a_hibernating_row_without_a_database_only_has_its_row_rewritten(self) -> None:
        self.add(A, hibernate=True)
        lines = self.run_it()
        row = self.registry.get(A)
        assert row is not None
        self.assertEqual(row.db_path, self.new(A))
        self.assertEqual(row.socket, hosts.socket_path(self.rundir, A, isolated=True))
        self.assertFalse(os.path.lexists(hosts.space_dir(self.data, A)))  # made at its first wake
        self.assertEqual([x for x in lines if x.startswith("move")], [])

    def test_the_clean_sleep_marker_and_moved_aside_copies_come_along_still_true(self) -> None:
        self.add(A, hibernate=True)
        self.database(self.flat(A))
        localdb.write_marker(self.flat(A), 41, time.time())
        self.assertEqual(localdb.local_state(self.flat(A)).marker_txid, 41)
        self.database(self.flat(A, ".db.stale-20261201T000000"))
        localdb.write_marker(self.flat(A, ".db.stale-20261201T000000"), 40, time.time())
        with open(self.flat(A, ".db-bot.json"), "w") as f:
            f.write("{}")
        self.run_it()
        self.assertEqual(localdb.local_state(self.new(A)).marker_txid, 41)
        aside = localdb.moved_aside(self.new(A))
        self.assertEqual(
            [(c.path, c.txid) for c in aside], [(self.new(A, ".db.stale-20261201T000000"), 40)]
        )
        self.assertTrue(os.path.exists(self.new(A, ".db-bot.json")))
        self.assertEqual([n for n in os.listdir(self.data) if n.startswith(A)], [])  # all moved

    def test_an_interrupted_run_is_completed(self) -> None:
        self.add(A)
        self.database(self.flat(A))
        isolation.enable(self.data, self.rundir)
        socket_path = hosts.socket_path(self.rundir, A, isolated=True)
        isolation.prepare(self.data, UIDS, A, socket_path)
        os.rename(self.flat(A, ".db-wal"), self.new(A, ".db-wal"))  # then the power went
        self.run_it()
        conn = sqlite3.connect(self.new(A))
        try:
            self.assertEqual(conn.execute("SELECT count(*) FROM t").fetchone()[0], 3)
        finally:
            conn.close()

    def test_a_lives_elsewhere_row_gets_the_isolated_paths(self) -> None:
        # A peer's flip back to hibernating keeps this box's socket and database path
        # (Registry.upsert_replicated): they must be the isolated ones by then.
        self.add(A, lives_at="https://box-2.example.net")
        self.run_it()
        row = self.registry.get(A)
        assert row is not None
        self.assertEqual(row.lives_at, "https://box-2.example.net")
        self.assertEqual(row.socket, hosts.socket_path(self.rundir, A, isolated=True))
        self.assertEqual(row.db_path, self.new(A))


class LeftAloneTests(Box):
    def test_a_custom_database_path_and_a_service_are_left_alone(self) -> None:
        custom = os.path.join(self.top, "elsewhere.db")
        self.add(A, db_path=custom)
        self.registry.insert(
            Route(host=B, kind="service", socket=hosts.socket_path(self.rundir, B), status="ready")
        )
        rows = self.rows()
        lines = self.run_it()
        self.assertEqual(self.rows(), rows)
        self.assertIn(
            f"{A}: its database {custom} is not the flat default ({self.flat(A)}): left as it is"
            " (move it into its own directory by hand)",
            lines,
        )
        self.assertFalse(any(B in x for x in lines), lines)


class RefusalTests(Box):
    def assertRefused(self, lines: list[str], host: str, *words: str) -> None:
        refused = [x for x in lines if x.startswith(f"{host}: refused: ")]
        self.assertEqual(len(refused), 1, lines)
        for word in words:
            self.assertIn(word, refused[0])

    def test_a_symlinked_database_is_refused_and_the_others_still_move(self) -> None:
        self.add(A)
        os.symlink(os.path.join(self.data, "router.env"), self.flat(A))
        self.add(B)
        self.database(self.flat(B))
        rows = self.rows()
        lines = self.run_it()
        self.assertRefused(lines, A, f"{self.flat(A)} is a symbolic link", "only plain files")
        self.assertTrue(os.path.islink(self.flat(A)))
        self.assertEqual(self.rows()[A], rows[A])
        self.assertEqual(os.stat(os.path.join(self.data, "router.env")).st_uid, 0)
        self.assertTrue(os.path.exists(self.new(B)))
        # Refused again, and said again, until the operator settles it.
        self.assertRefused(self.run_it(), A, "symbolic link")

    def test_a_hard_linked_journal_is_refused(self) -> None:
        self.add(A)
        self.database(self.flat(A))
        os.link(self.flat(A, ".db-wal"), os.path.join(self.top, "other"))
        lines = self.run_it()
        self.assertRefused(lines, A, f"{self.flat(A, '.db-wal')} has 2 hard links")
        self.assertTrue(os.path.exists(self.flat(A)))

    def test_a_database_in_both_places_is_refused_and_neither_is_touched(self) -> None:
        self.add(A)
        self.database(self.flat(A), rows=2)
        isolation.enable(self.data, self.rundir)
        isolation.prepare(self.data, UIDS, A, hosts.socket_path(self.rundir, A, isolated=True))
        self.database(self.new(A), rows=7)
        before, rows = self.tree(), self.rows()
        lines = self.run_it()
        self.assertRefused(lines, A, f"{self.flat(A)} and {self.new(A)} both exist")
        self.assertEqual(self.tree(), before)
        self.assertEqual(self.rows(), rows)

    def test_a_running_space_is_refused(self) -> None:
        self.add(A)
        self.database(self.flat(A))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(listener.close)
        listener.bind(hosts.socket_path(self.rundir, A))
        listener.listen(1)
        lines = self.run_it()
        self.assertRefused(lines, A, "its space is running")
        self.assertTrue(os.path.exists(self.flat(A)))

    def test_a_stale_journal_beside_a_database_already_moved_is_refused(self) -> None:
        self.add(A)
        self.database(self.flat(A))
        self.run_it()
        with open(self.flat(A, ".db-journal"), "wb") as f:  # left by something else since
            f.write(b"stale")
        lines = self.run_it()
        self.assertRefused(
            lines, A, f"{self.new(A)} exists and so does {self.flat(A, '.db-journal')}"
        )
        self.assertTrue(os.path.exists(self.flat(A, ".db-journal")))
