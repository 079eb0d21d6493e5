"""Anti-entropy of the spaces' settings: every box ends with the newest (docs/mesh.md, "What
travels").

Pushes (the CLI's fan-out, :mod:`lchat.mesh.due`) are best-effort: a peer that was down, frozen
or cut off misses them. So every ``LCHAT_MESH_SYNC`` (jittered by ±25 %, so that boxes started
together do not poll together), the router:

1. **Notices hand edits.** For every in-scope hibernating row it recomputes the settings hash
   from the row, ``<data>/<host>.env`` and ``<host>-bot.env`` (:func:`lchat.mesh.settings.route_hash`). A row with no
   hash yet (from before settings generations) gets one, at generation 0, and nothing is pushed;
   a hash that differs from the stored one is a change made on this box outside ``lchat``: the
   row gets a new generation (:func:`lchat.mesh.settings.bump`) and is pushed to the live peers
   that hold it, logged ``mesh: <host> settings changed on this box (gen N): pushing to K
   peer(s)``.
2. **Pulls what is newer.** It asks every live peer for its digest (``GET /api/mesh/digest``:
   one call per peer), and for each host this box also holds where the peer's generation is
   higher (or equal, with other settings, and the peer is the host's owner by the hash) it
   fetches that row (``GET /api/mesh/routes?host=``) and applies it through the mesh API's own
   upsert (:meth:`lchat.mesh.api.MeshAPI.apply`: the same checks and order as a push); likewise
   a row whose home region alone is newer there (the digest's ``regions``: the home region's own
   generation, :func:`lchat.mesh.settings.region_newer`, so a relocate this box missed reaches it
   even after a newer change of its own), logged
   ``mesh: <host> settings gen N from <peer> (was M)`` and counted in
   ``lchat_mesh_sync_applied_total{kind="settings"}``. A peer that cannot be asked is logged and
   counted in ``lchat_mesh_sync_failures_total{peer}``; the next round asks again.
3. **Creates what it missed.** A host the peer holds and this box does not (it was down or cut
   off at the create) is fetched and created through the same upsert, unless this box keeps a
   tombstone of it at the peer's generation or above (it was removed here after those
   settings), or the peer's generation is older than the tombstones' retention
   (:data:`lchat.registry.TOMBSTONE_RETENTION_MS`: a tombstone that would have beaten it may be
   gone); logged ``mesh: <host> created from <peer> (missed at its creation)``,
   ``kind="created"``.
4. **Removes what was removed.** A peer's tombstone (the digest's ``tombstones``, asked with
   ``?tombstones=1``; an older peer answers without them) with a generation above this box's row
   deletes the row through the path of a peer's ``DELETE`` (:meth:`lchat.mesh.api.MeshAPI.
   apply_delete`: the row, its env files; member data kept), which keeps the tombstone here too;
   logged ``mesh: <host> removed: <peer> deleted it (gen N)``, ``kind="deleted"``. A tombstone
   of a host this box holds no row of is kept here as well (a third box's older copy must not
   create it).
5. **Forgets old tombstones**: those whose generation is older than the retention, logged.

Invariants: a tombstone beats every copy of its host whose generation is not above it, so a
missed delete is never undone by a peer's older copy, and a host added again after a delete
(whose generation is above the tombstone: :meth:`lchat.registry.Registry.bump_settings`) comes
back everywhere; no row is created from a generation older than the retention, so a purged
tombstone cannot be undone either; a space this box runs itself (not replicated) is never
touched; env values are never logged; one round at a time, and ``stopService`` waits for the
round under way (each call bounded by ``timeout``).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from attrs import evolve
from prometheus_client import Counter
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from lchat import hosts
from lchat.config import ConfigError, MeshConfig
from lchat.mesh import client, settings
from lchat.mesh.members import Member
from lchat.mesh.placement import normalise_member_url
from lchat.mesh.route_payload import PayloadError, RoutePayload, in_scope, parse_payload
from lchat.reactors import TCPReactor
from lchat.registry import TOMBSTONE_RETENTION_MS, Registry, RegistryError, Route, Tombstone
from lchat.threads import RunInThread

SYNC_CALL_TIMEOUT = 10.0  # seconds per call to one peer
JITTER = 0.25  # each interval is LCHAT_MESH_SYNC times 1 ± this

_applied = Counter(
    "lchat_mesh_sync_applied_total",
    "Rows this box changed by anti-entropy (lchat.mesh.sync), by kind: settings (a peer's newer "
    "copy), created (a row it missed), deleted (a peer's tombstone)",
    ["kind"],
)
_purged = Counter(
    "lchat_mesh_tombstones_purged_total",
    "Tombstones of removed rows forgotten after their retention (lchat.registry)",
)
_failures = Counter(
    "lchat_mesh_sync_failures_total",
    "Anti-entropy calls to a peer that failed (its digest or a row), by peer",
    ["peer"],
)
_hand_edits = Counter(
    "lchat_mesh_sync_local_changes_total",
    "Settings changed on this box outside lchat (an env file edited by hand), given a new "
    "generation and pushed to the peers",
)
_repairs = Counter(
    "lchat_mesh_sync_repairs_total",
    "One host's row asked of the peers at once, outside the rounds (a wake here found the space "
    "moved to another region: lchat.hibernation.moved), by result: updated, unchanged, failed",
    ["result"],
)
_log = Logger(namespace="lchat.mesh.sync")

Apply = Callable[[RoutePayload, bool], Deferred[str]]
ApplyDelete = Callable[[str, int], Deferred[str]]


class SettingsSync(Service):
    """The anti-entropy rounds of the module docstring."""

    name = "settings-sync"

    def __init__(
        self,
        reactor: TCPReactor,
        clock: IReactorTime,
        mesh: MeshConfig,
        data_dir: str,
        registry: Registry,
        members: Callable[[], Sequence[Member]],
        owner: Callable[[Route], str],
        apply: Apply,
        *,
        run_in_thread: RunInThread,
        apply_delete: ApplyDelete | None = None,
        lock: AbstractContextManager[Any] | None = None,
        jitter: Callable[[], float] = random.random,
        now_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        timeout: float = SYNC_CALL_TIMEOUT,
    ) -> None:
        """``reactor``: the calls' (the router's); ``clock``: the rounds' timer; ``members``:
        the live membership view (this box included); ``owner``: a row's owner by the hash
        (MeshRouter.owner_url); ``apply``: the mesh API's upsert; ``apply_delete``: its
        peer's-tombstone path (MeshAPI.apply_delete; None: tombstones are not applied); ``jitter``: uniform in
        [0, 1); ``now_ms``: the wall clock for a new generation; ``lock``: the mesh API's write
        lock (MeshAPI.write_lock), held while a row and its env file are compared and bumped."""
        self._reactor = reactor
        self._clock = clock
        self._mesh = mesh
        self._data_dir = data_dir
        self._registry = registry
        self._members = members
        self._owner = owner
        self._apply = apply
        self._apply_delete = apply_delete
        self._run = run_in_thread
        self._jitter = jitter
        self._now_ms = now_ms
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self.timeout = timeout
        self._me = normalise_member_url(mesh.self_url)
        self._call: IDelayedCall | None = None
        self._round: Deferred[None] | None = None
        self._repairing: dict[str, Deferred[None]] = {}  # host -> its repair under way

    def startService(self) -> None:
        super().startService()
        self._schedule()

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        return self._round

    def _schedule(self) -> None:
        delay = self._mesh.sync * (1 - JITTER + 2 * JITTER * self._jitter())
        self._call = self._clock.callLater(delay, self._tick)

    def _tick(self) -> None:
        self._call = None
        d = Deferred.fromCoroutine(self.sync_once())
        self._round = d
        d.addErrback(lambda f: _log.failure("mesh: a settings sync round failed", f))

        def over(_: object) -> None:
            self._round = None
            if self.running:
                self._schedule()

        d.addBoth(over)

    async def sync_once(self) -> None:
        """One round: hand edits first (pushed), then every live peer's newer settings, missed
        rows and tombstones; old tombstones forgotten."""
        purged = await self._run(
            lambda: self._registry.purge_tombstones(self._now_ms() - TOMBSTONE_RETENTION_MS)
        )
        if purged:
            _purged.inc(len(purged))
            _log.info(
                "mesh: forgot {n} tombstone(s) older than {days} days: {hosts}",
                n=len(purged),
                days=TOMBSTONE_RETENTION_MS // 86_400_000,
                hosts=", ".join(purged),
            )
        changed: list[tuple[Route, dict[str, Any]]] = await self._run(self._local_changes)
        for route, payload in changed:
            await self._push(route, payload)
        for member in self._members():
            if member.self or member.url == self._me:
                continue
            await self._pull(member.url)

    def repair(self, host: str) -> Deferred[None]:
        """Ask every live peer for ``host``'s row now and take a newer one, as a round would
        (the mesh API's upsert): a wake here found the space relocated after this box's row
        (lchat.hibernation.moved), so its next request must go where the peers say. One repair
        per host at a time (a second call joins it); never fails (logged, counted)."""
        running = self._repairing.get(host)
        if running is not None:
            return running
        d = Deferred.fromCoroutine(self._repair(host))
        d.addErrback(lambda f: _log.failure("mesh: the repair of {host} failed", f, host=host))
        if d.called:
            return d  # over already (no peer to ask)

        def over(result: object) -> None:
            self._repairing.pop(host, None)  # (never return it: a Deferred chained to itself)

        self._repairing[host] = d
        d.addBoth(over)
        return d

    async def _repair(self, host: str) -> None:
        options: dict[str, Any] = {
            "ca_file": self._mesh.ca_file,
            "timeout": self.timeout,
            "reactor": self._reactor,
        }
        result = "unchanged"
        for member in self._members():
            if member.self or member.url == self._me:
                continue
            mine = await self._run(self._registry.get, host)
            if mine is None or not mine.replicated:
                break  # removed here meanwhile, or a space of this box's own
            peer = member.url
            try:
                body = await client.fetch_route(peer, self._mesh.token, host, **options)
                if body is None:
                    continue
                payload = parse_payload(body)
                if payload.host != host or not in_scope(self._mesh, host, payload.home_region):
                    raise PayloadError(
                        f"{host}: the row fetched is not this host's, or out of scope"
                    )
                if (payload.gen or 0) <= mine.settings_gen and (
                    payload.region_gen or 0
                ) <= mine.region_gen:
                    continue  # nothing newer there (its home region included)
                applied = await self._apply(payload, self._owner(mine) == peer)
            except Exception as e:  # a peer's failure or refusal: the next peer, then the rounds
                _failures.labels(peer).inc()
                result = "failed" if result == "unchanged" else result
                _log.warn(
                    "mesh: {host}: asking {peer} for its row failed: {e}", host=host, peer=peer, e=e
                )
                continue
            if applied == "stale":
                continue
            result = "updated"
            _applied.labels("settings").inc()
            _log.info(
                "mesh: {host} settings gen {gen} from {peer} (was {was}; asked at once: a wake "
                "here found it moved to region {region})",
                host=host,
                gen=payload.gen or 0,
                peer=peer,
                was=mine.settings_gen,
                region=payload.home_region or "(none)",
            )
        _repairs.labels(result).inc()
        if result != "updated":
            _log.warn(
                "mesh: {host}: no peer had a newer row ({result}); its settings sync tries again "
                "within LCHAT_MESH_SYNC (or run `lchat mesh-seed`)",
                host=host,
                result=result,
            )

    # -- 1. hand edits, in a thread ------------------------------------------------------------

    def _local_changes(self) -> list[tuple[Route, dict[str, Any]]]:
        bumped = []
        for route in self._registry.load():
            if not route.hibernating or route.elsewhere:
                continue
            if not in_scope(self._mesh, route.host, route.home_region):
                continue
            try:
                with self._lock:  # never between a peer's env file write and its row's
                    found = self._changed(route.host)
            except (ConfigError, RegistryError, hosts.InvalidHost) as e:
                _log.warn("mesh: cannot check the settings of {host}: {e}", host=route.host, e=e)
                continue
            if found is not None:
                bumped.append(found)
        return bumped

    def _changed(self, host: str) -> tuple[Route, dict[str, Any]] | None:
        """The row bumped when its settings changed outside lchat, with its payload; None
        when they did not. Called under the mesh API's write lock (a peer's write lands in the
        env file just before the row). The write is a compare-and-swap on the generation and hash
        read (:meth:`lchat.registry.Registry.bump_settings`'s ``expect``): a command's write in
        between (another process) wins, and the next round looks again."""
        route = self._registry.get(host)
        if route is None or not route.hibernating or route.elsewhere:
            return None
        env = client.read_route_env(self._data_dir, host)
        bot_env = client.read_bot_env(self._data_dir, host)
        digest = settings.route_hash(route, env, bot_env)
        if digest == route.settings_hash:
            return None
        expect = (route.settings_gen, route.settings_hash)
        if not route.settings_hash:  # a row from before generations: its first hash, gen 0
            self._registry.bump_settings(host, digest, 0, expect=expect, keep_gen=True)
            return None
        bumped = self._registry.bump_settings(host, digest, self._now_ms(), expect=expect)
        if bumped is None:
            return None
        _hand_edits.inc()
        route = evolve(route, settings_gen=bumped.settings_gen, settings_hash=digest)
        return route, client.route_payload(route, env, bot_env=bot_env)

    async def _push(self, route: Route, payload: dict[str, Any]) -> None:
        targets = client.fan_out_targets(self._mesh, route.host, route.home_region, self._members())
        _log.info(
            "mesh: {host} settings changed on this box (gen {gen}): pushing to {n} peer(s)",
            host=route.host,
            gen=route.settings_gen,
            n=len(targets),
        )
        for member in targets:
            try:
                answer = await client.push_route(
                    member.url,
                    self._mesh.token,
                    payload,
                    sender=self._mesh.self_url,
                    ca_file=self._mesh.ca_file,
                    timeout=self.timeout,
                    reactor=self._reactor,
                )
            except client.MeshCallError as e:
                _failures.labels(member.url).inc()
                _log.warn(
                    "mesh: {host} settings not pushed to {peer} ({e}): its next sync takes them",
                    host=route.host,
                    peer=member.url,
                    e=e,
                )
                continue
            _log.info(
                "mesh: {host} settings pushed to {peer}: {result}",
                host=route.host,
                peer=member.url,
                result=answer.get("result", "done"),
            )

    # -- 2. pulls ------------------------------------------------------------------------------

    async def _pull(self, peer: str) -> None:
        options: dict[str, Any] = {
            "ca_file": self._mesh.ca_file,
            "timeout": self.timeout,
            "reactor": self._reactor,
        }
        try:
            digest, buried, regions = await client.settings_digest_and_tombstones(
                peer, self._mesh.token, **options
            )
        except client.MeshCallError as e:
            _failures.labels(peer).inc()
            _log.warn("mesh: settings sync: cannot read {peer}'s digest: {e}", peer=peer, e=e)
            return
        table = await self._run(self._registry.load)
        mine_buried = await self._run(self._registry.tombstones)
        oldest = self._now_ms() - TOMBSTONE_RETENTION_MS
        for host, (gen, digest_hash) in sorted(digest.items()):
            mine = table.get(host)
            if mine is None:
                tomb = mine_buried.get(host)
                if (tomb is None or gen > tomb.gen) and gen >= oldest and host not in buried:
                    await self._take(peer, host, None, False, options)
                continue
            if not mine.replicated:
                continue  # a space of this box's own is its own
            from_owner = self._owner(mine) == peer
            if not (
                gen > mine.settings_gen
                or (gen == mine.settings_gen and digest_hash != mine.settings_hash and from_owner)
                or regions.get(host, 0) > mine.region_gen  # its home region alone is newer
            ):
                continue
            await self._take(peer, host, mine, from_owner, options)
        for host, gen in sorted(buried.items()):
            await self._bury(peer, host, gen, table.get(host), mine_buried.get(host))

    async def _take(
        self, peer: str, host: str, mine: Route | None, from_owner: bool, options: Any
    ) -> None:
        """Fetch ``host``'s row from ``peer`` and apply it: ``mine`` this box's (None: a create)."""
        try:
            body = await client.fetch_route(peer, self._mesh.token, host, **options)
            if body is None:
                return  # gone there since its digest
            payload = parse_payload(body)
            if payload.host != host or not in_scope(self._mesh, host, payload.home_region):
                raise PayloadError(f"{host}: the row fetched is not this host's, or out of scope")
            result = await self._apply(payload, from_owner)
        except (client.MeshCallError, PayloadError, hosts.InvalidHost) as e:
            _failures.labels(peer).inc()
            _log.warn(
                "mesh: settings sync: {host} from {peer} failed: {e}", host=host, peer=peer, e=e
            )
            return
        except Exception as e:  # refused by the upsert (a row this box cannot take): next round
            _failures.labels(peer).inc()
            _log.warn(
                "mesh: settings sync: {host} from {peer} refused: {e}", host=host, peer=peer, e=e
            )
            return
        if result == "stale":
            return  # changed (or removed) here meanwhile
        if mine is None or result == "created":
            _applied.labels("created").inc()
            _log.info(
                "mesh: {host} created from {peer} (missed at its creation; settings gen {gen})",
                host=host,
                peer=peer,
                gen=payload.gen or 0,
            )
            return
        _applied.labels("settings").inc()
        _log.info(
            "mesh: {host} settings gen {gen} from {peer} (was {was})",
            host=host,
            gen=payload.gen or 0,
            peer=peer,
            was=mine.settings_gen,
        )

    async def _bury(
        self, peer: str, host: str, gen: int, mine: Route | None, tomb: Tombstone | None
    ) -> None:
        """``peer``'s tombstone of ``host`` at ``gen``: this box's row goes when it is older."""
        if self._apply_delete is None or (tomb is not None and tomb.gen >= gen):
            return
        if mine is not None and (not mine.replicated or mine.settings_gen >= gen):
            return  # its own space, or added again since: the peer takes it from this digest
        try:
            hosts.normalise(host)
            result = await self._apply_delete(host, gen)
        except Exception as e:  # a conflict or a bad name: next round
            _failures.labels(peer).inc()
            _log.warn(
                "mesh: settings sync: {peer}'s tombstone of {host} refused: {e}",
                host=host[:253],
                peer=peer,
                e=e,
            )
            return
        if result != "deleted":
            return  # absent (the tombstone kept) or stale
        _applied.labels("deleted").inc()
        _log.info(
            "mesh: {host} removed: {peer} deleted it (gen {gen}; member data kept)",
            host=host,
            peer=peer,
            gen=gen,
        )
