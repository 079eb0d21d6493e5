"""``lchat relocate`` end to end (issue 17): four real routers in two regions on two different S3
implementations, one mesh.

Region ``ie`` keeps its replicas in a moto bucket, region ``fi`` in a SeaweedFS bucket; the
heartbeats of all four boxes live in a third bucket (``LCHAT_MESH_BUCKET``, on moto), so the two
regions are one mesh. A space homed in ``ie`` is moved to ``fi`` while a client keeps writing to it
through the ``ie`` boxes: every acknowledged write survives, the space ends up awake on an ``fi``
box, the ``ie`` boxes forward to it, the ``fi`` bucket holds a replica the stock ``litestream
restore`` reads, and the ``ie`` bucket keeps no lock; with the ``fi`` boxes gone, the ``ie`` boxes
answer 503 rather than wake their stale copy; a box that was down at the move's fan-out answers
503 moved (the source bucket's marker), never its stale copy, then follows the move. Run on a box
that does not run the space, the command has the box holding its lease sleep it and hold it
asleep (POST /api/mesh/hold), with either implementation as the source. With one shared bucket, the space is served in its new
region and its DNS record follows (Route53 on moto). Every other branch of the command is in
test_relocate_handover, on fakes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import tempfile
import threading
import time
from typing import Any, Literal

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.threads import deferToThread

from lchat import lease
from lchat.lease.lock import read_lock
from lchat.mesh.placement import normalise_member_url
from tests import replicas, s3servers, test_mesh
from tests.test_mesh import DOMAIN, TOKEN, Box, MeshTestCase, request
from tests.test_mesh import _lchat as lchat

HOST = f"moving.{DOMAIN}"


class _Writer:
    """A client posting numbered messages to ``HOST`` through the given boxes in turn until
    stopped; a 503 (held, waking, forwarded to a box that is not ready) is retried after a pause.
    ``acked``: the bodies answered 201."""

    def __init__(self, boxes: list[Box], ca: str) -> None:
        self.boxes = boxes
        self.ca = ca
        self.acked: list[str] = []
        self.answers: dict[int, int] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            box = self.boxes[n % len(self.boxes)]
            body = f"m{n}"
            try:
                status, data, _ = request(
                    box,
                    HOST,
                    "/api/rooms/r/messages",
                    "POST",
                    json.dumps({"body": body}).encode(),
                    ca=self.ca,
                )
            except OSError as e:
                self.errors.append(f"{box.name}: {e}")
                time.sleep(0.2)
                continue
            self.answers[status] = self.answers.get(status, 0) + 1
            if status == 201:
                self.acked.append(body)
                n += 1
                time.sleep(0.05)
            else:
                if status != 503:
                    self.errors.append(f"{box.name}: {status} {data[:200]!r}")
                time.sleep(0.2)

    def acked_since(self, mark: int) -> int:
        return len(self.acked) - mark


class TwoRegionsCase(MeshTestCase):
    """Region ``ie``'s replicas on ``IE_ON``, region ``fi``'s on the other S3 implementation,
    the heartbeats of every box on a third bucket (moto): two regions, one mesh."""

    IE_ON: Literal["moto", "seaweedfs"] = "moto"  # fi's bucket is on the other one

    async def _bucket(self) -> None:
        self.server = await s3servers.shared_server("moto")
        self.mesh_bucket = await self.server.new_bucket()  # every box's heartbeat
        other: Literal["moto", "seaweedfs"] = "seaweedfs" if self.IE_ON == "moto" else "moto"
        self.ie_server = await s3servers.shared_server(self.IE_ON)
        self.bucket = await self.ie_server.new_bucket()  # region ie's replicas
        self.fi_server = await s3servers.shared_server(
            other
        )  # region fi's S3 (SeaweedFS unless IE_ON is)
        self.fi_bucket = await self.fi_server.new_bucket()  # region fi's replicas
        # Each router takes its keys from its env file alone (the process environment would win).
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            saved = os.environ.pop(name, None)
            if saved is not None:
                self.addCleanup(os.environ.__setitem__, name, saved)

    def region_boxes(
        self, names: tuple[str, ...] = ("ie0", "ie1", "fi0", "fi1")
    ) -> tuple[list[Box], list[Box]]:
        ie_s3, fi_s3 = self.ie_server, self.fi_server
        ports = s3servers.free_ports(len(names))
        boxes = [Box(self.root, name, f"127.0.0.{i + 2}", ports[i]) for i, name in enumerate(names)]
        ie_keys = "access_key_env=IE_KEY&secret_key_env=IE_SECRET"
        fi_keys = "access_key_env=FI_KEY&secret_key_env=FI_SECRET"
        heart_keys = "access_key_env=MESH_KEY&secret_key_env=MESH_SECRET"
        ie = f"s3://{self.bucket}/prod?endpoint={ie_s3.endpoint}&region={ie_s3.region}&{ie_keys}"
        fi = f"s3://{self.fi_bucket}/prod?endpoint={fi_s3.endpoint}&region={fi_s3.region}&{fi_keys}"
        common = {
            "LCHAT_HIBERNATE_IDLE": "120s",
            "LCHAT_HIBERNATE_PREFIX": "prod",
            "LCHAT_LEASE_TTL": "60s",  # the relocation's fences must outlast a slow copy
            "LCHAT_MESH_DOMAINS": DOMAIN,
            "LCHAT_MESH_TOKEN": TOKEN,
            "LCHAT_MESH_HEARTBEAT": "300ms",
            "LCHAT_MESH_DEAD_AFTER": "1500ms",
            "LCHAT_MESH_CA_FILE": self.ca,
            "LCHAT_MESH_BUCKET": f"s3://{self.mesh_bucket}/fleet?endpoint={self.server.endpoint}"
            f"&region={self.server.region}&{heart_keys}",
            "LCHAT_REGION_BUCKETS": f"ie={ie},fi={fi}",
            "LCHAT_ACCESS_LOG": "on",
            "IE_KEY": ie_s3.credentials.access_key,
            "IE_SECRET": ie_s3.credentials.secret_key,
            "FI_KEY": fi_s3.credentials.access_key,
            "FI_SECRET": fi_s3.credentials.secret_key,
            "MESH_KEY": self.server.credentials.access_key,
            "MESH_SECRET": self.server.credentials.secret_key,
        }
        for box in boxes:
            server, bucket, region = (
                (ie_s3, self.bucket, "ie")
                if box.name.startswith("ie")
                else (fi_s3, self.fi_bucket, "fi")
            )
            os.makedirs(box.acme, mode=0o700)
            shutil.copy(self.wildcard, box.acme)
            os.chmod(os.path.join(box.acme, os.path.basename(self.wildcard)), 0o600)
            test_mesh.MeshTests._ip_certificate(self, box)  # type: ignore[arg-type]
            box.settings = {  # type: ignore[attr-defined]
                **common,
                "LCHAT_MESH_REGION": region,
                "LCHAT_HIBERNATE_BUCKET": bucket,
                "LCHAT_HIBERNATE_ENDPOINT": server.endpoint,
                "LCHAT_HIBERNATE_REGION": server.region,
                "AWS_ACCESS_KEY_ID": server.credentials.access_key,
                "AWS_SECRET_ACCESS_KEY": server.credentials.secret_key,
            }
            box.add_space(HOST, home_region="ie")
            self.addCleanup(box.kill_spaces)
            self.addCleanup(box.stop, signal.SIGKILL)
        return (
            [b for b in boxes if b.name.startswith("ie")],
            [b for b in boxes if b.name.startswith("fi")],
        )

    def messages(self, box: Box) -> list[str]:
        status, body, _ = request(box, HOST, "/api/rooms/r/messages?limit=1000", ca=self.ca)
        assert status == 200, (box.name, status, body)
        return [m["body"] for m in json.loads(body)["messages"]]

    def logs(self, *boxes: Box) -> str:
        return "\n".join(f"--- {b.name}\n{b.log()[-4000:]}" for b in boxes)


class RelocateAcrossRegionsTests(TwoRegionsCase):
    timeout = 420

    @inlineCallbacks
    def test_a_space_moves_from_moto_to_seaweedfs_while_clients_write(self) -> Any:
        ie, fi = self.region_boxes()
        everyone = [*ie, *fi]
        yield self.start(*everyone)
        status, body, _ = yield self.req(
            ie[0], HOST, "/api/rooms/r/messages", "POST", b'{"body": "before"}'
        )
        self.assertEqual(status, 201, body)
        owners = [b for b in everyone if b.awake(HOST)]
        self.assertEqual(len(owners), 1, self.logs(*everyone))
        source = owners[0]
        self.assertIn(source, ie, "placed outside its home region")

        writer = _Writer(ie, self.ca)
        running = deferToThread(writer.run)
        try:
            yield self.wait_for(lambda: len(writer.acked) >= 10, timeout=60)
            ran = yield deferToThread(
                lchat, "relocate", HOST, "--to", "fi", "--env-file", source.env_file
            )
            self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr + self.logs(*everyone))
            lines = ran.stdout.splitlines()
            self.assertEqual(lines[0], f"relocated {HOST}: ie → fi", lines)
            self.assertIn("store: copied", lines[1])
            self.assertIn("download + re-upload, lock.json excluded", lines[1])
            self.assertTrue(lines[-1].startswith("home_region flipped + route re-fanned-out"))
            for peer in (b for b in everyone if b is not source):
                self.assertIn(f"pushed to {peer.url}: updated", ran.stderr)
            # The writes go on, now served in fi.
            mark = len(writer.acked)
            yield self.wait_for(lambda: writer.acked_since(mark) >= 10, timeout=90)
        finally:
            writer.stop.set()
            yield running
        self.assertEqual(writer.errors, [], self.logs(*everyone))

        # Owned by an fi box; no ie box runs it; both ie boxes forward to it.
        awake = [b.name for b in everyone if b.awake(HOST)]
        self.assertEqual(len(awake), 1, awake)
        self.assertIn(awake[0], ("fi0", "fi1"))
        expected = ["before", *writer.acked]
        for box in everyone:
            got = yield deferToThread(self.messages, box)
            self.assertEqual(got, expected, box.name)
        for box in everyone:
            row = box.registry().get(HOST)
            assert row is not None
            self.assertEqual(row.home_region, "fi", box.name)

        # Asleep (flushed to fi's bucket): the stock litestream restores every acknowledged write.
        owner = next(b for b in fi if b.awake(HOST))
        slept = yield deferToThread(_admin, owner, f"/sleep?host={HOST}")
        self.assertEqual(slept[0], 200, slept)
        restored = os.path.join(tempfile.mkdtemp(dir=self.root), "restored.db")
        yield Deferred.fromCoroutine(
            replicas.litestream_restore(self.fi_server, self.fi_bucket, f"prod/{HOST}", restored)
        )
        with sqlite3.connect(restored) as conn:
            bodies = [r[0] for r in conn.execute("SELECT body FROM messages ORDER BY id")]
        self.assertEqual(bodies, expected)
        # No lock was copied or left behind in ie; fi's lock is its own box's (released now).
        ie_store = s3servers.store_for(self.ie_server, self.bucket)
        self.addCleanup(lambda: Deferred.fromCoroutine(ie_store.close()))
        listed = yield Deferred.fromCoroutine(ie_store.list(f"prod/{HOST}/"))
        ie_keys = [i.key for i in listed]
        self.assertNotIn(lease.lease_key("prod", HOST), ie_keys)

        # Without a live fi box the ie boxes answer 503: they never wake their stale copy.
        for box in fi:
            yield deferToThread(box.stop, signal.SIGTERM)
        yield self.wait_for(lambda: all(test_mesh._members(b) == 2 for b in ie), timeout=20)
        for box in ie:
            status, body, _ = yield self.req(box, HOST)
            self.assertEqual(status, 503, body)
            self.assertFalse(box.awake(HOST))
        # (Logged by whichever ie box placement fell back to; the other forwarded to it.)
        self.assertTrue(
            any("has no live box, and keeps its replica in another bucket" in b.log() for b in ie),
            self.logs(*ie),
        )


class RelocateFromAnyBoxTests(TwoRegionsCase):
    """``lchat relocate`` run on a box that does not run the space: the box holding its lease
    is asked (POST /api/mesh/hold) to sleep it and hold it asleep, the move goes on, and both
    holds are lifted. ``ie`` on moto, ``fi`` on SeaweedFS. The
    command runs on the other ``ie`` box, or, without one, on the destination box."""

    timeout = 240
    BOXES: tuple[str, ...] = ("ie0", "ie1", "fi0")

    @inlineCallbacks
    def test_relocate_from_a_box_that_does_not_run_it(self) -> Any:
        ie, fi = self.region_boxes(self.BOXES)
        everyone = [*ie, *fi]
        yield self.start(*everyone)
        status, body, _ = yield self.req(
            ie[0], HOST, "/api/rooms/r/messages", "POST", b'{"body": "before"}'
        )
        self.assertEqual(status, 201, body)
        holder = next(b for b in everyone if b.awake(HOST))
        self.assertIn(holder, ie)
        here = next((b for b in ie if b is not holder), fi[0])  # where the command runs

        writer = _Writer(ie, self.ca)
        running = deferToThread(writer.run)
        try:
            yield self.wait_for(lambda: len(writer.acked) >= 5, timeout=60)
            ran = yield deferToThread(
                lchat, "relocate", HOST, "--to", "fi", "--env-file", here.env_file
            )
            self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr + self.logs(*everyone))
            self.assertIn(f"{HOST}: asleep on {holder.url} and held asleep there", ran.stderr)
            self.assertEqual(ran.stdout.splitlines()[0], f"relocated {HOST}: ie → fi")
            mark = len(writer.acked)
            yield self.wait_for(lambda: writer.acked_since(mark) >= 5, timeout=60)
        finally:
            writer.stop.set()
            yield running
        self.assertEqual(writer.errors, [], self.logs(*everyone))

        # Answered from its new home: awake on the fi box only, every acknowledged write there.
        self.assertEqual([b.name for b in everyone if b.awake(HOST)], ["fi0"])
        expected = ["before", *writer.acked]
        for box in everyone:
            got = yield deferToThread(self.messages, box)
            self.assertEqual(got, expected, box.name)
        # One writer: fi's lease is the fi box's own (fresh, not copied); ie keeps no lock.
        fi_store = s3servers.store_for(self.fi_server, self.fi_bucket)
        ie_store = s3servers.store_for(self.ie_server, self.bucket)
        self.addCleanup(lambda: Deferred.fromCoroutine(fi_store.close()))
        self.addCleanup(lambda: Deferred.fromCoroutine(ie_store.close()))
        record = yield Deferred.fromCoroutine(read_lock(fi_store, lease.lease_key("prod", HOST)))
        assert record is not None
        self.assertEqual(
            lease.LeaseRecord.parse(record.body).owner, normalise_member_url(fi[0].url)
        )
        gone = yield Deferred.fromCoroutine(read_lock(ie_store, lease.lease_key("prod", HOST)))
        self.assertIsNone(gone)
        # The holder's hold was lifted (and logged there).
        code, status_body = yield deferToThread(holder.admin_call, "GET", "/status")
        self.assertEqual(code, 200)
        self.assertNotIn("held_for", json.loads(status_body)["hosts"].get(HOST, {}))
        self.assertIn("asked this box to sleep it and hold it asleep", holder.log())
        self.assertIn("a peer lifted its hold here (released)", holder.log())


class MissedFanOutTests(TwoRegionsCase):
    """A box that was down during a relocation (it missed the flip's fan-out) and comes back
    before its anti-entropy runs (``LCHAT_MESH_SYNC`` an hour) still places the space in its old
    region, and is its owner there: its wake finds the source bucket's moved marker and answers
    ``503 moved`` (never the old copy), asks the peers for the row at once, and then serves the
    space from its new region. ``ie`` on moto, ``fi`` on SeaweedFS."""

    timeout = 180

    @inlineCallbacks
    def test_a_box_that_missed_the_fan_out_never_wakes_the_old_copy(self) -> Any:
        ie, fi = self.region_boxes(("ie0", "ie1", "fi0"))
        everyone = [*ie, *fi]
        for box in everyone:
            box.settings["LCHAT_MESH_SYNC"] = "1h"  # type: ignore[attr-defined]
        late = ie[1]
        yield self.start(ie[0], fi[0])
        status, body, _ = yield self.req(
            ie[0], HOST, "/api/rooms/r/messages", "POST", b'{"body": "before"}'
        )
        self.assertEqual(status, 201, body)
        ran = yield deferToThread(
            lchat, "relocate", HOST, "--to", "fi", "--env-file", ie[0].env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr + self.logs(ie[0], fi[0]))
        status, body, _ = yield self.req(
            fi[0], HOST, "/api/rooms/r/messages", "POST", b'{"body": "after"}'
        )
        self.assertEqual(status, 201, body)
        # Asleep in fi (awake, its holder's heartbeat would draw the requests there), and the
        # only ie box left is the one that missed it: it owns the space by its stale row.
        slept = yield deferToThread(_admin, fi[0], f"/sleep?host={HOST}")
        self.assertEqual(slept[0], 200, slept)
        yield deferToThread(ie[0].stop, signal.SIGTERM)
        stale = late.registry().get(HOST)
        assert stale is not None
        self.assertEqual(stale.home_region, "ie")
        yield self.start(late)
        yield self.wait_for(lambda: test_mesh._members(late) == 2, timeout=10)

        status, body, headers = yield self.req(late, HOST, "/api/rooms/r/messages?limit=10")
        self.assertEqual(status, 503, body)
        self.assertIn(b"has moved to another region", body)
        self.assertLessEqual(int(headers["retry-after"]), 2)
        self.assertFalse(late.awake(HOST))
        self.assertIn("it missed the relocation's fan-out", late.log())
        # Asked at once, not at its next round: the row follows, and the space is served from
        # fi with every write.
        yield self.wait_for(lambda: _home(late) == "fi", timeout=10)
        got = yield deferToThread(self.messages, late)
        self.assertEqual(got, ["before", "after"])
        self.assertFalse(late.awake(HOST))
        self.assertIn(f"mesh: {HOST} settings gen", late.log())


class _FailoverCase(TwoRegionsCase):
    """One ``ie`` box and one ``fi`` box, both consenting to a regional failover after
    :attr:`GRACE` (``LCHAT_REGION_FAILOVER_AFTER``); the space is homed in ``ie``."""

    timeout = 180
    GRACE = 3.0

    def failover_boxes(self) -> tuple[Box, Box]:
        (ie,), (fi,) = self.region_boxes(("ie0", "fi0"))
        for box in (ie, fi):
            box.settings["LCHAT_REGION_FAILOVER_AFTER"] = f"{self.GRACE:g}s"  # type: ignore[attr-defined]
        return ie, fi

    @inlineCallbacks
    def home_region_gone(self, ie: Box, fi: Box) -> Any:
        """Both started, a write through the ie box (the space awake there, then asleep: in
        ie's bucket), then the ie box killed (its heartbeat ages out). Returns when it died."""
        yield self.start(ie, fi)
        status, body, _ = yield self.req(
            ie, HOST, "/api/rooms/r/messages", "POST", b'{"body": "before"}'
        )
        self.assertEqual(status, 201, body)
        self.assertTrue(ie.awake(HOST), self.logs(ie, fi))
        slept = yield deferToThread(_admin, ie, f"/sleep?host={HOST}")
        self.assertEqual(slept[0], 200, slept)
        yield deferToThread(ie.stop, signal.SIGKILL)
        return time.monotonic()

    @inlineCallbacks
    def answers_until_served(self, box: Box, limit: float) -> Any:
        """GET the messages through ``box`` every 0.2 s until a 200: (the statuses before it,
        the messages then)."""
        seen: list[int] = []
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            status, body, _ = yield self.req(box, HOST, "/api/rooms/r/messages?limit=100")
            if status == 200:
                return seen, [m["body"] for m in json.loads(body)["messages"]]
            self.assertEqual(status, 503, body)
            seen.append(status)
            yield test_mesh.sleep(0.2)
        self.fail(f"not served within {limit:g}s: {self.logs(box)}")


class RegionFailoverTests(_FailoverCase):
    """The space's home region ``ie`` (its bucket on moto) loses its only box; the ``fi`` box
    (its own bucket on SeaweedFS) answers 503 ``region_down`` through the grace, then serves the
    space from ie's bucket under a lease there (nothing of it in fi's bucket); when the ie box
    is back it forwards to the fi box while the space is awake there, and the space goes home
    at its next sleep."""

    @inlineCallbacks
    def test_failover_after_grace_with_consent_serves_the_home_buckets_data(self) -> Any:
        ie, fi = self.failover_boxes()
        died = yield self.home_region_gone(ie, fi)
        refused, got = yield self.answers_until_served(fi, 20)
        served_after = time.monotonic() - died
        self.assertTrue(refused, "served before the grace")
        self.assertGreaterEqual(served_after, self.GRACE)
        self.assertEqual(got, ["before"])
        self.assertTrue(fi.awake(HOST))
        self.assertEqual(fi.status()["hosts"][HOST]["activator"]["bucket_region"], "ie")
        status, body, _ = yield self.req(
            fi, HOST, "/api/rooms/r/messages", "POST", b'{"body": "during"}'
        )
        self.assertEqual(status, 201, body)
        self.assertIn(
            "mesh: regional failover consented (LCHAT_REGION_FAILOVER_AFTER=3s): a space homed "
            "in ie whose",
            fi.log(),
        )
        self.assertIn(f"mesh: {HOST} homed in ie (no live box for", fi.log())
        self.assertIn(
            f"serving from ie's bucket on this box (LCHAT_REGION_FAILOVER_AFTER={self.GRACE:g}s)",
            fi.log(),
        )
        # Its lease is in ie's bucket, naming the fi box; fi's bucket has nothing of it.
        ie_store = s3servers.store_for(self.ie_server, self.bucket)
        fi_store = s3servers.store_for(self.fi_server, self.fi_bucket)
        self.addCleanup(lambda: Deferred.fromCoroutine(ie_store.close()))
        self.addCleanup(lambda: Deferred.fromCoroutine(fi_store.close()))
        record = yield Deferred.fromCoroutine(read_lock(ie_store, lease.lease_key("prod", HOST)))
        assert record is not None
        self.assertEqual(lease.LeaseRecord.parse(record.body).owner, normalise_member_url(fi.url))
        listed = yield Deferred.fromCoroutine(fi_store.list(f"prod/{HOST}/"))
        self.assertEqual([i.key for i in listed], [])

        # The ie box is back: it forwards to the fi box while the space is awake there (once
        # its beats reach fi: until then its requests get a fast 503 holder_unreachable, which a
        # client retries; fc36 asked at once)...
        yield self.start(ie)
        yield self.wait_for(lambda: test_mesh._members(ie) == 2, timeout=10)
        yield self.wait_for(
            lambda: request(ie, HOST, "/api/rooms/r/messages?limit=1000", ca=self.ca)[0] == 200,
            timeout=10,
        )
        got = yield deferToThread(self.messages, ie)
        self.assertEqual(got, ["before", "during"])
        self.assertFalse(ie.awake(HOST))
        # ...and the space goes home at its next sleep (the lease released in ie's bucket), once
        # fi too sees ie's region live again: before that, a request ie forwards finds the
        # region still empty in fi's view, and fi fails over once more (fc41, a loaded machine:
        # fi's first beat answered by ie came a second after ie's own view had both).
        yield self.wait_for(lambda: test_mesh._members(fi) == 2, timeout=10)
        slept = yield deferToThread(_admin, fi, f"/sleep?host={HOST}")
        self.assertEqual(slept[0], 200, slept)
        # (Until fi's next beat says it no longer holds it, ie forwards to fi, which answers a
        # fast 503 region_down: a client retries.)
        yield self.wait_for(
            lambda: request(ie, HOST, "/api/rooms/r/messages?limit=1000", ca=self.ca)[0] == 200,
            timeout=10,
        )
        got = yield deferToThread(self.messages, ie)
        self.assertEqual(got, ["before", "during"])
        self.assertTrue(ie.awake(HOST), self.logs(ie, fi))
        self.assertFalse(fi.awake(HOST))


class HomeBucketDownTests(_FailoverCase):
    """The space's home region ``ie`` on SeaweedFS (fi on moto), its box gone and its bucket
    paused (SIGSTOP: nothing answers): the fi box answers 503 throughout, past the grace, never
    a wake of another copy; once the bucket answers again, the failover serves it."""

    IE_ON = "seaweedfs"

    @inlineCallbacks
    def test_home_bucket_down_never_fails_over(self) -> Any:
        ie, fi = self.failover_boxes()
        died = yield self.home_region_gone(ie, fi)
        yield deferToThread(self.ie_server.pause)
        due = "failing over is due, but its home bucket did not answer"
        try:
            # 503 throughout: through the grace, and past it until the fi box says why.
            while due not in fi.log():
                self.assertLess(time.monotonic() - died, 30, self.logs(fi))
                status, body, _ = yield self.req(fi, HOST, "/api/rooms/r/messages?limit=100")
                self.assertEqual(status, 503, body)
                yield test_mesh.sleep(0.2)
            self.assertGreaterEqual(time.monotonic() - died, self.GRACE)
        finally:
            yield deferToThread(self.ie_server.resume)
        self.assertFalse(fi.awake(HOST))
        # Back: served from it (the consent was there all along).
        _, got = yield self.answers_until_served(fi, 20)
        self.assertEqual(got, ["before"])


class RelocateSharedBucketTests(MeshTestCase):
    timeout = 240

    @inlineCallbacks
    def test_shared_bucket_moves_the_space_and_its_dns_record(self) -> Any:
        from tests.test_dns01 import _moto_server

        boxes = self.boxes(3, LCHAT_MESH_REGION="ie")
        boxes[2].settings = {**boxes[2].settings, "LCHAT_MESH_REGION": "fi"}  # type: ignore[attr-defined]
        for box in boxes:
            test_mesh.MeshTests._ip_certificate(self, box)  # type: ignore[arg-type]
            box.add_space(HOST, home_region="ie")
        yield self.start(*boxes)
        status, body, _ = yield self.req(
            boxes[0], HOST, "/api/rooms/r/messages", "POST", b'{"body": "kept"}'
        )
        self.assertEqual(status, 201, body)
        source = next(b for b in boxes if b.awake(HOST))
        self.assertIsNot(source, boxes[2])
        # The CLI's env file: the router's, plus Route53 (moto's open mode) as the DNS provider.
        dns = yield deferToThread(_moto_server)
        r53 = dns.client("route53")
        zone = r53.create_hosted_zone(Name=DOMAIN, CallerReference=str(time.time_ns()))
        zone_id = zone["HostedZone"]["Id"].rsplit("/", 1)[-1]
        cli_env = os.path.join(self.root, "cli.env")
        with open(source.env_file) as f, open(cli_env, "w") as out:
            out.write(f.read())
            out.write(
                f"LCHAT_ACME_DIRECTORY=http://127.0.0.1:9/directory\nLCHAT_DNS_PROVIDER=route53\n"
                f"LCHAT_ROUTE53_ENDPOINT={dns.endpoint}\nLCHAT_ROUTE53_ZONE_ID={zone_id}\n"
            )
        ran = yield deferToThread(
            lchat, "relocate", HOST, "--to", "fi", "--move-dns", "--json", "--env-file", cli_env
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        steps = json.loads(ran.stdout)
        self.assertEqual(steps["store"], {"copied": False, "why": "shared bucket"})
        self.assertEqual(steps["placement"], {"region": "fi", "live_boxes": [boxes[2].url]})
        self.assertEqual((steps["dns"]["before"], steps["dns"]["after"]), ([], [boxes[2].address]))
        records = r53.list_resource_record_sets(HostedZoneId=zone_id)["ResourceRecordSets"]
        a_sets = [r for r in records if r["Type"] == "A"]
        self.assertEqual(
            [(r["Name"].rstrip("."), [v["Value"] for v in r["ResourceRecords"]]) for r in a_sets],
            [(HOST, [boxes[2].address])],
        )
        # Served in fi now (the shared bucket), reachable through every box.
        yield self.wait_for(lambda: self._served_everywhere(boxes), timeout=60)
        self.assertTrue(boxes[2].awake(HOST))

    def _served_everywhere(self, boxes: list[Box]) -> bool:
        for box in boxes:
            status, body, _ = request(box, HOST, "/api/rooms/r/messages", ca=self.ca)
            if status != 200 or [m["body"] for m in json.loads(body)["messages"]] != ["kept"]:
                return False
        return True


def _home(box: Box) -> str | None:
    row = box.registry().get(HOST)
    return row.home_region if row is not None else None


def _admin(box: Box, path: str) -> tuple[int, bytes]:
    """``POST path`` on the box's admin socket."""
    return box.admin_call("POST", path, timeout=60)
