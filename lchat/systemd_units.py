"""systemd units for spaces: ``lchat@<host>`` (the template lives in ops/), a staged bot
sidecar's ``lchat-bot@<host>``, and the backup of its database ``lchat-backup@<host>``. Core,
not ``lchat.cli``: the CLI and ``lchat.release.deploy`` both drive them."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess

from lchat import hosts, isolation
from lchat.config import BoxConfig
from lchat.files import write_atomic
from lchat.isolation import IsolationError, SpaceUser

# `enable --now` waits for the start job; a unit that hangs must not hang the CLI forever.
SYSTEMCTL_TIMEOUT = 120.0
SYSTEMD_DIR = "/etc/systemd/system"
DROPIN = "10-space.conf"
# useradd for a user that only runs a service: no home, no login.
NO_LOGIN_USER = (
    "useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin"
)


class UnitError(Exception):
    """systemctl failed; the message is one line, fit for ``last_error``."""


def unit_name(host: str, *, sidecar: bool = False) -> str:
    """``lchat@<host>``, or the bot sidecar's ``lchat-bot@<host>``."""
    return f"{'lchat-bot' if sidecar else 'lchat'}@{hosts.normalise(host)}"


def backup_unit_name(host: str) -> str:
    """``lchat-backup@<host>``: the fleet backup of the space's database while the router is
    down (``lchat backup replicate --space``; ops/systemd/lchat-backup@.service)."""
    return f"lchat-backup@{hosts.normalise(host)}"


def enable_backup(host: str) -> None:
    """``systemctl enable lchat-backup@<host>``, not started here: it is wanted by
    ``lchat@<host>`` (its ``WantedBy=``), so it starts whenever the space's unit does and stops
    with it (``BindsTo=``)."""
    _systemctl("enable", backup_unit_name(host))


def enable_now(host: str, *, sidecar: bool = False) -> None:
    _systemctl("enable", "--now", unit_name(host, sidecar=sidecar))


def disable_now(host: str, *, sidecar: bool = False) -> None:
    _systemctl("disable", "--now", unit_name(host, sidecar=sidecar))


def restart(host: str, *, sidecar: bool = False) -> None:
    """``systemctl restart lchat@<host>`` (a deploy's restart onto a new build)."""
    _systemctl("restart", unit_name(host, sidecar=sidecar))


def install_space(cfg: BoxConfig, host: str, socket: str) -> SpaceUser | None:
    """On a box that isolates its spaces (lchat/isolation.py), before ``lchat@<host>`` starts:
    the space's user (``lchat-<sha>``, created with the uid its directory has or is given), its
    directories, and the drop-ins that run its units as that user with nothing of the box's but
    its own directories and its credential; then ``daemon-reload``. Idempotent; None (nothing
    done) on a box that does not isolate its spaces."""
    if not hosts.isolated(cfg.data_dir):
        return None
    try:
        user = isolation.prepare(cfg.data_dir, cfg.space_uids, host, socket)
        _ensure_system_user(user)
    except (isolation.IsolationError, OSError) as e:
        raise UnitError(f"{host}: cannot prepare its own user: {e}") from e
    for sidecar in (False, True):
        path = dropin_path(host, sidecar=sidecar)
        text = space_dropin(cfg, host, user, socket, sidecar=sidecar)
        try:
            os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
            write_atomic(path, text.encode(), 0o644)
        except OSError as e:
            raise UnitError(f"cannot write {path}: {e}") from e
    _systemctl("daemon-reload")
    return user


def dropin_path(host: str, *, sidecar: bool = False) -> str:
    """``/etc/systemd/system/lchat@<host>.service.d/10-space.conf`` (or lchat-bot@'s)."""
    return os.path.join(SYSTEMD_DIR, f"{unit_name(host, sidecar=sidecar)}.service.d", DROPIN)


def space_dropin(
    cfg: BoxConfig, host: str, user: SpaceUser, socket: str, *, sidecar: bool = False
) -> str:
    """The per-instance drop-in of an isolated space's unit (the template alone refuses to start
    on such a box: ``AssertPathExists=!<data>/spaces``, which this resets)."""
    own_dir = hosts.space_dir(cfg.data_dir, host)
    run_dir = os.path.dirname(socket)
    lines = [
        f"# Written by lchat (add-instance, bootstrap): {host} runs as its own user and sees of",
        f"# {cfg.data_dir} and {cfg.run_dir} only its own directories (lchat/isolation.py).",
        "[Unit]",
        "AssertPathExists=",
        "[Service]",
        f"User={user.name}",
        f"Group={user.name}",
    ]
    if not sidecar:
        # Its secrets as a credential, not environment: readable by this unit's user only
        # ($CREDENTIALS_DIRECTORY, a private ramfs), never inherited by the space's children.
        env_file = hosts.env_path(cfg.data_dir, host)
        lines += ["EnvironmentFile=", f"LoadCredential=env:{env_file}"]
        if os.path.dirname(run_dir).startswith("/run/"):
            lines += [
                f"RuntimeDirectory={os.path.relpath(run_dir, '/run')}",
                "RuntimeDirectoryMode=0700",
                "RuntimeDirectoryPreserve=yes",
            ]
    lines += [
        f"Environment=LCHAT_SOCKET={socket}",
        f"Environment=LCHAT_DB={hosts.db_path(cfg.data_dir, host)}",
        # An empty read-only tmpfs over each; its own directories bound back in: router.env,
        # acme/, the registry, the admin socket, every other space's files are simply absent.
        "ReadWritePaths=",
        f"TemporaryFileSystem={cfg.data_dir}:ro {cfg.run_dir}:ro",
        f"BindPaths={own_dir} {run_dir}",
    ]
    return "\n".join(lines) + "\n"


def _ensure_system_user(user: SpaceUser) -> None:
    """``user`` exists with its uid and a group of its own with the same number."""
    try:
        known = pwd.getpwnam(user.name)
    except KeyError:
        known = None
    if known is not None:
        if (known.pw_uid, known.pw_gid) != (user.uid, user.gid):
            raise IsolationError(
                f"user {user.name} exists with uid {known.pw_uid}, its directory is uid {user.uid}"
            )
        return
    try:
        grp.getgrnam(user.name)
    except KeyError:
        run_command(["groupadd", "--system", "--gid", str(user.gid), user.name], IsolationError)
    ids = ["--uid", str(user.uid), "--gid", str(user.gid)]
    run_command([*NO_LOGIN_USER.split(), *ids, user.name], IsolationError)


def _systemctl(*args: str) -> str:
    return run_command(["systemctl", *args], missing=" (LCHAT_UNITS=systemd)")


def run_command(argv: list[str], error: type[Exception] = UnitError, *, missing: str = "") -> str:
    """Run ``argv`` (its program found on PATH; ``missing`` says more when it is not); its
    output. Raises ``error`` in one line (the command, and the last line it said) when it cannot
    run, gives no answer in :data:`SYSTEMCTL_TIMEOUT` or fails."""
    command = " ".join(argv)
    binary = shutil.which(argv[0])
    if binary is None:
        raise error(f"{command}: {argv[0]} not found on PATH{missing}")
    try:
        done = subprocess.run(
            [binary, *argv[1:]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=SYSTEMCTL_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise error(f"{command}: no answer after {SYSTEMCTL_TIMEOUT:g}s") from None
    except OSError as e:
        raise error(f"{command}: {e.strerror or e}") from e
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        detail = lines[-1] if lines else "no output"
        raise error(f"{command} failed (exit {done.returncode}): {detail}")
    return done.stdout


# --- whole-box stops and starts (bootstrap's relayout: lchat/relayout.py) ---------------------------


def active_units(*patterns: str) -> list[str]:
    """The units matching ``patterns`` (``lchat@*``) that are active now, by name."""
    listed = _systemctl(
        "list-units", "--all", "--state=active", "--plain", "--no-legend", *patterns
    )
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def stop_units(*names: str) -> None:
    """``systemctl stop`` (waits for the stop jobs: ``lchat-spaces.target`` stops every space)."""
    _systemctl("stop", *names)


def start_units(*names: str) -> None:
    """``systemctl start`` (waits for the start jobs)."""
    _systemctl("start", *names)
