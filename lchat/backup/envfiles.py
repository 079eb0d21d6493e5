"""The spaces' env files in the backup, encrypted: a box rebuilt from the backup runs its spaces.

A space cannot start without ``<host>.env`` (it holds the space's admin token), and a staged bot
without ``<host>-bot.env``. They are secrets, so they reach the bucket only sealed with
``LCHAT_BACKUP_KEY`` (AES-256-GCM, the file name bound in as associated data so one file's
ciphertext cannot be passed off as another's), under ``<prefix>/<box>/.env/<file name>``. Without
the key they are not backed up at all, and the router says so once at start.

An env file is uploaded when its content changed since the last upload (a sha256 kept in memory:
one upload per file per router start, then only on changes). A file the router may not read (a
systemd space whose env file is root's) is logged once and skipped.
"""

from __future__ import annotations

import hashlib
import os
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"lchat-env-1\n"
DIRECTORY = ".env"  # under <prefix>/<box>/: not a database name, never listed as one


class SealError(ValueError):
    """The object is not a sealed env file for this name and key."""


def key_for(box_path: str, file_name: str) -> str:
    """The object key of one env file (``box_path`` ends with a slash)."""
    if "/" in file_name or file_name.startswith("."):
        raise ValueError(f"not an env file name: {file_name!r}")
    return f"{box_path}{DIRECTORY}/{file_name}"


def seal(file_name: str, content: bytes, key: bytes) -> bytes:
    nonce = secrets.token_bytes(12)
    return MAGIC + nonce + AESGCM(key).encrypt(nonce, content, file_name.encode())


def unseal(file_name: str, blob: bytes, key: bytes) -> bytes:
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 12 + 16:
        raise SealError(f"{file_name}: not a sealed env file")
    nonce = blob[len(MAGIC) : len(MAGIC) + 12]
    try:
        return AESGCM(key).decrypt(nonce, blob[len(MAGIC) + 12 :], file_name.encode())
    except InvalidTag:
        raise SealError(
            f"{file_name}: cannot decrypt it with LCHAT_BACKUP_KEY (another key sealed it, or it "
            f"was altered)"
        ) from None


def read(path: str) -> tuple[bytes, str] | None:
    """Blocking: the file's content and its sha256, or None when it does not exist."""
    try:
        with open(path, "rb") as f:
            content = f.read()
    except FileNotFoundError:
        return None
    return content, hashlib.sha256(content).hexdigest()


def write_private(path: str, content: bytes, uid: int = -1, gid: int = -1) -> None:
    """Blocking: write ``path`` mode 0600 (atomically), owned by ``uid``/``gid`` when given."""
    tmp = f"{path}.restore-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, content)
        os.fsync(fd)
        if uid >= 0 or gid >= 0:
            os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
    os.replace(tmp, path)
