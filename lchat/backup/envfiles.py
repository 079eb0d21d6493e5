"""The spaces' env files in the backup, encrypted: a box rebuilt from the backup runs its spaces.

A space cannot start without ``<host>.env`` (it holds the space's admin token), and a staged bot
without ``<host>-bot.env``. They are secrets, so they reach the bucket only sealed with
``LCHAT_BACKUP_KEY`` (AES-256-GCM), under ``<prefix>/<box>/.env/<file name>``. Without the key
they are not backed up at all: the router refuses to start while any exists (:func:`on_disk`)
unless ``LCHAT_BACKUP_ENV=unprotected`` says the operator accepts it, and then it says how many
are not protected at every start, daily and whenever the count changes.

Whoever can write the bucket but holds no key must not be able to make a restore bring back a
secret other than the newest this box sealed for that file (docs/backup.md, "Sealed env files").
So each seal binds, as associated data, where it belongs and when it was made:

- the layout's prefix, the box segment and the file name: a blob moved from another file, box or
  prefix fails to open (:class:`SealError` saying so);
- a *generation* (nanoseconds since the epoch at sealing, never less than the last one this box
  knew plus one), carried in clear in the header and authenticated through the associated data;
- a sealed *manifest* per box (``<prefix>/<box>/.env/.manifest``, a name no env file can take)
  names each file's newest generation. A restore refuses a file older than its manifest entry
  (rolled back) and, unless the operator accepts it explicitly, one the manifest does not pin.
  Rolling the manifest back together with the files to an older set this box once wrote is not
  detectable from the bucket alone: the restore prints the manifest's date, and bucket
  versioning is the record of what was there.

Seals of the first format (``lchat-env-1``: the file name alone bound) open only when the caller
accepts them (``lchat backup restore --accept-unpinned-env``): they could have been swapped from
another box or rolled back. A router of this version re-seals every env file in the current
format at its start, so only a box that never ran it needs that.

An env file is uploaded when its content changed since the last upload (a sha256 kept in memory:
one upload per file per router start, then only on changes), then the manifest. A file the router
may not read (a systemd space whose env file is root's) is logged once and skipped.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import secrets
import struct
from collections.abc import Mapping

from attrs import frozen
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lchat import hosts
from lchat.backup.layout import Layout
from lchat.config import ConfigError
from lchat.files import write_atomic

MAGIC_V1 = b"lchat-env-1\n"  # the file name alone bound (before generations and the manifest)
MAGIC = b"lchat-env-2\n"  # + generation (8 bytes, big endian) + nonce (12) + ciphertext
MANIFEST_MAGIC = b"lchat-env-manifest-1\n"  # same framing, a JSON body
DIRECTORY = ".env"  # under <prefix>/<box>/: not a database name, never listed as one
MANIFEST_NAME = ".manifest"  # a name key_for refuses: no env file can take it
_GEN = struct.Struct(">Q")
_NONCE = 12
_TAG = 16


class SealError(ValueError):
    """The object is not a sealed env file (or manifest) for this place, name and key, or it is
    older than the manifest allows; the message says which, for the operator."""


@frozen
class Opened:
    content: bytes
    generation: int  # 0 for a first-format seal (it has none)
    legacy: bool


@frozen
class Manifest:
    generation: int
    files: Mapping[str, int]  # file name -> the newest generation sealed


def when(generation: int) -> str:
    """A generation as the time it was sealed (RFC 3339, UTC)."""
    moment = datetime.datetime.fromtimestamp(generation / 1e9, datetime.UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def key_for(box_path: str, file_name: str) -> str:
    """The object key of one env file (``box_path`` ends with a slash)."""
    if "/" in file_name or file_name.startswith("."):
        raise ValueError(f"not an env file name: {file_name!r}")
    return f"{box_path}{DIRECTORY}/{file_name}"


def manifest_key(box_path: str) -> str:
    return f"{box_path}{DIRECTORY}/{MANIFEST_NAME}"


def next_generation(now_ns: int, last: int) -> int:
    """A generation later than ``last`` whatever the clock did."""
    return max(now_ns, last + 1)


def _ad(kind: bytes, place: Layout, name: str, generation: int) -> bytes:
    # NUL never occurs in a prefix, a box segment or a file name: the fields cannot run together.
    fields = (b"lchat-env-2", kind, place.prefix.encode(), place.box.encode(), name.encode())
    return b"\0".join((*fields, str(generation).encode()))


def _seal(magic: bytes, ad: bytes, generation: int, content: bytes, key: bytes) -> bytes:
    nonce = secrets.token_bytes(_NONCE)
    return magic + _GEN.pack(generation) + nonce + AESGCM(key).encrypt(nonce, content, ad)


def _open(
    magic: bytes, kind: bytes, place: Layout, name: str, blob: bytes, key: bytes, where: str
) -> tuple[int, bytes]:
    """The generation and content of a ``magic`` seal of ``name`` (:class:`SealError` naming
    ``where`` when it is no such seal, or does not open)."""
    what = "env file" if kind == b"file" else "env manifest"
    if not blob.startswith(magic) or len(blob) < len(magic) + _GEN.size + _NONCE + _TAG:
        raise SealError(f"{where}: not a sealed {what}")
    (generation,) = _GEN.unpack_from(blob, len(magic))
    at = len(magic) + _GEN.size
    try:
        ad = _ad(kind, place, name, generation)
        return generation, AESGCM(key).decrypt(blob[at : at + _NONCE], blob[at + _NONCE :], ad)
    except InvalidTag:
        moved = "file, box or prefix" if kind == b"file" else "box or prefix"
        raise SealError(
            f"{where}: cannot open it with LCHAT_BACKUP_KEY: another key sealed it, or it was "
            f"sealed for another {moved} and moved here, or it was altered"
        ) from None


def seal(place: Layout, file_name: str, content: bytes, key: bytes, generation: int) -> bytes:
    """``content`` sealed for ``file_name`` of box ``place`` at ``generation``."""
    key_for("", file_name)  # a name an env file may have
    return _seal(MAGIC, _ad(b"file", place, file_name, generation), generation, content, key)


def unseal(
    place: Layout,
    file_name: str,
    blob: bytes,
    key: bytes,
    *,
    not_before: int | None = None,
    accept_legacy: bool = False,
) -> Opened:
    """Open a sealed env file found at ``file_name``'s key under box ``place``. ``not_before``:
    the generation the box's manifest names for it (an older one is refused as rolled back)."""
    where = f"{file_name} (box {place.box}, prefix {place.prefix or '(none)'})"
    if blob.startswith(MAGIC_V1):
        if not accept_legacy:
            raise SealError(
                f"{where}: sealed by an lchat older than this one (lchat-env-1), whose seal binds "
                f"only the file name: it could have been moved here from another box or prefix, "
                f"or rolled back. A router of this version re-seals it at its start; to accept it "
                f"anyway, re-run with --accept-unpinned-env (docs/backup.md)"
            )
        return Opened(_unseal_v1(where, file_name, blob, key), 0, legacy=True)
    generation, content = _open(MAGIC, b"file", place, file_name, blob, key, where)
    if not_before is not None and generation < not_before:
        raise SealError(
            f"{where}: rolled back: this copy was sealed at {when(generation)}, but the box's "
            f"env manifest names a newer one (sealed at {when(not_before)}); the bucket's "
            f"noncurrent versions may hold it (docs/backup.md)"
        )
    return Opened(content, generation, legacy=False)


def _unseal_v1(where: str, file_name: str, blob: bytes, key: bytes) -> bytes:
    if len(blob) < len(MAGIC_V1) + _NONCE + _TAG:
        raise SealError(f"{where}: not a sealed env file")
    nonce = blob[len(MAGIC_V1) : len(MAGIC_V1) + _NONCE]
    try:
        return AESGCM(key).decrypt(nonce, blob[len(MAGIC_V1) + _NONCE :], file_name.encode())
    except InvalidTag:
        raise SealError(
            f"{where}: cannot open it with LCHAT_BACKUP_KEY (another key sealed it, or it was "
            f"altered)"
        ) from None


def seal_manifest(place: Layout, manifest: Manifest, key: bytes) -> bytes:
    body = json.dumps({"files": dict(sorted(manifest.files.items()))}).encode()
    ad = _ad(b"manifest", place, MANIFEST_NAME, manifest.generation)
    return _seal(MANIFEST_MAGIC, ad, manifest.generation, body, key)


def unseal_manifest(place: Layout, blob: bytes, key: bytes) -> Manifest:
    where = f"the env manifest of box {place.box} (prefix {place.prefix or '(none)'})"
    generation, plain = _open(MANIFEST_MAGIC, b"manifest", place, MANIFEST_NAME, blob, key, where)
    try:
        files = json.loads(plain)["files"]
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in files.items()
        ):
            raise ValueError("files is not a map of names to generations")
    except (ValueError, KeyError, TypeError) as e:
        raise SealError(f"{where}: sealed, but not a manifest ({e})") from None
    return Manifest(generation, files)


def on_disk(data_dir: str) -> list[str]:
    """Blocking: the spaces' env files in ``data_dir`` (``<host>.env``, ``<host>-bot.env``; a
    file named so whether or not its row exists: a secret all the same), sorted file names. The
    router's own ``router.env`` is not one (``router`` is no space name)."""
    try:
        names = os.listdir(data_dir)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        stem = name.removesuffix(".env")
        if stem != name and hosts.is_normal(stem.removesuffix("-bot")):
            found.append(name)
    return sorted(found)


def refuse_unprotected(data_dir: str, *, key: bytes, unprotected_ok: bool) -> list[str]:
    """Blocking, at the router's start: the env files the backup will not hold (none with a
    key). Raises :class:`ConfigError`, one line naming both ways out, when there are some and
    the operator has not accepted that (``LCHAT_BACKUP_ENV=unprotected``)."""
    if key:
        return []
    files = on_disk(data_dir)
    if files and not unprotected_ok:
        raise ConfigError(
            f"LCHAT_BACKUP_BUCKET is set but LCHAT_BACKUP_KEY is not, and {len(files)} env "
            f"file{'s' if len(files) != 1 else ''} (space secrets, such as {files[0]}) would "
            f"not be in the backup: a box rebuilt from it could not start those spaces. Set "
            f"LCHAT_BACKUP_KEY (32 bytes in base64: openssl rand -base64 32; keep a copy off "
            f"the box), or LCHAT_BACKUP_ENV=unprotected to run without (docs/backup.md)"
        )
    return files


def read(path: str) -> tuple[bytes, str] | None:
    """Blocking: the file's content and its sha256, or None when it does not exist."""
    try:
        with open(path, "rb") as f:
            content = f.read()
    except FileNotFoundError:
        return None
    return content, hashlib.sha256(content).hexdigest()


def write_private(dir_fd: int, name: str, content: bytes, uid: int = -1, gid: int = -1) -> None:
    """Blocking: write ``name`` in the directory ``dir_fd``, mode 0600, owned by ``uid``/``gid``
    when given, atomically and following no name the directory's other writers could plant
    (:func:`lchat.files.write_atomic`)."""
    write_atomic(name, content, 0o600, uid=uid, gid=gid, dir_fd=dir_fd)
