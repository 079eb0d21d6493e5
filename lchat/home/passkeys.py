"""Passkeys: WebAuthn registration and login for home, a thin layer on the ``webauthn`` package.

Each ceremony is two calls with nothing kept in between (the caller seals the challenge into a
``?session=`` token with :mod:`lchat.home.stateless`):

- ``begin_*`` returns the options JSON for ``navigator.credentials.create/get`` (``webauthn``'s
  ``options_to_json``) and the fresh random challenge to seal;
- ``finish_*`` verifies the browser's response against that challenge, the RP ID and the origin,
  and returns what to store (:class:`NewCredential`) or what changed (:class:`VerifiedLogin`).

Policy, decided here once:

- **Algorithms**: EdDSA, ES256 and RS256 (:data:`ALGORITHMS`), all the library verifies. An RS256
  key's modulus is bounded (:func:`check_public_key`, at registration and before every
  verification): its cost is paid on the reactor.
- **Attestation**: ``"none"`` is requested and nothing about the authenticator's make is trusted or
  required; home stores public-key metadata only (credential ID, COSE public key, sign count,
  transports, AAGUID) and no name.
- **Discoverable credentials are required**: home has no usernames, so a fresh device logs in with
  an empty ``allowCredentials`` and learns the account from the credential. The WebAuthn user handle
  is the uid (random, opaque, at most 64 bytes); ``user_name`` is only a label the browser shows in
  its passkey picker, never stored.
- **User verification is "preferred"** (unless the caller asks otherwise): the UV flag is reported
  back (``user_verified``) but not required.
- **Sign counts (clone detection)**: WebAuthn §6.1.1. A login whose authenticator reports a count
  that does not exceed the stored one (when either is non-zero) fails with
  :class:`SignCountRegressed`: two copies of one private key are in use, or (rarely) an
  authenticator went wrong. The check runs only *after* the signature verified, so nobody without
  the private key can trip it. The credential is not revoked automatically (that would let a flaky
  authenticator lock its owner out; the owner can revoke it from another device), and the stored
  count is not changed. Authenticators that do not count (synced passkeys) report 0 forever and are
  never judged: the sign count cannot stop their assertions from being replayed, so the API
  records every challenge it accepted as used, on every replica (lchat.home.api,
  ``VaultStore.use_once``). Concurrent logins with one counting authenticator can race: store
  ``max(stored, new)`` in the CAS loop, and the slower of the two simply fails and is retried.
- Every failure is a :class:`PasskeyError` (answer 401, write nothing); no exception from parsing
  hostile input escapes as anything else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from attrs import field, frozen
from webauthn import (
    generate_authentication_options,
    generate_registration_options,
    options_to_json,
    verify_authentication_response,
    verify_registration_response,
)
from webauthn.helpers import (
    bytes_to_base64url,
    parse_authentication_credential_json,
    parse_registration_credential_json,
)
from webauthn.helpers.cose import COSEAlgorithmIdentifier
from webauthn.helpers.decode_credential_public_key import (
    DecodedRSAPublicKey,
    decode_credential_public_key,
)
from webauthn.helpers.exceptions import WebAuthnException
from webauthn.helpers.structs import (
    AttestationConveyancePreference,
    AuthenticationCredential,
    AuthenticatorSelectionCriteria,
    AuthenticatorTransport,
    PublicKeyCredentialDescriptor,
    RegistrationCredential,
    ResidentKeyRequirement,
    UserVerificationRequirement,
)

from lchat.home.stateless import UserVerification

ALGORITHMS = [
    COSEAlgorithmIdentifier.EDDSA,
    COSEAlgorithmIdentifier.ECDSA_SHA_256,
    COSEAlgorithmIdentifier.RSASSA_PKCS1_v1_5_SHA_256,
]
CHALLENGE_BYTES = 32
MAX_USER_HANDLE_BYTES = 64  # WebAuthn's limit on user.id
MAX_CREDENTIAL_ID_BYTES = 1023  # WebAuthn L3 §7.1 step 23: longer ones are refused
# RS256 keys: the modulus within these bits and a small odd public exponent. A verification's
# cost grows with both (and runs on the reactor): a 16384-bit modulus or a huge exponent would
# let one passkey make every login with it, or a flood of registrations, expensive.
RSA_MIN_BITS = 2048
RSA_MAX_BITS = 4096
RSA_MAX_EXPONENT = (1 << 32) - 1
DEFAULT_TIMEOUT_MS = 300_000  # the browser's hint; the sealed session's window is the real limit

Response = str | Mapping[str, Any]  # the browser's PublicKeyCredential JSON, as text or parsed


class PasskeyError(Exception):
    """A passkey ceremony failed (answer 401, write nothing). ``reason`` is a stable word."""

    reason: ClassVar[str] = "failed"


class CeremonyFailed(PasskeyError):
    """The response does not verify: malformed, wrong origin, wrong RP ID, wrong challenge (a
    replayed or crossed ceremony), bad signature, user not present, or UV missing when required."""

    reason = "not_verified"


class UnknownCredential(PasskeyError):
    """The response names a credential that is not among the account's (never registered, revoked,
    or another account's)."""

    reason = "unknown_credential"

    def __init__(self, credential_id: bytes) -> None:
        super().__init__(f"credential {bytes_to_base64url(credential_id)} is not registered")
        self.credential_id = credential_id


class SignCountRegressed(PasskeyError):
    """A verified assertion whose sign count did not advance: a possibly cloned authenticator.
    Log it as a warning with the credential ID and both counts; the credential stays registered."""

    reason = "sign_count_regressed"

    def __init__(self, credential_id: bytes, stored: int, presented: int) -> None:
        super().__init__(
            f"credential {bytes_to_base64url(credential_id)} presented sign count {presented}, "
            f"not above the stored {stored}: possibly a cloned authenticator"
        )
        self.credential_id = credential_id
        self.stored = stored
        self.presented = presented


@frozen
class StoredCredential:
    """A registered credential as the store keeps it."""

    credential_id: bytes
    public_key: bytes  # COSE_Key, as registration returned it
    sign_count: int
    transports: tuple[str, ...] = ()


@frozen
class CeremonyStart:
    """``options_json`` goes to the browser; ``challenge`` and ``user_verification`` go into the
    sealed session, to be handed back to the matching ``finish_*``."""

    options_json: str
    challenge: bytes = field(repr=False)
    user_verification: UserVerification


@frozen
class NewCredential:
    """A verified registration: what to store (see :class:`StoredCredential`), plus facts the API
    may report. ``aaguid`` is the authenticator model's GUID (all zeroes when it keeps it private)."""

    credential_id: bytes
    public_key: bytes
    sign_count: int
    transports: tuple[str, ...]
    aaguid: str
    user_verified: bool
    backed_up: bool  # a synced (multi-device) passkey that is currently backed up


@frozen
class VerifiedLogin:
    """A verified login with ``credential_id``. ``sign_count`` is the count to store; write it only
    when ``sign_count_changed`` (counter-less passkeys never cost a write)."""

    credential_id: bytes
    sign_count: int
    sign_count_changed: bool
    user_verified: bool
    backed_up: bool


def _descriptors(credentials: Sequence[StoredCredential]) -> list[PublicKeyCredentialDescriptor]:
    descriptors = []
    for credential in credentials:
        transports = []
        for name in credential.transports:
            try:
                transports.append(AuthenticatorTransport(name))
            except ValueError:
                pass  # a transport newer than the library: the browser does without the hint
        descriptors.append(
            PublicKeyCredentialDescriptor(
                id=credential.credential_id, transports=transports or None
            )
        )
    return descriptors


def user_handle(uid: str) -> bytes:
    """The WebAuthn user handle for ``uid`` (its UTF-8 bytes; at most 64)."""
    handle = uid.encode("utf-8")
    if not handle or len(handle) > MAX_USER_HANDLE_BYTES:
        raise ValueError(f"a uid must be 1 to {MAX_USER_HANDLE_BYTES} bytes to be a user handle")
    return handle


@frozen
class Passkeys:
    """Begins and finishes WebAuthn ceremonies for one relying-party name. Stateless: the challenge
    from ``begin_*`` must come back to ``finish_*`` through the caller (the sealed session).

    ``random_bytes`` makes challenges; ``timeout_ms`` is the hint the browser gets."""

    rp_name: str
    random_bytes: Callable[[int], bytes] = os.urandom
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    def begin_registration(
        self,
        *,
        rp_id: str,
        uid: str,
        user_name: str,
        existing: Sequence[StoredCredential] = (),
        user_verification: UserVerification = "preferred",
    ) -> CeremonyStart:
        """Options to create a discoverable credential for ``uid``; ``existing`` (the account's
        credentials) are excluded so one authenticator is not registered twice."""
        challenge = self.random_bytes(CHALLENGE_BYTES)
        options = generate_registration_options(
            rp_id=rp_id,
            rp_name=self.rp_name,
            user_id=user_handle(uid),
            user_name=user_name,
            challenge=challenge,
            timeout=self.timeout_ms,
            attestation=AttestationConveyancePreference.NONE,
            authenticator_selection=AuthenticatorSelectionCriteria(
                resident_key=ResidentKeyRequirement.REQUIRED,
                user_verification=UserVerificationRequirement(user_verification),
            ),
            exclude_credentials=_descriptors(existing),
            supported_pub_key_algs=ALGORITHMS,
        )
        return CeremonyStart(options_to_json(options), challenge, user_verification)

    def finish_registration(
        self,
        response: Response,
        *,
        challenge: bytes,
        rp_id: str,
        origin: str | list[str],
        user_verification: UserVerification = "preferred",
    ) -> NewCredential:
        """Verify a ``navigator.credentials.create`` response; :class:`CeremonyFailed` if it does
        not. The caller must still refuse a credential ID that is already registered anywhere."""
        try:
            credential: RegistrationCredential = parse_registration_credential_json(
                response if isinstance(response, str) else dict(response)
            )
            verified = verify_registration_response(
                credential=credential,
                expected_challenge=challenge,
                expected_rp_id=rp_id,
                expected_origin=origin,
                require_user_verification=user_verification == "required",
                supported_pub_key_algs=ALGORITHMS,
            )
        except (WebAuthnException, ValueError, TypeError, KeyError) as e:
            raise CeremonyFailed(f"passkey registration does not verify: {e}") from e
        check_public_key(verified.credential_public_key)
        if len(verified.credential_id) > MAX_CREDENTIAL_ID_BYTES:
            raise CeremonyFailed(
                f"credential ID is {len(verified.credential_id)} bytes, over WebAuthn's "
                f"{MAX_CREDENTIAL_ID_BYTES}"
            )
        return NewCredential(
            credential_id=verified.credential_id,
            public_key=verified.credential_public_key,
            sign_count=verified.sign_count,
            transports=tuple(t.value for t in credential.response.transports or ()),
            aaguid=verified.aaguid,
            user_verified=verified.user_verified,
            backed_up=verified.credential_backed_up,
        )

    def begin_login(
        self,
        *,
        rp_id: str,
        credentials: Sequence[StoredCredential] = (),
        user_verification: UserVerification = "preferred",
    ) -> CeremonyStart:
        """Options to assert one of ``credentials``; none (the usual case, home has no usernames)
        lets the authenticator offer any discoverable credential it holds for ``rp_id``."""
        challenge = self.random_bytes(CHALLENGE_BYTES)
        options = generate_authentication_options(
            rp_id=rp_id,
            challenge=challenge,
            timeout=self.timeout_ms,
            allow_credentials=_descriptors(credentials),
            user_verification=UserVerificationRequirement(user_verification),
        )
        return CeremonyStart(options_to_json(options), challenge, user_verification)

    def finish_login(
        self,
        response: Response,
        *,
        challenge: bytes,
        rp_id: str,
        origin: str | list[str],
        uid: str,
        credentials: Sequence[StoredCredential],
        user_verification: UserVerification = "preferred",
    ) -> VerifiedLogin:
        """Verify a ``navigator.credentials.get`` response as a login to account ``uid`` holding
        ``credentials``: :class:`UnknownCredential` if it names none of them, :class:`CeremonyFailed`
        if it does not verify (or its user handle is not ``uid``'s), :class:`SignCountRegressed`
        if it verifies but its counter went backwards."""
        presented = self._parse_assertion(response)
        stored = next(
            (c for c in credentials if c.credential_id == presented.raw_id),
            None,
        )
        if stored is None:
            raise UnknownCredential(presented.raw_id)
        check_public_key(stored.public_key)  # one stored before the bound never verifies
        handle = presented.response.user_handle
        if handle and handle != user_handle(uid):  # absent or empty: a non-discoverable login
            raise CeremonyFailed("the credential's user handle belongs to another account")
        try:
            verified = verify_authentication_response(
                credential=presented,
                expected_challenge=challenge,
                expected_rp_id=rp_id,
                expected_origin=origin,
                credential_public_key=stored.public_key,
                # 0 switches the library's own counter check off: it runs before the signature
                # is verified (and raises the same error as a forgery); ours runs after.
                credential_current_sign_count=0,
                require_user_verification=user_verification == "required",
            )
        except (WebAuthnException, ValueError, TypeError, KeyError) as e:
            raise CeremonyFailed(f"passkey login does not verify: {e}") from e
        new = verified.new_sign_count
        if (new > 0 or stored.sign_count > 0) and new <= stored.sign_count:
            raise SignCountRegressed(stored.credential_id, stored.sign_count, new)
        return VerifiedLogin(
            credential_id=stored.credential_id,
            sign_count=new,
            sign_count_changed=new != stored.sign_count,
            user_verified=verified.user_verified,
            backed_up=verified.credential_backed_up,
        )

    def presented_credential_id(self, response: Response) -> bytes:
        """The credential ID a login response claims (not verified: for finding the account,
        ``creds/<id>`` → uid → its credentials, before :meth:`finish_login`, never for trusting)."""
        return self._parse_assertion(response).raw_id

    def _parse_assertion(self, response: Response) -> AuthenticationCredential:
        try:
            parsed = json.loads(response) if isinstance(response, str) else dict(response)
            credential = parse_authentication_credential_json(parsed)
        except (WebAuthnException, ValueError, TypeError, KeyError) as e:
            raise CeremonyFailed(f"passkey login response is malformed: {e}") from e
        # The library's base64url decoding is lenient ("!!" reads as b""): insist on canonical
        # values for the two fields we look things up by, before anyone looks them up. (The library
        # checks id against rawId too, but only after the caller's lookup.)
        if not credential.raw_id or bytes_to_base64url(credential.raw_id) != credential.id:
            raise CeremonyFailed("passkey login response is malformed: id and rawId differ")
        handle_text = parsed["response"].get("userHandle")
        handle = credential.response.user_handle
        if handle_text and bytes_to_base64url(handle or b"") != handle_text.rstrip("="):
            raise CeremonyFailed("passkey login response is malformed: userHandle is not base64url")
        return credential


def check_public_key(public_key: bytes) -> None:
    """:class:`CeremonyFailed` unless ``public_key`` (COSE) parses, and an RSA one has a modulus of
    :data:`RSA_MIN_BITS` to :data:`RSA_MAX_BITS` bits and an odd exponent of 3 to
    :data:`RSA_MAX_EXPONENT`."""
    try:
        decoded = decode_credential_public_key(public_key)
    except Exception as e:  # hostile CBOR: any parse failure is a refusal
        raise CeremonyFailed(f"the passkey's public key does not parse: {e}") from e
    if isinstance(decoded, DecodedRSAPublicKey):
        bits = int.from_bytes(decoded.n, "big").bit_length()
        exponent = int.from_bytes(decoded.e, "big")
        if not RSA_MIN_BITS <= bits <= RSA_MAX_BITS:
            raise CeremonyFailed(
                f"an RSA passkey's modulus is {RSA_MIN_BITS} to {RSA_MAX_BITS} bits, not {bits}"
            )
        if not (3 <= exponent <= RSA_MAX_EXPONENT and exponent % 2 == 1):
            raise CeremonyFailed("an RSA passkey's public exponent must be odd, 3 to 2**32-1")
