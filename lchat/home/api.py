"""Home's API (docs/home.md): passkeys, link tokens, devices and the vault, served as JSON over HTTP
on ``LCHAT_HOME_SOCKET`` by lchat.home.resource (the router proxies ``home.<domain>`` there).

Every route is a pure function of (request, store): a ceremony begun on one home process can be
finished on any other that shares the store and ``LCHAT_HOME_SESSION_KEY`` (lchat.home.stateless).
The only memory a process keeps is its :class:`~lchat.home.revocation.TokenCache` — which link
tokens it checked today, so that an authenticated request with a token seen today costs no store
request — and :class:`~lchat.home.revocation.RevocationFeed` makes every process forget a revoked
token within ``LCHAT_HOME_REVOCATION_POLL`` seconds (lchat.home.revocation).

The user document (``users/<uid>``, lchat.home.store) is the API's, laid out as::

    {"credentials": {"<sha256(credential id) hex>": {"id": "<base64url>", "public_key":
        "<base64url COSE key>", "sign_count": 3, "transports": ["internal"], "created":
        "2026-12-02"}},
     "devices": {"<device id>": {"token": "<sha256(token) hex>", "created": "2026-12-02",
        "last_seen": "2026-12-02", "cred": "<sha256(credential id) hex of the passkey that
        minted it>"}}}

Nothing else: no name, no email, no per-user counters. ``last_seen`` is a day, written at most
once a day per device, so an authenticated read never costs a write.

Abuse (docs/home.md, "Limits" and "Step-up"):

- every request passes the rate limits of lchat.home.limits first; quotas bound what one
  account holds (devices, the vault's size);
- **every WebAuthn challenge and every ceremony proof is single-use across replicas**: after it
  verifies, its SHA-256 is recorded once in the store (``VaultStore.use_once``); a second
  presentation, on any process sharing the store, is refused;
- **destructive changes need a step-up**: revoking another device or deleting a passkey takes a
  fresh passkey assertion bound to that one change (``POST /api/step-up/begin`` and
  ``/finish``, then the change with ``Step-Up: <proof>``, single-use, good for
  ``LCHAT_HOME_STEP_UP_WINDOW`` seconds); a link token alone can only sign its own device out;
  the last passkey is never deleted, and deleting one revokes every device it linked.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from attrs import Factory, define
from prometheus_client import Counter
from twisted.logger import Logger
from twisted.web.server import Request

from lchat.home import passkeys as pk
from lchat.home.limits import Limits
from lchat.home.revocation import RevocationFeed, utc_day
from lchat.home.stateless import Ceremonies, CeremonyRejected, SessionPurpose, b64url
from lchat.home.store import (
    NO_VERSION,
    BadVersion,
    Conflict,
    PointerTaken,
    StoreError,
    VaultStore,
    resolve_checked,
)

_log = Logger(namespace="lchat.home")

VAULT_MAX = 18 * 1024  # the default largest vault blob (LCHAT_HOME_VAULT_MAX)
_PAD_HEADER = 4  # stored = 4-byte big-endian length + blob + zeros up to VAULT_MAX
DEVICE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what a device id looks like (a route checks it)
_DIGEST = re.compile(r"[0-9a-f]{64}")
# The changes a step-up is asked for: revoke another device, delete a passkey.
_STEP_UP_ACTION = re.compile(r"DELETE /api/(devices|credentials)/([A-Za-z0-9_-]{1,1400})")
# A single-use record outlives what it records by this much: replicas' clocks may disagree on
# when a session or proof expires (by far less than this, with NTP).
USED_MARGIN = 3600.0
MAX_DEVICES = 20  # LCHAT_HOME_MAX_DEVICES' default
STEP_UP_WINDOW = 300.0  # LCHAT_HOME_STEP_UP_WINDOW's default

REFUSED_REUSE = Counter(
    "lchat_home_single_use_refusals_total",
    "WebAuthn challenges and ceremony proofs presented again after they were used once (on this "
    "or any replica), by kind (register, login, step_up, proof, step_up_proof): replays",
    ["kind"],
)
QUOTA_REFUSALS = Counter(
    "lchat_home_quota_refusals_total",
    "Writes refused for a quota, by quota (devices, vault_size, document_size, last_passkey)",
    ["quota"],
)
STEP_UPS = Counter(
    "lchat_home_step_ups_total",
    "Destructive changes by their step-up, by outcome (accepted; missing, not_valid, "
    "wrong_change, used: refused with 403)",
    ["outcome"],
)


class ApiError(Exception):
    """An answer other than success: ``status`` and a JSON body ``{"error": message, ...}``."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


def unb64url(text: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"not base64url: {e}") from e
    if b64url(raw) != text:
        raise ValueError("not canonical base64url")
    return raw


def sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def pad(blob: bytes, size: int = VAULT_MAX) -> bytes:
    """What is stored: every vault is the same size (``size``), whatever its content."""
    return len(blob).to_bytes(_PAD_HEADER, "big") + blob + b"\0" * max(0, size - len(blob))


def unpad(stored: bytes) -> bytes:
    length = int.from_bytes(stored[:_PAD_HEADER], "big")
    if length > len(stored) - _PAD_HEADER:
        raise StoreError("a stored vault is shorter than its length header")
    return stored[_PAD_HEADER : _PAD_HEADER + length]


@define
class HomeAPI:
    """The routes. Collaborators: the store, the ceremony keys, the passkey layer, a clock (unix
    seconds), the revocation feed (which holds the token cache), randomness, the WebAuthn
    relying party, the rate limits (none by default) and the quotas."""

    store: VaultStore
    ceremonies: Ceremonies
    passkeys: pk.Passkeys
    rp_id: str
    origins: tuple[str, ...]
    clock: Callable[[], float]
    feed: RevocationFeed
    random_bytes: Callable[[int], bytes] = os.urandom
    limits: Limits = Factory(lambda self: Limits.build({}, self.clock), takes_self=True)
    max_devices: int = MAX_DEVICES
    vault_max: int = VAULT_MAX
    step_up_window: float = STEP_UP_WINDOW

    def today(self) -> str:
        # The same UTC day as the token cache's: a token's first check of a day writes
        # last_seen, every later request that day is served from the cache.
        return utc_day(self.clock())

    # -- passkey ceremonies --------------------------------------------------------------------

    async def register_begin(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A new account: a fresh uid, and the options for ``navigator.credentials.create``."""
        uid = b64url(self.random_bytes(16))
        label = _label(body.get("label"), "lchat")
        start = self.passkeys.begin_registration(rp_id=self.rp_id, uid=uid, user_name=label)
        return self._begun("register", uid, start)

    def _begun(
        self, purpose: SessionPurpose, uid: str | None, start: pk.CeremonyStart, bound: str = ""
    ) -> dict[str, Any]:
        """The options for the browser's passkey call, and the ceremony sealed as its session."""
        session = self.ceremonies.sessions.seal(
            purpose,
            uid=uid,
            challenge=start.challenge,
            rp_id=self.rp_id,
            user_verification=start.user_verification,
            bound=bound,
        )
        return {"options": json.loads(start.options_json), "session": session}

    async def _use_once(self, kind: str, what: bytes | str, expires_at: float) -> bool:
        """Record ``what`` (a challenge, a proof) as used, on every replica: True the first
        time. The record outlives ``expires_at`` (after which nothing accepts it anyway)."""
        if await self.store.use_once(sha256_hex(what), expires_at + USED_MARGIN):
            return True
        REFUSED_REUSE.labels(kind).inc()
        _log.warn("home: a used {kind} was presented again (a replay): refused", kind=kind)
        return False

    async def register_finish(self, session: str, body: Mapping[str, Any]) -> dict[str, Any]:
        opened = self.ceremonies.sessions.open(session, "register")
        assert opened.uid is not None
        credential = self.passkeys.finish_registration(
            _credential(body),
            challenge=opened.challenge,
            rp_id=opened.rp_id,
            origin=list(self.origins),
            user_verification=opened.user_verification,
        )
        if not await self._use_once("register", opened.challenge, opened.expires_at):
            raise ApiError(409, "this registration was finished already")
        uid = opened.uid
        cred_key = sha256_hex(credential.credential_id)
        # The pointer first: a document listing a credential no pointer names could never log in.
        try:
            await self.store.put_pointer("creds", cred_key, uid)
        except PointerTaken as e:
            raise ApiError(409, "this passkey is registered already") from e
        doc = {
            "credentials": {
                cred_key: {
                    "id": b64url(credential.credential_id),
                    "public_key": b64url(credential.public_key),
                    "sign_count": credential.sign_count,
                    "transports": list(credential.transports),
                    "created": self.today(),
                }
            },
            "devices": {},
        }
        try:
            await self.store.put_user(uid, doc, NO_VERSION)
        except Conflict as e:
            # The same sealed session finished twice: the account exists already.
            raise ApiError(409, "this registration was finished already") from e
        _log.info("home: registered a new account")
        return {"uid": uid, "proof": self.ceremonies.proofs.issue(uid, "link", credential=cred_key)}

    async def login_begin(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Discoverable credentials: no user name is asked for, none is sent."""
        return self._begun("login", None, self.passkeys.begin_login(rp_id=self.rp_id))

    async def login_finish(self, session: str, body: Mapping[str, Any]) -> dict[str, Any]:
        opened = self.ceremonies.sessions.open(session, "login")
        uid, cred_key = await self._assert(opened, _credential(body), "login")
        return {"uid": uid, "proof": self.ceremonies.proofs.issue(uid, "link", credential=cred_key)}

    async def _assert(
        self, opened: Any, response: Mapping[str, Any], kind: str, uid_must_be: str = ""
    ) -> tuple[str, str]:
        """Verify a passkey assertion for the sealed ceremony ``opened``, use its challenge up
        (a replay, on any replica, is refused) and store a sign count that moved: the uid and
        the credential's key."""
        cred_key = sha256_hex(self.passkeys.presented_credential_id(response))
        found = await resolve_checked(
            self.store, "creds", cred_key, lambda doc: cred_key in doc.get("credentials", {})
        )
        if found is None or (uid_must_be and found[0] != uid_must_be):
            raise ApiError(401, "unknown passkey")
        uid, user = found
        stored = _stored_credentials(user.doc)
        verified = self.passkeys.finish_login(
            response,
            challenge=opened.challenge,
            rp_id=opened.rp_id,
            origin=list(self.origins),
            uid=uid,
            credentials=stored,
            user_verification=opened.user_verification,
        )
        # Only now (the signature verified): nobody without the passkey can use a challenge up.
        # Synced passkeys never move their sign count, so this record is what stops a replay.
        if not await self._use_once(kind, opened.challenge, opened.expires_at):
            raise ApiError(
                401, "this passkey assertion was used already: begin again", reason="replayed"
            )
        if verified.sign_count_changed:

            def count(doc: dict[str, Any] | None) -> dict[str, Any] | None:
                if doc is None or cred_key not in doc.get("credentials", {}):
                    return None
                entry = doc["credentials"][cred_key]
                if entry.get("sign_count", 0) >= verified.sign_count:
                    return None  # a concurrent login stored a later count
                entry["sign_count"] = verified.sign_count
                return doc

            await self.store.update_user(uid, count)
        return uid, cred_key

    # -- link tokens and devices ---------------------------------------------------------------

    async def mint_token(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A link token for a new device, for a proof from a passkey ceremony (5 minutes)."""
        proof = body.get("proof")
        if not isinstance(proof, str):
            raise ApiError(400, "proof must be the string a passkey ceremony returned")
        verified = self.ceremonies.proofs.verify(proof, "link")
        uid = verified.uid
        self.limits.check([("mints", uid)])
        user = await self.store.get_user(uid)
        if user is None:
            raise ApiError(401, "this account is gone")  # (before anything is written)
        if len(user.doc.get("devices", {})) >= self.max_devices:
            raise self._too_many_devices()  # the proof is not used up: revoke one, retry
        if not await self._use_once("proof", proof, verified.expires_at):
            raise ApiError(401, "this proof was used already: log in again", reason="replayed")
        self.limits.take([("mints", uid)])
        token = b64url(self.random_bytes(32))
        device = b64url(self.random_bytes(9))
        digest = sha256_hex(token)
        await self.store.put_pointer("tokens", digest, uid)
        today = self.today()

        def add(doc: dict[str, Any] | None) -> dict[str, Any] | None:
            if doc is None:
                raise ApiError(401, "this account is gone")
            devices = doc.setdefault("devices", {})
            if len(devices) >= self.max_devices:
                raise self._too_many_devices()
            entry = {"token": digest, "created": today, "last_seen": today}
            if verified.credential:
                # What this passkey linked is revoked with it (revoke_credential).
                entry["cred"] = verified.credential
            devices[device] = entry
            return doc

        await self.store.update_user(uid, add)
        self.feed.cache.put(digest, uid, device)
        _log.info("home: a device was linked")
        return {"token": token, "device": device, "uid": uid}

    def _too_many_devices(self) -> ApiError:
        QUOTA_REFUSALS.labels("devices").inc()
        _log.info("home: a device was not linked: the account has {n} already", n=self.max_devices)
        return ApiError(
            409,
            f"an account links at most {self.max_devices} devices: revoke one first",
            quota="devices",
        )

    async def authenticate(self, request: Request) -> tuple[str, str]:
        """The (uid, device id) a request's ``Authorization: Bearer <token>`` names, or 401."""
        header = (request.getHeader("authorization") or "").strip()
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "a link token is needed: Authorization: Bearer <token>")
        digest = sha256_hex(token.strip())
        cached = self.feed.cache.get(digest)
        if cached is not None:
            self.limits.take([("account", cached[0])])
            return cached
        device: list[str] = []

        def listed(doc: Mapping[str, Any]) -> bool:
            for device_id, entry in doc.get("devices", {}).items():
                if isinstance(entry, dict) and entry.get("token") == digest:
                    device.append(device_id)
                    return True
            return False

        found = await resolve_checked(self.store, "tokens", digest, listed)
        if found is None:
            raise ApiError(401, "unknown or revoked link token")
        uid, user = found
        today = self.today()
        if user.doc["devices"][device[0]].get("last_seen") != today:

            def seen(doc: dict[str, Any] | None) -> dict[str, Any] | None:
                entry = (doc or {}).get("devices", {}).get(device[0])
                if doc is None or entry is None or entry.get("last_seen") == today:
                    return None
                entry["last_seen"] = today
                return doc

            await self.store.update_user(uid, seen)
        self.feed.cache.put(digest, uid, device[0])
        self.limits.take([("account", uid)])
        return uid, device[0]

    async def devices(self, uid: str, device: str) -> dict[str, Any]:
        user = await self.store.get_user(uid)
        if user is None:
            raise ApiError(401, "this account is gone")
        devices = [
            {
                "id": device_id,
                "created": entry.get("created", ""),
                "last_seen": entry.get("last_seen", ""),
                "current": device_id == device,
            }
            for device_id, entry in sorted(user.doc.get("devices", {}).items())
        ]
        credentials = [
            {"id": entry.get("id", ""), "created": entry.get("created", "")}
            for _, entry in sorted(user.doc.get("credentials", {}).items())
        ]
        return {"devices": devices, "credentials": credentials}

    # -- step-up: a fresh passkey assertion for one destructive change -------------------------

    async def step_up_begin(self, uid: str, device: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Options to assert one of the account's passkeys (user verification required), for
        the one change ``body["action"]`` names, by this device."""
        action = body.get("action")
        if not isinstance(action, str) or not _STEP_UP_ACTION.fullmatch(action):
            raise ApiError(
                400,
                'action must name the change: "DELETE /api/devices/<id>" or "DELETE '
                '/api/credentials/<id>"',
            )
        user = await self.store.get_user(uid)
        if user is None:
            raise ApiError(401, "this account is gone")
        start = self.passkeys.begin_login(
            rp_id=self.rp_id,
            credentials=_stored_credentials(user.doc),
            user_verification="required",
        )
        return self._begun("stepup", uid, start, bound=f"{device} {action}")

    async def step_up_finish(
        self, uid: str, device: str, session: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The step-up proof: single-use, for this account, device and change only, good for
        ``step_up_window`` seconds."""
        opened = self.ceremonies.sessions.open(session, "stepup")
        bound_device, _, action = opened.bound.partition(" ")
        if opened.uid != uid or bound_device != device or not action:
            raise ApiError(401, "this step-up was begun by another device", reason="not_yours")
        _, cred_key = await self._assert(opened, _credential(body), "step_up", uid_must_be=uid)
        proof = self.ceremonies.proofs.issue(
            uid,
            "stepup",
            credential=cred_key,
            action=action,
            device=device,
            ttl=self.step_up_window,
        )
        _log.info("home: a step-up was granted for {action}", action=action.split("/")[2])
        return {"step_up": proof, "action": action, "expires_in": self.step_up_window}

    async def require_step_up(self, uid: str, device: str, action: str, presented: str) -> None:
        """403 unless ``presented`` is an unused step-up proof of this account and device for
        exactly ``action``; uses it up."""
        if not presented:
            STEP_UPS.labels("missing").inc()
            raise ApiError(
                403,
                f'this change needs a step-up: POST /api/step-up/begin {{"action": "{action}"}}'
                ", assert a passkey, then send the proof as Step-Up: <proof>",
                step_up="required",
                action=action,
            )
        try:
            proof = self.ceremonies.proofs.verify(presented, "stepup")
        except CeremonyRejected as e:
            STEP_UPS.labels("not_valid").inc()
            raise ApiError(403, f"step-up: {e}", step_up="required", action=action) from e
        if proof.uid != uid or proof.device != device or proof.action != action:
            STEP_UPS.labels("wrong_change").inc()
            raise ApiError(
                403,
                "this step-up was granted for another change",
                step_up="required",
                action=action,
            )
        if not await self._use_once("step_up_proof", presented, proof.expires_at):
            STEP_UPS.labels("used").inc()
            raise ApiError(403, "this step-up was used already", step_up="required", action=action)
        STEP_UPS.labels("accepted").inc()

    async def revoke_device(self, uid: str, victim: str) -> None:
        """The user document first (the authority: every fresh check denies from then on),
        then the revocation feed (this process forgets the token at once, the others within
        their poll period). The caller checked the step-up (another device) first."""
        self.limits.take([("revocations", uid)])
        gone: list[str] = []

        def drop(doc: dict[str, Any] | None) -> dict[str, Any] | None:
            gone.clear()  # fn may run again after a lost race
            if doc is None or victim not in doc.get("devices", {}):
                return None
            entry = doc["devices"].pop(victim)
            gone.append(str(entry.get("token", "")) if isinstance(entry, dict) else "")
            return doc

        await self.store.update_user(uid, drop)
        if not gone:
            raise ApiError(404, "no such device")
        digest = gone[0]
        if _DIGEST.fullmatch(digest):
            await self.feed.publish(digest, uid, victim)
        _log.info("home: a device was revoked")

    async def revoke_credential(self, uid: str, credential_id: str) -> None:
        """Delete a passkey (never the last one) and revoke every device it linked. The caller
        checked the step-up first."""
        key = credential_key(credential_id)
        self.limits.take([("revocations", uid)])
        gone: list[tuple[str, str]] = []  # (device, token digest) it linked
        found: list[bool] = []

        def drop(doc: dict[str, Any] | None) -> dict[str, Any] | None:
            gone.clear()  # fn may run again after a lost race
            found.clear()
            if doc is None or key not in doc.get("credentials", {}):
                return None
            found.append(True)
            if len(doc["credentials"]) <= 1:
                QUOTA_REFUSALS.labels("last_passkey").inc()
                raise ApiError(
                    409,
                    "this is the account's last passkey: it cannot be deleted (the account "
                    "would be lost)",
                    quota="last_passkey",
                )
            del doc["credentials"][key]
            devices = doc.get("devices", {})
            for device_id, entry in list(devices.items()):
                if isinstance(entry, dict) and entry.get("cred") == key:
                    del devices[device_id]
                    gone.append((device_id, str(entry.get("token", ""))))
            return doc

        # The passkey needs no marker: no process caches passkeys (every login re-reads the
        # user document through the credential's pointer). The devices it linked do.
        await self.store.update_user(uid, drop)
        if not found:
            raise ApiError(404, "no such passkey")
        for device_id, digest in gone:
            if _DIGEST.fullmatch(digest):
                await self.feed.publish(digest, uid, device_id)
        _log.info(
            "home: a passkey was deleted, and the {n} device(s) it linked revoked", n=len(gone)
        )

    # -- the vault -----------------------------------------------------------------------------

    async def vault_get(self, uid: str) -> tuple[bytes, str] | None:
        blob = await self.store.get_blob(uid)
        return None if blob is None else (unpad(blob.data), blob.version)

    async def vault_put(self, uid: str, data: bytes, expected: str) -> str:
        if len(data) > self.vault_max:
            QUOTA_REFUSALS.labels("vault_size").inc()
            raise ApiError(413, f"the vault is at most {self.vault_max} bytes", quota="vault_size")
        self.limits.take([("vault_writes", uid)])
        try:
            return await self.store.put_blob(uid, pad(data, self.vault_max), expected)
        except Conflict as e:
            raise ApiError(409, "the vault changed", current=e.current_version) from e
        except BadVersion as e:
            raise ApiError(400, "not a version of this vault") from e

    async def vault_versions(self, uid: str) -> dict[str, Any]:
        versions = await self.store.list_blob_versions(uid)
        return {
            "versions": [
                {"version": v.version, "modified": v.modified.isoformat()} for v in versions
            ]
        }

    async def vault_version(self, uid: str, version: str) -> bytes:
        data = await self.store.get_blob_version(uid, version)
        if data is None:
            raise ApiError(404, "not one of the kept versions")
        return unpad(data)


def credential_key(credential_id: str) -> str:
    try:
        return sha256_hex(unb64url(credential_id))
    except ValueError as e:
        raise ApiError(400, f"credential id: {e}") from e


def _label(value: object, default: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        raise ApiError(400, "label must be a string of 1 to 64 characters")
    return value


def _credential(body: Mapping[str, Any]) -> Mapping[str, Any]:
    credential = body.get("credential")
    if not isinstance(credential, dict):
        raise ApiError(400, "credential must be the JSON the browser's passkey call returned")
    return credential


def _stored_credentials(doc: Mapping[str, Any]) -> list[pk.StoredCredential]:
    stored = []
    for entry in doc.get("credentials", {}).values():
        try:
            stored.append(
                pk.StoredCredential(
                    credential_id=unb64url(entry["id"]),
                    public_key=unb64url(entry["public_key"]),
                    sign_count=int(entry.get("sign_count", 0)),
                    transports=tuple(entry.get("transports", ())),
                )
            )
        except (KeyError, ValueError, TypeError):
            continue  # a damaged entry cannot log in; the rest still can
    return stored
