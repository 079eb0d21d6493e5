"""lchat.isolation's parts on their own: the decision at start, uid allocation, a space's
directories made ready (and what is refused), setpriv's command line, the systemd drop-in, and
the reference space's credential. The escapes, tried from inside real spaces, are in
tests/test_isolation.py (builtin, as root) and the box test (systemd)."""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from lchat import hosts, isolation, systemd_units
from lchat.config import load
from lchat.space import server

UIDS = (45100, 45199)
HOST = "a.example.com"


def _need_root(case: SynchronousTestCase) -> None:
    if os.geteuid() != 0:
        case.skipTest("needs root (chown to a space's uid)")


class Box(SynchronousTestCase):
    def setUp(self) -> None:
        self.top = tempfile.mkdtemp()
        os.chmod(self.top, 0o711)
        self.addCleanup(shutil.rmtree, self.top)
        self.data = os.path.join(self.top, "data")
        self.rundir = os.path.join(self.top, "run")
        os.mkdir(self.data, 0o755)

    def socket(self, host: str = HOST) -> str:
        return hosts.socket_path(self.rundir, host, isolated=True)


class DecideTests(Box):
    def test_off_is_off(self) -> None:
        self.assertFalse(isolation.decide("off", self.data, self.rundir, missing=[]).on)

    def test_auto_with_privilege_is_on(self) -> None:
        self.assertTrue(isolation.decide("auto", self.data, self.rundir, missing=[]).on)

    def test_auto_without_privilege_says_plainly_it_is_off(self) -> None:
        d = isolation.decide("auto", self.data, self.rundir, missing=["CAP_SETUID"])
        self.assertFalse(d.on)
        self.assertIn("isolation: OFF", d.why)
        self.assertIn("CAP_SETUID", d.why)
        self.assertIn("can read the router's files", d.why)

    def test_on_without_privilege_refuses(self) -> None:
        with self.assertRaises(isolation.IsolationError):
            isolation.decide("on", self.data, self.rundir, missing=["CAP_SETUID"])

    def test_a_box_laid_out_for_isolation_never_runs_spaces_as_the_router(self) -> None:
        isolation.enable(self.data, self.rundir)
        for setting, missing in (("auto", ["CAP_SETUID"]), ("off", [])):
            with self.assertRaises(isolation.IsolationError, msg=setting):
                isolation.decide(setting, self.data, self.rundir, missing=missing)

    def test_a_data_dir_others_cannot_reach_turns_auto_off(self) -> None:
        os.chmod(self.data, 0o700)  # itself is fine: enable() makes it 0711
        self.assertTrue(isolation.decide("auto", self.data, self.rundir, missing=[]).on)
        os.chmod(self.top, 0o700)
        d = isolation.decide("auto", self.data, self.rundir, missing=[])
        self.assertFalse(d.on)
        self.assertIn(f"{self.top} is not traversable", d.why)
        with self.assertRaises(isolation.IsolationError):
            isolation.decide("on", self.data, self.rundir, missing=[])

    def test_a_space_command_others_cannot_run_turns_auto_off(self) -> None:
        """As with a venv whose interpreter lives under /root (0700): a space's user could not
        start it, so isolation would only break every space."""
        hidden = os.path.join(self.top, "hidden")
        os.mkdir(hidden, 0o700)
        interpreter = os.path.join(hidden, "python")
        with open(interpreter, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(interpreter, 0o755)
        script = os.path.join(self.top, "space")
        with open(script, "w") as f:
            f.write(f"#!{interpreter}\n")
        os.chmod(script, 0o755)
        d = isolation.decide("auto", self.data, self.rundir, commands=(script,), missing=[])
        self.assertFalse(d.on)
        self.assertIn(f"{hidden} cannot be reached or run by other users", d.why)
        os.chmod(hidden, 0o711)
        self.assertTrue(
            isolation.decide("auto", self.data, self.rundir, commands=(script,), missing=[]).on
        )
        template = "/opt/lchat/live/{host}"  # nothing installed yet: nothing to check
        self.assertTrue(
            isolation.decide("auto", self.data, self.rundir, commands=(template,), missing=[]).on
        )


class LayoutTests(Box):
    def test_paths_follow_the_layout_on_disk(self) -> None:
        self.assertEqual(hosts.db_path(self.data, HOST), os.path.join(self.data, HOST + ".db"))
        isolation.enable(self.data, self.rundir)
        self.assertEqual(
            hosts.db_path(self.data, HOST), os.path.join(self.data, "spaces", HOST, HOST + ".db")
        )
        self.assertEqual(self.socket(), os.path.join(self.rundir, "spaces", HOST, HOST + ".sock"))
        long_host = ("x" * 60) + ".example.com"
        self.assertTrue(self.socket(long_host).endswith("/s.sock"), self.socket(long_host))

    def test_enable_closes_the_top_of_the_data_dir_to_others(self) -> None:
        secret = os.path.join(self.data, "router.env")
        with open(secret, "w") as f:
            f.write("LCHAT_MESH_TOKEN=x\n")
        os.chmod(secret, 0o644)
        isolation.enable(self.data, self.rundir)
        self.assertEqual(os.stat(secret).st_mode & 0o777, 0o640)
        self.assertEqual(os.stat(self.data).st_mode & 0o777, 0o711)
        self.assertEqual(os.stat(os.path.join(self.data, "spaces")).st_mode & 0o777, 0o711)


class RouterStartTests(Box):
    def test_a_systemd_box_with_units_running_flat_waits_for_bootstrap(self) -> None:
        """Laying the box out under running units would stop each at its next restart (the
        template refuses an isolated box without a drop-in): the router leaves that to
        bootstrap, and says so; with no always-on space it lays the box out itself."""
        _need_root(self)
        from lchat import relayout
        from lchat.registry import Registry, Route

        env = os.path.join(self.top, "router.env")
        with open(env, "w") as f:
            f.write(
                f"LCHAT_DATA_DIR={self.data}\nLCHAT_RUN_DIR={self.rundir}\n"
                "LCHAT_UNITS=systemd\nLCHAT_ISOLATION=auto\nLCHAT_SPACE_COMMAND=/bin/true\n"
                "LCHAT_SIDECAR_COMMAND=/bin/true\n"
            )
        cfg = load(env_file=env, environ={}, systemd_present=True)
        registry = Registry(cfg.registry, lambda: 0.0)
        registry.migrate()
        registry.insert(Route(host=HOST, kind="instance", socket="/run/x.sock", status="ready"))

        isolation.at_start(cfg, registry, relayout.relayout)
        self.assertFalse(hosts.isolated(self.data))
        self.assertEqual(isolation.ISOLATED._value.get(), 0)
        registry.update(HOST, hibernate=True)
        isolation.at_start(cfg, registry, relayout.relayout)
        self.assertTrue(hosts.isolated(self.data))
        self.assertEqual(isolation.ISOLATED._value.get(), 1)


class PrepareTests(Box):
    def setUp(self) -> None:
        super().setUp()
        _need_root(self)
        isolation.enable(self.data, self.rundir)

    def test_a_new_space_gets_a_free_uid_and_its_own_directories(self) -> None:
        user = isolation.prepare(self.data, UIDS, HOST, self.socket())
        self.assertTrue(UIDS[0] <= user.uid <= UIDS[1])
        self.assertEqual(user.gid, user.uid)
        self.assertEqual(user.name, isolation.user_name(HOST))
        for d in (hosts.space_dir(self.data, HOST), os.path.dirname(self.socket())):
            st = os.stat(d)
            self.assertEqual(
                (st.st_uid, st.st_gid, st.st_mode & 0o777), (user.uid, user.uid, 0o700)
            )
        # the directory's owner is the record: the same uid again, another for another space
        self.assertEqual(isolation.prepare(self.data, UIDS, HOST, self.socket()), user)
        other = isolation.prepare(self.data, UIDS, "b.example.com", self.socket("b.example.com"))
        self.assertNotEqual(other.uid, user.uid)

    def test_files_the_router_left_are_given_to_the_space(self) -> None:
        user = isolation.prepare(self.data, UIDS, HOST, self.socket())
        db = hosts.db_path(self.data, HOST)
        with open(db + "-wal", "wb") as f:
            f.write(b"x")  # as root: a restore's file, a flush's journal
        isolation.prepare(self.data, UIDS, HOST, self.socket())
        self.assertEqual(os.stat(db + "-wal").st_uid, user.uid)

    def test_a_planted_link_is_refused_not_followed(self) -> None:
        isolation.prepare(self.data, UIDS, HOST, self.socket())
        target = os.path.join(self.data, "router.env")
        with open(target, "w") as f:
            f.write("secret\n")
        db = hosts.db_path(self.data, HOST)
        os.symlink(target, db)
        with self.assertRaisesRegex(isolation.IsolationError, "not a plain file"):
            isolation.prepare(self.data, UIDS, HOST, self.socket())
        self.assertEqual(os.stat(target).st_uid, 0)  # never chowned through the link
        os.unlink(db)
        os.link(target, db)
        with self.assertRaisesRegex(isolation.IsolationError, "hard links"):
            isolation.prepare(self.data, UIDS, HOST, self.socket())
        self.assertEqual(os.stat(target).st_uid, 0)

    def test_a_directory_outside_the_range_is_refused(self) -> None:
        os.makedirs(hosts.space_dir(self.data, HOST))  # owned by root
        with self.assertRaisesRegex(isolation.IsolationError, "outside LCHAT_SPACE_UIDS"):
            isolation.prepare(self.data, UIDS, HOST, self.socket())


class SpawnTests(SynchronousTestCase):
    def test_setpriv_drops_groups_and_capabilities(self) -> None:
        if shutil.which("setpriv") is None:
            self.skipTest("util-linux setpriv not installed")
        argv = isolation.argv_as(isolation.SpaceUser(45123, 45123, "x"), ["/bin/space", "-v"])
        self.assertEqual(argv[-3:], ["--", "/bin/space", "-v"])
        for flag in (
            "--reuid=45123",
            "--regid=45123",
            "--clear-groups",
            "--no-new-privs",
            "--inh-caps=-all",
            "--ambient-caps=-all",
        ):
            self.assertIn(flag, argv)


class DropinTests(Box):
    def test_the_unit_sees_only_its_own_directories_and_credential(self) -> None:
        env = os.path.join(self.top, "router.env")
        with open(env, "w") as f:
            f.write(f"LCHAT_DATA_DIR={self.data}\nLCHAT_RUN_DIR=/run/lchat\n")
        isolation.enable(self.data, self.rundir)
        cfg = load(env_file=env, environ={}, systemd_present=False)
        user = isolation.SpaceUser(45123, 45123, isolation.user_name(HOST))
        socket = hosts.socket_path("/run/lchat", HOST, isolated=True)
        text = systemd_units.space_dropin(cfg, HOST, user, socket)
        lines = text.splitlines()
        for line in (
            "AssertPathExists=",
            f"User={user.name}",
            "EnvironmentFile=",
            f"LoadCredential=env:{self.data}/{HOST}.env",
            f"RuntimeDirectory=lchat/spaces/{HOST}",
            f"Environment=LCHAT_SOCKET=/run/lchat/spaces/{HOST}/{HOST}.sock",
            f"Environment=LCHAT_DB={self.data}/spaces/{HOST}/{HOST}.db",
            "ReadWritePaths=",
            f"TemporaryFileSystem={self.data}:ro /run/lchat:ro",
            f"BindPaths={self.data}/spaces/{HOST} /run/lchat/spaces/{HOST}",
        ):
            self.assertIn(line, lines)
        bot = systemd_units.space_dropin(cfg, HOST, user, socket, sidecar=True).splitlines()
        self.assertIn(f"User={user.name}", bot)
        self.assertNotIn("EnvironmentFile=", bot)  # the bot keeps its own env file


class CredentialTests(SynchronousTestCase):
    def test_the_space_reads_its_credential_and_hands_no_secret_on(self) -> None:
        creds = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, creds)
        with open(os.path.join(creds, "env"), "w") as f:
            f.write("LCHAT_ADMIN_TOKEN=from-the-credential\n")
        saved = dict(os.environ)

        def restore() -> None:
            os.environ.clear()
            os.environ.update(saved)

        self.addCleanup(restore)
        os.environ["CREDENTIALS_DIRECTORY"] = creds
        os.environ["LCHAT_ADMIN_TOKEN"] = "from-the-environment"
        settings = server.environment(os.environ)
        self.assertEqual(settings["LCHAT_ADMIN_TOKEN"], "from-the-credential")
        self.assertNotIn("LCHAT_ADMIN_TOKEN", os.environ)
