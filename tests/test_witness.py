"""The peers' witness (lchat/mesh/witness.py, docs/lease.md "Witnesses"): its messages, the rule on
both sides as pure bookkeeping, and ``POST /api/mesh/beat`` served by the mesh API to a real
membership, called with the real client. The rule's consequences across boxes, clocks and faults
are tests/test_fence_model.py's; real routers cut apart are tests/test_mesh_cuts.py's."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any

from attrs import evolve
from prometheus_client import REGISTRY
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat.mesh import api
from lchat.mesh.client import PeerBeats
from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.members import member_key, read_members
from lchat.mesh.membership import Membership
from lchat.mesh.witness import (
    MAX_HOLDS,
    BeatMessage,
    BeatReply,
    MessageError,
    PeerCallError,
    PeerChannel,
    Witnesses,
    normal_holds,
)
from lchat.objstore import NotFound
from lchat.objstore.file import FileStore
from lchat.threads import thread_runner
from tests.test_mesh_api import TOKEN, Box

reactor: Any = _reactor

A = "https://box-a.example.net"
B = "https://box-b.example.net"
C = "https://box-c.example.net"
DEAD_AFTER = 45.0
MARGIN = 4.5
TOLERANCE = 900.0
HEARTBEAT = 15.0


def beat(url: str, process: str = "p", epoch: str = "e") -> Heartbeat:
    return Heartbeat(url, "", "0.1.0", 1.0, epoch=epoch, process=process)


def message(url: str = B, seq: int = 1, **kw: Any) -> BeatMessage:
    return BeatMessage(heartbeat=beat(url, kw.pop("process", "p")), seq=seq, **kw)


def reply(url: str = B, seq: int = 1, process: str = "p", **kw: Any) -> BeatReply:
    return BeatReply(heartbeat=beat(url, process), seq=seq, **kw)


def witnesses() -> Witnesses:
    return Witnesses(A, DEAD_AFTER, MARGIN, TOLERANCE, HEARTBEAT, started=0.0)


class MessageTests(SynchronousTestCase):
    def test_a_message_and_a_reply_round_trip(self) -> None:
        m = message(seq=7, relay=True, backlog=True, holds=("a.example", "b.example"))
        self.assertEqual(BeatMessage.parse(m.to_json()), m)
        r = reply(seq=9, backlog=True, relayed=True, holds=("c.example",))
        self.assertEqual(BeatReply.parse(r.to_json()), r)

    def test_garbage_is_refused_with_a_reason(self) -> None:
        good = json.loads(message().to_json())
        cases: list[tuple[bytes, str]] = [
            (b"", "not JSON"),
            (b"[1]", "not a JSON object"),
            (b"x" * 70_000, "larger than"),
            (json.dumps({**good, "seq": -1}).encode(), "seq"),
            (json.dumps({**good, "seq": True}).encode(), "seq"),
            (json.dumps({**good, "seq": 2**53}).encode(), "seq"),
            (json.dumps({**good, "heartbeat": "x"}).encode(), "heartbeat"),
            (json.dumps({**good, "heartbeat": {"url": A}}).encode(), "heartbeat"),
            (json.dumps({**good, "relay": "yes"}).encode(), "relay"),
            (json.dumps({**good, "holds": "a.example"}).encode(), "holds"),
            (json.dumps({**good, "holds": ["A.EXAMPLE"]}).encode(), "holds"),
            (json.dumps({**good, "holds": ["a.example"] * (MAX_HOLDS + 1)}).encode(), "holds"),
            (json.dumps({**good, "heartbeat": {**good["heartbeat"], "process": 1}}).encode(), ""),
        ]
        for body, why in cases:
            with self.subTest(body=body[:60]):
                with self.assertRaises(MessageError) as caught:
                    BeatMessage.parse(body)
                self.assertIn(why, str(caught.exception))

    def test_the_hosts_a_message_lists_are_bounded(self) -> None:
        long = [f"{i:04d}" + "a" * 240 + ".example" for i in range(1000)]
        holds = normal_holds(long)
        self.assertLess(sum(len(h) + 3 for h in holds), 32 * 1024 + 1)
        m = message(holds=holds, relay=True, backlog=True)
        self.assertLess(len(m.to_json()), 64 * 1024)
        self.assertEqual(BeatMessage.parse(m.to_json()).holds, holds)
        self.assertEqual(normal_holds(["Not A Host!", "ok.example"]), ("ok.example",))

    def test_an_older_heartbeat_has_no_process(self) -> None:
        old = Heartbeat(A, "", "0.0.9", 1.0, epoch="e")
        self.assertNotIn(b"process", old.to_json())
        self.assertEqual(Heartbeat.parse(old.to_json()).process, "")


class HolderTests(SynchronousTestCase):
    """W2: what the peers' word is worth to the box they heard."""

    def test_no_landed_beat_no_liveness_and_no_peer_the_tolerance(self) -> None:
        w = witnesses()
        self.assertEqual(w.holder_deadline(None), -math.inf)
        self.assertEqual(w.holder_deadline(10.0), 10.0 + HEARTBEAT + TOLERANCE)
        self.assertFalse(w.all_know_backlog(10.0))  # nobody to vouch: isolated

    def test_a_peer_answered_is_required_from_the_answer_on(self) -> None:
        w = witnesses()
        w.answered(message(), now=100.0, reply_seq=1, reply_backlog=False)
        (peer,) = w.required()
        self.assertEqual((peer.url, peer.accepted), (B, 100.0))
        self.assertEqual(w.holder_deadline(10.0), 100.0 + DEAD_AFTER - MARGIN)
        w.confirmed(peer, reply(), sent_at=130.0, sent_seq=2, sent_backlog=False, now=130.1,
                    epoch="e1")  # fmt: skip
        self.assertEqual(w.holder_deadline(10.0), 130.0 + DEAD_AFTER - MARGIN)
        # Never beyond the tolerance after the first beat that did not land.
        self.assertEqual(w.holder_deadline(-800.0), -800.0 + HEARTBEAT + TOLERANCE)

    def test_a_peer_told_of_the_backlog_never_judges_by_silence(self) -> None:
        w = witnesses()
        peer = w.answered(message(), now=100.0, reply_seq=1, reply_backlog=True)
        w.confirmed(peer, reply(), sent_at=110.0, sent_seq=2, sent_backlog=True, now=110.1,
                    epoch="e1")  # fmt: skip
        self.assertTrue(w.knows_backlog(peer))
        self.assertEqual(w.holder_deadline(10.0), 10.0 + HEARTBEAT + TOLERANCE)
        self.assertTrue(w.all_know_backlog(110.0 + DEAD_AFTER - MARGIN - 0.1))
        self.assertFalse(w.all_know_backlog(110.0 + DEAD_AFTER - MARGIN))  # not heard lately
        # A message saying "no backlog" may reach it, even unanswered: finite again.
        w.sent(peer, seq=3, backlog=False)
        self.assertFalse(w.knows_backlog(peer))
        self.assertEqual(w.holder_deadline(10.0), 110.0 + DEAD_AFTER - MARGIN)

    def test_an_older_lchat_among_the_peers_means_no_w2(self) -> None:
        w = witnesses()
        w.answered(message(), now=100.0, reply_seq=1, reply_backlog=False)
        w.peer(C).legacy = True
        self.assertEqual(w.holder_deadline(10.0), -math.inf)

    def test_a_silent_stale_peer_is_retired_and_no_other(self) -> None:
        w = witnesses()
        for url in (B, C):
            w.answered(message(url), now=100.0, reply_seq=1, reply_backlog=False)
        # B: silent for dead_after and stale in the bucket; C: stale but heard lately.
        w.peers[C].heard = 140.0
        retired = w.retire({B: 50.0, C: 50.0}, now=145.0)
        self.assertEqual([p.url for p in retired], [B])
        self.assertEqual([p.url for p in w.required()], [C])
        # A fresh heartbeat keeps a silent peer required (its own bucket keeps it alive).
        w.peers[C].heard = 0.0
        self.assertEqual(w.retire({C: 10.0}, now=145.0), [])
        # Gone from the listing counts as stale.
        self.assertEqual([p.url for p in w.retire({}, now=145.0)], [C])


class TakerTests(SynchronousTestCase):
    """May this box judge a peer dead by its silence?"""

    def permitted(self) -> Witnesses:
        w = witnesses()
        peer = w.peer(B)
        w.confirmed(peer, reply(process="p1"), sent_at=10.0, sent_seq=1, sent_backlog=False,
                    now=10.1, epoch="e1")  # fmt: skip
        return w

    def test_silence_counts_only_with_an_answer_of_that_process_in_this_epoch(self) -> None:
        w = witnesses()
        self.assertIn("no answer", w.silent(B, "p1", "e1", now=100.0) or "")
        w = self.permitted()
        self.assertIsNone(w.silent(B, "p1", "e1", now=10.1 + DEAD_AFTER))
        self.assertIn("heard", w.silent(B, "p1", "e1", now=10.1 + DEAD_AFTER - 1) or "")
        self.assertIn("lapsed", w.silent(B, "p1", "e2", now=100.0) or "")
        self.assertIn("another process", w.silent(B, "p2", "e1", now=100.0) or "")

    def test_a_peer_that_holds_writes_the_bucket_lacks_is_not_judged_by_silence(self) -> None:
        w = self.permitted()
        w.answered(message(seq=5, process="p1", backlog=True), now=20.0, reply_seq=2,
                   reply_backlog=False)  # fmt: skip
        self.assertIn("writes the bucket lacks", w.silent(B, "p1", "e1", now=200.0) or "")
        # A late, older message cannot take that back.
        w.answered(message(seq=4, process="p1", backlog=False), now=21.0, reply_seq=3,
                   reply_backlog=False)  # fmt: skip
        self.assertIn("writes the bucket lacks", w.silent(B, "p1", "e1", now=200.0) or "")

    def test_a_peer_that_drained_may_be_taken_over_at_once(self) -> None:
        w = self.permitted()
        w.answered(message(seq=9, process="p1", leaving=True), now=50.0, reply_seq=4,
                   reply_backlog=False)  # fmt: skip
        self.assertIsNone(w.silent(B, "p1", "e1", now=50.1))

    def test_the_slow_path_outlasts_any_holder_on_its_peers_word(self) -> None:
        w = witnesses()
        # A holder's clock may run 10 % slow: it lives (heartbeat + tolerance) / 0.9 at most.
        self.assertAlmostEqual(w.slow_after(), (HEARTBEAT + TOLERANCE) / 0.9 + DEAD_AFTER)

    def test_a_host_awake_on_a_peer_lately(self) -> None:
        w = witnesses()
        w.answered(message(holds=("x.example",)), now=100.0, reply_seq=1, reply_backlog=False)
        self.assertEqual(w.holding("x.example", 101.0), B)
        self.assertIsNone(w.holding("y.example", 101.0))
        self.assertIsNone(w.holding("x.example", 100.0 + DEAD_AFTER))


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class EndpointTests(TestCase):
    """``POST /api/mesh/beat`` on the mesh API, a real membership behind it (a file bucket), the
    real client (PeerBeats) calling it over HTTP."""

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="wt", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.box = Box(self.root, "box-1")
        os.makedirs(os.path.join(self.root, "bucket"))
        self.store = FileStore(reactor, os.path.join(self.root, "bucket"), thread_runner(reactor))
        cfg = self.box.cfg()
        assert cfg.mesh is not None and cfg.hibernate is not None
        self.hib = cfg.hibernate
        self.membership = Membership(
            reactor, self.store, cfg.hibernate, cfg.mesh, peers=PeerBeats(reactor, TOKEN)
        )
        self.serve(self.membership.receive_beat)

    def serve(self, beats: Any) -> None:
        site = api.mesh_site(
            self.box.registry,
            self.box.cfg(),
            lambda reason: None,
            run_in_thread=thread_runner(reactor),
            beats=beats,
        )
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.url = f"http://127.0.0.1:{port.getHost().port}"

    def call(self, body: bytes, token: str = TOKEN) -> Deferred[bytes]:
        peers = PeerBeats(reactor, token)
        self.addCleanup(peers.close)
        return Deferred.fromCoroutine(peers.call(self.url, body, 5.0))

    @inlineCallbacks
    def test_a_beat_is_answered_recorded_and_relayed_on_request(self) -> Any:
        before = sample("lchat_mesh_relays_total", outcome="ok")
        sent = message(C, seq=3, relay=True, holds=("x.example",), process="pc")
        sent = evolve(sent, heartbeat=HeartbeatKeys.of(TOKEN).sign(sent.heartbeat))
        raw = yield self.call(sent.to_json())
        answer = BeatReply.parse(raw)
        self.assertEqual(answer.heartbeat.url, self.membership.url)
        self.assertTrue(answer.relayed)
        self.assertEqual(sample("lchat_mesh_relays_total", outcome="ok"), before + 1)
        # Relayed: the sender's heartbeat is in the bucket, its exact bytes.
        stored = yield Deferred.fromCoroutine(self.store.get(member_key(self.hib, C)))
        self.assertEqual(stored.body, sent.heartbeat.to_json())
        peer = self.membership.witnesses.peers[C]
        self.assertTrue(peer.required)
        self.assertEqual((peer.process, peer.seq), ("pc", 3))
        self.assertEqual(self.membership.holding("x.example"), C)

    @inlineCallbacks
    def test_a_heartbeat_with_a_wrong_mac_is_not_relayed_nor_a_member(self) -> Any:
        """A peer (it holds the token: its beat is answered) asks to relay a heartbeat whose MAC
        is not the mesh's — none at all, another token's, or a field changed after signing: it
        is not written, and the same body planted in the bucket by a bucket writer is no
        member of anyone's view."""
        failed = sample("lchat_mesh_relays_total", outcome="failed")
        bodies = {
            "none": beat(C, "pc"),
            "another token": HeartbeatKeys.of("another-token-" + "w" * 30).sign(beat(C, "pc")),
            "changed": evolve(HeartbeatKeys.of(TOKEN).sign(beat(C, "pc")), region="elsewhere"),
        }
        for seq, (why, heartbeat) in enumerate(bodies.items(), start=1):
            sent = BeatMessage(heartbeat=heartbeat, seq=seq, relay=True)
            answer = BeatReply.parse((yield self.call(sent.to_json())))
            self.assertFalse(answer.relayed, why)
            with self.assertRaises(NotFound):
                yield Deferred.fromCoroutine(self.store.get(member_key(self.hib, C)))
            yield Deferred.fromCoroutine(
                self.store.put(member_key(self.hib, C), heartbeat.to_json())
            )
            members = yield Deferred.fromCoroutine(
                read_members(self.store, self.hib, keys=HeartbeatKeys.of(TOKEN))
            )
            self.assertNotIn(C, [m.url for m in members], why)
            yield Deferred.fromCoroutine(self.store.delete(member_key(self.hib, C)))
        self.assertEqual(sample("lchat_mesh_relays_total", outcome="failed"), failed + 3)
        # The control: signed with the mesh token, it is a member.
        good = HeartbeatKeys.of(TOKEN).sign(beat(C, "pc"))
        yield Deferred.fromCoroutine(self.store.put(member_key(self.hib, C), good.to_json()))
        members = yield Deferred.fromCoroutine(
            read_members(self.store, self.hib, keys=HeartbeatKeys.of(TOKEN))
        )
        self.assertIn(C, [m.url for m in members])

    @inlineCallbacks
    def test_refusals(self) -> Any:
        with self.assertRaises(PeerCallError) as caught:
            yield self.call(message(C).to_json(), token="wrong-" + "x" * 30)
        self.assertEqual(caught.exception.status, 401)
        with self.assertRaises(PeerCallError) as caught:
            yield self.call(b'{"heartbeat": 1}')
        self.assertEqual(caught.exception.status, 400)
        with self.assertRaises(PeerCallError) as caught:  # from itself: refused
            yield self.call(message(self.membership.url).to_json())
        self.assertEqual(caught.exception.status, 400)
        with self.assertRaises(PeerCallError) as caught:  # no process: not a witness
            yield self.call(message(C, process="").to_json())
        self.assertEqual(caught.exception.status, 400)
        self.assertEqual(self.membership.witnesses.required(), [])

    @inlineCallbacks
    def test_a_router_without_a_membership_answers_404(self) -> Any:
        self.serve(None)
        with self.assertRaises(PeerCallError) as caught:
            yield self.call(message(C).to_json())
        self.assertEqual(caught.exception.status, 404)

    @inlineCallbacks
    def test_nobody_listening_is_no_answer(self) -> Any:
        self.url = "http://127.0.0.1:9"  # (discard: nothing listens there)
        with self.assertRaises(PeerCallError) as caught:
            yield self.call(message(C).to_json())
        self.assertIsNone(caught.exception.status)


class HeldChannel:
    """A peer channel (lchat.mesh.witness.PeerChannel) whose beats stay on their way until the
    test answers them: ``calls`` holds each beat's message and the Deferred of its reply."""

    def __init__(self) -> None:
        self.calls: list[tuple[BeatMessage, Deferred[bytes]]] = []

    async def call(self, url: str, body: bytes, timeout: float) -> bytes:  # noqa: ASYNC109
        answer: Deferred[bytes] = Deferred()
        self.calls.append((BeatMessage.parse(body), answer))
        return await answer


def membership_with(test: TestCase, channel: PeerChannel) -> tuple[Membership, list[str]]:
    """A box's membership (a file bucket in a temp dir) whose beats go through ``channel``,
    and the peers its unreachable hook was told of."""
    root = tempfile.mkdtemp(prefix="wm", dir="/tmp")
    test.addCleanup(shutil.rmtree, root, True)
    box = Box(root, "box-1")
    os.makedirs(os.path.join(root, "bucket"))
    store = FileStore(reactor, os.path.join(root, "bucket"), thread_runner(reactor))
    cfg = box.cfg()
    assert cfg.mesh is not None and cfg.hibernate is not None
    membership = Membership(reactor, store, cfg.hibernate, cfg.mesh, peers=channel)
    aborted: list[str] = []
    membership.on_unreachable(aborted.append)
    return membership, aborted


class FastWitnessTests(TestCase):
    """A write to a space whose backlog is older than its class promises waits for every peer to
    know of the backlog (lchat.hibernation.outage.WITNESS_WAIT). A regular beat saying "no
    backlog" still on its way to a slow peer must not hold the news up: its answer cannot make
    the peer know (fc28: a write refused at +0.7 s with bucket and peer both up)."""

    def setUp(self) -> None:
        self.channel = HeldChannel()
        self.membership, _ = membership_with(self, self.channel)
        self.backlog = False
        self.membership.report(lambda: self.backlog, tuple)
        self.peer = self.membership.witnesses.peer(B)

    def answer(self, index: int) -> None:
        _message, answer = self.channel.calls[index]
        answer.callback(reply(B, seq=100 + index).to_json())

    @inlineCallbacks
    def test_a_backlog_beat_overtakes_a_clear_one_on_its_way(self) -> Any:
        membership = self.membership
        regular = Deferred.fromCoroutine(membership._round(fast=False))
        self.assertEqual([m.backlog for m, _ in self.channel.calls], [False])
        self.backlog = True
        yield Deferred.fromCoroutine(membership._round(fast=True))
        # Sent at once, beside the clear beat still on its way (before: skipped until it came back).
        self.assertEqual([m.backlog for m, _ in self.channel.calls], [False, True])
        yield Deferred.fromCoroutine(membership._round(fast=True))
        self.assertEqual(len(self.channel.calls), 2)  # one backlog beat on its way is enough
        self.answer(1)
        self.assertTrue(membership.witnesses.knows_backlog(self.peer))
        self.assertEqual(self.peer.in_flight, 1)  # the clear beat is still on its way
        yield Deferred.fromCoroutine(membership._round(fast=True))
        self.assertEqual(len(self.channel.calls), 2)  # the peer knows: nothing more to tell
        self.answer(0)  # its late answer takes nothing back
        yield regular
        self.assertTrue(membership.witnesses.knows_backlog(self.peer))
        self.assertEqual(self.peer.in_flight, 0)

    @inlineCallbacks
    def test_without_a_backlog_one_beat_at_a_time(self) -> Any:
        membership = self.membership
        regular = Deferred.fromCoroutine(membership._round(fast=False))
        yield Deferred.fromCoroutine(membership._round(fast=True))
        self.assertEqual(len(self.channel.calls), 1)
        self.answer(0)
        yield regular
        self.assertEqual(self.peer.in_flight, 0)
