"""``lchat instances``: every registered host, its state as the running router sees it, and the
box's capacity."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import attrs

from lchat.config import BoxConfig
from lchat.handover.hibernate import one_line
from lchat.registry import Route

Say = Callable[[str], None]
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
    return 0


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
