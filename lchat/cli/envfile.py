"""A space's env file, ``<data>/<host>.env``: the only plaintext copy of its admin token.

Written atomically and private from the first byte: a temp file created 0600 with ``O_EXCL``, fsynced,
renamed over the target, then the directory fsynced. Lines other than ``LCHAT_ADMIN_TOKEN`` (an
operator's own settings) survive a rewrite.
"""

from __future__ import annotations

import os
import re
import secrets
import stat

from lchat import config

TOKEN_VAR = "LCHAT_ADMIN_TOKEN"  # noqa: S105 -- a variable name, not a secret
MODE = 0o600
_TOKEN_LINE = re.compile(rf"^\s*(?:export\s+)?{TOKEN_VAR}\s*=")


def read_token(path: str) -> str | None:
    """The token already in ``path``, or None when the file or the variable is absent."""
    return config.read_env_file(path).get(TOKEN_VAR) or None


def write_token(path: str, token: str) -> None:
    """Set ``LCHAT_ADMIN_TOKEN`` in ``path``, keeping any other lines, mode exactly 0600."""
    try:
        with open(path, encoding="utf-8") as f:
            kept = [line for line in f.read().splitlines() if not _TOKEN_LINE.match(line)]
    except FileNotFoundError:
        kept = []
    _write_private(path, "".join(f"{line}\n" for line in [*kept, f"{TOKEN_VAR}={token}"]))


def make_private(path: str) -> None:
    """Tighten an existing env file to 0600: it holds a secret."""
    if stat.S_IMODE(os.stat(path).st_mode) != MODE:
        os.chmod(path, MODE)


def _write_private(path: str, text: str) -> None:
    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), MODE)  # the umask can only have removed bits; make it exact
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
