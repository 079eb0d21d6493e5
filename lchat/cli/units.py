"""systemd units for spaces: ``lchat@<host>`` (the template lives in ops/), and a staged bot
sidecar's ``lchat-bot@<host>``."""

from __future__ import annotations

import shutil
import subprocess

from lchat import hosts

# `enable --now` waits for the start job; a unit that hangs must not hang the CLI forever.
SYSTEMCTL_TIMEOUT = 120.0


class UnitError(Exception):
    """systemctl failed; the message is one line, fit for ``last_error``."""


def unit_name(host: str, *, sidecar: bool = False) -> str:
    """``lchat@<host>``, or the bot sidecar's ``lchat-bot@<host>``."""
    return f"{'lchat-bot' if sidecar else 'lchat'}@{hosts.normalise(host)}"


def enable_now(host: str, *, sidecar: bool = False) -> None:
    _systemctl("enable", "--now", unit_name(host, sidecar=sidecar))


def disable_now(host: str, *, sidecar: bool = False) -> None:
    _systemctl("disable", "--now", unit_name(host, sidecar=sidecar))


def restart(host: str, *, sidecar: bool = False) -> None:
    """``systemctl restart lchat@<host>`` (a deploy's restart onto a new build)."""
    _systemctl("restart", unit_name(host, sidecar=sidecar))


def _systemctl(*args: str) -> None:
    command = "systemctl " + " ".join(args)
    binary = shutil.which("systemctl")
    if binary is None:
        raise UnitError(f"{command}: systemctl not found on PATH (LCHAT_UNITS=systemd)")
    try:
        done = subprocess.run(
            [binary, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=SYSTEMCTL_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise UnitError(f"{command}: no answer after {SYSTEMCTL_TIMEOUT:g}s") from None
    except OSError as e:
        raise UnitError(f"{command}: {e.strerror or e}") from e
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        detail = lines[-1] if lines else "no output"
        raise UnitError(f"{command} failed (exit {done.returncode}): {detail}")
