"""``lchat backup replicate DB|--space HOST|--home``: one database's backup replicator, in the
foreground, until SIGTERM (the ``lchat-backup@<host>`` and ``lchat-backup-home`` units run it;
:mod:`lchat.backup.unit` says what it keeps).

Which file: a path; ``--space HOST``: the space's database where ``add-instance`` puts it
(:func:`lchat.hosts.db_path`, which knows an isolated box's layout); ``--home``: ``<data>/home.db``.
Its name in the backup is the file's name (the registry's is ``registry.db``), as the router names
it, so the replica path and the lock are the router's for that database.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time

from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)

from lchat import hosts
from lchat.backup import litestream_yml
from lchat.backup.layout import REGISTRY_NAME, check_name
from lchat.backup.unit import UnitReplicator
from lchat.buckets import open_bucket
from lchat.cli import runner
from lchat.cli.backup.output import BackupCliError
from lchat.config import BoxConfig
from lchat.reactors import Reactor
from lchat.registry import Registry, RegistryError
from lchat.threads import thread_runner

HOME_DB = "home.db"  # lchat-home's database (docs/home.md)


def hibernates(registry: str, host: str) -> bool:
    """Blocking: does ``host``'s row say it hibernates? (No registry, no row: no.) An unreadable
    registry says no: the unit's ordering (bound to the space's unit) still holds."""
    if not os.path.isfile(registry):
        return False
    try:
        route = Registry(registry, time.time).get(host)
    except (RegistryError, sqlite3.Error):
        return False
    return route is not None and route.hibernate


def target(cfg: BoxConfig, db: str | None, space: str | None, home: bool) -> tuple[str, str]:
    """(path, name in the backup) of what to replicate; BackupCliError when it cannot be one."""
    given = [x for x in (db, space, "--home" if home else None) if x]
    if len(given) != 1:
        raise BackupCliError("replicate takes one of DB (a path), --space HOST or --home")
    if space is not None:
        try:
            path = hosts.db_path(cfg.data_dir, hosts.normalise(space))
        except ValueError as e:
            raise BackupCliError(f"--space {space}: {e}") from e
    elif home:
        path = os.path.join(cfg.data_dir, HOME_DB)
    else:
        assert db is not None
        path = db
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise BackupCliError(f"{path} is a directory, not a database")
    external = cfg.backup.external_config if cfg.backup is not None else ""
    try:
        listed = bool(external) and litestream_yml.tracks(external, path)
    except litestream_yml.BackupConfigError as e:
        raise BackupCliError(str(e)) from e
    if listed:
        raise BackupCliError(
            f"{external} (LCHAT_BACKUP_CONFIG) lists {path}: an external Litestream backs it "
            f"up, and two replicators on one database corrupt each other (drop it there first)"
        )
    if path == os.path.abspath(cfg.registry):
        return path, REGISTRY_NAME
    return path, check_name(os.path.basename(path))


def replicate(cfg: BoxConfig, path: str, name: str, space: str | None = None) -> int:
    """Run until SIGTERM/SIGINT (then the final sync; a second signal cuts it short). Exit
    status 0 when everything committed is in the backup at the end, 1 when not."""
    conf = cfg.backup
    assert conf is not None, "the caller checks that the backup is configured"
    _start_logging()
    holder: list[UnitReplicator] = []
    stop_asked: list[bool] = []

    def on_signal() -> None:
        stop_asked.append(True)
        if holder:
            holder[0].stop()

    async def main(reactor: Reactor) -> bool:
        store = await open_bucket(reactor, cfg, conf.where, what="LCHAT_BACKUP_BUCKET")
        try:
            unit = UnitReplicator(
                reactor,
                store,
                conf,
                data_dir=cfg.data_dir,
                db_path=path,
                name=name,
                run_in_thread=thread_runner(reactor),
                hibernating=(
                    (lambda: hibernates(cfg.registry, hosts.normalise(space))) if space else None
                ),
            )
            holder.append(unit)
            if stop_asked:
                unit.stop()
            return await unit.run()
        finally:
            await store.close()

    return 0 if runner.run(main, on_signal=on_signal) else 1


def _start_logging() -> None:
    """Our lines at info to stderr (the unit's journal); Twisted's own only from warn."""
    predicate = LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)
    predicate.setLogLevelForNamespace("lchat", LogLevel.info)
    observer = FilteringLogObserver(textFileLogObserver(sys.stderr), [predicate])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
