"""Which databases the router backs up: the rule in one place, for the service and the CLI.

- the registry (always, stored as ``registry.db``);
- every *instance* row that is not hibernating (systemd or builtin), its ``<host>.db`` (or the
  row's ``db_path``) — unless the activator holds the host right now (it replicates it itself,
  from the start of a wake to the end of its stand-down);
- every file matching ``LCHAT_BACKUP_EXTRA``'s globs under the data dir that is an SQLite
  database (the default ``*.db``: every top-level database of the box, ``home.db``, ``push.db``,
  ``cloud.db`` …; ``none`` drops it), except:

  - any instance's database (a hibernating host's is the activator's, never ours);
  - a file named as a space's database (``<host>.db``, ``<host>`` a space name: two labels at
    least, so no box file such as ``home.db`` is one) that is not its row's database: a removed
    space's leftover cache (no row), or a copy its row no longer names (a relayout's or a
    re-pointed ``db_path``'s leftover). It is stale: the space's data is its row's file (or the
    hibernation bucket's), and a backup of the leftover under the space's name would be mistaken
    for it at a restore;
  - a copy the activator moved aside (``<db>.stale-<stamp>``, ``<db>.lease-lost-<stamp>``): a
    diverged or outdated copy kept for an operator, stale by definition.

Whatever the rule above, no database an external Litestream's config lists
(``LCHAT_BACKUP_CONFIG``): its replicator backs it up, and two replicators on one database
corrupt each other. The left-out matches and those are :attr:`Choice.skipped`, each with why
(``GET /status``, ``lchat backup litestream-config``).

A database that does not exist yet (a space that never started) is picked up by a later scan.
The invariant this module keeps for :mod:`lchat.backup.service`: a hibernating host's database is
never chosen, so the two replicators of one database cannot both run.
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Container, Iterable

from attrs import frozen

from lchat import hosts
from lchat.backup.layout import REGISTRY_NAME, is_name
from lchat.hibernation.localdb import is_moved_aside
from lchat.registry import Route

SQLITE_HEADER = b"SQLite format 3\x00"


@frozen
class Chosen:
    """One database to back up."""

    name: str  # its name in the layout
    path: str  # absolute
    why: str  # "registry", "instance" or "extra"
    host: str = ""  # the instance's host ("" otherwise)


@frozen
class Choice:
    """What :func:`choose` decided."""

    chosen: dict[str, Chosen]  # by name in the layout
    problems: list[str]  # worth an error line: a name two databases share, a file not nameable
    skipped: dict[str, str]  # path -> why a database a glob matched is not backed up (stale)


def space_named(file_name: str) -> str | None:
    """The host whose database ``file_name`` is named as (``<host>.db``, ``<host>`` a space
    name), else None. Space names have two labels at least (lchat.hosts), so ``home.db``,
    ``push.db`` or ``registry.db`` are never one."""
    if not file_name.endswith(".db"):
        return None
    host = file_name[: -len(".db")]
    return host if hosts.is_normal(host) else None


def instance_db(route: Route, data_dir: str) -> str:
    """The database file of an instance row (the activator's and the units' rule)."""
    return os.path.abspath(route.database(data_dir))


def candidates(routes: Iterable[Route], registry: str, data_dir: str) -> list[str]:
    """Every path the rule could choose from the rows alone (checked for existence in a thread)."""
    paths = [os.path.abspath(registry)]
    paths += [instance_db(r, data_dir) for r in routes if r.kind == "instance"]
    return paths


def scan(
    data_dir: str, patterns: Iterable[str], paths: Iterable[str], open_here: Iterable[str] = ()
) -> tuple[set[str], list[str]]:
    """Blocking (run it in a thread): which of ``paths`` exist now, and the databases
    ``patterns`` (globs under ``data_dir``) match, absolute and sorted.

    Only a ``stat`` for ``paths`` and ``open_here`` (databases this process may hold open in
    SQLite: the registry, every instance's, every one a replicator here has open, every one the
    activator took). Reading a file's header means opening and closing a descriptor of it, and
    POSIX drops *every* lock this process holds on a file when any descriptor of it closes: a
    replicator's read transaction would silently vanish, and the space's last close would
    checkpoint and delete the WAL under it. So a glob match gets its header read only if it has
    a database's name (never a ``-wal``/``-shm``/``-journal``, whose locks SQLite holds too) and
    is not one of those files under another name (same device and inode: a hard link, or a file
    renamed while open).
    """
    known = {os.path.abspath(p) for p in paths} | {os.path.abspath(p) for p in open_here}
    present = {p for p in (os.path.abspath(p) for p in paths) if os.path.isfile(p)}
    protected = set()
    for path in known:
        try:
            st = os.stat(path)
        except OSError:
            continue
        protected.add((st.st_dev, st.st_ino))
    extra: set[str] = set()
    for pattern in patterns:
        for match in glob.glob(os.path.join(data_dir, pattern)):
            match = os.path.abspath(match)
            if not is_name(os.path.basename(match)):
                continue
            try:
                st = os.stat(match)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if match in known:
                extra.add(match)  # a database, and perhaps open here: no header read
            elif (st.st_dev, st.st_ino) not in protected and is_sqlite(match):
                extra.add(match)
    return present, sorted(extra)


def is_sqlite(path: str) -> bool:
    """A regular file that starts with SQLite's header (not a -wal, a lock or a directory).
    Opens the file: never for a database this process has open (see :func:`scan`)."""
    try:
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            return f.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:
        return False


def choose(
    routes: Iterable[Route],
    *,
    registry: str,
    data_dir: str,
    present: Container[str],
    extra: Iterable[str],
    claimed: Container[str] = (),
    excluded: Container[str] = (),
    external: Container[str] = (),
) -> Choice:
    """The databases to back up now, by name, the problems worth a log line (a name two
    databases would share, a file that cannot be named), and the glob matches left out as stale
    (the module docstring). ``present``: the paths that exist; ``claimed``: the hosts the
    activator holds; ``excluded``: the database paths it took (never chosen, whichever rule would
    choose them: its row may be gone or re-pointed by now); ``external``: the paths an external
    Litestream's config lists (``LCHAT_BACKUP_CONFIG``: skipped, whichever rule would choose
    them: that replicator backs them up, and two on one database corrupt each other)."""
    chosen: dict[str, Chosen] = {}
    problems: list[str] = []
    skipped: dict[str, str] = {}
    registry = os.path.abspath(registry)
    every = {r.host: r for r in routes}
    rows = {h: r for h, r in every.items() if r.kind == "instance"}
    owned = {instance_db(r, data_dir) for r in rows.values()} | {registry}

    def add(item: Chosen) -> None:
        if item.path in excluded:
            return
        if os.path.normpath(item.path) in external:
            skipped[item.path] = (
                "LCHAT_BACKUP_CONFIG lists it: an external Litestream backs it up (two "
                "replicators on one database corrupt each other)"
            )
            return
        other = chosen.get(item.name)
        if other is not None:
            problems.append(
                f"{item.path} is not backed up: {other.path} has the same name {item.name} in "
                f"the backup layout"
            )
            return
        chosen[item.name] = item

    if registry in present:
        add(Chosen(REGISTRY_NAME, registry, "registry"))
    for route in sorted(rows.values(), key=lambda r: r.host):
        path = instance_db(route, data_dir)
        # A lives-elsewhere row is a peer's always-on space: a file at its path is not its data.
        if route.hibernate or route.elsewhere or route.host in claimed or path not in present:
            continue
        name = os.path.basename(path)
        if not is_name(name) or name == REGISTRY_NAME:
            problems.append(f"{route.host}: its database {path} cannot be named in the backup")
            continue
        add(Chosen(name, path, "instance", route.host))
    for path in extra:
        path = os.path.abspath(path)
        if path in owned:
            continue  # an instance's (ours above, or the activator's) or the registry
        name = os.path.basename(path)
        why = _stale(name, every, data_dir)
        if why:
            skipped[path] = why
            continue
        if not is_name(name) or name == REGISTRY_NAME:
            problems.append(f"LCHAT_BACKUP_EXTRA: {path} cannot be named in the backup")
            continue
        add(Chosen(name, path, "extra"))
    return Choice(chosen, problems, skipped)


def _stale(name: str, rows: dict[str, Route], data_dir: str) -> str:
    """Why a glob's match named ``name`` (not any row's database) is stale, or "". A service
    row's host names no space: a database named after it is the service's, and current."""
    if is_moved_aside(name):
        return "a copy the activator moved aside (outdated or diverged): never backed up"
    host = space_named(name)
    if host is None:
        return ""
    route = rows.get(host)
    if route is not None and route.kind != "instance":
        return ""
    if route is None:
        return f"named as {host}'s database, but {host} has no row here: a removed space's leftover"
    return (
        f"named as {host}'s database, but its row's database is {instance_db(route, data_dir)}: "
        f"a leftover copy"
    )
