"""lchat.home.stateless: ceremony proofs and sealed WebAuthn sessions, both keyed from one
LCHAT_HOME_SESSION_KEY. The property that matters most: a token made by one process opens in another
process given the same key (and in no process given another), with nothing remembered in between."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import subprocess
import sys
import textwrap

from prometheus_client import REGISTRY
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from lchat.home.stateless import (
    PROOF_KEY_INFO,
    SEAL_KEY_INFO,
    SESSION_KEY_ENV,
    Ceremonies,
    CeremonyProofs,
    ProofExpired,
    ProofNotAuthentic,
    ProofWrongPurpose,
    SessionExpired,
    SessionKeyError,
    SessionKeys,
    SessionNotAuthentic,
    SessionSealer,
    load_session_keys,
    parse_session_key,
)

SECRET = bytes(range(32))
SECRET_TEXT = base64.b64encode(SECRET).decode()
OTHER_SECRET = bytes(range(100, 132))
CHALLENGE = bytes(range(200, 232))
B64URL_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
T0 = 1_700_000_000.0


def counted(token: str, outcome: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "lchat_home_ceremony_tokens_total", {"token": token, "outcome": outcome}
        )
        or 0.0
    )


def every_one_character_change(token: str) -> list[str]:
    """The token with each character (but a '.') replaced by another base64url character."""
    changed = []
    for i, char in enumerate(token):
        if char == ".":
            continue
        other = B64URL_CHARS[(B64URL_CHARS.index(char) + 1) % len(B64URL_CHARS)]
        changed.append(token[:i] + other + token[i + 1 :])
    return changed


def ceremonies(secret: bytes = SECRET, clock: Clock | None = None) -> tuple[Ceremonies, Clock]:
    clock = clock or Clock()
    if not clock.seconds():
        clock.advance(T0)
    return Ceremonies.from_keys(SessionKeys.derive(secret), clock.seconds), clock


class SessionKeyTests(SynchronousTestCase):
    def test_keys_are_hkdf_sha256_with_distinct_labels(self) -> None:
        """Pinned against RFC 5869 written out here: the labels are part of the wire contract
        between replicas (a changed label fails every ceremony in flight across a deploy)."""

        def rfc5869(secret: bytes, info: bytes) -> bytes:
            prk = hmac.new(bytes(32), secret, hashlib.sha256).digest()  # no salt: HashLen zeroes
            return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()  # 32 bytes: one block

        keys = SessionKeys.derive(SECRET)
        self.assertEqual(keys.proof_key, rfc5869(SECRET, PROOF_KEY_INFO))
        self.assertEqual(keys.seal_key, rfc5869(SECRET, SEAL_KEY_INFO))
        self.assertNotEqual(PROOF_KEY_INFO, SEAL_KEY_INFO)
        self.assertNotEqual(keys.proof_key, keys.seal_key)
        self.assertNotIn(SECRET, (keys.proof_key, keys.seal_key))
        other = SessionKeys.derive(OTHER_SECRET)
        self.assertNotEqual(other.proof_key, keys.proof_key)
        self.assertNotEqual(other.seal_key, keys.seal_key)

    def test_one_key_cannot_do_the_others_job(self) -> None:
        keys = SessionKeys.derive(SECRET)
        clock = Clock()
        clock.advance(T0)
        sealed = SessionSealer(keys.seal_key, clock.seconds).seal(
            "login", uid=None, challenge=CHALLENGE, rp_id="home.example"
        )
        with self.assertRaises(SessionNotAuthentic):
            SessionSealer(keys.proof_key, clock.seconds).open(sealed, "login")
        proof = CeremonyProofs(keys.proof_key, clock.seconds).issue("u1", "link")
        with self.assertRaises(ProofNotAuthentic):
            CeremonyProofs(keys.seal_key, clock.seconds).verify(proof, "link")

    def test_the_keys_never_show_in_a_repr(self) -> None:
        keys = SessionKeys.derive(SECRET)
        clock = Clock()
        for thing in (
            keys,
            CeremonyProofs(keys.proof_key, clock.seconds),
            SessionSealer(keys.seal_key, clock.seconds),
        ):
            for key in (keys.proof_key, keys.seal_key):
                self.assertNotIn(repr(key), repr(thing))
                self.assertNotIn(key.hex(), repr(thing))

    def test_parses_base64_in_either_alphabet_with_or_without_padding(self) -> None:
        secret = bytes([0xFB, 0xFF] * 24)  # 48 bytes: '+' and '/' in standard base64
        standard = base64.b64encode(secret).decode()
        urlsafe = base64.urlsafe_b64encode(secret).decode()
        self.assertIn("+", standard)
        self.assertIn("-", urlsafe)
        for text in (standard, urlsafe, urlsafe.rstrip("="), f"  {standard}\n"):
            self.assertEqual(parse_session_key(text), secret, text)
        odd = os.urandom(32)  # 32 bytes: base64 ends in one '='
        self.assertEqual(parse_session_key(base64.b64encode(odd).decode().rstrip("=")), odd)

    def test_refuses_keys_that_are_not_base64_or_too_short(self) -> None:
        short = base64.b64encode(os.urandom(16)).decode()  # `openssl rand -base64 16`
        with self.assertRaises(SessionKeyError) as caught:
            parse_session_key(short)
        message = str(caught.exception)
        self.assertIn(SESSION_KEY_ENV, message)
        self.assertIn("at least 32 bytes, not 16", message)
        self.assertIn("openssl rand -base64 32", message)
        self.assertNotIn(short, message)  # a secret never reaches a log
        for bad in ("not base64 at all!", "abc$def", "a" * 45, "é" * 44, "+/-_" * 11):
            with self.assertRaises(SessionKeyError, msg=bad) as caught:
                parse_session_key(bad)
            self.assertNotIn(bad, str(caught.exception))
        with self.assertRaises(SessionKeyError):
            SessionKeys.derive(bytes(31))

    def test_unset_means_an_ephemeral_key_and_a_warning(self) -> None:
        for unset in (None, "", "  \n"):
            keys, warning = load_session_keys(unset)
            self.assertTrue(keys.ephemeral)
            assert warning is not None
            self.assertIn(SESSION_KEY_ENV, warning)
            self.assertIn("restart", warning)
            self.assertIn("replica", warning)
        first, _ = load_session_keys(None)
        second, _ = load_session_keys(None)
        self.assertNotEqual(first.seal_key, second.seal_key)  # random: one process's own
        self.assertEqual(
            load_session_keys(None, random_bytes=lambda n: SECRET[:n])[0].seal_key,
            SessionKeys.derive(SECRET).seal_key,
        )

    def test_set_means_the_derived_keys_and_no_warning(self) -> None:
        keys, warning = load_session_keys(SECRET_TEXT)
        self.assertIsNone(warning)
        self.assertFalse(keys.ephemeral)
        self.assertEqual(keys, SessionKeys.derive(SECRET))
        with self.assertRaises(SessionKeyError):
            load_session_keys("tooshort")


class ProofTests(SynchronousTestCase):
    def test_a_proof_verifies_until_exactly_300_seconds(self) -> None:
        c, clock = ceremonies()
        token = c.proofs.issue("u-1", "link")
        proof = c.proofs.verify(token, "link")
        self.assertEqual((proof.uid, proof.purpose, proof.expires_at), ("u-1", "link", T0 + 300))
        clock.advance(299.999)
        self.assertEqual(c.proofs.verify(token, "link").uid, "u-1")
        clock.advance(0.001)  # exactly issue time + 300 s
        with self.assertRaises(ProofExpired):
            c.proofs.verify(token, "link")

    def test_any_changed_character_is_rejected(self) -> None:
        c, _ = ceremonies()
        token = c.proofs.issue("u-1", "link")
        for changed in every_one_character_change(token):
            with self.assertRaises(ProofNotAuthentic, msg=changed):
                c.proofs.verify(changed, "link")

    def test_a_rewritten_payload_is_rejected(self) -> None:
        """The payload is readable, not writable: naming another uid, another purpose or a later
        expiry under the original signature fails."""
        c, _ = ceremonies()
        segment, tag = c.proofs.issue("u-1", "link").split(".")
        payload = json.loads(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
        for change in ({"u": "u-2"}, {"p": "delete"}, {"e": payload["e"] + 3600}):
            forged = dict(payload, **change)
            forged_segment = (
                base64.urlsafe_b64encode(json.dumps(forged, separators=(",", ":")).encode())
                .rstrip(b"=")
                .decode()
            )
            with self.assertRaises(ProofNotAuthentic, msg=str(change)):
                c.proofs.verify(f"{forged_segment}.{tag}", "link")

    def test_a_proof_from_another_key_is_rejected(self) -> None:
        c, clock = ceremonies()
        other, _ = ceremonies(OTHER_SECRET, clock)
        with self.assertRaises(ProofNotAuthentic):
            c.proofs.verify(other.proofs.issue("u-1", "link"), "link")

    def test_a_proof_for_another_purpose_is_rejected(self) -> None:
        c, _ = ceremonies()
        token = c.proofs.issue("u-1", "link")
        with self.assertRaises(ProofWrongPurpose) as caught:
            c.proofs.verify(token, "revoke-device")
        self.assertIn("'link'", str(caught.exception))

    def test_garbage_is_rejected(self) -> None:
        c, _ = ceremonies()
        token = c.proofs.issue("u-1", "link")
        segment, tag = token.split(".")
        for garbage in (
            "",
            ".",
            "a.b",
            "a.b.c",
            token + ".",
            f"{segment}.",
            f".{tag}",
            f"{segment}.{tag}=",
            f"{segment}={tag}",
            f"{segment}.{tag[:-1]}",
            "é." + tag,
            "A" * 100_000 + "." + tag,
        ):
            with self.assertRaises(ProofNotAuthentic, msg=garbage[:80]):
                c.proofs.verify(garbage, "link")
        with self.assertRaises(ProofNotAuthentic):
            c.proofs.verify(None, "link")  # type: ignore[arg-type]

    def test_issue_needs_a_uid_and_a_purpose(self) -> None:
        c, _ = ceremonies()
        with self.assertRaises(ValueError):
            c.proofs.issue("", "link")
        with self.assertRaises(ValueError):
            c.proofs.issue("u-1", "")

    def test_outcomes_are_counted(self) -> None:
        c, clock = ceremonies()
        before = {o: counted("proof", o) for o in ("accepted", "not_authentic", "expired")}
        token = c.proofs.issue("u-1", "link")
        c.proofs.verify(token, "link")
        self.assertRaises(ProofNotAuthentic, c.proofs.verify, token[:-1], "link")
        clock.advance(300)
        self.assertRaises(ProofExpired, c.proofs.verify, token, "link")
        for outcome, value in before.items():
            self.assertEqual(counted("proof", outcome), value + 1, outcome)


class SessionTests(SynchronousTestCase):
    def test_round_trip(self) -> None:
        c, _ = ceremonies()
        for uid in ("u-1", None):
            token = c.sessions.seal(
                "register",
                uid=uid,
                challenge=CHALLENGE,
                rp_id="home.example",
                user_verification="required",
            )
            self.assertRegex(token, r"^[A-Za-z0-9_-]+$")  # safe in a query string as it is
            session = c.sessions.open(token, "register")
            self.assertEqual(session.purpose, "register")
            self.assertEqual(session.uid, uid)
            self.assertEqual(session.challenge, CHALLENGE)
            self.assertEqual(session.rp_id, "home.example")
            self.assertEqual(session.user_verification, "required")
            self.assertEqual(session.expires_at, T0 + 300)

    def test_the_challenge_is_sealed_not_just_signed(self) -> None:
        c, _ = ceremonies()
        one = c.sessions.seal("login", uid="u-1", challenge=CHALLENGE, rp_id="home.example")
        two = c.sessions.seal("login", uid="u-1", challenge=CHALLENGE, rp_id="home.example")
        self.assertNotEqual(one, two)  # a fresh nonce each time
        blob = base64.urlsafe_b64decode(one + "=" * (-len(one) % 4))
        self.assertNotIn(CHALLENGE, blob)
        self.assertNotIn(base64.urlsafe_b64encode(CHALLENGE).rstrip(b"="), blob)
        self.assertNotIn(b"home.example", blob)

    def test_any_changed_character_is_rejected(self) -> None:
        c, _ = ceremonies()
        token = c.sessions.seal("login", uid="u-1", challenge=CHALLENGE, rp_id="home.example")
        for changed in every_one_character_change(token):
            with self.assertRaises(SessionNotAuthentic, msg=changed):
                c.sessions.open(changed, "login")

    def test_a_truncated_or_extended_session_is_rejected(self) -> None:
        c, _ = ceremonies()
        token = c.sessions.seal("login", uid="u-1", challenge=CHALLENGE, rp_id="home.example")
        for cut in (1, 2, 3, 4, 16, len(token) // 2, len(token) - 1):
            with self.assertRaises(SessionNotAuthentic, msg=str(cut)):
                c.sessions.open(token[:-cut], "login")
        for extended in (token + "A", token + "AA", token + "AAAA", token + "="):
            with self.assertRaises(SessionNotAuthentic, msg=extended):
                c.sessions.open(extended, "login")

    def test_a_session_opens_only_for_its_purpose(self) -> None:
        c, _ = ceremonies()
        for purpose in ("register", "login", "link"):
            token = c.sessions.seal(purpose, uid="u-1", challenge=CHALLENGE, rp_id="home.example")
            for other in {"register", "login", "link"} - {purpose}:
                with self.assertRaises(SessionNotAuthentic, msg=f"{purpose} as {other}"):
                    c.sessions.open(token, other)  # type: ignore[arg-type]
            self.assertEqual(c.sessions.open(token, purpose).purpose, purpose)
        with self.assertRaises(ValueError):
            c.sessions.open(token, "delete")  # type: ignore[arg-type]
        with self.assertRaises(ValueError):
            c.sessions.seal("delete", uid=None, challenge=CHALLENGE, rp_id="x")  # type: ignore[arg-type]

    def test_a_session_expires_at_exactly_its_window(self) -> None:
        c, clock = ceremonies()
        token = c.sessions.seal("login", uid=None, challenge=CHALLENGE, rp_id="home.example")
        clock.advance(299.999)
        self.assertEqual(c.sessions.open(token, "login").challenge, CHALLENGE)
        clock.advance(0.001)
        with self.assertRaises(SessionExpired):
            c.sessions.open(token, "login")

    def test_garbage_is_rejected(self) -> None:
        c, _ = ceremonies()
        for garbage in (
            "",
            "A",
            "!!!!",
            "====",
            "abc=",
            "a b",
            "é" * 80,
            "+/" * 60,
            base64.urlsafe_b64encode(os.urandom(80)).decode().rstrip("="),
            "A" * 100_000,
        ):
            with self.assertRaises(SessionNotAuthentic, msg=garbage[:80]):
                c.sessions.open(garbage, "login")
        with self.assertRaises(SessionNotAuthentic):
            c.sessions.open(None, "login")  # type: ignore[arg-type]

    def test_a_session_from_another_key_is_rejected(self) -> None:
        c, clock = ceremonies()
        other, _ = ceremonies(OTHER_SECRET, clock)
        token = other.sessions.seal("login", uid=None, challenge=CHALLENGE, rp_id="home.example")
        with self.assertRaises(SessionNotAuthentic) as caught:
            c.sessions.open(token, "login")
        self.assertIn(SESSION_KEY_ENV, str(caught.exception))  # what an operator checks first

    def test_outcomes_are_counted(self) -> None:
        c, clock = ceremonies()
        before = {o: counted("session", o) for o in ("accepted", "not_authentic", "expired")}
        token = c.sessions.seal("login", uid=None, challenge=CHALLENGE, rp_id="home.example")
        c.sessions.open(token, "login")
        self.assertRaises(SessionNotAuthentic, c.sessions.open, token, "register")
        clock.advance(300)
        self.assertRaises(SessionExpired, c.sessions.open, token, "login")
        for outcome, value in before.items():
            self.assertEqual(counted("session", outcome), value + 1, outcome)


# Run in a separate Python process: it shares nothing with the test but LCHAT_HOME_SESSION_KEY.
_OTHER_PROCESS = textwrap.dedent(
    """
    import json, os, sys
    from lchat.home.stateless import Ceremonies, load_session_keys

    keys, warning = load_session_keys(os.environ.get("LCHAT_HOME_SESSION_KEY"))
    assert warning is None, warning
    now = float(sys.argv[1])
    ceremonies = Ceremonies.from_keys(keys, lambda: now)
    session = ceremonies.sessions.seal(
        "register", uid="u-42", challenge=bytes.fromhex(sys.argv[2]), rp_id="home.example"
    )
    print(json.dumps({"session": session, "proof": ceremonies.proofs.issue("u-42", "link")}))
    """
)


class StatelessnessTests(SynchronousTestCase):
    """A ceremony begun in one process finishes in another: the tokens are all there is."""

    def begin_in_another_process(self, key_text: str) -> dict[str, str]:
        env = dict(os.environ, **{SESSION_KEY_ENV: key_text})
        done = subprocess.run(
            [sys.executable, "-c", _OTHER_PROCESS, repr(T0), CHALLENGE.hex()],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        result: dict[str, str] = json.loads(done.stdout)
        return result

    def test_tokens_from_another_process_with_the_same_key_open(self) -> None:
        tokens = self.begin_in_another_process(SECRET_TEXT)
        keys, _ = load_session_keys(SECRET_TEXT)
        clock = Clock()
        clock.advance(T0 + 10)
        here = Ceremonies.from_keys(keys, clock.seconds)
        session = here.sessions.open(tokens["session"], "register")
        self.assertEqual((session.uid, session.challenge), ("u-42", CHALLENGE))
        self.assertEqual(here.proofs.verify(tokens["proof"], "link").uid, "u-42")

    def test_tokens_from_another_process_with_another_key_do_not(self) -> None:
        tokens = self.begin_in_another_process(base64.b64encode(OTHER_SECRET).decode())
        keys, _ = load_session_keys(SECRET_TEXT)
        clock = Clock()
        clock.advance(T0 + 10)
        here = Ceremonies.from_keys(keys, clock.seconds)
        with self.assertRaises(SessionNotAuthentic):
            here.sessions.open(tokens["session"], "register")
        with self.assertRaises(ProofNotAuthentic):
            here.proofs.verify(tokens["proof"], "link")
