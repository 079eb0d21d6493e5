"""``lchat backup ls``: one LIST of the layout's root; every box's databases, their newest txid,
size and times; LAG from this box's router; a warning when this box's env files are not in the
backup (no ``LCHAT_BACKUP_KEY``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lchat.backup import envfiles
from lchat.backup.layout import Stored
from lchat.cli.backup.bucket import describe, opened, stored_in, versioning_note
from lchat.cli.backup.live import Command, lag
from lchat.cli.backup.output import iso, one_line, size, table

LS_COLUMNS = ("NAME", "BOX", "TXID", "SIZE", "NEWEST", "LAST SNAPSHOT", "LAG")


async def ls(command: Command) -> int:
    reactor, args, cfg, conf, out, err, run, router = command
    async with opened(reactor, cfg) as store:
        stored = await stored_in(store, conf)
        where = describe(store, conf)
        versioning = await versioning_note(reactor, store, conf)
    if args.box is not None:
        stored = [s for s in stored if s.box == args.box]
    objects = [_ls_object(s, router.entry(s.box, s.name)) for s in stored]
    if args.json:
        out(json.dumps(objects, indent=2))
    else:
        rows = [LS_COLUMNS, *(_ls_row(o) for o in objects)]
        table(rows, out)
        for o in objects:
            if o["last_error"]:
                out(f"  {o['name']}: last error: {one_line(o['last_error'])}")
        if not objects:
            err(f"lchat: nothing backed up{f' by box {args.box}' if args.box else ''} in {where}")
    if router.box and args.box in (None, router.box):
        listed = {s.name for s in stored if s.box == router.box}
        for name, entry in sorted(router.databases.items()):
            if name not in listed:
                why = entry.get("last_error") or entry.get("state") or "?"
                err(
                    f"lchat: warning: the router backs up {name} ({entry.get('path')}) but none "
                    f"of it is in the bucket yet: {one_line(str(why))}"
                )
    if versioning:
        err(versioning)
    if not conf.env_key:
        unprotected = await run(envfiles.on_disk, cfg.data_dir)
        if unprotected:
            err(
                f"lchat: warning: {len(unprotected)} env file(s) of this box (space secrets, such "
                f"as {unprotected[0]}) are NOT in the backup: LCHAT_BACKUP_KEY is not set"
            )
    return 0


def _ls_object(s: Stored, entry: Mapping[str, Any] | None) -> dict[str, Any]:
    error = entry.get("last_error") if entry is not None else None
    return {
        "name": s.name,
        "box": s.box,
        "replica": s.path,
        "txid": f"{s.txid:016x}",
        "size": s.size,
        "newest": iso(s.newest) if s.newest else None,
        "last_snapshot": iso(s.last_snapshot) if s.last_snapshot else None,
        "lag": lag(entry),
        "state": str(entry["state"]) if entry is not None and entry.get("state") else None,
        "last_error": str(error) if error else None,
    }


def _ls_row(o: Mapping[str, Any]) -> tuple[str, ...]:
    if o["state"] not in (None, "running"):
        lag = str(o["state"])  # starting, failed, stopping: no lag to speak of
    else:
        lag = "-" if o["lag"] is None else f"{o['lag']:.1f}s"
    return (
        o["name"],
        o["box"],
        o["txid"],
        size(o["size"]),
        o["newest"] or "-",
        o["last_snapshot"] or "-",
        lag,
    )
