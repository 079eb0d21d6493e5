"""Relayout: an existing box's flat files moved into every space's own directory, once, so that the
box can isolate its spaces (lchat/isolation.py; ``lchat bootstrap`` runs it, and the router at its
start).

A box from before isolation keeps a space's database beside everything else: ``<data>/<host>.db``
and its journals, its clean-sleep marker, its bot sidecar's schedule, the copies the activator
moved aside; and its registry row names ``<data>/<host>.db`` and ``<run>/<host>.sock`` (or an
empty ``db_path``: the default). Relayout moves those files into ``<data>/spaces/<host>/``
(:func:`lchat.hosts.space_dir`, made the space's own by :func:`lchat.isolation.prepare`, which
gives it its uid), gives the space its database and journals, and rewrites the row to
``<data>/spaces/<host>/<host>.db`` and ``<run>/spaces/<host>/<host>.sock``.

Invariants:

* :func:`plan` changes nothing; :func:`apply` does exactly the steps it is given, in order, and a
  second :func:`plan` finds nothing to do (and says so): the layout on disk and the rows are the
  record, there is no other state;
* nothing is ever overwritten: a host whose file exists in the old place and the new one is
  refused (which, is said), as is one whose database is already in the new place while files of
  the old remain (a journal beside the wrong database would corrupt it);
* only plain files move: a symbolic link, anything not a regular file, or a file with a second hard
  link is refused (the spaces ran as the router's user and could write ``<data>``: such a name
  could point the router at ``router.env``), as :func:`lchat.isolation.give_to_space` refuses;
* files move by ``rename`` inside ``<data>`` (never copied; another file system is refused), the
  database last: an interruption leaves a state the next run completes, and the inode, size and
  mtime of a database and its WAL do not change, so the activator's clean-sleep marker
  (lchat.hibernation.localdb, which records exactly those) moves with them and stays true;
* a row's paths change only after all its files moved; a host whose space still listens on its
  socket (it runs: it would go on writing, or re-create, the old files) is refused;
* services, and rows whose database or socket is not the flat default (an operator's choice), are
  left alone, with a line saying so. "Lives elsewhere" rows are relaid out like any instance:
  their socket and database path are this box's (a peer's flip keeps them) and must be the
  isolated ones by the time the space hibernates here again.

Blocking, and safe in a worker thread: it holds no state between calls.
"""

from __future__ import annotations

import errno
import os
import socket as socketlib
import stat
from collections.abc import Sequence
from typing import Literal

from attrs import field, frozen
from prometheus_client import Counter
from twisted.logger import Logger

from lchat import hosts, isolation
from lchat.hibernation.localdb import LEASE_SUFFIX, MARKER_SUFFIX, moved_aside
from lchat.registry import Registry, RegistryError, Route

_log = Logger(namespace="lchat.relayout")

STEPS = Counter(
    "lchat_relayout_steps_total",
    "Relayout steps (lchat/relayout.py) done or refused, by action",
    ["action"],
)

Action = Literal["enable", "move", "row", "note", "refuse", "nothing"]

# Beside a database, the files that belong to its space, moved with it ("" is the database itself,
# moved last). The marker is the router's record (left with its owner); the rest are the space's.
_SIDECAR_STATE = "-bot.json"  # lchat.space.sidecar: a bot sidecar's schedule, beside its database
_WITH_DB = ("-journal", "-shm", "-wal", MARKER_SUFFIX, LEASE_SUFFIX, _SIDECAR_STATE)
_WITH_COPY = ("-shm", "-wal", MARKER_SUFFIX)  # a moved-aside copy's (localdb.move_aside)
_PROBE_TIMEOUT = 1.0  # seconds: a socket whose space runs answers a connect at once


class RelayoutError(Exception):
    """One host's files cannot be moved (the message says which file and why); nothing more of
    that host is done."""


@frozen
class Step:
    """One thing relayout does or says, as one human line. ``source``/``target``: a ``move``'s;
    ``socket``/``db_path``: a ``row``'s new values; ``give``: a moved file becomes the space's."""

    action: Action
    line: str
    host: str = ""
    source: str = ""
    target: str = ""
    socket: str = ""
    db_path: str = ""
    give: bool = field(default=True, repr=False)

    @property
    def to_do(self) -> bool:
        return self.action in ("enable", "move", "row")


@frozen
class Report:
    """What :func:`apply` did (``done``: every line, in order, refusals included) and which of
    those lines are refusals (``refused``: something is left for the operator)."""

    done: list[str]
    refused: list[str]


def plan(
    data_dir: str,
    run_dir: str,
    registry: Registry,
    *,
    uids: tuple[int, int] | None = None,
    probe_running: bool = True,
) -> list[Step]:
    """Every step, in order, for every row of ``registry``. Reads the box; changes nothing.
    ``uids`` (LCHAT_SPACE_UIDS): the move lines say which uid each space will get.
    ``probe_running=False``: the caller stops every space before it applies a fresh plan
    (bootstrap under systemd): a running space is not refused in this one."""
    data_dir = os.path.abspath(data_dir)
    run_dir = os.path.abspath(run_dir)
    steps: list[Step] = []
    if not hosts.isolated(data_dir):
        steps.append(
            Step(
                "enable",
                f"lay out {os.path.join(data_dir, hosts.SPACES)} and "
                f"{os.path.join(run_dir, hosts.SPACES)} (mode 0711); {data_dir} mode 0711, nothing"
                " at its top open to other users",
            )
        )
    for route in registry.load():
        if route.kind != "instance":
            continue  # a service's files are its own business: never a space's directory
        try:
            steps.extend(_host_steps(data_dir, run_dir, route, uids, probe_running))
        except (hosts.InvalidHost, OSError, isolation.IsolationError) as e:
            steps.append(Step("refuse", f"{route.host}: not moved: {e}", host=route.host))
    if not any(s.to_do or s.action == "refuse" for s in steps):
        steps.append(
            Step("nothing", "relayout: nothing to do: every space's files are in its own directory")
        )
    return steps


def apply(
    data_dir: str,
    run_dir: str,
    uids: tuple[int, int],
    registry: Registry,
    steps: Sequence[Step],
) -> Report:
    """Do ``steps`` (from :func:`plan`) in order. A host that fails midway is left there (its row
    unchanged, its other steps not done, a line saying why) and the others go on; a second
    :func:`plan` picks up where it stopped."""
    data_dir = os.path.abspath(data_dir)
    done: list[str] = []
    refused: list[str] = []
    users: dict[str, int] = {}
    stopped: set[str] = set()
    for step in steps:
        if step.host in stopped:
            continue
        try:
            line = _do(data_dir, run_dir, uids, registry, step, users)
        except (RelayoutError, isolation.IsolationError, OSError, RegistryError) as e:
            stopped.add(step.host)
            line = f"{step.host}: stopped at '{step.line}': {e}; its row is unchanged"
            refused.append(line)
            STEPS.labels("failed").inc()
            _log.error("relayout: {line}", line=line)
            done.append(line)
            if step.action == "enable":
                break  # nothing can move without the layout
            continue
        if step.action == "refuse":
            refused.append(line)
            _log.warn("relayout: {line}", line=line)
        elif step.to_do:
            _log.info("relayout: {line}", line=line)
        STEPS.labels(step.action).inc()
        done.append(line)
    return Report(done, refused)


def relayout(
    data_dir: str,
    run_dir: str,
    uids: tuple[int, int],
    registry: Registry,
    *,
    dry_run: bool = False,
) -> list[str]:
    """:func:`plan`, then (unless ``dry_run``) :func:`apply`: the lines of what was done (or, dry,
    what would be). The router calls this in a thread at its start."""
    steps = plan(data_dir, run_dir, registry, uids=uids)
    if dry_run:
        return [s.line for s in steps]
    return apply(data_dir, run_dir, uids, registry, steps).done


# --- planning ------------------------------------------------------------------------------------


def _host_steps(
    data_dir: str, run_dir: str, route: Route, uids: tuple[int, int] | None, probe_running: bool
) -> list[Step]:
    host = route.host
    directory = hosts.space_dir(data_dir, host)  # raises InvalidHost for a name not normal
    name = os.path.basename(hosts.env_path(data_dir, host))[: -len(".env")]  # the checked host
    flat_db = os.path.join(data_dir, name + ".db")
    new_db = os.path.join(directory, name + ".db")
    flat_socket = hosts.socket_path(run_dir, host, isolated=False)
    new_socket = hosts.socket_path(run_dir, host, isolated=True)
    if route.db_path not in ("", flat_db, new_db):
        return [
            Step(
                "note",
                f"{host}: its database {route.db_path} is not the flat default ({flat_db}): left"
                " as it is (move it into its own directory by hand)",
                host=host,
            )
        ]
    if route.socket not in (flat_socket, new_socket):
        return [
            Step(
                "note",
                f"{host}: its socket {route.socket} is not the flat default ({flat_socket}):"
                " left as it is (it cannot run isolated until it is in a directory of its own)",
                host=host,
            )
        ]
    pairs = [(flat_db + s, new_db + s, s not in (MARKER_SUFFIX, LEASE_SUFFIX)) for s in _WITH_DB]
    for copy in moved_aside(flat_db):
        tail = os.path.basename(copy.path)[len(name + ".db") :]
        pairs += [(copy.path + s, new_db + tail + s, s != MARKER_SUFFIX) for s in _WITH_COPY]
        pairs.append((copy.path, new_db + tail, True))
    pairs.append((flat_db, new_db, True))  # the database last: see the module's invariants
    present = [(old, new, give) for old, new, give in pairs if os.path.lexists(old)]
    both = [old for old, new, _ in present if os.path.lexists(new)]
    both.sort(key=lambda old: old != flat_db)  # the database first: the one worth naming
    if both:
        twin = next(new for old, new, _ in pairs if old == both[0])
        return [_refusal(host, f"{both[0]} and {twin} both exist")]
    if present and os.path.lexists(new_db):
        return [
            _refusal(
                host,
                f"{new_db} exists and so does {present[0][0]} (the old place still has files:"
                " one of them would end up beside the wrong database)",
            )
        ]
    for old, _, _ in present:
        why = _not_plain(old)
        if why is not None:
            return [_refusal(host, why)]
    steps: list[Step] = []
    if present:
        for candidate in (flat_socket, new_socket) if probe_running else ():
            if listening(candidate):
                return [
                    _refusal(
                        host,
                        f"its space is running (a listener on {candidate}): stop it first, it"
                        " would go on writing the old files",
                    )
                ]
        uid = _uid_line(data_dir, host, uids)
        steps += [
            Step("move", f"move {old} -> {new}{uid}", host=host, source=old, target=new, give=give)
            for old, new, give in present
        ]
    changes = []
    if route.socket != new_socket:
        changes.append(f"socket {route.socket} -> {new_socket}")
    if route.db_path != new_db:
        changes.append(f"db_path {route.db_path or '(default)'} -> {new_db}")
    if changes:
        steps.append(
            Step(
                "row",
                f"row {host}: {', '.join(changes)}",
                host=host,
                socket=new_socket,
                db_path=new_db,
            )
        )
    return steps


def _refusal(host: str, why: str) -> Step:
    return Step(
        "refuse",
        f"{host}: refused: {why}; nothing of {host} is moved (never overwritten: settle it by hand)",
        host=host,
    )


def _uid_line(data_dir: str, host: str, uids: tuple[int, int] | None) -> str:
    if uids is None:
        return ""
    user = isolation.user_of(data_dir, host) if hosts.isolated(data_dir) else None
    if user is not None:
        return f" (uid {user.uid})"
    return f" (uid {isolation.allocate(data_dir, host, uids)})"


def _not_plain(path: str) -> str | None:
    """Why ``path`` is not a file relayout may move (None: it may)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (to {os.readlink(path)}): only plain files move"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file: only plain files move"
    if st.st_nlink > 1:
        return f"{path} has {st.st_nlink} hard links: only files with one name move"
    return None


def listening(path: str) -> bool:
    """Does a process accept connections on the unix socket ``path``?"""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT)
    try:
        probe.connect(path)
    except OSError:
        return False  # refused (a stale socket file: nothing runs), or gone
    finally:
        probe.close()
    return True


# --- applying -----------------------------------------------------------------------------------


def _do(
    data_dir: str,
    run_dir: str,
    uids: tuple[int, int],
    registry: Registry,
    step: Step,
    users: dict[str, int],
) -> str:
    if step.action == "enable":
        isolation.enable(data_dir, run_dir)
        return step.line
    if step.action == "move":
        if not hosts.isolated(data_dir):
            raise RelayoutError(f"{os.path.join(data_dir, hosts.SPACES)} does not exist")
        uid = users.get(step.host)
        if uid is None:
            socket = hosts.socket_path(run_dir, step.host, isolated=True)
            uid = isolation.prepare(data_dir, uids, step.host, socket).uid
            users[step.host] = uid
        _move(step.source, step.target)
        if step.give:
            isolation.give_to_space(step.target, uid)
        return f"move {step.source} -> {step.target} (uid {uid})"
    if step.action == "row":
        registry.update(step.host, socket=step.socket, db_path=step.db_path)
        return step.line
    return step.line  # note, refuse, nothing: said, not done


def _move(source: str, target: str) -> None:
    """Rename ``source`` to ``target``: a plain file, never over anything (checked just before;
    the target directory is the space's, new, and its space is not running)."""
    why = _not_plain(source)
    if why is not None:
        raise RelayoutError(why)
    if os.path.lexists(target):
        raise RelayoutError(f"{target} exists: not overwritten")
    try:
        os.rename(source, target)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise RelayoutError(
                f"{source} and {target} are on different file systems: move it by hand (a copy"
                " would void the clean-sleep marker and could be torn)"
            ) from e
        raise
