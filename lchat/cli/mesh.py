"""The mesh from the command line (docs/design.md §9): route fan-out, ``mesh-seed``, ``mesh``.

With ``LCHAT_MESH_SELF`` in the router's settings, ``add-instance --hibernate`` pushes the new route
to every live peer that covers the host (by mesh domain, or by ``home_region``), and ``remove``
sends them a tombstone. Both are best-effort: one bounded attempt (:data:`FANOUT_BUDGET` seconds in
all), every result on stderr, and never a failure of the command itself. A peer that missed a
push catches up with ``lchat mesh-seed``, which also prunes (``--prune``) what a missed tombstone
left behind.

The network calls run on a reactor of their own per command (:func:`lchat.cli.runner.run`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from attrs import frozen
from twisted.internet.defer import Deferred, DeferredSemaphore, gatherResults

from lchat import hosts
from lchat.buckets import open_mesh_bucket
from lchat.cli import runner
from lchat.config import BoxConfig, ConfigError, MeshConfig, mesh_bucket
from lchat.mesh import client, settings
from lchat.mesh.heartbeat import HeartbeatKeys
from lchat.mesh.members import Member, read_members
from lchat.mesh.placement import in_scope, normalise_member_url, owner, registered_by_owner
from lchat.objstore import ObjectStoreError
from lchat.reactors import Reactor, TCPReactor
from lchat.registry import Registry, RegistryError, Route, Transaction

FANOUT_BUDGET = 5.0  # seconds for the whole fan-out of one create or remove: membership + pushes
SEED_CALL_TIMEOUT = 15.0  # one push or delete of mesh-seed
SEED_LIST_TIMEOUT = 60.0  # the peer's listing (--prune): it may hold many thousands of routes
SEED_CONCURRENCY = 8
MEMBERS_TIMEOUT = 15.0  # `lchat mesh`: reading the membership

Say = Callable[[str], None]


@frozen
class Reach:
    """How many boxes of the mesh hold a route after a fan-out: this box and every peer that
    took it (``took``), of every member that must hold it (``of``, the dead ones too); the
    ones that did not, each with why."""

    took: int
    of: int
    missed: tuple[tuple[str, str], ...]  # (member url, why)

    def describe(self) -> str:
        line = f"registered on {self.took}/{self.of} boxes"
        if self.missed:
            line += " (" + "; ".join(f"{url}: {why}" for url, why in self.missed) + ")"
        return line


class MeshCliError(Exception):
    """A refusal or failure of a mesh command; one ``lchat: error:`` line."""


async def read_mesh_members(
    reactor: Reactor, cfg: BoxConfig, *, include_dead: bool = False
) -> list[Member]:
    """The mesh's members by their heartbeats in the mesh bucket (live ones unless
    ``include_dead``); only authenticated ones (the mesh token): a planted beat is no member."""
    mesh, hib = cfg.mesh, cfg.hibernate
    assert mesh is not None and hib is not None  # config.load refuses a mesh without a bucket
    store = await open_mesh_bucket(reactor, cfg)
    try:
        return await read_members(
            store,
            mesh_bucket(cfg),
            dead_after=mesh.dead_after,
            self_url=mesh.self_url,
            include_dead=include_dead,
            keys=HeartbeatKeys.of(mesh.token, mesh.accept_token),  # planted beats: no members
        )
    finally:
        await store.close()


# --- the registered-row ceiling, per owner ------------------------------------------------------


def owned_rows(
    cfg: BoxConfig, rows: Iterable[Route], host: str, home_region: str
) -> tuple[str, int]:
    """The live member that owns ``host`` (its URL) and how many instance ``rows`` count for it
    (lchat.mesh.placement.registered_by_owner). Reads the membership (one bounded bucket read);
    raises :class:`MeshCliError` when it cannot, or when no box is live."""
    mesh = cfg.mesh
    assert mesh is not None

    async def main(reactor: Reactor) -> list[Member]:
        return await read_mesh_members(reactor, cfg)

    try:
        members = runner.run(main, FANOUT_BUDGET)
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise MeshCliError(f"the mesh's members could not be read ({type(e).__name__}: {e})") from e
    taker = owner(host, members, home_region)
    if taker is None:
        raise MeshCliError("no box of the mesh is live")
    url = normalise_member_url(taker.url)
    counts = registered_by_owner(rows, members, mesh.self_url, mesh.domains)
    return url, counts.get(url, 0)


# --- fan-out on create and remove ---------------------------------------------------------------


def fan_out_upsert(cfg: BoxConfig, route: Route, say: Say) -> Reach | None:
    """Push ``route`` to the live peers; never raises. A hibernating instance (just registered,
    or flipped on by ``lchat hibernate --on``) goes as itself; an always-on instance of this box
    (flipped off by ``lchat hibernate --off``) goes in its "lives elsewhere" shape, so that the
    peers forward its requests here instead of waking a stale copy. Returns how many boxes hold
    it now (None: not a mesh route, or the membership could not be read)."""
    mesh = cfg.mesh
    if mesh is None or route.kind != "instance" or route.elsewhere:
        return None  # services do not replicate; a peer's lives-elsewhere row is not ours
    if route.hibernate:
        try:
            env = client.read_route_env(cfg.data_dir, route.host)
            bot_env = client.read_bot_env(cfg.data_dir, route.host)
        except ConfigError as e:
            say(f"mesh: not replicating {route.host}: its env file cannot be read ({e})")
            return None
        payload = client.route_payload(route, env, bot_env=bot_env)
    else:
        payload = client.elsewhere_payload(route, mesh.self_url)

    return _fan_out(cfg, route, "pushed", lambda m, r, s: _push(mesh, m.url, payload, s, r), say)


def publish_change(cfg: BoxConfig, registry: Registry, route: Route, say: Say) -> Reach | None:
    """A local change of ``route``'s settings (a create, ``lchat replication``, ``lchat env``,
    ``hibernate --on/--off``, ``relocate``, ``invite --rotate``): a new settings generation for
    its row (:func:`lchat.mesh.settings.bump`), then the fan-out of the row as it is now. Never
    raises; returns how many boxes hold it now (:func:`fan_out_upsert`); off a mesh, or for a row
    that does not replicate, nothing (None)."""
    bumped = bump_change(cfg, registry, route, say, int(time.time() * 1000))
    return None if bumped is None else fan_out_upsert(cfg, bumped, say)


def bump_change(
    cfg: BoxConfig, registry: Registry | Transaction, route: Route, say: Say, now_ms: int
) -> Route | None:
    """:func:`publish_change`'s first step alone: ``route`` with its new settings generation, or
    None (off a mesh, a row that does not replicate, or a failure, said). ``registry`` a
    :class:`lchat.registry.Transaction`: the generation is written in it, with the edit it
    versions (``lchat env``); the caller fans out once it committed. Never raises."""
    mesh = cfg.mesh
    if mesh is None or route.kind != "instance" or route.elsewhere or not replicates(mesh, route):
        return None
    try:
        return settings.bump(registry, cfg.data_dir, mesh.self_url, route, now_ms)
    except (ConfigError, RegistryError) as e:
        say(f"mesh: not replicating {route.host}: {e}")
        return None


def tombstoned(cfg: BoxConfig, route: Route) -> bool:
    """Does removing ``route`` here leave a tombstone (lchat.registry.Tombstone): an instance of
    a mesh host, whose copies the peers hold."""
    return cfg.mesh is not None and route.kind == "instance" and replicates(cfg.mesh, route)


def fan_out_delete(cfg: BoxConfig, route: Route, say: Say, gen: int | None = None) -> None:
    """Send ``route``'s tombstone (generation ``gen``, kept here) to the live peers (it was just
    removed here); never raises."""
    mesh = cfg.mesh
    if mesh is None or route.kind != "instance":
        return  # services do not replicate, so there is nothing of theirs to remove

    async def call(member: Member, reactor: TCPReactor, seconds: float) -> str:
        deleted = await _delete(mesh, member.url, route.host, seconds, reactor, gen)
        return "deleted" if deleted else "had no row"

    _fan_out(cfg, route, "tombstoned", call, say)


async def _push(
    mesh: MeshConfig, url: str, payload: dict[str, Any], seconds: float, reactor: TCPReactor
) -> str:
    """Push ``payload`` to the peer at ``url``; the peer's result ("created", "updated")."""
    answer = await client.push_route(
        url,
        mesh.token,
        payload,
        sender=mesh.self_url,
        ca_file=mesh.ca_file,
        timeout=seconds,
        reactor=reactor,
    )
    # "stale": the peer holds newer settings and kept them (its log says which generation).
    return str(answer.get("result", "done"))


async def _delete(
    mesh: MeshConfig,
    url: str,
    host: str,
    seconds: float,
    reactor: TCPReactor,
    gen: int | None = None,
) -> bool:
    """Tombstone ``host`` on the peer at ``url`` (at generation ``gen``); whether it had a row."""
    return await client.delete_route(
        url, mesh.token, host, gen, ca_file=mesh.ca_file, timeout=seconds, reactor=reactor
    )


def replicates(mesh: MeshConfig, route: Route) -> bool:
    """Is ``route`` a mesh host, whose rows the fan-out pushes: under the mesh domains, or
    placed by a home region?"""
    return bool(route.home_region) or in_scope(route.host, mesh.domains)


def _fan_out(
    cfg: BoxConfig,
    route: Route,
    what: str,
    call: Callable[[Member, TCPReactor, float], Awaitable[str]],
    say: Say,
) -> Reach | None:
    budget = FANOUT_BUDGET
    mesh = cfg.mesh
    assert mesh is not None
    host = route.host
    if not replicates(mesh, route):
        return None  # not a mesh host: it lives on this box alone
    started = time.monotonic()
    results: dict[str, str] = {}
    down: list[str] = []  # members that must hold it but are not live (their beats stopped)

    async def main(reactor: Reactor) -> list[Member]:
        everyone = await read_mesh_members(reactor, cfg, include_dead=True)
        members = await read_mesh_members(reactor, cfg)
        targets = client.fan_out_targets(mesh, host, route.home_region, members)
        live = {m.url for m in targets}
        down.extend(
            m.url
            for m in client.fan_out_targets(mesh, host, route.home_region, everyone)
            if m.url not in live
        )
        # Each call ends a little before the budget, so that every peer's outcome is reported.
        left = max(0.5, budget - (time.monotonic() - started) - 0.5)

        async def one(member: Member) -> None:
            try:
                results[member.url] = await call(member, reactor, left)
            except client.MeshCallError as e:
                results[member.url] = f"failed ({e})"

        await gatherResults([Deferred.fromCoroutine(one(m)) for m in targets])
        return targets

    try:
        targets = runner.run(main, budget)
    except TimeoutError:
        done = ", ".join(f"{url}: {r}" for url, r in sorted(results.items())) or "none"
        say(
            f"mesh: {host}: replication to peers did not finish within {budget:g}s (finished: "
            f"{done}); peers that missed it catch up with `lchat mesh-seed`"
        )
        return None
    except KeyboardInterrupt:
        raise
    except Exception as e:
        say(
            f"mesh: {host}: not replicated to peers ({type(e).__name__}: {e}); they catch up "
            f"with `lchat mesh-seed`"
        )
        return None
    missed = [(url, "down: converges when it is back") for url in sorted(down)]
    if not targets:
        say(f"mesh: {host}: no live peer to replicate to")
    for member in targets:
        result = results.get(member.url, "no answer")
        say(f"mesh: {host}: {what} to {member.url}: {result}")
        if result == "no answer" or result.startswith("failed"):
            missed.append((member.url, "missed it: converges (or `lchat mesh-seed` it)"))
    failed = [url for url, r in results.items() if r.startswith("failed")]
    if failed:
        say(f"mesh: {len(failed)} peer(s) missed {host}; they catch up with `lchat mesh-seed`")
    took = 1 + sum(1 for m in targets if m.url not in dict(missed))
    return Reach(took=took, of=1 + len(targets) + len(down), missed=tuple(missed))


# --- mesh-seed ----------------------------------------------------------------------------------


def _seed_scope(mesh: MeshConfig, region: str, host: str, home_region: str) -> bool:
    """Under the mesh domains, or homed in ``region`` (when given)."""
    return in_scope(host, mesh.domains) or (bool(region) and home_region == region)


def mesh_seed(
    cfg: BoxConfig,
    registry: Registry,
    peer_url: str,
    *,
    region: str,
    prune: bool,
    out: Say,
    note: Say,
) -> int:
    """Push every route in the seed's scope to ``peer_url``; with ``prune`` also tombstone the
    peer's rows in that scope which this registry does not have. 0 when every call succeeded."""
    mesh = cfg.mesh
    if mesh is None:
        raise MeshCliError(
            "mesh-seed needs the mesh settings (LCHAT_MESH_SELF, LCHAT_MESH_DOMAINS, "
            "LCHAT_MESH_TOKEN): pass --env-file /data/router.env"
        )
    try:
        peer = client.check_peer_url(peer_url)
    except ValueError as e:
        raise MeshCliError(f"peer URL: {e}") from e
    if normalise_member_url(peer) == normalise_member_url(mesh.self_url):
        raise MeshCliError(f"{peer} is this box (LCHAT_MESH_SELF): name a peer")
    table = registry.load()
    routes = [  # what it pushes
        r
        for r in table
        if r.kind == "instance" and r.hibernate and _seed_scope(mesh, region, r.host, r.home_region)
    ]
    # Spaces this box runs always-on: a peer's replicated row for one of them (a hibernating row
    # left by a missed `hibernate --off` fan-out) becomes the lives-elsewhere shape (--prune).
    always_on = {route.host: route for route in table if route.always_on_here}
    # The zero-source guard: --prune deletes every in-scope peer row this registry lacks, so a
    # registry that publishes nothing in scope (empty, misread, or the wrong --env-file) would
    # wipe the peer. It counts every row this source publishes in scope: its hibernating routes
    # and the lives-elsewhere shapes of its always-on spaces (a box whose last hibernating space
    # went always-on is not empty, and --prune is how its missed flips get repaired). A peer's
    # lives-elsewhere row held here is not this box's to publish, so it does not count.
    publishes = len(routes) + sum(
        _seed_scope(mesh, region, r.host, r.home_region) for r in always_on.values()
    )
    if prune and publishes == 0:
        raise MeshCliError(
            "refusing to prune: this registry publishes no in-scope route (no hibernating space, "
            "no always-on space of this box under the mesh domains), and a misread registry must "
            "never mass-delete a peer's rows; nothing was pushed or deleted"
        )
    payloads: list[dict[str, Any]] = []
    failures: list[str] = []
    for route in routes:
        try:
            env = client.read_route_env(cfg.data_dir, route.host)
            bot_env = client.read_bot_env(cfg.data_dir, route.host)
            payloads.append(client.route_payload(route, env, bot_env=bot_env))
        except ConfigError as e:
            failures.append(f"{route.host}: its env file cannot be read ({e})")
    have = {route.host for route in table}
    counts: dict[str, int] = {}
    pruned: list[str] = []
    flipped: list[str] = []

    async def main(reactor: Reactor) -> None:
        gate = DeferredSemaphore(SEED_CONCURRENCY)

        async def push(payload: dict[str, Any]) -> None:
            try:
                result = await _push(mesh, peer, payload, SEED_CALL_TIMEOUT, reactor)
            except client.MeshCallError as e:
                failures.append(f"{payload['host']}: {e}")
                return
            counts[result] = counts.get(result, 0) + 1

        await gatherResults([gate.run(push, p) for p in payloads])
        if not prune:
            return
        try:
            listing = await client.list_routes(
                peer, mesh.token, ca_file=mesh.ca_file, timeout=SEED_LIST_TIMEOUT, reactor=reactor
            )
        except client.MeshCallError as e:
            failures.append(f"--prune: cannot list the peer's routes ({e}); nothing was pruned")
            return
        in_scope = [
            r
            for r in listing
            if _seed_scope(mesh, region, str(r["host"]), str(r.get("home_region") or ""))
        ]
        stale = sorted({str(r["host"]) for r in in_scope if r["host"] not in have})

        async def tombstone(host: str) -> None:
            try:
                if await _delete(mesh, peer, host, SEED_CALL_TIMEOUT, reactor):
                    pruned.append(host)
            except (client.MeshCallError, hosts.InvalidHost) as e:
                failures.append(f"--prune {host}: {e}")

        await gatherResults([gate.run(tombstone, h) for h in stale])
        me = normalise_member_url(mesh.self_url)
        to_flip = sorted(
            {
                str(r["host"])
                for r in in_scope
                if r["host"] in always_on
                and not (r.get("hibernate") is False and r.get("lives_at") == me)
            }
        )

        async def elsewhere(host: str) -> None:
            try:
                payload = client.elsewhere_payload(always_on[host], mesh.self_url)
                await _push(mesh, peer, payload, SEED_CALL_TIMEOUT, reactor)
            except client.MeshCallError as e:
                failures.append(f"--prune {host} (lives here): {e}")
                return
            flipped.append(host)

        await gatherResults([gate.run(elsewhere, h) for h in to_flip])

    budget = 3600.0 + len(payloads) * SEED_CALL_TIMEOUT  # each call is bounded; this is a backstop
    try:
        runner.run(main, budget)
    except TimeoutError as e:
        failures.append(f"gave up: {e}")
    scope = ", ".join(mesh.domains) + (f" + home region {region}" if region else "")
    summary = ", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "nothing pushed"
    out(f"seeded {peer} with {len(routes)} route(s) in scope ({scope}): {summary}")
    if prune:
        out(
            f"pruned {len(pruned)} row(s) this registry no longer has"
            + (f": {', '.join(pruned[:20])}{' ...' if len(pruned) > 20 else ''}" if pruned else "")
        )
        if flipped:
            out(
                f"flipped {len(flipped)} row(s) to live here (always-on on this box): "
                f"{', '.join(sorted(flipped)[:20])}{' ...' if len(flipped) > 20 else ''}"
            )
    for failure in failures[:20]:
        note(f"mesh-seed: {failure}")
    if len(failures) > 20:
        note(f"mesh-seed: ... and {len(failures) - 20} more failures")
    if failures:
        raise MeshCliError(f"{len(failures)} call(s) failed; re-run mesh-seed to retry them")
    return 0


# --- lchat mesh ---------------------------------------------------------------------------------


def show_mesh(cfg: BoxConfig, registry: Registry, out: Say) -> int:
    """Members (URL, region, beat age, version, liveness) and how many in-scope spaces each owns."""
    mesh = cfg.mesh
    if mesh is None:
        raise MeshCliError("the mesh is off here: LCHAT_MESH_SELF is not set")

    try:
        members = runner.run(
            lambda reactor: read_mesh_members(reactor, cfg, include_dead=True), MEMBERS_TIMEOUT
        )
    except (TimeoutError, ObjectStoreError) as e:
        raise MeshCliError(f"could not read the membership from the bucket: {e}") from e
    live = [m for m in members if m.age <= mesh.dead_after]
    owned: dict[str, int] = {m.url: 0 for m in live}
    unowned = 0
    for route in registry.load():
        if route.kind != "instance" or not route.hibernate:
            continue
        if not in_scope(route.host, mesh.domains):
            continue
        best = owner(route.host, live, route.home_region)
        if best is None:
            unowned += 1
        else:
            owned[best.url] += 1
    rows = [("MEMBER", "REGION", "AGE", "STATE", "VERSION", "SPACES")]
    for m in members:
        state = "live" if m.age <= mesh.dead_after else "dead"
        name = m.url + (" (this box)" if m.self else "")
        spaces = str(owned[m.url]) if m.url in owned else "-"
        rows.append((name, m.region or "-", f"{m.age:.0f}s", state, m.version or "-", spaces))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    me = normalise_member_url(mesh.self_url)
    if not any(m.url == me for m in live):
        out(f"this box ({me}) has no live heartbeat: is its router running?")
    if unowned:
        out(f"{unowned} in-scope space(s) have no owner: no live member")
    return 0
