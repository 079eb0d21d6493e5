"""Replacing a small file atomically: the one way lchat writes the files it must never leave half
written (env files with their tokens, certificates and keys, the clean-sleep marker, a sidecar's
schedule).

:func:`write_atomic` writes a temp file beside the target, created with ``O_EXCL`` and set to the
final mode before the first byte, fsyncs it, renames it over the target and (by default) fsyncs
the directory. A reader, or a crash at any point, sees the old file or the complete new one, never
a mix; a secret is never readable by anyone the mode excludes, even for an instant.
"""

from __future__ import annotations

import os
import secrets


def write_atomic(path: str, data: bytes, mode: int = 0o600, *, fsync_dir: bool = True) -> None:
    """Replace ``path`` with ``data``, mode exactly ``mode``, owned by this process's user.

    The temp file is ``.<name>.<random>.tmp`` in the same directory (same filesystem, so the
    rename is atomic; hidden and ``*.tmp``, so directory scanners such as the certificate store
    skip it) and is removed if anything fails before the rename. ``fsync_dir=False`` skips the
    directory fsync, for a file whose loss in a crash (the old version back) costs nothing."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask can only have removed bits: make the mode exact
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync_dir:
        fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make the entries of ``directory`` (a rename, a new file) durable."""
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
