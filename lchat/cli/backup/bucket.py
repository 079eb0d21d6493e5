"""The backup bucket (``LCHAT_BACKUP_*``), to read: opened by the one opener, its catalogue,
which copy of a database to restore, and whether its versioning is on."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import cast

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from lchat.backup.layout import Layout, Stored, catalogue
from lchat.buckets import open_bucket
from lchat.cli.backup.output import BackupCliError, one_line
from lchat.config import BackupConfig, BoxConfig
from lchat.objstore import ObjectStore, VersionedObjectStore
from lchat.reactors import Reactor

VERSIONING_TIMEOUT = 5.0  # the one GetBucketVersioning of `ls`


@contextlib.asynccontextmanager
async def opened(reactor: Reactor, cfg: BoxConfig) -> AsyncIterator[ObjectStore]:
    """The bucket of ``LCHAT_BACKUP_*``, to read (closed after): a ``file:`` bucket must exist (a
    backup that is not there is an error, never an empty bucket)."""
    conf = cfg.backup
    assert conf is not None, "the caller checks that the backup is configured"
    store = await open_bucket(reactor, cfg, conf.where, what="LCHAT_BACKUP_BUCKET", must_exist=True)
    try:
        yield store
    finally:
        await store.close()


async def stored_in(store: ObjectStore, conf: BackupConfig) -> list[Stored]:
    """Every box's databases: one LIST of the layout's root."""
    return catalogue(conf.prefix, await store.list(Layout(conf.prefix, conf.box).root()))


def describe(store: ObjectStore, conf: BackupConfig) -> str:
    return f"{store.describe()} under {conf.prefix + '/' if conf.prefix else 'its root'}"


def pick(
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


async def versioning_note(
    reactor: IReactorTime, store: ObjectStore, conf: BackupConfig
) -> str | None:
    """The line ``ls`` ends with when the bucket's versioning is not known to be on (the
    ransomware backstop, docs/backup.md), else None. Never raises."""
    if conf.where.is_file:
        return (
            f"lchat: versioning does not apply to a file: bucket ({conf.bucket}): keep "
            f"another copy of that directory elsewhere"
        )
    try:
        asking = Deferred.fromCoroutine(cast(VersionedObjectStore, store).versioning())
        asking.addTimeout(VERSIONING_TIMEOUT, reactor)
        status = await asking
    except Exception as e:
        why = (
            f"no answer within {VERSIONING_TIMEOUT:g}s"
            if isinstance(e, defer.TimeoutError)
            else one_line(str(e)) or type(e).__name__
        )
        return (
            f"lchat: warning: cannot tell whether versioning is on for bucket {conf.bucket} "
            f"({why}): docs/backup.md says how to turn it on with a 14-day noncurrent-version "
            f"expiry"
        )
    if status == "Enabled":
        return None
    state = "suspended" if status == "Suspended" else "off"
    return (
        f"lchat: warning: versioning is {state} on bucket {conf.bucket}: an overwrite or a "
        f"delete there is final. Turn it on with a 14-day noncurrent-version expiry "
        f"(docs/backup.md)"
    )
