"""A holder out of reach: silent (a cut) against refused (its router is stopping or dead).

A peer that is alive but silent may be serving the space to clients that still reach it, so a
request for one of its spaces is refused at once (503, Retry-After) rather than waking here into
its lease. A peer whose port *refuses* the connection has no router answering: nothing of it can
be serving, and the request goes to this box's activator, which meets the lease (released within
moments by a drain, or judged) — a drain that began before its heartbeat said so must not turn
into 503s (tests.test_drain saw three)."""

from __future__ import annotations

import socket

from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from lchat.mesh.client import PeerBeats
from lchat.mesh.heartbeat import Heartbeat
from lchat.mesh.membership import Membership
from lchat.mesh.witness import BeatReply, PeerCallError
from lchat.reactors import installed
from lchat.router import LocalResponse
from tests.test_mesh_api import TOKEN
from tests.test_mesh_routing import (
    SELF,
    SERVED_HERE,
    C,
    Peer,
    View,
    _Base,
    host_owned_by,
)
from tests.test_witness import HeldChannel, membership_with

reactor = installed()

PEER = "https://box-b.example.net"


class WitnessView(View):
    """A view with the witness's answers (lchat.mesh.membership.Membership): every peer is fresh
    in the bucket and heard just now; none is marked unreachable by its beats."""

    def peer_unreachable(self, url: str) -> bool:
        return False

    def silent_for(self, url: str) -> float:
        return 0.0

    def fresh_in_bucket(self, url: str) -> bool:
        return True

    def kick(self, url: str) -> None:
        pass


class RefusedHolderTests(_Base):
    def holder_failing(self, why: str) -> tuple[str, object, object]:
        mesh = self.mesh(WitnessView(Peer(SELF), Peer(C)))
        host = host_owned_by(SELF, SELF, C)
        self.hold_lease(host, C)
        target = self.assertForwardedTo(self.routed(mesh, host), C, host)
        rerouted = self.successResultOf(self.reroute(mesh, target, why))
        return host, rerouted, self.routed(mesh, host)

    def test_a_silent_holder_alive_in_the_bucket_is_refused_at_once(self) -> None:
        _, rerouted, later = self.holder_failing("unreachable")
        for target in (rerouted, later):
            assert isinstance(target, LocalResponse), target
            self.assertEqual(target.status, 503)
        self.assertEqual(self.served, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_holder_whose_port_refuses_goes_to_the_activator(self) -> None:
        host, rerouted, later = self.holder_failing("refused")
        self.assertIs(rerouted, SERVED_HERE)
        self.assertIs(later, SERVED_HERE)  # left out meanwhile, not tried again
        self.assertEqual(self.served, [host, host])


class RefusingChannel:
    """A peer channel (lchat.mesh.witness.PeerChannel) whose every beat fails as ``error``."""

    def __init__(self, error: PeerCallError) -> None:
        self.error = error
        self.calls = 0

    async def call(self, url: str, body: bytes, timeout: float) -> bytes:  # noqa: ASYNC109
        self.calls += 1
        raise self.error


class BeatRefusedTests(TestCase):
    """The beats' side: a peer whose port refuses a beat is not out of reach (no abort of the
    connections its draining router is still answering, no 503 for its spaces); a silent one is
    (tests.test_drain saw a drain's in-flight POSTs aborted into 502s)."""

    def membership(self, error: PeerCallError) -> tuple[Membership, list[str]]:
        self.channel = RefusingChannel(error)
        return membership_with(self, self.channel)

    async def beat_once(self, membership: Membership, url: str) -> None:
        peer = membership.witnesses.peer(url)
        answered, _ = await membership._send(peer, membership._message(), 1.0)
        self.assertFalse(answered)

    async def test_a_refused_beat_aborts_nothing_and_marks_no_cut(self) -> None:
        membership, aborted = self.membership(PeerCallError(PEER, "refused", refused=True))
        await self.beat_once(membership, PEER)
        self.assertEqual(aborted, [])
        self.assertFalse(membership.peer_unreachable(PEER))

    async def test_a_silent_beat_aborts_its_connections_and_marks_a_cut(self) -> None:
        membership, aborted = self.membership(PeerCallError(PEER, "no answer within 1s"))
        await self.beat_once(membership, PEER)
        self.assertEqual(aborted, [PEER])
        self.assertTrue(membership.peer_unreachable(PEER))

    async def test_a_holder_silent_twice_lately_is_not_probed_again(self) -> None:
        """Judging a holder dead ends with a probe of it; when this box's last two beats to it
        went unanswered within a heartbeat and it said nothing since, the probe would only wait
        out its timeout again (a second more before its spaces are served elsewhere)."""
        membership, _ = self.membership(PeerCallError(PEER, "no answer within 1s"))
        channel = self.channel
        assert isinstance(channel, RefusingChannel)
        await self.beat_once(membership, PEER)
        self.assertFalse(await membership.probe(PEER))  # once: asked
        self.assertEqual(channel.calls, 2)
        self.assertFalse(await membership.probe(PEER))  # twice lately: not asked again
        self.assertEqual(channel.calls, 2)
        # Heard from since (a beat of its own came in): asked again.
        membership.witnesses.peers[PEER].heard = membership._monotonic() + 1.0
        self.assertFalse(await membership.probe(PEER))
        self.assertEqual(channel.calls, 3)


class StaleBeatTests(TestCase):
    """A beat sent during a cut that gives up after a later beat was answered says nothing of
    the peer now. Counted, it marked a peer that answered out of reach and aborted a POST on its
    way to it into a 502 just after the link healed (tests.test_mesh_cuts, isolate-box0, CI)."""

    def membership(self) -> tuple[Membership, HeldChannel, list[str]]:
        channel = HeldChannel()
        membership, aborted = membership_with(self, channel)
        return membership, channel, aborted

    def test_an_old_beats_silence_after_a_newer_answer_counts_for_nothing(self) -> None:
        membership, channel, aborted = self.membership()
        peer = membership.witnesses.peer(PEER)
        old = Deferred.fromCoroutine(membership._send(peer, membership._message(), 1.0))
        new = Deferred.fromCoroutine(membership._send(peer, membership._message(), 1.0))
        self.assertEqual(len(channel.calls), 2)
        channel.calls[1][1].callback(reply_of(PEER))  # the link healed: the newer beat is answered
        self.assertEqual(self.successResultOf(new), (True, None))
        channel.calls[0][1].errback(
            PeerCallError(PEER, "no answer within 1s")
        )  # the older gives up
        self.assertEqual(self.successResultOf(old), (False, None))
        self.assertEqual(aborted, [])
        self.assertFalse(membership.peer_unreachable(PEER))
        self.assertEqual(peer.failed, 0)

    def test_a_newer_beats_silence_still_counts(self) -> None:
        membership, channel, aborted = self.membership()
        peer = membership.witnesses.peer(PEER)
        old = Deferred.fromCoroutine(membership._send(peer, membership._message(), 1.0))
        new = Deferred.fromCoroutine(membership._send(peer, membership._message(), 1.0))
        channel.calls[0][1].callback(reply_of(PEER))
        self.assertEqual(self.successResultOf(old), (True, None))
        channel.calls[1][1].errback(PeerCallError(PEER, "no answer within 1s"))
        self.assertEqual(self.successResultOf(new), (False, None))
        self.assertEqual(aborted, [PEER])
        self.assertTrue(membership.peer_unreachable(PEER))


def reply_of(url: str) -> bytes:
    return BeatReply(
        heartbeat=Heartbeat(url, "", "0.1.0", 1.0, epoch="e", process="p"), seq=1
    ).to_json()


class PeerBeatsRefusedTests(TestCase):
    """The real client tells a refused connection from a silent one."""

    async def call(self, url: str, timeout: float) -> PeerCallError:  # noqa: ASYNC109
        peers = PeerBeats(reactor, TOKEN)
        self.addCleanup(peers.close)
        with self.assertRaises(PeerCallError) as caught:
            await peers.call(url, b"{}", timeout)
        return caught.exception

    async def test_a_closed_port_is_refused(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, never listening: the kernel refuses
            caught = await self.call(f"http://127.0.0.1:{port}", 2.0)
        self.assertTrue(caught.refused, caught)

    async def test_a_listener_that_never_answers_is_not_refused(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen(8)  # accepts (the kernel's backlog), never reads nor answers
            caught = await self.call(f"http://127.0.0.1:{s.getsockname()[1]}", 0.3)
        self.assertFalse(caught.refused, caught)
