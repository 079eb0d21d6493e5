"""``lchat backup restore``: one database into a file nothing uses, as of now, a txid or a time;
``--all --into DIR``: a box rebuilt from nothing (the registry first, then every database its rows
run without hibernating, then the box's other databases, and the spaces' env files).

Invariants: a database is rebuilt and checked in a private staging directory before it is
installed, never over a file something uses right now, and the ``-wal``/``-shm``/``-journal``
left beside the file it replaced are removed (SQLite would replay a stale WAL into it).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Callable

from attrs import define, field, frozen

from lchat import files, hosts
from lchat.backup import envfiles
from lchat.backup.layout import REGISTRY_NAME, Layout, Stored
from lchat.cli.backup.bucket import describe, opened, pick, stored_in
from lchat.cli.backup.live import Command, dbs_of, in_use, refusal, router_uses, rows_of
from lchat.cli.backup.output import ERRORS, BackupCliError, Out, error_line, iso, one_line
from lchat.config import BackupConfig
from lchat.objstore import NotFound, ObjectStore
from lchat.registry import Registry, RegistryError, Route
from lchat.replica import restore as restore_mod
from lchat.threads import RunInThread

SIDECARS = ("-wal", "-shm", "-journal")  # what SQLite keeps beside a database file


async def restore_one(command: Command) -> int:
    reactor, args, cfg, conf, out, _, run, router = command
    rows = await run(rows_of, cfg.registry)
    why = await run(in_use, args.output, cfg, router, dbs_of(rows, cfg.data_dir))
    if why is not None:
        raise BackupCliError(refusal(args.output, why))
    async with opened(reactor, cfg) as store, _target(run, os.path.dirname(args.output)) as where:
        stored = await stored_in(store, conf)
        found = pick(stored, args.name, args.box, conf, describe(store, conf))
        line = await _restore_to(
            store,
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
                    f"--timestamp {iso(timestamp, 'milliseconds')} is before the first snapshot "
                    f"({iso(first, 'milliseconds')}) "
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
        await run(remove_quietly, staged)
    removed = await run(_remove_sidecars, where, name)
    tail = f"; removed the stale {', '.join(removed)} beside it" if removed else ""
    return (
        f"{output}: txid {result.txid:016x} ({iso(result.timestamp)}), "
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


async def restore_all(command: Command) -> int:
    reactor, args, cfg, conf, out, err, run, router = command
    into: str = args.into
    if router.running and await run(router_uses, cfg, router, into):
        raise BackupCliError(
            f"refusing: a router is running on {into} ({cfg.admin_socket} answers), and a "
            f"restore would replace databases under their writers: stop it first (systemctl "
            f"stop lchat), or restore into another directory"
        )
    here_rows = await run(rows_of, cfg.registry)
    tally = _Tally()
    await run(lambda: os.makedirs(into, mode=0o750, exist_ok=True))
    async with opened(reactor, cfg) as store, _target(run, into) as where:
        stored = await stored_in(store, conf)
        registry = pick(stored, REGISTRY_NAME, args.box, conf, describe(store, conf))
        box = registry.box
        mine = {s.name: s for s in stored if s.box == box}
        owner = await run(_owner_to_hand_to, where.fd)
        out(f"restoring box {box} from {describe(store, conf)} into {into}")
        accept = bool(getattr(args, "accept_unpinned_env", False))
        env = _EnvRestore(store, conf, Layout(conf.prefix, box), where, owner, run, accept)

        async def one(
            found: Stored,
            name: str,
            rows: list[tuple[Route, str]],
            prepare: Callable[[str], object] | None = None,
        ) -> bool:
            target = os.path.join(into, name)
            why = await run(in_use, target, cfg, router, rows)
            if why is not None:
                return tally.failed(out, found.name, refusal(target, why))
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
            except (*ERRORS, OSError) as e:
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

        if not await one(registry, REGISTRY_NAME, dbs_of(here_rows, cfg.data_dir), sanitise):
            raise BackupCliError(
                f"the registry could not be restored, so nothing else was: {tally.errors[0]}"
            )
        for line in checked:
            out(f"  note: {line}")
        checks = dbs_of(rows, into) + dbs_of(here_rows, cfg.data_dir)
        instance_names = set()
        for route in rows:
            if route.kind != "instance":
                continue
            name = os.path.basename(hosts.db_path(into, route.host))
            instance_names.add(name)
            if route.hibernate:
                tally.skipped += 1
                out(f"{route.host}: hibernating, it wakes from the hibernation bucket")
            elif (found := mine.get(name)) is None:
                tally.failed(out, name, f"{route.host} has no backup under {box}/ (never ran?)")
                continue
            elif not await one(found, name, checks):
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
        err(error_line(f"{len(tally.errors)} of {total} databases were not restored (see above)"))
        return 1
    return 0


@define
class _EnvRestore:
    """Bringing back the spaces' env files of one box (sealed with LCHAT_BACKUP_KEY, pinned by
    the box's manifest: lchat.backup.envfiles)."""

    _store: ObjectStore
    _conf: BackupConfig
    _place: Layout
    _where: _Where
    _owner: tuple[int, int] | None
    _run: RunInThread
    _accept_unpinned: bool
    _manifest: envfiles.Manifest | None = field(init=False, default=None)
    _manifest_read: bool = field(init=False, default=False)

    async def _read_manifest(self) -> list[str]:
        """The box's manifest, read once; the lines to print about it."""
        if self._manifest_read or not self._conf.env_key:
            return []
        self._manifest_read = True
        key = envfiles.manifest_key(self._place.box_path())
        refused = "" if self._accept_unpinned else " not restored without --accept-unpinned-env"
        try:
            blob = (await self._store.get(key)).body
        except NotFound:
            return [
                f"  note: box {self._place.box} has no env manifest in the backup: its sealed env "
                f"files are not pinned to their newest versions{refused and ' and are' + refused}"
            ]
        try:
            self._manifest = envfiles.unseal_manifest(self._place, blob, self._conf.env_key)
        except envfiles.SealError as e:
            return [
                f"  note: {e}: the box's env files are not pinned{refused and ' and' + refused}"
            ]
        sealed = envfiles.when(self._manifest.generation)
        return [
            f"  env files: the box's manifest was sealed at {sealed} (a file older than it names "
            f"is refused as rolled back)"
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


@define
class _Tally:
    restored: int = 0
    skipped: int = 0
    errors: list[str] = field(factory=list)

    def failed(self, out: Out, name: str, why: str) -> bool:
        self.errors.append(why)
        out(f"{name}: FAILED: {one_line(why)}")
        return False


def _owner_to_hand_to(dir_fd: int) -> tuple[int, int] | None:
    """Blocking. Who restored files should belong to: the owner of the data dir they go into
    (the router's user), when we are root and it is someone else; else None (leave them)."""
    if os.geteuid() != 0:
        return None
    st = os.fstat(dir_fd)
    return None if (st.st_uid, st.st_gid) == (0, 0) else (st.st_uid, st.st_gid)


def remove_quietly(path: str) -> None:
    for p in (path, *(path + s for s in SIDECARS)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
