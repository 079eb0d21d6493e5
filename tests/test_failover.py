"""Hard-kill failover fenced by box liveness (issue 18, docs/lease.md), end to end: three real
routers on one moto bucket, each box's S3 traffic through its own :class:`tests.tcpproxy.BucketProxy`
so that one box can be cut off from the bucket while its clients still reach it.

Every lease here has a 10 min TTL: a failover that waited for the TTL would time the tests out.

- kill -9 the owner (router and space) under write load: a survivor serves the space within
  ``dead_after`` + one wake, taking the lease over because its holder is dead, with every write
  acknowledged before the kill minus the replication window; then the killed box restarts: it
  reclaims nothing (the survivor keeps the space), and when it later wakes the space itself it
  restores the current copy rather than serving its stale one.
- partition the owner from the bucket (not from its peers or clients): its peers relay its
  heartbeat, it keeps serving, nothing is taken over, and every acknowledged write ships once the
  bucket is back (issue 28). The owner cut off from its peers too is tests/test_mesh_cuts.py's.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread

from tests.tcpproxy import BucketProxy, request_matcher
from tests.test_mesh import DOMAIN, Box, MeshTestCase, _members, request, sleep
from tests.test_relocate_mesh import _admin

HOST = f"fo.{DOMAIN}"
DEAD_AFTER = 1.5  # MeshTestCase's LCHAT_MESH_DEAD_AFTER
REPLICATION_WINDOW = 1.5  # stream ships within ~1 s; plus the upload


class _Writer:
    """Posts numbered messages through ``boxes`` in turn until stopped. ``acks``: (body, box,
    monotonic time the 201 arrived) of every acknowledged write."""

    def __init__(self, boxes: list[Box], ca: str) -> None:
        self.boxes = boxes
        self.ca = ca
        self.acks: list[tuple[str, str, float]] = []
        self.refused = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._n = 0

    def run(self) -> None:
        while not self.stop.is_set():
            with self._lock:
                n = self._n
                self._n += 1
            box = self.boxes[n % len(self.boxes)]
            body = f"w{n}"
            try:
                status, _, _ = request(
                    box,
                    HOST,
                    "/api/rooms/r/messages",
                    "POST",
                    json.dumps({"body": body}).encode(),
                    ca=self.ca,
                )
            except OSError:
                status = 0
            if status == 201:
                self.acks.append((body, box.name, time.monotonic()))
                time.sleep(0.03)
            else:
                self.refused += 1
                time.sleep(0.1)

    def acked_after(self, t: float) -> int:
        return sum(1 for _, _, at in self.acks if at > t)


class _ProxiedMesh(MeshTestCase):
    """Three routers, each box's S3 traffic through its own BucketProxy."""

    timeout = 300

    def proxied(self, n: int = 3) -> tuple[list[Box], dict[str, BucketProxy]]:
        boxes = self.boxes(n, LCHAT_LEASE_TTL="10m")
        proxies: dict[str, BucketProxy] = {}
        for box in boxes:
            proxy = BucketProxy("127.0.0.1", self.server.port).start()
            self.addCleanup(proxy.close)
            box.settings = {  # type: ignore[attr-defined]
                **box.settings,  # type: ignore[attr-defined]
                "LCHAT_HIBERNATE_ENDPOINT": proxy.endpoint,
            }
            box.add_space(HOST)
            proxies[box.name] = proxy
        return boxes, proxies

    def messages(self, box: Box) -> list[str]:
        status, body, _ = request(box, HOST, "/api/rooms/r/messages?limit=1000", ca=self.ca)
        assert status == 200, (box.name, status, body, box.log()[-6000:])
        return [m["body"] for m in json.loads(body)["messages"]]

    def logs(self, *boxes: Box) -> str:
        return "\n".join(f"--- {b.name}\n{b.log()[-5000:]}" for b in boxes)

    @inlineCallbacks
    def owned(self, boxes: list[Box]) -> Any:
        status, body, _ = yield self.req(
            boxes[0], HOST, "/api/rooms/r/messages", "POST", b'{"body": "first"}'
        )
        self.assertEqual(status, 201, body)
        owner = next(b for b in boxes if b.awake(HOST))
        return owner, [b for b in boxes if b is not owner]


class FailoverTests(_ProxiedMesh):
    @inlineCallbacks
    def test_kill_9_of_the_owner_fails_over_within_dead_after_and_a_restart_reclaims_nothing(
        self,
    ) -> Any:
        boxes, _ = self.proxied()
        yield self.start(*boxes)
        owner, survivors = yield self.owned(boxes)
        writer = _Writer(survivors, self.ca)
        running = deferToThread(writer.run)
        try:
            yield self.wait_for(lambda: len(writer.acks) >= 20, timeout=60)
            assert owner.proc is not None
            killed_at = time.monotonic()
            owner.proc.send_signal(signal.SIGKILL)  # the whole box: its router and its space
            owner.kill_spaces()
            yield deferToThread(owner.proc.wait)
            yield self.wait_for(lambda: writer.acked_after(killed_at) >= 1, timeout=60)
            back = min(at for _, _, at in writer.acks if at > killed_at) - killed_at
            mark = time.monotonic()
            yield self.wait_for(lambda: writer.acked_after(mark) >= 10, timeout=60)
        finally:
            writer.stop.set()
            yield running
        # Served again within dead_after + one wake (and the lease's 10 min TTL never mattered).
        self.assertLess(back, DEAD_AFTER + 10.0, self.logs(*survivors))
        taker = [b for b in survivors if b.awake(HOST)]
        self.assertEqual(len(taker), 1, self.logs(*survivors))
        self.assertIn(
            "(holder dead: its box's heartbeat is too old or gone, and it is silent)",
            taker[0].log(),
        )
        final = yield deferToThread(self.messages, taker[0])
        kept = set(final)
        before = [body for body, _, at in writer.acks if at < killed_at - REPLICATION_WINDOW]
        self.assertEqual([b for b in before if b not in kept], [], "acknowledged writes lost")
        after = [body for body, _, at in writer.acks if at > killed_at]
        self.assertEqual([b for b in after if b not in kept], [])

        # The killed box comes back (same URL, new epoch): it takes nothing back.
        owner.start(owner.settings)
        yield self.wait_for(lambda: all(_members(b) == 3 for b in boxes), timeout=30)
        yield sleep(1.0)
        self.assertFalse(owner.awake(HOST))
        got = yield deferToThread(self.messages, owner)  # forwarded to the holder
        self.assertEqual(got, final)
        self.assertEqual([b.name for b in boxes if b.awake(HOST)], [taker[0].name])
        # Woken there later, it restores the current copy, never serving its stale one.
        slept = yield deferToThread(_admin, taker[0], f"/sleep?host={HOST}")
        self.assertEqual(slept[0], 200, slept)
        woke = yield deferToThread(_admin, owner, f"/wake?host={HOST}")
        self.assertEqual(woke[0], 200, woke)
        got = yield deferToThread(self.messages, owner)
        self.assertEqual(got, final, self.logs(owner))
        self.assertIn("moved it to", owner.log())

    @inlineCallbacks
    def test_an_owner_cut_off_from_the_bucket_keeps_serving_on_its_peers_relay(self) -> Any:
        """Issue 28: a box cut off from the bucket (not from its peers or clients) stays alive —
        its peers write its heartbeat into the bucket for it — so nobody takes its space over
        and nothing stands down: every write is acknowledged, waits to ship, and ships once the
        bucket is back. None is lost."""
        boxes, proxies = self.proxied()
        yield self.start(*boxes)
        owner, survivors = yield self.owned(boxes)
        writer = _Writer(boxes, self.ca)  # its clients still reach the owner
        running = deferToThread(writer.run)
        try:
            yield self.wait_for(lambda: len(writer.acks) >= 20, timeout=60)
            proxies[owner.name].cut()
            cut_at = time.monotonic()
            # Well past dead_after: the old rule stood the owner down at 0.9 * dead_after.
            yield sleep(4 * DEAD_AFTER)
            yield self.wait_for(lambda: writer.acked_after(cut_at + 4 * DEAD_AFTER) >= 10)
            self.assertTrue(owner.awake(HOST), self.logs(owner))
            self.assertEqual([b.name for b in survivors if b.awake(HOST)], [])
            proxies[owner.name].pass_through()
            mark = time.monotonic()
            yield self.wait_for(lambda: writer.acked_after(mark) >= 10, timeout=60)
        finally:
            writer.stop.set()
            yield running
        log = owner.log()
        self.assertIn(f"{owner.url} reachable via peer", log)
        self.assertNotIn("standing every space down", log)
        self.assertEqual(writer.refused, 0, self.logs(*boxes))
        # Everything acknowledged reaches the bucket: slept here (the final flush), woken on a
        # peer from the bucket, every acknowledged write is there.
        slept = yield deferToThread(_admin, owner, f"/sleep?host={HOST}")
        self.assertEqual(slept[0], 200, slept)
        woke = yield deferToThread(_admin, survivors[0], f"/wake?host={HOST}")
        self.assertEqual(woke[0], 200, woke)
        final = yield deferToThread(self.messages, survivors[0])
        kept = set(final)
        self.assertEqual(
            [body for body, _, _ in writer.acks if body not in kept], [], "acknowledged writes lost"
        )


class LateWriteTests(_ProxiedMesh):
    """docs/lease.md, "Late writes": an upload the dead owner had sent lands after the takeover."""

    @inlineCallbacks
    def test_a_late_upload_of_the_dead_owner_is_never_read(self) -> Any:
        boxes, proxies = self.proxied()
        yield self.start(*boxes)
        owner, survivors = yield self.owned(boxes)
        yield sleep(2.0)  # "first" is replicated
        # The owner's next level-0 upload is held in flight, then the owner dies.
        proxy = proxies[owner.name]
        proxy.hold(request_matcher("PUT", f"{HOST}/0000/"))
        status, body, _ = yield self.req(
            owner, HOST, "/api/rooms/r/messages", "POST", b'{"body": "late"}'
        )
        self.assertEqual(status, 201, body)  # acknowledged, its upload held
        # Held whole before the owner dies: the client writes the head and the body separately,
        # and a kill between the two leaves an upload that could never land (seen in CI: the
        # held request had its head and no body, and moto answered its delivery 400).
        yield deferToThread(proxy.wait_held, 1, 30.0, complete=True)
        assert owner.proc is not None
        owner.proc.send_signal(signal.SIGKILL)
        owner.kill_spaces()
        yield deferToThread(owner.proc.wait)
        # A survivor takes over (without "late": its upload never landed) and is written to.
        yield self.wait_for(lambda: _served(survivors[0], self.ca), timeout=60)
        status, body, _ = yield self.req(
            survivors[0], HOST, "/api/rooms/r/messages", "POST", b'{"body": "after"}'
        )
        self.assertEqual(status, 201, body)
        taker = next(b for b in survivors if b.awake(HOST))
        yield sleep(2.0)  # "after" is replicated
        # Now the dead owner's upload lands.
        released = proxy.release_held()
        self.assertEqual(len(released), 1)
        answered = yield deferToThread(released[0].wait_answered, 30.0)
        if answered != 200:
            # Seen under CI load: moto answered the delivered request 400 with no body, cause
            # not found. The late upload must land for this test to mean anything: its body,
            # whole (checked), PUT to the same key by the test's own client.
            late = released[0]
            body = late.raw.partition(b"\r\n\r\n")[2]
            self.assertEqual(
                len(body),
                int(late.headers["content-length"]),
                f"{late!r} {late.headers} -> {answered} {late.error_body!r}: held incomplete",
            )
            key = late.path.split("?", 1)[0].split("/", 2)[2]  # /<bucket>/<key>
            stamp = late.headers.get("x-amz-meta-litestream-timestamp", "")
            yield deferToThread(
                self.server.client().put_object,
                Bucket=self.bucket,
                Key=key,
                Body=body,
                Metadata={"litestream-timestamp": stamp} if stamp else {},
            )
        # Whoever restores the space next reads the new owner's lineage only — even when the new
        # owner dies too, before any flush or check of its own could notice the late file.
        assert taker.proc is not None
        taker.proc.send_signal(signal.SIGKILL)
        taker.kill_spaces()
        yield deferToThread(taker.proc.wait)
        other = next(b for b in survivors if b is not taker)
        yield self.wait_for(lambda: _served(other, self.ca), timeout=60)
        got = yield deferToThread(self.messages, other)
        self.assertEqual(got, ["first", "after"], self.logs(other))


def _served(box: Box, ca: str) -> bool:
    status, _, _ = request(box, HOST, "/api/rooms/r/messages", ca=ca)
    return status == 200
