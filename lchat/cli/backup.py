"""``lchat backup ls|restore|drill|litestream-config``: the operator's side of the fleet backup.

The bucket is the router's backup bucket (``LCHAT_BACKUP_*``, read from its env file like every
command; docs/backup.md), laid out as :mod:`lchat.backup.layout` says. The running router is asked
``GET /status`` on its admin socket for what it backs up right now (its ``backup`` section); it
may be down, and then every command still works, without the live columns.

- ``ls``: one LIST of the layout's root: every box's databases, their newest txid, size and
  times; LAG from this box's router.
- ``restore NAME``: one database into a file nothing uses (:func:`_in_use`), as of now, a txid or
  a time. ``restore --all --into DIR``: a box rebuilt from nothing: the registry first, then every
  database its rows run without hibernating, then the other databases of the box (extras).
- ``drill``: every database of a box restored into a temp dir, checked, and compared with the
  live txid: the one-command proof an operator runs after a change.
- ``litestream-config``: what the router backs up now, as a stock Litestream config.

Invariants: nothing is ever written to the bucket. A restore writes its output only once the
whole database is rebuilt and checked (:func:`lchat.replica.restore.restore`), never over a
database something uses right now, and then removes the ``-wal``/``-shm``/``-journal`` left
beside the output by the file it replaced (SQLite would replay a stale WAL into the restored
database). The commands are synchronous: :func:`run` runs the async work on a reactor of its own
(:func:`lchat.cli.runner.run`); :func:`execute` is the same on a reactor that is already running.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import sqlite3
import stat
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from attrs import field, frozen

from lchat import admin_client, files, hosts
from lchat.backup import envfiles, selection
from lchat.backup.layout import REGISTRY_NAME, BadName, Layout, Stored, catalogue, check_name
from lchat.buckets import prepare
from lchat.cli import replica as replica_cli
from lchat.cli import runner
from lchat.config import BackupConfig, BoxConfig
from lchat.objstore import (
    UTC,
    NotFound,
    ObjectStore,
    ObjectStoreError,
    open_store,
)
from lchat.objstore.aws import ResolvedCredentials
from lchat.registry import Registry, RegistryError, Route
from lchat.replica import restore as restore_mod
from lchat.threads import RunInThread, thread_runner

SUMMARY = "list, restore or drill the fleet backup (LCHAT_BACKUP_BUCKET)"
STATUS_TIMEOUT = 3.0  # GET /status on the admin socket
VERSIONING_TIMEOUT = 5.0  # the one GetBucketVersioning of `ls`
SIDECARS = ("-wal", "-shm", "-journal")  # what SQLite keeps beside a database file
_BOX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # LCHAT_BACKUP_BOX's rule

Out = Callable[[str], None]

RESTORE_HELP = """\
Restore one database (DB-NAME as `lchat backup ls` shows it: registry.db, <host>.db, home.db)
to ./DB-NAME or -o PATH, as of the newest state in the backup, --txid N or --timestamp T (the
last state committed before T).

Which box's copy: --box BOX; else this box's (LCHAT_BACKUP_BOX); else the only box that has
one. Nothing is written unless the whole database is rebuilt and passes integrity_check. An
existing output is replaced only with --force, and never while something uses it (a database
the running router backs up, the registry of a running router, a space's database while it
runs): restore elsewhere with -o, stop what writes it, then move the file into place.

--all --into DATA_DIR rebuilds a box: the registry (to DATA_DIR/registry.db), then the
database of every space it lists that does not hibernate (DATA_DIR/<host>.db; a hibernating
space wakes from the hibernation bucket), then the box's other databases (DATA_DIR/<name>).
Refused while a router runs on DATA_DIR, or when DATA_DIR/registry.db exists (unless --force).
The restored registry's paths are re-derived (this box's LCHAT_RUN_DIR, DATA_DIR), its service
rows dropped (add them again); beside the rows' databases only *.db names are restored. Sealed
env files come back only as new as the box's env manifest names (--accept-unpinned-env also
takes ones it does not pin: sealed by an older lchat, or with the manifest missing).
"""

DRILL_HELP = """\
Restore every database of a box (--box, default this box) into a temp dir (removed after; set
TMPDIR to put it elsewhere), run PRAGMA integrity_check on each, and compare its txid with the
live one the running router reports (LIVE TXID '-' when it does not back that database up here).

RESULT: ok (restored and checked; txid at or past the live one, or no live one), behind (the
restored txid is older than the live one, but the router had commits in flight: its lag was
above 0 when asked), missing (older although the router said everything up to the live txid
was in the bucket: lag 0), failed (the restore or the check failed). Exit status 0 only when
every database is ok or behind.
"""

LITESTREAM_HELP = """\
Print a litestream.yml for the stock Litestream (0.5) listing exactly what the router backs up
now: the registry, every instance that does not hibernate, and LCHAT_BACKUP_EXTRA, each to its
replica path in the backup layout. Never run it beside the router's own backup: two replicators
on one database corrupt each other. With the router's backup off, give the bucket to this
command alone: LCHAT_BACKUP_BUCKET=my-bucket lchat backup litestream-config.
"""


class BackupCliError(Exception):
    """A refusal or failure: one ``lchat: error:`` line, exit status 1."""


_ERRORS = (
    BackupCliError,
    BadName,
    restore_mod.RestoreError,
    ObjectStoreError,
    RegistryError,
)


# --- arguments ------------------------------------------------------------------------------------


def add_arguments(
    parser: argparse.ArgumentParser,
    common: Callable[[argparse.ArgumentParser], None] = lambda p: None,
) -> None:
    """``common`` adds the CLI's shared options to each action, so they may follow it too."""
    sub = parser.add_subparsers(dest="backup_command", metavar="<action>", required=True)
    raw = argparse.RawDescriptionHelpFormatter

    ls = sub.add_parser(
        "ls",
        help="every backed-up database of every box: txid, size, times, lag (one LIST)",
        description="Every database in the backup bucket, across boxes (one LIST), with LAG "
        "from this box's running router; warns when the bucket's versioning is off.",
    )
    common(ls)
    ls.add_argument("--json", action="store_true", help="print a JSON list (null where unknown)")
    ls.add_argument("--box", type=_box, metavar="BOX", help="only this box's databases")

    rs = sub.add_parser(
        "restore",
        help="rebuild a database (or a whole box) from the backup",
        description=RESTORE_HELP,
        formatter_class=raw,
    )
    common(rs)
    rs.add_argument("name", nargs="?", metavar="DB-NAME", help="the database, as ls names it")
    rs.add_argument("-o", "--output", metavar="PATH", help="where to write it (default ./DB-NAME)")
    target = rs.add_mutually_exclusive_group()
    target.add_argument(
        "--txid", type=replica_cli.txid_type, metavar="N", help="restore up to this txid"
    )
    target.add_argument(
        "--timestamp",
        type=replica_cli.timestamp_type,
        metavar="RFC3339",
        help="restore the last state committed before this time",
    )
    rs.add_argument("--box", type=_box, metavar="BOX", help="the box whose copy to restore")
    rs.add_argument("--force", action="store_true", help="replace an existing output file")
    rs.add_argument("--all", action="store_true", help="restore the whole box into --into DATA_DIR")
    rs.add_argument("--into", metavar="DATA_DIR", help="with --all: the data dir to rebuild")
    rs.add_argument(
        "--accept-unpinned-env",
        action="store_true",
        help="with --all: also restore sealed env files no manifest of the box pins (sealed by "
        "an older lchat, or the manifest is missing): they may be swapped or rolled back",
    )

    dr = sub.add_parser(
        "drill",
        help="restore every database into a temp dir, check it, compare with the live txid",
        description=DRILL_HELP,
        formatter_class=raw,
    )
    common(dr)
    dr.add_argument("--json", action="store_true", help="print a JSON list")
    dr.add_argument("--box", type=_box, metavar="BOX", help="the box to drill (default: this one)")

    lc = sub.add_parser(
        "litestream-config",
        help="print a litestream.yml listing what the router backs up now",
        description=LITESTREAM_HELP,
        formatter_class=raw,
    )
    common(lc)


def _box(text: str) -> str:
    if not _BOX.fullmatch(text) or text in (".", ".."):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a box name (letters, digits, '.', '_' and '-', as LCHAT_BACKUP_BOX)"
        )
    return text


# --- entry points ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, cfg: BoxConfig, out: Out) -> int:
    """The command, synchronously: what needs no bucket is refused before the reactor runs."""
    try:
        conf = _precheck(args, cfg)
        if args.backup_command == "litestream-config":
            out(litestream_config(cfg, conf))
            return 0
        return runner.run(lambda r: _execute(r, args, cfg, conf, out, _stderr))
    except _ERRORS as e:
        _stderr(_error(str(e)))
        return 1


async def execute(
    reactor: Any, args: argparse.Namespace, cfg: BoxConfig, out: Out, err: Out
) -> int:
    """The command on a running ``reactor``; ``out`` gets stdout's lines, ``err`` stderr's."""
    try:
        conf = _precheck(args, cfg)
    except _ERRORS as e:
        err(_error(str(e)))
        return 1
    return await _execute(reactor, args, cfg, conf, out, err)


async def _execute(
    reactor: Any, args: argparse.Namespace, cfg: BoxConfig, conf: BackupConfig, out: Out, err: Out
) -> int:
    try:
        action = args.backup_command
        if action == "litestream-config":
            out(await thread_runner(reactor)(litestream_config, cfg, conf))
            return 0
        if action == "ls":
            return await _ls(reactor, args, cfg, conf, out, err)
        if action == "drill":
            return await _drill(reactor, args, cfg, conf, out, err)
        if args.all:
            return await _restore_all(reactor, args, cfg, conf, out, err)
        return await _restore_one(reactor, args, cfg, conf, out, err)
    except _ERRORS as e:
        err(_error(str(e)))
        return 1
    except OSError as e:
        err(_error(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)))
        return 1


def _precheck(args: argparse.Namespace, cfg: BoxConfig) -> BackupConfig:
    """Everything that can be refused without the bucket; normalises the paths in ``args``."""
    if cfg.backup is None:
        raise BackupCliError(
            "no backup bucket: set LCHAT_BACKUP_BUCKET (in the router's env file, or in the "
            "environment of this command)"
        )
    if args.backup_command == "restore":
        _check_restore_args(args)
    return cfg.backup


def _check_restore_args(args: argparse.Namespace) -> None:
    if args.all:
        if not args.into:
            raise BackupCliError("restore --all needs --into DATA_DIR (the data dir to rebuild)")
        given = [
            flag
            for flag, value in (
                ("DB-NAME", args.name),
                ("-o", args.output),
                ("--txid", args.txid),
                ("--timestamp", args.timestamp),
            )
            if value is not None
        ]
        if given:
            raise BackupCliError(
                f"restore --all takes no {', '.join(given)}: it restores the newest state of "
                f"every database of the box into --into"
            )
        args.into = os.path.abspath(args.into)
        registry = os.path.join(args.into, "registry.db")
        if os.path.lexists(registry) and not args.force:
            raise BackupCliError(
                f"{registry} already exists: --all rebuilds a box into an empty data dir (use "
                f"--force to replace what is there)"
            )
        return
    if args.into is not None:
        raise BackupCliError("--into goes with --all (restore one database with -o PATH)")
    if args.accept_unpinned_env:
        raise BackupCliError(
            "--accept-unpinned-env goes with --all (env files come back with a box)"
        )
    if args.name is None:
        raise BackupCliError(
            "name the database to restore (`lchat backup ls` lists them), or restore the whole "
            "box with --all --into DATA_DIR"
        )
    check_name(args.name)
    output = os.path.abspath(args.output or args.name)
    if os.path.isdir(output):
        output = os.path.join(output, args.name)
    args.output = output
    if os.path.lexists(output) and not args.force:
        raise BackupCliError(f"{output} already exists (use --force to replace it)")
    if args.timestamp is not None:
        now = datetime.datetime.now(UTC)
        if args.timestamp > now:
            raise BackupCliError(
                f"--timestamp {_iso(args.timestamp, 'milliseconds')} is in the future (it is "
                f"{_iso(now, 'milliseconds')} here): "
                f"give a time the backup has already passed, or leave it out for the newest state"
            )


# --- the bucket -----------------------------------------------------------------------------------


@frozen
class _Bucket:
    store: ObjectStore
    credentials: ResolvedCredentials | None  # an S3 bucket's, for GetBucketVersioning


async def _open(reactor: Any, cfg: BoxConfig) -> _Bucket:
    """The bucket of ``LCHAT_BACKUP_*``, to read: a ``file:`` bucket must exist (a backup that
    is not there is an error, never an empty bucket)."""
    conf = cfg.backup
    assert conf is not None, "the caller checks that the backup is configured"
    run = thread_runner(reactor)
    credentials = await run(prepare, cfg, conf.where)
    store = open_store(
        reactor, conf.where, run, credentials, monotonic=time.monotonic, must_exist=True
    )
    return _Bucket(store, credentials)


@contextlib.asynccontextmanager
async def _opened(reactor: Any, cfg: BoxConfig) -> AsyncIterator[_Bucket]:
    bucket = await _open(reactor, cfg)
    try:
        yield bucket
    finally:
        await bucket.store.close()


async def _catalogue(store: ObjectStore, conf: BackupConfig) -> list[Stored]:
    """Every box's databases: one LIST of the layout's root."""
    return catalogue(conf.prefix, await store.list(Layout(conf.prefix, conf.box).root()))


def _where(store: ObjectStore, conf: BackupConfig) -> str:
    return f"{store.describe()} under {conf.prefix + '/' if conf.prefix else 'its root'}"


def _pick(
    stored: list[Stored], name: str, box: str | None, conf: BackupConfig, where: str
) -> Stored:
    """The copy of ``name`` to restore: ``box``'s; else this box's; else the only one."""
    have = [s for s in stored if s.name == name]
    boxes = ", ".join(s.box for s in have)
    if box is not None:
        for s in have:
            if s.box == box:
                return s
        elsewhere = f" (boxes that have it: {boxes})" if have else ""
        raise BackupCliError(f"no backup of {name} from box {box} in {where}{elsewhere}")
    if not have:
        names = sorted({s.name for s in stored})
        there = (
            f"it holds {', '.join(names[:10])}{', ...' if len(names) > 10 else ''}"
            if names
            else "it holds no backup at all"
        )
        raise BackupCliError(f"no backup of {name} in {where}: {there} (`lchat backup ls`)")
    for s in have:
        if s.box == conf.box:
            return s
    if len(have) == 1:
        return have[0]
    raise BackupCliError(
        f"{name} is backed up by {len(have)} boxes ({boxes}) and none of them is this box "
        f"({conf.box}): pass --box BOX to choose"
    )


def _versioning_note(conf: BackupConfig, credentials: ResolvedCredentials | None) -> str | None:
    """Blocking. The line ``ls`` ends with when the bucket's versioning is not known to be on
    (the ransomware backstop, docs/backup.md), else None. Never raises."""
    if credentials is None:
        return (
            f"lchat: versioning does not apply to a file: bucket ({conf.bucket}): keep "
            f"another copy of that directory elsewhere"
        )
    try:
        import botocore.config  # type: ignore[import-untyped]

        client = credentials.session.create_client(
            "s3",
            region_name=conf.region or credentials.region or "us-east-1",
            endpoint_url=conf.endpoint or None,
            config=botocore.config.Config(
                connect_timeout=VERSIONING_TIMEOUT,
                read_timeout=VERSIONING_TIMEOUT,
                retries={"max_attempts": 1, "mode": "standard"},
                s3={"addressing_style": "path" if conf.endpoint else "auto"},
            ),
        )
        status = str(client.get_bucket_versioning(Bucket=conf.bucket).get("Status") or "")
    except Exception as e:
        return (
            f"lchat: warning: cannot tell whether versioning is on for bucket {conf.bucket} "
            f"({_one_line(str(e)) or type(e).__name__}): docs/backup.md says how to turn it on "
            f"with a 14-day noncurrent-version expiry"
        )
    if status == "Enabled":
        return None
    state = "suspended" if status == "Suspended" else "off"
    return (
        f"lchat: warning: versioning is {state} on bucket {conf.bucket}: an overwrite or a "
        f"delete there is final. Turn it on with a 14-day noncurrent-version expiry "
        f"(docs/backup.md)"
    )


# --- the running router ---------------------------------------------------------------------------


@frozen
class _Router:
    """What the router of this box says (``GET /status``), or that it is not running."""

    running: bool
    known: bool  # it answered: ``databases`` is everything its backup replicates
    box: str | None = None  # its backup's box (None: its backup is off)
    databases: Mapping[str, Mapping[str, Any]] = field(factory=dict)  # its backup's, by name

    def entry(self, box: str, name: str) -> Mapping[str, Any] | None:
        """Its view of database ``name`` of ``box``, when it backs that one up."""
        return self.databases.get(name) if box == self.box else None


async def _ask_router(cfg: BoxConfig, run: RunInThread, err: Out) -> _Router:
    try:
        response = await run(admin_client.status, cfg.admin_socket, STATUS_TIMEOUT)
    except admin_client.Unreachable as e:
        if isinstance(e.__cause__, FileNotFoundError | ConnectionRefusedError):
            return _Router(running=False, known=True)
        err(f"lchat: cannot reach the router ({e}): taking it to be running")
        return _Router(running=True, known=False)
    except admin_client.ProtocolError as e:
        err(f"lchat: the router did not answer GET /status ({e}): taking it to be running")
        return _Router(running=True, known=False)
    try:
        body = response.json() if response.status == 200 else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        err(
            f"lchat: the router answered GET /status with {response.status}: what it backs up "
            f"is unknown"
        )
        return _Router(running=True, known=False)
    backup = body.get("backup")
    if not isinstance(backup, dict):
        return _Router(running=True, known=True)
    databases = backup.get("databases")
    if not isinstance(databases, dict):
        databases = {}
    return _Router(
        running=True,
        known=True,
        box=str(backup.get("box") or ""),
        databases={str(k): v for k, v in databases.items() if isinstance(v, dict)},
    )


def _lag(entry: Mapping[str, Any] | None) -> float | None:
    lag = entry.get("lag") if entry is not None else None
    return float(lag) if isinstance(lag, int | float) else None


def _live_txid(entry: Mapping[str, Any] | None) -> int | None:
    text = entry.get("txid") if entry is not None else None
    try:
        return int(text, 16) if isinstance(text, str) else None
    except ValueError:
        return None


# --- ls -------------------------------------------------------------------------------------------

LS_COLUMNS = ("NAME", "BOX", "TXID", "SIZE", "NEWEST", "LAST SNAPSHOT", "LAG")


async def _ls(
    reactor: Any, args: argparse.Namespace, cfg: BoxConfig, conf: BackupConfig, out: Out, err: Out
) -> int:
    run = thread_runner(reactor)
    router = await _ask_router(cfg, run, err)
    async with _opened(reactor, cfg) as bucket:
        stored = await _catalogue(bucket.store, conf)
        where = _where(bucket.store, conf)
        try:
            versioning = await run(_versioning_note, conf, bucket.credentials)
        except Exception as e:  # the note must never fail the command
            versioning = f"lchat: warning: cannot tell whether versioning is on ({e})"
    if args.box is not None:
        stored = [s for s in stored if s.box == args.box]
    objects = [_ls_object(s, router.entry(s.box, s.name)) for s in stored]
    if args.json:
        out(json.dumps(objects, indent=2))
    else:
        rows = [LS_COLUMNS, *(_ls_row(o) for o in objects)]
        _table(rows, out)
        for o in objects:
            if o["last_error"]:
                out(f"  {o['name']}: last error: {_one_line(o['last_error'])}")
        if not objects:
            err(f"lchat: nothing backed up{f' by box {args.box}' if args.box else ''} in {where}")
    if router.box and args.box in (None, router.box):
        listed = {s.name for s in stored if s.box == router.box}
        for name, entry in sorted(router.databases.items()):
            if name not in listed:
                why = entry.get("last_error") or entry.get("state") or "?"
                err(
                    f"lchat: warning: the router backs up {name} ({entry.get('path')}) but none "
                    f"of it is in the bucket yet: {_one_line(str(why))}"
                )
    if versioning:
        err(versioning)
    return 0


def _ls_object(s: Stored, entry: Mapping[str, Any] | None) -> dict[str, Any]:
    error = entry.get("last_error") if entry is not None else None
    return {
        "name": s.name,
        "box": s.box,
        "replica": s.path,
        "txid": f"{s.txid:016x}",
        "size": s.size,
        "newest": _iso(s.newest) if s.newest else None,
        "last_snapshot": _iso(s.last_snapshot) if s.last_snapshot else None,
        "lag": _lag(entry),
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
        _size(o["size"]),
        o["newest"] or "-",
        o["last_snapshot"] or "-",
        lag,
    )


# --- restore --------------------------------------------------------------------------------------


async def _restore_one(
    reactor: Any, args: argparse.Namespace, cfg: BoxConfig, conf: BackupConfig, out: Out, err: Out
) -> int:
    run = thread_runner(reactor)
    router = await _ask_router(cfg, run, err)
    rows = await run(_rows_of, cfg.registry)
    why = await run(_in_use, args.output, cfg, router, _dbs_of(rows, cfg.data_dir))
    if why is not None:
        raise BackupCliError(_refusal(args.output, why))
    async with _opened(reactor, cfg) as bucket, _target(run, os.path.dirname(args.output)) as where:
        stored = await _catalogue(bucket.store, conf)
        found = _pick(stored, args.name, args.box, conf, _where(bucket.store, conf))
        line = await _restore_to(
            bucket.store,
            found,
            where,
            os.path.basename(args.output),
            run,
            txid=args.txid,
            timestamp=args.timestamp,
            overwrite=args.force,
            owner=None,
        )
    out(f"restored {found.name} (box {found.box}) to {line}")
    return 0


@frozen
class _Where:
    """Where restored files go: the directory (held by a descriptor: every write there is
    relative to it, so a directory swapped for a symlink mid-way redirects nothing), and a
    private staging directory of our own (``mkdtemp`` under ``TMPDIR``) where each database is
    rebuilt and checked before it is installed (:func:`lchat.files.install_file`)."""

    path: str
    fd: int
    stage: str


@contextlib.asynccontextmanager
async def _target(run: RunInThread, directory: str) -> AsyncIterator[_Where]:
    fd: int = await run(files.open_directory, directory)
    try:
        stage: str = await run(_make_stage)
        try:
            yield _Where(directory, fd, stage)
        finally:
            await run(shutil.rmtree, stage, True)
    finally:
        await run(os.close, fd)


def _make_stage() -> str:
    """Blocking. A fresh directory only we write (mode 0700), in a parent nobody else can rename
    it out of: not writable by others, or sticky (as /tmp is)."""
    stage = tempfile.mkdtemp(prefix="lchat-restore-")
    parent = os.stat(os.path.dirname(stage))
    if parent.st_uid not in (0, os.geteuid()) or (
        parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX
    ):
        shutil.rmtree(stage, True)
        raise BackupCliError(
            f"{os.path.dirname(stage)} (TMPDIR) is writable by other users and not sticky: a "
            f"restore stages databases there; set TMPDIR to a directory only you write"
        )
    return stage


async def _restore_to(
    store: ObjectStore,
    found: Stored,
    where: _Where,
    name: str,
    run: RunInThread,
    *,
    txid: int | None = None,
    timestamp: datetime.datetime | None = None,
    overwrite: bool,
    owner: tuple[int, int] | None,
    prepare: Callable[[str], object] | None = None,
) -> str:
    """Restore ``found`` to ``name`` in ``where``, owned by ``owner`` when given; what was done,
    for the operator (``"<path>: txid ..."``). The database is rebuilt and checked in the
    staging directory, ``prepare`` (blocking) runs on it there, and only then is it installed."""
    output = os.path.join(where.path, name)
    staged = os.path.join(where.stage, found.name)
    try:
        result = await restore_mod.restore(
            store,
            found.path,
            staged,
            txid=txid,
            timestamp=timestamp,
            overwrite=True,
            run_in_thread=run,
        )
    except restore_mod.RestoreError as e:
        if timestamp is not None and str(e).startswith("no snapshot"):
            first = await _first_state(store, found)
            if first is not None and timestamp <= first:
                raise BackupCliError(
                    f"--timestamp {_iso(timestamp, 'milliseconds')} is before the first snapshot "
                    f"({_iso(first, 'milliseconds')}) "
                    f"of {found.name} in {found.path}/: there is no state that old to restore"
                ) from None
        raise restore_mod.RestoreError(f"{found.name} from box {found.box}: {e}") from None
    try:
        if prepare is not None:
            await run(prepare, staged)
        uid, gid = owner if owner is not None else (-1, -1)
        await run(
            lambda: files.install_file(
                staged, where.fd, name, uid=uid, gid=gid, overwrite=overwrite
            )
        )
    except FileExistsError:
        raise restore_mod.RestoreError(f"{output} already exists") from None
    finally:
        await run(_remove_quietly, staged)
    removed = await run(_remove_sidecars, where, name)
    tail = f"; removed the stale {', '.join(removed)} beside it" if removed else ""
    return (
        f"{output}: txid {result.txid:016x} ({_iso(result.timestamp)}), "
        f"{result.pages * result.page_size} bytes, {result.bytes_downloaded} bytes "
        f"downloaded{tail}"
    )


async def _first_state(store: ObjectStore, found: Stored) -> datetime.datetime | None:
    """When the oldest file a restore can start from (txid 1) was written, by Litestream's
    timestamp metadata (a LIST has none: one HEAD per such file, a handful at most)."""
    times = []
    for f in found.files:
        if f.min_txid == 1:
            head = restore_mod.parse_key(await store.head(f.info.key))
            times.append((head or f).created_at)
    return min(times, default=None)


def _remove_sidecars(where: _Where, name: str) -> list[str]:
    """Blocking. Remove what SQLite left beside the file ``name`` replaced: replayed into the
    restored database, an old WAL would corrupt it. Returns the names removed. (An unlink
    removes a planted symlink itself, never what it points to.)"""
    removed = []
    for suffix in SIDECARS:
        try:
            os.unlink(name + suffix, dir_fd=where.fd)
        except FileNotFoundError:
            continue
        removed.append(name + suffix)
    return removed


EXTRA_SUFFIX = ".db"  # what `restore --all` restores by listing, beside the registry's rows


async def _restore_all(
    reactor: Any, args: argparse.Namespace, cfg: BoxConfig, conf: BackupConfig, out: Out, err: Out
) -> int:
    run = thread_runner(reactor)
    into: str = args.into
    router = await _ask_router(cfg, run, err)
    if router.running and await run(_router_uses, cfg, router, into):
        raise BackupCliError(
            f"refusing: a router is running on {into} ({cfg.admin_socket} answers), and a "
            f"restore would replace databases under their writers: stop it first (systemctl "
            f"stop lchat), or restore into another directory"
        )
    here_rows = await run(_rows_of, cfg.registry)
    tally = _Tally()
    await run(lambda: os.makedirs(into, mode=0o750, exist_ok=True))
    async with _opened(reactor, cfg) as bucket, _target(run, into) as where:
        store = bucket.store
        stored = await _catalogue(store, conf)
        registry = _pick(stored, REGISTRY_NAME, args.box, conf, _where(store, conf))
        box = registry.box
        mine = {s.name: s for s in stored if s.box == box}
        owner = await run(_owner_to_hand_to, where.fd)
        out(f"restoring box {box} from {_where(store, conf)} into {into}")
        env = _EnvRestore(store, conf, Layout(conf.prefix, box), where, owner, run, args)

        async def one(
            found: Stored,
            name: str,
            rows: list[tuple[Route, str]],
            prepare: Callable[[str], object] | None = None,
        ) -> bool:
            target = os.path.join(into, name)
            why = await run(_in_use, target, cfg, router, rows)
            if why is not None:
                return tally.failed(out, found.name, _refusal(target, why))
            if not args.force and await run(os.path.lexists, target):
                return tally.failed(out, found.name, f"{target} already exists (use --force)")
            try:
                line = await _restore_to(
                    store,
                    found,
                    where,
                    name,
                    run,
                    overwrite=args.force,
                    owner=owner,
                    prepare=prepare,
                )
            except (*_ERRORS, OSError) as e:
                return tally.failed(out, found.name, str(e))
            tally.restored += 1
            out(f"{found.name}: restored to {line}")
            return True

        checked: list[str] = []
        rows: list[Route] = []

        def sanitise(path: str) -> None:
            # On the staged copy: read there, never through a name in the data dir.
            checked.extend(_sanitise_registry(path, into, cfg.run_dir))
            rows.extend(Registry(path, time.time).load())

        if not await one(registry, REGISTRY_NAME, _dbs_of(here_rows, cfg.data_dir), sanitise):
            raise BackupCliError(
                f"the registry could not be restored, so nothing else was: {tally.errors[0]}"
            )
        for line in checked:
            out(f"  note: {line}")
        checks = _dbs_of(rows, into) + _dbs_of(here_rows, cfg.data_dir)
        instance_names = set()
        for route in rows:
            if route.kind != "instance":
                continue
            name = os.path.basename(hosts.db_path(into, route.host))
            instance_names.add(name)
            if route.hibernate:
                tally.skipped += 1
                out(f"{route.host}: hibernating, it wakes from the hibernation bucket")
                for line in await env.restore(route.host):
                    out(line)
                continue
            found = mine.get(name)
            if found is None:
                tally.failed(out, name, f"{route.host} has no backup under {box}/ (never ran?)")
                continue
            if not await one(found, name, checks):
                continue
            for line in await env.restore(route.host):
                out(line)
        for name in sorted(mine):
            if name == REGISTRY_NAME or name in instance_names:
                continue
            if not name.endswith(EXTRA_SUFFIX):
                # Never a name the box's files could collide with (an env file, a key): whoever
                # writes the bucket could plant a "replica" of any name under the box.
                out(
                    f"{name}: not restored (only {EXTRA_SUFFIX} names are restored with --all; "
                    f"if it is yours: lchat backup restore {name} --box {box} -o PATH)"
                )
                continue
            await one(mine[name], name, checks)
    total = tally.restored + len(tally.errors)
    out(
        f"restored {tally.restored} of {total} databases into {into}"
        f"{f', {tally.skipped} hibernating spaces skipped' if tally.skipped else ''}"
    )
    if tally.errors:
        err(_error(f"{len(tally.errors)} of {total} databases were not restored (see above)"))
        return 1
    return 0


class _EnvRestore:
    """Bringing back the spaces' env files of one box (sealed with LCHAT_BACKUP_KEY, pinned by
    the box's manifest: lchat.backup.envfiles)."""

    def __init__(
        self,
        store: ObjectStore,
        conf: BackupConfig,
        place: Layout,
        where: _Where,
        owner: tuple[int, int] | None,
        run: RunInThread,
        args: argparse.Namespace,
    ) -> None:
        self._store = store
        self._conf = conf
        self._place = place
        self._where = where
        self._owner = owner
        self._run = run
        self._accept_unpinned = bool(getattr(args, "accept_unpinned_env", False))
        self._manifest: envfiles.Manifest | None = None
        self._manifest_read = False

    async def _read_manifest(self) -> list[str]:
        """The box's manifest, read once; the lines to print about it."""
        if self._manifest_read or not self._conf.env_key:
            return []
        self._manifest_read = True
        key = envfiles.manifest_key(self._place.box_path())
        try:
            blob = (await self._store.get(key)).body
        except NotFound:
            return [
                f"  note: box {self._place.box} has no env manifest in the backup: its sealed env "
                f"files are not pinned to their newest versions"
                + (
                    ""
                    if self._accept_unpinned
                    else " and are not restored without --accept-unpinned-env"
                )
            ]
        try:
            self._manifest = envfiles.unseal_manifest(self._place, blob, self._conf.env_key)
        except envfiles.SealError as e:
            return [
                f"  note: {e}: the box's env files are not pinned"
                + (
                    ""
                    if self._accept_unpinned
                    else " and not restored without --accept-unpinned-env"
                )
            ]
        return [
            f"  env files: the box's manifest was sealed at {self._manifest.sealed_at} (a file "
            f"older than it names is refused as rolled back)"
        ]

    async def restore(self, host: str) -> list[str]:
        """Bring back ``host``'s env files unless they are there already; the lines to print."""
        lines = await self._read_manifest()
        run = self._run
        for path in (
            hosts.env_path(self._where.path, host),
            hosts.bot_env_path(self._where.path, host),
        ):
            name = os.path.basename(path)
            if await run(_exists_in, self._where.fd, name):
                lines.append(f"  {name}: already there, kept")
                continue
            try:
                blob = (await self._store.get(envfiles.key_for(self._place.box_path(), name))).body
            except NotFound:
                if name.endswith("-bot.env"):
                    continue  # no bot staged
                lines.append(
                    f"  note: {path} (its admin token) is not in the backup (the backing-up router "
                    f"had no LCHAT_BACKUP_KEY): the space starts once it is back (copy it from "
                    f"where you keep the box's secrets, mode 0600)"
                )
                continue
            if not self._conf.env_key:
                lines.append(
                    f"  note: {name} is in the backup, sealed: set LCHAT_BACKUP_KEY (the "
                    f"backing-up box's) and re-run with --force, or copy it from where you keep "
                    f"the secrets"
                )
                continue
            floor = self._manifest.files.get(name) if self._manifest is not None else None
            try:
                if floor is None and not self._accept_unpinned:
                    raise envfiles.SealError(
                        f"{name}: no env manifest of box {self._place.box} pins it, so a copy "
                        f"rolled back or planted by whoever writes the bucket cannot be told "
                        f"from the newest: not restored (re-run with --accept-unpinned-env to "
                        f"accept it, or copy it from where you keep the secrets)"
                    )
                opened = envfiles.unseal(
                    self._place,
                    name,
                    blob,
                    self._conf.env_key,
                    not_before=floor,
                    accept_legacy=self._accept_unpinned,
                )
            except envfiles.SealError as e:
                lines.append(f"  note: {e}")
                continue
            uid, gid = self._owner if self._owner is not None else (-1, -1)
            await run(envfiles.write_private, self._where.fd, name, opened.content, uid, gid)
            sealed = (
                "first-format seal, accepted"
                if opened.legacy
                else f"sealed at {envfiles.when(opened.generation)}"
            )
            lines.append(f"  {name}: restored (mode 0600; {sealed})")
        return lines


def _exists_in(dir_fd: int, name: str) -> bool:
    """Blocking. Whether ``name`` is in the directory (a symlink counts, followed nowhere)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _sanitise_registry(path: str, data_dir: str, run_dir: str) -> list[str]:
    """Blocking. Make a restored registry (in the staging directory) trust nothing the backup
    said about paths: every instance row's socket and database are re-derived by
    :mod:`lchat.hosts` (this box's LCHAT_RUN_DIR, the data dir restored into); service rows
    (their socket is whatever the operator gave, so any path a bucket writer likes, such as the
    router's admin socket) and rows that are not valid are removed. Migrates it to this lchat's
    schema, as the router would at its start. Returns what was changed, in words."""
    registry = Registry(path, time.time)
    registry.migrate()
    notes = []
    for route in registry.load():
        try:
            if not hosts.is_normal(route.host):
                raise RegistryError("not a normalised host name")
            if route.kind != "instance":
                registry.delete(route.host)
                notes.append(
                    f"{route.host}: a service row (the backup names socket {route.socket}) was "
                    f"not restored: a restore cannot tell a service's socket from a planted "
                    f"one. Add it again if it is yours: lchat add-service {route.host} --socket "
                    f"PATH"
                )
                continue
            socket = hosts.socket_path(run_dir, route.host, isolated=hosts.isolated(data_dir))
            db = hosts.db_path(data_dir, route.host)
            if (route.socket, route.db_path) != (socket, db):
                registry.update(route.host, socket=socket, db_path=db)
                # Said only when the backup's path is not this host's file in some other
                # directory (a box restored elsewhere): that is a path the host could not have.
                for what, was, now in (
                    ("socket", route.socket, socket),
                    ("database", route.db_path, db),
                ):
                    if was and os.path.basename(was) != os.path.basename(now):
                        notes.append(
                            f"{route.host}: the backup's row names {what} {was}, not a path of "
                            f"this host: set to {now}"
                        )
        except (RegistryError, hosts.InvalidHost) as e:
            registry.delete(route.host)
            notes.append(f"{route.host!r}: removed from the restored registry ({e})")
    return notes


class _Tally:
    def __init__(self) -> None:
        self.restored = 0
        self.skipped = 0
        self.errors: list[str] = []

    def failed(self, out: Out, name: str, why: str) -> bool:
        self.errors.append(why)
        out(f"{name}: FAILED: {_one_line(why)}")
        return False


def _owner_to_hand_to(dir_fd: int) -> tuple[int, int] | None:
    """Blocking. Who restored files should belong to: the owner of the data dir they go into
    (the router's user), when we are root and it is someone else; else None (leave them)."""
    if os.geteuid() != 0:
        return None
    st = os.fstat(dir_fd)
    return None if (st.st_uid, st.st_gid) == (0, 0) else (st.st_uid, st.st_gid)


def _router_uses(cfg: BoxConfig, router: _Router, data_dir: str) -> bool:
    """Blocking. Whether the running router works on ``data_dir``: it is the env file's data
    dir, or the registry's directory, or what the router backs up lies under it."""
    keys = _same(data_dir)
    if keys & (_same(cfg.data_dir) | _same(os.path.dirname(cfg.registry))):
        return True
    real = os.path.realpath(data_dir) + os.sep
    return any(
        os.path.realpath(str(e.get("path", ""))).startswith(real) for e in router.databases.values()
    )


def _rows_of(registry: str) -> list[Route]:
    """Blocking. The rows of the registry at ``registry`` (none when it does not exist); read
    only: a registry the router has not migrated yet is an error, not an upgrade."""
    if not os.path.exists(registry):
        return []
    return list(Registry(registry, time.time).load())


def _dbs_of(rows: Iterable[Route], data_dir: str) -> list[tuple[Route, str]]:
    """Each instance row with its database file."""
    return [(r, selection.instance_db(r, data_dir)) for r in rows if r.kind == "instance"]


def _in_use(
    output: str, cfg: BoxConfig, router: _Router, rows: Iterable[tuple[Route, str]]
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


def _refusal(output: str, why: str) -> str:
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


# --- drill ----------------------------------------------------------------------------------------

DRILL_COLUMNS = ("NAME", "TXID", "LIVE TXID", "INTEGRITY", "SECONDS", "RESULT")


async def _drill(
    reactor: Any, args: argparse.Namespace, cfg: BoxConfig, conf: BackupConfig, out: Out, err: Out
) -> int:
    run = thread_runner(reactor)
    box = args.box or conf.box
    # Asked before the restores: what it says was in the bucket then must be in what we restore.
    router = await _ask_router(cfg, run, err)
    results: list[dict[str, Any]] = []
    async with _opened(reactor, cfg) as bucket:
        store = bucket.store
        stored = await _catalogue(store, conf)
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
                f"nothing backed up by box {box} in {_where(store, conf)} ({there})"
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
        rows = [DRILL_COLUMNS]
        for r in results:
            rows.append(
                (
                    r["name"],
                    r["txid"] or "-",
                    r["live_txid"] or "-",
                    r["integrity"] or "-",
                    f"{r['seconds']:.2f}",
                    r["result"],
                )
            )
        _table(rows, out)
        for r in results:
            if r["error"]:
                out(f"  {r['name']}: {_one_line(r['error'])}")
    bad = [r["name"] for r in results if r["result"] not in ("ok", "behind")]
    if bad:
        err(_error(f"the drill failed for {', '.join(bad)} (box {box})"))
        return 1
    return 0


async def _drill_one(
    store: ObjectStore, s: Stored, entry: Mapping[str, Any] | None, work: str, run: RunInThread
) -> dict[str, Any]:
    live = _live_txid(entry)
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
        restored = await restore_mod.restore(store, s.path, path, run_in_thread=run)
        result["txid"] = f"{restored.txid:016x}"
        result["integrity"] = await run(_integrity, path)
    except (restore_mod.RestoreError, ObjectStoreError, OSError, sqlite3.Error) as e:
        result["error"] = str(e) or type(e).__name__
        return result
    finally:
        result["seconds"] = round(time.monotonic() - started, 3)
        await run(_remove_quietly, path)
    if result["integrity"] != "ok":
        result["error"] = f"integrity_check: {result['integrity']}"
    elif live is None or restored.txid >= live:
        result["result"] = "ok"
    elif (_lag(entry) or 0.0) > 0:
        result["result"] = "behind"  # commits were in flight when the router was asked
    else:
        result["result"] = "missing"
        result["error"] = (
            f"the router said everything up to txid {live:016x} was in the bucket (lag 0), but "
            f"the restore reached only {restored.txid:016x}"
        )
    return result


def _integrity(path: str) -> str:
    """Blocking. ``PRAGMA integrity_check``'s answer: ``ok``, or its first problems."""
    conn = sqlite3.connect(f"file:{quote(path)}?immutable=1", uri=True)
    try:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
    finally:
        conn.close()
    return "; ".join(str(r[0]) for r in rows[:3])


def _remove_quietly(path: str) -> None:
    for p in (path, *(path + s for s in SIDECARS)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


# --- litestream-config ----------------------------------------------------------------------------


def litestream_config(cfg: BoxConfig, conf: BackupConfig) -> str:
    """Blocking. A ``litestream.yml`` (Litestream 0.5: ``dbs:``, one ``replica:`` each) listing
    exactly what the router would back up now, by :mod:`lchat.backup.selection`'s rule with no
    host claimed by the activator: never a hibernating space."""
    rows = _rows_of(cfg.registry)
    paths = selection.candidates(rows, cfg.registry, cfg.data_dir)
    present, extra = selection.scan(cfg.data_dir, conf.extra, paths)
    chosen, problems = selection.choose(
        rows, registry=cfg.registry, data_dir=cfg.data_dir, present=present, extra=extra
    )
    layout = Layout(conf.prefix, conf.box)
    now = _iso(datetime.datetime.now(UTC))
    header = (
        f"litestream.yml for the stock Litestream (0.5), generated by `lchat backup "
        f"litestream-config` at {now} from {cfg.env_file}. It lists exactly what the lchat router "
        f"backs up now: the registry, every space that does not hibernate, and "
        f"LCHAT_BACKUP_EXTRA; never a hibernating space (the activator replicates those). "
        f"Regenerate it whenever the registry changes."
    )
    warning = (
        "DO NOT run Litestream on it while the router's own backup is on (LCHAT_BACKUP_BUCKET in "
        "its env file): that puts two replicators on one database, and they corrupt each other."
    )
    notes = [
        header,
        warning,
        "Credentials: Litestream's own (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or its chain).",
    ]
    if conf.where.is_file:
        notes.append(
            "A file: bucket: Litestream writes plain files there, which `litestream restore` "
            "reads (`lchat backup restore` reads only the router's own file-store layout)."
        )
    lines = [
        line
        for note in notes
        for line in textwrap.wrap(
            note,
            98,
            initial_indent="# ",
            subsequent_indent="# ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    ]
    lines += [f"# not listed: {_one_line(p)}" for p in problems]
    entries = []
    for c in chosen.values():
        replica = layout.replica_path(c.name)
        entries.append(f"  - path: {_yaml(c.path)}  # {c.why}{f' {c.host}' if c.host else ''}")
        entries.append("    replica:")
        if not conf.where.is_file:
            entries += [
                "      type: s3",
                f"      bucket: {_yaml(conf.bucket)}",
                f"      path: {_yaml(replica)}",
            ]
            if conf.region:
                entries.append(f"      region: {_yaml(conf.region)}")
            if conf.endpoint:
                entries.append(f"      endpoint: {_yaml(conf.endpoint)}")
                entries.append("      force-path-style: true")
        else:
            directory = conf.where.directory
            entries += [
                "      type: file",
                f"      path: {_yaml(os.path.join(directory, replica))}",
            ]
        entries.append(f"      sync-interval: {round(conf.interval * 1000)}ms")
    if any("$" in e for e in entries):
        lines.append("# Run litestream with -no-expand-env: a path here contains '$'.")
    lines += ["dbs:", *entries] if entries else ["dbs: []"]
    return "\n".join(lines)


def _yaml(text: str) -> str:
    """A YAML double-quoted scalar (JSON's string syntax is a subset of it)."""
    return json.dumps(text)


# --- output ---------------------------------------------------------------------------------------


def _table(rows: Sequence[Sequence[str]], out: Out) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _iso(when: datetime.datetime, timespec: str = "seconds") -> str:
    return when.astimezone(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _error(message: str) -> str:
    return f"lchat: error: {_one_line(message)}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
