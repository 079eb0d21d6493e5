"""Due wakes follow the owner: push a space's ``next_due`` to the mesh peers when it changes.

A hibernating space reports its next scheduled delivery when it sleeps; the activator stores it in
this box's registry (``RouteSource.record_next_due``), and a due wake clears it. The due sweep fires
only on the space's owner by hash (``MeshRouter.is_owner``), which is not always the box it slept
on: after a drain, a box leaving or joining, ownership moves. So every change of a mesh space's
``next_due`` here is pushed, with its route and env values (the payload of
``POST /api/mesh/route`` and its ``next_due`` field), to every live peer that must hold the route
(:func:`lchat.mesh.client.fan_out_targets` over this router's own membership view). Whichever box
owns the space at the due time then has the due time, and its sweep wakes it.

Invariants:

- Best effort, never in the way: the push runs after the registry write, never delays a sleep or
  a wake, and each call is bounded by ``timeout`` seconds. A peer that is down or refuses is
  logged and counted (``lchat_mesh_due_pushes_total{outcome}``); ``lchat mesh-seed`` reconciles
  it (its payloads carry every non-zero ``next_due``).
- Per host, one push round at a time, and the value pushed is the row's *at push time*: a change
  arriving during a round causes exactly one more round afterwards, so peers end with the latest
  value whatever the order of events (a sleep's due time, then the clear of a due wake).
- ``stopService`` (the drain, after the activator has slept every space) waits for the due times
  still being recorded and for every push round, so the due times of the spaces a drain slept
  reach the peers before this box is gone; bounded by the calls' own timeouts.
- Only hibernating instance rows in the mesh's scope (under its domains, or with a home region);
  a box only pushes what its own activator recorded, so a pushed value is never pushed back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList
from twisted.logger import Logger

from lchat import hosts
from lchat.config import ConfigError, MeshConfig
from lchat.mesh import client
from lchat.mesh.members import Member
from lchat.reactors import TCPReactor
from lchat.registry import Route
from lchat.routesource import RouteSource
from lchat.threads import RunInThread

DUE_PUSH_TIMEOUT = 5.0  # seconds per call to one peer

_pushes = Counter(
    "lchat_mesh_due_pushes_total",
    "Pushes of a space's next_due to mesh peers, per peer, by outcome (pushed, failed; "
    "unreadable: the row's env file could not be read, nothing was sent)",
    ["outcome"],
)
_log = Logger(namespace="lchat.mesh.due")


class DuePush(Service):
    """Pushes every change of a mesh space's ``next_due`` to the live peers; see the module."""

    name = "due-push"

    def __init__(
        self,
        reactor: TCPReactor,
        mesh: MeshConfig,
        data_dir: str,
        routes: RouteSource,
        members: Callable[[], Sequence[Member]],
        *,
        run_in_thread: RunInThread,
        timeout: float = DUE_PUSH_TIMEOUT,
    ) -> None:
        """``members``: the router's live membership view (``Membership.live``), this box
        included."""
        self._reactor = reactor
        self._mesh = mesh
        self._data_dir = data_dir
        self._routes = routes
        self._members = members
        self._run = run_in_thread
        self.timeout = timeout
        self._rounds: dict[str, Deferred[None]] = {}  # host -> its push round under way
        self._again: set[str] = set()  # hosts changed during their round: one more round
        routes.subscribe_next_due(self.changed)

    def changed(self, host: str, due: int) -> None:
        """``host``'s next_due changed in this box's registry (to ``due``): push it. Returns at
        once; the push runs in the background."""
        if host in self._rounds:
            self._again.add(host)
            return
        self._start(host)

    def stopService(self) -> Deferred[None]:
        """Wait for the due times being recorded, then for every push round (each bounded)."""
        super().stopService()
        return Deferred.fromCoroutine(self._settle())

    async def _settle(self) -> None:
        await self._routes.recorded()
        while self._rounds:
            await DeferredList(list(self._rounds.values()), consumeErrors=True)

    # -- a round -----------------------------------------------------------------------------

    def _start(self, host: str) -> None:
        d = Deferred.fromCoroutine(self._round(host))
        self._rounds[host] = d

        def over(_: object) -> None:
            del self._rounds[host]
            if host in self._again:
                self._again.discard(host)
                self._start(host)

        d.addErrback(lambda f: _log.failure("mesh: next due push of {host} failed", f, host=host))
        d.addBoth(over)

    async def _round(self, host: str) -> None:
        found: tuple[Route, dict[str, str], dict[str, str]] | None = await self._run(
            self._read, host
        )
        if found is None:
            return
        route, env, bot_env = found
        targets = client.fan_out_targets(self._mesh, host, route.home_region, self._members())
        if not targets:
            return  # not a mesh host (fan_out_targets decides: domains, or the home region)
        # The whole settings ride along (the bot's too): a payload without them would read as
        # other settings at the same generation on the peer.
        payload = client.route_payload(route, env, next_due=route.next_due, bot_env=bot_env)
        due = route.next_due
        results = await DeferredList(
            [Deferred.fromCoroutine(self._one(m.url, payload, due)) for m in targets],
            consumeErrors=True,
        )
        missed = [targets[i].url for i, (ok, value) in enumerate(results) if not ok or not value]
        if missed:
            _log.warn(
                "mesh: {n} peer(s) missed the next due of {host} ({missed}); if one of them owns "
                "it at the due time, its reminder waits for the next request: catch them up with "
                "`lchat mesh-seed <peer>` from this box",
                n=len(missed),
                host=host,
                missed=", ".join(missed),
            )

    def _read(self, host: str) -> tuple[Route, dict[str, str], dict[str, str]] | None:
        """The row and its replicable env values (its bot sidecar's too), in a thread; None when there is nothing to
        push (no row any more, not a hibernating instance, or an env file that cannot be read)."""
        route = self._routes.registry.get(host)
        if route is None or route.kind != "instance" or not route.hibernate:
            return None
        try:
            env = client.read_route_env(self._data_dir, host)
            bot_env = client.read_bot_env(self._data_dir, host)
        except (ConfigError, hosts.InvalidHost) as e:
            _pushes.labels("unreadable").inc()
            _log.error(
                "mesh: not pushing the next due of {host} to peers: its env file cannot be read "
                "({e}); fix it, then run `lchat mesh-seed <peer>`",
                host=host,
                e=e,
            )
            return None
        return route, env, bot_env

    async def _one(self, peer: str, payload: Mapping[str, Any], due: int) -> bool:
        host = payload["host"]
        try:
            answer = await client.push_route(
                peer,
                self._mesh.token,
                payload,
                ca_file=self._mesh.ca_file,
                timeout=self.timeout,
                reactor=self._reactor,
            )
        except Exception as e:  # MeshCallError, or anything unforeseen: never past this peer
            _pushes.labels("failed").inc()
            _log.warn(
                "mesh: next due of {host} ({due}) not pushed to {peer}: {e}",
                host=host,
                due=due or "none",
                peer=peer,
                e=e,
            )
            return False
        _pushes.labels("pushed").inc()
        _log.info(
            "mesh: next due of {host} ({due}) pushed to {peer}: {result}",
            host=host,
            due=due or "none",
            peer=peer,
            result=answer.get("result", "done"),
        )
        return True
