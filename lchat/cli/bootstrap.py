"""``lchat bootstrap``: make a fresh box ready to run the router, as root, idempotently.

What a box needs before ``systemctl start lchat-router`` (docs/operations.md, "Bootstrap a box"):

1. the service user (a system user, no login shell, no home) the units run as;
2. ``<data>`` (default ``/data``), mode 0750, owned by it;
3. ``<data>/router.env``, from the shipped example (:data:`lchat.ops.ENV_EXAMPLE`) with the given
   values filled in, mode 0600, owned by the service user: the router reads it, and env-file
   ownership follows the reader (a root-owned file the service user cannot read kills a wake);
4. ``/opt/lchat/versions`` and ``/opt/lchat/live`` (:class:`lchat.release.layout.BuildLayout`);
5. the systemd units shipped with the package (:data:`lchat.ops.UNITS_DIR`, the checkout's
   ``ops/systemd``) in ``/etc/systemd/system``, with the data directory and the user filled in;
   ``systemctl daemon-reload`` and ``systemctl enable lchat-router.service``;

then the router's own boot checks of the settings, run as the service user on the written file:
the configuration (``config.load``), the AWS credentials the buckets and Route53 need, and each
bucket's write probe (as the router's ``_BucketCheck``, ``lchat.buckets.probe_name``). What fails there is printed as
left to do, with everything else left (secrets to fill in, no build yet...).

Invariants: :func:`plan` changes nothing (it reads the box and says, step by step, what it would
do and what is already so); bad input is refused before anything changes; a second run changes
nothing; an operator's existing ``router.env`` keeps every line except the values given (each
change is named; a secret's value is never printed); ``--root DIR`` prefixes every path (tests,
or preparing an image) and then never creates users nor runs ``systemctl``.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from attrs import field, frozen

from lchat import config, envfile, files, ops
from lchat.config import BoxConfig, ConfigError
from lchat.files import write_atomic
from lchat.release import settings as release_settings
from lchat.release.layout import DEFAULT_OPT_DIR, BuildLayout

SUMMARY = (
    "prepare this box for the router: service user, data directory, router.env, /opt/lchat, "
    "systemd units (as root; idempotent; --dry-run shows the plan)"
)
DEFAULT_USER = "lchat"
DEFAULT_DATA_DIR = os.path.dirname(config.DEFAULT_ENV_FILE)  # /data
ENV_NAME = os.path.basename(config.DEFAULT_ENV_FILE)  # router.env
DATA_MODE = 0o750
# A box that isolates its spaces (lchat/isolation.py): each space, its own user, traverses
# <data> to reach <data>/spaces/<host>; nothing else in it is open to other users.
ISOLATED_DATA_MODE = 0o711
OPT_MODE = 0o755
UNIT_MODE = 0o644
UNITS_TARGET = "/etc/systemd/system"
ROUTER_UNIT = "lchat-router.service"
VENV_TWISTD = os.path.join(DEFAULT_OPT_DIR, "venv", "bin", "twistd")  # the units' ExecStart
NOLOGIN = "/usr/sbin/nologin"
PROBE_TIMEOUT = 60.0  # one bucket's write probe (a PUT and a DELETE, with botocore's retries)
PROBES_TIMEOUT = 300.0  # the whole probe process, as the service user
# Besides the router's own variables (config.DEFAULTS), the AWS settings the seeds keep in the
# env file for the bucket's credentials.
AWS_NAMES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
)
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD")
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,30}")
# A data directory is written into unit files (ReadWritePaths= splits on spaces): plain paths only.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._/-]*")
_SYSTEM_DIRS = frozenset(
    "/ /bin /boot /dev /etc /home /lib /lib64 /opt /proc /root /run /sbin /srv /sys /tmp /usr "
    "/var".split()
)
# The data directory as the shipped units spell it: a path at the start of a value or argument.
_UNIT_DATA_DIR = re.compile(rf"(?<=[=\s]){re.escape(DEFAULT_DATA_DIR)}(?=/|\s|$)", re.MULTILINE)


class BootstrapError(Exception):
    """Bad input, or a box bootstrap cannot prepare; nothing was changed."""


# --- the request ---------------------------------------------------------------------------------


@frozen
class Request:
    """Validated input. Paths are box paths (``/data``); :meth:`path` is where they are on this
    machine (under ``root``)."""

    data_dir: str
    user: str
    root: str  # "" for the real root
    values: Mapping[str, str]  # what router.env must say, in the order given
    given: tuple[str, ...]  # the names the operator gave (--set, --mesh-self, --data-dir)
    dry_run: bool = False
    # None: run systemctl; else why not (said plainly in the plan).
    no_systemctl: str | None = None

    @property
    def env_file(self) -> str:
        return os.path.join(self.data_dir, ENV_NAME)

    def path(self, box_path: str) -> str:
        return self.root + box_path if self.root else box_path


def request_from_args(
    args: argparse.Namespace,
    *,
    is_root: bool,
    systemctl: str | None,
    systemd_running: bool,
) -> Request:
    """Check the command line; :class:`BootstrapError` names the first thing wrong."""
    if getattr(args, "env_file", None) is not None:
        raise BootstrapError(
            "bootstrap writes <data-dir>/router.env, the file the router unit reads: give "
            "--data-dir, not --env-file"
        )
    for option in ("registry", "run_dir"):
        if getattr(args, option, None) is not None:
            raise BootstrapError(
                f"bootstrap does not take --{option.replace('_', '-')}: the units use "
                f"<data-dir> and /run/lchat (set other paths with --set NAME=VALUE)"
            )
    data_dir = _data_dir(getattr(args, "data_dir", None))
    user = args.user
    if not _USER_NAME.fullmatch(user):
        raise BootstrapError(
            f"--user {user!r} is not a user name (lower-case letters, digits, '_' and '-', "
            "starting with a letter or '_')"
        )
    root = ""
    if args.root is not None:
        root = os.path.abspath(args.root)
        if not os.path.isdir(root):
            raise BootstrapError(f"--root {args.root}: not a directory")
        if root == "/":
            root = ""
    values: dict[str, str] = {"LCHAT_DATA_DIR": data_dir}
    given: list[str] = []
    if getattr(args, "data_dir", None) is not None:
        given.append("LCHAT_DATA_DIR")
    if args.mesh_self is not None:
        values["LCHAT_MESH_SELF"] = _mesh_self(args.mesh_self)
        given.append("LCHAT_MESH_SELF")
    known = set(config.DEFAULTS) | set(AWS_NAMES) | set(release_settings.VARIABLES)
    for item in args.set or ():
        name, sep, value = item.partition("=")
        if not sep:
            raise BootstrapError(f"--set {item!r}: expected NAME=VALUE")
        if name not in known:
            raise BootstrapError(
                f"--set {name}: not a router setting (etc/router.env.example lists them; AWS "
                f"credentials: {', '.join(AWS_NAMES)})"
            )
        if name == "LCHAT_DATA_DIR":
            raise BootstrapError("--set LCHAT_DATA_DIR: give --data-dir instead (the units use it)")
        if name == "LCHAT_RUN_DIR" and os.path.normpath(value) != config.DEFAULTS[name]:
            raise BootstrapError(
                f"--set LCHAT_RUN_DIR={value}: the units make {config.DEFAULTS[name]} "
                "(RuntimeDirectory=lchat) and the spaces' sockets live there: keep it"
            )
        if name == "LCHAT_MESH_SELF":
            value = _mesh_self(value)
            if values.get(name, value) != value:
                raise BootstrapError("LCHAT_MESH_SELF given twice, differently")
        try:
            envfile.env_line(name, value)
        except ValueError as e:
            raise BootstrapError(f"--set {e}") from None
        if name in given and values[name] != value:
            raise BootstrapError(f"--set {name} given twice, differently")
        values[name] = value
        if name not in given:
            given.append(name)
    no_systemctl = None
    if args.no_systemctl:
        no_systemctl = "--no-systemctl given"
    elif root:
        no_systemctl = f"--root {root} given: run them on the box itself"
    elif systemctl is None:
        no_systemctl = "systemctl is not on PATH"
    elif not systemd_running:
        no_systemctl = "systemd is not running here (no /run/systemd/system)"
    if not is_root and not args.dry_run:
        raise BootstrapError(
            "run it as root (sudo lchat bootstrap ...): it creates the service user and hands "
            "files to it; --dry-run shows the plan as anyone"
        )
    request = Request(
        data_dir=data_dir,
        user=user,
        root=root,
        values=values,
        given=tuple(given),
        dry_run=args.dry_run,
        no_systemctl=no_systemctl,
    )
    if root and _account(user) is None:
        raise BootstrapError(
            f"the service user {user!r} does not exist, and with --root bootstrap creates no "
            f"users: create it first, or pick an existing one with --user"
        )
    return request


def _data_dir(text: str | None) -> str:
    if text is None:
        return DEFAULT_DATA_DIR
    if not text.startswith("/"):
        raise BootstrapError(f"--data-dir {text!r} must be an absolute path, such as /data")
    path = os.path.normpath(text)
    if not _PLAIN_PATH.fullmatch(path):
        raise BootstrapError(
            f"--data-dir {text!r}: letters, digits, '.', '_', '-' and '/' only (it is written "
            f"into the unit files)"
        )
    if path in _SYSTEM_DIRS:
        raise BootstrapError(
            f"--data-dir {path} is a system directory (bootstrap makes it mode 0750 and hands "
            f"it to the service user): use a directory of its own, such as /data"
        )
    return path


def _mesh_self(text: str) -> str:
    """The box's own mesh URL, by the rules ``config.load`` applies to ``LCHAT_MESH_SELF``."""
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 -- raises on a malformed port
    except ValueError:
        raise BootstrapError(
            f"--mesh-self {text!r}: the port is not a number up to 65535"
        ) from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
        or parts.password is not None
    ):
        raise BootstrapError(
            f"--mesh-self {text!r} must be this box's URL, https://HOST[:PORT], with no path, "
            f"query or user (e.g. https://box-1.example.net)"
        )
    return text.rstrip("/")


# --- the plan ----------------------------------------------------------------------------------------


@frozen
class Step:
    """One thing bootstrap sees to. ``already``: why nothing needs doing (None: to do);
    ``skipped``: why it will not be done here; ``run`` does it and says what it did."""

    what: str
    already: str | None = None
    skipped: str | None = None
    run: Callable[[], str | list[str]] | None = field(default=None, eq=False, repr=False)
    # Lines under ``what`` in the plan (the relayout's moves and row changes, one a line).
    detail: tuple[str, ...] = ()
    # Filled by ``run`` (or the plan) with what is left for the operator (a relayout refusal).
    left: list[str] = field(factory=list, eq=False, repr=False)

    @property
    def to_do(self) -> bool:
        return self.already is None and self.skipped is None


@frozen
class _Account:
    uid: int
    gid: int
    group: str


def _account(user: str) -> _Account | None:
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    try:
        group = grp.getgrgid(entry.pw_gid).gr_name
    except KeyError:
        group = str(entry.pw_gid)
    return _Account(entry.pw_uid, entry.pw_gid, group)


def _owner(user: str) -> _Account:
    account = _account(user)
    if account is None:
        raise BootstrapError(f"the service user {user!r} does not exist")
    return account


def plan(request: Request) -> list[Step]:
    """Every step, each saying whether it is already so. Reads the box; changes nothing."""
    account = _account(request.user)
    group = account.group if account is not None else request.user  # useradd --user-group
    units = _unit_steps(request, group)
    spaces, isolating = _relayout_steps(request)
    return [
        _user_step(request, account),
        _data_dir_step(request, account, ISOLATED_DATA_MODE if isolating else DATA_MODE),
        _env_step(request, account),
        *_opt_steps(request),
        *units,
        *_systemctl_steps(request, any(u.to_do for u in units)),
        *spaces,
    ]


def _user_step(request: Request, account: _Account | None) -> Step:
    name = request.user
    if account is not None:
        return Step(
            f"service user {name}",
            already=f"the service user {name} exists (uid {account.uid}, group {account.group})",
        )
    try:
        grp.getgrnam(name)
        group = ["--gid", name]  # a group of that name is left from before: join it
    except KeyError:
        group = ["--user-group"]
    argv = [
        "useradd",
        "--system",
        *group,
        "--no-create-home",
        "--home-dir",
        "/nonexistent",
        "--shell",
        NOLOGIN,
        "--comment",
        "lchat router and spaces",
        name,
    ]

    def run() -> str:
        _run_command(argv)
        made = _owner(name)
        return f"created the service user {name} (uid {made.uid}, group {made.group})"

    return Step(f"create the service user {name}: {shlex.join(argv)}", run=run)


def _data_dir_step(request: Request, account: _Account | None, want: int) -> Step:
    """``want``: :data:`want`, or :data:`ISOLATED_want` on a box that isolates its
    spaces (or is about to): 0750 there would lock every space out of its own directory."""
    path = request.path(request.data_dir)
    user = request.user
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        # Root chowns it to the service user: through a link, that would hand over whatever it
        # points to. Name the real directory instead.
        raise BootstrapError(
            f"{path} is a symbolic link (to {os.readlink(path)}): bootstrap hands the data dir "
            f"to {user} and will not follow a link to do so; give --data-dir the real directory"
        )
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise BootstrapError(f"{path} exists and is not a directory")
    mode = stat.S_IMODE(st.st_mode) if st is not None else None
    owned = st is not None and account is not None and (st.st_uid, st.st_gid) == _ids(account)
    if st is not None and owned and mode == want:
        return Step(path, already=f"{path}: mode {want:04o}, owner {user}")

    def run() -> str:
        owner = _owner(user)
        created = not os.path.lexists(path)
        if created:
            os.makedirs(os.path.dirname(path) or "/", mode=0o755, exist_ok=True)
            os.mkdir(path, want)
        # Changed through a descriptor of the directory itself (no link followed), never by name.
        fd = files.open_directory(path)
        try:
            now = os.fstat(fd)
            changed = []
            if stat.S_IMODE(now.st_mode) != want:
                os.fchmod(fd, want)  # the umask may have narrowed mkdir's mode
                changed.append(f"mode {stat.S_IMODE(now.st_mode):04o} -> {want:04o}")
            if (now.st_uid, now.st_gid) != _ids(owner):
                os.fchown(fd, owner.uid, owner.gid)
                changed.append(f"owner {_name_of(now.st_uid)} -> {user}")
        finally:
            os.close(fd)
        if created:
            return f"{path}: created, mode {want:04o}, owner {user}"
        return f"{path}: {', '.join(changed)}"

    if st is None:
        return Step(f"create {path}, mode {want:04o}, owner {user}", run=run)
    return Step(
        f"{path}: make it mode {want:04o} (is {mode:04o}), owner {user} (is {_name_of(st.st_uid)})",
        run=run,
    )


def _env_step(request: Request, account: _Account | None) -> Step:
    path = request.path(request.env_file)
    exists = os.path.lexists(path)
    if exists and (os.path.islink(path) or not os.path.isfile(path)):
        # The data dir is the service user's: a link (or a second name of another file) there
        # would have root copy what it points to into a file handed to that user.
        raise BootstrapError(f"{path} exists and is not a regular file (a link is not followed)")
    source = path if exists else ops.ENV_EXAMPLE
    try:
        current = config.read_env_file(source, must_exist=True)
        text = _read_own_file(source) if exists else _read_text(source)
    except ConfigError as e:
        raise BootstrapError(f"{e} (fix it by hand first; bootstrap edits only valid files)") from e
    values = dict(request.values)
    if current.get("LCHAT_DATA_DIR", config.DEFAULTS["LCHAT_DATA_DIR"]) == request.data_dir:
        del values["LCHAT_DATA_DIR"]  # already what the router uses: no line to add
    _refuse_bad_values(request, {**current, **values})
    new_text, changes = merge_env(text, current, values)
    st = os.stat(path) if exists else None
    # Private: owned by the service user, no group or other bits (envfile.hand_to's rule: it
    # never loosens a mode, so a 0400 file stays 0400).
    private = (
        st is not None
        and account is not None
        and (st.st_uid, st.st_gid) == _ids(account)
        and not stat.S_IMODE(st.st_mode) & 0o077
    )
    user = request.user
    if exists and not changes and private:
        return Step(path, already=f"{path}: has the given values; private, owner {user}")

    def run() -> str:
        owner = _owner(user)
        said = [] if exists else ["created from the example"]
        said.extend(changes)
        if changes or not exists:
            # The reader owns it: handed over on the descriptor, before the rename.
            write_atomic(path, new_text.encode("utf-8"), envfile.MODE, uid=owner.uid, gid=owner.gid)
        elif not private:
            _, handed = envfile.hand_to(path, owner.uid, owner.gid)  # the reader owns it
            said.append(handed)
        if not exists or changes:
            said.append(f"mode {envfile.MODE:04o}, owner {user}")
        return f"{path}: {'; '.join(said)}"

    if not exists:
        what = f"write {path} from the example (mode 0600, owner {user})"
    else:
        what = f"{path}: keep the operator's lines"
    if changes:
        what += ": " + "; ".join(changes)
    if exists and not private:
        what += f"; make it mode 0600, owner {user}"
    return Step(what, run=run)


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _read_own_file(path: str) -> str:
    """The text of ``path``, read through a descriptor that followed no link, of a file with no
    other name (a hard link to a file outside the data dir would be copied into one the service
    user owns)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise BootstrapError(
            f"{path}: cannot open it without following a link ({e.strerror})"
        ) from None
    with os.fdopen(fd, encoding="utf-8") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise BootstrapError(
                f"{path} is not a regular file with one name (links: {st.st_nlink}): fix it by "
                f"hand first"
            )
        return f.read()


def _refuse_bad_values(request: Request, merged: Mapping[str, str]) -> None:
    """A given value the router would refuse is bad input (nothing is written); a setting that is
    merely missing (a secret to fill in) is left to do, reported after the run."""
    environ = {k: v for k, v in merged.items() if k.startswith("LCHAT_")}
    try:
        config.load(env_file=os.devnull, environ=environ, systemd_present=False)
    except ConfigError as e:
        message = str(e)
        for name in request.given:
            if any(f"{name}{tail}" in message for tail in ("=", " must", " is not")):
                raise BootstrapError(message) from None


_ASSIGNMENT = r"^\s*(?:export\s+)?{name}\s*="
_COMMENTED = r"^\s*#\s*(?:export\s+)?{name}\s*="


def merge_env(
    text: str, current: Mapping[str, str], values: Mapping[str, str]
) -> tuple[str, list[str]]:
    """``text`` (an env file) with each of ``values`` set, every other line kept: the value's
    last assignment is rewritten (the one that wins), else its commented-out line in the example
    becomes it, else it is appended. Returns the text and what changed, in words (a secret's
    value is never in them)."""
    lines = text.splitlines()
    changes = []
    for name, value in values.items():
        if current.get(name) == value:
            continue
        line = envfile.env_line(name, value)
        shown = f"{name} (value not shown)" if _SECRET_NAME.search(name) else line
        assigned = [i for i, x in enumerate(lines) if re.match(_ASSIGNMENT.format(name=name), x)]
        commented = [i for i, x in enumerate(lines) if re.match(_COMMENTED.format(name=name), x)]
        if assigned:
            lines[assigned[-1]] = line
            changes.append(f"changed {shown}")
        elif commented:
            lines[commented[0]] = line
            changes.append(f"set {shown}")
        else:
            lines.append(line)
            changes.append(f"set {shown}")
    return "".join(f"{x}\n" for x in lines), changes


def _opt_steps(request: Request) -> list[Step]:
    layout = BuildLayout(request.path(DEFAULT_OPT_DIR))
    steps = []
    for path in (layout.root, layout.versions_dir, layout.live_dir):
        if os.path.isdir(path):
            steps.append(Step(path, already=f"{path} exists"))
            continue
        if os.path.lexists(path):
            raise BootstrapError(f"{path} exists and is not a directory")

        def run(path: str = path) -> str:
            os.makedirs(path, OPT_MODE, exist_ok=True)
            os.chmod(path, OPT_MODE)
            return f"{path}: created (mode {OPT_MODE:04o}, owner root: builds change as root)"

        steps.append(Step(f"create {path} (mode {OPT_MODE:04o}, owner root)", run=run))
    return steps


def shipped_units() -> list[str]:
    """The unit files shipped with the package (``ops/systemd`` in the checkout), sorted."""
    try:
        names = os.listdir(ops.UNITS_DIR)
    except FileNotFoundError:
        raise BootstrapError(
            f"{ops.UNITS_DIR}: missing: this lchat installation has no unit files (reinstall "
            f"the wheel)"
        ) from None
    return sorted(n for n in names if n.endswith((".service", ".target", ".timer")))


def render_unit(text: str, data_dir: str, user: str, group: str) -> str:
    """A shipped unit for this box: its data directory and service user and group."""
    text = re.sub(r"^User=.*$", f"User={user}", text, flags=re.MULTILINE)
    text = re.sub(r"^Group=.*$", f"Group={group}", text, flags=re.MULTILINE)
    if data_dir != DEFAULT_DATA_DIR:
        text = _UNIT_DATA_DIR.sub(data_dir, text)
    return text


def _unit_steps(request: Request, group: str) -> list[Step]:
    target_dir = request.path(UNITS_TARGET)
    steps = []
    for name in shipped_units():
        with open(os.path.join(ops.UNITS_DIR, name), encoding="utf-8") as f:
            rendered = render_unit(f.read(), request.data_dir, request.user, group)
        target = os.path.join(target_dir, name)
        try:
            with open(target, encoding="utf-8") as f:
                installed: str | None = f.read()
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            installed, mode = None, None
        if installed == rendered and mode == UNIT_MODE:
            steps.append(Step(target, already=f"{target} is installed"))
            continue

        def run(
            target: str = target, rendered: str = rendered, fresh: bool = installed is None
        ) -> str:
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            write_atomic(target, rendered.encode("utf-8"), UNIT_MODE)
            return f"{target}: {'installed' if fresh else 'updated'}"

        verb = "install" if installed is None else "update"
        steps.append(Step(f"{verb} {target}", run=run))
    return steps


def _systemctl_steps(request: Request, units_change: bool) -> list[Step]:
    wants = request.path(os.path.join(UNITS_TARGET, "multi-user.target.wants", ROUTER_UNIT))
    enabled = os.path.lexists(wants)
    enable_step = Step(
        f"systemctl enable {ROUTER_UNIT}",
        already=f"{ROUTER_UNIT} is enabled" if enabled else None,
    )
    # Also before a first enable: units installed by an earlier --no-systemctl run are new to
    # systemd.
    reload_step = Step(
        "systemctl daemon-reload",
        already=None if units_change or not enabled else "no unit changed: no daemon-reload needed",
    )
    steps = []
    for step, argv in (
        (reload_step, ["systemctl", "daemon-reload"]),
        (enable_step, ["systemctl", "enable", ROUTER_UNIT]),
    ):
        if step.already is not None:
            steps.append(step)
        elif request.no_systemctl is not None:
            steps.append(Step(step.what, skipped=request.no_systemctl))
        else:

            def run(argv: list[str] = argv) -> str:
                _run_command(argv)
                return " ".join(argv)

            steps.append(Step(step.what, run=run))
    return steps


RELAYOUT = "move every space's files into a directory of its own (lchat/relayout.py)"
SPACES_TARGET = "lchat-spaces.target"
SPACE_UNITS = ("lchat@*", "lchat-bot@*")


def _relayout_steps(request: Request) -> tuple[list[Step], bool]:
    """A box with spaces whose router.env leaves isolation on (``LCHAT_ISOLATION`` not ``off``):
    their flat files moved into their own directories and their rows rewritten
    (:mod:`lchat.relayout`); under systemd, with the router and every space stopped meanwhile
    and started again after (those that ran), and each always-on space's unit drop-in written
    (its own user: :func:`lchat.systemd_units.install_space`). Returns the steps and whether the
    box isolates its spaces once they are done. Reads the box; changes nothing."""
    from lchat import hosts, relayout, systemd_units
    from lchat.registry import Registry, RegistryError

    env_path = request.path(request.env_file)
    if request.root:
        # The rows name box paths (/data/<host>.db), not paths under --root.
        registry_file = request.path(os.path.join(request.data_dir, "registry.db"))
        if not os.path.exists(registry_file):
            return [], hosts.isolated(request.path(request.data_dir))
        skip = f"--root {request.root} given: run bootstrap on the box itself"
        return [Step(RELAYOUT, skipped=skip)], hosts.isolated(request.path(request.data_dir))
    if not os.path.isfile(env_path):
        return [], hosts.isolated(request.data_dir)
    try:
        cfg = config.load(
            env_file=env_path,
            # The values this run writes into router.env win (--set LCHAT_ISOLATION=off).
            environ={k: v for k, v in request.values.items() if k.startswith("LCHAT_")},
            systemd_present=request.no_systemctl is None,
        )
    except ConfigError as e:
        isolated = hosts.isolated(request.data_dir)
        if not os.path.exists(os.path.join(request.data_dir, "registry.db")):
            return [], isolated
        return [Step(RELAYOUT, skipped=f"{env_path} does not load ({e}): fix it, run again")], (
            isolated
        )
    isolated = hosts.isolated(cfg.data_dir)
    if not os.path.exists(cfg.registry):
        return [], isolated  # no spaces yet: the router lays the box out at its start
    registry = Registry(cfg.registry, time.time)
    try:
        rows = [r for r in registry.load() if r.kind == "instance"]
    except RegistryError as e:
        return [Step(RELAYOUT, skipped=f"cannot read the spaces' rows: {e}")], isolated
    if not rows:
        return [], isolated
    if cfg.isolation == "off":
        why = f"LCHAT_ISOLATION=off in {env_path}: every space runs as the router's user"
        if isolated:
            why += (
                f" (but {os.path.join(cfg.data_dir, hosts.SPACES)} exists: the router refuses that)"
            )
        return [Step(RELAYOUT, skipped=why)], isolated
    systemctl = request.no_systemctl is None
    steps = relayout.plan(
        cfg.data_dir, cfg.run_dir, registry, uids=cfg.space_uids, probe_running=not systemctl
    )
    to_do = any(s.to_do for s in steps)
    said = tuple(s.line for s in steps if s.action != "nothing")
    refused = [s.line for s in steps if s.action == "refuse"]
    out: list[Step] = []
    if not to_do:
        out.append(
            Step(
                RELAYOUT,
                already="every space's files are in a directory of its own",
                detail=said,
                left=refused,
            )
        )
    elif not systemctl and relayout.listening(cfg.admin_socket):
        out.append(
            Step(
                RELAYOUT,
                skipped=f"the router runs ({cfg.admin_socket} answers) and bootstrap cannot stop"
                f" it ({request.no_systemctl}): stop it and its spaces, then run bootstrap again",
                detail=said,
            )
        )
    else:
        was_active: list[str] = []
        if systemctl:

            def stop() -> str:
                was_active[:] = systemd_units.active_units(ROUTER_UNIT, *SPACE_UNITS)
                systemd_units.stop_units(ROUTER_UNIT, SPACES_TARGET)
                return f"stopped {ROUTER_UNIT} and {SPACES_TARGET} ({len(was_active)} units ran)"

            out.append(
                Step(
                    f"stop {ROUTER_UNIT} and {SPACES_TARGET}: no space runs while its files move",
                    run=_unit_errors(stop),
                )
            )
        left: list[str] = []

        def move() -> list[str]:
            # Planned again: under systemd, only now that nothing runs is a running space a refusal.
            fresh = relayout.plan(cfg.data_dir, cfg.run_dir, registry, uids=cfg.space_uids)
            report = relayout.apply(cfg.data_dir, cfg.run_dir, cfg.space_uids, registry, fresh)
            left.extend(report.refused)
            return report.done

        out.append(Step(RELAYOUT, run=move, detail=said, left=left))
        isolated = True
    if isolated and systemctl and cfg.units == "systemd":
        out.extend(_dropin_steps(cfg, registry, rows))
    if to_do and systemctl:

        def start() -> str:
            if not was_active:
                return "nothing to start again (no unit ran before)"
            systemd_units.start_units(*was_active)
            return f"started again: {' '.join(was_active)}"

        out.append(Step("start again the units that ran", run=_unit_errors(start)))
    return out, isolated


def _dropin_steps(cfg: BoxConfig, registry: Any, rows: Sequence[Any]) -> list[Step]:
    """Each always-on space's units run as its own user only with their drop-ins (the template
    refuses an isolated box without one): written where missing."""
    from lchat import hosts, isolation, systemd_units

    missing = [
        r.host
        for r in rows
        if not r.hibernate
        and not r.elsewhere
        and not os.path.exists(systemd_units.dropin_path(r.host))
    ]
    if not missing:
        return []

    def write() -> list[str]:
        done = []
        for host in missing:
            route = registry.get(host)
            if route is None or route.hibernate or route.elsewhere:
                continue
            socket = hosts.socket_path(cfg.run_dir, host, isolated=True)
            db = hosts.db_path(cfg.data_dir, host)
            if route.socket != socket or route.db_path not in ("", db):
                # Its files did not move (a refusal above): a unit started on the isolated
                # paths would serve an empty database beside the real one.
                done.append(f"{host}: no drop-in: its row still names {route.socket}")
                continue
            user = systemd_units.install_space(cfg, host, socket)
            uid = f"uid {user.uid}" if user is not None else "no user of its own"
            done.append(f"{host}: its units run as {isolation.user_name(host)} ({uid})")
        return done

    return [
        Step(
            "write each always-on space's unit drop-ins (its own user, its own directories)",
            run=_unit_errors(write),
            detail=tuple(systemd_units.dropin_path(h) for h in missing),
        )
    ]


def _unit_errors(
    run: Callable[[], str | list[str]],
) -> Callable[[], str | list[str]]:
    from lchat import systemd_units

    def checked() -> str | list[str]:
        try:
            return run()
        except systemd_units.UnitError as e:
            raise BootstrapError(str(e)) from e

    return checked


# --- applying it -------------------------------------------------------------------------------


@frozen
class Outcome:
    done: list[str]
    already: list[str]
    skipped: list[str]
    ok: list[str]  # settings checked and fine
    left: list[str]  # what the operator still has to do


def apply(request: Request, steps: Sequence[Step], probe: bool = True) -> Outcome:
    """Run the steps still to do, in order; then check what is left."""
    done, already, skipped = [], [], []
    for step in steps:
        if step.already is not None:
            already.append(step.already)
        elif step.skipped is not None:
            skipped.append(f"{step.what}: {step.skipped}")
        else:
            assert step.run is not None
            result = step.run()
            done.extend([result] if isinstance(result, str) else result)
    ok, left = [], []
    for step in steps:
        left.extend(step.left)
    if any(s.skipped and s.what.startswith("systemctl") for s in steps):
        where = "on the box" if request.root else "run them yourself"
        left.append(f"{where}: systemctl daemon-reload && systemctl enable {ROUTER_UNIT}")
    twistd = request.path(VENV_TWISTD)
    if not os.access(twistd, os.X_OK):
        left.append(
            f"install lchat into {os.path.dirname(os.path.dirname(VENV_TWISTD))} (the units run "
            f"{VENV_TWISTD}): python3 -m venv /opt/lchat/venv && /opt/lchat/venv/bin/pip install "
            f"lchat-<version>-*.whl"
        )
    if not BuildLayout(request.path(DEFAULT_OPT_DIR)).installed():
        left.append(
            f"no space build in {os.path.join(DEFAULT_OPT_DIR, 'versions')} yet: fetch one "
            f"(lchat release fetch <version>) before adding always-on spaces"
        )
    env_path = request.path(request.env_file)
    missing = _mesh_checklist(env_path)
    left.extend(missing)
    if probe:
        found_ok, found_left = _probe_as(request.user, env_path)
        ok.extend(found_ok)
        # config.load stops at the first missing mesh setting: the checklist already said it.
        left.extend(
            x
            for x in found_left
            if not (missing and ("LCHAT_MESH_SELF is set" in x or "LCHAT_MESH_SELF needs" in x))
        )
    left.append(f"then start the router (restart it if it runs): systemctl restart {ROUTER_UNIT}")
    return Outcome(done, already, skipped, ok, left)


def _mesh_checklist(env_path: str) -> list[str]:
    """What a mesh member's router.env still lacks (``config.load`` stops at the first)."""
    try:
        values = config.read_env_file(env_path)
    except ConfigError:
        return []  # the probe says what is wrong with the file
    if not values.get("LCHAT_MESH_SELF"):
        return []
    needed = {
        "LCHAT_MESH_DOMAINS": "the domains the mesh serves",
        "LCHAT_MESH_TOKEN": "the fleet's shared mesh token",
        "LCHAT_HIBERNATE_BUCKET": "the shared bucket, with its credentials",
    }
    return [
        f"set {name} in {env_path} ({why})" for name, why in needed.items() if not values.get(name)
    ]


def _run_command(argv: list[str]) -> None:
    binary = shutil.which(argv[0])
    if binary is None:
        raise BootstrapError(f"{argv[0]}: not found on PATH")
    try:
        done = subprocess.run(
            [binary, *argv[1:]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise BootstrapError(f"{' '.join(argv)}: no answer after 120 s") from None
    if done.returncode != 0:
        lines = [x.strip() for x in (done.stderr or done.stdout).splitlines() if x.strip()]
        raise BootstrapError(
            f"{' '.join(argv)} failed (exit {done.returncode}): {lines[-1] if lines else 'no output'}"
        )


def _ids(account: _Account) -> tuple[int, int]:
    return account.uid, account.gid


def _name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# --- the router's boot checks, as the service user ------------------------------------------------


def _probe_as(user: str, env_path: str) -> tuple[list[str], list[str]]:
    """Run :func:`probe` in a child as the service user, with the environment the router gets
    from its unit (none of this shell's variables: no AWS_* nor LCHAT_* of root's), so the checks
    see what the router will see, starting with whether it can read its env file.

    When the service user cannot run this Python at all (an interpreter in a private home, as on
    a development machine; never a box's /opt/lchat/venv), the checks run here instead, in that
    same environment, and the env file's ownership is judged from its owner and mode."""
    account = _owner(user)
    env = _router_environment(user)
    argv = [sys.executable, "-m", "lchat.cli.bootstrap", "--probe", env_path]
    drop: dict[str, Any] = {"user": account.uid, "group": account.gid, "extra_groups": []}
    setpriv = shutil.which("setpriv")  # util-linux, on every Debian box
    if setpriv is not None:
        ids = [f"--reuid={account.uid}", f"--regid={account.gid}", "--clear-groups"]
        argv, drop = [setpriv, *ids, "--no-new-privs", *argv], {}
    try:
        done = subprocess.run(
            argv,
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=PROBES_TIMEOUT,
            check=False,
            **drop,
        )
    except subprocess.TimeoutExpired:
        return [], [f"the settings checks did not finish in {PROBES_TIMEOUT:g} s (a bucket hangs?)"]
    except PermissionError:
        return _probe_here(user, account, env, env_path)
    try:
        found = json.loads(done.stdout)
        return list(found["ok"]), list(found["left"])
    except (ValueError, KeyError, TypeError):
        if setpriv is not None and "failed to execute" in done.stderr:
            return _probe_here(user, account, env, env_path)
        lines = [x.strip() for x in done.stderr.splitlines() if x.strip()]
        return [], [
            f"the settings checks failed to run as {user} (exit {done.returncode}): "
            f"{lines[-1] if lines else 'no output'}"
        ]


def _router_environment(user: str) -> dict[str, str]:
    """What the router's unit gives it: a PATH, the service user's HOME, nothing else."""
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": pwd.getpwnam(user).pw_dir or "/nonexistent",
        "LANG": "C.UTF-8",
    }


def _probe_here(
    user: str, account: _Account, env: Mapping[str, str], env_path: str
) -> tuple[list[str], list[str]]:
    st = os.stat(env_path)
    readable = (
        (st.st_uid == account.uid and st.st_mode & stat.S_IRUSR)
        or (st.st_gid == account.gid and st.st_mode & stat.S_IRGRP)
        or st.st_mode & stat.S_IROTH
    )
    if not readable:
        return [], [f"{env_path}: the service user {user} cannot read it (it must own it)"]
    os.environ.clear()  # this process ends after the checks: they see the router's environment
    os.environ.update(env)
    ok, left = probe(env_path, file_buckets=False)
    note = f"(checked as {_name_of(os.geteuid())}: {sys.executable} is not executable by {user})"
    return [*ok, note], left


def probe(env_path: str, *, file_buckets: bool = True) -> tuple[list[str], list[str]]:
    """The router's boot checks on ``env_path``, reusing its own code: ``config.load`` (every
    setting, the ACME ones among them), the AWS credential resolution (``lchat.buckets``), and a
    write probe of each bucket (hibernation, mesh, backup). Returns (fine, left to do).

    ``file_buckets=False`` (not running as the service user): a ``file:`` bucket is not probed,
    since the probe would leave directories in it the router could not write."""
    from lchat.buckets import boot_credentials

    ok: list[str] = []
    if not os.access(env_path, os.R_OK):
        return ok, [f"{env_path}: the service user cannot read it (it must own it, mode 0600)"]
    try:
        cfg = config.load(env_file=env_path, environ={}, systemd_present=False)
    except ConfigError as e:
        return ok, [f"fix {env_path}: {e}"]
    left = [f"{env_path}: {warning}" for warning in cfg.warnings]
    ok.append(f"{env_path}: the router accepts its settings")
    ok.append(_certificates_line(cfg))
    try:
        aws = boot_credentials(cfg)
    except ConfigError as e:
        return ok, [*left, f"AWS credentials (in {env_path}, or an instance role): {e}"]
    if cfg.hibernate is None:
        ok.append("no hibernation bucket (LCHAT_HIBERNATE_BUCKET unset): no hibernation, no mesh")
    buckets = _buckets(cfg, aws)
    if not file_buckets:
        for b in buckets:
            if b.bucket.startswith("file:"):
                ok.append(f"{b.stem}_BUCKET={b.bucket}: not probed (not as the service user)")
        buckets = [b for b in buckets if not b.bucket.startswith("file:")]
    if buckets:
        from lchat.cli import runner

        for stem, bucket, error in runner.run(lambda reactor: _probe_buckets(reactor, buckets)):
            if error is None:
                ok.append(f"{stem}_BUCKET={bucket}: reachable and writable")
            else:
                left.append(
                    f"{stem}_BUCKET={bucket}: the bucket is not usable: {error} (check its "
                    f"settings in {env_path} and the AWS credentials)"
                )
    return ok, left


def _certificates_line(cfg: BoxConfig) -> str:
    if cfg.https_addr is None:
        return "certificates: HTTPS is off (LCHAT_HTTPS_ADDR=off)"
    if cfg.acme is None:
        return (
            f"certificates: no issuance (LCHAT_ACME_DIRECTORY=off): the files in "
            f"{cfg.acme_cache} are served as they are"
        )
    wildcards = ", ".join("*." + d for d in cfg.wildcard_domains)
    return (
        f"certificates: issued by {cfg.acme.directory}; per-host (HTTP-01) "
        f"{'on' if cfg.http_addr else 'off: LCHAT_HTTP_ADDR is off'}; wildcards "
        + (f"{wildcards} over DNS-01 ({cfg.acme.dns_provider})" if wildcards else "none")
        + f"; cache {cfg.cert_cache}"
    )


@frozen
class _Bucket:
    stem: str
    bucket: str
    open: Callable[[Any], Any]  # reactor -> Deferred/coroutine of an ObjectStore
    key: str


def _buckets(cfg: BoxConfig, aws: Any) -> list[_Bucket]:
    """The buckets the router probes at start, with the keys it probes."""
    from lchat.backup.layout import Layout
    from lchat.buckets import open_mesh_bucket, probe_name
    from lchat.config import mesh_bucket
    from lchat.objstore import open_store
    from lchat.objstore.where import Where
    from lchat.threads import thread_runner

    def opener(where: Where) -> Callable[[Any], Any]:
        async def open_it(reactor: Any) -> Any:
            return open_store(reactor, where, thread_runner(reactor), aws, monotonic=time.monotonic)

        return open_it

    found = []
    probe_key = probe_name(cfg.box_id)
    hib = cfg.hibernate
    if hib is not None:
        found.append(
            _Bucket(
                "LCHAT_HIBERNATE",
                hib.bucket,
                opener(hib.where),
                hib.key(".lchat", "probe", probe_key),
            )
        )
        if cfg.mesh is not None and cfg.mesh.bucket is not None:
            beats = mesh_bucket(cfg)

            async def open_mesh(reactor: Any) -> Any:
                return await open_mesh_bucket(reactor, cfg)

            found.append(
                _Bucket(
                    "LCHAT_MESH", beats.bucket, open_mesh, beats.key(".lchat", "probe", probe_key)
                )
            )
    backup = cfg.backup
    if backup is not None:
        found.append(
            _Bucket(
                "LCHAT_BACKUP",
                backup.bucket,
                opener(backup.where),
                Layout(backup.prefix, backup.box).probe_key(),
            )
        )
    return found


async def _probe_buckets(reactor: Any, buckets: list[_Bucket]) -> list[tuple[str, str, str | None]]:
    from twisted.internet.defer import Deferred

    from lchat import objstore

    results: list[tuple[str, str, str | None]] = []
    for b in buckets:
        try:
            store = await b.open(reactor)
        except Exception as e:
            results.append((b.stem, b.bucket, str(e) or type(e).__name__))
            continue
        try:
            probing = Deferred.fromCoroutine(objstore.probe_writable(store, b.key))
            probing.addTimeout(PROBE_TIMEOUT, reactor)
            await probing
            results.append((b.stem, b.bucket, None))
        except Exception as e:
            results.append((b.stem, b.bucket, str(e) or type(e).__name__))
        finally:
            await store.close()
    return results


# --- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data-dir`` is the CLI's common option (LCHAT_DATA_DIR): here, where the box keeps its
    data and ``router.env`` (default /data)."""
    parser.add_argument(
        "--user",
        default=DEFAULT_USER,
        metavar="NAME",
        help=f"the service user the units run as (default {DEFAULT_USER}; created if missing)",
    )
    parser.add_argument(
        "--mesh-self",
        metavar="URL",
        help="this box's mesh URL (LCHAT_MESH_SELF), e.g. https://box-1.example.net",
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="NAME=VALUE",
        help="a router setting to put in router.env (repeatable; other lines are kept)",
    )
    parser.add_argument(
        "--root",
        metavar="DIR",
        help="prefix every path with DIR (tests, images): no user is created, no systemctl run",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    parser.add_argument(
        "--no-systemctl", action="store_true", help="install the units but run no systemctl"
    )


def run(args: argparse.Namespace, out: Callable[[str], None], fail: Callable[[str], int]) -> int:
    systemctl = shutil.which("systemctl")
    try:
        request = request_from_args(
            args,
            is_root=os.geteuid() == 0,
            systemctl=systemctl,
            systemd_running=os.path.isdir("/run/systemd/system"),
        )
        steps = plan(request)
        if request.dry_run:
            out("lchat bootstrap: the plan (--dry-run: nothing is changed)")
            for step in steps:
                if step.already is not None:
                    out(f"  already  {step.already}")
                elif step.skipped is not None:
                    out(f"  skip     {step.what}: {step.skipped}")
                else:
                    out(f"  to do    {step.what}")
                for line in step.detail:
                    out(f"             {line}")
            return 0
        outcome = apply(request, steps)
    except BootstrapError as e:
        return fail(str(e))
    out("lchat bootstrap:" + (" nothing to change" if not outcome.done else ""))
    for label, lines in (
        ("done", outcome.done),
        ("already", outcome.already),
        ("skipped", outcome.skipped),
        ("ok", outcome.ok),
        ("left", outcome.left),
    ):
        for line in lines:
            out(f"  {label:<8} {line}")
    return 0


def _probe_main(argv: list[str]) -> int:
    """``python -m lchat.cli.bootstrap --probe ENV``: :func:`probe`, as JSON on stdout."""
    ok, left = probe(argv[1])
    print(json.dumps({"ok": ok, "left": left}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        sys.exit(_probe_main(sys.argv[1:]))
    sys.exit("usage: lchat bootstrap ... (this module's own entry point is for its probes)")
