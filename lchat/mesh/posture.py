"""The box's replication posture, said once at start (the seed's "controld posture line").

A space created on a box whose ``lchat`` does not see the mesh settings is born dark on its peers
(they answer 404 for it until ``lchat mesh-seed``): the live incident of the seed. So the router
says at start, in one line, what replicates from here and to whom:

    mesh posture: on as https://box-1.example.net (region ie), domains example.net; 2 peers live,
    2 reachable: https://box-2.example.net, https://box-3.example.net; routes created with
    `lchat --env-file /data/router.env` fan out to them

(or ``mesh posture: off ...``). "Reachable" is a TCP connect to each live peer's URL within a few
seconds (the mesh API is served on that listener); a peer that is live in the bucket but not
reachable will miss every fan-out, and the line says so as a warning.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from lchat.config import BoxConfig
from lchat.mesh.members import Member
from lchat.mesh.membership import Membership
from lchat.reactors import TCPReactor

_log = Logger(namespace="lchat.mesh.posture")

CONNECT_TIMEOUT = 3.0


def say_off(cfg: BoxConfig) -> None:
    """The line of a box without the mesh."""
    _log.info(
        "mesh posture: off (LCHAT_MESH_SELF is not set in {env_file}): routes created here stay "
        "on this box",
        env_file=cfg.env_file,
    )


class Posture(Service):
    """Logs the posture once, after the membership's first read (or after ``wait`` seconds)."""

    name = "mesh-posture"

    def __init__(self, reactor: TCPReactor, cfg: BoxConfig, membership: Membership) -> None:
        assert cfg.mesh is not None
        self._reactor = reactor
        self._cfg = cfg
        self._membership = membership
        self._wait = 3 * cfg.mesh.heartbeat
        self._call: IDelayedCall | None = None
        self._deadline = 0.0
        self.said: Deferred[str] = Deferred()  # fires with the line (tests)

    def startService(self) -> None:
        super().startService()
        self._deadline = self._reactor.seconds() + self._wait
        self._call = self._reactor.callLater(0.1, self._check)

    def stopService(self) -> None:
        super().stopService()
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _check(self) -> None:
        self._call = None
        if self._membership.beats >= 1 or self._reactor.seconds() >= self._deadline:
            Deferred.fromCoroutine(self._say()).addErrback(
                lambda f: _log.failure("mesh posture: could not be said", f)
            )
        elif self.running:
            self._call = self._reactor.callLater(0.2, self._check)

    async def _say(self) -> None:
        mesh = self._cfg.mesh
        assert mesh is not None
        peers = self._membership.peers()
        checks = [self._reachable(m) for m in peers]
        outcomes = await DeferredList(checks, consumeErrors=True) if checks else []
        reachable = [m.url for m, (ok, value) in zip(peers, outcomes, strict=True) if ok and value]
        unreachable = [m.url for m in peers if m.url not in reachable]
        line = (
            f"mesh posture: on as {self._membership.url} (region {mesh.region or '-'}), domains "
            f"{', '.join(mesh.domains) or '-'}; {len(peers)} peers live, {len(reachable)} "
            f"reachable{': ' + ', '.join(reachable) if reachable else ''}; routes created with "
            f"`lchat --env-file {self._cfg.env_file}` fan out to them"
        )
        if unreachable:
            _log.warn(
                "{line}; NOT reachable (they miss every fan-out until `lchat mesh-seed`): "
                "{unreachable}",
                line=line,
                unreachable=", ".join(unreachable),
            )
        else:
            _log.info("{line}", line=line)
        if not self.said.called:
            self.said.callback(line)

    def _reachable(self, member: Member) -> Deferred[bool]:
        parts = urlsplit(member.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        endpoint = HostnameEndpoint(
            self._reactor, parts.hostname or "", port, timeout=CONNECT_TIMEOUT
        )
        d: Deferred[Any] = endpoint.connect(Factory.forProtocol(Protocol))

        def connected(protocol: Protocol) -> bool:
            if protocol.transport is not None:
                protocol.transport.loseConnection()
            return True

        d.addCallbacks(connected, lambda _: False)
        return d
