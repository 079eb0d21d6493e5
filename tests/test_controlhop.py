"""lchat.controlhop: a worker process's router with the hop seams (the real Router, a real route
table): what goes to the control process's hop socket, with what, and what stays the worker's."""

from __future__ import annotations

from typing import Any

from attrs import evolve
from twisted.trial.unittest import SynchronousTestCase

from lchat import controlhop
from lchat.controlhop import HopActivator, HopMesh
from lchat.registry import Route
from lchat.router import (
    ACME_CHALLENGE_PATH,
    LocalResponse,
    LocalSocket,
    RemotePeer,
    RequestHead,
    Router,
)
from tests.test_router import table_of

HOP = "/run/lchat/workers/hop.sock"
MESH_SOCK = "/run/lchat/mesh.sock"
ACME_SOCK = "/run/lchat/acme.sock"
SELF = "box1.mesh.example.com"

READY = Route("chat.example.com", "instance", "/run/chat.sock", status="ready")
SLEEPY = Route("sleepy.example.com", "instance", "/run/sleepy.sock", status="ready", hibernate=True)
ELSEWHERE = Route(
    "far.example.com", "instance", "", status="ready", lives_at="https://box2.mesh.example.com"
)
SERVICE = Route("svc.example.com", "service", "/run/svc.sock", status="ready")


def head(host: str, **fields: Any) -> RequestHead:
    return RequestHead(b"GET", b"/", host, "192.0.2.7", True)._replace(**fields)


def worker_router(*, mesh: bool = True, hibernate: bool = True) -> Router:
    """A worker's router as lchat.worker_tap builds it."""
    return Router(
        table_of(READY, SLEEPY, ELSEWHERE, SERVICE),
        activator=HopActivator(HOP) if hibernate else None,
        mesh=HopMesh(HOP) if mesh else None,
        mesh_api=(SELF, MESH_SOCK) if mesh else None,
        acme_challenge=ACME_SOCK,
    )


def hop(host: str, *added: tuple[bytes, bytes]) -> LocalSocket:
    return LocalSocket(host, HOP, kind="hop", add_headers=added)


class HopRoutingTests(SynchronousTestCase):
    def test_a_hibernating_host_goes_to_control(self) -> None:
        """With or without the mesh, a hibernating host's request is control's (its wake, its
        in-flight ticket): a hop target carrying nothing, the same object every time."""
        for mesh in (True, False):
            with self.subTest(mesh=mesh):
                router = worker_router(mesh=mesh)
                target = router.route(head("sleepy.example.com"))
                self.assertEqual(target, hop("sleepy.example.com"))
                self.assertIs(router.route(head("sleepy.example.com")), target)
                post = router.route(head("sleepy.example.com", method=b"POST"))
                self.assertIs(post, target)  # (control reads "write" from the method again)

    def test_a_sidecars_request_carries_its_marker(self) -> None:
        for mesh in (True, False):
            with self.subTest(mesh=mesh):
                router = worker_router(mesh=mesh)
                target = router.route(head("sleepy.example.com", sidecar=True))
                self.assertEqual(target, hop("sleepy.example.com", controlhop.SIDECAR))
                self.assertIs(router.route(head("sleepy.example.com", sidecar=True)), target)
                self.assertNotEqual(router.route(head("sleepy.example.com")), target)

    def test_a_mesh_forwards_marker_is_emitted_again(self) -> None:
        """X-Lchat-Mesh-Forwarded (read and taken out by the worker's proxy) goes on to
        control, which checks it: for a hibernating host and for a lives-elsewhere row."""
        router = worker_router()
        for host in ("sleepy.example.com", "far.example.com"):
            with self.subTest(host=host):
                target = router.route(head(host, forwarded=b"token"))
                self.assertEqual(target, hop(host, (b"X-Lchat-Mesh-Forwarded", b"token")))
                both = router.route(head(host, forwarded=b"token", sidecar=True))
                self.assertEqual(
                    both,
                    hop(host, controlhop.SIDECAR, (b"X-Lchat-Mesh-Forwarded", b"token")),
                )

    def test_a_lives_elsewhere_row_goes_to_control(self) -> None:
        self.assertEqual(worker_router().route(head("far.example.com")), hop("far.example.com"))

    def test_what_stays_the_workers(self) -> None:
        """Ready rows go to their own socket; the ACME path and the mesh-self host to control's
        sockets directly (no hop); unknown hosts and rows not ready are the worker's answers."""
        router = worker_router()
        self.assertEqual(
            router.route(head("chat.example.com")), LocalSocket("chat.example.com", READY.socket)
        )
        self.assertEqual(
            router.route(head("svc.example.com")),
            LocalSocket("svc.example.com", SERVICE.socket, kind="service"),
        )
        acme = head("sleepy.example.com", secure=False, target=ACME_CHALLENGE_PATH + b"tok")
        self.assertEqual(
            router.route(acme), LocalSocket("sleepy.example.com", ACME_SOCK, kind="service")
        )
        self.assertEqual(router.route(head(SELF)), LocalSocket(SELF, MESH_SOCK, kind="service"))
        unknown = router.route(head("other.example.com"))
        assert isinstance(unknown, LocalResponse)
        self.assertEqual(unknown.status, 404)
        creating = Router(
            table_of(evolve(SLEEPY, status="creating")), activator=HopActivator(HOP)
        ).route(head("sleepy.example.com"))
        assert isinstance(creating, LocalResponse)
        self.assertEqual(creating.status, 503)

    def test_no_activator_is_todays_503(self) -> None:
        """A worker of a box without LCHAT_HIBERNATE_BUCKET answers a hibernating row as a
        single process does, and a box outside the mesh a lives-elsewhere row."""
        router = worker_router(mesh=False, hibernate=False)
        single = Router(table_of(READY, SLEEPY, ELSEWHERE, SERVICE))
        for host in ("sleepy.example.com", "far.example.com"):
            with self.subTest(host=host):
                target = router.route(head(host))
                assert isinstance(target, LocalResponse)
                self.assertEqual(target, single.route(head(host)))
                self.assertEqual(target.status, 503)
        sleepy = router.route(head("sleepy.example.com"))
        assert isinstance(sleepy, LocalResponse)
        self.assertIn(b"this router has no activator (LCHAT_HIBERNATE_BUCKET", sleepy.body)

    def test_the_target_cache_is_bounded(self) -> None:
        activator = HopActivator(HOP)
        first = activator.route(SLEEPY)
        for n in range(controlhop.CACHE_LIMIT):
            activator.route(evolve(SLEEPY, host=f"h{n}.example.com"))
        again = activator.route(SLEEPY)
        self.assertEqual(again, first)
        self.assertIsNot(again, first)  # (made again: the map was cleared past the limit)

    def test_reroute_is_never_the_workers(self) -> None:
        peer = RemotePeer("far.example.com", "10.0.0.2", 443, "far.example.com", member="m")
        with self.assertRaises(AssertionError):
            HopMesh(HOP).reroute(ELSEWHERE, head("far.example.com"), peer, "unreachable")
