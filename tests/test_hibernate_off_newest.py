"""``lchat hibernate <host> --off`` hands the always-on unit the *newest* copy of the space.

A hibernating space runs wherever its lease is taken, so its last writes may have been made on
another box: this box's ``<data>/<host>.db`` is then older than the bucket's replica, and the unit
serves whatever file it finds. ``--off`` must fetch the newest copy first (the router's activator
restores it under the space's lease), or refuse with what to do and change nothing.

Real parts: a moto S3 server (tests/s3servers.py), two real ``twistd lchat`` routers ("box A",
where the CLI runs in-process, and "box B", with its own data directory and registry over the same
bucket), real reference spaces under builtin units. Its refusals and every other branch are
tested on in-memory seams in test_handover (NewestCopyTests).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

from lchat import admin_client, envfile, hosts
from lchat.hibernation.localdb import MARKER_SUFFIX, local_state, moved_aside
from lchat.registry import Registry, Route
from tests import s3servers
from tests.routerproc import spawn_router
from tests.test_cli import TOKEN
from tests.test_cli_hibernate import HibernateTestCase

HOST = "moved.example.com"


class OffFetchesTheNewestCopyTests(HibernateTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.s3 = s3servers.shared_server_sync("moto")
        self.s3_bucket = self.s3.new_bucket_sync()
        self.s3_settings = {
            "LCHAT_HIBERNATE_BUCKET": self.s3_bucket,
            "LCHAT_HIBERNATE_ENDPOINT": self.s3.endpoint,
            "LCHAT_HIBERNATE_REGION": self.s3.region,
            "AWS_ACCESS_KEY_ID": self.s3.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": self.s3.credentials.secret_key,
        }
        self.configure(**self.s3_settings)
        self.db = hosts.db_path(self.data_dir, HOST)

    # -- box B: another data directory and registry over the same bucket ------------------------

    def start_box_b(self) -> str:
        """Box B's router, with ``HOST`` registered hibernating; returns its HTTP socket."""
        root = os.path.join(self.root, "b")
        data, run = os.path.join(root, "data"), os.path.join(root, "run")
        os.makedirs(data)
        os.makedirs(run)
        http = os.path.join(run, "http.sock")
        settings = {
            **self.settings,
            "LCHAT_DATA_DIR": data,
            "LCHAT_RUN_DIR": run,
            "LCHAT_HTTP_ADDR": f"unix:{http}",
            "LCHAT_BACKUP_CONFIG": os.path.join(root, "litestream.yml"),
        }
        env_file = os.path.join(root, "router.env")
        with open(env_file, "w") as f:
            f.write("LCHAT_UNITS=builtin\n" + "".join(f"{k}={v}\n" for k, v in settings.items()))
        envfile.write_token(hosts.env_path(data, HOST), TOKEN)
        registry = Registry(os.path.join(data, "registry.db"), clock=time.time)
        registry.migrate()
        registry.insert(
            Route(
                host=HOST,
                kind="instance",
                socket=hosts.socket_path(run, HOST),
                db_path=hosts.db_path(data, HOST),
                status="ready",
                hibernate=True,
            )
        )
        router = spawn_router(env_file, os.path.join(root, "router.log"))
        self.addCleanup(self._stop_router, router)
        admin = os.path.join(run, "router.sock")
        deadline = time.monotonic() + 30
        while True:
            try:
                if admin_client.status(admin, timeout=2).status == 200:
                    break
            except (admin_client.Unreachable, admin_client.ProtocolError):
                pass
            self.assertIsNone(router.poll(), "box B's router exited")
            self.assertLess(time.monotonic(), deadline, "box B's router did not come up")
            time.sleep(0.1)
        self.box_b_admin = admin
        return http

    def post_to(self, http_socket: str, text: str) -> None:
        body = json.dumps({"body": text}).encode()
        response = admin_client.request(
            http_socket, "POST", "/api/rooms/lobby/messages", host=HOST, body=body, timeout=60
        )
        self.assertEqual(response.status, 201, response.body)

    def stop(self, router: subprocess.Popen[bytes]) -> None:
        router.send_signal(signal.SIGTERM)  # a drain: every awake space flushed and released
        router.wait(60)

    def newest_written_on_box_b(self) -> None:
        """Writes "one" on box A (which keeps its slept copy and marker), then "two" on box B:
        the bucket's replica is newer than A's file. Box A's router is stopped at the end."""
        self.add_row(HOST, hibernate=True)
        router_a = self.start_router()
        self.post(HOST, "one")
        slept = admin_client.sleep_space(self.admin_socket, HOST, 120)
        self.assertEqual(slept.status, 200, slept.body)
        self.stop(router_a)
        marker_a = local_state(self.db).marker_txid
        self.assertIsNotNone(marker_a)  # A's file is exactly the bucket's state of then
        http_b = self.start_box_b()
        self.post_to(http_b, "two")
        slept = admin_client.sleep_space(self.box_b_admin, HOST, 120)
        self.assertEqual(slept.status, 200, slept.body)
        self.a_before = self.fingerprint()
        self.assertEqual(local_state(self.db).marker_txid, marker_a)

    def fingerprint(self) -> dict[str, Any]:
        names = [n for n in os.listdir(self.data_dir) if n.startswith(HOST)]
        return {n: os.stat(os.path.join(self.data_dir, n)).st_mtime_ns for n in sorted(names)}

    def lock_exists(self) -> bool:
        listed = self.s3.client().list_objects_v2(Bucket=self.s3_bucket, Prefix=f"{HOST}/")
        return any(o["Key"].endswith("/lock.json") for o in listed.get("Contents", []))

    # -- the tests ---------------------------------------------------------------------------

    def test_off_restores_what_another_box_wrote_before_the_unit_starts(self) -> None:
        self.newest_written_on_box_b()
        self.start_router()
        off = self.lchat("hibernate", HOST, "--off", "--timeout", "60")
        self.assertEqual(off.code, 0, off)
        # Every acknowledged write, from both boxes, is in what the always-on unit serves.
        self.assertEqual(self.messages(HOST), ["one", "two"], off)
        self.assertInOrder(
            off.out,
            f"{HOST}: asleep",
            "fetching the newest copy from the bucket under the space's lease",
            f"{HOST}: woken here from the newest copy",
            f"{HOST}: {self.db} is now the newest copy",
            f"{HOST}: hibernate flag cleared",
            f"{HOST} is ready",
        )
        route = self.row(HOST)
        assert route is not None
        self.assertFalse(route.hibernate)
        self.assertEqual(self.process_state(HOST, "ready"), "ready")
        self.assertFalse(self.lock_exists())  # the lease was released before the unit started
        # The stale file was moved aside by the activator, never deleted.
        self.assertEqual(len(moved_aside(self.db)), 1)
        self.assertFalse(os.path.exists(self.db + MARKER_SUFFIX))
        self.post(HOST, "three")  # and the unit owns it from here
        self.assertEqual(self.messages(HOST), ["one", "two", "three"])


class OffRefusalsTests(HibernateTestCase):
    """Refusals that need no S3 server: nothing changes, and the line says what to do."""

    def test_a_bucket_that_cannot_be_read_is_refused(self) -> None:
        # A file: bucket whose directory is a regular file: every LIST fails.
        broken = os.path.join(self.root, "not-a-dir")
        with open(broken, "w") as f:
            f.write("x")
        self.configure(LCHAT_HIBERNATE_BUCKET=f"file:{broken}")
        self.add_row(HOST, hibernate=True)
        off = self.lchat("hibernate", HOST, "--off", "--timeout", "5")
        self.assertFailed(
            off, "cannot read the bucket to check that", f"lchat hibernate {HOST} --off"
        )
        route = self.row(HOST)
        assert route is not None
        self.assertTrue(route.hibernate)
