"""Every space isolated from the router and from every other space, proven from inside real spaces
(issue 30, item 3; builtin units, as root): a real ``twistd lchat`` router with
``LCHAT_ISOLATION=on`` runs tests/isolation_probe.py as two always-on spaces and as a hibernating
one the activator wakes. Each probe, running as its space's user, tries the escapes a compromised
space would (the router's env file and registry, the ACME cache, another space's env file,
database, socket and process, the admin socket, planting files) and reports what it was refused;
every attempt must be refused with a permission error, and the space must be itself: its own uid
and gid, no groups, no capabilities, no_new_privs. Once with the router as root, once as
lchat-router.service runs it (its own uid, the unit's capabilities as ambient ones). A space that
turns its database into a link is refused replication (ReplicationLinkTests).
The parts on their own are in tests/test_isolation_parts.py; the same proof under systemd is the
box test's."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import sqlite3
import stat
import sys
import time
from typing import Any

from lchat import admin_client, hosts
from lchat.acme.cache import LocalCache
from tests.test_cli_hibernate import HibernateTestCase

PROBE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isolation_probe.py")
# The probe needs only the standard library: the system's Python, which every user can run (a
# virtualenv's interpreter may live under a home directory a space cannot traverse).
PROBE_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
PROBE = f"{PROBE_PYTHON} -I {PROBE_SCRIPT}"
SECRET = "router-secret-that-no-space-may-read-0123456789"
A, B, H = "a.iso.test", "b.iso.test", "h.iso.test"
# lchat-router.service's capabilities (AmbientCapabilities=, CapabilityBoundingSet=), in setpriv's
# spelling, and their bits in /proc/<pid>/status.
UNIT_CAPS = "+net_bind_service,+chown,+dac_override,+fowner,+kill,+setgid,+setuid"
UNIT_CAP_BITS = 0x4EB


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: spaces are started as their own users only by a privileged router"
    if shutil.which("setpriv") is None:
        return "needs util-linux setpriv: the router starts isolated spaces through it"
    return None


class IsolatedBoxTestCase(HibernateTestCase):
    """A box whose router isolates its spaces: data and run directories other users can
    traverse, the router's env file in ``<data>`` (as on a real box) with a secret in it, an ACME
    cache with a key file, as the router leaves them."""

    def setUp(self) -> None:
        reason = _skip_reason()
        if reason is not None:
            self.skipTest(reason)
        super().setUp()
        os.unlink(self.env_file)
        os.chmod(self.root, 0o711)  # spaces traverse it to their own directories
        for directory in (self.data_dir, self.run_dir, self.bucket):
            os.chmod(directory, 0o711)  # as above
        self.env_file = os.path.join(self.data_dir, "router.env")
        self.configure(LCHAT_ISOLATION="on", LCHAT_SPACE_COMMAND=PROBE)
        cache = LocalCache(os.path.join(self.data_dir, "acme"))
        cache.ensure_directory()
        with open(os.path.join(cache.directory, "account.key"), "w") as f:
            f.write("-----BEGIN PRIVATE KEY----- not a real one\n")

    def write_router_env(self, units: str = "builtin", **extra: str) -> None:
        super().write_router_env(units, **extra)
        with open(self.env_file, "a") as f:
            f.write(
                f"# the mesh token, the bucket's keys, the cert-cache key live here: {SECRET}\n"
            )

    # -- what the probes left in their own directories -----------------------------------------

    def own_dir(self, host: str) -> str:
        return hosts.space_dir(self.data_dir, host)

    def wait_for(self, host: str, name: str) -> Any:
        path = os.path.join(self.own_dir(host), name)
        deadline = time.monotonic() + 20
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                self.fail(f"{host} never wrote {name}:\n{self._log(self.router_log)}")
            time.sleep(0.05)
        with open(path) as f:
            return json.load(f)

    @property
    def router_log(self) -> str:
        return os.path.join(self.root, "router.log")

    def pid_of(self, host: str) -> int:
        self.wait_for(host, "own.json")  # written after the pid
        with open(os.path.join(self.own_dir(host), "pid")) as f:
            return int(f.read())

    # -- assertions ------------------------------------------------------------------------------

    def assertRefused(self, host: str, outcomes: dict[str, Any], attempt: str) -> None:
        self.assertIn(attempt, outcomes, f"{host} did not try: {attempt}")
        self.assertTrue(
            str(outcomes[attempt]).startswith("refused: PermissionError"),
            f"{host}: {attempt}: {outcomes[attempt]} (must be refused: permission denied)",
        )

    def assertItself(self, host: str, own: dict[str, Any], others: list[int]) -> int:
        """``host``'s space runs as the owner of its directory (not root, not another space's
        uid), with no groups, no capabilities and no_new_privs; checked from inside (its
        /proc/self/status) and from outside (its pid's). Returns its uid."""
        uid = os.stat(self.own_dir(host)).st_uid
        self.assertNotEqual(uid, 0, f"{host}'s directory is root's")
        self.assertNotIn(uid, others, f"{host} shares a uid with another space")
        status = own["status"]
        self.assertEqual(status["Uid"].split(), [str(uid)] * 4, f"{host}: its uid ({status})")
        self.assertEqual(status["Gid"].split(), [str(uid)] * 4, f"{host}: its gid ({status})")
        self.assertEqual(status["Groups"], "", f"{host}: supplementary groups ({status})")
        for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
            self.assertEqual(int(status[caps], 16), 0, f"{host}: {caps} ({status})")
        self.assertEqual(status["NoNewPrivs"], "1", f"{host}: NoNewPrivs ({status})")
        self.assertEqual(
            own["own: create a file in its own directory"],
            "ALLOWED",
            f"{host}: create a file in its own directory",
        )
        with open(f"/proc/{self.pid_of(host)}/status") as f:
            outside = dict(line.split(":", 1) for line in f)
        self.assertEqual(
            outside["Uid"].split()[0], str(uid), f"{host}: its pid's uid, seen by root"
        )
        return uid

    def assertBoxRefused(self, host: str, own: dict[str, Any]) -> None:
        """The escapes into the router's part of the box, all refused."""
        for attempt in (
            "read <data>/router.env",
            "read <data>/registry.db",
            "list <data>/acme",
            "read <data>/acme/account.key",
            "list <data>",
            "list <data>/spaces",
            "list <run>",
            "connect to the admin socket <run>/router.sock",
            "plant a file in <data>",
            "plant a file in <data>/spaces",
            "plant a file in <run>",
            "plant a file in <run>/spaces",
            "hard-link <data>/registry.db into its own directory",  # fs.protected_hardlinks=1
            "read the router's /proc/<pid>/environ",
            "signal 0 to the router",
        ):
            self.assertRefused(host, own, attempt)

    def assertTargetsExist(self) -> None:
        """Refusals prove nothing about files that are not there: root sees every target."""
        for path in (
            os.path.join(self.data_dir, "router.env"),
            os.path.join(self.data_dir, "registry.db"),
            os.path.join(self.data_dir, "acme", "account.key"),
            self.admin_socket,
        ):
            self.assertTrue(os.path.exists(path), path)


class AlwaysOnTests(IsolatedBoxTestCase):
    def test_two_spaces_cannot_reach_the_router_or_each_other(self) -> None:
        router = self.start_router()
        for host in (A, B):
            result = self.lchat("add-instance", host, "--timeout", "30")
            self.assertEqual(result.code, 0, f"{result}\n{self._log(self.router_log)}")
        with open(self.router_log) as f:
            self.assertIn("isolation: on", f.read())
        # The router tightened what it found at the top of <data> (it was made with umask 022).
        for name in ("router.env", "registry.db", "acme"):
            mode = stat.S_IMODE(os.stat(os.path.join(self.data_dir, name)).st_mode)
            self.assertEqual(mode & 0o007, 0, f"<data>/{name} is mode {mode:o}")
        self.assertTargetsExist()

        pids = {host: self.pid_of(host) for host in (A, B)}
        uids: list[int] = []
        for host in (A, B):
            own = self.wait_for(host, "own.json")
            uids.append(self.assertItself(host, own, uids))
            self.assertEqual(own["router_pid"], router.pid, f"{host}'s parent is the router")
            self.assertBoxRefused(host, own)

        # Each is told the other (its pid, database, socket) and every path root sees under
        # <data> and <run> but its own.
        for host, other in ((A, B), (B, A)):
            route = self.row(other)
            assert route is not None
            self.assertTrue(os.path.exists(route.db_path), route.db_path)
            self.assertTrue(os.path.exists(route.socket), route.socket)
            targets = {
                "host": other,
                "pid": pids[other],
                "db": route.db_path,
                "socket": route.socket,
                "paths": self.paths_but(host),
            }
            with open(os.path.join(self.own_dir(host), "targets.json"), "w") as f:
                json.dump(targets, f)
        for host in (A, B):
            escapes = self.wait_for(host, "escapes.json")
            for attempt in escapes:
                self.assertRefused(host, escapes, attempt)
            for attempt in (
                "read the other space's env file <data>/<B>.env",
                "read the other space's database",
                "list the other space's directory <data>/spaces/<B>",
                "create a file in the other space's directory",
                "connect to the other space's socket",
                "read the other space's /proc/<pid>/environ",
                "signal 0 to the other space",
                "SIGTERM to the other space",
            ):
                self.assertIn(attempt, escapes, f"{host} did not try: {attempt}")
        # Nobody was signalled away: the same two processes still run, ready.
        for host in (A, B):
            self.assertEqual(self.pid_of(host), pids[host], f"{host} was restarted")
            process = self.router_entry(host)["process"]
            self.assertEqual(
                (process["state"], process["pid"], process["restarts"]),
                ("ready", pids[host], 0),
                f"{host}: the router's view of it",
            )
            code, body = self.call(host, "GET", "/api/version")
            self.assertEqual((code, body["uid"]), (200, os.stat(self.own_dir(host)).st_uid))

    def paths_but(self, host: str) -> list[str]:
        """Every file and socket under ``<data>`` and ``<run>``, except ``host``'s own."""
        mine = (
            self.own_dir(host),
            os.path.dirname(hosts.socket_path(self.run_dir, host, isolated=True)),
        )
        found = []
        for top in (self.data_dir, self.run_dir):
            for directory, dirs, names in os.walk(top):
                if directory in mine:
                    dirs[:] = []
                    continue
                found += [os.path.join(directory, n) for n in names]
        return sorted(found)


class HibernatingTests(IsolatedBoxTestCase):
    def test_a_woken_space_runs_as_its_own_user_too(self) -> None:
        router = self.start_router()
        result = self.lchat("add-instance", H, "--hibernate")
        self.assertEqual(result.code, 0, f"{result}\n{self._log(self.router_log)}")
        self.assertFalse(os.path.exists(os.path.join(self.own_dir(H), "pid")), "running asleep")
        code, body = self.call(H, "GET", "/api/version")  # the activator wakes it
        self.assertEqual(code, 200, body)
        self.assertEqual(self.instances()[H]["STATE"], "awake")
        self.assertTargetsExist()
        own = self.wait_for(H, "own.json")
        uid = self.assertItself(H, own, [])
        self.assertEqual(body["uid"], uid)
        self.assertEqual(own["router_pid"], router.pid, f"{H}'s parent is the router")
        self.assertBoxRefused(H, own)


def _unknown_uid(start: int = 39990) -> int:
    """A uid below LCHAT_SPACE_UIDS that names no user: the router's, for the test."""
    uid = start
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid -= 1


class UnitUserRouterTests(IsolatedBoxTestCase):
    """The router as lchat-router.service runs it: not root, its user's own uid, the unit's
    capabilities as ambient ones, no_new_privs. Its spaces must not inherit those capabilities
    (an ambient set survives exec, and a uid change away from a non-root uid keeps the
    permitted set: only setpriv's clearing stands between a space and CAP_DAC_OVERRIDE)."""

    def setUp(self) -> None:
        super().setUp()
        self.router_uid = _unknown_uid()
        self.router_prefix = (
            "setpriv",
            f"--reuid={self.router_uid}",
            f"--regid={self.router_uid}",
            "--clear-groups",
            f"--inh-caps=-all,{UNIT_CAPS}",
            f"--ambient-caps=-all,{UNIT_CAPS}",
            f"--bounding-set=-all,{UNIT_CAPS}",
            "--no-new-privs",
            "--",
        )
        # The box's directories and the router's own files are its user's, as bootstrap leaves
        # them for the lchat user.
        acme = os.path.join(self.data_dir, "acme")
        for path in (self.data_dir, self.run_dir, self.bucket, acme, self.env_file):
            os.chown(path, self.router_uid, self.router_uid)
        os.chown(os.path.join(acme, "account.key"), self.router_uid, self.router_uid)

    def test_spaces_of_a_router_with_capabilities_have_none(self) -> None:
        router = self.start_router()
        with open(f"/proc/{router.pid}/status") as f:
            seen = dict(line.split(":", 1) for line in f)
        self.assertEqual(seen["Uid"].split()[0], str(self.router_uid), "the router's uid")
        self.assertEqual(int(seen["CapAmb"], 16), UNIT_CAP_BITS, "the router's ambient set")
        result = self.lchat("add-instance", A, "--timeout", "30")
        self.assertEqual(result.code, 0, f"{result}\n{self._log(self.router_log)}")
        result = self.lchat("add-instance", H, "--hibernate")
        self.assertEqual(result.code, 0, f"{result}\n{self._log(self.router_log)}")
        code, body = self.call(H, "GET", "/api/version")  # the activator wakes it
        self.assertEqual(code, 200, body)
        self.assertTargetsExist()
        uids: list[int] = [self.router_uid]
        for host in (A, H):
            own = self.wait_for(host, "own.json")
            uids.append(self.assertItself(host, own, uids))
            self.assertEqual(own["router_pid"], router.pid, f"{host}'s parent is the router")
            self.assertBoxRefused(host, own)


class ReplicationLinkTests(IsolatedBoxTestCase):
    # Found by this test (it failed before lchat/replica/db.py checked which file SQLite opened
    # and wal.py opened O_NOFOLLOW): the replicator opens a hibernating space's database by its
    # path with the router's privilege, after lchat/isolation.py checked the directory at spawn.

    def test_a_space_cannot_point_the_routers_replication_at_another_file(self) -> None:
        """The router replicates a hibernating space's database as root: a space that makes its
        database a symbolic link (to the registry, another space's database) must not have the
        router open, change and upload that file for it (and restore it into the space's own
        directory at its next wake)."""
        registry = os.path.join(self.data_dir, "registry.db")
        self.start_router()
        result = self.lchat("add-instance", H, "--hibernate")
        self.assertEqual(result.code, 0, f"{result}\n{self._log(self.router_log)}")
        with open(hosts.env_path(self.data_dir, H), "a") as f:  # stays 0600: space_env checks
            f.write(f"PROBE_DB_LINK={registry}\n")
        before = self.tables(registry)
        response = admin_client.request(self.http_socket, "GET", "/api/version", host=H, timeout=60)
        self.assertTrue(os.path.islink(hosts.db_path(self.data_dir, H)), "the probe made its link")
        deadline = time.monotonic() + 20
        while "is a link to" not in self._log(self.router_log):
            if time.monotonic() > deadline:
                self.fail(f"no refusal logged:\n{self._log(self.router_log)}")
            time.sleep(0.2)
        self.assertIn(f"is a link to {registry}", self._log(self.router_log))
        self.assertEqual(
            self.tables(registry),
            before,
            f"the router opened (and wrote) the registry through {H}'s database link; the wake"
            f" answered {response.status}",
        )

    def tables(self, path: str) -> list[str]:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            return sorted(row[0] for row in conn.execute("SELECT name FROM sqlite_master"))


class RelayoutAtStartTests(IsolatedBoxTestCase):
    def test_an_older_box_is_relaid_out_when_its_router_starts_isolating(self) -> None:
        """A box from before isolation (flat files, rows naming them) whose router starts with
        isolation on: before any space starts, the space's database moves into its own
        directory (its rows, its contents kept), and the space then runs there as its own user."""
        self.configure(LCHAT_ISOLATION="off", LCHAT_SPACE_COMMAND=PROBE)
        router = self.start_router()
        result = self.lchat("add-instance", A)
        self.assertEqual(result.code, 0, f"{result}\n{self._log(self.router_log)}")
        flat = os.path.join(self.data_dir, f"{A}.db")
        deadline = time.monotonic() + 20
        while not os.path.exists(flat):
            if time.monotonic() > deadline:
                self.fail(f"{A} never made {flat}:\n{self._log(self.router_log)}")
            time.sleep(0.05)
        with contextlib.closing(sqlite3.connect(flat)) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS kept (x)")
            conn.execute("INSERT INTO kept VALUES ('written before the move')")
            conn.commit()
        self._stop_router(router)
        self.configure(LCHAT_ISOLATION="on", LCHAT_SPACE_COMMAND=PROBE)
        self.start_router()
        moved = hosts.db_path(self.data_dir, A)
        self.assertEqual(moved, os.path.join(self.data_dir, "spaces", A, f"{A}.db"))
        self.assertFalse(os.path.exists(flat), "the flat database is gone")
        self.assertIn("relayout:", self._log(self.router_log))
        own = self.wait_for(A, "own.json")  # the probe, from its own directory
        uid = self.assertItself(A, own, [])
        self.assertEqual(os.stat(moved).st_uid, uid)
        with contextlib.closing(sqlite3.connect(f"file:{moved}?mode=ro", uri=True)) as conn:
            self.assertEqual(
                conn.execute("SELECT x FROM kept").fetchall(), [("written before the move",)]
            )
        response = admin_client.request(self.http_socket, "GET", "/api/version", host=A, timeout=30)
        self.assertEqual(response.status, 200)
