"""A holder out of reach: silent (a cut) against refused (its router is stopping or dead).

A peer that is alive but silent may be serving the space to clients that still reach it, so a
request for one of its spaces is refused at once (503, Retry-After) rather than waking here into
its lease. A peer whose port *refuses* the connection has no router answering: nothing of it can
be serving, and the request goes to this box's activator, which meets the lease (released within
moments by a drain, or judged) — a drain that began before its heartbeat said so must not turn
into 503s (tests.test_drain saw three)."""

from __future__ import annotations

from lchat.router import LocalResponse
from tests.test_mesh_routing import (
    SELF,
    SERVED_HERE,
    C,
    Peer,
    View,
    _Base,
    _deferred,
    host_owned_by,
)


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
        assert target.fallback is not None
        rerouted = self.successResultOf(_deferred(target.fallback(why)))
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
