"""``lchat backup ls|restore|drill|replicate|litestream-config``: the operator's side of the
fleet backup (one submodule per action, each saying what it does).

The bucket is the router's backup bucket (``LCHAT_BACKUP_*``, read from its env file like every
command; docs/backup.md), laid out as :mod:`lchat.backup.layout` says. The running router is asked
``GET /status`` on its admin socket for what it backs up right now (its ``backup`` section); it
may be down, and then every command still works, without the live columns.

Invariants: nothing is ever written to the bucket; a restore installs nothing over a database
something uses (:mod:`lchat.cli.backup.restore`). The commands are synchronous: :func:`run` runs
the async work on a reactor of its own (:func:`lchat.cli.runner.run`); :func:`execute` is the
same on a reactor that is already running.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from collections.abc import Callable

from lchat.backup.layout import check_name
from lchat.cli import replica as replica_cli
from lchat.cli import runner
from lchat.cli.backup.drill import drill
from lchat.cli.backup.litestream import litestream_config
from lchat.cli.backup.live import Command, ask_router
from lchat.cli.backup.ls import ls
from lchat.cli.backup.output import ERRORS, BackupCliError, Out, error_line, iso
from lchat.cli.backup.replicate import replicate, target
from lchat.cli.backup.restore import restore_all, restore_one
from lchat.config import BackupConfig, BoxConfig
from lchat.objstore import UTC
from lchat.reactors import Reactor
from lchat.threads import thread_runner

SUMMARY = "list, restore or drill the fleet backup (LCHAT_BACKUP_BUCKET)"
_BOX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # LCHAT_BACKUP_BOX's rule
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
now: the registry, every instance that does not hibernate, and LCHAT_BACKUP_EXTRA (default:
every top-level *.db but a space's stale copies; `none`: only the globs given), each to its
replica path in the backup layout. Never run it beside the router's own backup: two replicators
on one database corrupt each other. With the router's backup off, give the bucket to this
command alone: LCHAT_BACKUP_BUCKET=my-bucket lchat backup litestream-config.
"""

REPLICATE_HELP = """\
Replicate one database to the backup bucket in the foreground, until SIGTERM: the router's
replicator (same replica path, same LCHAT_BACKUP_INTERVAL), in a process of its own, so that a
database another unit writes keeps shipping while the router is down. The units
lchat-backup@<host> (beside lchat@<host>) and lchat-backup-home (beside lchat-home) run it.

Only one replicator ever runs per database: each holds <data>/.backup/<name>.lock. While the
router holds it this waits, and takes over once the router stops; a router started later leaves
the database to this one, and takes it back once this one stops. SIGTERM: a final sync (at most
30 s), then exit 0, or 1 when the last commits may not be in the backup.
"""

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
        "from this box's running router; warns when the bucket's versioning is off, and when "
        "this box's env files are not in the backup (LCHAT_BACKUP_KEY unset).",
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

    rp = sub.add_parser(
        "replicate",
        help="replicate one database until SIGTERM (the lchat-backup@ units run it)",
        description=REPLICATE_HELP,
        formatter_class=raw,
    )
    common(rp)
    rp.add_argument("db", nargs="?", metavar="DB", help="the database file")
    rp.add_argument(
        "--space", metavar="HOST", help="the space's database (as add-instance puts it)"
    )
    rp.add_argument("--home", action="store_true", help="lchat-home's database (<data>/home.db)")

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
        if args.backup_command == "replicate":
            return replicate(cfg, *target(cfg, args.db, args.space, args.home), args.space)
        return runner.run(lambda r: _execute(r, args, cfg, conf, out, _stderr))
    except ERRORS as e:
        _stderr(error_line(str(e)))
        return 1


async def execute(
    reactor: Reactor, args: argparse.Namespace, cfg: BoxConfig, out: Out, err: Out
) -> int:
    """The command on a running ``reactor``; ``out`` gets stdout's lines, ``err`` stderr's."""
    try:
        conf = _precheck(args, cfg)
    except ERRORS as e:
        err(error_line(str(e)))
        return 1
    return await _execute(reactor, args, cfg, conf, out, err)


async def _execute(
    reactor: Reactor,
    args: argparse.Namespace,
    cfg: BoxConfig,
    conf: BackupConfig,
    out: Out,
    err: Out,
) -> int:
    try:
        action = args.backup_command
        run = thread_runner(reactor)
        if action == "litestream-config":
            out(await run(litestream_config, cfg, conf))
            return 0
        if action == "replicate":
            raise BackupCliError(
                "replicate runs in a process of its own (`lchat backup replicate`)"
            )
        command = Command(reactor, args, cfg, conf, out, err, run, await ask_router(cfg, run, err))
        if action == "ls":
            return await ls(command)
        if action == "drill":
            return await drill(command)
        return await (restore_all if args.all else restore_one)(command)
    except ERRORS as e:
        err(error_line(str(e)))
        return 1
    except OSError as e:
        err(error_line(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)))
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
                f"--timestamp {iso(args.timestamp, 'milliseconds')} is in the future (it is "
                f"{iso(now, 'milliseconds')} here): "
                f"give a time the backup has already passed, or leave it out for the newest state"
            )


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
