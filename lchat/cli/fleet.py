"""``lchat fleet [--json] [--publish URL]``: every live mesh member's spaces in one table.

On any mesh box: read the live members (the heartbeats, as ``lchat mesh`` does), ask each one's
mesh API for ``GET /api/mesh/spaces`` (bearer ``LCHAT_MESH_TOKEN``, TLS verified as for every
mesh call, each call bounded by ``--timeout``, all at once), and print the union: each space once,
reported by the box that owns it (:mod:`lchat.mesh.fleet`). A member that does not answer is a
line saying so and why, never dropped; this box's registry says roughly how many spaces it owns.

Each space's settings generation as its reporter holds it (``GEN``: generation/short hash) and the
boxes whose settings differ from the newest (``DIVERGED``; JSON ``divergence``); ``--settings``
prints every box's copy of every space's settings (generation, hash, replication class, home
region, env key *names*: never a value).

Exit status: 0 every live member answered; 3 the view is partial (a member unreachable, or its
answer refused: bad token, not lchat, garbage), printed all the same; 4 every member answered
and a space's settings have differed between boxes for longer than twice ``LCHAT_MESH_SYNC``
(its anti-entropy should have caught them up: look at the diverged box's log for ``mesh:
settings sync``); 1 nothing could be shown
(no mesh settings, membership unreadable or without a live member, or the publish failed); 2 a
usage error.

``--publish s3://BUCKET[/PREFIX][?region=R&endpoint=URL]`` (or ``file:PATH``) writes the counts
only (:func:`lchat.mesh.fleet.publishable`) to ``<PREFIX>/status/fleet.json``, and only on the
elected box: the live member with the lowest URL (the heartbeat janitor's rule). Any other box
says it is not elected and exits 0 without asking anyone, so every box can run the same timer
(``ops/systemd/lchat-fleet-publish.timer``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred, gatherResults

from lchat.buckets import open_bucket
from lchat.cli import mesh as mesh_cli
from lchat.cli import runner
from lchat.config import BoxConfig, ConfigError, parse_bucket_url
from lchat.mesh import client, fleet
from lchat.mesh.members import Member
from lchat.mesh.placement import normalise_member_url
from lchat.objstore import ObjectStoreError
from lchat.objstore.where import Where
from lchat.reactors import Reactor, TCPReactor
from lchat.registry import Registry, Route

SUMMARY = "every mesh box's spaces in one table: state, version, awake-since, next-due, lag"
DEFAULT_TIMEOUT = 5.0  # seconds for each member's answer
MEMBERS_TIMEOUT = 15.0  # reading the membership from the bucket
PUBLISH_TIMEOUT = 30.0  # writing status/fleet.json
PUBLISH_KEY = "status/fleet.json"
EXIT_PARTIAL = 3
EXIT_DIVERGED = 4
COLUMNS = (
    "BOX",
    "HOST",
    "STATE",
    "VERSION",
    "FLOOR",
    "AWAKE-SINCE",
    "NEXT-DUE",
    "LAG",
    "GEN",
    "DIVERGED",
)
SETTINGS_COLUMNS = ("HOST", "BOX", "GEN", "HASH", "REPLICATION", "REGION", "ENV-KEYS")

Say = Callable[[str], None]


class FleetCliError(Exception):
    """A refusal or failure: one ``lchat: error:`` line, exit status 1."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the table and totals as JSON")
    parser.add_argument(
        "--publish",
        metavar="BUCKET-URL",
        help="on the elected box only (the live member with the lowest URL), write the counts "
        "(no hostnames) to status/fleet.json under s3://BUCKET[/PREFIX][?region=R&endpoint=URL] "
        "or file:PATH",
    )
    parser.add_argument(
        "--settings",
        action="store_true",
        help="print every box's copy of every space's settings (generation, hash, replication, "
        "region, env key names; never values)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"how long each member may take to answer (default {DEFAULT_TIMEOUT:g})",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 300:
        raise argparse.ArgumentTypeError("the timeout must be more than 0, at most 300 seconds")
    return value


def run(
    args: argparse.Namespace,
    cfg: BoxConfig,
    open_registry: Callable[[BoxConfig], Registry],
    out: Say,
    note: Say,
) -> int:
    mesh = cfg.mesh
    if mesh is None or cfg.hibernate is None:
        raise FleetCliError(
            "lchat fleet needs the mesh settings (LCHAT_MESH_SELF, LCHAT_MESH_DOMAINS, "
            "LCHAT_MESH_TOKEN): pass --env-file /data/router.env"
        )
    target = None
    if args.publish:
        try:
            target = parse_bucket_url("--publish", args.publish)
        except ConfigError as e:
            raise FleetCliError(str(e)) from None
    shown = str(Where(target.bucket, target.key(PUBLISH_KEY))) if target is not None else ""
    me = normalise_member_url(mesh.self_url)
    timeout: float = args.timeout

    async def main(reactor: Reactor) -> tuple[list[Member], fleet.Fleet | None]:
        try:
            members = await _members(reactor, cfg)
        except ObjectStoreError as e:
            raise FleetCliError(f"could not read the membership from the bucket: {e}") from e
        if target is not None and not fleet.elected(members, me):
            return members, None
        reports = await gatherResults(
            [Deferred.fromCoroutine(_ask(reactor, cfg, m, timeout)) for m in members]
        )
        result = _fleet(cfg, open_registry, members, reports)
        if target is not None:
            try:
                await _publish(reactor, cfg, target, result)
            except ObjectStoreError as e:
                raise FleetCliError(f"could not write {shown}: {e}") from e
        return members, result

    # Each step is bounded; this is a backstop well past their sum.
    budget = MEMBERS_TIMEOUT + timeout + PUBLISH_TIMEOUT + 10.0
    try:
        members, result = runner.run(main, budget)
    except TimeoutError as e:
        raise FleetCliError(f"gave up: {e}") from e
    if result is None:
        lowest = members[0].url if members else "none"
        out(
            f"not elected: the publisher is the live member with the lowest URL ({lowest}), and "
            f"this box is {me}; nothing written"
        )
        return 0
    if not members:
        raise FleetCliError(
            f"no live member in the mesh's heartbeats, not even this box ({me}): is its router "
            "running, and is LCHAT_MESH_TOKEN this mesh's (a heartbeat counts only when its MAC "
            "verifies with it)? (`lchat mesh` lists the members, dead ones too)"
        )
    if target is not None:
        counts = fleet.publishable(result)
        out(
            f"published {shown}: {counts['boxes']['live']} live box(es), "
            f"{counts['boxes']['answered']} answered, {counts['spaces']['total']} space(s)"
        )
    elif args.json:
        out(json.dumps(fleet.as_json(result), indent=2))
    elif getattr(args, "settings", False):
        _settings_table(result, out)
    else:
        _table(result, me, out)
    for warning in result.warnings:
        note(f"warning: {warning}")
    if not result.complete:
        return EXIT_PARTIAL
    stuck = _stuck(result, mesh.sync)
    if stuck:
        note(
            f"error: {len(stuck)} space(s) diverged for longer than twice LCHAT_MESH_SYNC "
            f"({2 * mesh.sync:g}s): {', '.join(stuck[:10])}; the diverged boxes' logs say why "
            "(`mesh: settings sync`)"
        )
        return EXIT_DIVERGED
    return 0


def _stuck(result: fleet.Fleet, sync: float) -> list[str]:
    """The diverged hosts whose newest settings are older than twice the sync interval."""
    return [
        host
        for host in sorted(result.divergence)
        if result.generated_at - (result.diverged_since(host) or result.generated_at) > 2 * sync
    ]


async def _members(reactor: Reactor, cfg: BoxConfig) -> list[Member]:
    read: Deferred[list[Member]] = Deferred.fromCoroutine(mesh_cli.read_mesh_members(reactor, cfg))
    read.addTimeout(MEMBERS_TIMEOUT, reactor)
    try:
        return await read
    except defer.TimeoutError as e:  # (addTimeout's: not the builtin TimeoutError)
        raise ObjectStoreError(f"no answer within {MEMBERS_TIMEOUT:g}s") from e


async def _ask(
    reactor: TCPReactor,
    cfg: BoxConfig,
    member: Member,
    timeout: float,  # noqa: ASYNC109 -- bounded by the mesh client's addTimeout
) -> fleet.BoxReport:
    """One member's answer, or why there is none; never raises."""
    mesh = cfg.mesh
    assert mesh is not None

    def report(outcome: fleet.Outcome, error: str = "", answer: Any = None) -> fleet.BoxReport:
        return fleet.BoxReport(
            url=member.url,
            region=member.region,
            outcome=outcome,
            error=error,
            answer=answer,
            is_self=member.self,
        )

    try:
        body = await client.get_json(
            member.url,
            mesh.token,
            fleet.SPACES_PATH,
            ca_file=mesh.ca_file,
            timeout=timeout,
            reactor=reactor,
        )
    except client.MeshCallError as e:
        why = str(e).removeprefix(f"{member.url}: ")
        if e.status is None:
            return report("unreachable", why)
        if e.status == 401:
            why += " (its LCHAT_MESH_TOKEN differs from this box's: a rotation half done?)"
        elif e.status == 404:
            why += " (an lchat without fleet status? upgrade it)"
        return report("error", why)
    try:
        return report("ok", answer=fleet.parse_answer(body))
    except fleet.BadAnswer as e:
        return report("error", f"answered nonsense: {e}")


def _fleet(
    cfg: BoxConfig,
    open_registry: Callable[[BoxConfig], Registry],
    members: list[Member],
    reports: list[fleet.BoxReport],
) -> fleet.Fleet:
    """The aggregation, with estimates for the members that did not answer from this box's own
    registry (when it can be read)."""
    mesh = cfg.mesh
    assert mesh is not None
    missing = [r.url for r in reports if r.outcome != "ok"]
    unreported: dict[str, int] = {}
    if missing:
        routes: Iterable[Route] = ()
        with contextlib.suppress(Exception):  # an estimate only: without a registry, none shown
            routes = open_registry(cfg).load()
        unreported = fleet.registry_counts(
            routes, normalise_member_url(mesh.self_url), members, mesh.domains, missing
        )
    return fleet.aggregate(reports, time.time(), unreported)


async def _publish(reactor: Reactor, cfg: BoxConfig, where: Where, result: fleet.Fleet) -> None:
    body = json.dumps(fleet.publishable(result), indent=2, sort_keys=True).encode() + b"\n"
    key = where.key(PUBLISH_KEY)
    store = await open_bucket(reactor, cfg, where, what="--publish", make_dir=True)
    try:
        put: Deferred[Any] = Deferred.fromCoroutine(
            store.put(key, body, content_type="application/json")
        )
        put.addTimeout(PUBLISH_TIMEOUT, reactor)
        try:
            await put
        except defer.TimeoutError as e:
            raise ObjectStoreError(f"no answer within {PUBLISH_TIMEOUT:g}s", key) from e
    finally:
        await store.close()


# --- the table ----------------------------------------------------------------------------------


def _gen(held: fleet.HeldSettings | None) -> str:
    if held is None:
        return "-"
    return f"{held.gen}/{held.hash or '-'}"


def _settings_table(result: fleet.Fleet, out: Say) -> None:
    """``--settings``: one line per space and box holding it, diverged boxes marked."""
    rows = [SETTINGS_COLUMNS]
    for host, by_box in result.settings.items():
        behind = result.divergence.get(host, ())
        for url, held in by_box.items():
            rows.append(
                (
                    host,
                    url + (" (diverged)" if url in behind else ""),
                    str(held.gen),
                    held.hash or "-",
                    held.replication or "-",
                    held.home_region or "-",
                    ",".join(held.env_keys) or "-",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(SETTINGS_COLUMNS))]
    for r in rows:
        out("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _table(result: fleet.Fleet, me: str, out: Say) -> None:
    rows = [COLUMNS]
    for row in result.rows:
        space = row.space
        state = space.state
        if space.process is not None and space.process != "ready":
            state += f" ({space.process})"
        if row.running_on:
            state += f" on {row.running_on}"
        rows.append(
            (
                row.box,
                space.host,
                state,
                space.version or "-",
                space.floor or "-",
                fleet.utc(space.awake_since) or "-",
                fleet.utc(space.next_due) or "-",
                "-" if space.lag is None else f"{space.lag:.1f}s",
                _gen(result.settings.get(space.host, {}).get(row.box)),
                ",".join(result.divergence.get(space.host, ())) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    for r in rows:
        out("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    out("")
    for box in result.boxes:
        name = box.url + (" (this box)" if box.is_self else "")
        if box.outcome == "ok":
            states = ", ".join(f"{n} {state}" for state, n in box.by_state.items())
            out(
                f"{name}: {box.spaces} space(s)"
                + (f": {states}" if states else "")
                + f"; default build {box.default_version or '-'}"
            )
            continue
        what = "unreachable" if box.outcome == "unreachable" else "error"
        line = f"{name}: {what}: {box.error}"
        if box.unreported:
            line += f"; about {box.unreported} space(s) it owns are not shown (this box's registry)"
        out(line)
    answered = sum(1 for b in result.boxes if b.outcome == "ok")
    out(
        f"total: {len(result.rows)} space(s) on {len(result.boxes)} live box(es), "
        f"{answered} answered" + ("" if result.complete else " (partial: exit status 3)")
    )
