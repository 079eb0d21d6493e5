"""Where space builds live on a box, which build each host runs, and which it last woke on.

::

    <opt>/versions/<version>/space       a build's space server (executable)
    <opt>/versions/<version>/space-bot   its bot sidecar, when the build has one
    <opt>/live/<host>                    -> ../versions/<version>/space
    <opt>/live/<host>-bot                -> ../versions/<version>/space-bot
    <opt>/live/_default                  -> the box's default build (``lchat deploy <v> --all``)
    <data>/woke/<host>.json              the build <host> last woke on (:func:`record`)

``<opt>`` is ``LCHAT_OPT_DIR`` (default ``/opt/lchat``). The router runs ``LCHAT_SPACE_COMMAND``
(default ``/opt/lchat/live/{host}``), so repointing a host's link changes its build: an always-on
space picks it up when restarted, a hibernating one at its next wake. A host without a link of
its own runs the default build (:func:`fall_back_to_default`): a space created on another mesh
box, or replicated here, wakes on this box's default build without a deploy naming it.

Invariants: a version name is a safe path segment (:func:`check_version`); live links are
relative, so a tree copied or mounted elsewhere keeps working; a host whose link is missing or
points outside ``versions/`` has no version (``None``), never a guessed one.

The activator records each wake just before the exec (``lchat.hibernation.lifecycle``), the
command's first word resolved to the file it really is; ``lchat rollback`` reads it
(:func:`read_wake`): a space that woke on the build being rolled back from may have run its
(additive) migrations, so going back is refused (docs/operations.md, "Deploys and rollbacks").
One small file per host, written atomically; recording never fails a wake (an error is logged).

The *build floor* travels with the space, in the bucket: ``<prefix>/<host>/build.json``
(:class:`BuildRecord`: the newest build the space has run, on any box, when and where it first
ran it). A wake never runs a build older than it (``lchat.hibernation.floor``), and ``lchat
rollback`` reads it before the local record. Which of two builds is newer is
:func:`compare_versions`: the numbers of dotted-numeric names (``1.4.0``, ``v2``; ``1.4`` ==
``1.4.0``) when both have them, else the feed's order (each version's ``released_at``, as this box
last accepted the feed: :func:`lchat.release.fetch.read_state`) when both are in it, else no order
at all (names such as commit hashes): then the floor cannot be enforced (docs/operations.md, "The
build floor").
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence

from attrs import frozen
from twisted.logger import Logger

from lchat import hosts
from lchat.files import write_atomic

DEFAULT_OPT_DIR = "/opt/lchat"
DEFAULT_LINK = "_default"  # never a host name (no underscore in one)
SPACE_BINARY = "space"
SIDECAR_BINARY = "space-bot"
WAKES_DIRECTORY = "woke"
BUILD_RECORD = "build.json"  # <prefix>/<host>/build.json in the bucket: the space's build floor

_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z._+-]{0,63}")
_NUMBERED = re.compile(r"[vV]?([0-9]{1,9}(?:\.[0-9]{1,9})*)")  # 1.4.0, v2: a release number
_log = Logger(namespace="lchat.activator")


class BadVersion(ValueError):
    """A version name that is not a safe path segment."""


def check_version(version: str) -> str:
    """``version`` if it is a valid version name (1-64 of ``[0-9A-Za-z._+-]``, starting with a
    letter or digit; so never ``.``, ``..`` or a path), else :class:`BadVersion`."""
    if not _VERSION.fullmatch(version):
        raise BadVersion(
            f"{version!r} is not a version name (1-64 letters, digits, '.', '_', '+' or '-', "
            "starting with a letter or digit)"
        )
    return version


@frozen
class BuildLayout:
    """The build tree under ``root`` (``LCHAT_OPT_DIR``)."""

    root: str = DEFAULT_OPT_DIR

    @property
    def versions_dir(self) -> str:
        return os.path.join(self.root, "versions")

    @property
    def live_dir(self) -> str:
        return os.path.join(self.root, "live")

    @property
    def release_state(self) -> str:
        """``<opt>/release-state.json``: the newest feed this box accepted (lchat.release.fetch)."""
        return os.path.join(self.root, "release-state.json")

    @classmethod
    def holding(cls, build: str) -> BuildLayout | None:
        """The tree whose ``versions/`` holds ``build`` (a real path, ``.../versions/<v>/<file>``),
        or None when it lies in no version tree."""
        if version_in(build) is None:
            return None
        return cls(os.path.dirname(os.path.dirname(os.path.dirname(build))))

    def build_dir(self, version: str) -> str:
        return os.path.join(self.versions_dir, check_version(version))

    def binary(self, version: str, *, sidecar: bool = False) -> str:
        return os.path.join(self.build_dir(version), SIDECAR_BINARY if sidecar else SPACE_BINARY)

    def live_link(self, host: str, *, sidecar: bool = False) -> str:
        return os.path.join(self.live_dir, f"{host}-bot" if sidecar else host)

    def installed(self) -> list[str]:
        """The versions present under ``versions/`` (sorted by name), valid names only."""
        try:
            names = os.listdir(self.versions_dir)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if _VERSION.fullmatch(n))

    def version_of(self, host: str) -> str | None:
        """The version ``host`` runs here: its live link's, else the default build's when it has
        no link of its own; ``None`` when neither is a link into ``versions/``."""
        link = self.live_link(host)
        if not os.path.lexists(link):
            link = self.live_link(DEFAULT_LINK)
        try:
            target = os.readlink(link)
        except OSError:
            return None
        resolved = os.path.normpath(os.path.join(self.live_dir, target))
        relative = os.path.relpath(resolved, self.versions_dir)
        parts = relative.split(os.sep)  # a version name is never "." or ".."
        return parts[0] if len(parts) == 2 and _VERSION.fullmatch(parts[0]) else None


def space_argv(command: Sequence[str], host: str, *, sidecar: bool = False) -> list[str]:
    """The command that runs ``host``'s space (``sidecar``: its bot sidecar): ``command``
    (``LCHAT_SPACE_COMMAND``, ``LCHAT_SIDECAR_COMMAND``) with ``{host}`` filled in, the default
    build's link run when ``host`` has no live link of its own (:func:`fall_back_to_default`)."""
    host = hosts.normalise(host)
    argv = [part.replace("{host}", host) for part in command]
    return fall_back_to_default(argv, host, sidecar=sidecar)


def fall_back_to_default(argv: list[str], host: str, *, sidecar: bool = False) -> list[str]:
    """``argv`` with its program replaced by the default build's link when the program is a live
    link ``.../live/<host>`` (``-bot`` for a sidecar) that does not exist and
    ``.../live/_default`` does; else ``argv`` unchanged (any other command, or no default)."""
    if not argv:
        return argv
    program = argv[0]
    suffix = "-bot" if sidecar else ""
    directory = os.path.dirname(program)
    if os.path.basename(program) != host + suffix or os.path.basename(directory) != "live":
        return argv
    if os.path.lexists(program):
        return argv
    default = os.path.join(directory, DEFAULT_LINK + suffix)
    return [default, *argv[1:]] if os.path.lexists(default) else argv


@frozen
class Wake:
    host: str
    build: str  # the real path of the program that was started
    version: str | None  # versions/<v>/... when the build lies in a version tree
    at: float  # unix seconds of the spawn


def wake_path(data_dir: str, host: str) -> str:
    return os.path.join(data_dir, WAKES_DIRECTORY, f"{host}.json")


def version_in(build: str) -> str | None:
    """``<v>`` when ``build`` is ``.../versions/<v>/<file>``, else None."""
    parent = os.path.dirname(build)
    if os.path.basename(os.path.dirname(parent)) != "versions":
        return None
    try:
        return check_version(os.path.basename(parent))
    except BadVersion:
        return None


def record_quietly(data_dir: str, host: str, program: str) -> None:
    """:func:`record`, logging (never raising) when it cannot be written: a wake must go on."""
    try:
        record(data_dir, host, program)
    except OSError as e:
        _log.warn(
            "activator: {host}: could not record the build it wakes on ({error}); "
            "`lchat rollback` of it will not know",
            host=host,
            error=e,
        )


def record(data_dir: str, host: str, program: str, clock: Callable[[], float] = time.time) -> Wake:
    """Record that ``host`` is being started from ``program`` (resolved through its links; a
    bare command name found on PATH is recorded as it is, with no version)."""
    build = os.path.realpath(program) if os.path.isabs(program) else program
    wake = Wake(host=host, build=build, version=version_in(build), at=clock())
    doc = {"host": host, "build": build, "version": wake.version, "at": wake.at}
    os.makedirs(os.path.join(data_dir, WAKES_DIRECTORY), 0o750, exist_ok=True)
    write_atomic(
        wake_path(data_dir, host), json.dumps(doc).encode() + b"\n", 0o640, fsync_dir=False
    )
    return wake


def read_wake(data_dir: str, host: str) -> Wake | None:
    """The last recorded wake of ``host`` on this box, or None (never woken, or unreadable)."""
    try:
        with open(wake_path(data_dir, host), encoding="utf-8") as f:
            doc = json.load(f)
        return Wake(
            host=str(doc["host"]),
            build=str(doc["build"]),
            version=doc["version"] if isinstance(doc.get("version"), str) else None,
            at=float(doc["at"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- the build floor: the newest build a space has run, kept in the bucket ---------------------


class BadRecord(ValueError):
    """A ``build.json`` that is not a build record."""


@frozen
class BuildRecord:
    """The newest build a space has run (its floor): ``version``, when (unix seconds, the waking
    box's clock) and on which ``box`` (``LCHAT_BOX_ID``) it first ran it."""

    version: str
    at: float
    box: str

    def to_bytes(self) -> bytes:
        doc = {"version": self.version, "at": self.at, "box": self.box}
        return json.dumps(doc, sort_keys=True).encode() + b"\n"

    @classmethod
    def parse(cls, body: bytes) -> BuildRecord:
        """The record in ``body``, or :class:`BadRecord` naming what is wrong with it."""
        try:
            doc = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise BadRecord(f"not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise BadRecord("not a JSON object")
        version, at, box = doc.get("version"), doc.get("at"), doc.get("box", "")
        if not isinstance(version, str):
            raise BadRecord(f"version {version!r} is not a version name")
        try:
            check_version(version)
        except BadVersion as e:
            raise BadRecord(str(e)) from None
        if not isinstance(at, int | float) or isinstance(at, bool):
            raise BadRecord(f"at {at!r} is not a time")
        return cls(version=version, at=float(at), box=str(box))


def record_key(prefix: str, host: str) -> str:
    """``<prefix>/<host>/build.json`` (beside the space's ``lock.json`` and replica; the host is
    normalised, raising ``hosts.InvalidHost``)."""
    return "/".join(p for p in (prefix.strip("/"), hosts.normalise(host), BUILD_RECORD) if p)


def release_number(version: str) -> tuple[int, ...] | None:
    """``version``'s release number (``1.4.0`` -> (1, 4), trailing zeros dropped so that ``1.4``
    and ``1.4.0`` are one release; a leading ``v`` allowed, as PEP 440 does), or None for a name
    that is not dotted numbers (a pre-release, a hash): those have no order of their own."""
    m = _NUMBERED.fullmatch(version)
    if m is None:
        return None
    parts = [int(p) for p in m[1].split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def compare_versions(a: str, b: str, released: Mapping[str, str]) -> int | None:
    """-1, 0 or 1 as ``a`` is older than, as new as, or newer than ``b``; None when they have no
    known order. Release numbers (:func:`release_number`) decide when both have one: a hotfix on
    an older line (1.3.5, published after 1.4.0) is older than 1.4.0 whatever its date, since it
    does not know 1.4's migrations. Otherwise ``released`` (versions to their feed
    ``released_at``, ``2026-12-02T03:00:00Z``, which sorts as text) decides when both are in it
    with different times."""
    if a == b:
        return 0
    na, nb = release_number(a), release_number(b)
    if na is not None and nb is not None:
        return (na > nb) - (na < nb)
    ra, rb = released.get(a, ""), released.get(b, "")
    if ra and rb and ra != rb:
        return -1 if ra < rb else 1
    return None
