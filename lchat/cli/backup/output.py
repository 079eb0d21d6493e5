"""What every ``lchat backup`` action prints by, and the refusal each raises: one ``lchat:
error:`` line (:class:`BackupCliError`), tables, times and sizes."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

from lchat.backup.layout import BadName
from lchat.objstore import UTC, ObjectStoreError
from lchat.registry import RegistryError
from lchat.replica import restore as restore_mod

Out = Callable[[str], None]


class BackupCliError(Exception):
    """A refusal or failure: one ``lchat: error:`` line, exit status 1."""


ERRORS = (
    BackupCliError,
    BadName,
    restore_mod.RestoreError,
    ObjectStoreError,
    RegistryError,
)


def table(rows: Sequence[Sequence[str]], out: Out) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def iso(when: datetime.datetime, timespec: str = "seconds") -> str:
    return when.astimezone(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


def size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def one_line(text: str) -> str:
    return " ".join(text.split())


def error_line(message: str) -> str:
    return f"lchat: error: {one_line(message)}"
