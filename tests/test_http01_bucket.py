"""HTTP-01 answers shared through the bucket, against moto and the real port-80 responder:

- only what a box of this fleet wrote is answered (a MAC under ``LCHAT_CERT_CACHE_KEY``, or the
  previous key during a rotation); what someone who can only write to the bucket plants is a 404,
  logged and counted;
- a flood of random tokens from one address neither crowds out another client's lookup nor costs a
  bucket GET per token (one shared listing of ``certs/challenges/``, paced).
"""

from __future__ import annotations

import json
import secrets
from typing import Any, cast

from prometheus_client import REGISTRY
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import deferLater
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.server import Site

from lchat.acme.cache import SharedCache, seal_challenge
from lchat.acme.http01 import ChallengeResponder
from lchat.redirect import RedirectToHTTPS
from tests.s3servers import shared_server, store_for
from tests.tcpproxy import BucketProxy, request_matcher

KEY = bytes(range(32))
OLD_KEY = bytes(range(100, 132))
PREFIX = "fleet"
HOST = "chat.example.com"


def token() -> str:
    return secrets.token_urlsafe(32)  # 43 characters, as Let's Encrypt and Pebble send


def outcome(name: str) -> float:
    value = REGISTRY.get_sample_value("lchat_acme_challenge_lookups_total", {"outcome": name})
    return value or 0.0


class _FromAddress:
    """An endpoint factory for Agent: connections leave from ``source`` (a loopback address)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def endpointForURI(self, uri: Any) -> TCP4ClientEndpoint:
        return TCP4ClientEndpoint(
            reactor, uri.host.decode(), uri.port, bindAddress=(self.source, 0)
        )


class BucketChallengeTests(TestCase):
    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.s3 = await shared_server("moto")
        self.bucket = await self.s3.new_bucket()
        self.proxy = BucketProxy("127.0.0.1", self.s3.port).start()
        self.addCleanup(self.proxy.close)
        # The responding box reads the bucket through a proxy the test can make hold requests.
        self.store = store_for(self.s3, self.bucket, endpoint=self.proxy.endpoint)
        self.addCleanup(self.store.close)
        self.shared = SharedCache(
            self.store, KEY, monotonic=lambda: 0.0, prefix=PREFIX, previous_key=OLD_KEY
        )
        # Another box of the fleet (the one that ordered), straight to the bucket.
        self.orderer_store = store_for(self.s3, self.bucket)
        self.addCleanup(self.orderer_store.close)
        self.orderer = SharedCache(self.orderer_store, KEY, monotonic=lambda: 0.0, prefix=PREFIX)
        self.responder = ChallengeResponder(
            lookup=self.shared.get_challenge,
            pending=self.shared.challenge_tokens,
            clock=reactor,
            list_interval=0.05,
        )
        site = Site(RedirectToHTTPS(acme_challenge=self.responder.resource()))
        r: Any = reactor
        self.port = r.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.errors: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_level") is LogLevel.error and "log_format" in event:
                self.errors.append(event["log_format"])

        globalLogPublisher.addObserver(cast(Any, observe))
        self.addCleanup(globalLogPublisher.removeObserver, cast(Any, observe))

    async def get(self, challenge: str, source: str = "127.0.0.1") -> tuple[int, bytes]:
        agent = Agent.usingEndpointFactory(reactor, _FromAddress(source))
        url = f"http://127.0.0.1:{self.port.getHost().port}/.well-known/acme-challenge/{challenge}"
        response = await agent.request(b"GET", url.encode(), Headers({b"host": [HOST.encode()]}))
        return response.code, await readBody(response)

    def plant(self, key: str, body: bytes) -> None:
        """What someone with bucket write access and no cache key can do."""
        self.s3.client().put_object(
            Bucket=self.bucket, Key=f"{PREFIX}/certs/challenges/{key}", Body=body
        )

    async def test_an_answer_a_bucket_writer_planted_is_refused(self) -> None:
        before = outcome("unauthenticated")
        plain = token()
        self.plant(plain, f"{plain}.attacker-thumbprint".encode())  # the old, unsealed format
        forged = token()
        self.plant(
            forged,
            json.dumps(
                {
                    "format": "lchat-challenge/1",
                    "key_id": "0" * 16,
                    "key_authorization": f"{forged}.attacker-thumbprint",
                    "mac": "A" * 43 + "=",
                }
            ).encode(),
        )
        other_key = token()  # sealed, but under a key the fleet does not hold
        self.plant(other_key, seal_challenge(other_key, f"{other_key}.attacker", bytes(32 * [7])))
        moved = token()  # a genuine object of the fleet's, copied to another token's name
        self.plant(moved, seal_challenge(plain, f"{plain}.fleet-thumbprint", KEY))
        for planted in (plain, forged, other_key, moved):
            code, body = await self.get(planted)
            self.assertEqual((code, body), (404, b"no such challenge\n"), planted)
        self.assertEqual(outcome("unauthenticated") - before, 4)
        refusals = [e for e in self.errors if "no box of this fleet wrote it" in e]
        self.assertEqual(len(refusals), 4, self.errors)

    async def test_a_fleet_boxs_answer_is_answered(self) -> None:
        before = outcome("answered")
        mine = token()
        await self.orderer.put_challenge(mine, f"{mine}.fleet-thumbprint")
        self.assertEqual(await self.get(mine), (200, f"{mine}.fleet-thumbprint".encode()))
        # A box still on the previous key during a rotation: read with LCHAT_CERT_CACHE_KEY_PREVIOUS.
        rotating = token()
        self.plant(rotating, seal_challenge(rotating, f"{rotating}.fleet-thumbprint", OLD_KEY))
        self.assertEqual(await self.get(rotating), (200, f"{rotating}.fleet-thumbprint".encode()))
        self.assertEqual(outcome("answered") - before, 2)
        # Withdrawn by the orderer: the last listing still names it, the GET finds it gone.
        await self.orderer.delete_challenge(mine)
        missing = outcome("missing")
        self.assertEqual((await self.get(mine))[0], 404)
        self.assertEqual(outcome("missing") - missing, 1)
        # A token no listing ever held: a 404 without a GET.
        unlisted = outcome("unlisted")
        self.assertEqual((await self.get(token()))[0], 404)
        self.assertEqual(outcome("unlisted") - unlisted, 1)

    async def test_a_flood_of_random_tokens_does_not_starve_another_client(self) -> None:
        ours = token()
        await self.orderer.put_challenge(ours, f"{ours}.fleet-thumbprint")
        gets_before = sum(outcome(o) for o in ("answered", "missing", "unauthenticated"))
        # The bucket answers slowly (every read under certs/challenges/ held) while one client
        # sends 40 random, well-formed tokens at once.
        busy_before = outcome("busy_client")
        self.proxy.hold(request_matcher("GET", "challenges"))
        flood = [Deferred.fromCoroutine(self.get(token(), source="127.0.0.1")) for _ in range(40)]
        flooding = DeferredList(flood, consumeErrors=True)
        await self.proxy.until_held(1)
        # Every flood request has reached the responder once all but the 16 the shared lookup
        # could ever hold are answered (a 404 at once for each one over a cap).
        for _ in range(250):
            if sum(d.called for d in flood) >= 40 - 16:
                break
            await _sleep(0.02)
        await _sleep(0.1)
        # The CA, from another address, asks for a token this fleet did publish.
        ca = Deferred.fromCoroutine(self.get(ours, source="127.0.0.2"))
        await _sleep(0.2)
        self.assertFalse(ca.called)  # waiting for the bucket, as the CA would (not refused)
        # That one address had 4 lookups waiting at most: the other 36 were refused at once.
        self.assertEqual(outcome("busy_client") - busy_before, 36)
        self.proxy.pass_through()
        self.proxy.release_held()
        self.assertEqual(await ca, (200, f"{ours}.fleet-thumbprint".encode()))
        results = await flooding
        codes = [r[1][0] for r in results if r[0]]
        self.assertEqual(codes, [404] * 40)
        # The flood cost no GET: only the real token was read.
        gets = sum(outcome(o) for o in ("answered", "missing", "unauthenticated")) - gets_before
        self.assertEqual(gets, 1)
        assert self.responder.index is not None
        self.assertLessEqual(self.responder.index.listings, 4)


async def _sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)
