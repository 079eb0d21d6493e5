"""Where backups live in the bucket, and what a LIST of them says.

Layout (docs/backup.md): one Litestream replica per database at
``<LCHAT_BACKUP_PREFIX>/<box>/<database name>/`` — the same ``<level>/<min>-<max>.ltx`` files a
stock ``litestream`` writes under a replica path, so ``litestream restore`` reads each one. The
database name is its file name (``registry.db``, ``<host>.db``, ``home.db``): a box rebuilt from
nothing finds its databases by name, and ``lchat backup ls`` lists them across every box under the
prefix. The box segment (``LCHAT_BACKUP_BOX``, default the host name) keeps two boxes that happen
to hold a database of the same name apart. Nothing else is written under the prefix except the
boot probe, under ``.lchat/`` (a name no box segment can take).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable

from attrs import frozen

from lchat.objstore import ObjectInfo
from lchat.replica.restore import SNAPSHOT_LEVEL, ReplicaFile, replica_files

# The registry is stored under this name whatever its file is called (LCHAT_REGISTRY), so that a
# restore of a whole box knows which database tells it the rest.
REGISTRY_NAME = "registry.db"
PROBE_DIR = ".lchat"  # the boot probe's objects: not a box (a box name starts alphanumeric)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


class BadName(ValueError):
    """Not a database name (a file name of letters, digits, ``.``, ``_`` and ``-``)."""


def check_name(name: str) -> str:
    """``name`` if it can be a database's name in the layout (a plain file name), else
    :class:`BadName` saying why."""
    if not _NAME.fullmatch(name) or name.endswith((".", "-wal", "-shm", "-journal")):
        raise BadName(
            f"{name!r} is not a database name: a file name of letters, digits, '.', '_' and "
            f"'-' (such as registry.db or chat.example.com.db), not a path"
        )
    return name


def is_name(name: str) -> bool:
    try:
        check_name(name)
    except BadName:
        return False
    return True


@frozen
class Layout:
    """The keys of one box's backups."""

    prefix: str  # LCHAT_BACKUP_PREFIX, without slashes at the ends ("" = the bucket's root)
    box: str

    def replica_path(self, name: str) -> str:
        """The replica path of database ``name`` (no trailing slash), as Litestream's ``path:``."""
        return "/".join(p for p in (self.prefix, self.box, check_name(name)) if p)

    def box_path(self) -> str:
        """This box's part of the layout, with a trailing slash."""
        return "/".join(p for p in (self.prefix, self.box) if p) + "/"

    def probe_key(self) -> str:
        return "/".join(p for p in (self.prefix, PROBE_DIR, "probe", self.box) if p)

    def root(self) -> str:
        """What a LIST of every box's backups asks for."""
        return self.prefix + "/" if self.prefix else ""


@frozen
class Stored:
    """One database's replica as a LIST shows it."""

    box: str
    name: str
    path: str  # the replica path (no trailing slash)
    files: tuple[ReplicaFile, ...]

    @property
    def txid(self) -> int:
        """The newest txid there."""
        return max((f.max_txid for f in self.files), default=0)

    @property
    def size(self) -> int:
        return sum(f.info.size for f in self.files)

    @property
    def newest(self) -> datetime.datetime | None:
        """When the newest file was written (Litestream's timestamp, else Last-Modified)."""
        return max((f.created_at for f in self.files), default=None)

    @property
    def last_snapshot(self) -> datetime.datetime | None:
        return max((f.created_at for f in self.files if f.level == SNAPSHOT_LEVEL), default=None)


def catalogue(prefix: str, listing: Iterable[ObjectInfo]) -> list[Stored]:
    """Every database replica in a LIST of ``Layout(prefix, *).root()``, by (name, box). Keys that
    are not ``<box>/<name>/<level>/<file>.ltx`` under the prefix (the probe, strays) are skipped."""
    root = prefix + "/" if prefix else ""
    groups: dict[tuple[str, str], list[ObjectInfo]] = {}
    for info in listing:
        if not info.key.startswith(root):
            continue
        parts = info.key[len(root) :].split("/")
        if len(parts) != 4 or parts[0] == PROBE_DIR or not is_name(parts[1]):
            continue
        groups.setdefault((parts[0], parts[1]), []).append(info)
    found = []
    for (box, name), infos in groups.items():
        files = replica_files(infos)
        if files:
            path = "/".join(p for p in (prefix, box, name) if p)
            found.append(Stored(box, name, path, tuple(files)))
    found.sort(key=lambda s: (s.name, s.box))
    return found
