"""``lchat relocate`` (lchat.handover.relocate) on the hand-over seams and a fake clock: the admin
API's real resource over a scripted activator (its hold), recording peers (their live members and
answers) and DNS, and real FileStores as the region buckets. The real S3 stores (moto, SeaweedFS,
the stock litestream reading the copy back) are in test_relocate; real routers in two regions in
test_relocate_mesh."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import attrs
from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred, fail

from lchat import admin_client, config, lease
from lchat.handover.relocate import Relocation
from lchat.hibernation import moved
from lchat.mesh import api
from lchat.mesh.members import Member
from lchat.objstore import StoreUnavailable
from lchat.objstore.file import FileBucket, FileStore
from lchat.objstore.where import Where
from lchat.registry import Route
from lchat.replica import ltx
from lchat.threads import RunInThread
from tests.fakes import inline
from tests.handover_fakes import (
    InMemoryAdmin,
    PeerActivator,
    RecordingRecords,
    StubPeerHolds,
    clock_of,
    member,
    region_stores,
)
from tests.test_handover import HandoverCase
from tests.test_mesh_api import Box as MeshBox

HOST = "h.example.com"
FI_BOX = "https://203.0.113.9"
MESH = {
    "LCHAT_MESH_SELF": "https://ie0.example.net",
    "LCHAT_MESH_DOMAINS": "example.com",
    "LCHAT_MESH_TOKEN": "t" * 32,
    "LCHAT_MESH_REGION": "ie",
}


def snapshot(txid: int) -> str:
    """A level-9 snapshot's name under a replica directory."""
    return ltx.object_key("", 9, 1, txid).lstrip("/")


class RelocateCase(HandoverCase):
    """This box in region ``ie``; ``ie`` and ``fi`` keep their replicas in directories of their
    own (``file:`` buckets); the space is hibernating, homed in ``ie``, with a replica there."""

    def setUp(self) -> None:
        super().setUp()
        self.ie, self.fi = (os.path.join(self.root, r) for r in ("ie", "fi"))
        self.configure(
            LCHAT_HIBERNATE_BUCKET=f"file:{self.ie}",
            LCHAT_REGION_BUCKETS=f"ie=file:{self.ie},fi=file:{self.fi}",
        )
        self.add_row(hibernate=True, home_region="ie")
        self.admin.routes.reload("test")  # the router's table knows it
        self.put(self.ie, snapshot(5), b"snapshot up to 5")
        self.peers.active = False  # no mesh unless a test configures one
        self.records = RecordingRecords()
        self.disk: RunInThread = inline  # the region buckets' thread runner
        self.steps: dict[str, Any] = {}
        self.printed: list[str] = []
        self.peer_holds = StubPeerHolds(self.reactor, MESH["LCHAT_MESH_TOKEN"])

    def mesh(self, **extra: str) -> None:
        self.configure(**{**self.settings, **MESH, **extra})
        self.peers.active = True
        self.peers.live = [member("https://ie0.example.net", "ie"), member(FI_BOX, "fi")]

    def put(self, directory: str, name: str, body: bytes, host: str = HOST) -> None:
        FileBucket(directory, create=True).put(f"{host}/{name}", body)

    def keys(self, directory: str) -> list[str]:
        if not os.path.isdir(directory):
            return []
        return [i.key[len(HOST) + 1 :] for i in FileBucket(directory).list(f"{HOST}/")]

    def relocation(self, cfg: config.BoxConfig | None = None) -> Relocation:
        def report(steps: dict[str, Any], lines: list[str]) -> None:
            self.steps = steps
            self.printed.extend(lines)

        return Relocation(
            cfg or self.cfg,
            self.registry,
            self.admin,
            self.peers,
            region_stores(self.reactor, self.disk),
            self.records,
            self.say,
            report,
            clock=clock_of(self.reactor),
            peer_holds=self.peer_holds,
        )

    def relocate(
        self,
        to: str = "fi",
        *,
        move_dns: bool = False,
        cfg: config.BoxConfig | None = None,
        source: str = "",
    ) -> int:
        return self.relocation(cfg)(HOST, to, move_dns=move_dns, timeout=600.0, source=source)

    def refused_move(
        self, *fragments: str, to: str = "fi", move_dns: bool = False, source: str = ""
    ) -> str:
        return self.refused(lambda: self.relocate(to, move_dns=move_dns, source=source), *fragments)

    def home(self) -> str:
        route = self.row(HOST)
        assert route is not None
        return route.home_region

    def assertUnmoved(self) -> None:
        """Nothing flipped, told or left behind: no fence in either bucket, no hold here."""
        self.assertEqual(self.home(), "ie")
        self.assertEqual(self.peers.pushed, [])
        self.assertNotIn(lease.LOCK_NAME, self.keys(self.ie))
        self.assertNotIn(lease.LOCK_NAME, self.keys(self.fi))
        self.assertEqual(self.activator.holds, {})


class CopyTests(RelocateCase):
    def test_sleeps_and_holds_copies_fenced_flips_then_lifts_the_hold(self) -> None:
        self.activator.states[HOST] = "awake"
        self.put(self.ie, snapshot(3), b"older")
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(
            self.printed,
            [
                f"relocated {HOST}: ie → fi",
                f"store: copied 2 objects (21 bytes, 0 already there) file:{self.ie}/{HOST}/ → "
                f"file:{self.fi}/{HOST}/ by download + re-upload, lock.json excluded; newest "
                f"txid {5:016x}",
                f"home_region flipped (no mesh on this box: no peers to tell) — {HOST} → fi",
            ],
        )
        self.assertTrue(self.said(f"note: {HOST}: asleep on this box and held asleep while it"))
        # Asleep and held before the copy; the router told of the flip; the hold lifted after.
        self.assertEqual(self.admin.calls, ["POST /sleep", "POST /reload", "POST /release"])
        self.assertEqual(self.activator.calls, [("hold", HOST), ("sleep", HOST), ("release", HOST)])
        self.assertEqual(self.activator.holds, {})
        self.assertEqual(self.home(), "fi")
        self.assertEqual([r.home_region for r in self.peers.pushed], [])  # no mesh
        self.assertEqual(sorted(self.keys(self.fi)), sorted([snapshot(3), snapshot(5)]))
        # The source keeps its replica, and a marker of where the space went.
        self.assertEqual(
            sorted(self.keys(self.ie)), sorted([snapshot(3), snapshot(5), moved.MOVED_NAME])
        )

    def marker(self, directory: str) -> moved.MovedRecord | None:
        bucket = FileBucket(directory)
        if f"{HOST}/{moved.MOVED_NAME}" not in {i.key for i in bucket.list(f"{HOST}/")}:
            return None
        return moved.MovedRecord.parse(bucket.get(f"{HOST}/{moved.MOVED_NAME}").body)

    def test_the_source_keeps_a_moved_marker_and_a_move_back_clears_it(self) -> None:
        self.mesh()
        # (The CLI's fan-out gives the flipped row its generation; these peers record only.)
        self.registry.bump_settings(HOST, "a" * 64, 1_000)
        self.assertEqual(self.relocate(), 0)
        row = self.row(HOST)
        assert row is not None
        marker = self.marker(self.ie)
        assert marker is not None
        self.assertEqual(
            (marker.to, marker.gen, marker.by), ("fi", row.settings_gen, self.cfg.box_id)
        )
        self.assertIsNone(self.marker(self.fi))  # a marker is never copied
        # Back to ie: fi now says where it went, and ie's marker of the first move is gone.
        self.registry.bump_settings(HOST, "b" * 64, 2_000)
        self.assertEqual(self.relocate("ie"), 0)
        back = self.marker(self.fi)
        row = self.row(HOST)
        assert back is not None and row is not None
        self.assertEqual((back.to, back.gen), ("ie", row.settings_gen))
        self.assertGreater(back.gen, marker.gen)
        self.assertIsNone(self.marker(self.ie))
        self.assertNotIn(moved.MOVED_NAME, self.keys(self.ie))

    def test_a_marker_that_cannot_be_written_is_a_note_and_the_move_stands(self) -> None:
        async def refuse(*args: Any) -> None:
            raise StoreUnavailable("the bucket is away")

        self.patch(moved, "write", refuse)
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(self.home(), "fi")
        self.assertTrue(
            self.said(
                f"note: {HOST}: could not leave the moved marker in file:{self.ie}/{HOST}/ "
                f"(the bucket is away): the move stands"
            )
        )

    def test_the_hold_outlasts_the_timeout_by_a_minute_at_most_an_hour(self) -> None:
        sleeps: list[dict[bytes, list[bytes]]] = []
        render = self.admin.call

        def call(method: str, path: str, timeout: float, **args: str) -> Any:
            if path == "/sleep":
                sleeps.append({k.encode(): [v.encode()] for k, v in args.items()})
            return render(method, path, timeout, **args)

        self.patch(self.admin, "call", call)
        self.relocation()(HOST, "fi", move_dns=False, timeout=120)
        self.registry.update(HOST, home_region="ie")
        self.relocation()(HOST, "fi", move_dns=False, timeout=86400)
        self.assertEqual([s[b"hold"] for s in sleeps], [[b"180"], [b"3600"]])

    def test_json_steps(self) -> None:
        self.relocate()
        store = self.steps["store"]
        self.assertEqual(
            (self.steps["from"], self.steps["to"], self.steps["result"]), ("ie", "fi", "relocated")
        )
        self.assertEqual((store["objects"], store["txid"], store["copied"]), (1, f"{5:016x}", True))
        self.assertEqual((self.steps["home_region"], self.steps["fan_out"]), ("fi", []))
        self.assertNotIn("placement", self.steps)

    def test_again_is_nothing_to_do(self) -> None:
        self.relocate()
        self.admin.calls.clear()
        self.printed.clear()
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(self.printed, [f"{HOST}: already in fi: nothing to do"])
        self.assertEqual(
            self.steps, {"host": HOST, "from": "fi", "to": "fi", "result": "nothing to do"}
        )
        self.assertEqual(self.admin.calls, [])

    def test_files_already_there_are_skipped_and_strays_deleted(self) -> None:
        self.put(self.ie, snapshot(3), b"older")
        self.put(self.fi, snapshot(3), b"older")  # an interrupted earlier copy
        self.put(self.fi, "0000/stray.ltx", b"an older stay in fi")
        self.relocate()
        store = self.steps["store"]
        self.assertEqual((store["objects"], store["skipped"]), (1, 1))
        self.assertEqual(sorted(self.keys(self.fi)), sorted([snapshot(3), snapshot(5)]))

    def test_one_bucket_two_prefixes_copies_within_the_store(self) -> None:
        self.configure(LCHAT_HIBERNATE_BUCKET=f"file:{self.ie}", LCHAT_HIBERNATE_PREFIX="prod")
        here = Where(f"file:{self.ie}", "prod")
        cfg = attrs.evolve(
            self.cfg, region_buckets={"ie": here, "fi": attrs.evolve(here, prefix="prod-fi")}
        )
        FileBucket(self.ie).put(f"prod/{HOST}/{snapshot(5)}", b"snapshot up to 5")
        self.assertEqual(self.relocate(cfg=cfg), 0)
        self.assertEqual(self.steps["store"]["method"], "server-side copy")
        copied = [i.key for i in FileBucket(self.ie).list(f"prod-fi/{HOST}/")]
        self.assertEqual(copied, [f"prod-fi/{HOST}/{snapshot(5)}"])

    def test_a_space_without_a_home_region_needs_from_under_per_region_buckets(self) -> None:
        self.registry.update(HOST, home_region="")
        self.refused_move(
            f"{HOST} has no home_region, and the regions keep their replicas in different "
            f"buckets (LCHAT_REGION_BUCKETS: fi, ie): say which region's bucket holds it with "
            f"--from REGION; nothing was copied or flipped"
        )
        self.assertEqual(self.admin.calls, [])
        self.assertEqual(self.keys(self.fi), [])
        self.assertEqual(self.relocate(source="ie"), 0)
        self.assertEqual(self.printed[0], f"relocated {HOST}: ie → fi")
        self.assertEqual(self.keys(self.fi), [snapshot(5)])

    def test_from_must_agree_with_the_home_region(self) -> None:
        self.refused_move(
            f"--from fi: {HOST}'s home_region is ie, so it moves from there: drop --from",
            to="de",
            source="fi",
        )
        self.refused_move("--from 'i e' must be letters, digits", source="i e")
        self.assertEqual(self.relocate(source="ie"), 0)  # the same region: fine
        self.assertEqual(self.home(), "fi")

    def test_a_shared_bucket_needs_no_from(self) -> None:
        self.configure(LCHAT_HIBERNATE_BUCKET=f"file:{self.ie}")
        self.registry.update(HOST, home_region="")
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(self.printed[0], f"relocated {HOST}: (no region) → fi")


class CopyRefusalTests(RelocateCase):
    def test_a_destination_ahead_is_never_overwritten(self) -> None:
        self.put(self.fi, snapshot(9), b"written in fi later")
        self.refused_move(
            f"{HOST}: the destination file:{self.fi}/{HOST}/ is ahead of the source (newest "
            f"txid {9:016x} > {5:016x})",
            "if fi is where it lives, flip only its home_region",
        )
        self.assertEqual(self.keys(self.fi), [snapshot(9)])
        self.assertUnmoved()
        self.assertEqual(self.activator.calls[-1], ("release", HOST))

    def test_no_replica_is_nothing_to_copy(self) -> None:
        FileBucket(self.ie).delete(f"{HOST}/{snapshot(5)}")
        self.refused_move(f"{HOST}: no replica under file:{self.ie}/{HOST}/: nothing to copy")
        self.assertUnmoved()

    def test_a_lease_held_by_another_box_is_refused_and_left_alone(self) -> None:
        ie = FileStore(self.reactor, self.ie, inline)
        key = lease.lease_key("", HOST)
        other = lease.acquire(ie, key, "https://box2.example.net", 900.0, monotonic=time.monotonic)
        self.successResultOf(Deferred.fromCoroutine(other))
        before = FileBucket(self.ie).head(key).etag
        self.refused_move(
            f"{HOST}: its lease in region ie (file:{self.ie}) is held by https://box2.example.net",
            "nothing was copied or flipped",
        )
        self.assertEqual(FileBucket(self.ie).head(key).etag, before)
        self.assertEqual(self.keys(self.fi), [])
        self.assertEqual(self.home(), "ie")
        self.assertEqual(self.activator.holds, {})

    def test_a_copy_that_fails_midway_flips_nothing_and_lets_go(self) -> None:
        self.put(self.ie, snapshot(3), b"older")
        puts: list[str] = []

        def disk(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
            if _calls(f, "put_file"):
                puts.append("put_file")
                if len(puts) == 2:
                    return fail(StoreUnavailable("the disk went away"))
            return inline(f, *args)

        self.disk = disk
        self.refused_move(
            f"{HOST}: the bucket failed (the disk went away); nothing was flipped: retry"
        )
        self.assertEqual(len(puts), 2)
        self.assertEqual(len(self.keys(self.fi)), 1)  # the first; a re-run skips it
        self.assertUnmoved()

    def test_a_copy_longer_than_the_lease_ttl_is_not_flipped(self) -> None:
        def slow(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
            if _calls(f, "put_file"):
                self.reactor.advance(850.0)  # of the 900 s lease TTL
            return inline(f, *args)

        self.disk = slow
        self.refused_move(
            "the copy took longer than the lease TTL (900s), so the fence may have lapsed",
            "nothing was flipped",
        )
        self.assertUnmoved()

    def test_interrupted_it_lifts_the_hold_and_flips_nothing(self) -> None:
        def interrupted(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
            if _calls(f, "put_file"):
                raise KeyboardInterrupt
            return inline(f, *args)

        self.disk = interrupted
        self.assertRaises(KeyboardInterrupt, self.relocate)
        self.assertEqual(self.activator.calls[-1], ("release", HOST))
        self.assertUnmoved()


class RouterTests(RelocateCase):
    """This box's router: down, without the space or an activator, slow to sleep it."""

    def test_no_router_nothing_is_held_and_the_move_goes_on(self) -> None:
        self.admin.down = FileNotFoundError(2, "No such file or directory")
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(self.home(), "fi")
        self.assertTrue(self.said("note: router not running; it will pick this up when it starts"))
        self.assertEqual(self.admin.calls, ["POST /sleep", "POST /reload"])  # no release

    def test_a_router_that_does_not_know_it_holds_nothing(self) -> None:
        self.admin = InMemoryAdmin(self.reactor, self.registry, self.activator)  # table not read
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(self.activator.calls, [])
        self.assertFalse(self.said("checking the lease"))
        self.assertNotIn("POST /release", self.admin.calls)

    def test_a_router_without_an_activator_holds_nothing(self) -> None:
        self.admin.api.activator = None
        self.assertEqual(self.relocate(), 0)
        self.assertNotIn("POST /release", self.admin.calls)
        self.assertFalse(self.said("checking the lease"))

    def test_a_router_that_cannot_sleep_it_is_a_note_and_the_lease_decides(self) -> None:
        self.activator.sleep_fails = RuntimeError("the space would not stop")
        self.assertEqual(self.relocate(), 0)
        self.assertTrue(
            self.said(f"note: the router answered 503 to /sleep for {HOST}; checking the lease")
        )
        self.assertEqual(self.activator.holds, {})  # placed before the sleep failed: lifted

    def test_a_sleep_that_takes_too_long_lifts_the_hold_and_copies_nothing(self) -> None:
        self.activator.states[HOST] = "awake"
        self.activator.sleep_hangs = True
        self.refused_move(
            f"{HOST}: the router did not finish putting it to sleep within 150s",
            "nothing was copied or flipped: retry",
        )
        self.assertEqual(self.activator.calls, [("hold", HOST), ("sleep", HOST), ("release", HOST)])
        self.assertEqual(self.keys(self.fi), [])
        self.assertUnmoved()

    def test_a_hold_that_cannot_be_lifted_is_a_note(self) -> None:
        render = self.admin.call

        def call(method: str, path: str, timeout: float, **args: str) -> Any:
            if path == "/release":
                raise admin_client.ProtocolError("router.sock: timed out")
            return render(method, path, timeout, **args)

        self.patch(self.admin, "call", call)
        self.assertEqual(self.relocate(), 0)
        self.assertTrue(
            self.said(f"note: {HOST}: could not lift the hold on this box's router (router.sock")
        )


class MeshTests(RelocateCase):
    def setUp(self) -> None:
        super().setUp()
        self.mesh()

    def test_the_flip_is_pushed_to_the_peers_and_reported(self) -> None:
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(
            self.printed[-1],
            f"home_region flipped + route re-fanned-out to peers — the mesh now places {HOST} on a fi box",
        )
        self.assertEqual([(r.host, r.home_region) for r in self.peers.pushed], [(HOST, "fi")])
        self.assertEqual(self.steps["placement"], {"region": "fi", "live_boxes": [FI_BOX]})
        pushed = f"mesh: {HOST}: pushed to {FI_BOX}: updated"
        self.assertIn(pushed, self.steps["fan_out"])
        self.assertTrue(self.said(f"note: {pushed}"))

    def test_a_peer_that_does_not_take_the_flip_is_reported_the_move_stands(self) -> None:
        self.peers.answers[FI_BOX] = "failed (connection refused)"
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(self.home(), "fi")
        self.assertTrue(self.said(f"pushed to {FI_BOX}: failed (connection refused)"))

    def test_no_live_box_in_a_region_with_its_own_bucket_is_refused(self) -> None:
        self.peers.live = [member("https://ie0.example.net", "ie")]
        self.refused_move(
            f"{HOST}: no live box in region fi, and fi keeps its replicas in its own bucket",
            "Start a fi box (LCHAT_MESH_REGION=fi) first",
        )
        self.assertUnmoved()
        self.assertEqual(self.admin.calls, [])  # not even slept

    def test_members_that_cannot_be_read_refuse_a_copy(self) -> None:
        self.peers.live = StoreUnavailable("the mesh bucket did not answer")
        self.refused_move(
            f"{HOST}: could not read the mesh's members (the mesh bucket did not answer), so "
            f"whether a fi box is live is unknown; nothing was copied or flipped: retry"
        )
        self.assertUnmoved()

    def test_shared_bucket_members_unread_is_a_note_and_it_moves(self) -> None:
        self.mesh(LCHAT_REGION_BUCKETS="")
        self.peers.live = StoreUnavailable("the mesh bucket did not answer")
        self.assertEqual(self.relocate(), 0)
        self.assertTrue(self.said("placement in fi not checked"))
        self.assertNotIn("placement", self.steps)

    def test_shared_bucket_no_live_box_says_placement_falls_back(self) -> None:
        self.mesh(LCHAT_REGION_BUCKETS="")
        self.assertEqual(self.relocate("se"), 0)
        self.assertIn(
            f"placement: no live box in se yet — the mesh places {HOST} on the whole fleet until "
            f"one joins (availability wins over residency; the bucket is shared)",
            self.printed,
        )


class SharedBucketTests(RelocateCase):
    def setUp(self) -> None:
        super().setUp()
        self.configure(LCHAT_HIBERNATE_BUCKET=f"file:{self.ie}")  # no LCHAT_REGION_BUCKETS

    def test_no_copy_the_flip_and_an_awake_space_slept_here(self) -> None:
        self.activator.states[HOST] = "awake"
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(
            self.printed[:2],
            [
                f"relocated {HOST}: ie → fi",
                "store: no copy — source and destination share the same bucket (the "
                "shared-bucket case)",
            ],
        )
        self.assertEqual(self.steps["store"], {"copied": False, "why": "shared bucket"})
        self.assertEqual(self.home(), "fi")
        self.assertTrue(self.said(f"note: {HOST}: slept on this box; its next request wakes it"))
        self.assertEqual(self.activator.calls, [("sleep", HOST)])  # no hold
        self.assertFalse(os.path.exists(self.fi))

    def test_asleep_here_it_is_left_alone(self) -> None:
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(self.activator.calls, [])
        self.assertFalse(self.said("slept on this box"))

    def test_both_regions_naming_one_place_are_a_shared_bucket(self) -> None:
        self.configure(
            LCHAT_HIBERNATE_BUCKET=f"file:{self.ie}",
            LCHAT_REGION_BUCKETS=f"ie=file:{self.ie},fi=file:{self.ie}",
        )
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(self.steps["store"], {"copied": False, "why": "shared bucket"})


class MoveDNSTests(RelocateCase):
    def setUp(self) -> None:
        super().setUp()
        self.mesh()

    def test_the_record_follows_to_the_live_boxes(self) -> None:
        self.assertEqual(self.relocate(move_dns=True), 0)
        self.assertEqual(self.records.pointed, [(HOST, [FI_BOX])])
        self.assertEqual(self.steps["dns"]["after"], ["203.0.113.9"])
        self.assertEqual(
            self.printed[-1], f"dns: {HOST} A (none) → 203.0.113.9 (Route53 zone Z1, TTL 60s)"
        )

    def test_already_there_it_still_moves_the_record(self) -> None:
        self.registry.update(HOST, home_region="fi")
        self.assertEqual(self.relocate(move_dns=True), 0)
        self.assertEqual(self.printed[0], f"{HOST}: already in fi: nothing to do")
        self.assertEqual(self.records.pointed, [(HOST, [FI_BOX])])
        self.peers.live = StoreUnavailable("no answer")
        self.refused_move(
            f"{HOST}: could not read the mesh's members (no answer) to move its record",
            move_dns=True,
        )

    def test_no_live_box_leaves_the_record_alone(self) -> None:
        self.mesh(LCHAT_REGION_BUCKETS="")
        self.assertEqual(self.relocate("se", move_dns=True), 0)
        self.assertEqual(self.records.pointed, [])
        self.assertEqual(self.steps["dns"], {"changed": False, "why": "no live box in se"})
        self.assertIn(f"dns: not moved — no live box in se to point {HOST} at", self.printed)

    def test_a_dns_move_that_fails_leaves_the_relocation_standing(self) -> None:
        self.records.failure = "--move-dns: Route53 said no"
        message = self.refused_move(
            f"{HOST} is relocated to fi, but its DNS record was not moved: --move-dns: Route53 "
            f"said no. The wildcard and the mesh's forwarding keep it reachable; re-run with "
            f"--move-dns",
            move_dns=True,
        )
        self.assertTrue(message)
        self.assertEqual(self.home(), "fi")
        self.assertEqual(self.printed[0], f"relocated {HOST}: ie → fi")  # the move, reported
        self.assertNotIn("dns", self.steps)

    def test_a_provider_that_is_not_route53_is_refused_before_anything_moves(self) -> None:
        self.records.refusal = "--move-dns works with Route53 only"
        self.refused_move(
            "--move-dns works with Route53 only; nothing was copied or flipped", move_dns=True
        )
        self.assertUnmoved()
        self.assertEqual(self.admin.calls, [])

    def test_without_a_mesh_it_is_refused(self) -> None:
        self.configure(**{k: v for k, v in self.settings.items() if k not in MESH})
        self.refused_move(
            "--move-dns points the record at the destination region's live boxes",
            "set LCHAT_MESH_SELF",
            move_dns=True,
        )


class RefusalTests(RelocateCase):
    def test_what_cannot_move(self) -> None:
        self.refused_move("--to 'f i' must be letters, digits, '.', '_' or '-'", to="f i")
        self.refused_move("no bucket for region 'de' (it names fi, ie)", to="de")
        self.registry.update(HOST, hibernate=False)
        self.refused_move(f"{HOST} is a live instance", f"`lchat hibernate {HOST} --on`")
        self.registry.delete(HOST)
        self.refused_move(f"{HOST} is not registered")
        self.registry.insert(Route(HOST, "service", "/srv/x.sock"))
        self.refused_move(f"{HOST} is a service (a server lchat does not run): it cannot move")
        self.assertEqual(self.admin.calls, [])

    def test_without_a_hibernation_bucket(self) -> None:
        self.configure(LCHAT_HIBERNATE_BUCKET="")
        self.refused_move("relocating needs the hibernation bucket: set LCHAT_HIBERNATE_BUCKET")


def _calls(f: Callable[..., Any], name: str) -> bool:
    """Whether the FileStore's thread call ``f`` (a lambda over its FileBucket) is ``name``."""
    return name in f.__code__.co_names


PEER = "http://ie1.example.net"  # a box of region ie (tests.test_mesh_api.Box's URL form)


class FromAnyBoxTests(RelocateCase):
    """Run on ie0 while the space is awake on the peer ie1 (its lease in ie's bucket): ie1's
    router, reached through its real mesh API, sleeps it and holds it asleep for the move."""

    def setUp(self) -> None:
        super().setUp()
        self.mesh()
        self.peers.live = [*self.live(), member(PEER, "ie")]
        box = MeshBox(self.root, "ie1", LCHAT_MESH_TOKEN=MESH["LCHAT_MESH_TOKEN"])
        box.add(HOST, hibernate=True, home_region="ie")
        self.peer = PeerActivator(self.reactor)
        self.peer.awake.add(HOST)
        self.peer.on_sleep = lambda host: FileBucket(self.ie).delete(self.lock)  # its release
        self.peer_api = api.MeshAPI(
            box.registry, box.cfg(), lambda why: None, run_in_thread=inline, holds=self.peer
        )
        self.peer_holds.add(PEER, self.peer_api)
        self.lock = lease.lease_key("", HOST)
        ie = FileStore(self.reactor, self.ie, inline)
        taken = lease.acquire(ie, self.lock, PEER, 900.0, monotonic=self.reactor.seconds)
        self.successResultOf(Deferred.fromCoroutine(taken))

    def live(self) -> list[Member]:
        """This box and the fi box (not the peer)."""
        return [member(MESH["LCHAT_MESH_SELF"], "ie"), member(FI_BOX, "fi")]

    def calls(self, op: str, outcome: str) -> float:
        labels = {"op": op, "outcome": outcome}
        return REGISTRY.get_sample_value("lchat_mesh_route_calls_total", labels) or 0.0

    def test_the_peer_sleeps_and_holds_it_the_move_goes_on_then_both_holds_lift(self) -> None:
        held, released = self.calls("hold", "held"), self.calls("release", "released")
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(self.home(), "fi")
        self.assertEqual(self.keys(self.fi), [snapshot(5)])  # no lock copied
        self.assertNotIn(lease.LOCK_NAME, self.keys(self.ie))
        # Held here first, then asleep and held on the peer (after the fence met its lease);
        # both lifted after the flip.
        self.assertEqual(self.peer_holds.calls, [("hold", PEER), ("release", PEER)])
        self.assertEqual(self.peer.calls, [("hold", HOST), ("sleep", HOST), ("release", HOST)])
        self.assertEqual(self.activator.calls, [("hold", HOST), ("sleep", HOST), ("release", HOST)])
        self.assertIsNone(self.peer.held.refusal(HOST))
        self.assertEqual(self.activator.holds, {})
        self.assertTrue(self.said(f"note: {HOST}: awake on {PEER}: asking it to sleep it"))
        self.assertTrue(self.said(f"note: {HOST}: asleep on {PEER} and held asleep there"))
        self.assertEqual(self.calls("hold", "held"), held + 1)
        self.assertEqual(self.calls("release", "released"), released + 1)

    def test_a_lease_still_held_after_the_peers_sleep_is_refused_and_its_hold_lifted(self) -> None:
        self.peer.on_sleep = lambda host: None  # its lease stays: refused after the hold
        self.refused_move(f"its lease in region ie (file:{self.ie}) is held by {PEER}")
        self.assertEqual(self.peer_holds.calls, [("hold", PEER), ("release", PEER)])
        self.assertIsNone(self.peer.held.refusal(HOST))
        self.assertUnmovedButTheLock()

    def test_a_box_that_woke_it_in_between_is_asked_too(self) -> None:
        other = "http://ie2.example.net"
        box = MeshBox(self.root, "ie2", LCHAT_MESH_TOKEN=MESH["LCHAT_MESH_TOKEN"])
        box.add(HOST, hibernate=True, home_region="ie")
        second = PeerActivator(self.reactor)
        second.awake.add(HOST)
        second.on_sleep = lambda host: FileBucket(self.ie).delete(self.lock)
        self.peer_holds.add(
            other,
            api.MeshAPI(
                box.registry, box.cfg(), lambda why: None, run_in_thread=inline, holds=second
            ),
        )
        self.peers.live = [*self.live(), member(PEER, "ie"), member(other, "ie")]
        ie = FileStore(self.reactor, self.ie, inline)

        def woken_on_the_other(host: str) -> None:  # a request woke it on ie2 meanwhile
            FileBucket(self.ie).delete(self.lock)
            taken = lease.acquire(ie, self.lock, other, 900.0, monotonic=self.reactor.seconds)
            self.successResultOf(Deferred.fromCoroutine(taken))

        self.peer.on_sleep = woken_on_the_other
        self.assertEqual(self.relocate(), 0)
        self.assertEqual(
            self.peer_holds.calls,
            [("hold", PEER), ("hold", other), ("release", PEER), ("release", other)],
        )
        for activator in (self.peer, second):
            self.assertIsNone(activator.held.refusal(HOST))
        self.assertEqual(self.home(), "fi")

    def test_an_older_peer_without_the_call_is_todays_refusal(self) -> None:
        self.peer_api._space_calls._holds = (
            None  # as an lchat without POST /api/mesh/hold: 404, no reason
        )
        self.refused_move(
            f"{HOST}: its lease in region ie (file:{self.ie}) is held by {PEER} until",
            "Let it sleep on that box (`lchat hibernate",
            "nothing was copied or flipped",
        )
        self.assertEqual(self.peer.calls, [])
        self.assertEqual(self.peer_holds.calls, [("hold", PEER)])  # no hold there to lift
        self.assertFalse(self.said("could not lift"))
        self.assertUnmovedButTheLock()
        self.assertEqual(self.activator.calls[-1], ("release", HOST))

    def test_a_peer_that_does_not_answer_in_time_is_refused_and_its_hold_lifted(self) -> None:
        self.peer.sleep_hangs = True
        started = self.reactor.seconds()
        self.refused_move(
            f"{HOST}: it is awake on {PEER} (its lease in region ie), which did not answer the "
            f"request to sleep it and hold it asleep",
            "no answer within 160s",
            "nothing was copied or flipped: retry, or run the command on that box",
        )
        self.assertEqual(self.reactor.seconds() - started, 160.0)
        # Its hold was placed before the sleep hung: lifted on the way out.
        self.assertEqual(self.peer.calls, [("hold", HOST), ("sleep", HOST), ("release", HOST)])
        self.assertIsNone(self.peer.held.refusal(HOST))
        self.assertUnmovedButTheLock()

    def test_an_unreachable_peer_is_refused(self) -> None:
        self.peer_holds.down.add(PEER)
        self.refused_move(
            f"{HOST}: it is awake on {PEER} (its lease in region ie), which did not answer",
            "Connection refused",
        )
        self.assertUnmovedButTheLock()
        self.assertTrue(self.said(f"could not lift the hold on {PEER}"))

    def test_a_hold_that_cannot_be_lifted_expires_by_itself(self) -> None:
        def sleep_then_go_away(host: str) -> None:
            FileBucket(self.ie).delete(self.lock)
            self.peer_holds.down.add(PEER)  # gone before the release

        self.peer.on_sleep = sleep_then_go_away
        expired = REGISTRY.get_sample_value("lchat_holds_total", {"event": "expired"}) or 0.0
        self.assertEqual(self.relocate(), 0)
        self.assertTrue(
            self.said(
                f"note: {HOST}: could not lift the hold on {PEER} ({PEER}: POST: Connection "
                f"refused); it ends by itself within 660s"
            )
        )
        # Still held there, with the local hold's deadline: the timeout (600 s) plus a minute.
        self.assertEqual(self.peer.held.held_asleep(), {HOST: 660.0})
        self.reactor.advance(660.0)
        self.assertIsNone(self.peer.held.refusal(HOST))  # the deadline ended it
        self.assertEqual(
            REGISTRY.get_sample_value("lchat_holds_total", {"event": "expired"}), expired + 1
        )

    def test_a_peer_without_the_space_says_so(self) -> None:
        self.peer_api._registry.delete(HOST)
        self.refused_move(
            f"{HOST}: {PEER} answered 404 to the request to sleep it and hold it asleep: {HOST} "
            f"is not a hibernating instance on this box; nothing was copied or flipped"
        )
        self.assertEqual(self.peer_holds.calls, [("hold", PEER)])
        self.assertUnmovedButTheLock()

    def test_a_lease_of_a_box_that_is_not_live_is_refused_without_asking(self) -> None:
        self.peers.live = self.live()
        self.refused_move(f"is held by {PEER} until")
        self.assertEqual(self.peer_holds.calls, [])
        self.assertUnmovedButTheLock()

    def test_another_relocation_running_is_refused_without_asking(self) -> None:
        FileBucket(self.ie).delete(self.lock)
        ie = FileStore(self.reactor, self.ie, inline)
        other = f"{PEER} (lchat relocate)"
        taken = lease.acquire(ie, self.lock, other, 900.0, monotonic=self.reactor.seconds)
        self.successResultOf(Deferred.fromCoroutine(taken))
        self.refused_move(f"is held by {other} until")
        self.assertEqual(self.peer_holds.calls, [])

    def assertUnmovedButTheLock(self) -> None:
        """Nothing flipped or copied; the fi bucket has no fence; no hold left here."""
        self.assertEqual(self.home(), "ie")
        self.assertEqual(self.peers.pushed, [])
        self.assertEqual(self.keys(self.fi), [])
        self.assertEqual(self.activator.holds, {})
