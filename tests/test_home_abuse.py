"""Home on the open internet (issue 29, items 5-9): abuse against real ``twistd lchat-home``
processes, on SQLite and on moto's S3, with the software authenticator in the browser's place.

- a registration flood from one address is answered ``429`` with ``Retry-After`` (another
  address still registers); an address that keeps failing authentication is slowed, its
  victim's account is not (a valid token from another address works);
- quotas: the vault's size, vault writes per account (``429``), devices per account;
- every challenge and proof is single-use: a login replayed by a synced passkey (sign count 0
  forever) is refused, on the same replica and (S3) on another one; a proof mints one token;
- a link token alone cannot delete a passkey or revoke another device (``403``, step-up
  required); with a step-up (a fresh assertion for that one change) it can, once; the last
  passkey is never deleted; deleting a passkey revokes the devices it linked.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.threads import deferToThread

from tests import s3servers
from tests.authenticator import SoftwareAuthenticator
from tests.test_home import ORIGIN, Home, HomeTestCase

LIMITS = {
    "LCHAT_HOME_LIMIT_REGISTER_IP": "3/3600",
    "LCHAT_HOME_LIMIT_FAILURES_IP": "10/600",
    "LCHAT_HOME_LIMIT_VAULT_WRITES": "3/3600",
    "LCHAT_HOME_VAULT_MAX": "2048",
    "LCHAT_HOME_MAX_DEVICES": "3",
}
PUT = {"Content-Type": "application/octet-stream", "If-None-Match": "*"}


def at(address: str) -> dict[str, str]:
    """The header the router sets for a client at ``address`` (its last entry is believed)."""
    return {"X-Forwarded-For": f"192.0.2.1, {address}"}


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class AbuseScenarios(HomeTestCase):
    """The scenarios; the subclasses run them on a store."""

    def call(self, home: Home, *args: Any, **kwargs: Any) -> Any:
        return deferToThread(home.call, *args, **kwargs)

    @inlineCallbacks
    def flood_and_failures(self, home: Home) -> Any:
        # Registration flood from one address: 3 begin, the 4th is refused with Retry-After.
        for _ in range(3):
            status, body, _ = yield self.call(
                home, "POST", "/api/register/begin", {}, headers=at("203.0.113.9")
            )
            self.assertEqual(status, 200, body)
        status, body, hdrs = yield self.call(
            home, "POST", "/api/register/begin", {}, headers=at("203.0.113.9")
        )
        self.assertEqual((status, body.get("limit")), (429, "register_ip"), body)
        self.assertGreater(int(hdrs["retry-after"]), 60)
        # Earlier X-Forwarded-For entries are the client's own: changing them changes nothing.
        status, body, _ = yield self.call(
            home,
            "POST",
            "/api/register/begin",
            {},
            headers={"X-Forwarded-For": "10.9.9.9, 203.0.113.9"},
        )
        self.assertEqual(status, 429, body)
        # Another address registers (and an IPv6 one is limited by its /64).
        status, body, _ = yield self.call(
            home, "POST", "/api/register/begin", {}, headers=at("2001:db8::1")
        )
        self.assertEqual(status, 200, body)

        # Failures: an address failing 10 times is refused, even with a valid token; the
        # account is not locked (its owner's address still works).
        account = yield deferToThread(self.register_at, home, "198.51.100.50")
        token = yield deferToThread(self.token_at, home, account["proof"], "198.51.100.50")
        for _ in range(10):
            status, body, _ = yield self.call(
                home, "GET", "/api/vault", token="forged", headers=at("198.51.100.66")
            )
            self.assertEqual(status, 401, body)
        status, body, hdrs = yield self.call(
            home, "GET", "/api/vault", token=token["token"], headers=at("198.51.100.66")
        )
        self.assertEqual((status, body.get("limit")), (429, "failures_ip"), body)
        self.assertIn("retry-after", hdrs)
        status, body, _ = yield self.call(
            home, "GET", "/api/vault", token=token["token"], headers=at("198.51.100.50")
        )
        self.assertEqual(status, 404, body)  # (no vault yet)
        metrics = yield deferToThread(home.metrics)
        self.assertEqual(metrics[("lchat_home_limited_total", (("limit", "register_ip"),))], 2)

    def register_at(self, home: Home, address: str) -> dict[str, Any]:
        status, started, _ = home.call("POST", "/api/register/begin", {}, headers=at(address))
        assert status == 200, started
        created = self.authenticator.create(started["options"], origin=ORIGIN)
        status, done, _ = home.call(
            "POST",
            f"/api/register/finish?session={started['session']}",
            {"credential": created},
            headers=at(address),
        )
        assert status == 200, done
        return dict(done)

    def token_at(self, home: Home, proof: str, address: str = "192.0.2.77") -> dict[str, Any]:
        status, minted, _ = home.call("POST", "/api/tokens", {"proof": proof}, headers=at(address))
        assert status == 200, minted
        return dict(minted)

    @inlineCallbacks
    def quotas(self, home: Home) -> Any:
        account = yield deferToThread(self.register_at, home, "192.0.2.10")
        token = (yield deferToThread(self.token_at, home, account["proof"]))["token"]
        status, body, _ = yield self.call(
            home, "PUT", "/api/vault", token=token, headers=PUT, raw=b"x" * 2049
        )
        self.assertEqual((status, body.get("quota")), (413, "vault_size"), body)
        version = "0"
        for i in range(3):
            headers = {"Content-Type": "application/octet-stream", "If-Match": f'"{version}"'}
            status, body, _ = yield self.call(
                home, "PUT", "/api/vault", token=token, headers=headers, raw=b"v%d" % i
            )
            self.assertEqual(status, 200, body)
            version = body["version"]
        headers = {"Content-Type": "application/octet-stream", "If-Match": f'"{version}"'}
        status, body, hdrs = yield self.call(
            home, "PUT", "/api/vault", token=token, headers=headers, raw=b"v4"
        )
        self.assertEqual((status, body.get("limit")), (429, "vault_writes"), body)
        self.assertGreater(int(hdrs["retry-after"]), 60)
        status, data, _ = yield self.call(home, "GET", "/api/vault", token=token)
        self.assertEqual((status, data), (200, b"v2"))
        # Devices: 3 at most (one linked above, two more, then 409).
        for _ in range(2):
            status, logged = yield deferToThread(self.login, home)
            self.assertEqual(status, 200, logged)
            yield deferToThread(self.token_at, home, logged["proof"])
        status, logged = yield deferToThread(self.login, home)
        status, body, _ = yield self.call(home, "POST", "/api/tokens", {"proof": logged["proof"]})
        self.assertEqual((status, body.get("quota")), (409, "devices"), body)

    def assertion(self, home: Home) -> tuple[str, dict[str, Any]]:
        status, started, _ = home.call("POST", "/api/login/begin", {})
        assert status == 200, started
        return started["session"], self.authenticator.get(started["options"], origin=ORIGIN)

    @inlineCallbacks
    def replays(self, a: Home, b: Home) -> Any:
        """A synced passkey (sign count 0 forever): the same assertion is accepted once, on
        either replica; a proof mints one token."""
        self.authenticator = SoftwareAuthenticator(counter=False)
        account = yield deferToThread(self.register_at, a, "192.0.2.20")
        session, asserted = yield deferToThread(self.assertion, a)
        path = f"/api/login/finish?session={session}"
        status, body, _ = yield self.call(a, "POST", path, {"credential": asserted})
        self.assertEqual((status, body.get("uid")), (200, account["uid"]), body)
        for home in (a, b):
            status, replay, _ = yield self.call(home, "POST", path, {"credential": asserted})
            self.assertEqual((status, replay.get("reason")), (401, "replayed"), replay)
        yield deferToThread(self.token_at, b, body["proof"])
        status, again, _ = yield self.call(a, "POST", "/api/tokens", {"proof": body["proof"]})
        self.assertEqual((status, again.get("reason")), (401, "replayed"), again)
        metrics = yield deferToThread(a.metrics)
        self.assertGreaterEqual(
            metrics[("lchat_home_single_use_refusals_total", (("kind", "login"),))], 1
        )

    @inlineCallbacks
    def stolen_token(self, home: Home, add_passkey: Any) -> Any:
        """A link token alone cannot delete a passkey or revoke another device."""
        self.authenticator = SoftwareAuthenticator()
        account = yield deferToThread(self.register_at, home, "192.0.2.30")
        owner = yield deferToThread(self.token_at, home, account["proof"])
        status, logged = yield deferToThread(self.login, home)
        thief = yield deferToThread(self.token_at, home, logged["proof"])
        status, body, _ = yield self.call(home, "GET", "/api/devices", token=thief["token"])
        (credential,) = [c["id"] for c in body["credentials"]]
        for path in (f"/api/credentials/{credential}", f"/api/devices/{owner['device']}"):
            status, body, _ = yield self.call(home, "DELETE", path, token=thief["token"])
            self.assertEqual(status, 403, body)  # (204 before issue 29)
            self.assertEqual(body["step_up"], "required", body)
        # A step-up granted for one change does not do another.
        other = yield deferToThread(
            self.step_up, home, thief["token"], f"DELETE /api/devices/{owner['device']}x"
        )
        status, body, _ = yield self.call(
            home,
            "DELETE",
            f"/api/devices/{owner['device']}",
            token=thief["token"],
            headers={"Step-Up": other},
        )
        self.assertEqual(status, 403, body)
        # The owner's device still works; the thief's own sign-out needs no step-up.
        status, body, _ = yield self.call(home, "GET", "/api/devices", token=owner["token"])
        self.assertEqual(len(body["devices"]), 2, body)
        # With a step-up (the passkey asserted for this change), once.
        action = f"DELETE /api/devices/{thief['device']}"
        proof = yield deferToThread(self.step_up, home, owner["token"], action)
        status, body, _ = yield self.call(
            home,
            "DELETE",
            f"/api/devices/{thief['device']}",
            token=owner["token"],
            headers={"Step-Up": proof},
        )
        self.assertEqual(status, 204, body)
        status, body, _ = yield self.call(home, "GET", "/api/devices", token=thief["token"])
        self.assertEqual(status, 401, body)
        # The last passkey: never, even with a step-up.
        action = f"DELETE /api/credentials/{credential}"
        proof = yield deferToThread(self.step_up, home, owner["token"], action)
        status, body, _ = yield self.call(
            home,
            "DELETE",
            f"/api/credentials/{credential}",
            token=owner["token"],
            headers={"Step-Up": proof},
        )
        self.assertEqual((status, body.get("quota")), (409, "last_passkey"), body)
        # A second passkey, and a device it links: deleting that passkey revokes the device.
        second = SoftwareAuthenticator()
        created = second.create(
            {
                "rp": {"id": "home.example.test"},
                "user": {"id": b64url(account["uid"].encode())},
                "challenge": b64url(os.urandom(32)),
            },
            origin=ORIGIN,
        )
        yield add_passkey(account["uid"], created)
        first = self.authenticator
        self.authenticator = second
        status, logged = yield deferToThread(self.login, home)
        self.assertEqual(status, 200, logged)
        linked = yield deferToThread(self.token_at, home, logged["proof"])
        self.authenticator = first
        action = f"DELETE /api/credentials/{created['id']}"
        proof = yield deferToThread(self.step_up, home, owner["token"], action)
        status, body, _ = yield self.call(
            home,
            "DELETE",
            f"/api/credentials/{created['id']}",
            token=owner["token"],
            headers={"Step-Up": proof},
        )
        self.assertEqual(status, 204, body)
        status, body, _ = yield self.call(home, "GET", "/api/vault", token=linked["token"])
        self.assertEqual(status, 401, body)
        self.authenticator = second  # the deleted passkey no longer logs in
        status, body = yield deferToThread(self.login, home)
        self.assertEqual(status, 401, body)
        self.authenticator = first
        status, body, _ = yield self.call(home, "GET", "/api/devices", token=owner["token"])
        self.assertEqual([d["id"] for d in body["devices"]], [owner["device"]], body)


def credential_entry(created: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The user document's entry for a passkey the software authenticator created (its COSE
    key read out of the attestation's authData), and its key."""
    from webauthn.helpers import parse_registration_credential_json
    from webauthn.helpers.parse_attestation_object import parse_attestation_object

    parsed = parse_registration_credential_json(json.dumps(created))
    attested = parse_attestation_object(parsed.response.attestation_object).auth_data
    assert attested.attested_credential_data is not None
    public_key = attested.attested_credential_data.credential_public_key
    key = hashlib.sha256(parsed.raw_id).hexdigest()
    return key, {
        "id": created["id"],
        "public_key": b64url(public_key),
        "sign_count": 0,
        "transports": ["internal"],
        "created": "2026-12-05",
    }


def adder(store: Any) -> Any:
    """add_passkey(uid, created) on ``store``: the pointer, then the user document."""

    async def add(uid: str, created: dict[str, Any]) -> None:
        key, entry = credential_entry(created)
        await store.put_pointer("creds", key, uid)

        def put(doc: dict[str, Any] | None) -> dict[str, Any] | None:
            assert doc is not None
            doc["credentials"][key] = entry
            return doc

        await store.update_user(uid, put)

    return lambda uid, created: Deferred.fromCoroutine(add(uid, created))


class AbuseTests(AbuseScenarios):
    """Each promise on its own process(es): ``homes`` and ``own_store`` say on which store."""

    def homes(self, n: int) -> Deferred[list[Home]]:
        raise NotImplementedError

    def own_store(self, home: Home) -> Deferred[Any]:
        """The test's own store on the processes' (for a second passkey)."""
        raise NotImplementedError

    @inlineCallbacks
    def test_a_registration_flood_and_failing_address_get_429(self) -> Any:
        (home,) = yield self.homes(1)
        yield self.flood_and_failures(home)

    @inlineCallbacks
    def test_vault_and_device_quotas(self) -> Any:
        (home,) = yield self.homes(1)
        yield self.quotas(home)

    @inlineCallbacks
    def test_a_replayed_assertion_or_proof_is_refused(self) -> Any:
        a, b = yield self.homes(2)
        yield self.replays(a, b)

    @inlineCallbacks
    def test_a_link_token_alone_cannot_act_destructively(self) -> Any:
        (home,) = yield self.homes(1)
        store = yield self.own_store(home)
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        yield self.stolen_token(home, adder(store))


class SQLiteAbuseTests(AbuseTests):
    """On SQLite: two "replicas" are the one process (a second one would have its own file)."""

    @inlineCallbacks
    def homes(self, n: int) -> Any:
        home = yield self.home(**LIMITS)
        return [home] * n

    def own_store(self, home: Home) -> Deferred[Any]:
        from lchat.home.sqlite_store import SQLiteVaultStore
        from lchat.reactors import installed
        from lchat.threads import thread_runner

        reactor = installed()

        # The process's own file (WAL: both may write), through the real store code.
        path = os.path.join(home.settings["LCHAT_DATA_DIR"], "home.db")
        return Deferred.fromCoroutine(SQLiteVaultStore.open(path, thread_runner(reactor), reactor))


class S3AbuseTests(AbuseTests):
    """On one moto bucket; the replay is tried on a second process too."""

    timeout = 180

    @inlineCallbacks
    def homes(self, n: int) -> Any:
        server = yield Deferred.fromCoroutine(s3servers.shared_server("moto"))
        bucket = yield Deferred.fromCoroutine(server.new_bucket())
        yield deferToThread(
            server.client().put_bucket_versioning,
            Bucket=bucket,
            VersioningConfiguration={"Status": "Enabled"},
        )
        self.bucket = (server, bucket)
        settings = {
            **LIMITS,
            "LCHAT_HOME_STORE": "s3",
            "LCHAT_HOME_S3_BUCKET": bucket,
            "LCHAT_HOME_S3_REGION": server.region,
            "LCHAT_HOME_S3_ENDPOINT": server.endpoint,
            "AWS_ACCESS_KEY_ID": server.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": server.credentials.secret_key,
        }
        homes = []
        for i in range(n):
            homes.append((yield self.home(f"h{i}", **settings)))
        return homes

    def own_store(self, home: Home) -> Deferred[Any]:
        from twisted.internet import reactor

        from lchat.home.s3_store import S3VaultStore

        server, bucket = self.bucket
        return succeed(S3VaultStore(s3servers.store_for(server, bucket), reactor))


del AbuseTests  # run by its subclasses only (trial collects every TestCase in the module)
