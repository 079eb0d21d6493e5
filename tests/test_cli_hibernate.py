"""``lchat hibernate``, ``lchat replication`` and the hibernation side of ``instances`` and
``add-instance``, end to end.

The CLI runs in-process (as in test_cli); where a router is needed it is a real ``twistd lchat``
process with a ``file:`` hibernation bucket, running real reference spaces (builtin units and the
activator). ``systemctl`` is a recording stand-in on PATH that starts and stops real reference
spaces the way systemd would run ``lchat@<host>``. Every branch of the hand-over itself is tested
on in-memory seams in test_handover; here, the promises end to end.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from typing import Any

from lchat import admin_client, envfile, hosts
from lchat.backup import litestream_yml
from lchat.hibernation.localdb import MARKER_SUFFIX
from lchat.registry import Route
from tests.routerproc import kill_spaces_under, spawn_router
from tests.test_cli import REPO, TOKEN, CliTestCase, Result, _gone, token_from

SPACE = f"env PYTHONPATH={REPO} {sys.executable} -m lchat.space"
SIDECAR = f"env PYTHONPATH={REPO} {sys.executable} -m lchat.space.sidecar"
BOT_TOKEN = "b0t-token-for-tests-0123456789"

# systemctl as far as lchat can tell: records its argv; `enable --now lchat@H` runs the reference
# space as systemd's lchat@.service would (env file + LCHAT_HOST/SOCKET/DB), `disable --now
# lchat@H` stops it and waits; sidecar units are only recorded.
SYSTEMCTL = """#!{python}
import json, os, signal, subprocess, sys, time
sys.path.insert(0, {repo!r})
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
unit = args[-1]
pidfile = os.path.join({pids!r}, unit + ".pid")

def alive(pid):
    try:
        with open(f"/proc/{{pid}}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

def running():
    if not os.path.exists(pidfile):
        return None
    with open(pidfile) as f:
        pid = int(f.read())
    return pid if alive(pid) else None

if not unit.startswith("lchat@"):
    sys.exit(0)
host = unit.split("@", 1)[1]
if args[:2] == ["enable", "--now"] and running() is None:
    from lchat import config
    env = dict(os.environ)
    env.update(config.read_env_file(os.path.join({data!r}, host + ".env"), must_exist=True))
    env.update(LCHAT_HOST=host, LCHAT_SOCKET=os.path.join({run!r}, host + ".sock"),
               LCHAT_DB=os.path.join({data!r}, host + ".db"), PYTHONPATH={repo!r})
    with open({space_log!r}, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "lchat.space"], env=env,
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True)
    with open(pidfile, "w") as f:
        f.write(str(child.pid))
elif args[:2] == ["disable", "--now"]:
    pid = running()
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if os.path.exists(pidfile):
        os.unlink(pidfile)
"""


class HibernateTestCase(CliTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.bucket = os.path.join(self.root, "bucket")
        os.mkdir(self.bucket)
        self.http_socket = os.path.join(self.run_dir, "http.sock")
        self.backup_config = os.path.join(self.root, "litestream.yml")
        self.settings: dict[str, str] = {}
        self.configure()

    def configure(self, units: str = "builtin", **extra: str) -> None:
        """The router's env file, which the CLI reads too (both agree on every path)."""
        self.settings = {
            "LCHAT_DATA_DIR": self.data_dir,
            "LCHAT_RUN_DIR": self.run_dir,
            "LCHAT_HTTP_ADDR": f"unix:{self.http_socket}",
            "LCHAT_HTTPS_ADDR": "off",
            "LCHAT_SPACE_COMMAND": SPACE,
            "LCHAT_SIDECAR_COMMAND": SIDECAR,
            "LCHAT_HIBERNATE_BUCKET": f"file:{self.bucket}",
            "LCHAT_HIBERNATE_IDLE": "15m",  # nothing sleeps on its own during a test
            "LCHAT_LEASE_TTL": "30s",
            "LCHAT_BACKUP_CONFIG": self.backup_config,
            **extra,
        }
        self.write_router_env(units=units, **self.settings)

    # -- a real router -----------------------------------------------------------------------

    router_prefix: tuple[str, ...] = ()  # what the router is started through (setpriv ...)

    def start_router(self) -> subprocess.Popen[bytes]:
        log_path = os.path.join(self.root, "router.log")
        router = spawn_router(self.env_file, log_path, self.router_prefix)
        self.addCleanup(self._stop_router, router)
        deadline = time.monotonic() + 30
        while True:
            if router.poll() is not None:
                self.fail(f"the router exited with {router.returncode}:\n{self._log(log_path)}")
            try:
                if admin_client.status(self.admin_socket, timeout=2).status == 200:
                    return router
            except (admin_client.Unreachable, admin_client.ProtocolError):
                pass
            if time.monotonic() > deadline:
                self.fail(f"the router did not come up:\n{self._log(log_path)}")
            time.sleep(0.1)

    def _stop_router(self, router: subprocess.Popen[bytes]) -> None:
        if router.poll() is None:
            router.send_signal(signal.SIGTERM)  # it drains: every awake space flushed, released
            try:
                router.wait(60)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait(10)
        kill_spaces_under(self.root)  # anything a killed router left behind

    def _log(self, path: str) -> str:
        with open(path, errors="replace") as f:
            return f.read()[-4000:]

    def router_entry(self, host: str) -> dict[str, Any]:
        entry: dict[str, Any] = admin_client.status(self.admin_socket).json()["hosts"][host]
        return entry

    def process_state(self, host: str, expected: str, within: float = 10.0) -> str:
        """The supervisor's state of ``host``'s process once it is ``expected`` (or the last seen
        after ``within`` s): it marks a child ready on its own probe, a moment after the child
        first answers on its socket (all that the CLI's health check waits for)."""
        deadline = time.monotonic() + within
        while True:
            state = str(self.router_entry(host).get("process", {}).get("state"))
            if state == expected or time.monotonic() > deadline:
                return state
            time.sleep(0.05)

    # -- talking to a space through the router ----------------------------------------------

    def call(self, host: str, method: str, path: str, body: object = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        response = admin_client.request(
            self.http_socket, method, path, host=host, body=data, timeout=60
        )
        return response.status, json.loads(response.body) if response.body else None

    def post(self, host: str, text: str) -> None:
        code, body = self.call(host, "POST", "/api/rooms/lobby/messages", {"body": text})
        self.assertEqual(code, 201, body)

    def messages(self, host: str) -> list[str]:
        code, body = self.call(host, "GET", "/api/rooms/lobby/messages")
        self.assertEqual(code, 200, body)
        return [m["body"] for m in body["messages"]]

    # -- the box's files ----------------------------------------------------------------------

    def add_row(self, host: str, **row: Any) -> Route:
        """A registered instance with its env file, as add-instance leaves it."""
        envfile.write_token(hosts.env_path(self.data_dir, host), TOKEN)
        self.registry.migrate()
        fields: dict[str, Any] = {"status": "ready"}
        fields.update(row)
        return self.registry.insert(
            Route(
                host=host,
                kind="instance",
                socket=hosts.socket_path(self.run_dir, host),
                db_path=hosts.db_path(self.data_dir, host),
                **fields,
            )
        )

    def bucket_files(self, host: str) -> list[str]:
        top = os.path.join(self.bucket, "objects", f"{host}@d")
        return sorted(
            os.path.relpath(os.path.join(d, n), top)
            for d, _, names in os.walk(top)
            for n in names
            if not n.startswith("@t")
        )

    def lease_held(self, host: str) -> bool:
        return "lock.json@o" in self.bucket_files(host)

    def replica_files(self, host: str) -> list[str]:
        return [f for f in self.bucket_files(host) if f.endswith(".ltx@o")]

    def write_backup_config(self, *dbs: str) -> None:
        lines = ["# written by fleet-backup.sh", "dbs:"]
        for db in dbs:
            lines += [
                f'  - path: "{db}"  # {os.path.basename(db)}',
                "    replicas:",
                "      - type: s3",
                "        bucket: fleet-backups",
                f"        path: {os.path.basename(db)}",
            ]
        with open(self.backup_config, "w") as f:
            f.write("\n".join(lines) + "\n")

    def instances(self) -> dict[str, dict[str, str]]:
        result = self.lchat("instances")
        self.assertEqual(result.code, 0, result)
        lines = [ln for ln in result.out.splitlines() if not ln.startswith("  ")]
        header = lines[0].split()
        return {
            cells[0]: dict(zip(header, cells, strict=True))
            for cells in (ln.split() for ln in lines[1:])
        }

    def fake_units(self) -> str:
        """The recording, space-running systemctl first on PATH; returns its argv log."""
        bin_dir = os.path.join(self.root, "bin")
        pids = os.path.join(self.root, "units")
        os.makedirs(bin_dir, exist_ok=True)
        os.makedirs(pids, exist_ok=True)
        log = os.path.join(self.root, "systemctl.log")
        script = os.path.join(bin_dir, "systemctl")
        with open(script, "w") as f:
            f.write(
                SYSTEMCTL.format(
                    python=sys.executable,
                    repo=REPO,
                    log=log,
                    pids=pids,
                    data=self.data_dir,
                    run=self.run_dir,
                    space_log=os.path.join(self.root, "space.log"),
                )
            )
        os.chmod(script, 0o755)
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        self.addCleanup(self._stop_units, pids)
        return log

    def _stop_units(self, pids: str) -> None:
        for name in os.listdir(pids):
            with open(os.path.join(pids, name)) as f:
                pid = int(f.read())
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + 5
                while not _gone(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _gone(pid):
                    break

    def unit_running(self, unit: str) -> bool:
        path = os.path.join(self.root, "units", unit + ".pid")
        if not os.path.exists(path):
            return False
        with open(path) as f:
            return not _gone(int(f.read()))

    def assertInOrder(self, text: str, *fragments: str) -> None:
        positions = []
        for fragment in fragments:
            self.assertIn(fragment, text)
            positions.append(text.index(fragment))
        self.assertEqual(positions, sorted(positions), text)


# --- hibernate --on / --off with a real router ---------------------------------------------------


class RoundTripTests(HibernateTestCase):
    def test_builtin_round_trip_keeps_the_data(self) -> None:
        host = "rt.example.com"
        self.start_router()
        result = self.lchat("add-instance", host, "--timeout", "30")
        self.assertEqual(result.code, 0, result)
        self.post(host, "before")

        on = self.lchat("hibernate", host, "--on")
        self.assertEqual(on.code, 0, on)
        self.assertInOrder(
            on.out,
            f"{host}: {host}.env: already owned by",
            f"{host}: hibernate flag set",
            "the router stops running it as a builtin unit on reload",
            f"{host}: router reloaded",
            f"{host}: awake after the warm request",
        )
        route = self.row(host)
        assert route is not None
        self.assertEqual((route.hibernate, route.status), (True, "ready"))
        # The warm request woke it under the lease: no member request was needed.
        self.assertTrue(self.lease_held(host))
        self.assertEqual(self.instances()[host]["STATE"], "awake")
        self.assertEqual(self.router_entry(host)["state"], "awake")
        self.post(host, "while hibernating")

        off = self.lchat("hibernate", host, "--off")
        self.assertEqual(off.code, 0, off)
        self.assertInOrder(
            off.out,
            f"{host}: asleep (flushed to the bucket, lease released)",
            f"{host}: hibernate flag cleared",
            f"{host}: router reloaded",
            f"{host} is ready",
        )
        route = self.row(host)
        assert route is not None
        self.assertEqual((route.hibernate, route.next_due), (False, 0))
        self.assertFalse(self.lease_held(host))
        self.assertTrue(self.replica_files(host))  # the parked copy the activator flushed
        self.assertFalse(os.path.exists(route.db_path + MARKER_SUFFIX))
        self.assertEqual(self.messages(host), ["before", "while hibernating"])
        row = self.instances()[host]
        self.assertEqual((row["HIBERNATE"], row["STATE"]), ("off", "ready"))
        self.assertEqual(self.process_state(host, "ready"), "ready")

        # Both directions are idempotent: already in place, the remaining steps are harmless.
        again = self.lchat("hibernate", host, "--off")
        self.assertEqual(again.code, 0, again)
        self.assertIn("flag already off", again.out)
        self.assertEqual(self.messages(host), ["before", "while hibernating"])

    def test_systemd_round_trip_calls_units_in_order(self) -> None:
        host = "sd.example.com"
        self.configure(units="systemd")
        log = self.fake_units()
        self.start_router()
        result = self.lchat("add-instance", host, "--timeout", "30")
        self.assertEqual(result.code, 0, result)
        self.post(host, "under systemd")
        # A staged bot sidecar: its unit is stopped first on --on and started last on --off.
        with open(hosts.env_path(self.data_dir, host), "a") as f:
            f.write(f"LCHAT_BOT_TOKEN={BOT_TOKEN}\n")
        envfile.write_token(hosts.bot_env_path(self.data_dir, host), TOKEN)
        with open(hosts.bot_env_path(self.data_dir, host), "a") as f:
            f.write(f"LCHAT_BOT_TOKEN={BOT_TOKEN}\n")

        on = self.lchat("hibernate", host, "--on")
        self.assertEqual(on.code, 0, on)
        self.assertInOrder(
            on.out,
            f"{host}: hibernate flag set",
            f"stopped and disabled lchat-bot@{host}",
            f"stopped and disabled lchat@{host}",
            f"{host}: router reloaded",
            f"{host}: awake after the warm request",
        )
        self.assertFalse(self.unit_running(f"lchat@{host}"))
        self.assertEqual(self.router_entry(host)["state"], "awake")
        self.post(host, "hibernating")

        off = self.lchat("hibernate", host, "--off")
        self.assertEqual(off.code, 0, off)
        self.assertInOrder(
            off.out,
            f"{host}: asleep",
            f"{host}: hibernate flag cleared",
            f"{host}: router reloaded",
            f"enabled and started lchat@{host}",
            f"{host} is ready",
            f"enabled and started lchat-bot@{host}",
        )
        self.assertEqual(
            self.systemctl_calls(log),
            [
                ["enable", "--now", f"lchat@{host}"],  # add-instance
                ["disable", "--now", f"lchat-bot@{host}"],
                ["disable", "--now", f"lchat@{host}"],
                ["enable", "--now", f"lchat@{host}"],
                ["enable", "--now", f"lchat-bot@{host}"],
            ],
        )
        self.assertTrue(self.unit_running(f"lchat@{host}"))
        self.assertFalse(self.lease_held(host))
        route = self.row(host)
        assert route is not None
        self.assertEqual((route.hibernate, route.status), (False, "ready"))
        self.assertEqual(self.messages(host), ["under systemd", "hibernating"])


# --- add-instance --hibernate --------------------------------------------------------------------


class BornAsleepTests(HibernateTestCase):
    def test_born_asleep_wakes_on_its_first_request(self) -> None:
        host = "born.example.com"
        self.start_router()
        result = self.lchat("add-instance", host, "--hibernate", "--replication", "daily")
        self.assertEqual(result.code, 0, result)
        self.assertIn(f"{host} is registered, asleep (daily replication)", result.out)
        token = token_from(result.out)
        env = hosts.env_path(self.data_dir, host)
        self.assertEqual(stat.S_IMODE(os.stat(env).st_mode), 0o600)
        self.assertEqual(self.env_token(host), token)
        route = self.row(host)
        assert route is not None
        self.assertEqual(
            (route.status, route.hibernate, route.replication), ("ready", True, "daily")
        )
        # Nothing runs and no database exists until the first request.
        self.assertFalse(os.path.exists(route.db_path))
        self.assertEqual(self.instances()[host]["STATE"], "asleep")
        self.assertNotIn("process", self.router_entry(host))

        code, body = self.call(host, "GET", "/api/version")
        self.assertEqual(code, 200, body)
        self.assertEqual(self.instances()[host]["STATE"], "awake")
        self.assertTrue(os.path.exists(route.db_path))
        self.post(host, "first words")
        self.assertEqual(self.messages(host), ["first words"])

        # The replication class, changed through the CLI, is what the router serves next.
        changed = self.lchat("replication", host, "batched")
        self.assertEqual(changed.code, 0, changed)
        self.assertIn(f"{host}: replication daily -> batched", changed.out)
        self.assertEqual(self.router_entry(host)["replication"], "batched")

    def test_refused_while_the_backup_config_lists_it(self) -> None:
        host = "listed.example.com"
        self.write_backup_config(hosts.db_path(self.data_dir, host))
        result = self.lchat("add-instance", host, "--hibernate")
        self.assertFailed(
            result, "backup replicator still tracks", "regenerate the backup config", "nothing was"
        )
        self.assertIsNone(self.row(host))
        self.assertFalse(os.path.exists(hosts.env_path(self.data_dir, host)))

    def test_removes_a_clean_sleep_marker_it_cannot_vouch_for(self) -> None:
        host = "again.example.com"
        db = hosts.db_path(self.data_dir, host)
        with open(db + MARKER_SUFFIX, "w") as f:
            f.write('{"txid": 7}')
        self.assertEqual(self.lchat("add-instance", host, "--hibernate").code, 0)
        self.assertFalse(os.path.exists(db + MARKER_SUFFIX))


# --- the backup replicator's config --------------------------------------------------------------


class BackupRefusalTests(HibernateTestCase):
    host = "bk.example.com"

    def setUp(self) -> None:
        super().setUp()
        self.configure(units="systemd")
        self.log = self.fake_units()
        self.db = self.add_row(self.host).db_path

    def test_variable_from_the_environment(self) -> None:
        elsewhere = os.path.join(self.root, "elsewhere.yml")
        with open(elsewhere, "w") as f:
            f.write(f"dbs:\n  - {{path: {self.db}, replicas: [{{url: 's3://b/x'}}]}}\n")
        os.environ["LCHAT_BACKUP_CONFIG"] = elsewhere
        self.assertFailed(self.lchat("hibernate", self.host, "--on"), f"({elsewhere} lists it)")

    def test_absent_config_tracks_nothing(self) -> None:
        self.assertFalse(os.path.exists(self.backup_config))
        self.assertEqual(self.lchat("hibernate", self.host, "--on").code, 0)

    def test_unreadable_config_refuses(self) -> None:
        os.mkdir(self.backup_config)  # a directory: reading it fails even for root
        result = self.lchat("hibernate", self.host, "--on")
        self.assertFailed(result, "cannot read the backup config", "LCHAT_BACKUP_CONFIG")
        route = self.row(self.host)
        assert route is not None
        self.assertFalse(route.hibernate)


class BackupScanTests(HibernateTestCase):
    def test_path_entries_in_every_spelling(self) -> None:
        text = "\n".join(
            [
                "# path: /data/commented.db",
                "dbs:",
                "  - path: /data/plain.db",
                "  - path: '/data/single.db' # a comment",
                '  -   "path":   "/data/double # not a comment.db"',
                "  - {path: /data/flow.db, replicas: [{url: 's3://b/flow'}]}",
                "  - replicas: [{type: s3, path: replica-path}]",
                "    path: /data/after.db",
            ]
        )
        self.assertEqual(
            litestream_yml.db_paths(text),
            [
                "/data/plain.db",
                "/data/single.db",
                "/data/double # not a comment.db",
                "/data/flow.db",
                "replica-path",
                "/data/after.db",
            ],
        )

    def test_same_file_through_a_symlink(self) -> None:
        real_dir = os.path.join(self.root, "real")
        os.mkdir(real_dir)
        link = os.path.join(self.root, "link")
        os.symlink(real_dir, link)
        with open(self.backup_config, "w") as f:
            f.write(f"dbs:\n  - path: {link}/x.example.com.db\n")
        self.assertTrue(litestream_yml.tracks(self.backup_config, f"{real_dir}/x.example.com.db"))
        self.assertTrue(litestream_yml.tracks(self.backup_config, f"{real_dir}//x.example.com.db"))
        self.assertFalse(
            litestream_yml.tracks(self.backup_config, f"{real_dir}/x.example.com.db-wal")
        )
        self.assertFalse(litestream_yml.tracks(os.path.join(self.root, "absent.yml"), "/data/x.db"))


# --- env file ownership ----------------------------------------------------------------------------


class OwnershipTests(HibernateTestCase):
    def test_already_right_says_so(self) -> None:
        host = "own.example.com"
        self.add_row(host)
        result = self.lchat("hibernate", host, "--on")
        self.assertEqual(result.code, 0, result)
        self.assertIn(f"{host}: {host}.env: already owned by", result.out)
        self.assertIn("with mode 0600", result.out)

    def test_handed_to_the_routers_user_never_loosened(self) -> None:
        if os.geteuid() != 0:
            self.skipTest("only root can change a file's owner")
        host = "chown.example.com"
        self.add_row(host)
        env = hosts.env_path(self.data_dir, host)
        bot = hosts.bot_env_path(self.data_dir, host)
        envfile.write_token(bot, TOKEN)
        os.chown(env, 65534, 65534)  # as a hand copy might leave it: someone else's, too open
        os.chmod(env, 0o640)
        os.chown(bot, 65534, 65534)
        os.chmod(bot, 0o400)
        registry = os.stat(self.registry.path)
        result = self.lchat("hibernate", host, "--on")
        self.assertEqual(result.code, 0, result)
        for path, mode in ((env, 0o600), (bot, 0o400)):
            st = os.stat(path)
            self.assertEqual((st.st_uid, st.st_gid), (registry.st_uid, registry.st_gid))
            self.assertEqual(stat.S_IMODE(st.st_mode), mode)
        [env_line] = [ln for ln in result.out.splitlines() if f"{host}.env: " in ln]
        self.assertIn("65534", env_line)
        self.assertIn("mode 0640 -> 0600", env_line)
        self.assertIn(f"{host}-bot.env: owner", result.out)


# --- replication, instances, unknown hosts ---------------------------------------------------------


class ReplicationTests(HibernateTestCase):
    def test_get_set_and_invalid(self) -> None:
        host = "rep.example.com"
        self.add_row(host, hibernate=True)
        self.assertEqual(self.lchat("replication", host), Result(0, "stream\n", ""))
        result = self.lchat("replication", host, "daily")
        self.assertEqual(result.code, 0, result)
        self.assertIn(f"{host}: replication stream -> daily", result.out)
        self.assertIn("from its next wake", result.err)
        self.assertEqual(self.lchat("replication", host.upper()).out, "daily\n")
        same = self.lchat("replication", host, "daily")
        self.assertEqual(same.code, 0, same)
        self.assertIn("already daily; nothing changed", same.out)
        bad = self.lchat("replication", host, "hourly")
        self.assertEqual(bad.code, 2, bad)
        self.assertIn("'hourly' is not a replication class", bad.err)
        route = self.row(host)
        assert route is not None
        self.assertEqual(route.replication, "daily")

    def test_not_for_services(self) -> None:
        self.registry.migrate()
        self.registry.insert(
            Route("svc.example.com", kind="service", socket="/srv/s.sock", status="ready")
        )
        self.assertFailed(self.lchat("replication", "svc.example.com", "daily"), "is a service")
        self.assertFailed(self.lchat("hibernate", "svc.example.com", "--on"), "is a service")


class InstancesTests(HibernateTestCase):
    def test_state_unknown_without_a_router_and_next_due_in_utc(self) -> None:
        self.add_row("due.example.com", hibernate=True, next_due=1_767_225_600)
        self.add_row("plain.example.com")
        rows = self.instances()
        self.assertEqual(
            rows["due.example.com"],
            {
                "HOST": "due.example.com",
                "KIND": "instance",
                "STATUS": "ready",
                "STATE": "?",
                "VERSION": "-",
                "HIBERNATE": "on",
                "REPLICATION": "stream",
                "NEXT-DUE": "2026-01-01T00:00:00Z",
                "SOCKET": hosts.socket_path(self.run_dir, "due.example.com"),
            },
        )
        self.assertEqual(rows["plain.example.com"]["NEXT-DUE"], "-")

    def test_state_from_the_running_router(self) -> None:
        # Due far in the future: the due sweep leaves it asleep.
        self.add_row("sleepy.example.com", hibernate=True, next_due=4_102_444_800)
        self.add_row("broken.example.com", status="failed", last_error="boom")
        os.unlink(hosts.env_path(self.data_dir, "broken.example.com"))  # cannot start
        self.start_router()
        rows = self.instances()
        self.assertEqual(rows["sleepy.example.com"]["STATE"], "asleep")
        self.assertEqual(rows["sleepy.example.com"]["NEXT-DUE"], "2100-01-01T00:00:00Z")
        self.assertEqual(rows["broken.example.com"]["STATE"], "failed")
        # The JSON carries every column of the table, STATE included.
        result = self.lchat("instances", "--json")
        self.assertEqual(result.code, 0, result)
        states = {row["host"]: row["state"] for row in json.loads(result.out)}
        self.assertEqual(states, {"sleepy.example.com": "asleep", "broken.example.com": "failed"})


class UnknownHostTests(HibernateTestCase):
    def test_unknown_host_is_an_error(self) -> None:
        for argv in (
            ("hibernate", "ghost.example.com", "--on"),
            ("hibernate", "ghost.example.com", "--off"),
            ("replication", "ghost.example.com"),
            ("replication", "ghost.example.com", "daily"),
        ):
            self.assertFailed(self.lchat(*argv), "ghost.example.com is not registered")

    def test_on_or_off_is_required(self) -> None:
        self.add_row("x.example.com")
        self.assertEqual(self.lchat("hibernate", "x.example.com").code, 2)
        self.assertEqual(self.lchat("hibernate", "x.example.com", "--on", "--off").code, 2)

    def test_on_needs_a_bucket(self) -> None:
        self.configure(LCHAT_HIBERNATE_BUCKET="")
        self.add_row("nb.example.com")
        self.assertFailed(
            self.lchat("hibernate", "nb.example.com", "--on"), "LCHAT_HIBERNATE_BUCKET"
        )
        route = self.row("nb.example.com")
        assert route is not None
        self.assertFalse(route.hibernate)
