"""Which build each hibernating space last woke on: ``<data>/woke/<host>.json``.

The activator records it at every spawn (:func:`record`, called from
``lchat.hibernation.lifecycle``), resolving the space command's first word to the file it really
is (``live/<host>`` -> ``versions/<v>/space``) just before the exec. ``lchat rollback`` reads it
(:func:`read`): a space that woke on the build being rolled back from may have run that build's
(additive) migrations on its database, so going back is refused (docs/operations.md, "Deploys
and rollbacks").

One small file per host, written atomically: wakes of different hosts never contend, and a
reader sees the previous record or the new one. Recording never fails a wake: an error is logged
and the wake goes on.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from attrs import frozen
from twisted.logger import Logger

from lchat.files import write_atomic
from lchat.release.layout import BadVersion, check_version

DIRECTORY = "woke"
_log = Logger(namespace="lchat.activator")


@frozen
class Wake:
    host: str
    build: str  # the real path of the program that was started
    version: str | None  # versions/<v>/... when the build lies in a version tree
    at: float  # unix seconds of the spawn


def path_of(data_dir: str, host: str) -> str:
    return os.path.join(data_dir, DIRECTORY, f"{host}.json")


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


def record(data_dir: str, host: str, program: str, clock: Any = time.time) -> Wake:
    """Record that ``host`` is being started from ``program`` (resolved through its links; a
    bare command name found on PATH is recorded as it is, with no version)."""
    build = os.path.realpath(program) if os.path.isabs(program) else program
    wake = Wake(host=host, build=build, version=version_in(build), at=clock())
    doc = {"host": host, "build": build, "version": wake.version, "at": wake.at}
    directory = os.path.join(data_dir, DIRECTORY)
    os.makedirs(directory, 0o750, exist_ok=True)
    write_atomic(path_of(data_dir, host), json.dumps(doc).encode() + b"\n", 0o640, fsync_dir=False)
    return wake


def read(data_dir: str, host: str) -> Wake | None:
    """The last recorded wake of ``host`` on this box, or None (never woken, or unreadable)."""
    try:
        with open(path_of(data_dir, host), encoding="utf-8") as f:
            doc = json.load(f)
        return Wake(
            host=str(doc["host"]),
            build=str(doc["build"]),
            version=doc["version"] if isinstance(doc.get("version"), str) else None,
            at=float(doc["at"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
