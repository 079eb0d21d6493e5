"""The mesh's route writes on this box, in a worker thread: a peer's route upserted (its env file,
then its row), a peer's tombstone applied, and the digest and listing peers read
(docs/mesh.md, "What travels"). :class:`lchat.mesh.api.MeshAPI` serves them over HTTP and
:class:`lchat.mesh.sync.SettingsSync` applies what it fetched through the same methods.

Invariants: every write holds :attr:`RouteStore.lock` and (an upsert) one registry transaction
(:meth:`lchat.registry.Registry.transaction`) from its check to its row, so a write, the settings
sweep and a local change by another process (``lchat env``) never see each other half done; only a replicated row (or none) is written, a
space this box runs itself never (409 ``conflict``); settings are written only when newer
(:func:`lchat.mesh.settings.newer`), else the answer is ``stale`` and only a ``next_due`` lands;
a payload this box could not wake is refused (422 ``unrunnable``); an env file written before a
row write that fails is put back (and ``<host>-bot.env``, written or removed with it: a payload
without ``bot_env`` says the space has no bot sidecar); a tombstone deletes the replicated files only, never member
data (``<host>.db`` and its ``-wal``/``-shm``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Sequence
from typing import Any

from attrs import evolve
from prometheus_client import Counter
from twisted.logger import Logger

from lchat import builds, envfile, hosts
from lchat.config import ConfigError, MeshConfig, read_env_file
from lchat.files import write_atomic
from lchat.mesh import settings
from lchat.mesh.client import read_bot_env, read_route_env, replicable_env, route_payload
from lchat.mesh.route_payload import RoutePayload, in_scope
from lchat.registry import Registry, Route, Stale, Tombstoned, Transaction

_log = Logger(namespace="lchat.mesh.api")
_region_merges = Counter(
    "lchat_mesh_home_region_merges_total",
    "A peer's copy whose home region and other settings were merged apart (lchat.mesh.settings."
    "region_newer), by result: taken (its region alone, newer than this box's), kept (this box's "
    "region, newer than the copy's other settings carried)",
    ["result"],
)

_edits_overwritten = Counter(
    "lchat_mesh_local_edits_overwritten_total",
    "Env files edited on this box by hand and not yet versioned (the sync notices an edit every"
    " LCHAT_MESH_SYNC) that a peer's newer settings replaced",
)

Result = tuple[int, dict[str, Any], str]  # status, JSON body, the outcome counted


class Refused(Exception):
    """A write this box refuses: the status, the message and the outcome counted."""

    def __init__(self, code: int, message: str, outcome: str) -> None:
        super().__init__(message)
        self.code = code
        self.outcome = outcome


class RouteStore:
    """The writes and reads (the module docstring); every method blocks (call it in a thread)."""

    def __init__(
        self,
        registry: Registry,
        mesh: MeshConfig,
        data_dir: str,
        run_dir: str,
        space_command: Sequence[str],
    ) -> None:
        self._registry = registry
        self._mesh = mesh
        self._data_dir = data_dir
        self._run_dir = run_dir
        self._space_command = space_command
        self.lock = threading.Lock()  # held by every write: the env file, then the row

    def route(self, payload: RoutePayload) -> Route:
        """The replicated row ``payload`` describes: hibernating here, or (``lives_at``) run
        always-on elsewhere (such a payload never carries ``next_due``: parse_payload)."""
        host = payload.host
        return Route(
            host=host,
            kind="instance",
            socket=hosts.socket_path(self._run_dir, host, isolated=hosts.isolated(self._data_dir)),
            db_path=hosts.db_path(self._data_dir, host),
            status="ready",
            hibernate=not payload.lives_at,
            version=payload.version,
            replication=payload.replication,  # type: ignore[arg-type]  # checked in parse_payload
            home_region=payload.home_region,
            next_due=payload.next_due or 0,
            lives_at=payload.lives_at,
        )

    def _edited_here(self, route: Route) -> bool:
        """``route``'s env files on disk differ from the settings its hash versions: an edit by
        hand the sync has not noticed yet (False for a row without a hash, from before
        generations; True for a file that cannot be read)."""
        if not route.settings_hash:
            return False
        try:
            env = read_route_env(self._data_dir, route.host)
            bot_env = read_bot_env(self._data_dir, route.host)
        except ConfigError:
            return True
        return settings.route_hash(route, env, bot_env) != route.settings_hash

    def upsert(self, payload: RoutePayload, from_owner: bool = False) -> Result:
        """Only over no row or a replicated one (a space this box runs itself is never
        hijacked), and only newer settings (lchat.mesh.settings.newer; else :meth:`_stale`). The
        "lives elsewhere" shape (``lives_at``) leaves the env file as it is: this box never runs
        the space, and a tombstone removes it."""
        host = payload.host
        digest = settings.settings_hash(
            replication=payload.replication,
            home_region=payload.home_region,
            version=payload.version,
            lives_at=payload.lives_at,
            env={} if payload.lives_at else payload.env,
            bot_env=None if payload.lives_at else payload.bot_env,
        )
        route = evolve(
            self.route(payload),
            settings_gen=payload.gen or 0,
            settings_hash=digest,
            region_gen=payload.region_gen or 0,
        )

        def accept(existing: Route) -> bool:
            return settings.newer(existing, payload.gen, digest, from_owner=from_owner)

        # A row this box could not wake is worse than none: its first wake here would fail
        # (503 spawn) long after the create that sent it looked fine. Refused loudly instead.
        unrunnable = None if payload.lives_at else _unrunnable(self._space_command, host)
        if unrunnable is not None:
            _log.error(
                "mesh: route {host} refused: this box cannot run it ({why}); give it a default "
                "build (`lchat deploy <version> --all`) or set LCHAT_SPACE_COMMAND to a command "
                "that runs any host (docs/mesh.md, The space command), then catch up with "
                "`lchat mesh-seed`",
                host=host,
                why=unrunnable,
            )
            raise Refused(
                422,
                f"this box cannot run {host}: {unrunnable} (its LCHAT_SPACE_COMMAND must run any "
                f"mesh host: docs/mesh.md, The space command)",
                "unrunnable",
            )
        # The row's check, its env files and the row itself in one registry transaction: a local
        # change (``lchat env``, another process) takes the same one, so neither lands between
        # the other's file and row (an owner's older env over the edit, or the edit under the
        # older copy's generation). Env files written are put back when the transaction does not
        # commit (a refusal, a failed write, or the commit itself).
        written: list[tuple[str, bytes | None]] = []  # (path, its bytes before): to put back
        edited = False  # the env files held an edit not yet versioned, which this copy replaces
        try:
            with self.lock, self._registry.transaction() as txn:
                existing = txn.get(host)
                if existing is not None and not existing.replicated:
                    raise conflict(host, existing)
                if existing is not None:
                    whole = accept(existing)
                    region = settings.region_newer(existing, payload.region_gen, whole)
                    if not whole:
                        if region:
                            return self._region_only(txn, payload, existing)
                        return self._stale(txn, payload, existing)
                    if not region:
                        route = self._keep_region(payload, route, existing)
                if payload.lives_at:
                    _, created = txn.upsert_replicated(route, accept=accept)
                else:
                    env_file = hosts.env_path(self._data_dir, host)
                    bot_file = hosts.bot_env_path(self._data_dir, host)
                    edited = existing is not None and self._edited_here(existing)
                    written = [(env_file, _read_private(env_file))]
                    written.append((bot_file, _read_private(bot_file)))
                    envfile.write_env(env_file, payload.env)
                    if payload.bot_env:
                        envfile.write_env(bot_file, payload.bot_env)
                    elif written[1][1] is not None:
                        os.unlink(bot_file)  # the sender's space has no bot sidecar now
                    _, created = txn.upsert_replicated(
                        route, next_due=payload.next_due is not None, accept=accept
                    )
        except Tombstoned as e:  # removed here after the settings it carries (env put back)
            _put_back_all(written)
            _log.info(
                "mesh: route {host} from a peer not created: it was removed (settings gen "
                "{mine}, the payload's {theirs})",
                host=host,
                mine=e.tombstone.gen,
                theirs=payload.gen or "none",
            )
            return 200, {"host": host, "result": "stale", "gen": e.tombstone.gen}, "stale"
        except BaseException:
            _put_back_all(written)
            raise
        result = "created" if created else "updated"
        if edited:
            _edits_overwritten.inc()
            _log.warn(
                "mesh: route {host}: its env file was edited on this box (not yet noticed by the "
                "settings sync, so never versioned or pushed) and a peer's newer settings (gen "
                "{gen}) replaced the edit; make it again with `lchat env` (docs/mesh.md, "
                "Anti-entropy)",
                host=host,
                gen=payload.gen or "none",
            )
        if payload.lives_at:
            _log.info(
                "mesh: route {host} {result} by a peer: it lives at {lives_at} (always-on there); "
                "this box forwards its requests there and never wakes it",
                host=host,
                result=result,
                lives_at=payload.lives_at,
            )
        else:
            _log.info(
                "mesh: route {host} {result} by a peer ({replication}, home region {region}, "
                "{n} env values{bot}{due}, settings gen {gen})",
                host=host,
                result=result,
                gen=payload.gen or "none",
                replication=payload.replication,
                region=payload.home_region or "-",
                n=len(payload.env),
                bot=f", {len(payload.bot_env)} bot sidecar env values" if payload.bot_env else "",
                due="" if payload.next_due is None else f", next due {payload.next_due or 'none'}",
                next_due=payload.next_due,
            )
        return (201 if created else 200), {"host": host, "result": result}, result

    def _keep_region(self, payload: RoutePayload, route: Route, existing: Route) -> Route:
        """``route`` (the payload's newer settings) with this box's home region and its
        generation, which is newer than the payload's (lchat.mesh.settings.region_newer: the
        sender missed a relocate), hashed as merged."""
        _region_merges.labels("kept").inc()
        _log.info(
            "mesh: route {host} from a peer: its settings (gen {gen}) taken, but not its home "
            "region {theirs} (region gen {theirs_gen}): this box's {mine} is newer (region gen "
            "{mine_gen}); the sender takes it from this box's digest",
            host=payload.host,
            gen=payload.gen or "none",
            theirs=payload.home_region or "-",
            theirs_gen=payload.region_gen,
            mine=existing.home_region or "-",
            mine_gen=existing.region_gen,
        )
        merged = evolve(route, home_region=existing.home_region, region_gen=existing.region_gen)
        return evolve(
            merged, settings_hash=settings.route_hash(merged, payload.env, payload.bot_env)
        )

    def _region_only(self, txn: Transaction, payload: RoutePayload, existing: Route) -> Result:
        """A payload older than this box's row but for its home region, whose generation is
        newer (lchat.mesh.settings.region_newer: this box missed a relocate, then changed
        something else): the region alone is written, and the row's hash becomes the merged
        settings'. A hand edit of the env files not yet swept keeps the row's old hash, so the
        sweep still sees the change (and pushes it with the region). Its ``next_due`` lands as
        :meth:`_stale` takes it. Called inside the write's transaction ``txn``."""
        host = payload.host
        assert payload.region_gen is not None  # (region_newer: a payload without one follows gen)
        merged = evolve(existing, home_region=payload.home_region, region_gen=payload.region_gen)
        if existing.elsewhere:
            env: dict[str, str] = {}
            bot_env: dict[str, str] = {}
        else:
            env = read_route_env(self._data_dir, host)
            bot_env = read_bot_env(self._data_dir, host)
        swept = settings.route_hash(existing, env, bot_env) == existing.settings_hash
        digest = settings.route_hash(merged, env, bot_env) if swept else existing.settings_hash
        changes: dict[str, Any] = {
            "home_region": merged.home_region,
            "region_gen": merged.region_gen,
            "settings_hash": digest,
        }
        due = payload.next_due
        if due is not None and existing.hibernate and existing.next_due != due:
            changes["next_due"] = due
        txn.update(host, **changes)
        _region_merges.labels("taken").inc()
        _log.info(
            "mesh: route {host}: home region {region} from a peer (region gen {theirs}, this box "
            "held {was} at {mine}); the rest of its settings is older (gen {gen}, this box holds "
            "{held}): kept",
            host=host,
            region=payload.home_region or "-",
            theirs=payload.region_gen,
            was=existing.home_region or "-",
            mine=existing.region_gen,
            gen=payload.gen or "none",
            held=existing.settings_gen,
        )
        return 200, {"host": host, "result": "updated"}, "region"

    def _stale(self, txn: Transaction, payload: RoutePayload, existing: Route) -> Result:
        """A payload older than this box's row (lchat.mesh.settings.newer): its settings are not
        written. Its ``next_due`` still is: a due time is no setting, and the box that slept the
        space knows it best (lchat.mesh.due). Called inside the write's transaction ``txn``."""
        host = payload.host
        due = payload.next_due
        if due is not None and existing.hibernate and existing.next_due != due:
            txn.update(host, next_due=due)
        _log.info(
            "mesh: route {host} from a peer is stale (settings gen {theirs}, this box holds "
            "{mine}): kept this box's settings{due}",
            host=host,
            theirs=payload.gen or "none",
            mine=existing.settings_gen,
            due="" if due is None else f" (its next due {due or 'none'} taken)",
        )
        return 200, {"host": host, "result": "stale", "gen": existing.settings_gen}, "stale"

    def delete(self, host: str, gen: int | None = None) -> Result:
        """A peer's tombstone of ``host`` (``gen``: its generation; None from an older peer):
        the row and its replicated files go, this box keeps a tombstone (lchat.registry). A row
        newer than ``gen`` (added again since) stays: ``"result": "stale"``. Over no row, a
        tombstone with a generation is kept all the same (a third box's older copy must not
        create the host here)."""
        with self.lock:
            existing = self._registry.get(host)
            if existing is None:
                if gen is not None and in_scope(self._mesh, host, ""):
                    self._registry.record_tombstone(host, gen, "")
                return 200, {"host": host, "deleted": False}, "absent"
            if not existing.replicated:
                raise conflict(host, existing)
            if not in_scope(self._mesh, host, existing.home_region):
                raise Refused(400, f"{host} is not in this box's mesh scope", "invalid")
            try:
                deleted = self._registry.delete_replicated(host, gen)
            except Stale as e:
                _log.info(
                    "mesh: route {host}: a peer's tombstone (gen {theirs}) is older than this "
                    "box's row (gen {mine}): kept",
                    host=host,
                    theirs=gen,
                    mine=e.existing.settings_gen,
                )
                body = {"host": host, "deleted": False, "result": "stale"}
                return 200, {**body, "gen": e.existing.settings_gen}, "stale"
            if deleted is None:
                return 200, {"host": host, "deleted": False}, "absent"
            # The replicated files only: the member data (<host>.db, -wal, -shm) is never touched.
            # After the row's commit, on purpose: a crash between the two leaves an env file no
            # row names (rewritten by the next copy of the host, harmless meanwhile), where the
            # other order could leave a row whose space would start without its env file.
            for path in (
                hosts.env_path(self._data_dir, host),
                hosts.bot_env_path(self._data_dir, host),
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        _log.info("mesh: route {host} deleted by a peer's tombstone (member data kept)", host=host)
        return 200, {"host": host, "deleted": True}, "deleted"

    def digest(self, with_tombstones: bool = False) -> Result:
        """``GET /api/mesh/digest``: ``{host: [settings gen, settings hash]}`` of every in-scope
        replicated row (lchat.mesh.sync compares it with its own); ``?tombstones=1``: ``{"rows":
        that, "tombstones": {host: gen}, "regions": {host: region_gen}}`` (tombstones in scope,
        of hosts with no row here; the home-region generations of the rows that have one: an
        older box reads the first two keys only). An older box
        ignores the query and answers the first shape, which the caller tells apart: no host is
        named ``rows`` (a host has two labels at least)."""
        table = self._registry.load()
        digest = {
            route.host: [route.settings_gen, route.settings_hash]
            for route in table
            if route.replicated and in_scope(self._mesh, route.host, route.home_region)
        }
        if not with_tombstones:
            return 200, digest, "listed"
        buried = {
            host: tomb.gen
            for host, tomb in self._registry.tombstones().items()
            if table.get(host) is None and in_scope(self._mesh, host, tomb.home_region)
        }
        regions = {
            route.host: route.region_gen
            for route in table
            if route.host in digest and route.region_gen > 0
        }
        return 200, {"rows": digest, "tombstones": buried, "regions": regions}, "listed"

    def listing(self, only: str = "") -> Result:
        """Every in-scope replicated row as a payload; ``only``: that host's alone (``GET
        /api/mesh/routes?host=``: an empty list when this box holds none)."""
        routes = []
        table = self._registry.load()
        for route in table if not only else [r for r in [table.get(only)] if r is not None]:
            if not route.replicated or not in_scope(self._mesh, route.host, route.home_region):
                continue
            if route.elsewhere:
                routes.append(route_payload(route, {}))  # never run here: no env values
                continue
            try:
                env = replicable_env(read_env_file(hosts.env_path(self._data_dir, route.host)))
                bot_env = read_bot_env(self._data_dir, route.host)
            except (ConfigError, hosts.InvalidHost) as e:
                _log.warn("mesh: listing {host} without env values: {e}", host=route.host, e=e)
                env, bot_env = {}, {}
            routes.append(route_payload(route, env, bot_env=bot_env))
        return 200, {"routes": routes}, "listed"


def _unrunnable(space_command: Sequence[str], host: str) -> str | None:
    """Why the space command, ``{host}`` filled in, cannot run here, or None. Blocking (a stat
    or a PATH search): called in a worker thread."""
    argv = builds.space_argv(space_command, host)
    program = argv[0] if argv else ""
    if not program:
        return "LCHAT_SPACE_COMMAND is empty"
    if "/" in program:
        if not os.path.isfile(program):
            return f"{program} does not exist"
        if not os.access(program, os.X_OK):
            return f"{program} is not executable"
        return None
    if shutil.which(program) is None:
        return f"{program} is not on the router's PATH"
    return None


def conflict(host: str, existing: Route) -> Refused:
    what = "a service" if existing.kind != "instance" else "a space that does not hibernate"
    return Refused(409, f"{host} is {what} on this box: a peer may not change it", "conflict")


def _read_private(path: str) -> bytes | None:
    """The current bytes of ``path`` (to put back if the row write fails); None when absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _put_back_all(written: list[tuple[str, bytes | None]]) -> None:
    for path, previous in written:
        _put_back(path, previous)


def _put_back(path: str, previous: bytes | None) -> None:
    try:
        if previous is None:
            with contextlib.suppress(FileNotFoundError):  # (a bot env neither had nor written)
                os.unlink(path)
        else:
            write_atomic(path, previous, envfile.MODE)
    except OSError as e:
        _log.error("mesh: could not put {path} back after a failed write: {e}", path=path, e=e)
