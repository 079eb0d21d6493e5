"""A worker process's stand-ins for the activator and the mesh: requests it cannot serve itself go
to the control process, as one more upstream.

With ``LCHAT_WORKERS`` ≥ 2 a box runs one control process and N worker processes (docs/performance.md
"Many cores"). The wake, the in-flight ticket of an awake hibernating space, its sleep, and the mesh's
routing of a request live in control only: one activator, one ticket per space, per box. A worker's
:class:`lchat.router.Router` is the single process's router with its two seams filled from here:
every request for a hibernating host (awake or not) and every mesh forward is routed to the
control process's hop socket, ``<run>/workers/hop.sock``, where a full router serves it
(``ProxyFactory(trusted_hop=True)``). The worker splices to control, control to the space: streaming,
backpressure and WebSockets work as with any upstream. Ready rows, unknown hosts and the router's own
answers stay the worker's (the same code as a single process's).

What control must know to route the request as the worker would have is carried in the request:
the client and scheme in the worker's X-Forwarded-For (its last element) and X-Forwarded-Proto
(lchat.proxy.exchange.hop_origin), and the internal markers the worker read and took out, a
sidecar's X-Lchat-Sidecar and a mesh peer's X-Lchat-Mesh-Forwarded, added back as the target's
``add_headers``. Control's drain refusal (X-Lchat-Refused) comes back through a hop target's answer
(lchat.proxy.relay), for the mesh peer that forwarded the request.
"""

from __future__ import annotations

from lchat.registry import Route
from lchat.router import Header, LocalSocket, RemotePeer, RequestHead

SIDECAR: Header = (b"X-Lchat-Sidecar", b"1")
FORWARDED = b"X-Lchat-Mesh-Forwarded"
# Hop targets kept per (host, sidecar), as ProxyFactory.host_names keeps Host values: cleared whole
# past this many (hosts removed since are forgotten with the rest).
CACHE_LIMIT = 4096


class _Hops:
    """Hop targets to ``path``, one per (host, sidecar), made once, not per request."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._targets: dict[tuple[str, bool], LocalSocket] = {}

    def target(self, host: str, sidecar: bool, forwarded: bytes | None = None) -> LocalSocket:
        if forwarded is not None:
            # A mesh peer's forward: its marker goes on to control (which checks it), and the
            # target is this request's own.
            headers = (*((SIDECAR,) if sidecar else ()), (FORWARDED, forwarded))
            return LocalSocket(host=host, path=self.path, kind="hop", add_headers=headers)
        key = (host, sidecar)
        target = self._targets.get(key)
        if target is None:
            if len(self._targets) >= CACHE_LIMIT:
                self._targets.clear()
            target = LocalSocket(
                host=host, path=self.path, kind="hop", add_headers=(SIDECAR,) if sidecar else ()
            )
            self._targets[key] = target
        return target


class HopActivator:
    """The activator as a worker's router sees it (:class:`lchat.router.Hibernation`): every
    request for a hibernating host goes to the control process's hop socket at ``path``, whose
    activator wakes the space and holds its in-flight ticket. ``write`` needs no carrying: control
    reads it from the method again."""

    def __init__(self, path: str) -> None:
        self._hops = _Hops(path)

    def route(self, route: Route, sidecar: bool = False, write: bool = False) -> LocalSocket:
        return self._hops.target(route.host, sidecar)


class HopMesh:
    """The mesh's routing as a worker's router sees it (:class:`lchat.router.Mesh`): every
    hibernating host is in scope and every request for one, like every request for a peer's
    lives-elsewhere row, goes to the control process's hop socket at ``path``, whose mesh
    routes it (here, or forwarded to a peer, and routed again without a peer that could not take
    it: ``reroute`` is control's, as a worker never makes a RemotePeer)."""

    def __init__(self, path: str) -> None:
        self._hops = _Hops(path)

    def in_scope(self, host: str) -> bool:
        return True  # control asks its own mesh

    def route(self, route: Route, head: RequestHead) -> LocalSocket:
        return self._hops.target(route.host, head.sidecar, head.forwarded)

    def forward_elsewhere(self, route: Route, head: RequestHead) -> LocalSocket:
        return self._hops.target(route.host, head.sidecar, head.forwarded)

    def reroute(self, route: Route, head: RequestHead, peer: RemotePeer, why: str) -> LocalSocket:
        raise AssertionError(
            f"a worker process made no mesh peer target to route {route.host} again without "
            f"({peer.member}, {why}): its mesh forwards are control's"
        )
