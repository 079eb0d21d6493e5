"""Rotating the fleet's shared secrets without refusals (docs/secrets.md).

The mesh token: a box sends ``LCHAT_MESH_TOKEN`` and accepts it or ``LCHAT_MESH_TOKEN_ACCEPT``, on
the route-replication API (real HTTP servers, real client) and in forwarded markers (the mesh
router). The documented three rolling steps keep every pair of boxes talking at every moment.

The certificate cache key: entries sealed under ``LCHAT_CERT_CACHE_KEY_PREVIOUS`` are read and
re-sealed under ``LCHAT_CERT_CACHE_KEY`` (If-Match: a newer upload is never overwritten), on a real
S3 server (moto); a box with neither key reads nothing, writes nothing and crashes on nothing.
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
import time
from typing import Any

from attrs import evolve
from prometheus_client import REGISTRY
from twisted.internet import reactor as _reactor
from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import certfiles, config
from lchat.acme import cache
from lchat.acme.cache import (
    CacheEntryError,
    CacheSync,
    Certificate,
    CertName,
    LocalCache,
    SharedCache,
)
from lchat.cli import certs as certs_cli
from lchat.config import ConfigError
from lchat.home import config as home_config
from lchat.home.stateless import (
    Ceremonies,
    ProofExpired,
    ProofNotAuthentic,
    ProofWrongPurpose,
    SessionExpired,
    SessionKeyError,
    SessionKeys,
    SessionNotAuthentic,
    load_session_keys,
)
from lchat.mesh import client, forward
from lchat.threads import thread_runner
from tests.s3servers import shared_server, store_for
from tests.test_acme_parts import certificate
from tests.test_mesh_api import Box, Served, payload
from tests.test_mesh_routing import (
    BOUND,
    SELF,
    SERVED_HERE,
    TOKEN,
    B,
    _Base,
    forwards,
    host_owned_by,
)

reactor: Any = _reactor

OLD = "old-mesh-token-" + "o" * 24
NEW = "new-mesh-token-" + "n" * 24

OLD_KEY = bytes(range(32))
NEW_KEY = bytes(range(100, 132))
OTHER_KEY = b"\x07" * 32


def sample(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


def accept_uses(use: str) -> float:
    return sample("lchat_mesh_accept_token_total", use=use)


def previous_reads(outcome: str) -> float:
    return sample("lchat_cert_cache_previous_key_total", outcome=outcome)


# --- mesh token: configuration ------------------------------------------------------------------


class MeshTokenConfigTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)

    def load(self, **env: str) -> config.BoxConfig:
        base = {
            "LCHAT_DATA_DIR": self.dir,
            "LCHAT_RUN_DIR": self.dir,
            "LCHAT_UNITS": "builtin",
            "LCHAT_HIBERNATE_BUCKET": f"file:{self.dir}/bucket",
            "LCHAT_MESH_SELF": "https://box-1.example.net",
            "LCHAT_MESH_DOMAINS": "chat.example.com",
            "LCHAT_MESH_TOKEN": NEW,
        }
        return config.load(env_file=None, environ={**base, **env}, systemd_present=False)

    def test_the_accepted_token_is_read_and_never_shown(self) -> None:
        cfg = self.load(LCHAT_MESH_TOKEN_ACCEPT=f"  {OLD} ")
        assert cfg.mesh is not None
        self.assertEqual((cfg.mesh.token, cfg.mesh.accept_token), (NEW, OLD))
        self.assertNotIn(OLD, repr(cfg))
        self.assertEqual(cfg.warnings, ())

    def test_unset_accepts_nothing_more(self) -> None:
        cfg = self.load()
        assert cfg.mesh is not None
        self.assertEqual(cfg.mesh.accept_token, "")

    def test_equal_to_the_token_is_dropped_with_a_warning(self) -> None:
        cfg = self.load(LCHAT_MESH_TOKEN_ACCEPT=NEW)
        assert cfg.mesh is not None
        self.assertEqual(cfg.mesh.accept_token, "")
        (warning,) = cfg.warnings
        self.assertIn("LCHAT_MESH_TOKEN_ACCEPT equals LCHAT_MESH_TOKEN", warning)
        self.assertNotIn(NEW, warning)

    def test_without_a_token_the_accepted_one_does_not_stand_in(self) -> None:
        with self.assertRaisesRegex(ConfigError, "LCHAT_MESH_TOKEN is empty"):
            self.load(LCHAT_MESH_TOKEN="", LCHAT_MESH_TOKEN_ACCEPT=OLD)


# --- mesh token: the route-replication API ------------------------------------------------------


class MeshAPIRotationTests(TestCase):
    """A real mesh API on 127.0.0.1, called by the real client."""

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="sr", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)

    def served(self, name: str, token: str, accept: str = "") -> Served:
        box = Box(self.root, name, LCHAT_MESH_TOKEN=token, LCHAT_MESH_TOKEN_ACCEPT=accept)
        return Served(self, box)

    async def status_of(self, url: str, token: str) -> int:
        """200 when ``token`` is accepted by the box at ``url`` (listing its routes), else the
        refusal's status."""
        try:
            await client.list_routes(url, token, reactor=reactor)
        except client.MeshCallError as e:
            return e.status or 0
        return 200

    async def test_the_old_token_is_accepted_while_set_and_refused_once_dropped(self) -> None:
        served = self.served("box-1", NEW, accept=OLD)
        before = accept_uses("api")
        answer = await client.push_route(served.url, OLD, payload(), reactor=reactor)
        self.assertEqual(answer["result"], "created")
        self.assertEqual(accept_uses("api"), before + 1)
        self.assertEqual(await self.status_of(served.url, NEW), 200)
        self.assertEqual(accept_uses("api"), before + 1)  # the current token is not counted
        self.assertEqual(await self.status_of(served.url, "a-third-token-" + "x" * 20), 401)

        # Step 3 of the rotation: the line is removed and the router restarted.
        await served.port.stopListening()
        served.box.write_env(LCHAT_MESH_TOKEN_ACCEPT="")
        restarted = Served(self, served.box)
        files = served.box.files()
        with self.assertRaises(client.MeshCallError) as refused:
            await client.push_route(restarted.url, OLD, payload(version="9.9.9"), reactor=reactor)
        self.assertEqual(refused.exception.status, 401)
        self.assertEqual(served.box.files(), files)  # nothing written
        route = served.box.registry.get(payload()["host"])
        assert route is not None
        self.assertEqual(route.version, "1.2.3")
        self.assertEqual(accept_uses("api"), before + 1)
        self.assertEqual(await self.status_of(restarted.url, NEW), 200)

    async def test_the_three_rolling_steps_never_refuse_a_peer(self) -> None:
        """Each box changes alone (a rolling restart); after every single change, every box
        accepts what every other sends — on the API and in forwarded markers."""
        names = ("box-1", "box-2", "box-3")
        settings = {name: (OLD, "") for name in names}
        served = {name: self.served(name, OLD) for name in names}
        steps = (
            lambda token, accept: (token, NEW),  # 1. accept the new token too
            lambda token, accept: (NEW, OLD),  # 2. send the new one, still accept the old
            lambda token, accept: (token, ""),  # 3. accept only the new one
        )
        host = payload()["host"]
        for step, change in enumerate(steps, 1):
            for name in names:
                await served[name].port.stopListening()
                settings[name] = change(*settings[name])
                token, accept = settings[name]
                served[name].box.write_env(LCHAT_MESH_TOKEN=token, LCHAT_MESH_TOKEN_ACCEPT=accept)
                served[name] = Served(self, served[name].box)
                for sender in names:
                    sent = served[sender].box.cfg().mesh
                    assert sent is not None
                    for receiver in names:
                        if receiver == sender:
                            continue
                        state = f"step {step}, {name} done: {sender} -> {receiver} {settings}"
                        got = served[receiver].box.cfg().mesh
                        assert got is not None
                        status = await self.status_of(served[receiver].url, sent.token)
                        self.assertEqual(status, 200, state)
                        marker = forward.marker(sent.token, host, time.time, BOUND)
                        self.assertTrue(
                            forward.authentic(
                                marker, got.token, host, time.time, got.accept_token, bound=BOUND
                            ),
                            state,
                        )
        self.assertEqual(set(settings.values()), {(NEW, "")})

    async def test_switching_in_one_step_would_refuse_peers(self) -> None:
        """Why the rotation takes three steps: a box that sends the new token before its peers
        accept it is refused by them."""
        switched = self.served("box-1", NEW, accept=OLD)
        laggard = self.served("box-2", OLD)
        self.assertEqual(await self.status_of(switched.url, OLD), 200)
        self.assertEqual(await self.status_of(laggard.url, NEW), 401)


# --- mesh token: forwarded markers in the mesh router -------------------------------------------


class ForwardedMarkerRotationTests(_Base):
    def with_accept(self, accept: str) -> None:
        assert self.cfg.mesh is not None
        self.cfg = evolve(self.cfg, mesh=evolve(self.cfg.mesh, accept_token=accept))

    def test_a_marker_made_with_the_accepted_token_is_served_here_and_counted(self) -> None:
        self.with_accept(OLD)
        mesh = self.mesh_of(SELF, B)
        host = host_owned_by(B, SELF, B)
        here, uses = forwards("local_forwarded"), accept_uses("forwarded")
        marker = forward.marker(OLD, host, self.clock.seconds, BOUND)
        self.assertIs(self.routed(mesh, host, forwarded=marker), SERVED_HERE)
        self.assertEqual(forwards("local_forwarded"), here + 1)
        self.assertEqual(accept_uses("forwarded"), uses + 1)
        # The current token still works, uncounted; a box sends only the current one.
        marker = forward.marker(TOKEN, host, self.clock.seconds, BOUND)
        self.assertIs(self.routed(mesh, host, forwarded=marker), SERVED_HERE)
        self.assertEqual(accept_uses("forwarded"), uses + 1)
        other = host_owned_by(B, SELF, B, but_not=(host,))
        target = self.routed(mesh, other)
        ((_, sent),) = target.add_headers  # type: ignore[union-attr]
        to_b = forward.Bound(b"POST", b"/", B)
        self.assertTrue(forward.authentic(sent, TOKEN, other, self.clock.seconds, bound=to_b))
        self.assertFalse(forward.authentic(sent, OLD, other, self.clock.seconds, bound=to_b))

    def test_once_dropped_the_old_marker_is_routed_like_any_request(self) -> None:
        mesh = self.mesh_of(SELF, B)
        host = host_owned_by(B, SELF, B)
        bad, uses = forwards("bad_marker"), accept_uses("forwarded")
        marker = forward.marker(OLD, host, self.clock.seconds, BOUND)
        self.assertForwardedTo(self.routed(mesh, host, forwarded=marker), B, host)
        self.assertEqual(self.served, [])
        self.assertEqual(forwards("bad_marker"), bad + 1)
        self.assertEqual(accept_uses("forwarded"), uses)

    def test_the_accepted_token_does_not_loosen_the_other_checks(self) -> None:
        at = self.clock.seconds
        host = "a.mesh.example"
        stale = forward.marker(OLD, host, lambda: at() - 1000, BOUND)
        self.assertFalse(forward.authentic(stale, TOKEN, host, at, OLD, bound=BOUND))
        other_host = forward.marker(OLD, "b.mesh.example", at, BOUND)
        self.assertFalse(forward.authentic(other_host, TOKEN, host, at, OLD, bound=BOUND))
        self.assertFalse(
            forward.authentic(forward.marker("", host, at, BOUND), TOKEN, host, at, "", bound=BOUND)
        )
        self.assertFalse(
            forward.authentic(forward.marker(OLD, host, at, BOUND), "", host, at, OLD, bound=BOUND)
        )


# --- certificate cache key ----------------------------------------------------------------------


class CertCacheKeyConfigTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)

    def load(self, **env: str) -> config.BoxConfig:
        base = {
            "LCHAT_DATA_DIR": self.dir,
            "LCHAT_RUN_DIR": self.dir,
            "LCHAT_UNITS": "builtin",
            "LCHAT_HIBERNATE_BUCKET": f"file:{self.dir}/bucket",
            "LCHAT_CERT_CACHE": "s3",
            "LCHAT_CERT_CACHE_KEY": _b64(NEW_KEY),
        }
        return config.load(env_file=None, environ={**base, **env}, systemd_present=False)

    def test_the_previous_key_is_read_like_the_current_one(self) -> None:
        cfg = self.load(LCHAT_CERT_CACHE_KEY_PREVIOUS=_b64(OLD_KEY))
        self.assertEqual((cfg.cert_cache_key, cfg.cert_cache_previous_key), (NEW_KEY, OLD_KEY))
        self.assertNotIn(_b64(OLD_KEY), repr(cfg))
        self.assertEqual(self.load().cert_cache_previous_key, b"")

    def test_a_malformed_previous_key_fails_the_boot_by_name(self) -> None:
        for bad in ("not base64!", _b64(b"short")):
            with self.assertRaisesRegex(ConfigError, "^LCHAT_CERT_CACHE_KEY_PREVIOUS"):
                self.load(LCHAT_CERT_CACHE_KEY_PREVIOUS=bad)

    def test_equal_to_the_current_key_is_ignored_with_a_warning(self) -> None:
        cfg = self.load(LCHAT_CERT_CACHE_KEY_PREVIOUS=_b64(NEW_KEY))
        self.assertEqual(cfg.cert_cache_previous_key, b"")
        (warning,) = cfg.warnings
        self.assertIn("LCHAT_CERT_CACHE_KEY_PREVIOUS equals LCHAT_CERT_CACHE_KEY", warning)


def _b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


_NO_STORE: Any = object()  # never called: only the keys are under test


class SealedUnderPreviousTests(SynchronousTestCase):
    def test_an_entry_opens_with_the_key_it_names(self) -> None:
        name = CertName("host", "chat.example.com")
        cert = certificate(name.name)
        old = cache.seal(name, cert, OLD_KEY, "box-1")
        self.assertEqual(cache.unseal(name, old, NEW_KEY, previous=OLD_KEY), cert)
        new = cache.seal(name, cert, NEW_KEY, "box-1")
        self.assertEqual(cache.unseal(name, new, NEW_KEY, previous=OLD_KEY), cert)
        with self.assertRaisesRegex(CacheEntryError, "LCHAT_CERT_CACHE_KEY_PREVIOUS") as e:
            cache.unseal(name, cache.seal(name, cert, OTHER_KEY, "x"), NEW_KEY, previous=OLD_KEY)
        for key in (NEW_KEY, OLD_KEY, OTHER_KEY):
            self.assertNotIn(key.hex(), str(e.exception))
        self.assertIn(cache.key_id(OTHER_KEY), str(e.exception))

    def test_a_previous_key_equal_to_the_current_one_is_just_the_current_one(self) -> None:
        shared = SharedCache(_NO_STORE, NEW_KEY, previous_key=NEW_KEY, monotonic=time.monotonic)
        self.assertEqual(shared.key_ids, (cache.key_id(NEW_KEY),))
        with self.assertRaisesRegex(ValueError, "32 bytes"):
            SharedCache(_NO_STORE, NEW_KEY, previous_key=b"short", monotonic=time.monotonic)


class CertCacheRotationTests(TestCase):
    """Boxes sharing one certificate cache on a real S3 server (moto) while the key rotates."""

    NAME = CertName("host", "chat.example.com")

    async def setUp(self) -> None:  # type: ignore[override]
        server = await shared_server("moto")
        self.store = store_for(server, await server.new_bucket())
        self.addCleanup(self.store.close)
        self.root = tempfile.mkdtemp(prefix="sr", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.key = f"p/certs/{self.NAME.stem}.json"

    def box(self, name: str, key: bytes, previous: bytes = b"") -> tuple[SharedCache, CacheSync]:
        shared = SharedCache(
            self.store,
            key,
            previous_key=previous,
            prefix="p",
            box_id=name,
            monotonic=time.monotonic,
        )
        local = LocalCache(os.path.join(self.root, name))
        local.ensure_directory()

        def certificates() -> dict[str, certfiles.Loaded]:
            path = self.NAME.path(local.directory)
            if not os.path.exists(path):
                return {}
            loaded = certfiles.load_file(path, "host", self.NAME.name, time.time())
            assert isinstance(loaded, certfiles.Loaded), loaded
            return {self.NAME.name: loaded}

        sync = CacheSync(
            reactor,
            shared,
            local,
            certificates,
            lambda: succeed(None),
            thread_runner(reactor),
        )
        return shared, sync

    async def put_entry(self, cert: Certificate, key: bytes, box: str = "box-0") -> str:
        body = cache.seal(self.NAME, cert, key, box)
        put = await self.store.put(self.key, body, content_type="application/json")
        return put.etag

    async def entry(self) -> tuple[bytes, str]:
        got = await self.store.get(self.key)
        return got.body, got.info.etag

    def local(self, box: str) -> Certificate | None:
        return LocalCache(os.path.join(self.root, box)).read(self.NAME)

    async def test_an_entry_under_the_previous_key_is_installed_and_resealed(self) -> None:
        cert = certificate(self.NAME.name)
        await self.put_entry(cert, OLD_KEY, box="box-0")
        resealed = previous_reads("resealed")
        _, sync = self.box("box-1", NEW_KEY, previous=OLD_KEY)
        await sync.sync_now()
        installed = self.local("box-1")
        assert installed is not None
        self.assertEqual((installed.serial, installed.key_pem), (cert.serial, cert.key_pem))
        body, _ = await self.entry()
        self.assertEqual(cache.sealed_key_id(body), cache.key_id(NEW_KEY))
        self.assertEqual(cache.describe(body)["issued_by"], "box-0")  # who issued it, kept
        self.assertEqual(cache.unseal(self.NAME, body, NEW_KEY), cert)  # the new key alone
        self.assertEqual(previous_reads("resealed"), resealed + 1)
        # The next round reads nothing new and writes nothing.
        await sync.sync_now()
        self.assertEqual((await self.entry())[0], body)
        self.assertEqual(previous_reads("resealed"), resealed + 1)

    async def test_a_reseal_never_overwrites_a_newer_upload(self) -> None:
        old_cert = certificate(self.NAME.name, days=30)
        etag = await self.put_entry(old_cert, OLD_KEY)
        shared, _ = self.box("box-1", NEW_KEY, previous=OLD_KEY)
        read, _ = await self.entry()
        # Meanwhile a box still on the old key uploads a renewal.
        renewed = certificate(self.NAME.name, days=90)
        await self.put_entry(renewed, OLD_KEY, box="box-2")
        raced = previous_reads("raced")
        self.assertIsNone(await shared.reseal(self.NAME, old_cert, read, etag))
        self.assertEqual(previous_reads("raced"), raced + 1)
        body, _ = await self.entry()
        self.assertEqual(cache.unseal(self.NAME, body, OLD_KEY).serial, renewed.serial)
        # The sync reads the renewal and re-seals it instead.
        _, sync = self.box("box-1", NEW_KEY, previous=OLD_KEY)
        await sync.sync_now()
        body, _ = await self.entry()
        self.assertEqual(cache.unseal(self.NAME, body, NEW_KEY).serial, renewed.serial)

    async def test_with_neither_key_nothing_is_read_written_or_crashed(self) -> None:
        cert = certificate(self.NAME.name)
        await self.put_entry(cert, OLD_KEY)
        before, etag = await self.entry()
        refused = sample("lchat_cert_cache_sync_total", operation="install", outcome="refused")
        shared, sync = self.box("box-1", NEW_KEY, previous=OTHER_KEY)
        await sync.sync_now()
        self.assertIsNone(self.local("box-1"))
        self.assertEqual(await self.entry(), (before, etag))
        self.assertEqual(
            sample("lchat_cert_cache_sync_total", operation="install", outcome="refused"),
            refused + 1,
        )
        self.assertIsNone(await shared.fetch(self.NAME))
        with self.assertRaisesRegex(CacheEntryError, "not replacing it"):
            await shared.publish(self.NAME, certificate(self.NAME.name, days=89))
        self.assertEqual(await self.entry(), (before, etag))
        self.flushLoggedErrors()

    async def test_mid_rotation_a_box_not_yet_switched_never_undoes_the_switch(self) -> None:
        """box-1 switched (new key, old as previous); box-2 not yet (old key only): box-2 cannot
        read what box-1 re-sealed, and neither replaces it nor uploads over it."""
        cert = certificate(self.NAME.name, days=60)
        await self.put_entry(cert, OLD_KEY)
        _, switched = self.box("box-1", NEW_KEY, previous=OLD_KEY)
        await switched.sync_now()
        resealed, etag = await self.entry()
        self.assertEqual(cache.sealed_key_id(resealed), cache.key_id(NEW_KEY))

        laggard_shared, laggard = self.box("box-2", OLD_KEY)
        # The laggard has a newer certificate of its own (its local copy keeps serving TLS).
        newer = certificate(self.NAME.name, days=90)
        LocalCache(os.path.join(self.root, "box-2")).install(self.NAME, newer)
        await laggard.sync_now()
        self.assertEqual(await self.entry(), (resealed, etag))
        with self.assertRaisesRegex(CacheEntryError, "not replacing it"):
            await laggard_shared.publish(self.NAME, newer)
        self.assertEqual(await self.entry(), (resealed, etag))

        # Switched too, it reads the entry and uploads its newer certificate under the new key.
        _, laggard = self.box("box-2", NEW_KEY, previous=OLD_KEY)
        await laggard.sync_now()
        body, _ = await self.entry()
        self.assertEqual(cache.unseal(self.NAME, body, NEW_KEY).serial, newer.serial)
        self.flushLoggedErrors()

    async def test_a_renewal_replaces_an_entry_under_the_previous_key(self) -> None:
        await self.put_entry(certificate(self.NAME.name, days=30), OLD_KEY)
        shared, _ = self.box("box-1", NEW_KEY, previous=OLD_KEY)
        reads = previous_reads("read")
        got = await shared.fetch(self.NAME)  # the issuer's look before it orders
        assert got is not None
        self.assertEqual(previous_reads("read"), reads + 1)
        renewed = certificate(self.NAME.name, days=90)
        await shared.publish(self.NAME, renewed)
        body, _ = await self.entry()
        self.assertEqual(cache.sealed_key_id(body), cache.key_id(NEW_KEY))
        self.assertEqual(cache.unseal(self.NAME, body, NEW_KEY).serial, renewed.serial)

    async def test_lchat_certs_says_which_entries_still_need_the_previous_key(self) -> None:
        sealed_with = {"new.example.com": NEW_KEY, "old.example.com": OLD_KEY}
        sealed_with["other.example.com"] = OTHER_KEY
        for host, key in sealed_with.items():
            name = CertName("host", host)
            body = cache.seal(name, certificate(host), key, "box-0")
            await self.store.put(f"p/certs/{name.stem}.json", body)
        rows = await certs_cli._shared_rows(
            self.store, "p/certs/", cache.key_id(NEW_KEY), cache.key_id(OLD_KEY)
        )
        notes = {row.name: row.note for row in rows}
        self.assertEqual(notes["new.example.com"], "issued by box-0")
        self.assertIn("sealed with LCHAT_CERT_CACHE_KEY_PREVIOUS", notes["old.example.com"])
        self.assertIn(
            f"sealed with cache key {cache.key_id(OTHER_KEY)}, which this box cannot read",
            notes["other.example.com"],
        )


# --- home session key ---------------------------------------------------------------------------

HOME_OLD = bytes(range(32))
HOME_NEW = bytes(range(100, 132))


def home_replica(
    main: bytes, accept: bytes | None = None, clock: Clock | None = None
) -> Ceremonies:
    """A home replica's ceremonies, as its boot makes them from its two variables."""
    keys, warning = load_session_keys(
        _b64(main), accept=_b64(accept) if accept is not None else None
    )
    assert warning is None
    return Ceremonies.from_keys(keys, (clock or HOME_CLOCK).seconds)


HOME_CLOCK = Clock()
HOME_CLOCK.advance(1_700_000_000)


def home_accepts(token: str) -> float:
    return sample("lchat_home_session_accept_key_total", token=token)


def seal_login(replica: Ceremonies) -> str:
    return replica.sessions.seal("login", uid="u-1", challenge=b"c" * 32, rp_id="home.example")


class HomeSessionKeyRotationTests(SynchronousTestCase):
    def test_old_tokens_open_while_accepted_and_not_once_dropped(self) -> None:
        old = home_replica(HOME_OLD)
        proof, session = old.proofs.issue("u-1", "link"), seal_login(old)
        switched = home_replica(HOME_NEW, accept=HOME_OLD)
        proofs, sessions = home_accepts("proof"), home_accepts("session")
        self.assertEqual(switched.proofs.verify(proof, "link").uid, "u-1")
        self.assertEqual(switched.sessions.open(session, "login").uid, "u-1")
        self.assertEqual(
            (home_accepts("proof"), home_accepts("session")), (proofs + 1, sessions + 1)
        )
        # Its own tokens are made with the main secret only, and not counted.
        own = switched.proofs.issue("u-2", "link")
        self.assertEqual(switched.proofs.verify(own, "link").uid, "u-2")
        self.assertEqual(home_accepts("proof"), proofs + 1)
        with self.assertRaises(ProofNotAuthentic):
            old.proofs.verify(own, "link")
        # Dropped: the old tokens are refused like any stranger's.
        dropped = home_replica(HOME_NEW)
        with self.assertRaises(ProofNotAuthentic):
            dropped.proofs.verify(proof, "link")
        with self.assertRaises(SessionNotAuthentic):
            dropped.sessions.open(session, "login")

    def test_the_accepted_secret_does_not_loosen_purpose_or_expiry(self) -> None:
        clock = Clock()
        clock.advance(1_700_000_000)
        old = home_replica(HOME_OLD, clock=clock)
        switched = home_replica(HOME_NEW, accept=HOME_OLD, clock=clock)
        proof, session = old.proofs.issue("u-1", "link"), seal_login(old)
        with self.assertRaises(ProofWrongPurpose):
            switched.proofs.verify(proof, "delete")
        with self.assertRaises(SessionNotAuthentic):
            switched.sessions.open(session, "register")
        clock.advance(301)
        with self.assertRaises(ProofExpired):
            switched.proofs.verify(proof, "link")
        with self.assertRaises(SessionExpired):
            switched.sessions.open(session, "login")

    def test_the_three_rolling_steps_never_fail_a_ceremony_across_replicas(self) -> None:
        names = ("home-1", "home-2", "home-3")
        settings: dict[str, tuple[bytes, bytes | None]] = {name: (HOME_OLD, None) for name in names}
        steps = (
            lambda main, accept: (main, HOME_NEW),
            lambda main, accept: (HOME_NEW, HOME_OLD),
            lambda main, accept: (main, None),
        )
        for step, change in enumerate(steps, 1):
            for name in names:
                settings[name] = change(*settings[name])
                replicas = {n: home_replica(*settings[n]) for n in names}
                for maker in names:
                    proof = replicas[maker].proofs.issue("u-1", "link")
                    session = seal_login(replicas[maker])
                    for opener in names:
                        state = f"step {step}, {name} done: {maker} -> {opener}"
                        self.assertEqual(
                            replicas[opener].proofs.verify(proof, "link").uid, "u-1", state
                        )
                        self.assertEqual(
                            replicas[opener].sessions.open(session, "login").uid, "u-1", state
                        )
        self.assertEqual(set(settings.values()), {(HOME_NEW, None)})

    def test_the_accepted_secret_is_checked_like_the_main_one(self) -> None:
        for bad in ("not base64!", _b64(b"short")):
            with self.assertRaisesRegex(SessionKeyError, "^LCHAT_HOME_SESSION_KEY_ACCEPT ") as e:
                load_session_keys(_b64(HOME_NEW), accept=bad)
            self.assertNotIn(bad, str(e.exception))
        # Equal to the main secret, or beside an unset one: ignored (logged), nothing more opens.
        keys, _ = load_session_keys(_b64(HOME_NEW), accept=_b64(HOME_NEW))
        self.assertEqual(keys, SessionKeys.derive(HOME_NEW))
        keys, warning = load_session_keys("", accept=_b64(HOME_OLD))
        self.assertTrue(keys.ephemeral)
        self.assertIsNotNone(warning)
        self.assertEqual((keys.accept_proof_key, keys.accept_seal_key), (b"", b""))
        self.assertNotIn(HOME_OLD.hex(), repr(home_replica(HOME_NEW, accept=HOME_OLD)))

    def test_home_config_reads_the_variable_and_never_shows_it(self) -> None:
        cfg = home_config.load(
            env_file=os.devnull,
            environ={
                "LCHAT_HOME_SESSION_KEY": _b64(HOME_NEW),
                "LCHAT_HOME_SESSION_KEY_ACCEPT": _b64(HOME_OLD),
            },
        )
        self.assertEqual(cfg.session_key_accept, _b64(HOME_OLD))
        self.assertNotIn(_b64(HOME_OLD), repr(cfg))
        self.assertEqual(home_config.load(env_file=os.devnull, environ={}).session_key_accept, "")
