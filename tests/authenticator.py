"""A software WebAuthn authenticator (and the browser's part of the ceremony), on ``cryptography``.

:class:`SoftwareAuthenticator` answers the JSON options a relying party sends for
``navigator.credentials.create()`` / ``.get()`` (what ``webauthn.options_to_json`` produces, bare or
wrapped in ``{"publicKey": ...}``) with the JSON a browser's ``PublicKeyCredential.toJSON()`` would
post back:

- registration: ``clientDataJSON`` (``webauthn.create``, the challenge, the origin), an
  ``attestationObject`` in the ``"none"`` format whose ``authData`` holds the SHA-256 of the RP ID,
  flags UP|UV|AT, the sign count, the AAGUID, the credential ID and the COSE public key;
- authentication: ``clientDataJSON`` (``webauthn.get``), ``authenticatorData`` (RP ID hash, UP|UV,
  the incremented sign count) and the signature over ``authenticatorData || SHA-256(clientDataJSON)``,
  plus the ``userHandle`` of the discoverable credential.

Keys are ES256 (P-256) by default; EdDSA (Ed25519) and RS256 on request. Credentials are resident
(discoverable): an empty ``allowCredentials`` picks the newest one for the RP ID.

It is deliberately independent of lchat and of the ``webauthn`` package (its own small CBOR encoder),
so a bug on the relying party's side cannot cancel out against the same bug here. For negative tests,
keyword arguments lie the way a broken or hostile client would (``rp_id=`` signs for another RP ID,
``challenge=`` answers another challenge, ``user_present=False``), and a credential's ``sign_count``
can be wound back to act as a clone.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

ES256 = -7
EDDSA = -8
RS256 = -257

FLAG_UP = 0x01  # user present
FLAG_UV = 0x04  # user verified
FLAG_AT = 0x40  # attested credential data included

PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey


class AuthenticatorRefused(Exception):
    """What a browser would reject the ``create``/``get`` promise with (NotAllowedError,
    InvalidStateError, NotSupportedError): ``name`` says which."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def cbor(value: Any) -> bytes:
    """CTAP2 canonical CBOR for what authenticators emit: ints, bytes, text, lists, maps (keys sorted
    by encoded length, then bytewise), booleans and null."""
    if value is True:
        return b"\xf5"
    if value is False:
        return b"\xf4"
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        encoded = value.encode("utf-8")
        return _cbor_head(3, len(encoded)) + encoded
    if isinstance(value, list | tuple):
        return _cbor_head(4, len(value)) + b"".join(cbor(item) for item in value)
    if isinstance(value, dict):
        items = sorted(
            ((cbor(k), cbor(v)) for k, v in value.items()), key=lambda kv: (len(kv[0]), kv[0])
        )
        return _cbor_head(5, len(items)) + b"".join(k + v for k, v in items)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def _cbor_head(major: int, argument: int) -> bytes:
    if argument < 24:
        return bytes([major << 5 | argument])
    for additional, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if argument < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | additional]) + struct.pack(fmt, argument)
    raise ValueError("CBOR argument too large")


def _int_bytes(n: int) -> bytes:
    return n.to_bytes((n.bit_length() + 7) // 8, "big")


def generate_key(algorithm: int) -> PrivateKey:
    if algorithm == ES256:
        return ec.generate_private_key(ec.SECP256R1())
    if algorithm == EDDSA:
        return ed25519.Ed25519PrivateKey.generate()
    if algorithm == RS256:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    raise ValueError(f"unsupported COSE algorithm {algorithm}")


def cose_public_key(key: PrivateKey, algorithm: int) -> bytes:
    """The credential public key as a COSE_Key (RFC 9052/9053), as it appears in authData."""
    if algorithm == ES256:
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        numbers = key.public_key().public_numbers()
        x, y = numbers.x.to_bytes(32, "big"), numbers.y.to_bytes(32, "big")
        return cbor({1: 2, 3: ES256, -1: 1, -2: x, -3: y})
    if algorithm == EDDSA:
        assert isinstance(key, ed25519.Ed25519PrivateKey)
        raw = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return cbor({1: 1, 3: EDDSA, -1: 6, -2: raw})
    assert isinstance(key, rsa.RSAPrivateKey) and algorithm == RS256
    public = key.public_key().public_numbers()
    return cbor({1: 3, 3: RS256, -1: _int_bytes(public.n), -2: _int_bytes(public.e)})


def sign(key: PrivateKey, algorithm: int, data: bytes) -> bytes:
    """A WebAuthn assertion signature: DER ECDSA for ES256, raw Ed25519, PKCS#1 v1.5 for RS256."""
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    return key.sign(data, padding.PKCS1v15(), hashes.SHA256())


@dataclass
class Credential:
    """One resident credential. Wind ``sign_count`` back to impersonate a clone."""

    credential_id: bytes
    rp_id: str
    user_handle: bytes
    private_key: PrivateKey
    algorithm: int
    sign_count: int = 0


@dataclass
class SoftwareAuthenticator:
    """A platform authenticator that always has its user present and (by default) verified.

    ``counter=False`` makes it report a sign count of 0 forever, as synced passkeys do."""

    algorithm: int = ES256
    aaguid: bytes = bytes(16)
    user_verifying: bool = True
    counter: bool = True
    transports: tuple[str, ...] = ("internal",)
    credential_id_bytes: int = 32
    credentials: list[Credential] = field(default_factory=list)

    def create(
        self,
        options: str | dict[str, Any],
        *,
        origin: str,
        rp_id: str | None = None,
        challenge: str | None = None,
        user_present: bool = True,
    ) -> dict[str, Any]:
        """``navigator.credentials.create({publicKey: options})`` on ``origin``, as JSON.

        ``rp_id`` makes it sign for another RP ID than the options name, ``challenge`` (base64url)
        answer another challenge than the options carry."""
        opts = _public_key_options(options)
        options_rp_id = opts["rp"].get("id") or _host(origin)
        algorithms = [
            p["alg"] for p in opts.get("pubKeyCredParams", []) if p.get("type") == "public-key"
        ]
        if algorithms and self.algorithm not in algorithms:
            raise AuthenticatorRefused(
                "NotSupportedError", f"the RP does not accept alg {self.algorithm}"
            )
        excluded = {b64url_decode(c["id"]) for c in opts.get("excludeCredentials") or []}
        if any(c.rp_id == options_rp_id and c.credential_id in excluded for c in self.credentials):
            raise AuthenticatorRefused(
                "InvalidStateError", "this authenticator is already registered"
            )
        selection = opts.get("authenticatorSelection") or {}
        if selection.get("userVerification") == "required" and not self.user_verifying:
            raise AuthenticatorRefused("NotAllowedError", "user verification is required")
        credential = Credential(
            credential_id=os.urandom(self.credential_id_bytes),
            rp_id=options_rp_id,
            user_handle=b64url_decode(opts["user"]["id"]),
            private_key=generate_key(self.algorithm),
            algorithm=self.algorithm,
        )
        self.credentials.append(credential)
        client_data = _client_data("webauthn.create", challenge or opts["challenge"], origin)
        attested = (
            self.aaguid
            + struct.pack(">H", len(credential.credential_id))
            + credential.credential_id
            + cose_public_key(credential.private_key, credential.algorithm)
        )
        auth_data = (
            self._auth_data(rp_id or options_rp_id, FLAG_AT, credential.sign_count, user_present)
            + attested
        )
        spki = credential.private_key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        attestation_object = cbor({"fmt": "none", "attStmt": {}, "authData": auth_data})
        return {
            "id": b64url(credential.credential_id),
            "rawId": b64url(credential.credential_id),
            "type": "public-key",
            "authenticatorAttachment": "platform",
            "clientExtensionResults": {},
            "response": {
                "clientDataJSON": b64url(client_data),
                "attestationObject": b64url(attestation_object),
                "authenticatorData": b64url(auth_data),
                "transports": list(self.transports),
                "publicKeyAlgorithm": credential.algorithm,
                "publicKey": b64url(spki),
            },
        }

    def get(
        self,
        options: str | dict[str, Any],
        *,
        origin: str,
        rp_id: str | None = None,
        challenge: str | None = None,
        user_present: bool = True,
    ) -> dict[str, Any]:
        """``navigator.credentials.get({publicKey: options})`` on ``origin``, as JSON: the first
        allowed credential this authenticator holds, or (empty ``allowCredentials``) its newest
        discoverable one for the RP ID. ``rp_id``/``challenge`` lie as in :meth:`create`."""
        opts = _public_key_options(options)
        options_rp_id = opts.get("rpId") or _host(origin)
        allowed = [b64url_decode(c["id"]) for c in opts.get("allowCredentials") or []]
        mine = [c for c in self.credentials if c.rp_id == options_rp_id]
        if allowed:
            mine = [c for c in mine if c.credential_id in allowed]
        if not mine:
            raise AuthenticatorRefused("NotAllowedError", "no credential for this RP")
        if opts.get("userVerification") == "required" and not self.user_verifying:
            raise AuthenticatorRefused("NotAllowedError", "user verification is required")
        credential = mine[-1] if not allowed else mine[0]
        if self.counter:
            credential.sign_count += 1
        client_data = _client_data("webauthn.get", challenge or opts["challenge"], origin)
        auth_data = self._auth_data(
            rp_id or options_rp_id, 0, credential.sign_count if self.counter else 0, user_present
        )
        signature = sign(
            credential.private_key,
            credential.algorithm,
            auth_data + hashlib.sha256(client_data).digest(),
        )
        return {
            "id": b64url(credential.credential_id),
            "rawId": b64url(credential.credential_id),
            "type": "public-key",
            "authenticatorAttachment": "platform",
            "clientExtensionResults": {},
            "response": {
                "clientDataJSON": b64url(client_data),
                "authenticatorData": b64url(auth_data),
                "signature": b64url(signature),
                "userHandle": b64url(credential.user_handle),
            },
        }

    def _auth_data(
        self, rp_id: str, extra_flags: int, sign_count: int, user_present: bool
    ) -> bytes:
        flags = (
            extra_flags | (FLAG_UP if user_present else 0) | (FLAG_UV if self.user_verifying else 0)
        )
        return (
            hashlib.sha256(rp_id.encode()).digest() + bytes([flags]) + struct.pack(">I", sign_count)
        )


def _public_key_options(options: str | dict[str, Any]) -> dict[str, Any]:
    parsed = json.loads(options) if isinstance(options, str) else options
    inner = parsed.get("publicKey", parsed)
    assert isinstance(inner, dict)
    return inner


def _host(origin: str) -> str:
    # A browser's default RP ID: the origin's effective domain.
    return urlsplit(origin).hostname or ""


def _client_data(kind: str, challenge: str, origin: str) -> bytes:
    # A browser serialises the challenge bytes afresh: decode and re-encode, never echo.
    return json.dumps(
        {
            "type": kind,
            "challenge": b64url(b64url_decode(challenge)),
            "origin": origin,
            "crossOrigin": False,
        },
        separators=(",", ":"),
    ).encode()
