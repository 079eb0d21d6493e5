"""Writes during an outage (docs/lease.md, "Writes during an outage", "An isolated box"): what a
request to an awake hibernating space gets while its writes cannot ship.

- A space on a mesh box that is not alive any more (cut off from bucket and peers) is *fenced*:
  its lease is lost, its replicator stopped, and it answers reads from its copy, marked
  ``X-Lchat-Read-Only: isolated``; writes and its sidecar's requests get 503 ``not_witnessed``.
- A write to a *stale* space (its oldest commit not in the bucket is older than its class
  promises) is passed on once every peer that could take this box's spaces over knows it holds
  such writes (then none will, and the write ships when the bucket is back); else, after at most
  :data:`WITNESS_WAIT`, 503: a write acknowledged now could be lost to a takeover.
- Refusals are counted each, logged once per :data:`REFUSED_LOG_EVERY` per host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prometheus_client import Counter
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat.hibernation.space import Space
from lchat.lease import BOX_NOT_ALIVE
from lchat.router import Header, LocalResponse, LocalSocket, Target

_log = Logger(namespace="lchat.activator")

# A write to a space whose backlog is older than its class promises waits at most this long for
# the peers to know of it, then gets a 503.
WITNESS_WAIT = 0.75
REFUSED_LOG_EVERY = 10.0  # seconds between "writes refused" lines for one host

_fenced = Counter(
    "lchat_spaces_read_only_total",
    "Spaces kept answering reads (writes refused, nothing shipped) because this mesh box was "
    "cut off from the bucket and its peers (its liveness lapsed)",
)
_refused_writes = Counter(
    "lchat_writes_refused_total",
    "Writes answered 503 because their space's backlog is older than its replication class "
    "promises and this box's peers could not be told (it is isolated from bucket and peers)",
)

Unavailable = Callable[[str, str, float], LocalResponse]  # (host, reason, Retry-After): a 503


class WriteWitness(Protocol):
    """What the activator asks a mesh box's membership before acknowledging a write that cannot
    ship now (lchat.mesh.membership.Membership)."""

    def writes_safe(self) -> bool: ...

    def writes_known(self, timeout: float) -> Deferred[bool]: ...


def stale(space: Space) -> bool:
    """Is ``space``'s oldest commit not in the bucket older than its class promises?"""
    replicator = space.replicator
    return replicator is not None and replicator.lag() > replicator.interval


class OutageWrites:
    """The activator's answers for spaces whose writes cannot ship (see the module docstring).
    ``witness``: a mesh box's membership (None off a mesh: nothing waits for it)."""

    def __init__(
        self, clock: IReactorTime, witness: WriteWitness | None, unavailable: Unavailable
    ) -> None:
        self._clock = clock
        self._witness = witness
        self._unavailable = unavailable
        self._logged: dict[str, float] = {}  # host -> last "writes refused" line

    def fence(self, space: Space) -> None:
        """The box is not alive: ``space`` writes nothing more (its lease is lost, its
        replicator stopped) but keeps answering reads from its copy, until the box is alive
        again (the activator's recovery stands it down) or it is slept."""
        space.lost = BOX_NOT_ALIVE
        space.fenced = True
        _fenced.inc()
        if space.replicator is not None:
            Deferred.fromCoroutine(space.replicator.stop())
        _log.error(
            "activator: {host}: this box is cut off from the bucket and its peers: read-only "
            "now (reads answered from its copy, writes refused, nothing shipped) until it is "
            "alive again",
            host=space.host,
        )

    def read_only(self, space: Space, sidecar: bool, write: bool) -> Target:
        """A fenced space: reads from its copy, marked; writes refused."""
        host = space.host
        if write or sidecar:
            if self._refused(host):
                _log.warn(
                    "activator: {host}: writes refused (503): this box is cut off from the "
                    "bucket and its peers; reads are answered from its copy, which may be "
                    "behind (X-Lchat-Read-Only: isolated)",
                    host=host,
                )
            return self._unavailable(host, "not_witnessed", 1.0)
        marked: Header = (b"x-lchat-read-only", b"isolated")
        return LocalSocket(host=host, path=space.socket, response_headers=(marked,), inflight=space)

    def must_wait(self, space: Space, write: bool) -> bool:
        """Does this request wait for the peers' word (:meth:`write_target`)?"""
        return write and self._witness is not None and stale(space)

    def write_target(
        self, space: Space, sidecar: bool, awake: Callable[[Space], bool]
    ) -> Target | Deferred[Target]:
        """A write to stale ``space``: its socket once the peers know, else a 503 (``awake``:
        whether the activator still runs ``space`` awake, asked when the answer comes)."""
        assert self._witness is not None
        host = space.host

        def target(safe: bool) -> Target:
            if not awake(space):
                return self._unavailable(host, "stood_down", 0.0)
            if safe:
                return LocalSocket(
                    host=host, path=space.socket, inflight=None if sidecar else space
                )
            if self._refused(host):
                replicator = space.replicator
                _log.warn(
                    "activator: {host}: writes refused (503): {lag:.1f}s of its writes are not "
                    "in the bucket yet, and no peer could be told so: this box cannot reach the "
                    "bucket or its peers; reads are still served",
                    host=host,
                    lag=replicator.lag() if replicator is not None else 0.0,
                )
            return self._unavailable(host, "not_witnessed", 1.0)

        if self._witness.writes_safe():
            return target(True)
        return self._witness.writes_known(WITNESS_WAIT).addCallback(target)

    def _refused(self, host: str) -> bool:
        """Count one refused write to ``host``; whether to log it (once per interval)."""
        _refused_writes.inc()
        now = self._clock.seconds()
        if now - self._logged.get(host, float("-inf")) < REFUSED_LOG_EVERY:
            return False
        self._logged[host] = now
        return True
