"""Where certificates go: the local directory the TLS listener serves, and the shared cache.

**Local** (:class:`LocalCache`): ``LCHAT_ACME_CACHE``, the layout :mod:`lchat.tls` reads —
``<host>.pem`` / ``wildcard-<domain>.pem``, key then chain, written atomically with mode 0600 in a
directory kept at 0700. It is the only thing TLS ever reads, so a bucket outage never breaks TLS.

**Shared** (:class:`SharedCache`, ``LCHAT_CERT_CACHE=s3``): the same certificates in the bucket, so
every box of a mesh can present any space's certificate:

- ``<prefix>/certs/<file stem>.json``: the chain in clear (it is public) and the private key
  encrypted with AES-256-GCM under ``LCHAT_CERT_CACHE_KEY``; the associated data binds the key to
  its name and chain, so a ciphertext moved to another name or chain does not decrypt;
- ``<prefix>/certs/locks/<file stem>.json``: a short lease (:mod:`lchat.lease`) held while one box
  issues that name, so a fleet places one order per name, not one per box;
- ``<prefix>/certs/challenges/<token>``: an HTTP-01 key authorisation while its order runs, so the
  box the CA happens to reach can answer for the box that ordered. It carries an HMAC-SHA256 over
  the token and the key authorisation, keyed from ``LCHAT_CERT_CACHE_KEY`` (a key derived for this
  use only): a box answers a bucket object only when the MAC verifies, so someone who can write to
  the bucket but holds no cache key cannot have the fleet answer *their* order's challenge (which
  would give them a real certificate for a fleet name).

Every box lists ``<prefix>/certs/`` every ``LCHAT_CERT_CACHE_SYNC`` (one LIST; a GET only for an
object whose ETag changed) and installs anything newer than its local copy; a certificate this box
has and the bucket lacks (or has older) is uploaded, which also heals a failed upload.

**Key rotation** (``LCHAT_CERT_CACHE_KEY_PREVIOUS``, docs/secrets.md): an entry is opened with the
key its ``key_id`` names, the current key or the previous one; it is only ever sealed with the
current key. An entry read under the previous key is re-sealed under the current key at once, by the
sync that read it (every entry is read in a box's first round after its restart), with ``If-Match``
on the ETag it read: a newer upload made meanwhile (by a box still on the old key, say) is never
overwritten, it is simply read — and re-sealed — in the next round. Each such read counts in
``lchat_cert_cache_previous_key_total``.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from collections.abc import Callable
from typing import Any, Literal

from attrs import frozen
from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from prometheus_client import Counter
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from lchat import certfiles, hosts, lease
from lchat.certfiles import issuer_name
from lchat.deferutil import settled
from lchat.files import write_atomic
from lchat.objstore import NotFound, ObjectStore, ObjectStoreError, PreconditionFailed
from lchat.threads import RunInThread

FORMAT = "lchat-cert/1"
CHALLENGE_FORMAT = "lchat-challenge/1"
MAX_CHALLENGE_BYTES = 4096  # a key authorisation is a token, a dot and a 43-character thumbprint
STOP_BUDGET = 5.0
Kind = Literal["host", "wildcard"]

_log = Logger(namespace="lchat.acme")

_sync = Counter(
    "lchat_cert_cache_sync_total",
    "Shared certificate cache operations by outcome",
    ["operation", "outcome"],
)
for _op, _outcomes in (
    ("list", ("ok", "error")),
    ("install", ("ok", "refused")),
    ("upload", ("ok", "error")),
):
    for _o in _outcomes:
        _sync.labels(_op, _o)

_previous_key = Counter(
    "lchat_cert_cache_previous_key_total",
    "Shared cache entries read under LCHAT_CERT_CACHE_KEY_PREVIOUS, by what followed: resealed "
    "(under LCHAT_CERT_CACHE_KEY), raced (a newer upload came first; read again next round), "
    "failed (the bucket refused; tried again next round), read (by the issuer, not resealed). "
    "Flat on every box after each box's first round: no entry needs the previous key any more",
    ["outcome"],
)
for _o in ("resealed", "raced", "failed", "read"):
    _previous_key.labels(_o)


@frozen
class CertName:
    """A certificate we can issue: one host, or ``*.<domain>``."""

    kind: Kind
    name: str  # the host, or the domain of a wildcard (normalised)

    @classmethod
    def wildcard(cls, domain: str) -> CertName:
        return cls("wildcard", hosts.normalise(domain))

    @classmethod
    def from_stem(cls, stem: str) -> CertName | None:
        """The name a file stem (``chat.example.com``, ``wildcard-example.com``) stands for."""
        role = certfiles.role_of(stem + certfiles.SUFFIX)
        if role is None or role[0] == "default":
            return None
        return cls("wildcard" if role[0] == "wildcard" else "host", role[1])

    @property
    def label(self) -> str:
        """``chat.example.com`` or ``*.example.com``: what logs and metrics call it."""
        return "*." + self.name if self.kind == "wildcard" else self.name

    @property
    def stem(self) -> str:
        return certfiles.WILDCARD_PREFIX + self.name if self.kind == "wildcard" else self.name

    def path(self, directory: str) -> str:
        if self.kind == "wildcard":
            return certfiles.wildcard_cert_path(directory, self.name)
        return certfiles.cert_path(directory, self.name)


@frozen
class Certificate:
    """A key and its chain, with what we need to compare copies."""

    key_pem: bytes
    chain_pem: bytes
    not_after: float
    serial: int
    issuer: str
    not_before: float | None = None
    origin: str = ""  # the ACME directory that issued it; "" = placed by hand (or unknown)

    @classmethod
    def parse(cls, key_pem: bytes, chain_pem: bytes, origin: str = "") -> Certificate:
        leaf = x509.load_pem_x509_certificate(chain_pem)
        return cls(
            key_pem,
            chain_pem,
            leaf.not_valid_after_utc.timestamp(),
            leaf.serial_number,
            issuer_name(leaf),
            leaf.not_valid_before_utc.timestamp(),
            origin,
        )


def split_pem(data: bytes) -> tuple[bytes, bytes]:
    """A ``.pem`` file's (private key, chain) blocks."""
    key = b""
    chain = []
    for match in certfiles.PEM_BLOCK.finditer(data):
        if match.group(1).endswith(b"PRIVATE KEY"):
            key = match.group(0)
        elif match.group(1) == b"CERTIFICATE":
            chain.append(match.group(0))
    return key, b"".join(c if c.endswith(b"\n") else c + b"\n" for c in chain)


# --- local ---------------------------------------------------------------------------------------


class LocalCache:
    """The certificate directory. Blocking methods: call them in a thread."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)

    def ensure_directory(self) -> None:
        """Create the directory 0700, or tighten an existing one to 0700: it holds keys."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        mode = stat.S_IMODE(os.stat(self.directory).st_mode)
        if mode & 0o077:
            os.chmod(self.directory, mode & 0o700)
            _log.warn(
                "acme: {directory} was mode {mode:04o}; tightened to {new:04o} (it holds keys)",
                directory=self.directory,
                mode=mode,
                new=mode & 0o700,
            )

    def install(self, name: CertName, cert: Certificate) -> str:
        key = cert.key_pem if cert.key_pem.endswith(b"\n") else cert.key_pem + b"\n"
        path = name.path(self.directory)
        # The first line says which CA issued it (what the sync and renewal go by).
        marker = (
            certfiles.ORIGIN_MARKER + cert.origin.encode("ascii") + b"\n" if cert.origin else b""
        )
        write_atomic(path, marker + key + cert.chain_pem, 0o600)
        return path

    def read(self, name: CertName) -> Certificate | None:
        try:
            with open(name.path(self.directory), "rb") as f:
                data = f.read(1 << 20)
        except OSError:
            return None
        key, chain = split_pem(data)
        if not key or not chain:
            return None
        try:
            return Certificate.parse(key, chain, certfiles.origin_of(data))
        except ValueError:
            return None


# --- shared --------------------------------------------------------------------------------------


class CacheEntryError(Exception):
    """An object in the shared cache we cannot use (corrupt, another key, wrong name)."""


def key_id(key: bytes) -> str:
    """A short public fingerprint of the cache key: tells boxes with different keys apart."""
    return hashlib.sha256(b"lchat cert cache key\0" + key).hexdigest()[:16]


def _aad(name: CertName, chain_pem: bytes, origin: str) -> bytes:
    # Name, chain and issuing directory: none can be changed without the key.
    return b"\0".join(
        (FORMAT.encode(), name.stem.encode(), hashlib.sha256(chain_pem).digest(), origin.encode())
    )


def seal(name: CertName, cert: Certificate, key: bytes, issued_by: str) -> bytes:
    """The bucket object for ``cert``: chain in clear, private key AES-256-GCM encrypted."""
    nonce = secrets.token_bytes(12)
    ciphertext = AESGCM(key).encrypt(nonce, cert.key_pem, _aad(name, cert.chain_pem, cert.origin))
    body = {
        "format": FORMAT,
        "name": name.label,
        "kind": name.kind,
        "not_after": _rfc3339(cert.not_after),
        "serial": f"{cert.serial:x}",
        "issuer": cert.issuer,
        "issued_by": issued_by,
        "directory": cert.origin,
        "chain": cert.chain_pem.decode("ascii"),
        "key": {
            "alg": "AES-256-GCM",
            "key_id": key_id(key),
            "nonce": base64.b64encode(nonce).decode(),
            "ciphertext": base64.b64encode(ciphertext).decode(),
        },
    }
    return json.dumps(body, indent=1).encode()


def describe(body: bytes) -> dict[str, Any]:
    """The public fields of a bucket object (for ``lchat certs``), without decrypting."""
    try:
        data = json.loads(body)
    except ValueError as e:
        raise CacheEntryError(f"not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CacheEntryError("not a certificate cache entry (format)")
    return data


def sealed_key_id(body: bytes) -> str | None:
    """The ``key_id`` an entry says its private key is sealed with (None: unreadable entry)."""
    try:
        found = describe(body).get("key", {}).get("key_id")
    except (CacheEntryError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def unseal(name: CertName, body: bytes, key: bytes, previous: bytes = b"") -> Certificate:
    """The certificate in ``body``, its key decrypted with ``key`` or, when the entry names it,
    ``previous`` (a key rotation's old key; b"": none). :class:`CacheEntryError` otherwise."""
    data = describe(body)
    try:
        chain = str(data["chain"]).encode("ascii")
        sealed = data["key"]
        if previous and sealed.get("key_id") == key_id(previous):
            key = previous
        elif sealed.get("key_id") != key_id(key):
            ours = f"ours is {key_id(key)}"
            if previous:
                ours = (
                    f"ours are {key_id(key)} (LCHAT_CERT_CACHE_KEY) and {key_id(previous)} "
                    f"(LCHAT_CERT_CACHE_KEY_PREVIOUS)"
                )
            raise CacheEntryError(
                f"its key is encrypted with cache key {sealed.get('key_id')}, {ours} "
                f"(LCHAT_CERT_CACHE_KEY must be the same on every box)"
            )
        nonce = base64.b64decode(sealed["nonce"], validate=True)
        ciphertext = base64.b64decode(sealed["ciphertext"], validate=True)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CacheEntryError(f"malformed entry: {e}") from None
    origin = data.get("directory")
    if not isinstance(origin, str) or not re.fullmatch(r"[\x21-\x7e]{0,2000}", origin):
        raise CacheEntryError("malformed entry: its directory is not a URL")
    try:
        key_pem = AESGCM(key).decrypt(nonce, ciphertext, _aad(name, chain, origin))
    except (InvalidTag, ValueError):
        raise CacheEntryError(
            "its private key does not decrypt for this name, chain and directory (tampered or "
            "moved)"
        ) from None
    try:
        cert = Certificate.parse(key_pem, chain, origin)
    except ValueError as e:
        raise CacheEntryError(f"its chain does not parse: {e}") from None
    return cert


class ChallengeRefused(CacheEntryError):
    """A ``certs/challenges/`` object no box of this fleet wrote: its MAC does not verify under
    the cache key (or the previous one), or it is not a challenge object at all."""


def challenge_key(key: bytes) -> bytes:
    """The MAC key of challenge objects: derived from the cache key for this one use (HMAC as a
    PRF with its own label), so no MAC is ever made with the key that seals private keys."""
    return hmac.new(key, b"lchat http-01 challenge mac v1", hashlib.sha256).digest()


def _challenge_mac(key: bytes, token: str, key_authorization: str) -> str:
    message = b"\0".join(
        (CHALLENGE_FORMAT.encode(), token.encode("ascii"), key_authorization.encode("ascii"))
    )
    digest = hmac.new(challenge_key(key), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii")


def seal_challenge(token: str, key_authorization: str, key: bytes) -> bytes:
    """The bucket object for an HTTP-01 answer: the key authorisation (it is public: the CA
    fetches it over plain HTTP) and a MAC binding it to ``token`` under the cache key."""
    body = {
        "format": CHALLENGE_FORMAT,
        "key_id": key_id(key),
        "key_authorization": key_authorization,
        "mac": _challenge_mac(key, token, key_authorization),
    }
    return json.dumps(body).encode()


def open_challenge(token: str, body: bytes, key: bytes, previous: bytes = b"") -> str:
    """The key authorisation in a challenge object for ``token``, once its MAC verifies under
    ``key`` or ``previous`` (a rotation's old key; b"": none); :class:`ChallengeRefused`
    otherwise, saying why. Invariant: nothing is returned that a holder of neither key could have
    made, and an object is only good for the token it was made for."""
    if len(body) > MAX_CHALLENGE_BYTES:
        raise ChallengeRefused(f"larger than {MAX_CHALLENGE_BYTES} bytes")
    try:
        data = json.loads(body)
    except ValueError:
        raise ChallengeRefused(
            "not a sealed challenge (not JSON: a plain key authorisation?)"
        ) from None
    if not isinstance(data, dict) or data.get("format") != CHALLENGE_FORMAT:
        raise ChallengeRefused("not a sealed challenge (format)")
    answer, mac = data.get("key_authorization"), data.get("mac")
    if not isinstance(answer, str) or not isinstance(mac, str) or not answer.isascii():
        raise ChallengeRefused("malformed challenge object")
    if not answer.startswith(token + "."):
        raise ChallengeRefused("its key authorisation is for another token")
    for candidate in (key, previous) if previous else (key,):
        if hmac.compare_digest(
            mac.encode("ascii", "replace"), _challenge_mac(candidate, token, answer).encode()
        ):
            return answer
    raise ChallengeRefused(
        f"its MAC does not verify under the cache key{' or the previous one' if previous else ''} "
        f"(it says key {str(data.get('key_id'))[:16]!r}; ours: {key_id(key)})"
    )


def _rfc3339(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class SharedCache:
    """The bucket side: entries, issuance locks, challenge tokens."""

    def __init__(
        self,
        store: ObjectStore,
        key: bytes,
        *,
        monotonic: Callable[[], float],  # the issuance locks' local clock (lchat.lease.acquire)
        prefix: str = "",
        box_id: str = "",
        lock_ttl: float = 600.0,
        previous_key: bytes = b"",  # LCHAT_CERT_CACHE_KEY_PREVIOUS: read, re-sealed, never written
    ) -> None:
        if len(key) != 32 or (previous_key and len(previous_key) != 32):
            raise ValueError("the certificate cache key must be 32 bytes")
        self.store = store
        self._monotonic = monotonic
        self._key = key
        self._previous_key = b"" if previous_key == key else previous_key
        self._prefix = prefix.strip("/")
        self.box_id = box_id
        self.lock_ttl = lock_ttl
        self.lock_owner = f"{box_id or '?'}#{secrets.token_hex(4)}"

    def key_for(self, *parts: str) -> str:
        return "/".join(p for p in (self._prefix, "certs", *parts) if p)

    @property
    def listing_prefix(self) -> str:
        return self.key_for("") + "/"

    def entry_key(self, name: CertName) -> str:
        return self.key_for(name.stem + ".json")

    # -- entries

    async def fetch(self, name: CertName) -> Certificate | None:
        """The bucket's copy of ``name``; None if there is none (or it is unusable, which is
        logged)."""
        try:
            got = await self.store.get(self.entry_key(name))
        except NotFound:
            return None
        try:
            cert, under_previous = self.open(name, got.body)
        except CacheEntryError as e:
            _log.error("acme: shared cache entry {key} is unusable: {why}", key=got.info.key, why=e)
            return None
        if under_previous:
            _previous_key.labels("read").inc()  # the sync re-seals it; this read only uses it
        return cert

    async def publish(self, name: CertName, cert: Certificate) -> None:
        """Upload ``cert`` as the bucket's copy of ``name``, replacing an entry sealed with either
        key. One sealed under another cache key is left alone (:class:`CacheEntryError`): a
        misconfigured box must not replace the fleet's certificates with ones it cannot read."""
        key = self.entry_key(name)
        try:
            current = await self.store.get(key)
        except NotFound:
            pass
        else:
            # None: unreadable garbage, replacing it heals the entry. The previous key's entries
            # are ours to replace (every box in the rotation reads both keys).
            sealed_with = sealed_key_id(current.body)
            if sealed_with is not None and sealed_with not in self.key_ids:
                raise CacheEntryError(
                    f"{key} is sealed with cache key {sealed_with}, ours is "
                    f"{key_id(self._key)}: not replacing it (LCHAT_CERT_CACHE_KEY must be the "
                    f"same on every box)"
                )
        await self.store.put(
            key, seal(name, cert, self._key, self.box_id), content_type="application/json"
        )
        _sync.labels("upload", "ok").inc()
        _log.info(
            "acme: {name} certificate uploaded to the shared cache (serial {serial:x})",
            name=name.label,
            serial=cert.serial,
        )

    @property
    def key_ids(self) -> tuple[str, ...]:
        """The ids of the keys this box opens entries with: current first, then previous."""
        return tuple(key_id(k) for k in (self._key, self._previous_key) if k)

    def open(self, name: CertName, body: bytes) -> tuple[Certificate, bool]:
        """The certificate in an entry, and whether it was sealed with the previous key."""
        previous = self._previous_key
        cert = unseal(name, body, self._key, previous)
        return cert, bool(previous) and sealed_key_id(body) == key_id(previous)

    async def reseal(self, name: CertName, cert: Certificate, body: bytes, etag: str) -> str | None:
        """Replace the entry read as ``body``/``etag`` (sealed with the previous key) by the same
        certificate sealed with the current key, only if it is still that version (If-Match). The
        new ETag, or None when the entry changed meanwhile or the bucket refused (both logged and
        counted; the caller reads the entry again next round)."""
        key = self.entry_key(name)
        issued_by = str(describe(body).get("issued_by") or self.box_id)
        try:
            put = await self.store.put(
                key,
                seal(name, cert, self._key, issued_by),
                if_match=etag,
                content_type="application/json",
            )
        except PreconditionFailed:
            _previous_key.labels("raced").inc()
            _log.info(
                "acme: {key} changed while this box re-sealed it under the current cache key; "
                "reading it again next round",
                key=key,
            )
            return None
        except ObjectStoreError as e:
            _previous_key.labels("failed").inc()
            _log.warn(
                "acme: cannot re-seal {key} under the current cache key ({error}); still readable "
                "with LCHAT_CERT_CACHE_KEY_PREVIOUS, tried again next round",
                key=key,
                error=e,
            )
            return None
        _previous_key.labels("resealed").inc()
        _log.info(
            "acme: {key} was sealed with the previous cache key {old}; re-sealed with {new}",
            key=key,
            old=key_id(self._previous_key),
            new=key_id(self._key),
        )
        return put.etag

    # -- issuance locks

    async def lock(self, name: CertName) -> lease.HeldLease:
        """Take the issuance lock of ``name`` or raise :class:`lchat.lease.LeaseHeld`."""
        # The owner is this process, not just this box: two routers that share a hostname (a
        # cloned machine) must still exclude each other. A crashed holder's lock simply expires.
        return await lease.acquire(
            self.store,
            self.key_for("locks", name.stem + ".json"),
            self.lock_owner,
            self.lock_ttl,
            host=name.label,
            monotonic=self._monotonic,
        )

    # -- HTTP-01 tokens

    async def put_challenge(self, token: str, key_authorization: str) -> None:
        """Share an HTTP-01 answer, MACed under the current cache key (:func:`seal_challenge`)."""
        await self.store.put(
            self.key_for("challenges", token),
            seal_challenge(token, key_authorization, self._key),
            content_type="application/json",
        )

    async def get_challenge(self, token: str) -> str | None:
        """The key authorisation a box of this fleet shared for ``token``; None when there is
        none. :class:`ChallengeRefused` when there is an object no box of this fleet wrote (its
        MAC does not verify under either cache key): never to be answered."""
        try:
            got = await self.store.get(self.key_for("challenges", token))
        except NotFound:
            return None
        return open_challenge(token, got.body, self._key, self._previous_key)

    async def challenge_tokens(self) -> frozenset[str]:
        """The tokens under ``certs/challenges/`` (one LIST): which lookups may find something."""
        prefix = self.key_for("challenges") + "/"
        return frozenset(
            info.key[len(prefix) :]
            for info in await self.store.list(prefix)
            if "/" not in info.key[len(prefix) :]
        )

    async def delete_challenge(self, token: str) -> None:
        await self.store.delete(self.key_for("challenges", token))


class CacheSync(Service):
    """Every ``interval``: install what the bucket has newer than us, upload what we have newer.

    ``installed`` is called after a file was written (the certificate store rescans then).
    ``directory``: this box's ACME directory. With one, only certificates from that CA are shared
    both ways (a staging or ``lchat dev-cert`` file with a later notAfter must not spread over the
    fleet's real ones); without one (ACME off), every certificate is: sharing hand-placed files is
    then the point."""

    def __init__(
        self,
        reactor: IReactorTime,
        shared: SharedCache,
        local: LocalCache,
        certificates: Callable[[], dict[str, certfiles.Loaded]],
        installed: Callable[[], Deferred[None]],
        run_in_thread: RunInThread,
        interval: float = 60.0,
        directory: str = "",
    ) -> None:
        self._reactor = reactor
        self.directory = directory
        self._shared = shared
        self._local = local
        self._certificates = certificates
        self._installed = installed
        self._run_in_thread = run_in_thread
        self.interval = interval
        self._etags: dict[str, str] = {}  # bucket key -> the ETag we last read
        self._remote: dict[CertName, tuple[str, float]] = {}  # readable entries: (etag, not_after)
        self._loop: LoopingCall | None = None
        self._running: Deferred[None] | None = None
        self._failing = False

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self.sync_now)
        self._loop.clock = self._reactor
        self._loop.start(self.interval, now=True).addErrback(
            lambda f: _log.failure("acme: the shared cache sync loop died", f)
        )

    def stopService(self) -> Deferred[None] | None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        super().stopService()
        if self._running is None:
            return None
        # A round in flight finishes (each bucket call has its own timeouts), within a budget.
        done = settled(self._running)
        done.addTimeout(STOP_BUDGET, self._reactor)
        done.addErrback(lambda _: _log.warn("acme: a shared cache sync was still running at stop"))
        return done

    def sync_now(self) -> Deferred[None]:
        """One round (joins a round already running)."""
        if self._running is not None:
            return settled(self._running)
        d = Deferred.fromCoroutine(self._round())
        d.addErrback(lambda f: _log.failure("acme: shared cache sync failed", f))
        self._running = d

        def done(result: object) -> object:
            self._running = None
            return result

        d.addBoth(done)
        return settled(d)

    async def _round(self) -> None:
        try:
            listing = await self._shared.store.list(self._shared.listing_prefix)
        except ObjectStoreError as e:
            _sync.labels("list", "error").inc()
            if not self._failing:
                _log.warn(
                    "acme: cannot list the shared certificate cache ({error}); serving the "
                    "local copies",
                    error=e,
                )
            self._failing = True
            return
        if self._failing:
            _log.info("acme: the shared certificate cache is reachable again")
        self._failing = False
        _sync.labels("list", "ok").inc()
        in_bucket: dict[CertName, str] = {}
        prefix = self._shared.listing_prefix
        for info in listing:
            rest = info.key[len(prefix) :]
            if "/" in rest or not rest.endswith(".json"):
                continue  # locks/, challenges/, strangers
            name = CertName.from_stem(rest[: -len(".json")])
            if name is not None:
                in_bucket[name] = info.etag
        changed = False
        for name, etag in in_bucket.items():
            key = self._shared.entry_key(name)
            if self._etags.get(key) == etag:
                continue
            try:
                changed |= await self._pull(name, key)
            except Exception:  # one entry (a full disk...) must not stop the others, or the push
                _log.failure(
                    "acme: installing {name} from the shared cache failed", name=name.label
                )
        await self._push(in_bucket)
        if changed:
            await self._installed()

    async def _pull(self, name: CertName, key: str) -> bool:
        try:
            got = await self._shared.store.get(key)
        except ObjectStoreError as e:
            _log.warn("acme: cannot read {key}: {error}", key=key, error=e)
            return False
        try:
            cert, under_previous = self._shared.open(name, got.body)
        except CacheEntryError as e:
            self._etags[key] = got.info.etag  # said once per version
            _sync.labels("install", "refused").inc()
            _log.error("acme: shared cache entry {key} is unusable: {why}", key=key, why=e)
            return False
        etag = got.info.etag
        if under_previous:
            resealed = await self._shared.reseal(name, cert, got.body, etag)
            if resealed is None:
                # Not remembered as read: the next round reads (and re-seals) it again. Nothing
                # is installed from a version that may already be outdated.
                return False
            etag = resealed  # the bucket now holds this very certificate under our key
        return await self._consider(name, key, cert, got.body, etag)

    async def _consider(
        self, name: CertName, key: str, cert: Certificate, body: bytes, etag: str
    ) -> bool:
        """Install ``cert`` (the entry ``key`` at ``etag``) if it is for us and newer than ours."""
        if self.directory and cert.origin != self.directory:
            self._etags[key] = etag
            _log.info(
                "acme: not installing the {name} certificate from the shared cache: it comes "
                "from {origin}, this box uses {directory}",
                name=name.label,
                origin=cert.origin or "a file placed by hand",
                directory=self.directory,
            )
            return False
        self._remote[name] = (etag, cert.not_after)
        local = await self._run_in_thread(lambda: self._local.read(name))
        if (local is not None and local.not_after >= cert.not_after) or (
            cert.not_after <= self._reactor.seconds()
        ):
            self._etags[key] = etag
            return False
        await self._run_in_thread(lambda: self._local.install(name, cert))
        self._etags[key] = etag  # only now: a failed install is tried again next round
        _sync.labels("install", "ok").inc()
        _log.info(
            "acme: installed the {name} certificate from the shared cache (serial {serial:x}, "
            "issued by {box})",
            name=name.label,
            serial=cert.serial,
            box=describe(body).get("issued_by") or "?",
        )
        return True

    async def _push(self, in_bucket: dict[CertName, str]) -> None:
        for loaded in self._certificates().values():
            if loaded.kind == "default" or (self.directory and loaded.origin != self.directory):
                continue
            name = CertName(loaded.kind, loaded.name)
            if name in in_bucket:
                remote = self._remote.get(name)
                if remote is None or remote[0] != in_bucket[name]:
                    continue  # not readable by us: never overwrite what we could not judge
                if remote[1] >= loaded.not_after:
                    continue
            cert = await self._run_in_thread(self._local.read, name)
            if cert is None:
                continue
            try:
                await self._shared.publish(name, cert)
            except (ObjectStoreError, CacheEntryError) as e:
                _sync.labels("upload", "error").inc()
                _log.warn("acme: cannot upload {name}: {error}", name=name.label, error=e)
