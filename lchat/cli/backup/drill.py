"""``lchat backup drill``: every database of a box restored into a temp dir, checked, and
compared with the live txid: the one-command proof an operator runs after a change."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from lchat.backup.layout import Stored
from lchat.cli.backup.bucket import describe, opened, stored_in
from lchat.cli.backup.live import Command, lag, live_txid
from lchat.cli.backup.output import BackupCliError, error_line, one_line, table
from lchat.cli.backup.restore import remove_quietly
from lchat.objstore import ObjectStore, ObjectStoreError
from lchat.replica import restore as restore_mod
from lchat.threads import RunInThread

DRILL_COLUMNS = ("NAME", "TXID", "LIVE TXID", "INTEGRITY", "SECONDS", "RESULT")


async def drill(command: Command) -> int:
    reactor, args, cfg, conf, out, err, run, router = command
    # The router was asked before the restores: what it says was in the bucket then must be in
    # what we restore.
    box = args.box or conf.box
    results: list[dict[str, Any]] = []
    async with opened(reactor, cfg) as store:
        stored = await stored_in(store, conf)
        mine = [s for s in stored if s.box == box]
        # What the router backs up that has nothing in the bucket (a start that keeps failing:
        # a wrong IAM prefix, say) fails the drill too: it is exactly what it is for.
        absent = [
            name
            for name in sorted(router.databases if router.box == box else {})
            if name not in {s.name for s in mine}
        ]
        if not mine and not absent:
            boxes = sorted({s.box for s in stored})
            there = f"boxes there: {', '.join(boxes)}; pass --box" if boxes else "it is empty"
            raise BackupCliError(
                f"nothing backed up by box {box} in {describe(store, conf)} ({there})"
            )
        work: str = await run(lambda: tempfile.mkdtemp(prefix="lchat-drill-"))
        try:
            for s in mine:
                results.append(await _drill_one(store, s, router.entry(box, s.name), work, run))
        finally:
            await run(shutil.rmtree, work, True)
        for name in absent:
            entry = router.databases[name]
            why = entry.get("last_error") or f"state {entry.get('state')}"
            results.append(
                {
                    "name": name,
                    "txid": None,
                    "live_txid": entry.get("txid"),
                    "integrity": None,
                    "seconds": 0.0,
                    "result": "missing",
                    "error": f"the router backs it up, but nothing of it is in the bucket ({why})",
                }
            )
    if args.json:
        out(json.dumps(results, indent=2))
    else:
        dashed = ("name", "txid", "live_txid", "integrity")  # "-" where None
        rows = [
            (*(r[c] or "-" for c in dashed), f"{r['seconds']:.2f}", r["result"]) for r in results
        ]
        table([DRILL_COLUMNS, *rows], out)
        for r in results:
            if r["error"]:
                out(f"  {r['name']}: {one_line(r['error'])}")
    bad = [r["name"] for r in results if r["result"] not in ("ok", "behind")]
    if bad:
        err(error_line(f"the drill failed for {', '.join(bad)} (box {box})"))
        return 1
    return 0


async def _drill_one(
    store: ObjectStore, s: Stored, entry: Mapping[str, Any] | None, work: str, run: RunInThread
) -> dict[str, Any]:
    live = live_txid(entry)
    result: dict[str, Any] = {
        "name": s.name,
        "box": s.box,
        "txid": None,
        "live_txid": f"{live:016x}" if live is not None else None,
        "integrity": None,
        "seconds": 0.0,
        "result": "failed",
        "error": None,
    }
    path = os.path.join(work, s.name)
    started = time.monotonic()
    try:
        # Published only once PRAGMA integrity_check said ok: a failed check is a RestoreError.
        restored = await restore_mod.restore(store, s.path, path, run_in_thread=run)
        result["txid"] = f"{restored.txid:016x}"
        result["integrity"] = "ok"
    except (restore_mod.RestoreError, ObjectStoreError, OSError, sqlite3.Error) as e:
        result["error"] = str(e) or type(e).__name__
        return result
    finally:
        result["seconds"] = round(time.monotonic() - started, 3)
        await run(remove_quietly, path)
    if live is None or restored.txid >= live:
        result["result"] = "ok"
    elif (lag(entry) or 0.0) > 0:
        result["result"] = "behind"  # commits were in flight when the router was asked
    else:
        result["result"] = "missing"
        result["error"] = (
            f"the router said everything up to txid {live:016x} was in the bucket (lag 0), but "
            f"the restore reached only {restored.txid:016x}"
        )
    return result
