"""Every space its own user: who a space runs as, what it may touch, how it is started
(docs/secrets.md, "Who can read what").

A box isolates its spaces when ``<data>/spaces`` exists (:func:`lchat.hosts.isolated`: the layout
on disk is the switch, so the router, the CLI and bootstrap always agree). Then:

* each space has a uid of its own, and a gid of the same number, from ``LCHAT_SPACE_UIDS``. The
  owner of ``<data>/spaces/<host>`` is the record: no table of uids to lose; a restored or
  migrated directory keeps its owner; a new one takes the first free uid from a start derived
  from the hostname. systemd units name it ``lchat-<sha256(host)[:10]>`` (add-instance creates
  that user with this uid); a space the router starts itself needs no name at all;
* ``<data>/spaces/<host>/`` (its database and journals) and ``<run>/spaces/<host>/`` (its socket)
  are the space's, mode 0700. ``<data>`` and ``<data>/spaces`` are 0711 (traversable, not
  listable) and nothing else in ``<data>`` is open to other users;
* the router reaches into a space's directories with ``CAP_DAC_OVERRIDE`` (root has it), gives
  every file of the space's it finds owned by another user back to the space, and refuses a
  database or journal that is a symbolic link or has a second hard link (a space could point the
  router, which replicates and restores those files, at ``router.env``);
* the router starts a space through util-linux ``setpriv``: the space's uid and gid, no
  supplementary groups, no capabilities (inheritable and ambient sets cleared: a router started
  with ``AmbientCapabilities=`` would otherwise hand them on), ``no_new_privs``.

Without the privilege for it (not root, and not the capabilities in :data:`CAPABILITIES`), and
with ``LCHAT_ISOLATION=auto``, the router says plainly that isolation is off and runs every space
as itself, as before.
"""

from __future__ import annotations

import ctypes
import grp
import hashlib
import os
import pwd
import shutil
import stat
from collections.abc import Callable

from attrs import frozen
from prometheus_client import Gauge
from twisted.logger import Logger

from lchat import hosts
from lchat.config import BoxConfig, ConfigError
from lchat.registry import Registry

_log = Logger(namespace="lchat.tap")  # (what the router's start says, as it always did)
LayOut = Callable[[str, str, tuple[int, int], Registry], object]  # data, run, uids, registry

ISOLATED = Gauge(
    "lchat_space_isolation",
    "1 when every space runs as its own user (lchat/isolation.py); 0 when isolation is off",
)

# What a router that is not root needs (lchat-router.service grants exactly these, besides
# CAP_NET_BIND_SERVICE): create a space's directories and give them away, open its files, start
# it as its user, signal it. Bit numbers from linux/capability.h.
CAPABILITIES = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
}
# The files of a space the router opens, writes or replaces (replication, restore, hand-over).
JOURNALS = ("", "-wal", "-shm", "-journal")


class IsolationError(Exception):
    """A space cannot be started isolated (its directory is not what it must be, or the router
    lacks the privilege): never started any other way."""


@frozen
class SpaceUser:
    """Who a space runs as."""

    uid: int
    gid: int
    name: str  # the systemd unit's User= (lchat-<sha256(host)[:10]>)


@frozen
class Decision:
    """Whether this router isolates its spaces, and why (logged at start)."""

    on: bool
    why: str


def user_name(host: str) -> str:
    """``lchat-`` and ten hex digits of the hostname's SHA-256: a valid user name for any host."""
    return "lchat-" + hashlib.sha256(host.encode("ascii")).hexdigest()[:10]


def missing_privilege(status_file: str = "/proc/self/status") -> list[str]:
    """The capabilities of :data:`CAPABILITIES` this process lacks (none for root)."""
    if os.geteuid() == 0:
        return []
    effective = 0
    try:
        with open(status_file) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    effective = int(line.split()[1], 16)
    except OSError:
        pass
    return [name for name, bit in CAPABILITIES.items() if not effective >> bit & 1]


def unreachable(path: str) -> str | None:
    """The first directory above ``path`` that other users cannot traverse (no o+x): a space
    running as its own user could never reach its files below it. (``path`` itself is made
    0711 by :func:`enable`.)"""
    path = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = 0o711  # created by us, below: traversable
        if not mode & stat.S_IXOTH:
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def unrunnable(command: str) -> str | None:
    """Why a space's user could not run ``command`` (a program, or a script and its ``#!``
    interpreter, links resolved): the first path on the way others cannot traverse or execute;
    None when it can, or when there is nothing yet to check (``{host}`` in it, not installed)."""
    if "{host}" in command:
        command = os.path.dirname(command)
    paths = [os.path.realpath(command)]
    try:
        with open(paths[0], "rb") as f:
            head = f.readline(256)
    except OSError:
        head = b""
    if head.startswith(b"#!") and head[2:].split():
        paths.append(os.path.realpath(head[2:].split()[0].decode(errors="replace")))
    for path in paths:
        blocked = unreachable(path)
        if blocked is not None:
            return blocked
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue
        if not mode & stat.S_IXOTH:
            return path
    return None


def decide(
    setting: str,
    data_dir: str,
    run_dir: str,
    *,
    commands: tuple[str, ...] = (),
    missing: list[str] | None = None,
) -> Decision:
    """``LCHAT_ISOLATION`` (auto, on, off) against what this process can do. Raises
    :class:`IsolationError` when isolation is required (``on``, or the box's layout already
    isolates its spaces) but impossible: a router must not run isolated spaces as itself."""
    laid_out = hosts.isolated(data_dir)
    if setting == "off":
        if laid_out:
            raise IsolationError(
                f"LCHAT_ISOLATION=off, but {os.path.join(data_dir, hosts.SPACES)} exists: this box"
                " gives every space its own user; its files are not the router's to run as itself"
            )
        return Decision(False, "LCHAT_ISOLATION=off")
    user = _user_name(os.geteuid())
    if missing is None:
        missing = missing_privilege()
    why_not = None
    if missing:
        why_not = f"the router runs as {user} without {', '.join(missing)}"
    elif (blocked := unreachable(data_dir) or unreachable(run_dir)) is not None:
        why_not = f"{blocked} is not traversable by other users (chmod o+x, or move the data)"
    else:
        for command in commands:
            if (blocked := unrunnable(command)) is not None:
                why_not = (
                    f"{blocked} cannot be reached or run by other users, so a space's user could"
                    f" not run {command} (chmod o+x, or install it where others can)"
                )
                break
    if why_not is None:
        return Decision(True, f"every space runs as its own user (uids from {data_dir})")
    if setting == "on" or laid_out:
        raise IsolationError(f"spaces cannot be isolated: {why_not}")
    return Decision(
        False,
        f"isolation: OFF ({why_not}): every space runs as {user} and can read the router's"
        " files, its secrets and every other space's (docs/secrets.md)",
    )


def clear_ambient() -> None:
    """Drop this process's ambient capabilities (its own stay): a router that does not isolate
    its spaces must not hand ``AmbientCapabilities=`` on to them across exec."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    except (OSError, AttributeError):
        pass


def enable(data_dir: str, run_dir: str) -> None:
    """Make this box isolate its spaces: ``<data>/spaces`` and ``<run>/spaces`` (0711), ``<data>``
    0711 and nothing at its top level open to other users. Idempotent."""
    for base in (data_dir, run_dir):
        os.makedirs(base, 0o711, exist_ok=True)
        os.chmod(base, 0o711)  # noqa: S103 -- traversable, not listable: a space reaches its own
    for entry in os.scandir(data_dir):
        if entry.name == hosts.SPACES or entry.is_symlink():
            continue
        mode = entry.stat(follow_symlinks=False).st_mode
        if mode & 0o007:
            os.chmod(entry.path, stat.S_IMODE(mode) & ~0o007)
    for base in (data_dir, run_dir):
        spaces = os.path.join(base, hosts.SPACES)
        os.makedirs(spaces, 0o711, exist_ok=True)
        os.chmod(spaces, 0o711)  # noqa: S103 -- as above


def at_start(cfg: BoxConfig, registry: Registry, lay_out: LayOut) -> None:
    """The router's start: every space its own user where this router can, said either way;
    refuses to start (ConfigError) where the box requires it and the router cannot. Turning it
    on lays the box out right after :func:`enable` (lchat.relayout.relayout: an older box's flat
    files moved into the spaces' own directories, what no space runs from)."""
    try:
        decision = decide(
            cfg.isolation,
            cfg.data_dir,
            cfg.run_dir,
            commands=(cfg.space_command[0], cfg.sidecar_command[0]),
        )
    except IsolationError as e:
        raise ConfigError(str(e)) from e
    if decision.on and cfg.units == "systemd" and not hosts.isolated(cfg.data_dir):
        running = [r.host for r in registry.load() if r.always_on_here]
        if running:
            # Their units run from the flat files now; laying the box out under them would stop
            # each at its next restart (the template refuses an isolated box without a drop-in).
            decision = Decision(
                False,
                f"isolation: OFF until `lchat bootstrap` moves the {len(running)} always-on"
                " spaces' files into their own directories (it stops their units meanwhile):"
                " every space runs as the router's user and can read its files (docs/secrets.md)",
            )
    ISOLATED.set(1 if decision.on else 0)
    if not decision.on:
        clear_ambient()
        if cfg.isolation == "off":
            _log.info("isolation: off ({why})", why=decision.why)
        else:
            _log.warn("{why}", why=decision.why)
        return
    enable(cfg.data_dir, cfg.run_dir)
    lay_out(cfg.data_dir, cfg.run_dir, cfg.space_uids, registry)  # logs each step
    _log.info("isolation: on: {why}", why=decision.why)


def user_of(data_dir: str, host: str) -> SpaceUser | None:
    """Who ``host``'s space runs as: its directory's owner (None: no directory yet)."""
    try:
        st = os.lstat(hosts.space_dir(data_dir, host))
    except FileNotFoundError:
        return None
    return SpaceUser(st.st_uid, st.st_gid, user_name(host))


def allocate(data_dir: str, host: str, uids: tuple[int, int]) -> int:
    """A uid for a new space: the first, from a start derived from ``host``, that no other
    space's directory owns and the system knows no user or group by."""
    low, high = uids
    try:
        named = pwd.getpwnam(user_name(host)).pw_uid  # its unit's user, left from before
    except KeyError:
        named = -1
    if low <= named <= high:
        return named
    taken = {e.stat(follow_symlinks=False).st_uid for e in _spaces(data_dir) if e.name != host}
    size = high - low + 1
    start = int(hashlib.sha256(host.encode("ascii")).hexdigest()[:8], 16) % size
    for step in range(size):
        uid = low + (start + step) % size
        if uid not in taken and not _known(uid):
            return uid
    raise IsolationError(f"no free uid left in LCHAT_SPACE_UIDS {low}-{high}")


def prepare(data_dir: str, uids: tuple[int, int], host: str, socket: str) -> SpaceUser:
    """Before ``host``'s space starts (in a thread): its directories exist, are its own and 0700;
    its database and journals are regular files of its own (files the router wrote there, a
    restore's, are given to it). Returns who it runs as; raises :class:`IsolationError`."""
    directory = hosts.space_dir(data_dir, host)
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        uid = allocate(data_dir, host, uids)
    else:
        if not stat.S_ISDIR(st.st_mode):
            raise IsolationError(f"{directory} is not a directory: refusing to start {host}")
        uid = st.st_uid
        if not uids[0] <= uid <= uids[1]:
            raise IsolationError(
                f"{directory} belongs to uid {uid}, outside LCHAT_SPACE_UIDS"
                f" {uids[0]}-{uids[1]}: refusing to start {host} as it"
            )
    _own_dir(directory, uid)
    db = hosts.db_path(data_dir, host)
    for suffix in JOURNALS:
        give_to_space(db + suffix, uid)
    run = os.path.dirname(socket)
    if os.path.basename(os.path.dirname(run)) != hosts.SPACES:
        raise IsolationError(f"{host}'s socket {socket} is not in a directory of its own")
    os.makedirs(os.path.dirname(run), 0o711, exist_ok=True)
    _own_dir(run, uid)
    return SpaceUser(uid, uid, user_name(host))


def give_to_space(path: str, uid: int) -> None:
    """``path`` (absent is fine) is a plain file owned by ``uid``: chowned when it is not (never
    through a link); refused when it is a symbolic link, not a file, or has another hard link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise IsolationError(
            f"{path} is not a plain file: refusing it (the space may have replaced it)"
        )
    if st.st_nlink > 1:
        raise IsolationError(f"{path} has {st.st_nlink} hard links: refusing it")
    if (st.st_uid, st.st_gid) != (uid, uid):
        os.chown(path, uid, uid, follow_symlinks=False)


def argv_as(user: SpaceUser, argv: list[str]) -> list[str]:
    """``argv`` run as ``user`` through util-linux ``setpriv`` (which execs in place: the pid
    stays the space's). Raises :class:`IsolationError` without ``setpriv``."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise IsolationError(
            "util-linux setpriv is not on PATH: cannot start a space as its own user"
        )
    return [
        setpriv,
        f"--reuid={user.uid}",
        f"--regid={user.gid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--",
        *argv,
    ]


def _own_dir(path: str, uid: int) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise IsolationError(f"{path} is not a directory")
    if (st.st_uid, st.st_gid) != (uid, uid):
        os.chown(path, uid, uid, follow_symlinks=False)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _spaces(data_dir: str) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(os.path.join(data_dir, hosts.SPACES)))
    except FileNotFoundError:
        return []


def _known(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
        except KeyError:
            continue
        return True
    return False


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
