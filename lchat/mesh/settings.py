"""A replicated space's settings, versioned across the mesh (docs/mesh.md, "What travels").

A space's *settings* are what a peer needs to run it as its creator meant: the row's replicated
fields (replication class, home region, version, hibernating or living elsewhere), the
replicable values of ``<data>/<host>.env`` (:func:`lchat.mesh.client.replicable_env`) and those
of its bot sidecar's ``<data>/<host>-bot.env`` when it has one. Each row
carries a *generation* and the *hash* of those settings (``settings_gen``/``settings_hash``).

Invariants:

- A local change raises the generation to ``max(now in unix ms, gen + 1)``
  (:meth:`lchat.registry.Registry.bump_settings`): a Lamport-style counter, so a box whose clock
  is behind the last writer's still moves it forward, and a later change wins.
- A peer's write is applied only when :func:`newer` says so: a higher generation; or the same
  generation with the same hash (the same settings again: a due time riding on it); or the same
  generation with a different hash from the host's owner by the hash ("the owner's word last").
  A payload without a generation (an older peer) is applied only over a row that has none.
- The home region merges on a generation of its own (``region_gen``, the generation of its last
  change: :func:`region_newer`), the rest of the settings on the row's; the hash covers the row
  as merged, so two boxes holding the same fields hold the same hash.
- A space without a bot sidecar hashes as it did before bot envs travelled (the key is left
  out, not empty), so an upgrade bumps no row of such a space.
- The hash covers exactly what travels, never a per-box value (socket, database path, the
  ``live/<host>`` link, certificates), so two boxes holding the same settings hold the same hash.
- Env *values* never leave this module's callers in a log line or a fleet view: only key names,
  generations and hashes do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from attrs import evolve

from lchat.mesh.client import read_bot_env, read_route_env
from lchat.mesh.placement import normalise_member_url
from lchat.registry import Registry, Route, Transaction

SHORT = 8  # hex digits of a hash shown to an operator (lchat fleet, log lines)


def settings_hash(
    *,
    replication: str,
    home_region: str,
    version: str,
    lives_at: str,
    env: Mapping[str, str],
    bot_env: Mapping[str, str] | None = None,
) -> str:
    """The sha256 (hex) of the canonical JSON of a space's settings. ``env`` and ``bot_env``
    (its bot sidecar's; none or empty: it has none): the replicable values only (the caller
    filters them: :func:`lchat.mesh.client.replicable_env`)."""
    fields: dict[str, object] = {
        "env": dict(sorted(env.items())),
        "home_region": home_region,
        "lives_at": lives_at,
        "replication": replication,
        "version": version,
    }
    if bot_env:  # left out when empty: the hash of a space without a bot is unchanged
        fields["bot_env"] = dict(sorted(bot_env.items()))
    canonical = json.dumps(
        fields,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def route_hash(
    route: Route, env: Mapping[str, str], bot_env: Mapping[str, str] | None = None
) -> str:
    """:func:`settings_hash` of a row and its env files' replicable values (none for a
    lives-elsewhere row: it never runs here, and its payload carries none)."""
    return settings_hash(
        replication=route.replication,
        home_region=route.home_region,
        version=route.version,
        lives_at=route.lives_at,
        env={} if route.elsewhere else env,
        bot_env=None if route.elsewhere else bot_env,
    )


def newer(existing: Route, gen: int | None, digest: str, *, from_owner: bool) -> bool:
    """May a peer's settings (generation ``gen``, None when its payload had none; hash
    ``digest``) replace ``existing``'s? The order of the module docstring; ``from_owner``: the
    sender is the host's owner by the hash."""
    if gen is None:
        return existing.settings_gen == 0
    if gen != existing.settings_gen:
        return gen > existing.settings_gen
    return digest == existing.settings_hash or from_owner


def region_newer(existing: Route, region_gen: int | None, whole: bool) -> bool:
    """May a peer's home region (changed at ``region_gen``; None: an older peer's payload, which
    carries none) replace ``existing``'s? ``whole``: :func:`newer` took the rest of the payload.

    The home region is a field with its own generation (a last-writer-wins register beside the
    row's): the higher ``region_gen`` wins whatever the row's generations say, so a change of
    something else made on a box that missed a relocate (its region older) never rolls the
    region back, and a relocate reaches a box that has since made a newer change of its own.
    Equal region generations (the same region change, or none on either side), and an older
    peer's payload, follow the whole row. Both orders are total and every box applies the same
    rule to the same pair, so the boxes converge on the field-wise maximum."""
    if region_gen is None or region_gen == existing.region_gen:
        return whole
    return region_gen > existing.region_gen


def short(digest: str) -> str:
    """The first :data:`SHORT` hex digits of a hash ('-' for none)."""
    return digest[:SHORT] or "-"


def local_hash(
    route: Route,
    env: Mapping[str, str],
    self_url: str,
    bot_env: Mapping[str, str] | None = None,
) -> str:
    """The hash of ``route``'s settings as its peers will hold them: a space this box runs
    always-on travels in its lives-elsewhere shape (``lives_at`` this box, no env values)."""
    if route.always_on_here:
        return route_hash(evolve(route, lives_at=normalise_member_url(self_url)), {})
    return route_hash(route, env, bot_env)


def bump(
    registry: Registry | Transaction, data_dir: str, self_url: str, route: Route, now_ms: int
) -> Route:
    """A local change of ``route``'s settings: its row gets a new generation and the hash of
    ``route`` as given (the row as it is, or as it is about to be: ``hibernate --off`` pushes its
    lives-elsewhere shape before the row flips) and its env files' replicable values
    (:meth:`lchat.registry.Registry.bump_settings`), ``route``'s class, region and version
    written with them in one transaction (``registry`` a :class:`lchat.registry.Transaction`:
    in that one, with the edit it versions). Returns ``route`` with them. Blocking.
    Raises :class:`lchat.config.ConfigError` when the env file cannot be read, and
    :class:`lchat.registry.UnknownHost`."""
    runs_here = not (route.always_on_here or route.elsewhere)
    env = read_route_env(data_dir, route.host) if runs_here else {}
    bot_env = read_bot_env(data_dir, route.host) if runs_here else {}
    digest = local_hash(route, env, self_url, bot_env)
    bumped = registry.bump_settings(route.host, digest, now_ms, changed=route)
    assert bumped is not None  # (no compare-and-swap asked)
    return evolve(
        route,
        settings_gen=bumped.settings_gen,
        settings_hash=bumped.settings_hash,
        region_gen=bumped.region_gen,  # (raised with it when the change moved the region)
    )
