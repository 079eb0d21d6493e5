"""The home store seam: everything home keeps, behind one small object-store-shaped interface.

Home keeps three kinds of data, all per user and never queried across users
(``/work/shared/seeds/planet-scale.txt``, "Home: the store is a seam"):

- the **vault blob** of a user: client-encrypted ciphertext the server never parses, with its
  last :data:`KEEP_VERSIONS` versions;
- the **user document** ``users/<uid>``: one JSON object holding the user's credentials, devices
  and link tokens' metadata;
- **write-once pointers** from a credential id (``creds``) or a link token's SHA-256 (``tokens``)
  to the uid that registered it.

Beside them, the **revocation feed** (``revoked/<sha256 of a link token>``): a short-lived
marker per revoked link token (:meth:`~VaultStore.mark_revoked`) that every home process polls
(:meth:`~VaultStore.revoked_since`, one request) to drop the token from its day-long cache
(lchat.home.api's ``TokenCache``, lchat.home.revocation). A marker only ever makes a cache
forget: the user document stays the authority, so a lost or late marker never grants access
beyond the cache's day, and a marker for a live token only costs that token a store read.

Two implementations keep the same contract (the conformance suite is ``tests/test_home_store.py``):
:class:`lchat.home.sqlite_store.SQLiteVaultStore` (the default, forever: one file,
``LCHAT_HOME_DB``) and :class:`lchat.home.s3_store.S3VaultStore` (one bucket, no database).

The contract:

- **Versions are opaque strings.** Callers (and clients, on the wire) only hand back a version
  the store gave them. :data:`NO_VERSION` (``"0"``) is the one universal sentinel: "nothing
  yet". Writing with ``expected_version="0"`` creates only; writing with any other version
  replaces only that version. A write whose expected version is not the current one raises
  :class:`Conflict` carrying the current version (``"0"`` if there is none), and writes nothing.
  Among concurrent writers from one version, exactly one wins.
- **A version that was never ours** is backend-specific, on purpose: SQLite can tell, and raises
  :class:`BadVersion` (the API answers 400); S3 cannot tell it from a stale version, so it raises
  :class:`Conflict` (409). Clients must treat both as "re-read and retry".
- **Keep-last-5 is the interface's promise**, not the storage's: :meth:`~VaultStore.
  list_blob_versions` lists at most the 5 newest versions (the current one first) and
  :meth:`~VaultStore.get_blob_version` reads only those. The S3 bucket may hold older versions
  until its lifecycle rule prunes them; nothing here ever shows them.
- **Pointers are never authoritative.** A pointer is written once and never rewritten or deleted
  (revoking a credential or token removes it from the user document only). Whoever resolves a
  pointer must re-load the user document and check that the credential or token is still listed
  there (:func:`resolve_checked` does exactly that), so a revoked credential's leftover pointer
  denies by construction.
- **Errors:** :class:`Conflict`, :class:`BadVersion`, :class:`PointerTaken` are answers about the
  data; :class:`StoreError` is the infrastructure failing (a bucket answering 5xx or not at all,
  a disk error, a locked or corrupt database): the API answers 503 and the client retries. All
  four derive from :class:`HomeStoreError`. Bad arguments (a malformed uid, pointer name or kind,
  a document that is not a JSON object) raise ``ValueError``: that is a bug in the caller.
- Everything is ``async def`` (no Deferreds inside); wrap with ``Deferred.fromCoroutine`` at a
  Deferred-speaking edge.

Nothing here knows what a credential or a device is: the user document's layout belongs to the
API (``lchat/home/api.py``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, Literal, NamedTuple, Protocol, get_args

from prometheus_client import Counter, Histogram
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from lchat.backoff import Backoff, Uniform

log = Logger()

NO_VERSION = "0"  # the universal "nothing yet" version
KEEP_VERSIONS = 5  # blob versions the interface keeps reachable (the current one included)

# The largest user document stored or parsed (its JSON): with LCHAT_HOME_MAX_DEVICES at most 200
# devices (~150 bytes each) it never comes near; it bounds what one account can make any call
# decode, copy and encode. A larger write is refused (DocumentTooLarge), a larger stored one is
# never parsed (StoreError: that account only gets 503s).
MAX_USER_DOC = 64 * 1024
# A link token's digest, a single-use record's name: a SHA-256, lowercase hex.
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

# Seconds a revocation marker lives: longer than any cache entry, and no longer (the feed every
# replica lists stays as short as it can be). A token is trusted from the cache only on the UTC
# day it was checked (lchat.home.revocation), so an entry that may still hold a token revoked at
# t ends by the end of t's day, under 24 hours later; the extra hour covers replicas' clocks.
MARKER_LIFETIME = 25 * 3600.0

PointerKind = Literal["creds", "tokens"]
POINTER_KINDS: frozenset[str] = frozenset(get_args(PointerKind))

# uids and pointer names become object keys (``blobs/<uid>``, ``creds/<name>``): a conservative
# alphabet (base64url, hex) with no "/" so that one user's key is never a prefix path of another's
# key space, and short enough for S3's 1024-byte keys with any prefix.
_UID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_POINTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,512}")

# update_user's retries after a lost CAS: jittered, so writers racing on one document spread out.
# Twenty attempts make a livelock practically impossible (each round, one writer wins).
UPDATE_ATTEMPTS = 20
UPDATE_BACKOFF = Backoff(0.005, 0.25, jitter=(0.5, 1.0))

Outcome = Literal["ok", "conflict", "bad_version", "pointer_taken", "too_large", "error"]

OPERATIONS = Counter(
    "lchat_home_store_operations_total",
    "Home store operations, by backend (sqlite, s3), operation and outcome (ok, conflict: a CAS "
    "lost to another writer or a stale version; bad_version: a version never issued (SQLite); "
    "pointer_taken; too_large: a user document over MAX_USER_DOC, not written; error: the store "
    "failed, the client saw a 503)",
    ["backend", "operation", "outcome"],
)
LATENCY = Histogram(
    "lchat_home_store_seconds",
    "Home store operation latency, by backend and operation (an S3 operation is one to a few "
    "requests; update_user includes its retries)",
    ["backend", "operation"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
CAS_CONFLICTS = Counter(
    "lchat_home_cas_conflicts_total",
    "Conditional writes that found another version in place, by what was written (blob, user); "
    "update_user retries these itself",
    ["backend", "kind"],
)


class HomeStoreError(Exception):
    """Base of the store's errors."""


class Conflict(HomeStoreError):
    """The expected version is not the current one; nothing was written. ``current_version`` is
    the version in place now (``"0"``: none), for the 409 answer and the client's re-read."""

    def __init__(self, current_version: str, what: str = "") -> None:
        super().__init__(
            f"{what + ': ' if what else ''}version conflict, current version {current_version!r}"
        )
        self.current_version = current_version


class BadVersion(HomeStoreError):
    """(SQLite only) the expected version is one this store never issued (answer 400). On S3 the
    same request is a :class:`Conflict`: S3 cannot tell a foreign version from a stale one."""


class PointerTaken(HomeStoreError):
    """A write-once pointer already names another uid (a colliding credential id or token)."""


class StoreError(HomeStoreError):
    """The store itself failed (unreachable, 5xx, timeouts, disk, a locked or corrupt database).
    Nothing is known about whether a write landed; the API answers 503 and the client retries."""


class DocumentTooLarge(HomeStoreError):
    """A user document over :data:`MAX_USER_DOC` bytes was not written (the API answers 413)."""


class Blob(NamedTuple):
    """A vault blob and its version (unpacks as ``data, version``)."""

    data: bytes
    version: str


class BlobVersion(NamedTuple):
    """One of the kept versions of a vault blob."""

    version: str
    modified: datetime  # timezone-aware UTC, when this version was written (the store's clock)
    size: int


class UserDoc(NamedTuple):
    """A user document and its version (unpacks as ``doc, version``). ``doc`` is the caller's own
    copy: mutating it changes nothing stored."""

    doc: dict[str, Any]
    version: str


class Revocation(NamedTuple):
    """One revocation marker: the revoked link token's SHA-256 (hex) and when it was marked."""

    digest: str
    marked: datetime  # timezone-aware UTC (S3: the object's LastModified; SQLite: our clock)


class Revocations(NamedTuple):
    """What :meth:`VaultStore.revoked_since` found, and the cursor to hand it next time."""

    markers: list[Revocation]
    cursor: str


# fn(current document or None if there is none) -> the new document, or None to write nothing.
UserUpdate = Callable[[dict[str, Any] | None], Mapping[str, Any] | None]


class VaultStore(Protocol):
    """Home's whole persistence surface. See the module docstring for the contract."""

    def describe(self) -> str:
        """Where the store is, for log lines (no secrets)."""
        ...

    async def check(self) -> None:
        """Prove at boot that the store is usable as configured; :class:`StoreError` with what
        to fix if not (misconfiguration fails at boot, never limps)."""
        ...

    async def get_blob(self, uid: str) -> Blob | None:
        """The current vault blob and its version, or None if the user has none."""
        ...

    async def put_blob(self, uid: str, data: bytes, expected_version: str) -> str:
        """Replace the blob if its version is ``expected_version`` (``"0"``: create only); return
        the new version. :class:`Conflict` (current version) or :class:`BadVersion` otherwise."""
        ...

    async def list_blob_versions(self, uid: str) -> list[BlobVersion]:
        """At most :data:`KEEP_VERSIONS` versions, newest (the current one) first; [] if none."""
        ...

    async def get_blob_version(self, uid: str, version: str) -> bytes | None:
        """The blob as it was at ``version``, if that is one of the kept versions; else None."""
        ...

    async def get_user(self, uid: str) -> UserDoc | None:
        """The user document and its version, or None if there is none."""
        ...

    async def put_user(self, uid: str, doc: Mapping[str, Any], expected_version: str) -> str:
        """Write the user document (a JSON object) if its version is ``expected_version``
        (``"0"``: create only); return the new version. Errors as :meth:`put_blob`."""
        ...

    async def update_user(self, uid: str, fn: UserUpdate) -> UserDoc | None:
        """Read, ``fn(doc)``, conditional write; on a conflict, again from the read.

        ``fn`` gets a fresh copy of the current document (None if there is none) and returns the
        new one, or None to leave it as it is (no write: e.g. a daily ``last_seen`` already set
        today). ``fn`` may run several times and must be free of side effects; an exception
        from it aborts the update (nothing written) and propagates. Returns what is stored
        after the call (None if there was nothing and ``fn`` wrote nothing). After
        :data:`UPDATE_ATTEMPTS` lost races, raises :class:`Conflict`.
        """
        ...

    async def put_pointer(self, kind: PointerKind, name: str, uid: str) -> None:
        """Create the pointer ``kind/name -> uid`` once. Writing the same pointer again is a no-op
        (a retried registration); one that names another uid raises :class:`PointerTaken`."""
        ...

    async def resolve_pointer(self, kind: PointerKind, name: str) -> str | None:
        """The uid a pointer names, or None. Never authoritative: see :func:`resolve_checked`."""
        ...

    async def mark_revoked(self, digest: str, uid: str, device: str) -> None:
        """Publish that the link token whose SHA-256 is ``digest`` (64 lowercase hex) was revoked.
        Idempotent. Call it after the user document no longer lists the token: the marker makes
        other processes forget it, the document is what denies it."""
        ...

    async def revoked_since(self, cursor: str) -> Revocations:
        """The markers written after ``cursor`` (``""``: every live one) and the cursor for the
        next call, in ONE store request. At least once: a marker may come back again, so callers
        apply them idempotently. Markers older than :data:`MARKER_LIFETIME` are not returned, and
        the call deletes them."""
        ...

    async def use_once(self, name: str, expires_at: float) -> bool:
        """Record that the single-use thing ``name`` (a SHA-256, 64 lowercase hex: of a WebAuthn
        challenge, a ceremony proof) was used: True the first time, False every later time, on
        every process sharing the store (one conditional write). ``expires_at`` (unix seconds) is
        when the thing stops being accepted anyway: the record may be dropped after it, never
        before."""
        ...

    async def close(self) -> None:
        """Release connections and threads."""
        ...


async def resolve_checked(
    store: VaultStore,
    kind: PointerKind,
    name: str,
    listed: Callable[[Mapping[str, Any]], bool],
) -> tuple[str, UserDoc] | None:
    """Resolve a pointer the only safe way: the uid it names, and that user's document, only if
    ``listed(doc)`` says the credential or token is still there; else None.

    A revoked credential's pointer names a uid whose document no longer lists it, and a deleted
    user's pointer names a uid with no document: both deny here.
    """
    uid = await store.resolve_pointer(kind, name)
    if uid is None:
        return None
    user = await store.get_user(uid)
    if user is None or not listed(user.doc):
        return None
    return uid, user


async def update_user_cas(
    store: VaultStore,
    backend: str,
    uid: str,
    fn: UserUpdate,
    *,
    clock: IReactorTime,
    rng: Uniform,
    attempts: int = UPDATE_ATTEMPTS,
) -> UserDoc | None:
    """:meth:`VaultStore.update_user` on top of ``get_user`` and ``put_user``, for every backend
    (see that method for the contract). Between lost races it sleeps a jittered backoff on
    ``clock``, so racing writers spread out rather than collide again in lockstep."""
    check_uid(uid)
    with measured(backend, "update_user", clock):
        current_version = NO_VERSION
        for attempt in range(1, attempts + 1):
            current = await store.get_user(uid)
            working = copy.deepcopy(current.doc) if current is not None else None
            new = fn(working)
            if new is None:
                return current
            expected = current.version if current is not None else NO_VERSION
            doc = dict(new)
            try:
                version = await store.put_user(uid, doc, expected)
            except Conflict as e:
                current_version = e.current_version
                if attempt < attempts:
                    delay = UPDATE_BACKOFF.jittered(UPDATE_BACKOFF.delay(attempt), rng)
                    await deferLater(clock, delay)
                continue
            return UserDoc(doc, version)
        log.warn(
            "home store ({backend}): a user document update lost {attempts} races in a row and "
            "gave up (the client gets a conflict); many clients of one user writing at once, or a "
            "store answering slowly, cause this",
            backend=backend,
            attempts=attempts,
        )
        raise Conflict(current_version, f"user document still contended after {attempts} attempts")


# -- helpers for the implementations -------------------------------------------------------------


def check_uid(uid: str) -> str:
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise ValueError(f"not a uid (1-128 of A-Z a-z 0-9 _ -): {uid!r}")
    return uid


def check_pointer(kind: str, name: str) -> None:
    if kind not in POINTER_KINDS:
        raise ValueError(f"pointer kind must be one of {sorted(POINTER_KINDS)}, not {kind!r}")
    if not isinstance(name, str) or not _POINTER_NAME.fullmatch(name):
        raise ValueError(f"not a pointer name (1-512 of A-Z a-z 0-9 _ -): {name!r}")


def check_digest(digest: str, what: str = "SHA-256 digest") -> str:
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
        raise ValueError(f"not a {what} (64 lowercase hex): {digest!r}")
    return digest


def encode_user(doc: Mapping[str, Any]) -> bytes:
    """The stored form of a user document: compact, key-sorted JSON (one spelling per document).
    :class:`DocumentTooLarge` past :data:`MAX_USER_DOC` bytes."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"a user document is a JSON object, not {type(doc).__name__}")
    try:
        data = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"the user document is not JSON: {e}") from e
    if len(data) > MAX_USER_DOC:
        raise DocumentTooLarge(f"a user document is at most {MAX_USER_DOC} bytes, not {len(data)}")
    return data


def decode_user(data: bytes, where: str) -> dict[str, Any]:
    if len(data) > MAX_USER_DOC:
        # Never parsed: one account must not make a call spend long on the reactor.
        log.error(
            "home store: {where} is {size} bytes, over {cap}: not read (that account is answered "
            "503; it was written before the cap, delete or trim it)",
            where=where,
            size=len(data),
            cap=MAX_USER_DOC,
        )
        raise StoreError(f"{where}: the stored user document is over {MAX_USER_DOC} bytes")
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise StoreError(f"{where}: the stored user document is not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise StoreError(f"{where}: the stored user document is not a JSON object")
    return doc


# What a failed operation counts as (the first class it is an instance of); anything else: error.
_OUTCOMES: tuple[tuple[type[HomeStoreError], Outcome], ...] = (
    (Conflict, "conflict"),
    (BadVersion, "bad_version"),
    (PointerTaken, "pointer_taken"),
    (DocumentTooLarge, "too_large"),
)


@contextlib.contextmanager
def measured(backend: str, operation: str, clock: IReactorTime) -> Iterator[None]:
    """Count one operation by outcome and time it (wraps awaits: it is entered on the reactor)."""
    started = clock.seconds()
    outcome: Outcome = "ok"
    try:
        yield
    except BaseException as e:
        outcome = next((o for kind, o in _OUTCOMES if isinstance(e, kind)), "error")
        raise
    finally:
        OPERATIONS.labels(backend, operation, outcome).inc()
        LATENCY.labels(backend, operation).observe(max(0.0, clock.seconds() - started))


__all__ = [
    "KEEP_VERSIONS",
    "MARKER_LIFETIME",
    "MAX_USER_DOC",
    "NO_VERSION",
    "POINTER_KINDS",
    "BadVersion",
    "Blob",
    "BlobVersion",
    "Conflict",
    "DocumentTooLarge",
    "HomeStoreError",
    "PointerKind",
    "PointerTaken",
    "Revocation",
    "Revocations",
    "StoreError",
    "UserDoc",
    "UserUpdate",
    "VaultStore",
    "resolve_checked",
    "update_user_cas",
]
