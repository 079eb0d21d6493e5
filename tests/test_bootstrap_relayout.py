"""``lchat bootstrap`` on a box with spaces from before isolation: it moves their files into their
own directories (lchat/relayout.py) unless router.env says ``LCHAT_ISOLATION=off``, shows it with
``--dry-run`` and changes nothing then, keeps the data directory traversable (0711) once the box
isolates its spaces, and leaves it alone while a router it cannot stop runs.

No systemd here: the stop/start of the units is the box test's (tests/box); these run as root on
a real tree with real chowns, without --root (a --root run skips the relayout: its rows name box
paths)."""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import socket
import sqlite3
import stat
import tempfile
import time

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from lchat import hosts, isolation
from lchat.cli import bootstrap
from lchat.cli.bootstrap.apply import apply, plan
from lchat.cli.bootstrap.relayout import RELAYOUT
from lchat.cli.bootstrap.request import Request
from lchat.cli.bootstrap.steps import Step
from lchat.registry import Registry, Route

SERVICE_USER = "daemon"
A = "a.example.com"
UIDS = "45000-45099"


class Box(SynchronousTestCase):
    def setUp(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("needs root (bootstrap hands files to their users)")
        try:
            self.owner = pwd.getpwnam(SERVICE_USER)
        except KeyError:
            raise SkipTest(f"no user {SERVICE_USER} here") from None
        self.top = tempfile.mkdtemp()
        os.chmod(self.top, 0o711)
        self.addCleanup(shutil.rmtree, self.top)
        self.data = os.path.join(self.top, "data")
        self.rundir = os.path.join(self.top, "run")
        os.mkdir(self.data, 0o750)
        os.chown(self.data, self.owner.pw_uid, self.owner.pw_gid)
        os.mkdir(self.rundir, 0o755)
        self.write_env()
        self.registry = Registry(os.path.join(self.data, "registry.db"), time.time)
        self.registry.migrate()
        self.registry.insert(
            Route(
                host=A,
                kind="instance",
                socket=hosts.socket_path(self.rundir, A),
                db_path=os.path.join(self.data, A + ".db"),
                status="ready",
            )
        )
        conn = sqlite3.connect(os.path.join(self.data, A + ".db"))
        conn.execute("CREATE TABLE t (n INTEGER)")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.commit()
        conn.close()

    def write_env(self, *extra: str) -> None:
        lines = [
            f"LCHAT_DATA_DIR={self.data}",
            f"LCHAT_RUN_DIR={self.rundir}",
            f"LCHAT_SPACE_UIDS={UIDS}",
            *extra,
        ]
        path = os.path.join(self.data, "router.env")
        with open(path, "w") as f:
            f.write("".join(x + "\n" for x in lines))
        os.chmod(path, 0o600)
        os.chown(path, self.owner.pw_uid, self.owner.pw_gid)

    def request(self, *, dry_run: bool = False) -> Request:
        return Request(
            data_dir=self.data,
            user=SERVICE_USER,
            root="",
            values={"LCHAT_DATA_DIR": self.data},
            given=(),
            dry_run=dry_run,
            no_systemctl="systemd is not running here",
        )

    def relayout_step(self, steps: list[Step]) -> Step:
        found = [s for s in steps if s.what == RELAYOUT]
        self.assertEqual(len(found), 1, [s.what for s in steps])
        return found[0]

    def tree(self) -> dict[str, tuple[int, int, int, bytes | None]]:
        found = {}
        for directory, dirs, names in os.walk(self.top):
            for name in [*dirs, *names]:
                path = os.path.join(directory, name)
                if name.startswith("registry.db"):
                    continue  # reading rows touches its shared memory; the rows are compared
                st = os.lstat(path)
                body = None
                if stat.S_ISREG(st.st_mode):
                    with open(path, "rb") as f:
                        body = f.read()
                found[path] = (st.st_mode, st.st_uid, st.st_gid, body)
        return found


class BootstrapRelayoutTests(Box):
    def test_dry_run_prints_every_move_and_changes_nothing(self) -> None:
        before, rows = self.tree(), dict(self.registry.load().routes)
        said: list[str] = []
        args = argparse.Namespace(
            data_dir=self.data,
            user=SERVICE_USER,
            mesh_self=None,
            set=None,
            root=None,
            dry_run=True,
            no_systemctl=True,
        )
        code = bootstrap.run(args, said.append, lambda message: self.fail(message))
        self.assertEqual(code, 0)
        self.assertEqual(self.tree(), before)
        self.assertEqual(dict(self.registry.load().routes), rows)
        text = "\n".join(said)
        new_db = os.path.join(self.data, "spaces", A, A + ".db")
        self.assertIn(f"  to do    {RELAYOUT}", text)
        self.assertIn(f"             move {self.data}/{A}.db -> {new_db} (uid 450", text)
        self.assertIn(f"             row {A}: socket ", text)
        self.assertIn(f"to do    {self.data}: make it mode 0711 (is 0750)", text)

    def test_the_run_moves_them_and_a_second_plan_finds_it_done(self) -> None:
        steps = plan(self.request())
        self.assertTrue(self.relayout_step(steps).to_do)
        outcome = apply(self.request(), steps, probe=False)
        new_db = os.path.join(self.data, "spaces", A, A + ".db")
        self.assertIn(
            f"row {A}: socket {hosts.socket_path(self.rundir, A)} -> "
            f"{hosts.socket_path(self.rundir, A, isolated=True)}, db_path "
            f"{self.data}/{A}.db -> {new_db}",
            outcome.done,
        )
        self.assertTrue(os.path.exists(new_db))
        self.assertEqual(stat.S_IMODE(os.stat(self.data).st_mode), 0o711)
        again = plan(self.request())
        self.assertFalse(any(s.to_do for s in again), [s.what for s in again if s.to_do])
        self.assertEqual(
            self.relayout_step(again).already, "every space's files are in a directory of its own"
        )

    def test_an_isolated_box_keeps_its_data_dir_traversable(self) -> None:
        # Bootstrap's own 0750 would lock every space out of <data>/spaces/<host>: the router
        # then refuses to start (isolation.decide).
        isolation.enable(self.data, self.rundir)
        step = plan(self.request())[1]
        self.assertEqual(step.already, f"{self.data}: mode 0711, owner {SERVICE_USER}")

    def test_isolation_off_leaves_the_files_with_a_line(self) -> None:
        self.write_env("LCHAT_ISOLATION=off")
        before = self.tree()
        steps = plan(self.request())
        step = self.relayout_step(steps)
        self.assertIn("LCHAT_ISOLATION=off", step.skipped or "")
        apply(self.request(), steps, probe=False)
        self.assertFalse(hosts.isolated(self.data))
        self.assertTrue(os.path.exists(os.path.join(self.data, A + ".db")))
        self.assertEqual(self.tree()[self.data], before[self.data])

    def test_isolation_off_given_on_the_same_run_wins(self) -> None:
        request = self.request()
        request = Request(
            data_dir=request.data_dir,
            user=request.user,
            root="",
            values={**request.values, "LCHAT_ISOLATION": "off"},
            given=("LCHAT_ISOLATION",),
            no_systemctl=request.no_systemctl,
        )
        step = self.relayout_step(plan(request))
        self.assertIn("LCHAT_ISOLATION=off", step.skipped or "")

    def test_a_router_it_cannot_stop_is_not_moved_under(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(listener.close)
        listener.bind(os.path.join(self.rundir, "router.sock"))
        listener.listen(1)
        step = self.relayout_step(plan(self.request()))
        self.assertIn("the router runs", step.skipped or "")
        self.assertTrue(step.detail)  # what it would do, said
