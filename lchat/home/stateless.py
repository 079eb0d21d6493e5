"""Stateless ceremonies: nothing about a WebAuthn ceremony lives in a home process between requests.

Two kinds of token carry what an in-memory map used to hold, so that any replica can finish what
another began (``/work/shared/seeds/planet-scale.txt``, "Home is stateless"):

- A **ceremony proof** (:class:`CeremonyProofs`) says "this client finished a WebAuthn ceremony as
  ``uid``, for ``purpose``, until ``expires_at``" (5 minutes). It is
  ``base64url(payload JSON) "." base64url(HMAC-SHA256(proof key, payload segment))``: readable by
  anyone, forgeable by no one without the key, verified in constant time. It is a bearer capability
  that ``purpose`` confines to one kind of action (a step-up proof to one change, ``action``, by one
  device). This module keeps no state, so it cannot make it single-use: the API does, with the
  store's single-use record (``VaultStore.use_once`` of its SHA-256), as it does for every
  WebAuthn challenge (lchat.home.api).
- A **sealed WebAuthn session** (:class:`SessionSealer`) is the in-flight ceremony (challenge, uid,
  RP ID, user-verification requirement, expiry) serialised to JSON and sealed with AES-256-GCM under a
  random 96-bit nonce, with the ceremony's purpose (``register``/``login``/``link``) as associated
  data, then base64url-encoded to travel in the ``?session=`` query parameter. It opens only under
  the same key, for the same purpose, untampered and unexpired; the client can neither read the
  challenge early nor change anything in it.

Both keys come from one server secret, ``LCHAT_HOME_SESSION_KEY`` (base64 of at least 32 random
bytes, the same on every replica), through HKDF-SHA256 with distinct ``info`` labels
(:data:`PROOF_KEY_INFO`, :data:`SEAL_KEY_INFO`), so neither key is ever used for the other's job.
The secret is auth plumbing like the admin token: it cannot open a byte of any vault. Unset, an
ephemeral random secret is minted at boot (:func:`load_session_keys` returns the warning to log):
one process keeps working with zero configuration, and ceremonies do not survive a restart or span
replicas.

Invariants:

- Nothing here keeps per-ceremony state: the objects are immutable (key + clock) and every answer is
  a pure function of (token, key, clock).
- Tokens are canonical: base64url without padding and without stray bits, so changing any character
  of a token makes it fail (no two spellings of one token).
- A token is judged expired when ``clock() >= expires_at`` (a proof issued at ``t`` is good up to
  but not at ``t + 300``). The clock is injected (unix seconds); replicas' clocks should agree to
  well under the window (NTP), or a token may be judged expired early or late by the skew.
- Failures raise a :class:`CeremonyRejected` subclass naming what was wrong (the API answers 401 and
  writes nothing) and count in ``lchat_home_ceremony_tokens_total``.

Limits: AES-GCM with random nonces is safe for about 2**32 seals per key; rotate
``LCHAT_HOME_SESSION_KEY`` long before.

Rotation (docs/secrets.md): ``LCHAT_HOME_SESSION_KEY_ACCEPT`` is one more secret whose derived keys
*open* proofs and sessions (never make them), so replicas can change keys one at a time without
failing a ceremony that crosses two of them: accept the new secret everywhere, then make it the
main one (accepting the old), then drop the old. Both MACs are computed and compared on every proof;
a token that only the accepted secret opens counts in ``lchat_home_session_accept_key_total``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeVar, get_args

from attrs import evolve, field, frozen
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from prometheus_client import Counter
from twisted.logger import Logger

SESSION_KEY_ENV = "LCHAT_HOME_SESSION_KEY"
ACCEPT_KEY_ENV = "LCHAT_HOME_SESSION_KEY_ACCEPT"
MIN_SECRET_BYTES = 32
PROOF_TTL = 300.0  # seconds: the 5-minute window of a ceremony proof
SESSION_TTL = 300.0  # seconds: how long a begun WebAuthn ceremony may take to finish

# HKDF-SHA256 info labels: one per derived key, never reused. Changing one changes that key, so
# ceremonies in flight across a deploy that changes it fail (once) on replicas that disagree.
PROOF_KEY_INFO = b"lchat-home/v1 ceremony-proof HMAC-SHA256"
SEAL_KEY_INFO = b"lchat-home/v1 webauthn-session AES-256-GCM"

SessionPurpose = Literal["register", "login", "link", "stepup"]
SESSION_PURPOSES: frozenset[str] = frozenset(get_args(SessionPurpose))
UserVerification = Literal["required", "preferred", "discouraged"]
_USER_VERIFICATIONS: frozenset[str] = frozenset(get_args(UserVerification))

_SEAL_VERSION = 1
_NONCE_BYTES = 12  # AES-GCM's 96-bit nonce
_TAG_BYTES = 16
_SEAL_AD_PREFIX = (
    b"lchat-home session v1\x00"  # + purpose: the associated data a session is bound to
)
_MAX_TOKEN_CHARS = 4096  # far above any token we mint: bounds the work an attacker can ask for
_B64URL = re.compile(r"[A-Za-z0-9_-]*")

TOKENS = Counter(
    "lchat_home_ceremony_tokens_total",
    "Ceremony proofs and sealed WebAuthn sessions presented to this process, by outcome: accepted, "
    "not_authentic (tampered, truncated, garbage, wrong purpose for a session, or made under another "
    "LCHAT_HOME_SESSION_KEY: a climb after a deploy means replicas disagree on the key), expired, "
    "wrong_purpose (proofs only)",
    ["token", "outcome"],
)

ACCEPT_KEY_USES = Counter(
    "lchat_home_session_accept_key_total",
    "Ceremony proofs and sealed WebAuthn sessions that only LCHAT_HOME_SESSION_KEY_ACCEPT opened "
    "(a replica still makes them with that secret). Flat on every replica: it can be dropped",
    ["token"],
)
for _token in ("proof", "session"):
    ACCEPT_KEY_USES.labels(_token)

_log = Logger(namespace="lchat.home.stateless")
_T = TypeVar("_T")


class SessionKeyError(ValueError):
    """``LCHAT_HOME_SESSION_KEY`` is set but unusable. The message never contains the value."""


class CeremonyRejected(Exception):
    """A proof or session the client presented is not good (answer 401, write nothing).

    ``reason`` is a stable machine-readable word for logs, metrics and the API's error body."""

    reason: ClassVar[str] = "rejected"


class ProofNotAuthentic(CeremonyRejected):
    """Not a proof this key made: tampered, truncated, garbage, or signed under another key."""

    reason = "not_authentic"


class ProofExpired(CeremonyRejected):
    """An authentic proof whose 5-minute window has passed."""

    reason = "expired"


class ProofWrongPurpose(CeremonyRejected):
    """An authentic proof made for another purpose than the one it was presented for."""

    reason = "wrong_purpose"


class SessionNotAuthentic(CeremonyRejected):
    """Does not open: tampered, truncated, garbage, sealed for another purpose, or sealed under
    another key. AES-GCM cannot tell these apart, and need not: none of them may proceed."""

    reason = "not_authentic"


class SessionExpired(CeremonyRejected):
    """An authentic session whose ceremony took longer than its window."""

    reason = "expired"


def _hide(_: bytes) -> str:
    return "<secret>"


@frozen
class SessionKeys:
    """The two keys derived from ``LCHAT_HOME_SESSION_KEY``; ``ephemeral`` when it was unset and a
    random secret was minted for this process alone (show it on ``/status``)."""

    proof_key: bytes = field(repr=_hide)  # HMAC-SHA256 key for ceremony proofs
    seal_key: bytes = field(repr=_hide)  # AES-256-GCM key for sealed WebAuthn sessions
    ephemeral: bool = False
    # From LCHAT_HOME_SESSION_KEY_ACCEPT: they open proofs and sessions, never make them (b"": none).
    accept_proof_key: bytes = field(default=b"", repr=_hide)
    accept_seal_key: bytes = field(default=b"", repr=_hide)

    @classmethod
    def derive(cls, secret: bytes, *, ephemeral: bool = False) -> SessionKeys:
        """HKDF-SHA256 (no salt: the secret is already uniformly random) with one ``info`` label per
        key, so the proof key and the seal key are independent."""
        if len(secret) < MIN_SECRET_BYTES:
            raise SessionKeyError(
                f"{SESSION_KEY_ENV} must be at least {MIN_SECRET_BYTES} bytes, not {len(secret)}"
            )
        return cls(
            proof_key=_hkdf(secret, PROOF_KEY_INFO),
            seal_key=_hkdf(secret, SEAL_KEY_INFO),
            ephemeral=ephemeral,
        )


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def parse_session_key(text: str, name: str = SESSION_KEY_ENV) -> bytes:
    """The secret in ``LCHAT_HOME_SESSION_KEY`` (or ``name``): base64 (standard or URL-safe
    alphabet, padding optional, surrounding whitespace ignored) of at least 32 bytes, e.g.
    ``openssl rand -base64 32``. Raises :class:`SessionKeyError` with a message an operator can act
    on (never the value)."""
    text = text.strip()
    how = "(make one with `openssl rand -base64 32`, the same on every replica)"
    padded = text + "=" * (-len(text) % 4)
    try:
        if re.fullmatch(r"[A-Za-z0-9+/]+=*", padded):
            secret = base64.b64decode(padded, validate=True)
        elif re.fullmatch(r"[A-Za-z0-9_-]+=*", padded):
            secret = base64.urlsafe_b64decode(padded)
        else:
            raise ValueError("not base64")
    except (binascii.Error, ValueError):
        raise SessionKeyError(f"{name} is not base64 {how}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise SessionKeyError(
            f"{name} must decode to at least {MIN_SECRET_BYTES} bytes, not {len(secret)} {how}"
        )
    return secret


def load_session_keys(
    text: str | None,
    *,
    random_bytes: Callable[[int], bytes] = os.urandom,
    accept: str | None = None,
) -> tuple[SessionKeys, str | None]:
    """The keys for ``LCHAT_HOME_SESSION_KEY``'s value, and a warning for the caller to log loudly
    when it is unset or empty (an ephemeral secret is minted: fine for one process, wrong for
    replicas). A set but malformed value raises :class:`SessionKeyError` (fail at boot).

    ``accept``: ``LCHAT_HOME_SESSION_KEY_ACCEPT``'s value, checked the same way; its keys open
    (never make) proofs and sessions. Equal to the main secret, or beside an unset one, it is
    ignored with a warning logged here (the returned warning stays about the ephemeral key)."""
    warning = None
    if text is None or not text.strip():
        keys = SessionKeys.derive(random_bytes(MIN_SECRET_BYTES), ephemeral=True)
        warning = (
            f"{SESSION_KEY_ENV} is not set: using a random key for this process only. Passkey "
            f"ceremonies and ceremony proofs in flight will fail after a restart, and replicas will "
            f"reject each other's (a ceremony begun on one fails on another). Fine for a single "
            f"self-hosted process; for replicas set {SESSION_KEY_ENV} to the same "
            f"`openssl rand -base64 32` on every one"
        )
    else:
        keys = SessionKeys.derive(parse_session_key(text))
    if accept is None or not accept.strip():
        return keys, warning
    other = SessionKeys.derive(parse_session_key(accept, ACCEPT_KEY_ENV))
    if keys.ephemeral:
        _log.warn(
            "{accept} is set but {main} is not: ignored (set both during a rotation)",
            accept=ACCEPT_KEY_ENV,
            main=SESSION_KEY_ENV,
        )
        return keys, warning
    if other == keys:
        _log.warn(
            "{accept} equals {main}: ignored (mid-rotation it holds the other secret; after it, "
            "remove the line)",
            accept=ACCEPT_KEY_ENV,
            main=SESSION_KEY_ENV,
        )
        return keys, warning
    # A rotation window: these keys, also opening what the accepted secret's keys made.
    return evolve(keys, accept_proof_key=other.proof_key, accept_seal_key=other.seal_key), warning


def b64url(data: bytes) -> str:
    """Base64url without padding (WebAuthn's encoding, and every token home hands out)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes | None:
    """Canonical base64url without padding, or ``None``: re-encoding must give back ``text``, so a
    changed character can never decode to the same bytes."""
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        return None
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    return data if b64url(data) == text else None


def _is_time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _counted(token: str, judge: Callable[[], _T]) -> _T:
    """``judge()``, its outcome counted in ``lchat_home_ceremony_tokens_total``."""
    try:
        judged = judge()
    except CeremonyRejected as e:
        TOKENS.labels(token=token, outcome=e.reason).inc()
        raise
    TOKENS.labels(token=token, outcome="accepted").inc()
    return judged


@frozen
class CeremonyProof:
    """A verified ceremony proof: ``uid`` finished a ceremony for ``purpose``; good until
    ``expires_at`` (unix seconds)."""

    uid: str
    purpose: str
    expires_at: float
    credential: str = ""  # sha256 hex of the passkey that finished the ceremony ("": unknown)
    action: str = ""  # a step-up's one change, e.g. "DELETE /api/devices/<id>"
    device: str = ""  # a step-up's device (the link token that asked for it)


@frozen
class CeremonyProofs:
    """Issues and verifies ceremony proofs (HMAC-SHA256 under ``key``, judged by ``clock``, unix
    seconds). Holds no state: any process with the same key verifies any other's proofs."""

    key: bytes = field(repr=_hide)
    clock: Callable[[], float]
    ttl: float = PROOF_TTL
    accept_key: bytes = field(default=b"", repr=_hide)  # verifies too, never signs (b"": none)

    def issue(
        self,
        uid: str,
        purpose: str,
        *,
        credential: str = "",
        action: str = "",
        device: str = "",
        ttl: float | None = None,
    ) -> str:
        """A proof that ``uid`` just finished a ceremony (with the passkey whose SHA-256 is
        ``credential``), good for ``purpose`` (and, a step-up, for ``action`` by ``device``
        only) during ``ttl`` (default :attr:`ttl`)."""
        if not uid or not purpose:
            raise ValueError("a ceremony proof needs a uid and a purpose")
        lifetime = self.ttl if ttl is None else ttl
        payload: dict[str, Any] = {"v": 1, "u": uid, "p": purpose, "e": self.clock() + lifetime}
        for name, value in (("c", credential), ("a", action), ("d", device)):
            if value:
                payload[name] = value
        segment = b64url(json.dumps(payload, separators=(",", ":"), sort_keys=True).encode())
        return f"{segment}.{b64url(self._tag(segment))}"

    def verify(self, token: str, purpose: str) -> CeremonyProof:
        """The proof in ``token`` if it is authentic, for ``purpose``, and unexpired; otherwise
        :class:`ProofNotAuthentic`, :class:`ProofWrongPurpose` or :class:`ProofExpired`."""
        return _counted("proof", lambda: self._verify(token, purpose))

    def _tag(self, segment: str, key: bytes | None = None) -> bytes:
        key = self.key if key is None else key
        return hmac.new(key, segment.encode("ascii"), hashlib.sha256).digest()

    def _verify(self, token: str, purpose: str) -> CeremonyProof:
        if not isinstance(token, str) or len(token) > _MAX_TOKEN_CHARS or token.count(".") != 1:
            raise ProofNotAuthentic("not a ceremony proof")
        segment, tag_text = token.split(".")
        tag = _b64url_decode(tag_text)
        # The MAC is checked before anything in the payload is believed; compare_digest keeps the
        # comparison's time independent of where a forged tag first differs.
        if tag is None or not _B64URL.fullmatch(segment):
            raise ProofNotAuthentic("not a ceremony proof")
        made_here = hmac.compare_digest(tag, self._tag(segment))
        # Compared whether or not the first matched: the time says nothing about which did.
        made_under_accept = bool(self.accept_key) and hmac.compare_digest(
            tag, self._tag(segment, self.accept_key)
        )
        if made_under_accept and not made_here:
            ACCEPT_KEY_USES.labels("proof").inc()
        if not (made_here or made_under_accept):
            raise ProofNotAuthentic(
                "ceremony proof signature does not verify (tampered, or made under another "
                f"{SESSION_KEY_ENV})"
            )
        raw = _b64url_decode(segment)
        try:
            payload = json.loads(raw) if raw is not None else None
        except ValueError:
            payload = None
        # Authentic but malformed: only a bug or a leaked key makes one. Never trust it.
        if (
            not isinstance(payload, dict)
            or payload.get("v") != 1
            or not isinstance(payload.get("u"), str)
            or not payload["u"]
            or not isinstance(payload.get("p"), str)
            or not _is_time(payload.get("e"))
            or not all(isinstance(payload.get(k, ""), str) for k in ("c", "a", "d"))
        ):
            raise ProofNotAuthentic("ceremony proof payload is malformed")
        if payload["p"] != purpose:
            raise ProofWrongPurpose(
                f"ceremony proof is for {payload['p']!r}, presented for {purpose!r}"
            )
        if self.clock() >= payload["e"]:
            raise ProofExpired("ceremony proof has expired: finish a passkey ceremony again")
        return CeremonyProof(
            uid=payload["u"],
            purpose=payload["p"],
            expires_at=payload["e"],
            credential=payload.get("c", ""),
            action=payload.get("a", ""),
            device=payload.get("d", ""),
        )


@frozen
class WebAuthnSession:
    """An opened in-flight WebAuthn ceremony. ``uid`` is ``None`` for a login that has not named its
    user yet (a discoverable-credential login learns it from the credential)."""

    purpose: SessionPurpose
    uid: str | None
    challenge: bytes = field(repr=False)
    rp_id: str
    user_verification: UserVerification
    expires_at: float
    bound: str = ""  # what the ceremony is for beyond its purpose (a step-up's change)


def _check_purpose(purpose: str) -> None:
    # A programming error, not a client's: the API passes one of the constants.
    if purpose not in SESSION_PURPOSES:
        raise ValueError(f"session purpose must be one of {sorted(SESSION_PURPOSES)}: {purpose!r}")


@frozen
class SessionSealer:
    """Seals and opens in-flight WebAuthn sessions (AES-256-GCM under ``key``, random nonces from
    ``random_bytes``, judged by ``clock``, unix seconds). Holds no state: any process with the same
    key opens any other's sessions."""

    key: bytes = field(repr=_hide)
    clock: Callable[[], float]
    ttl: float = SESSION_TTL
    random_bytes: Callable[[int], bytes] = os.urandom
    accept_key: bytes = field(default=b"", repr=_hide)  # opens too, never seals (b"": none)

    def seal(
        self,
        purpose: SessionPurpose,
        *,
        uid: str | None,
        challenge: bytes,
        rp_id: str,
        user_verification: UserVerification = "preferred",
        bound: str = "",
    ) -> str:
        """The ``?session=`` value carrying this ceremony, good for ``purpose`` during ``ttl``;
        ``bound`` (sealed too) names what exactly it is for (a step-up's one change)."""
        _check_purpose(purpose)
        if not challenge or not rp_id or user_verification not in _USER_VERIFICATIONS:
            raise ValueError("a WebAuthn session needs a challenge, an RP ID and a UV requirement")
        plaintext = json.dumps(
            {
                "v": _SEAL_VERSION,
                "u": uid,
                "c": b64url(challenge),
                "r": rp_id,
                "uv": user_verification,
                "e": self.clock() + self.ttl,
                **({"b": bound} if bound else {}),
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode()
        nonce = self.random_bytes(_NONCE_BYTES)
        sealed = AESGCM(self.key).encrypt(nonce, plaintext, _SEAL_AD_PREFIX + purpose.encode())
        return b64url(bytes([_SEAL_VERSION]) + nonce + sealed)

    def _open_under_accept(self, nonce: bytes, sealed: bytes, associated: bytes) -> bytes | None:
        if not self.accept_key:
            return None
        try:
            plaintext = AESGCM(self.accept_key).decrypt(nonce, sealed, associated)
        except InvalidTag:
            return None
        ACCEPT_KEY_USES.labels("session").inc()
        return plaintext

    def open(self, token: str, purpose: SessionPurpose) -> WebAuthnSession:
        """The session in ``token`` if it opens for ``purpose`` and is unexpired; otherwise
        :class:`SessionNotAuthentic` or :class:`SessionExpired`."""
        _check_purpose(purpose)
        return _counted("session", lambda: self._open(token, purpose))

    def _open(self, token: str, purpose: SessionPurpose) -> WebAuthnSession:
        blob = (
            _b64url_decode(token)
            if isinstance(token, str) and len(token) <= _MAX_TOKEN_CHARS
            else None
        )
        if blob is None or len(blob) < 1 + _NONCE_BYTES + _TAG_BYTES or blob[0] != _SEAL_VERSION:
            raise SessionNotAuthentic("not a WebAuthn session")
        nonce, sealed = blob[1 : 1 + _NONCE_BYTES], blob[1 + _NONCE_BYTES :]
        associated = _SEAL_AD_PREFIX + purpose.encode()
        plaintext: bytes | None
        try:
            plaintext = AESGCM(self.key).decrypt(nonce, sealed, associated)
        except InvalidTag:
            plaintext = self._open_under_accept(nonce, sealed, associated)
        if plaintext is None:
            raise SessionNotAuthentic(
                f"WebAuthn session does not open for {purpose!r} (tampered, begun for another "
                f"ceremony, or sealed under another {SESSION_KEY_ENV})"
            )
        try:
            fields = json.loads(plaintext)
        except ValueError:
            fields = None
        encoded = fields.get("c") if isinstance(fields, dict) else None
        challenge = _b64url_decode(encoded) if isinstance(encoded, str) else None
        # Authentic but malformed: only a bug or a leaked key makes one. Never trust it.
        if (
            not isinstance(fields, dict)
            or fields.get("v") != _SEAL_VERSION
            or not (fields.get("u") is None or (isinstance(fields["u"], str) and fields["u"]))
            or not challenge
            or not isinstance(fields.get("r"), str)
            or not fields["r"]
            or fields.get("uv") not in _USER_VERIFICATIONS
            or not _is_time(fields.get("e"))
            or not isinstance(fields.get("b", ""), str)
        ):
            raise SessionNotAuthentic("WebAuthn session payload is malformed")
        if self.clock() >= fields["e"]:
            raise SessionExpired("the passkey ceremony took too long: begin it again")
        return WebAuthnSession(
            purpose=purpose,
            uid=fields["u"],
            challenge=challenge,
            rp_id=fields["r"],
            user_verification=fields["uv"],
            expires_at=fields["e"],
            bound=fields.get("b", ""),
        )


@frozen
class Ceremonies:
    """Both token kinds, from one :class:`SessionKeys` and one clock: what the API holds."""

    proofs: CeremonyProofs
    sessions: SessionSealer

    @classmethod
    def from_keys(cls, keys: SessionKeys, clock: Callable[[], float]) -> Ceremonies:
        return cls(
            proofs=CeremonyProofs(
                key=keys.proof_key, clock=clock, accept_key=keys.accept_proof_key
            ),
            sessions=SessionSealer(key=keys.seal_key, clock=clock, accept_key=keys.accept_seal_key),
        )
