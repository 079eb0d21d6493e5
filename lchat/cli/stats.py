"""``lchat stats <host> [--json]``: a space's setup_complete, members and has_content, never
waking it (docs/hibernation.md, "Wake-free stats").

The running router is asked (``GET /stats/<host>`` on its admin socket): it knows whether the
space is awake and reads in its own process, where SQLite shares the locks of the connections
its replicators hold. When no router answers, the command reads the registry and the database
itself, with the same read-only code (:mod:`lchat.spacestats`), and says so — except for a mesh
space on a mesh box (``LCHAT_MESH_SELF``): another box may have woken and written it since, and
only a running router asks that box or the bucket, so the command refuses (``no_router_mesh``)
rather than answer from this box's files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.parse
from collections.abc import Callable
from typing import Any

from lchat import admin_client, hosts, spacestats
from lchat.config import BoxConfig
from lchat.handover.router import absent
from lchat.mesh.placement import in_scope
from lchat.registry import Registry

SUMMARY = "a space's setup, member count and content, read without waking it"
TIMEOUT = 10.0  # the router's read is bounded by spacestats.QUERY_BUDGET and its busy timeout

Out = Callable[[str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("host", help="the space's hostname")
    parser.add_argument(
        "--json", action="store_true", help="print the JSON object the router gives"
    )


def run(
    args: argparse.Namespace,
    cfg: BoxConfig,
    out: Out,
    open_registry: Callable[[BoxConfig], Registry],
) -> int:
    """Print the stats of ``args.host``; 0, or 1 with why (``--json``: the error object too)."""
    host = hosts.normalise(args.host)
    try:
        code, body = _ask_router(cfg, host)
    except admin_client.Unreachable as e:
        _stderr(f"lchat: no router answers on {cfg.admin_socket} ({e}): reading the files here")
        code, body = _read_here(cfg, host, open_registry, absent(e))
    except admin_client.ProtocolError as e:
        _stderr(f"lchat: error: the router did not answer GET /stats: {e}")
        return 1
    if args.json:
        out(json.dumps(body, indent=2, sort_keys=True))
    if code != 200:
        _stderr(f"lchat: error: {body.get('error') or f'the router answered {code}'}")
        return 1
    if not args.json:
        for line in describe(body):
            out(line)
    return 0


def _ask_router(cfg: BoxConfig, host: str) -> tuple[int, dict[str, Any]]:
    path = "/stats/" + urllib.parse.quote(host, safe="")
    response = admin_client.request(cfg.admin_socket, "GET", path, timeout=TIMEOUT)
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"host": host, "error": f"the router answered {response.status} without JSON"}
    return response.status, body


def _read_here(
    cfg: BoxConfig,
    host: str,
    open_registry: Callable[[BoxConfig], Registry],
    no_router: bool,
) -> tuple[int, dict[str, Any]]:
    # With no router, no activator holds any hibernating space awake, so a hibernating row is
    # "asleep" by definition; a router we could not ask (permissions) may hold it awake: unknown.
    if not os.path.exists(cfg.registry):
        return 404, {
            "host": host,
            "error": f"no registry at {cfg.registry}",
            "reason": "no_registry",
        }
    route = open_registry(cfg).get(host)
    if (
        cfg.mesh is not None
        and route is not None
        and route.kind == "instance"
        and route.hibernate
        and not route.elsewhere
        and in_scope(host, cfg.mesh.domains)
    ):
        # Never from this box's files alone: the space may have woken and been written on any
        # box since (an empty local view is not "never woken"; a reaper must skip, not reap).
        return 503, {
            "host": host,
            "error": f"{host} is a mesh space and no router answers here: only a running router "
            "asks the box that holds or owns it (or the bucket). Start the router, or run "
            "`lchat stats` on another box of the mesh",
            "reason": "no_router_mesh",
        }
    state = "asleep" if no_router and route is not None and route.hibernate else None
    try:
        stats = spacestats.stats_of(route, host, cfg.data_dir, state)
    except spacestats.StatsError as e:
        return e.code, e.to_json(host)
    return 200, stats.to_json()


def describe(body: dict[str, Any]) -> list[str]:
    """The human lines for a 200 body."""
    host = body.get("host", "?")
    source = body.get("source")
    if source == "registry":
        where = "from its registry row: it has never woken on this box"
    elif source == "bucket":
        where = "from the bucket: it has never woken on any box of the mesh"
    elif source == "owner":
        where = f"from {body.get('box')}, which holds or owns it ({body.get('owner_source')})"
    else:
        where = f"from {body.get('db')}, read-only"
    kind = "hibernating" if body.get("hibernate") else "always-on"
    state = f", {body['state']}" if body.get("state") else ""
    return [
        f"{host} ({kind}{state}), {where}",
        f"  setup complete  {_yes(body.get('setup_complete'))}",
        f"  members         {body.get('members')}",
        f"  has content     {_yes(body.get('has_content'))}",
    ]


def _yes(value: object) -> str:
    return "yes" if value is True else "no" if value is False else "?"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
