"""lchat.home.passkeys: WebAuthn registration and login on the ``webauthn`` package, driven by the
software authenticator in tests/authenticator.py (independent of both), and finished through a
sealed session opened by another Ceremonies instance with the same key (nothing kept in between)."""

from __future__ import annotations

import base64
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from lchat.home.passkeys import (
    CeremonyFailed,
    NewCredential,
    PasskeyError,
    Passkeys,
    SignCountRegressed,
    StoredCredential,
    UnknownCredential,
)
from lchat.home.stateless import Ceremonies, SessionKeys
from tests.authenticator import (
    EDDSA,
    ES256,
    RS256,
    AuthenticatorRefused,
    SoftwareAuthenticator,
    b64url,
    b64url_decode,
)

RP_ID = "home.example.test"
ORIGIN = "https://home.example.test"
UID = "u-7f3a"
PASSKEYS = Passkeys(rp_name="lchat home")


def as_stored(credential: NewCredential) -> StoredCredential:
    """What the API stores of a registered credential."""
    return StoredCredential(
        credential.credential_id,
        credential.public_key,
        credential.sign_count,
        credential.transports,
    )


def register(
    authenticator: SoftwareAuthenticator, existing: tuple[StoredCredential, ...] = ()
) -> NewCredential:
    start = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat", existing=existing)
    response = authenticator.create(start.options_json, origin=ORIGIN)
    return PASSKEYS.finish_registration(
        response, challenge=start.challenge, rp_id=RP_ID, origin=ORIGIN
    )


def login(
    authenticator: SoftwareAuthenticator, credentials: list[StoredCredential], **lie: Any
) -> Any:
    start = PASSKEYS.begin_login(rp_id=RP_ID)
    response = authenticator.get(start.options_json, origin=lie.pop("origin", ORIGIN), **lie)
    return PASSKEYS.finish_login(
        response,
        challenge=start.challenge,
        rp_id=RP_ID,
        origin=ORIGIN,
        uid=UID,
        credentials=credentials,
    )


def flip(text: str, index: int, bit: int = 0) -> str:
    data = bytearray(b64url_decode(text))
    data[index % len(data)] ^= 1 << bit
    return b64url(bytes(data))


class RoundTripTests(SynchronousTestCase):
    def test_register_and_log_in(self) -> None:
        authenticator = SoftwareAuthenticator(aaguid=bytes(range(16)))
        credential = register(authenticator)
        self.assertEqual(credential.credential_id, authenticator.credentials[0].credential_id)
        self.assertEqual(credential.sign_count, 0)
        self.assertEqual(credential.transports, ("internal",))
        self.assertEqual(credential.aaguid, "00010203-0405-0607-0809-0a0b0c0d0e0f")
        self.assertTrue(credential.user_verified)
        self.assertFalse(credential.backed_up)
        stored = [as_stored(credential)]
        first = login(authenticator, stored)
        self.assertEqual(first.credential_id, credential.credential_id)
        self.assertEqual((first.sign_count, first.sign_count_changed), (1, True))
        self.assertTrue(first.user_verified)
        stored = [StoredCredential(credential.credential_id, credential.public_key, 1)]
        self.assertEqual(login(authenticator, stored).sign_count, 2)

    def test_every_supported_algorithm(self) -> None:
        for algorithm in (ES256, EDDSA, RS256):
            authenticator = SoftwareAuthenticator(algorithm=algorithm)
            credential = register(authenticator)
            self.assertEqual(login(authenticator, [as_stored(credential)]).sign_count, 1)

    def test_the_options_ask_for_what_home_needs(self) -> None:
        start = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        options = json.loads(start.options_json)
        self.assertEqual(options["rp"], {"name": "lchat home", "id": RP_ID})
        self.assertEqual(b64url_decode(options["user"]["id"]), UID.encode())
        self.assertEqual(b64url_decode(options["challenge"]), start.challenge)
        self.assertEqual(len(start.challenge), 32)
        self.assertEqual([p["alg"] for p in options["pubKeyCredParams"]], [-8, -7, -257])
        self.assertEqual(options["attestation"], "none")
        self.assertEqual(options["authenticatorSelection"]["residentKey"], "required")
        self.assertEqual(options["authenticatorSelection"]["userVerification"], "preferred")
        self.assertEqual(start.user_verification, "preferred")
        login_start = PASSKEYS.begin_login(rp_id=RP_ID)
        login_options = json.loads(login_start.options_json)
        self.assertEqual(login_options["rpId"], RP_ID)
        self.assertEqual(login_options["allowCredentials"], [])  # discoverable: no usernames
        self.assertEqual(login_options["userVerification"], "preferred")
        self.assertNotEqual(login_start.challenge, start.challenge)

    def test_login_with_an_allow_list(self) -> None:
        authenticator = SoftwareAuthenticator(transports=("usb", "nfc"))
        credential = register(authenticator)
        start = PASSKEYS.begin_login(rp_id=RP_ID, credentials=[as_stored(credential)])
        allowed = json.loads(start.options_json)["allowCredentials"]
        self.assertEqual(
            allowed,
            [
                {
                    "id": b64url(credential.credential_id),
                    "type": "public-key",
                    "transports": ["usb", "nfc"],
                }
            ],
        )
        response = authenticator.get(start.options_json, origin=ORIGIN)
        verified = PASSKEYS.finish_login(
            response,
            challenge=start.challenge,
            rp_id=RP_ID,
            origin=ORIGIN,
            uid=UID,
            credentials=[as_stored(credential)],
        )
        self.assertEqual(verified.credential_id, credential.credential_id)

    def test_registered_credentials_are_excluded(self) -> None:
        authenticator = SoftwareAuthenticator()
        credential = register(authenticator)
        with self.assertRaises(AuthenticatorRefused) as caught:
            register(authenticator, existing=(as_stored(credential),))
        self.assertEqual(caught.exception.name, "InvalidStateError")

    def test_through_sealed_sessions_on_two_replicas(self) -> None:
        """Begin on one Ceremonies, finish on another built from the same key: the session token is
        the whole of the ceremony's state."""
        clock = Clock()
        clock.advance(1_700_000_000)
        keys = SessionKeys.derive(bytes(range(32)))
        replica_a = Ceremonies.from_keys(keys, clock.seconds)
        replica_b = Ceremonies.from_keys(keys, clock.seconds)
        authenticator = SoftwareAuthenticator()

        start = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        token = replica_a.sessions.seal(
            "register",
            uid=UID,
            challenge=start.challenge,
            rp_id=RP_ID,
            user_verification=start.user_verification,
        )
        response = authenticator.create(start.options_json, origin=ORIGIN)
        clock.advance(20)
        session = replica_b.sessions.open(token, "register")
        credential = PASSKEYS.finish_registration(
            response,
            challenge=session.challenge,
            rp_id=session.rp_id,
            origin=ORIGIN,
            user_verification=session.user_verification,
        )

        start = PASSKEYS.begin_login(rp_id=RP_ID)
        token = replica_b.sessions.seal("login", uid=None, challenge=start.challenge, rp_id=RP_ID)
        response = authenticator.get(start.options_json, origin=ORIGIN)
        session = replica_a.sessions.open(token, "login")
        self.assertEqual(PASSKEYS.presented_credential_id(response), credential.credential_id)
        verified = PASSKEYS.finish_login(
            response,
            challenge=session.challenge,
            rp_id=session.rp_id,
            origin=ORIGIN,
            uid=UID,  # the response's user handle must be this uid's
            credentials=[as_stored(credential)],
        )
        self.assertEqual(verified.credential_id, credential.credential_id)


class RegistrationRefusalTests(SynchronousTestCase):
    def finish(self, response: Any, challenge: bytes, **expect: Any) -> NewCredential:
        return PASSKEYS.finish_registration(
            response,
            challenge=challenge,
            rp_id=expect.get("rp_id", RP_ID),
            origin=expect.get("origin", ORIGIN),
            user_verification=expect.get("user_verification", "preferred"),
        )

    def test_wrong_origin(self) -> None:
        start = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        response = SoftwareAuthenticator().create(start.options_json, origin="https://evil.test")
        with self.assertRaises(CeremonyFailed) as caught:
            self.finish(response, start.challenge)
        self.assertIn("origin", str(caught.exception))
        # The same response is fine where its origin is expected: only the origin was wrong.
        self.finish(response, start.challenge, origin=["https://other.test", "https://evil.test"])

    def test_wrong_rp_id(self) -> None:
        start = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        response = SoftwareAuthenticator().create(
            start.options_json, origin=ORIGIN, rp_id="evil.test"
        )
        with self.assertRaises(CeremonyFailed) as caught:
            self.finish(response, start.challenge)
        self.assertIn("RP ID", str(caught.exception))

    def test_an_answer_to_another_ceremony(self) -> None:
        """A response to an earlier ceremony's options, finished with a later session's challenge
        (a replay, or two tabs crossed), fails."""
        old = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        new = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        response = SoftwareAuthenticator().create(old.options_json, origin=ORIGIN)
        with self.assertRaises(CeremonyFailed) as caught:
            self.finish(response, new.challenge)
        self.assertIn("challenge", str(caught.exception))
        self.finish(response, old.challenge)  # its own ceremony accepts it

    def test_user_verification_required_is_enforced_by_the_server(self) -> None:
        start = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        response = SoftwareAuthenticator(user_verifying=False).create(
            start.options_json, origin=ORIGIN
        )
        self.assertFalse(self.finish(response, start.challenge).user_verified)  # "preferred"
        with self.assertRaises(CeremonyFailed):
            self.finish(response, start.challenge, user_verification="required")

    def test_user_not_present(self) -> None:
        start = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        response = SoftwareAuthenticator().create(
            start.options_json, origin=ORIGIN, user_present=False
        )
        with self.assertRaises(CeremonyFailed):
            self.finish(response, start.challenge)

    def test_credential_ids_longer_than_webauthn_allows(self) -> None:
        start = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        for length, accepted in ((1023, True), (1024, False)):
            authenticator = SoftwareAuthenticator(credential_id_bytes=length)
            response = authenticator.create(start.options_json, origin=ORIGIN)
            if accepted:
                self.assertEqual(len(self.finish(response, start.challenge).credential_id), length)
            else:
                with self.assertRaises(CeremonyFailed):
                    self.finish(response, start.challenge)

    def test_malformed_responses(self) -> None:
        start = PASSKEYS.begin_registration(rp_id=RP_ID, uid=UID, user_name="lchat")
        good = SoftwareAuthenticator().create(start.options_json, origin=ORIGIN)
        inner = good["response"]
        for bad in (
            "",
            "null",
            "[]",
            "{}",
            {"id": 1},
            dict(good, rawId="!!"),
            dict(good, id=b64url(b"someone else")),
            dict(good, type="password"),
            dict(good, response=dict(inner, clientDataJSON=b64url(b"{not json"))),
            dict(good, response=dict(inner, attestationObject=b64url(b"\xff\x00garbage"))),
            dict(good, response=dict(inner, attestationObject=7)),
            dict(good, response="nope"),
        ):
            with self.assertRaises(CeremonyFailed, msg=str(bad)[:80]):
                self.finish(bad, start.challenge)


class LoginRefusalTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.authenticator = SoftwareAuthenticator()
        self.credential = register(self.authenticator)
        self.stored = [as_stored(self.credential)]

    def finish(self, response: Any, challenge: bytes, **expect: Any) -> Any:
        return PASSKEYS.finish_login(
            response,
            challenge=challenge,
            rp_id=expect.get("rp_id", RP_ID),
            origin=expect.get("origin", ORIGIN),
            uid=expect.get("uid", UID),
            credentials=expect.get("credentials", self.stored),
            user_verification=expect.get("user_verification", "preferred"),
        )

    def test_wrong_origin(self) -> None:
        with self.assertRaises(CeremonyFailed):
            login(self.authenticator, self.stored, origin="https://home.example.test.evil.test")

    def test_wrong_rp_id(self) -> None:
        with self.assertRaises(CeremonyFailed):
            login(self.authenticator, self.stored, rp_id="example.test")

    def test_a_replayed_ceremony(self) -> None:
        """A response for an older challenge fails under a newer session; so does a completed
        login's response presented again under a new ceremony."""
        old = PASSKEYS.begin_login(rp_id=RP_ID)
        new = PASSKEYS.begin_login(rp_id=RP_ID)
        stale = self.authenticator.get(old.options_json, origin=ORIGIN)
        with self.assertRaises(CeremonyFailed):
            self.finish(stale, new.challenge)
        first = PASSKEYS.begin_login(rp_id=RP_ID)
        response = self.authenticator.get(first.options_json, origin=ORIGIN)
        self.finish(response, first.challenge)
        with self.assertRaises(CeremonyFailed):
            self.finish(response, PASSKEYS.begin_login(rp_id=RP_ID).challenge)
        # A lying client cannot fix it up: changing the challenge breaks the signature instead.
        client_data = json.loads(b64url_decode(stale["response"]["clientDataJSON"]))
        client_data["challenge"] = b64url(new.challenge)
        stale["response"]["clientDataJSON"] = b64url(json.dumps(client_data).encode())
        with self.assertRaises(CeremonyFailed) as caught:
            self.finish(stale, new.challenge)
        self.assertIn("signature", str(caught.exception))

    def test_a_tampered_signature(self) -> None:
        start = PASSKEYS.begin_login(rp_id=RP_ID)
        response = self.authenticator.get(start.options_json, origin=ORIGIN)
        response["response"]["signature"] = flip(response["response"]["signature"], 20)
        with self.assertRaises(CeremonyFailed) as caught:
            self.finish(response, start.challenge)
        self.assertIn("signature", str(caught.exception))

    def test_a_signature_by_another_key(self) -> None:
        """A credential ID copied onto another authenticator's assertion does not log in."""
        thief = SoftwareAuthenticator()
        register(thief)
        thief.credentials[0].credential_id = self.credential.credential_id
        thief.credentials[0].user_handle = UID.encode()
        with self.assertRaises(CeremonyFailed):
            login(thief, self.stored)

    def test_sign_count_regression(self) -> None:
        self.assertEqual(login(self.authenticator, self.stored).sign_count, 1)
        stored = [StoredCredential(self.credential.credential_id, self.credential.public_key, 5)]
        for presented in (5, 3, 0):  # equal, lower, and a counter that stopped counting
            self.authenticator.credentials[0].sign_count = presented - 1
            self.authenticator.counter = presented > 0
            with self.assertRaises(SignCountRegressed, msg=str(presented)) as caught:
                login(self.authenticator, stored)
            self.assertEqual(caught.exception.stored, 5)
            self.assertEqual(caught.exception.presented, presented)
            self.assertEqual(caught.exception.credential_id, self.credential.credential_id)
        self.authenticator.counter = True
        self.authenticator.credentials[0].sign_count = 5
        self.assertEqual(login(self.authenticator, stored).sign_count, 6)

    def test_a_forged_assertion_never_reads_as_a_clone(self) -> None:
        """The counter is judged only after the signature verifies: a forgery with a low count is
        a failed ceremony, not a clone alarm about the real owner's authenticator."""
        stored = [StoredCredential(self.credential.credential_id, self.credential.public_key, 9)]
        start = PASSKEYS.begin_login(rp_id=RP_ID)
        response = self.authenticator.get(start.options_json, origin=ORIGIN)  # count 1
        response["response"]["signature"] = flip(response["response"]["signature"], 20)
        with self.assertRaises(CeremonyFailed):
            self.finish(response, start.challenge, credentials=stored)

    def test_counterless_authenticators_are_never_judged(self) -> None:
        authenticator = SoftwareAuthenticator(counter=False)
        credential = register(authenticator)
        for _ in range(3):
            verified = login(authenticator, [as_stored(credential)])
            self.assertEqual((verified.sign_count, verified.sign_count_changed), (0, False))

    def test_unknown_credential(self) -> None:
        stranger = SoftwareAuthenticator()
        stranger_credential = register(stranger)
        with self.assertRaises(UnknownCredential) as caught:
            login(stranger, self.stored)
        self.assertEqual(caught.exception.credential_id, stranger_credential.credential_id)
        with self.assertRaises(UnknownCredential):  # revoked: no longer in the account's list
            login(self.authenticator, [])

    def test_another_accounts_user_handle(self) -> None:
        with self.assertRaises(CeremonyFailed):
            start = PASSKEYS.begin_login(rp_id=RP_ID)
            response = self.authenticator.get(start.options_json, origin=ORIGIN)
            self.finish(response, start.challenge, uid="u-someone-else")

    def test_user_verification_required_is_enforced_by_the_server(self) -> None:
        self.authenticator.user_verifying = False
        start = PASSKEYS.begin_login(rp_id=RP_ID)
        response = self.authenticator.get(start.options_json, origin=ORIGIN)
        with self.assertRaises(CeremonyFailed):
            self.finish(response, start.challenge, user_verification="required")
        self.assertFalse(self.finish(response, start.challenge).user_verified)

    def test_user_not_present(self) -> None:
        with self.assertRaises(CeremonyFailed):
            login(self.authenticator, self.stored, user_present=False)

    def test_malformed_responses(self) -> None:
        start = PASSKEYS.begin_login(rp_id=RP_ID)
        good = self.authenticator.get(start.options_json, origin=ORIGIN)
        inner = good["response"]
        for bad in (
            "",
            "null",
            "{}",
            {"id": None},
            dict(good, rawId="!!"),
            dict(good, response=dict(inner, userHandle=5)),
            dict(good, response=dict(inner, userHandle="!!")),
            dict(good, response=dict(inner, authenticatorData=b64url(b"short"))),
            dict(good, response=dict(inner, clientDataJSON=b64url(b'{"type": 1}'))),
            dict(good, response=dict(inner, signature="")),
        ):
            with self.assertRaises(CeremonyFailed, msg=str(bad)[:80]):
                self.finish(bad, start.challenge)
            if isinstance(bad, str) or bad.get("rawId") == "!!" or "id" not in bad:
                with self.assertRaises(CeremonyFailed):
                    PASSKEYS.presented_credential_id(bad)

    @given(
        part=st.sampled_from(["clientDataJSON", "authenticatorData", "signature"]),
        index=st.integers(min_value=0, max_value=400),
        bit=st.integers(min_value=0, max_value=7),
    )
    @settings(max_examples=150, deadline=None)
    def test_any_flipped_bit_fails_the_login(self, part: str, index: int, bit: int) -> None:
        """Every bit of an assertion is signed: one flipped anywhere is a failed ceremony (never a
        login, never another exception, never a clone alarm)."""
        start = PASSKEYS.begin_login(rp_id=RP_ID)
        response = self.authenticator.get(start.options_json, origin=ORIGIN)
        response["response"][part] = flip(response["response"][part], index, bit)
        with self.assertRaises(PasskeyError) as caught:
            self.finish(response, start.challenge)
        self.assertIsInstance(caught.exception, CeremonyFailed)


class ErrorTests(SynchronousTestCase):
    def test_every_error_is_a_passkey_error_with_a_reason(self) -> None:
        reasons = {cls.reason for cls in (CeremonyFailed, UnknownCredential, SignCountRegressed)}
        self.assertEqual(len(reasons), 3)
        for cls in (CeremonyFailed, UnknownCredential, SignCountRegressed):
            self.assertTrue(issubclass(cls, PasskeyError))

    def test_uid_must_fit_a_user_handle(self) -> None:
        with self.assertRaises(ValueError):
            PASSKEYS.begin_registration(rp_id=RP_ID, uid="x" * 65, user_name="lchat")
        with self.assertRaises(ValueError):
            PASSKEYS.begin_registration(rp_id=RP_ID, uid="", user_name="lchat")

    def test_unknown_transports_are_dropped_from_options(self) -> None:
        stored = StoredCredential(b"\x01" * 16, b"", 0, transports=("internal", "telepathy"))
        options = json.loads(PASSKEYS.begin_login(rp_id=RP_ID, credentials=[stored]).options_json)
        self.assertEqual(options["allowCredentials"][0]["transports"], ["internal"])
        self.assertEqual(
            base64.urlsafe_b64decode(options["allowCredentials"][0]["id"] + "=="), b"\x01" * 16
        )
