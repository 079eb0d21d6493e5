"""An external Litestream's config (``LCHAT_BACKUP_CONFIG``, default ``/etc/litestream.yml``).

Two replicators on one database corrupt each other's state, so a space handed to the activator
(which replicates it itself) must not be listed there any more, and the router's own backup
(lchat.backup.service) leaves out every database it lists. Litestream names each database in a
``path:`` entry of its ``dbs:`` list; a line scan for ``path:`` values equal to the database's path
is enough for that question (block or flow style, quoted or not) and needs no YAML library.
"""

from __future__ import annotations

import os
import re

from lchat import config

VARIABLE = "LCHAT_BACKUP_CONFIG"

# `path: VALUE` at the start of a (list item) line, and `{path: VALUE, ...}` / `, path: VALUE` in
# flow mappings. Keys may be quoted.
_BLOCK = re.compile(r"""^\s*(?:-\s+)*["']?path["']?\s*:\s*(?P<value>.*)$""")
_FLOW = re.compile(r"""[{,]\s*["']?path["']?\s*:\s*(?P<value>"[^"]*"|'[^']*'|[^,}\]]*)""")


class BackupConfigError(Exception):
    """The config exists but cannot be read: whether it tracks a database is unknown."""


def config_path(cfg: config.BoxConfig) -> str:
    """``LCHAT_BACKUP_CONFIG`` as the router would see it: its env file, then the environment."""
    value = os.environ.get(VARIABLE, cfg.file_env.get(VARIABLE, "")).strip()
    return value or config.DEFAULTS[VARIABLE]


def tracks(config_file: str, db_path: str) -> bool:
    """True when ``config_file`` lists ``db_path``; an absent file tracks nothing."""
    return bool(listed(config_file) & _same_file_keys(db_path))


def listed(config_file: str) -> frozenset[str]:
    """Blocking: every spelling (as written, symlinks resolved) of the databases ``config_file``
    lists; empty when the file is absent. Raises :class:`BackupConfigError` when it exists but
    cannot be read."""
    try:
        with open(config_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return frozenset()
    except OSError as e:
        raise BackupConfigError(
            f"cannot read the backup config {config_file} ({e.strerror or e}), so cannot tell "
            f"which databases it tracks (set {VARIABLE} if it lives elsewhere)"
        ) from e
    return frozenset(key for value in db_paths(text) for key in _same_file_keys(value))


def db_paths(text: str) -> list[str]:
    """Every ``path:`` value in a Litestream-style YAML text, unquoted, comments removed."""
    found: list[str] = []
    for line in text.splitlines():
        line = _strip_comment(line)
        block = _BLOCK.match(line)
        if block is not None and not block.group("value").lstrip().startswith(("{", "[")):
            found.append(_unquote(block.group("value")))
        found.extend(_unquote(m.group("value")) for m in _FLOW.finditer(line))
    return [value for value in found if value]


def _same_file_keys(path: str) -> set[str]:
    """The spellings under which two paths name one file: as written, and symlinks resolved."""
    if not path or "\x00" in path:
        return set()
    return {os.path.normpath(path), os.path.realpath(path)}


def _strip_comment(line: str) -> str:
    """Drop a `` # comment`` outside quotes (YAML: ``#`` starts one after whitespace)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value
