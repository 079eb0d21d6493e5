"""``lchat replica ls|restore <host>``: inspect and restore a space's replica in the bucket.

Reads the bucket from the router's settings (``LCHAT_HIBERNATE_*``). ``ls`` costs one LIST;
``restore`` also downloads the files its plan needs and never touches the output path on failure.
The commands are synchronous: each runs its async work on a reactor of its own
(:func:`lchat.cli.runner.run`).
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable

from lchat import hosts
from lchat.buckets import open_bucket
from lchat.cli import runner
from lchat.config import BoxConfig
from lchat.objstore import ObjectStore, ObjectStoreError
from lchat.reactors import Reactor
from lchat.replica import restore as restore_mod
from lchat.threads import RunInThread, thread_runner

SUMMARY = "list or restore a space's replica in the hibernation bucket"


class ReplicaCliError(Exception):
    """A refusal or failure: one ``lchat: error:`` line, exit status 1."""


def add_arguments(
    parser: argparse.ArgumentParser,
    common: Callable[[argparse.ArgumentParser], None] = lambda p: None,
) -> None:
    """``common`` adds the CLI's shared options to each action, so they may follow it too."""
    sub = parser.add_subparsers(dest="replica_command", metavar="<action>", required=True)
    ls = sub.add_parser("ls", help="levels, files, sizes, newest txid and its time (one LIST)")
    ls.add_argument("host", help="the space's hostname")
    common(ls)
    rs = sub.add_parser("restore", help="rebuild the space's database from its replica")
    common(rs)
    rs.add_argument("host", help="the space's hostname")
    rs.add_argument(
        "-o", "--output", metavar="PATH", help="where to write it (default ./<host>.db)"
    )
    target = rs.add_mutually_exclusive_group()
    target.add_argument("--txid", type=txid_type, metavar="N", help="restore up to this txid")
    target.add_argument(
        "--timestamp",
        type=timestamp_type,
        metavar="RFC3339",
        help="restore the last state before this",
    )
    rs.add_argument("--force", action="store_true", help="replace an existing output file")


def txid_type(text: str) -> int:
    try:
        value = int(text, 16) if len(text) == 16 else int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a txid") from None
    if value < 1:
        raise argparse.ArgumentTypeError("a txid is positive")
    return value


def timestamp_type(text: str) -> datetime.datetime:
    try:
        return restore_mod.parse_timestamp(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace, cfg: BoxConfig, out: Callable[[str], None]) -> int:
    host = hosts.normalise(args.host)
    if cfg.hibernate is None:
        raise ReplicaCliError("no hibernation bucket: set LCHAT_HIBERNATE_BUCKET")
    hib = cfg.hibernate
    path = hib.key(host)
    if args.replica_command == "restore":
        args.output = os.path.abspath(args.output or f"{host}.db")
        if os.path.lexists(args.output) and not args.force:
            raise ReplicaCliError(f"{args.output} already exists (use --force to replace it)")

    async def main(reactor: Reactor) -> int:
        store = await open_bucket(reactor, cfg, hib.where)
        try:
            if args.replica_command == "ls":
                return await _ls(store, path, out)
            return await _restore(store, path, host, args, out, thread_runner(reactor))
        finally:
            await store.close()

    try:
        return runner.run(main)
    except (restore_mod.RestoreError, ObjectStoreError) as e:
        raise ReplicaCliError(str(e)) from e


async def _ls(store: ObjectStore, path: str, out: Callable[[str], None]) -> int:
    files = restore_mod.replica_files(await store.list(path + "/"))
    if not files:
        raise ReplicaCliError(f"no replica under {path}/")
    out(f"{'LEVEL':<6}{'MIN TXID':<18}{'MAX TXID':<18}{'SIZE':>12}  CREATED")
    for f in files:
        created = f.created_at.isoformat(timespec="seconds").replace("+00:00", "Z")
        out(f"{f.level:<6}{f.min_txid:016x}  {f.max_txid:016x}  {f.info.size:>12}  {created}")
    newest = max(files, key=lambda f: (f.max_txid, f.created_at))
    by_level = sorted({f.level for f in files})
    total = sum(f.info.size for f in files)
    out(
        f"{len(files)} files, {total} bytes, levels {','.join(map(str, by_level))}; newest txid "
        f"{newest.max_txid:016x} at {newest.created_at.isoformat(timespec='seconds')}"
    )
    return 0


async def _restore(
    store: ObjectStore,
    path: str,
    host: str,
    args: argparse.Namespace,
    out: Callable[[str], None],
    run: RunInThread,
) -> int:
    output = args.output or f"{host}.db"
    result = await restore_mod.restore(
        store,
        path,
        output,
        txid=args.txid,
        timestamp=args.timestamp,
        overwrite=args.force,
        run_in_thread=run,
    )
    out(
        f"restored {host} to {result.path}: txid {result.txid:016x} "
        f"({result.timestamp.isoformat(timespec='seconds')}), {result.pages} pages of "
        f"{result.page_size} bytes, {result.files} files, {result.bytes_downloaded} bytes downloaded"
    )
    return 0
