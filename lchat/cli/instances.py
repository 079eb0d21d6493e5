"""``lchat instances``: every registered host, its state as the running router sees it, and the
box's capacity; and the capacity checks ``add-instance`` and ``hibernate --off`` make before
writing anything (docs/operations.md, "Capacity")."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import attrs

from lchat.cli import mesh as mesh_cli
from lchat.config import BoxConfig
from lchat.handover.hibernate import one_line
from lchat.registry import Registry, Route

Say = Callable[[str], None]


class CapacityRefused(Exception):
    """A create or flip beyond ``LCHAT_MAX_REGISTERED`` or ``LCHAT_MAX_INSTANCES``; nothing was
    written."""


TABLE_COLUMNS = tuple(
    "HOST KIND STATUS STATE VERSION HIBERNATE REPLICATION NEXT-DUE SOCKET".split()
)


def show(
    cfg: BoxConfig,
    routes: list[Route],
    status: dict[str, Any] | None,
    as_json: bool,
    out: Say,
    note: Say,
) -> int:
    """The table (or ``--json``) of ``routes``, sorted by host, with what the running router's
    ``status`` says (None: it cannot be asked), then the capacity summary on stderr."""
    hosts_now = status.get("hosts") if status is not None else None  # the router's view of each
    live = (hosts_now if isinstance(hosts_now, dict) else None) if routes else {}
    from lchat.cli.release import live_versions  # the live/<host> links (lchat deploy)

    builds = live_versions(cfg, [r.host for r in routes])
    if as_json:
        # Every column of the table: the registry row, and STATE (null where the table says
        # "?" or "-": no router to ask, or it has not loaded the row yet); live_version and
        # canary: the build live/<host> points at here, and whether `deploy --canary` put it.
        objects = [
            attrs.asdict(r)
            | {"state": None if (state := _state(r, live)) in ("?", "-") else state}
            | dict(zip(("live_version", "canary"), builds.get(r.host, (None, False)), strict=True))
            for r in routes
        ]
        out(json.dumps(objects, indent=2))
        return 0
    rows = [TABLE_COLUMNS, *(_table_row(r, live, builds.get(r.host)) for r in routes)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    for row, route in zip(rows, [None, *routes], strict=True):
        out("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if route is not None and route.status == "failed":
            out(f"  last error: {one_line(route.last_error) or '(none recorded)'}")
    # On stderr: stdout stays the table that scripts parse.
    if any(canary for _, canary in builds.values()):
        note("VERSION*: a canary (lchat deploy --canary); `lchat deploy <v> --all` clears it")
    note(_capacity_summary(cfg, routes, status))
    workers = _workers_summary(status)
    if workers is not None:
        note(workers)
    return 0


def _workers_summary(status: dict[str, Any] | None) -> str | None:
    """``workers: 2 of 2 serving (LCHAT_WORKERS=2), on the current routes and certificates``, or
    what is wrong: ``workers: 1 of 2 serving (LCHAT_WORKERS=2) — worker 2 backoff (killed by
    SIGKILL; 3 restarts); worker 1 behind on routes``. None when the router runs one process
    (its status has no ``workers``) or cannot be asked."""
    workers = status.get("workers") if status else None
    if not isinstance(workers, dict):
        return None
    wanted, serving = workers.get("wanted"), workers.get("serving")
    line = f"workers: {serving} of {wanted} serving (LCHAT_WORKERS={wanted})"
    problems = []
    for worker in workers.get("list") or []:
        if not isinstance(worker, dict):
            continue
        slot, state = worker.get("slot"), worker.get("state")
        if state != "ready":
            why = [str(worker["last_error"])] if worker.get("last_error") else []
            if worker.get("restarts"):
                restarts = worker["restarts"]
                why.append(f"{restarts} restart{'' if restarts == 1 else 's'}")
            problems.append(f"worker {slot} {state}" + (f" ({'; '.join(why)})" if why else ""))
            continue
        behind = [
            what for what in ("routes", "certificates") if worker.get(f"{what}_current") is False
        ]
        if behind:
            problems.append(f"worker {slot} behind on {' and '.join(behind)}")
    if problems:
        return f"{line} \N{EM DASH} {'; '.join(problems)}"
    return f"{line}, on the current routes and certificates"


def _capacity_summary(cfg: BoxConfig, routes: list[Route], status: dict[str, Any] | None) -> str:
    """``capacity: 1 of 40 always-on, 2 hibernating awake (~690 by memory), 12 of 400
    registered``: the router's always-on processes against LCHAT_MAX_INSTANCES (its own limit
    when it says), the hibernating spaces it holds (against LCHAT_MAX_AWAKE when set; with the
    memory estimate of how many fit when it gives one), the registry's instance rows against
    LCHAT_MAX_REGISTERED (0: "12 registered (no limit)"; on a mesh the ceiling is per owner)."""

    def of(count: object, limit: int, what: str) -> str:
        return f"{count} of {limit} {what}" if limit > 0 else f"{count} {what} (no limit)"

    registered = sum(1 for r in routes if r.kind == "instance")
    now = status.get("capacity") if status else None
    if isinstance(now, dict) and isinstance(now.get("always_on"), int):
        limit = now.get("max_instances")
        resident = of(
            now["always_on"], limit if isinstance(limit, int) else cfg.max_instances, "always-on"
        )
        awake = now.get("max_awake")
        hibernating = (
            f"{now.get('hibernating')} of {awake} hibernating awake"
            if isinstance(awake, int) and awake > 0
            else f"{now.get('hibernating')} hibernating awake"
        )
        if isinstance(now.get("awake_estimate"), int):
            hibernating += f" (~{now['awake_estimate']} by memory)"
        resident += f", {hibernating}"
    elif not routes:
        resident = of(0, cfg.max_instances, "always-on")
    else:
        why = "the router did not say" if status else "the router cannot be asked"
        resident = of("?", cfg.max_instances, "always-on") + f" ({why})"
    return f"capacity: {resident}, {of(registered, cfg.max_registered, 'registered')}"


def _table_row(
    route: Route,
    live: dict[str, dict[str, Any]] | None,
    build: tuple[str | None, bool] | None = None,
) -> tuple[str, ...]:
    version, canary = build or (None, False)
    return (
        route.host,
        route.kind,
        route.status,
        _state(route, live),
        f"{version}{'*' if canary else ''}" if version else route.version or "-",
        "on" if route.hibernate else "off",
        route.replication,
        _utc(route.next_due),
        route.socket,
    )


def _state(route: Route, live: dict[str, dict[str, Any]] | None) -> str:
    """What the running router says: a hibernating space's activator state (awake, waking,
    stopping, asleep); else the process it supervises (builtin units), else the row's status as
    it serves it. ``?``: the router cannot be asked; ``-``: it has not loaded this row yet."""
    if route.elsewhere:
        return f"elsewhere {route.lives_at}"  # a peer's always-on space: never runs here
    if live is None:
        return "?"
    entry = live.get(route.host)
    if not isinstance(entry, dict):
        return "-"
    if route.hibernate and entry.get("hibernate"):
        return str(entry.get("state") or "asleep")
    process = entry.get("process")
    if isinstance(process, dict) and process.get("state"):
        return str(process["state"])
    return str(entry.get("status") or "-")


def _utc(seconds: int) -> str:
    if seconds <= 0:
        return "-"
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):
        return str(seconds)


def refuse_beyond_registered(
    cfg: BoxConfig, registry: Registry, note: Say, host: str, home_region: str
) -> None:
    """LCHAT_MAX_REGISTERED (0 = no limit): the most instance rows this box takes, hibernating
    or not. On a mesh, for a mesh host, it is per owner: the rows the new host's owner (HRW
    among the live boxes) holds, always-on rows counting for the box they run on, so a mesh
    takes the ceiling times its boxes; when the membership cannot be read, this box's whole
    registry counts (as off a mesh). Checked before anything is written; two add-instance runs
    at once may both pass (a ceiling, not a lock)."""
    limit = cfg.max_registered
    if limit <= 0:
        return
    rows = registry.load()
    probe = Route(host=host or "x.invalid", kind="instance", socket="", home_region=home_region)
    if cfg.mesh is not None and host and mesh_cli.replicates(cfg.mesh, probe):
        try:
            owner_url, owned = mesh_cli.owned_rows(cfg, rows, host, home_region)
        except mesh_cli.MeshCliError as e:
            note(f"LCHAT_MAX_REGISTERED counts this box's whole registry: {e}")
        else:
            if owned >= limit:
                raise CapacityRefused(
                    f"{owned} instances are registered to {owner_url}, which owns {host} on the "
                    f"mesh: the most one box takes (LCHAT_MAX_REGISTERED={limit}); nothing was "
                    f"registered. Remove one of its spaces, add a box, or raise "
                    f"LCHAT_MAX_REGISTERED on every box"
                )
            return
    registered = sum(1 for r in rows if r.kind == "instance")
    if registered >= limit:
        raise CapacityRefused(
            f"{registered} instances are registered, the most this box takes "
            f"(LCHAT_MAX_REGISTERED={limit}); nothing was registered. Remove one (lchat remove "
            f"HOST) or raise LCHAT_MAX_REGISTERED in {cfg.env_file}"
        )


def refuse_beyond_always_on(cfg: BoxConfig, registry: Registry, host: str) -> None:
    """LCHAT_MAX_INSTANCES (0 = no limit): the most always-on spaces this box runs (each is a
    process that never sleeps; hibernating spaces are admitted by memory instead). Checked
    before anything is written by ``add-instance`` without ``--hibernate`` and by ``hibernate
    --off``."""
    limit = cfg.max_instances
    if limit <= 0:
        return
    always_on = sum(1 for r in registry.load() if r.always_on_here and r.host != host)
    if always_on >= limit:
        raise CapacityRefused(
            f"{always_on} always-on instances run on this box, the most it takes "
            f"(LCHAT_MAX_INSTANCES={limit}); nothing was changed. Hibernate it (--hibernate, "
            f"or lchat hibernate HOST --on for another), or raise LCHAT_MAX_INSTANCES in "
            f"{cfg.env_file}"
        )
