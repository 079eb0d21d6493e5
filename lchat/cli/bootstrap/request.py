"""What ``lchat bootstrap`` is asked (:class:`Request`, from the command line) and the givens it
works with: the paths and modes of a box, the service user's account, running a command."""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from attrs import frozen

from lchat import config, envfile
from lchat.builds import DEFAULT_OPT_DIR
from lchat.release import settings as release_settings

DEFAULT_USER = "lchat"
DEFAULT_DATA_DIR = os.path.dirname(config.DEFAULT_ENV_FILE)  # /data
ENV_NAME = os.path.basename(config.DEFAULT_ENV_FILE)  # router.env
DATA_MODE = 0o750


# A box that isolates its spaces (lchat/isolation.py): each space, its own user, traverses
# <data> to reach <data>/spaces/<host>; nothing else in it is open to other users.
ISOLATED_DATA_MODE = 0o711
ROUTER_UNIT = "lchat-router.service"
VENV_TWISTD = os.path.join(DEFAULT_OPT_DIR, "venv", "bin", "twistd")  # the units' ExecStart
NOLOGIN = "/usr/sbin/nologin"


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
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,30}")


# A data directory is written into unit files (ReadWritePaths= splits on spaces): plain paths only.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._/-]*")
_SYSTEM_DIRS = frozenset(
    "/ /bin /boot /dev /etc /home /lib /lib64 /opt /proc /root /run /sbin /srv /sys /tmp /usr "
    "/var".split()
)


class BootstrapError(Exception):
    """Bad input, or a box bootstrap cannot prepare; nothing was changed."""


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
    asked_dir = getattr(args, "data_dir", None)
    data_dir = _data_dir(asked_dir)
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
    if args.mesh_self is not None:
        values["LCHAT_MESH_SELF"] = _mesh_self(args.mesh_self)
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
        if values.get(name, value) != value:
            raise BootstrapError(f"--set {name} given twice, differently")
        values[name] = value
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
        # In the order given; LCHAT_DATA_DIR only when --data-dir was.
        given=tuple(n for n in values if n != "LCHAT_DATA_DIR" or asked_dir is not None),
        dry_run=args.dry_run,
        no_systemctl=no_systemctl,
    )
    if root and account_of(user) is None:
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


@frozen
class Account:
    uid: int
    gid: int
    group: str


def account_of(user: str) -> Account | None:
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    try:
        group = grp.getgrgid(entry.pw_gid).gr_name
    except KeyError:
        group = str(entry.pw_gid)
    return Account(entry.pw_uid, entry.pw_gid, group)


def owner_of(user: str) -> Account:
    account = account_of(user)
    if account is None:
        raise BootstrapError(f"the service user {user!r} does not exist")
    return account


def ids_of(account: Account) -> tuple[int, int]:
    return account.uid, account.gid


def name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
