"""The steps of ``lchat bootstrap``'s plan, each saying whether it is already so: the service user,
the data directory, ``router.env`` (:func:`merge_env`), ``/opt/lchat``, the systemd units
(:func:`render_unit`) and ``systemctl``."""

from __future__ import annotations

import grp
import os
import re
import shlex
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

from attrs import field, frozen

from lchat import config, envfile, files, ops, systemd_units
from lchat.builds import DEFAULT_OPT_DIR, BuildLayout
from lchat.cli.bootstrap.request import (
    DEFAULT_DATA_DIR,
    NOLOGIN,
    ROUTER_UNIT,
    Account,
    BootstrapError,
    Request,
    ids_of,
    name_of,
    owner_of,
)
from lchat.config import ConfigError
from lchat.files import write_atomic

OPT_MODE = 0o755
UNIT_MODE = 0o644
UNITS_TARGET = "/etc/systemd/system"
HOME_UNIT = "lchat-home.service"
HOME_BACKUP_UNIT = "lchat-backup-home.service"
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD")


# The data directory as the shipped units spell it: a path at the start of a value or argument.
_UNIT_DATA_DIR = re.compile(rf"(?<=[=\s]){re.escape(DEFAULT_DATA_DIR)}(?=/|\s|$)", re.MULTILINE)


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


def user_step(request: Request, account: Account | None) -> Step:
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
        systemd_units.run_command(argv, BootstrapError)
        made = owner_of(name)
        return f"created the service user {name} (uid {made.uid}, group {made.group})"

    return Step(f"create the service user {name}: {shlex.join(argv)}", run=run)


def data_dir_step(request: Request, account: Account | None, want: int) -> Step:
    """``want``: ``DATA_MODE``, or ``ISOLATED_DATA_MODE`` on a box that isolates its
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
    owned = st is not None and account is not None and (st.st_uid, st.st_gid) == ids_of(account)
    if st is not None and owned and mode == want:
        return Step(path, already=f"{path}: mode {want:04o}, owner {user}")

    def run() -> str:
        owner = owner_of(user)
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
            if (now.st_uid, now.st_gid) != ids_of(owner):
                os.fchown(fd, owner.uid, owner.gid)
                changed.append(f"owner {name_of(now.st_uid)} -> {user}")
        finally:
            os.close(fd)
        if created:
            return f"{path}: created, mode {want:04o}, owner {user}"
        return f"{path}: {', '.join(changed)}"

    if st is None:
        return Step(f"create {path}, mode {want:04o}, owner {user}", run=run)
    return Step(
        f"{path}: make it mode {want:04o} (is {mode:04o}), owner {user} (is {name_of(st.st_uid)})",
        run=run,
    )


def env_step(request: Request, account: Account | None) -> Step:
    path = request.path(request.env_file)
    exists = os.path.lexists(path)
    if exists and (os.path.islink(path) or not os.path.isfile(path)):
        # The data dir is the service user's: a link (or a second name of another file) there
        # would have root copy what it points to into a file handed to that user.
        raise BootstrapError(f"{path} exists and is not a regular file (a link is not followed)")
    source = path if exists else ops.ENV_EXAMPLE
    try:
        current = config.read_env_file(source, must_exist=True)
        text = _read_own_file(source) if exists else Path(source).read_text(encoding="utf-8")
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
        and (st.st_uid, st.st_gid) == ids_of(account)
        and not stat.S_IMODE(st.st_mode) & 0o077
    )
    user = request.user
    if exists and not changes and private:
        return Step(path, already=f"{path}: has the given values; private, owner {user}")

    def run() -> str:
        owner = owner_of(user)
        said = [] if exists else ["created from the example"]
        said.extend(changes)
        if changes or not exists:
            # The reader owns it: handed over on the descriptor, before the rename.
            write_atomic(path, new_text.encode("utf-8"), envfile.MODE, uid=owner.uid, gid=owner.gid)
            said.append(f"mode {envfile.MODE:04o}, owner {user}")
        elif not private:
            _, handed = envfile.hand_to(path, owner.uid, owner.gid)  # the reader owns it
            said.append(handed)
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


def merge_env(
    text: str, current: Mapping[str, str], values: Mapping[str, str]
) -> tuple[str, list[str]]:
    """``text`` (an env file) with each of ``values`` set by :func:`lchat.envfile.assign`, every
    other line kept. Returns the text and what changed, in words (a secret's value is never in
    them)."""
    lines = text.splitlines()
    changes = []
    for name, value in values.items():
        if current.get(name) == value:
            continue
        line = envfile.env_line(name, value)
        shown = f"{name} (value not shown)" if _SECRET_NAME.search(name) else line
        changes.append(f"{'changed' if envfile.assign(lines, name, value) else 'set'} {shown}")
    return "".join(f"{x}\n" for x in lines), changes


def opt_steps(request: Request) -> list[Step]:
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


def unit_steps(request: Request, group: str) -> list[Step]:
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


def systemctl_steps(request: Request, units_change: bool) -> list[Step]:
    wants = request.path(os.path.join(UNITS_TARGET, "multi-user.target.wants", ROUTER_UNIT))
    enabled = os.path.lexists(wants)
    # home.db's backup while the router is down: wanted by lchat-home (it starts and stops with
    # home, and is skipped on a box without LCHAT_BACKUP_BUCKET).
    home_wants = request.path(os.path.join(UNITS_TARGET, f"{HOME_UNIT}.wants", HOME_BACKUP_UNIT))
    home_enabled = os.path.lexists(home_wants)
    steps = []
    for argv, already in (
        # Also before a first enable: units installed by an earlier --no-systemctl run are new to
        # systemd.
        (
            ["systemctl", "daemon-reload"],
            "no unit changed: no daemon-reload needed" if enabled and not units_change else None,
        ),
        (["systemctl", "enable", ROUTER_UNIT], f"{ROUTER_UNIT} is enabled" if enabled else None),
        (
            ["systemctl", "enable", HOME_BACKUP_UNIT],
            f"{HOME_BACKUP_UNIT} is enabled" if home_enabled else None,
        ),
    ):

        def run(argv: list[str] = argv) -> str:
            systemd_units.run_command(argv, BootstrapError)
            return " ".join(argv)

        if already is not None:
            steps.append(Step(" ".join(argv), already=already))
        elif request.no_systemctl is not None:
            steps.append(Step(" ".join(argv), skipped=request.no_systemctl))
        else:
            steps.append(Step(" ".join(argv), run=run))
    return steps
