"""The live box, as a backup command sees it: what its running router backs up right now (``GET
/status``), and whether something uses a file a restore would write (the router, a space)."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from attrs import field, frozen

from lchat import admin_client
from lchat.backup import selection
from lchat.cli.backup.output import Out
from lchat.config import BackupConfig, BoxConfig
from lchat.reactors import Reactor
from lchat.registry import Registry, Route
from lchat.threads import RunInThread

STATUS_TIMEOUT = 3.0  # GET /status on the admin socket


@frozen
class Router:
    """What the router of this box says (``GET /status``), or that it is not running."""

    running: bool
    known: bool  # it answered: ``databases`` is everything its backup replicates
    box: str | None = None  # its backup's box (None: its backup is off)
    databases: Mapping[str, Mapping[str, Any]] = field(factory=dict)  # its backup's, by name

    def entry(self, box: str, name: str) -> Mapping[str, Any] | None:
        """Its view of database ``name`` of ``box``, when it backs that one up."""
        return self.databases.get(name) if box == self.box else None


class Command(NamedTuple):
    """What a backup action works with; ``router`` was asked before anything else was done."""

    reactor: Reactor
    args: argparse.Namespace
    cfg: BoxConfig
    conf: BackupConfig
    out: Out
    err: Out
    run: RunInThread
    router: Router


async def ask_router(cfg: BoxConfig, run: RunInThread, err: Out) -> Router:
    try:
        response = await run(admin_client.status, cfg.admin_socket, STATUS_TIMEOUT)
    except admin_client.Unreachable as e:
        if isinstance(e.__cause__, FileNotFoundError | ConnectionRefusedError):
            return Router(running=False, known=True)
        err(f"lchat: cannot reach the router ({e}): taking it to be running")
        return Router(running=True, known=False)
    except admin_client.ProtocolError as e:
        err(f"lchat: the router did not answer GET /status ({e}): taking it to be running")
        return Router(running=True, known=False)
    try:
        body = response.json() if response.status == 200 else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        err(
            f"lchat: the router answered GET /status with {response.status}: what it backs up "
            f"is unknown"
        )
        return Router(running=True, known=False)
    backup = body.get("backup")
    if not isinstance(backup, dict):
        return Router(running=True, known=True)
    databases = backup.get("databases")
    if not isinstance(databases, dict):
        databases = {}
    return Router(
        running=True,
        known=True,
        box=str(backup.get("box") or ""),
        databases={str(k): v for k, v in databases.items() if isinstance(v, dict)},
    )


def lag(entry: Mapping[str, Any] | None) -> float | None:
    lag = entry.get("lag") if entry is not None else None
    return float(lag) if isinstance(lag, int | float) else None


def live_txid(entry: Mapping[str, Any] | None) -> int | None:
    text = entry.get("txid") if entry is not None else None
    try:
        return int(text, 16) if isinstance(text, str) else None
    except ValueError:
        return None


def router_uses(cfg: BoxConfig, router: Router, data_dir: str) -> bool:
    """Blocking. Whether the running router works on ``data_dir``: it is the env file's data
    dir, or the registry's directory, or what the router backs up lies under it."""
    keys = _same(data_dir)
    if keys & (_same(cfg.data_dir) | _same(os.path.dirname(cfg.registry))):
        return True
    real = os.path.realpath(data_dir) + os.sep
    return any(
        os.path.realpath(str(e.get("path", ""))).startswith(real) for e in router.databases.values()
    )


def rows_of(registry: str) -> list[Route]:
    """Blocking. The rows of the registry at ``registry`` (none when it does not exist); read
    only: a registry the router has not migrated yet is an error, not an upgrade."""
    if not os.path.exists(registry):
        return []
    return list(Registry(registry, time.time).load())


def dbs_of(rows: Iterable[Route], data_dir: str) -> list[tuple[Route, str]]:
    """Each instance row with its database file."""
    return [(r, selection.instance_db(r, data_dir)) for r in rows if r.kind == "instance"]


def in_use(
    output: str, cfg: BoxConfig, router: Router, rows: Iterable[tuple[Route, str]]
) -> str | None:
    """Blocking. Why ``output`` must not be written now (something uses it), or None."""
    keys = _same(output)
    if router.running:
        if not router.known and _under(output, cfg.data_dir):
            return (
                f"the router is running ({cfg.admin_socket}) but did not say what it backs up, "
                f"and {output} is in its data dir"
            )
        for name, entry in router.databases.items():
            if keys & _same(str(entry.get("path", ""))):
                return f"the running router backs it up right now (as {name})"
        if keys & _same(cfg.registry):
            return "it is the registry of the running router"
    for route, db in rows:
        if not keys & _same(db):
            continue
        if admin_client.has_listener(route.socket):
            return f"it is the database of {route.host}, which is running ({route.socket} answers)"
        if router.running and not route.hibernate:
            return (
                f"it is the database of {route.host}, which does not hibernate: the running "
                f"router keeps it running"
            )
        if route.hibernate:
            # Its live copy is the hibernation bucket's; a backup copy here is history from
            # before it hibernated, and the next wake would snapshot it as the newest state.
            return (
                f"it is the database of {route.host}, which hibernates: its newest copy is in "
                f"the hibernation bucket (`lchat replica restore {route.host}`), and the next "
                f"wake would take this file as newer"
            )
    return None


def refusal(output: str, why: str) -> str:
    base = os.path.basename(output)
    return (
        f"refusing to restore onto {output}: {why}. Restore it elsewhere (-o "
        f"{output}.restored), stop what writes it (its space, the router), then move the "
        f"restored file into place and delete the old {base}-wal and {base}-shm beside it"
    )


def _same(path: str) -> set[object]:
    """The keys under which two paths name one file: the real path, and the file's identity."""
    if not path or "\x00" in path:
        return set()
    keys: set[object] = {os.path.realpath(path)}
    with contextlib.suppress(OSError):
        st = os.stat(path)
        keys.add((st.st_dev, st.st_ino))
    return keys


def _under(path: str, directory: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(directory) + os.sep)
