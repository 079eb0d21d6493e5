"""Route replication: the mesh API (``lchat.mesh.api``) served for real on loopback over a real
registry file, called through ``lchat.mesh.client`` (treq) and raw sockets; then the CLI side
(``mesh-seed``, ``--prune``, the fan-out of ``add-instance``/``remove``, ``lchat mesh``) as real
``lchat`` processes against a peer box served here, membership from heartbeats in a file bucket.
"""

from __future__ import annotations

import datetime
import hmac
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from twisted.internet import reactor as _reactor
from twisted.internet import ssl
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import config, envfile, hosts
from lchat.cli import mesh as mesh_cli
from lchat.config import BoxConfig
from lchat.mesh import api, client, route_payload, settings, tokens
from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.members import Member, member_key
from lchat.mesh.placement import normalise_member_url, owner
from lchat.objstore.file import FileBucket
from lchat.registry import Conflict, Registry, RegistryError, Route
from lchat.threads import thread_runner
from tests.test_tls import TestCA

reactor: Any = _reactor
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "mesh-token-for-tests-0123456789-abcdef"  # >= 32 characters (config.MIN_MESH_TOKEN)
DOMAIN = "chat.example.com"
HOST = "a.chat.example.com"
ADMIN = "admin-token-" + "k" * 24
NOW = datetime.datetime.now(datetime.UTC)


def payload(host: Any = HOST, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "host": host,
        "kind": "instance",
        "version": "1.2.3",
        "hibernate": True,
        "replication": "batched",
        "home_region": "",
        "env": {"LCHAT_ADMIN_TOKEN": ADMIN, "LCHAT_SPACE_NAME": "Team chat #1"},
    }
    body.update(changes)
    return body


def sample(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


def calls(op: str, outcome: str) -> float:
    return sample("lchat_mesh_route_calls_total", op=op, outcome=outcome)


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def raw_http(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
    """Send ``data`` as-is on a fresh connection; the status and JSON body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    answer = b"".join(chunks)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body.strip() else {}


def request_bytes(
    method: str,
    path: str,
    body: bytes = b"",
    *,
    token: str | None = TOKEN,
    content_type: str | None = "application/json",
    extra: tuple[str, ...] = (),
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: box-1.example.net", "Connection: close"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    lines.append(f"Content-Length: {len(body)}")
    lines.extend(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# --- a box: directories, settings, registry ----------------------------------------------------


class Box:
    def __init__(self, root: str, name: str, **settings: str) -> None:
        self.dir = os.path.join(root, name)
        self.data = os.path.join(self.dir, "data")
        self.run = os.path.join(self.dir, "run")
        os.makedirs(self.data)
        os.makedirs(self.run)
        self.env_file = os.path.join(self.dir, "router.env")
        self.settings = {
            "LCHAT_DATA_DIR": self.data,
            "LCHAT_RUN_DIR": self.run,
            "LCHAT_UNITS": "builtin",
            "LCHAT_HIBERNATE_BUCKET": f"file:{os.path.join(root, 'bucket')}",
            "LCHAT_HIBERNATE_PREFIX": "prod",
            "LCHAT_MESH_SELF": f"http://{name}.example.net",
            "LCHAT_MESH_DOMAINS": DOMAIN,
            "LCHAT_MESH_TOKEN": TOKEN,
            "LCHAT_MESH_REGION": "ie",
            "LCHAT_HTTP_REDIRECT": "off",  # an http mesh-self URL needs plain http served
            # A command that runs any host here (a peer refuses a route it could not wake).
            "LCHAT_SPACE_COMMAND": f"{sys.executable} -m lchat.space",
            **settings,
        }
        self.write_env()
        self.registry = Registry(os.path.join(self.data, "registry.db"), clock=time.time)
        self.registry.migrate()

    def write_env(self, **changes: str) -> None:
        self.settings.update(changes)
        with open(self.env_file, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in self.settings.items() if v))

    def cfg(self) -> BoxConfig:
        return config.load(env_file=self.env_file, environ={})

    def env_path(self, host: str) -> str:
        return hosts.env_path(self.data, host)

    def add(self, host: str, *, hibernate: bool = True, kind: str = "instance", **kw: Any) -> Route:
        """A row as ``lchat add-instance`` writes it, and its env file."""
        if kind == "instance":
            write_private(self.env_path(host), f"LCHAT_ADMIN_TOKEN=tok-{host}\nOTHER=kept-here\n")
        return self.registry.insert(
            Route(
                host=host,
                kind=kind,  # type: ignore[arg-type]
                socket=hosts.socket_path(self.run, host),
                db_path=hosts.db_path(self.data, host) if kind == "instance" else "",
                status="ready",
                hibernate=hibernate and kind == "instance",
                **kw,
            )
        )

    def changes(self) -> int:
        with self.registry.connect() as conn:
            return int(conn.execute("SELECT n FROM registry_changes").fetchone()[0])

    def files(self) -> dict[str, bytes]:
        result = {}
        for name in sorted(os.listdir(self.data)):
            if name.startswith("registry.db"):
                continue
            with open(os.path.join(self.data, name), "rb") as f:
                result[name] = f.read()
        return result


class Served:
    """A box's mesh API on 127.0.0.1, with its reload callback recorded."""

    def __init__(
        self,
        case: TestCase,
        box: Box,
        reload: Callable[[str], object] | None = None,
        *,
        members: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        owner: Callable[[Route], str] | None = None,
    ) -> None:
        """``members``: which URLs are members (``lives_at`` may name them); ``clock``: the
        failed-authentication limiter's."""
        self.box = box
        self.reloads: list[str] = []

        def record(reason: str) -> object:
            self.reloads.append(reason)
            return reload(reason) if reload is not None else None

        self.site = api.mesh_site(
            box.registry,
            box.cfg(),
            record,
            run_in_thread=thread_runner(reactor),
            members=members,
            clock=clock,
            owner=owner,
        )
        self.port = reactor.listenTCP(0, self.site, interface="127.0.0.1")
        case.addCleanup(self.port.stopListening)
        self.number = self.port.getHost().port
        self.url = f"http://127.0.0.1:{self.number}"


class APITestCase(TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="ma", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.box = Box(self.root, "box-1")
        self.served = Served(self, self.box)
        self.url = self.served.url

    def push(self, body: dict[str, Any], token: str = TOKEN) -> Deferred[dict[str, Any]]:
        return Deferred.fromCoroutine(client.push_route(self.url, token, body, reactor=reactor))

    def raw(self, data: bytes) -> Deferred[tuple[int, dict[str, Any]]]:
        return deferToThread(raw_http, self.served.number, data)

    @inlineCallbacks
    def assertRefused(self, data: bytes, status: int, fragment: str = "") -> Any:
        """The request is answered ``status`` with a JSON error, and nothing at all changed."""
        before = (self.box.changes(), self.box.files(), list(self.served.reloads))
        code, body = yield self.raw(data)
        self.assertEqual(code, status, body)
        self.assertIsInstance(body.get("error"), str)
        self.assertIn(fragment, body["error"])
        after = (self.box.changes(), self.box.files(), list(self.served.reloads))
        self.assertEqual(after, before, "something was written")


# --- POST ---------------------------------------------------------------------------------------


class UpsertTests(APITestCase):
    @inlineCallbacks
    def test_post_creates_row_and_private_env_file(self) -> Any:
        created = calls("upsert", "created")
        answer = yield self.push(payload())
        self.assertEqual(answer, {"host": HOST, "result": "created"})
        route = self.box.registry.get(HOST)
        assert route is not None
        self.assertEqual(
            (route.kind, route.status, route.hibernate, route.version, route.replication),
            ("instance", "ready", True, "1.2.3", "batched"),
        )
        # Paths are this box's own, derived through hosts.py.
        self.assertEqual(route.socket, hosts.socket_path(self.box.run, HOST))
        self.assertEqual(route.db_path, hosts.db_path(self.box.data, HOST))
        path = self.box.env_path(HOST)
        self.assertEqual(mode(path), 0o600)
        self.assertEqual(
            config.read_env_file(path),
            {"LCHAT_ADMIN_TOKEN": ADMIN, "LCHAT_SPACE_NAME": "Team chat #1"},
        )
        self.assertEqual([n for n in os.listdir(self.box.data) if n.endswith(".tmp")], [])
        self.assertEqual(calls("upsert", "created"), created + 1)
        self.assertEqual(self.served.reloads, [f"mesh route created: {HOST}"])

    @inlineCallbacks
    def test_a_bot_env_travels_and_its_absence_removes_it(self) -> Any:
        """``bot_env`` is written to ``<host>-bot.env`` (private) and in the row's hash; a later
        payload without it (the sender's space has no sidecar now) removes the file."""
        bot = hosts.bot_env_path(self.box.data, HOST)
        answer = yield self.push(payload(gen=10, bot_env={"LCHAT_BOT_TOKEN": "b" * 32}))
        self.assertEqual(answer["result"], "created")
        self.assertEqual(mode(bot), 0o600)
        self.assertEqual(config.read_env_file(bot), {"LCHAT_BOT_TOKEN": "b" * 32})
        route = self.box.registry.get(HOST)
        assert route is not None
        env = client.read_route_env(self.box.data, HOST)
        with_bot = settings.route_hash(route, env, {"LCHAT_BOT_TOKEN": "b" * 32})
        self.assertEqual(route.settings_hash, with_bot)
        self.assertNotEqual(with_bot, settings.route_hash(route, env))

        answer = yield self.push(payload(gen=11))
        self.assertEqual(answer["result"], "updated")
        self.assertFalse(os.path.exists(bot))
        route = self.box.registry.get(HOST)
        assert route is not None
        self.assertEqual(route.settings_hash, settings.route_hash(route, env))
        # A listing carries the bot env of a space that has one, and none otherwise.
        write_private(bot, "LCHAT_BOT_TOKEN=c\nOTHER=stays-here\n")
        listed = yield Deferred.fromCoroutine(client.list_routes(self.url, TOKEN, reactor=reactor))
        self.assertEqual(listed[0]["bot_env"], {"LCHAT_BOT_TOKEN": "c"})

    @inlineCallbacks
    def test_post_answers_201_then_200(self) -> Any:
        code, body = yield self.raw(
            request_bytes("POST", "/api/mesh/route", json.dumps(payload()).encode())
        )
        self.assertEqual((code, body), (201, {"host": HOST, "result": "created"}))
        code, body = yield self.raw(
            request_bytes("POST", "/api/mesh/route", json.dumps(payload()).encode())
        )
        self.assertEqual((code, body), (200, {"host": HOST, "result": "updated"}))

    @inlineCallbacks
    def test_post_updates_an_existing_hibernating_row(self) -> Any:
        local = self.box.add(HOST, replication="stream", version="0.9")
        self.box.registry.update(HOST, next_due=1234)
        answer = yield self.push(
            payload(version="2.0", replication="daily", home_region="ie", env={"LCHAT_X": "y"})
        )
        self.assertEqual(answer["result"], "updated")
        route = self.box.registry.get(HOST)
        assert route is not None
        self.assertEqual(
            (route.version, route.replication, route.home_region), ("2.0", "daily", "ie")
        )
        # What only this box knows stays as it was.
        self.assertEqual(
            (route.socket, route.db_path, route.status, route.next_due, route.created_at),
            (local.socket, local.db_path, "ready", 1234, local.created_at),
        )
        # The env file is exactly the replicated values now.
        self.assertEqual(config.read_env_file(self.box.env_path(HOST)), {"LCHAT_X": "y"})
        self.assertEqual(mode(self.box.env_path(HOST)), 0o600)
        self.assertEqual(len(self.served.reloads), 1)

    @inlineCallbacks
    def test_host_is_normalised(self) -> Any:
        answer = yield self.push(payload(host="A.Chat.Example.COM."))
        self.assertEqual(answer["host"], HOST)
        self.assertIsNotNone(self.box.registry.get(HOST))
        self.assertTrue(os.path.exists(self.box.env_path(HOST)))

    @inlineCallbacks
    def test_home_region_of_this_box_is_in_scope(self) -> Any:
        # (Under the mesh's domain, though not directly: placed by region, not by hash.)
        yield self.push(payload(host="x.deep.chat.example.com", home_region="ie"))
        route = self.box.registry.get("x.deep.chat.example.com")
        assert route is not None
        self.assertEqual(route.home_region, "ie")

    @inlineCallbacks
    def test_values_that_need_quoting_round_trip(self) -> Any:
        env = {
            "LCHAT_A": " leading and trailing ",
            "LCHAT_B": "it's",
            "LCHAT_C": 'say "hi" # not a comment',
            "LCHAT_D": "",
            "LCHAT_E": "x" * route_payload.MAX_ENV_VALUE,
            "LCHAT_F": "ünïcödé",
        }
        yield self.push(payload(env=env))
        self.assertEqual(config.read_env_file(self.box.env_path(HOST)), env)

    @inlineCallbacks
    def test_reload_is_waited_for(self) -> Any:
        gate: Deferred[None] = Deferred()
        served = Served(self, self.box, reload=lambda reason: gate)
        answered = Deferred.fromCoroutine(
            client.push_route(served.url, TOKEN, payload(), reactor=reactor)
        )
        yield deferLater(reactor, 0.3, lambda: None)
        self.assertEqual(len(served.reloads), 1)
        self.assertFalse(answered.called, "answered before the route table reloaded")
        gate.callback(None)
        answer = yield answered
        self.assertEqual(answer["result"], "created")

    @inlineCallbacks
    def test_failed_reload_still_answers(self) -> Any:
        def broken(reason: str) -> object:
            raise RuntimeError("reload exploded")

        served = Served(self, self.box, reload=broken)
        answer = yield Deferred.fromCoroutine(
            client.push_route(served.url, TOKEN, payload(), reactor=reactor)
        )
        self.assertEqual(answer["result"], "created")
        self.flushLoggedErrors()


class SettingsGenTests(APITestCase):
    """Settings generations order the upserts (issue 32, item 2: lchat.mesh.settings)."""

    OWNER = "https://owner.example.net"

    def setUp(self) -> None:
        super().setUp()
        self.served = Served(self, self.box, owner=lambda route: self.OWNER)
        self.url = self.served.url

    def send(self, body: dict[str, Any], sender: str = "") -> Deferred[dict[str, Any]]:
        return Deferred.fromCoroutine(
            client.push_route(self.url, TOKEN, body, sender=sender, reactor=reactor)
        )

    def row(self) -> Route:
        route = self.box.registry.get(HOST)
        assert route is not None
        return route

    @inlineCallbacks
    def test_gen_orders_updates(self) -> Any:
        stale = calls("upsert", "stale")
        answer = yield self.send(payload(gen=100))
        self.assertEqual(answer["result"], "created")
        self.assertEqual(self.row().settings_gen, 100)
        answer = yield self.send(payload(gen=200, replication="daily"))
        self.assertEqual(answer["result"], "updated")
        first = self.row()
        self.assertEqual((first.replication, first.settings_gen), ("daily", 200))
        self.assertEqual(len(first.settings_hash), 64)
        before = (self.box.changes(), self.box.files())
        answer = yield self.send(payload(gen=150, env={"LCHAT_ADMIN_TOKEN": "older-token"}))
        self.assertEqual(answer, {"host": HOST, "result": "stale", "gen": 200})
        self.assertEqual((self.box.changes(), self.box.files()), before, "a stale push wrote")
        self.assertEqual(self.row(), first)
        self.assertEqual(calls("upsert", "stale"), stale + 1)
        # The same generation and settings again (a due time riding on them) is taken...
        answer = yield self.send(payload(gen=200, replication="daily", next_due=77))
        self.assertEqual((answer["result"], self.row().next_due), ("updated", 77))
        # ...other settings at the same generation only from the host's owner by the hash.
        answer = yield self.send(payload(gen=200, replication="stream"), sender="https://b.net")
        self.assertEqual((answer["result"], self.row().replication), ("stale", "daily"))
        answer = yield self.send(payload(gen=200, replication="stream"), sender=self.OWNER)
        self.assertEqual((answer["result"], self.row().replication), ("updated", "stream"))

    @inlineCallbacks
    def test_payload_without_gen_never_overwrites_a_gend_row(self) -> Any:
        yield self.send(payload())  # an older peer's create: no generation
        self.assertEqual(self.row().settings_gen, 0)
        answer = yield self.send(payload(replication="daily"))  # over a row with none: taken
        self.assertEqual((answer["result"], self.row().replication), ("updated", "daily"))
        yield self.send(payload(gen=5, replication="batched"))
        before = self.box.files()
        answer = yield self.send(payload(replication="stream", next_due=99))
        self.assertEqual(answer, {"host": HOST, "result": "stale", "gen": 5})
        row = self.row()
        self.assertEqual((row.replication, row.settings_gen), ("batched", 5))
        self.assertEqual(self.box.files(), before)
        # Its due time is no setting: taken (the box that slept the space knows it best).
        self.assertEqual(row.next_due, 99)

    @inlineCallbacks
    def test_an_older_peer_takes_the_push_without_gen(self) -> Any:
        """A peer from before generations refuses the field (400 ``unknown fields: gen``): the
        push is retried once without it, and logged."""
        older = tuple(f for f in client.PAYLOAD_FIELDS if f != "gen")
        self.patch(route_payload, "PAYLOAD_FIELDS", older)  # the older lchat's parse_payload
        logged: list[dict[str, Any]] = []
        observer = cast(Any, logged.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        answer = yield self.send(payload(gen=9))
        self.assertEqual(answer["result"], "created")
        self.assertEqual(self.row().settings_gen, 0)
        said = [formatEvent(e) for e in logged if e.get("log_namespace") == "lchat.mesh.client"]
        self.assertTrue(any("does not know gen (an older lchat)" in m for m in said), said)

    @inlineCallbacks
    def test_an_older_peer_takes_the_push_without_the_fields_it_does_not_know(self) -> Any:
        """A peer from before the bot's env travelled (and before generations) names both fields
        in its 400: the push is retried once without them; a field that is not optional is no
        reason to retry (the 400 stands)."""
        older = tuple(f for f in client.PAYLOAD_FIELDS if f not in ("gen", "bot_env"))
        self.patch(route_payload, "PAYLOAD_FIELDS", older)
        logged: list[dict[str, Any]] = []
        observer = cast(Any, logged.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        sent = dict(payload(gen=9), bot_env={"LCHAT_BOT_NAME": "helper"})
        answer = yield self.send(sent)
        self.assertEqual(answer["result"], "created")
        said = [formatEvent(e) for e in logged if e.get("log_namespace") == "lchat.mesh.client"]
        self.assertTrue(any("does not know bot_env, gen" in m for m in said), said)
        bogus = dict(payload(f"b.{DOMAIN}"), colour="red")
        failure = yield self.assertFailure(self.send(bogus), client.MeshCallError)
        self.assertIn("unknown fields: colour", str(failure))

    @inlineCallbacks
    def test_a_peer_from_before_region_generations_takes_the_push_with_gen(self) -> Any:
        """A peer that knows settings generations but not the home region's (400 ``unknown
        fields: region_gen``): the push is retried once without that field alone."""
        older = tuple(f for f in client.PAYLOAD_FIELDS if f != "region_gen")
        self.patch(route_payload, "PAYLOAD_FIELDS", older)  # that lchat's parse_payload
        answer = yield self.send(payload(gen=9, region_gen=4))
        self.assertEqual(answer["result"], "created")
        self.assertEqual((self.row().settings_gen, self.row().region_gen), (9, 0))

    @inlineCallbacks
    def test_digest_endpoint_needs_the_token(self) -> Any:
        """``GET /api/mesh/digest``: {host: [gen, hash]} of the replicated rows, with the token
        only; ``GET /api/mesh/routes?host=`` lists that one row."""
        yield self.send(payload(gen=42))
        yield self.send(payload(f"b.{DOMAIN}"))
        self.box.add(f"local.{DOMAIN}", hibernate=False)  # always-on here: not replicated
        code, body = yield self.raw(request_bytes("GET", "/api/mesh/digest", token=None))
        self.assertEqual(code, 401, body)
        code, body = yield self.raw(request_bytes("GET", "/api/mesh/digest", token="x" * 40))
        self.assertEqual(code, 401, body)
        digest = yield Deferred.fromCoroutine(
            client.settings_digest(self.url, TOKEN, reactor=reactor)
        )
        self.assertEqual(
            digest,
            {HOST: (42, self.row().settings_hash), f"b.{DOMAIN}": (0, digest[f"b.{DOMAIN}"][1])},
        )
        self.assertEqual(len(digest[f"b.{DOMAIN}"][1]), 64)
        one = yield Deferred.fromCoroutine(
            client.fetch_route(self.url, TOKEN, HOST, reactor=reactor)
        )
        self.assertEqual((one["host"], one["gen"]), (HOST, 42))
        none = yield Deferred.fromCoroutine(
            client.fetch_route(self.url, TOKEN, f"local.{DOMAIN}", reactor=reactor)
        )
        self.assertIsNone(none)

    def test_gen_field_is_checked(self) -> None:
        for bad in (0, -1, 2**53, True, "5", 1.5):
            with self.assertRaises(route_payload.PayloadError):
                route_payload.parse_payload(payload(gen=bad))
        self.assertEqual(route_payload.parse_payload(payload(gen=3)).gen, 3)
        self.assertIsNone(route_payload.parse_payload(payload()).gen)


class RefusalTests(APITestCase):
    def post(self, body: object, **kw: Any) -> bytes:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return request_bytes("POST", "/api/mesh/route", data, **kw)

    def test_unknown_fields(self) -> Any:
        return self.assertRefused(
            self.post(payload(socket="/tmp/evil.sock")), 400, "unknown fields: socket"
        )

    def test_db_path_field(self) -> Any:
        return self.assertRefused(self.post(payload(db_path="/etc/passwd")), 400, "db_path")

    def test_missing_field(self) -> Any:
        body = payload()
        del body["replication"]
        return self.assertRefused(self.post(body), 400, "missing fields: replication")

    @inlineCallbacks
    def test_bad_bot_env(self) -> Any:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"bot_env": {"PATH": "/bin"}}, "bot_env: 'PATH' is not a replicable name"),
            ({"bot_env": ["LCHAT_A"]}, "bot_env must be an object"),
            ({"bot_env": {"LCHAT_A": "line\nbreak"}}, "bot_env: LCHAT_A"),
            (
                {"hibernate": False, "lives_at": "https://b.example.net", "bot_env": {}},
                "never runs a sidecar here",
            ),
        ]
        for changes, fragment in cases:
            yield self.assertRefused(self.post(payload(**changes)), 400, fragment)

    @inlineCallbacks
    def test_contract_paths_in_env(self) -> Any:
        for name in ("LCHAT_SOCKET", "LCHAT_DB", "LCHAT_HOST"):
            yield self.assertRefused(
                self.post(payload(env={name: "/tmp/x"})), 400, "not a replicable name"
            )

    @inlineCallbacks
    def test_bad_env(self) -> Any:
        for env, fragment in [
            ({"PATH": "/bin"}, "not a replicable name"),
            ({"LCHAT_lower": "x"}, "not a replicable name"),
            ({"LCHAT_" + "A" * 65: "x"}, "not a replicable name"),
            ({"LCHAT_A": 1}, "must be a string"),
            ({"LCHAT_A": "\ud800"}, "must be a string"),
            ({"LCHAT_A": "line\nbreak"}, "line break"),
            ({"LCHAT_A": "nul\x00"}, "control character"),
            ({"LCHAT_A": "cr\r"}, "line break"),
            ({"LCHAT_A": "sep\u2028"}, "line break"),
            ({"LCHAT_A": "x" * (route_payload.MAX_ENV_VALUE + 1)}, "longer than"),
            ({"LCHAT_A": "é" * (route_payload.MAX_ENV_VALUE // 2 + 1)}, "longer than"),
            ({"LCHAT_A": " 'both\" "}, "both quote"),
            ({f"LCHAT_K{i}": "v" for i in range(route_payload.MAX_ENV_KEYS + 1)}, "more than"),
            (["LCHAT_A"], "env must be an object"),
        ]:
            yield self.assertRefused(self.post(payload(env=env)), 400, fragment)

    @inlineCallbacks
    def test_bad_hosts(self) -> Any:
        for host in ["../../etc", "a", "127.0.0.1", "a b.chat.example.com", "", 7, "a.example-bot"]:
            yield self.assertRefused(self.post(payload(host=host)), 400, "host")

    def test_out_of_scope_host(self) -> Any:
        return self.assertRefused(
            self.post(payload(host="a.other.example.org")), 400, "not in this box's mesh scope"
        )

    def test_deeper_than_one_label_is_out_of_scope(self) -> Any:
        return self.assertRefused(
            self.post(payload(host="b.a.chat.example.com")), 400, "not in this box's mesh scope"
        )

    def test_other_region_is_out_of_scope(self) -> Any:
        return self.assertRefused(
            self.post(payload(host="x.elsewhere.org", home_region="fi")), 400, "scope"
        )

    @inlineCallbacks
    def test_not_hibernating_or_not_an_instance(self) -> Any:
        yield self.assertRefused(self.post(payload(hibernate=False)), 400, "hibernate must be")
        yield self.assertRefused(self.post(payload(hibernate=1)), 400, "hibernate must be")
        yield self.assertRefused(self.post(payload(kind="service")), 400, "services do not")

    @inlineCallbacks
    def test_bad_types_and_values(self) -> Any:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"replication": "hourly"}, "replication"),
            ({"version": 3}, "version"),
            ({"version": "x" * 300}, "version"),
            ({"version": "a\nb"}, "version"),
            ({"version": "\udfff"}, "version"),
            ({"home_region": "../x"}, "home_region"),
            ({"home_region": None}, "home_region"),
        ]
        for changes, fragment in cases:
            yield self.assertRefused(self.post(payload(**changes)), 400, fragment)

    @inlineCallbacks
    def test_not_json(self) -> Any:
        for body in [
            b"",
            b"not json",
            b"[1, 2]",
            b'{"host": "a.chat.example.com"',
            b"\xff\xfe",
            b"[" * 30000 + b"]" * 30000,
            b'{"host": NaN}',
        ]:
            yield self.assertRefused(self.post(body), 400)

    def test_duplicate_keys(self) -> Any:
        body = json.dumps(payload())[:-1] + ', "host": "b.chat.example.com"}'
        return self.assertRefused(self.post(body.encode()), 400, "duplicate key")

    @inlineCallbacks
    def test_content_type(self) -> Any:
        body = json.dumps(payload()).encode()
        for content_type in [None, "text/plain", "application/json; charset=latin-1"]:
            yield self.assertRefused(
                self.post(body, content_type=content_type), 400, "Content-Type"
            )
        code, _ = yield self.raw(self.post(body, content_type="Application/JSON; charset=UTF-8"))
        self.assertEqual(code, 201)

    def test_oversized_declared_body(self) -> Any:
        body = json.dumps(payload(env={"LCHAT_PAD": "x" * 4000})).encode()
        body = body[:-1] + b"," + b" " * (api.MAX_BODY + 10 - len(body)) + b"}"
        return self.assertRefused(self.post(body), 400, "larger than")

    def test_oversized_chunked_body(self) -> Any:
        chunk = b"x" * 8192
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(10)) + b"0\r\n\r\n"
        head = (
            "POST /api/mesh/route HTTP/1.1\r\nHost: b\r\nConnection: close\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode()
        return self.assertRefused(head + chunks, 400, "larger than")

    @inlineCallbacks
    def test_wrong_or_missing_token(self) -> Any:
        unauthorized = calls("upsert", "unauthorized")
        compared: list[tuple[bytes, bytes]] = []
        original = hmac.compare_digest

        def spy(a: Any, b: Any) -> bool:
            compared.append((a, b))
            return original(a, b)

        self.patch(tokens.hmac, "compare_digest", spy)
        body = json.dumps(payload()).encode()
        yield self.assertRefused(self.post(body, token="wrong-token"), 401, "token")
        # Both values are compared every time (the second, LCHAT_MESH_TOKEN_ACCEPT, is unset).
        self.assertEqual(compared, [(b"wrong-token", TOKEN.encode()), (b"wrong-token", b"")])
        yield self.assertRefused(self.post(body, token=TOKEN + "x"), 401, "token")
        yield self.assertRefused(self.post(body, token=None), 401, "token")
        yield self.assertRefused(self.post(body, token=""), 401, "token")
        # Not bearer, or the token twice.
        yield self.assertRefused(
            request_bytes(
                "POST",
                "/api/mesh/route",
                body,
                token=None,
                extra=(f"Authorization: Basic {TOKEN}",),
            ),
            401,
        )
        yield self.assertRefused(
            self.post(body, extra=(f"Authorization: Bearer {TOKEN}",)), 401, "token"
        )
        self.assertEqual(calls("upsert", "unauthorized"), unauthorized + 6)

    @inlineCallbacks
    def test_client_reports_a_refusal(self) -> Any:
        with self.assertRaises(client.MeshCallError) as caught:
            yield self.push(payload(), token="nope")
        self.assertEqual(caught.exception.status, 401)
        with self.assertRaises(client.MeshCallError) as caught:
            yield self.push(payload(hibernate=False))
        self.assertEqual(caught.exception.status, 400)
        self.assertIn("hibernate must be true", str(caught.exception))

    @inlineCallbacks
    def test_methods_and_paths(self) -> Any:
        for method, path, status in [
            ("GET", "/api/mesh/route", 405),
            ("PUT", "/api/mesh/route", 405),
            ("POST", "/api/mesh/routes", 405),
            ("GET", "/api/mesh/route/a.chat.example.com", 405),
            ("POST", "/api/mesh/route/a.chat.example.com", 405),
            ("GET", "/", 404),
            ("GET", "/api/mesh/route/a.chat.example.com/x", 404),
            ("DELETE", "/api/mesh/route/", 400),
            ("GET", "/api/mesh/routesx", 404),
            ("POST", "/api/mesh/route/", 405),
        ]:
            yield self.assertRefused(request_bytes(method, path), status)

    @inlineCallbacks
    def test_a_route_this_box_could_not_wake_is_refused(self) -> Any:
        # The seed's incident class: the row arrives, and its first wake fails because the
        # space's binary is missing on this box. Refused at the upsert instead, loudly.
        for command, why in (
            ("/opt/lchat/live/{host}", f"/opt/lchat/live/{HOST} does not exist"),
            ("no-such-space-binary --x", "no-such-space-binary is not on the router's PATH"),
            (__file__, "is not executable"),
        ):
            self.box.write_env(LCHAT_SPACE_COMMAND=command)
            served = Served(self, self.box)
            code, body = yield deferToThread(raw_http, served.number, self.post(payload()))
            self.assertEqual(code, 422, body)
            self.assertIn(why, body["error"])
            self.assertIn("The space command", body["error"])
            self.assertIsNone(self.box.registry.get(HOST))
            self.assertFalse(os.path.exists(self.box.env_path(HOST)))
        with self.assertRaises(client.MeshCallError) as caught:
            yield Deferred.fromCoroutine(
                client.push_route(served.url, TOKEN, payload(), reactor=reactor)
            )
        self.assertEqual(caught.exception.status, 422)
        self.assertIn("cannot run", str(caught.exception))

    @inlineCallbacks
    def test_local_non_hibernating_row_is_never_overwritten(self) -> Any:
        self.box.add(HOST, hibernate=False)
        self.box.add("svc.chat.example.com", kind="service")
        for host in (HOST, "svc.chat.example.com"):
            yield self.assertRefused(self.post(payload(host=host)), 409, "a peer may not change")
        route = self.box.registry.get(HOST)
        assert route is not None
        self.assertFalse(route.hibernate)
        self.assertEqual(
            config.read_env_file(self.box.env_path(HOST)),
            {"LCHAT_ADMIN_TOKEN": f"tok-{HOST}", "OTHER": "kept-here"},
        )


# --- DELETE -------------------------------------------------------------------------------------


class DeleteTests(APITestCase):
    def delete(self, host: str, token: str = TOKEN) -> Deferred[bool]:
        return Deferred.fromCoroutine(client.delete_route(self.url, token, host, reactor=reactor))

    @inlineCallbacks
    def test_tombstone_is_idempotent_and_keeps_member_data(self) -> Any:
        yield self.push(payload())
        data = {
            name: hosts.db_path(self.box.data, HOST) + suffix
            for name, suffix in (("db", ""), ("wal", "-wal"), ("shm", "-shm"))
        }
        for path in data.values():
            write_private(path, "member data")
        bot = hosts.bot_env_path(self.box.data, HOST)
        write_private(bot, "LCHAT_BOT_TOKEN=b\n")
        other = self.box.env_path("b.chat.example.com")
        write_private(other, "LCHAT_ADMIN_TOKEN=other\n")
        self.served.reloads.clear()

        deleted = yield self.delete(HOST)
        self.assertTrue(deleted)
        self.assertIsNone(self.box.registry.get(HOST))
        self.assertFalse(os.path.exists(self.box.env_path(HOST)))
        self.assertFalse(os.path.exists(bot))
        for path in data.values():
            with open(path) as f:
                self.assertEqual(f.read(), "member data")
        self.assertTrue(os.path.exists(other))
        self.assertEqual(self.served.reloads, [f"mesh route deleted: {HOST}"])

        absent = calls("delete", "absent")
        again = yield self.delete(HOST)
        self.assertFalse(again)
        self.assertEqual(calls("delete", "absent"), absent + 1)
        self.assertEqual(len(self.served.reloads), 1)  # nothing changed: no reload

    @inlineCallbacks
    def test_absent_row_leaves_files_alone(self) -> Any:
        # An env file without a row is a locally removed space's token (remove keeps files).
        write_private(self.box.env_path(HOST), "LCHAT_ADMIN_TOKEN=kept\n")
        code, body = yield self.raw(request_bytes("DELETE", f"/api/mesh/route/{HOST}"))
        self.assertEqual((code, body), (200, {"host": HOST, "deleted": False}))
        self.assertTrue(os.path.exists(self.box.env_path(HOST)))

    @inlineCallbacks
    def test_local_rows_are_refused(self) -> Any:
        self.box.add(HOST, hibernate=False)
        self.box.add("svc.chat.example.com", kind="service")
        for host in (HOST, "svc.chat.example.com"):
            yield self.assertRefused(
                request_bytes("DELETE", f"/api/mesh/route/{host}"), 409, "a peer may not change"
            )
        self.assertIsNotNone(self.box.registry.get(HOST))
        self.assertTrue(os.path.exists(self.box.env_path(HOST)))

    @inlineCallbacks
    def test_out_of_scope_row_is_refused(self) -> Any:
        self.box.add("x.elsewhere.org")  # a local hibernating space outside the mesh
        yield self.assertRefused(
            request_bytes("DELETE", "/api/mesh/route/x.elsewhere.org"), 400, "scope"
        )
        self.assertIsNotNone(self.box.registry.get("x.elsewhere.org"))

    @inlineCallbacks
    def test_bad_host_and_token(self) -> Any:
        yield self.push(payload())
        for path in ["/api/mesh/route/..", "/api/mesh/route/a%2f.chat.example.com"]:
            yield self.assertRefused(request_bytes("DELETE", path), 400, "host")
        yield self.assertRefused(
            request_bytes("DELETE", f"/api/mesh/route/{HOST}", token="bad"), 401
        )
        self.assertIsNotNone(self.box.registry.get(HOST))


# --- GET ----------------------------------------------------------------------------------------


class ListTests(APITestCase):
    @inlineCallbacks
    def test_lists_in_scope_hibernating_rows_with_env(self) -> Any:
        yield self.push(payload())
        yield self.push(payload(host="r.deep.chat.example.com", home_region="ie", env={}))
        self.box.add("local.chat.example.com", home_region="fi")  # a local hibernating one
        self.box.add("live.chat.example.com", hibernate=False)
        self.box.add("svc.chat.example.com", kind="service")
        self.box.add("out.elsewhere.org")  # hibernating, out of scope
        self.box.add("fi.elsewhere.org", home_region="fi")  # another region's
        self.box.registry.insert(
            Route(
                host="noenv.chat.example.com",
                kind="instance",
                socket="/run/x.sock",
                hibernate=True,
                status="ready",
            )
        )
        listed = calls("list", "listed")
        before = self.box.changes()
        routes = yield Deferred.fromCoroutine(client.list_routes(self.url, TOKEN, reactor=reactor))
        self.assertEqual(
            routes,
            [
                payload(),
                {
                    "host": "local.chat.example.com",
                    "kind": "instance",
                    "version": "",
                    "hibernate": True,
                    "replication": "stream",
                    "home_region": "fi",
                    "env": {"LCHAT_ADMIN_TOKEN": "tok-local.chat.example.com"},
                },
                {
                    **payload(host="noenv.chat.example.com", version="", replication="stream"),
                    "env": {},
                },
                payload(host="r.deep.chat.example.com", home_region="ie", env={}),
            ],
        )
        # Every entry is a payload the API itself accepts.
        for route in routes:
            route_payload.parse_payload(route)
        self.assertEqual(self.box.changes(), before)
        self.assertEqual(
            self.served.reloads,
            [f"mesh route created: {HOST}", "mesh route created: r.deep.chat.example.com"],
        )
        self.assertEqual(calls("list", "listed"), listed + 1)

    @inlineCallbacks
    def test_needs_the_token(self) -> Any:
        yield self.assertRefused(request_bytes("GET", "/api/mesh/routes", token="x"), 401)
        with self.assertRaises(client.MeshCallError):
            yield Deferred.fromCoroutine(client.list_routes(self.url, "x", reactor=reactor))


# --- the client ---------------------------------------------------------------------------------


class _Silent(Protocol):
    """Accepts a connection and never answers."""


class ClientTests(TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="mc", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.box = Box(self.root, "box-1")

    def tls_site(self, ca: TestCA, name: str) -> int:
        key, cert = ca.issue(name)
        from cryptography.hazmat.primitives import serialization

        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ) + cert.public_bytes(serialization.Encoding.PEM)
        options = ssl.PrivateCertificate.loadPEM(pem).options()
        site = api.mesh_site(
            self.box.registry,
            self.box.cfg(),
            lambda reason: None,
            run_in_thread=thread_runner(reactor),
        )
        port = reactor.listenSSL(0, site, options, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)

    @inlineCallbacks
    def test_https_verified_against_the_ca_file(self) -> Any:
        ca = TestCA()
        ca_file = os.path.join(self.root, "ca.pem")
        with open(ca_file, "wb") as f:
            f.write(ca.pem)
        port = self.tls_site(ca, "localhost")
        url = f"https://localhost:{port}"
        answer = yield Deferred.fromCoroutine(
            client.push_route(url, TOKEN, payload(), ca_file=ca_file, reactor=reactor)
        )
        self.assertEqual(answer["result"], "created")
        # Without the CA the certificate is not trusted: there is no way around verification.
        with self.assertRaises(client.MeshCallError) as caught:
            yield Deferred.fromCoroutine(client.list_routes(url, TOKEN, reactor=reactor))
        self.assertIn("certificate", str(caught.exception).lower())
        # A certificate for another name is refused even with the CA trusted.
        other = self.tls_site(ca, "other.example.net")
        with self.assertRaises(client.MeshCallError):
            yield Deferred.fromCoroutine(
                client.list_routes(
                    f"https://localhost:{other}", TOKEN, ca_file=ca_file, reactor=reactor
                )
            )

    @inlineCallbacks
    def test_timeout_is_bounded(self) -> Any:
        port = reactor.listenTCP(0, Factory.forProtocol(_Silent), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        started = time.monotonic()
        with self.assertRaises(client.MeshCallError) as caught:
            yield Deferred.fromCoroutine(
                client.push_route(
                    f"http://127.0.0.1:{port.getHost().port}",
                    TOKEN,
                    payload(),
                    timeout=0.5,
                    reactor=reactor,
                )
            )
        self.assertLess(time.monotonic() - started, 3.0)
        self.assertIn("no answer within 0.5s", str(caught.exception))

    @inlineCallbacks
    def test_unreachable_and_bad_urls(self) -> Any:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        with self.assertRaises(client.MeshCallError):
            yield Deferred.fromCoroutine(
                client.delete_route(f"http://127.0.0.1:{free}", TOKEN, HOST, reactor=reactor)
            )
        for url in ["ftp://x.example.net", "https://x.example.net/path", "http://"]:
            with self.assertRaises(client.MeshCallError):
                yield Deferred.fromCoroutine(client.list_routes(url, TOKEN, reactor=reactor))

    def test_route_payload_is_narrow(self) -> None:
        route = Route(
            host=HOST,
            kind="instance",
            socket="/run/lchat/secret.sock",
            db_path="/data/secret.db",
            hibernate=True,
            version="1",
            replication="daily",
            home_region="fi",
            next_due=99,
            settings_gen=1_700_000_000_123,
            settings_hash="f" * 64,
            region_gen=1_600_000_000_000,
        )
        body = client.route_payload(
            route,
            {"LCHAT_ADMIN_TOKEN": "t", "LCHAT_SOCKET": "/x", "LCHAT_DB": "/y", "PATH": "/bin"},
        )
        self.assertEqual(
            body,
            {
                "host": HOST,
                "kind": "instance",
                "version": "1",
                "hibernate": True,
                "replication": "daily",
                "home_region": "fi",
                "env": {"LCHAT_ADMIN_TOKEN": "t"},
                "next_due": 99,  # the due time travels (issue 17: due wakes follow the owner)
                "gen": 1_700_000_000_123,  # the settings generation (issue 32), never the hash
                "region_gen": 1_600_000_000_000,  # its home region's own (sent with gen)
            },
        )
        self.assertNotIn("secret", json.dumps(body))
        # Every field but lives_at, which only the lives-elsewhere shape carries, and bot_env,
        # which only a space with a bot sidecar does.
        self.assertEqual(
            tuple(body), tuple(f for f in client.PAYLOAD_FIELDS if f not in ("lives_at", "bot_env"))
        )


class RegistryHelperTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="mr", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.box = Box(self.root, "box-1")
        self.registry = self.box.registry

    def replicated(self, **changes: Any) -> Route:
        fields: dict[str, Any] = {
            "host": HOST,
            "kind": "instance",
            "socket": hosts.socket_path(self.box.run, HOST),
            "status": "ready",
            "hibernate": True,
        }
        fields.update(changes)
        return Route(**fields)

    def test_upsert_inserts_then_updates_only_replicated_fields(self) -> None:
        row, created = self.registry.upsert_replicated(self.replicated(version="1"))
        self.assertTrue(created)
        self.assertEqual(self.registry.get(HOST), row)
        self.registry.update(HOST, next_due=77, status="failed", last_error="x")
        before = self.box.changes()
        row, created = self.registry.upsert_replicated(
            self.replicated(version="2", socket="/elsewhere.sock", replication="daily")
        )
        self.assertFalse(created)
        stored = self.registry.get(HOST)
        assert stored is not None
        self.assertEqual(row, stored)
        self.assertEqual(
            (stored.version, stored.replication, stored.socket, stored.next_due, stored.status),
            ("2", "daily", hosts.socket_path(self.box.run, HOST), 77, "failed"),
        )
        self.assertEqual(self.box.changes(), before + 1)
        # The same values again: no write at all (the router's poll sees no change).
        self.registry.upsert_replicated(self.replicated(version="2", replication="daily"))
        self.assertEqual(self.box.changes(), before + 1)

    def test_conflicts_and_refusals(self) -> None:
        self.box.add(HOST, hibernate=False)
        self.box.add("svc.chat.example.com", kind="service")
        for host in (HOST, "svc.chat.example.com"):
            with self.assertRaises(Conflict):
                self.registry.upsert_replicated(self.replicated(host=host))
            with self.assertRaises(Conflict):
                self.registry.delete_replicated(host)
            self.assertIsNotNone(self.registry.get(host))
        with self.assertRaises(RegistryError):
            self.registry.upsert_replicated(
                self.replicated(host="b.chat.example.com", hibernate=False)
            )
        self.assertIsNone(self.registry.get("b.chat.example.com"))

    def test_delete_replicated(self) -> None:
        self.registry.upsert_replicated(self.replicated())
        deleted = self.registry.delete_replicated(HOST)
        assert deleted is not None
        self.assertEqual(deleted.host, HOST)
        self.assertIsNone(self.registry.get(HOST))
        self.assertIsNone(self.registry.delete_replicated(HOST))


class EnvLineTests(SynchronousTestCase):
    @given(st.text(max_size=60))
    def test_written_values_read_back_exactly(self, value: str) -> None:
        try:
            line = envfile.env_line("LCHAT_V", value)
        except ValueError:
            self.assertTrue(
                any(envfile._breaks_line(c) for c in value) or ("'" in value and '"' in value)
            )
            return
        directory = tempfile.mkdtemp(prefix="el", dir="/tmp")
        try:
            path = os.path.join(directory, "x.env")
            envfile.write_env(path, {"LCHAT_V": value})
            self.assertEqual(config.read_env_file(path), {"LCHAT_V": value}, line)
            self.assertEqual(mode(path), 0o600)
        finally:
            shutil.rmtree(directory)


# --- the CLI: mesh-seed, --prune, fan-out, lchat mesh -------------------------------------------


def lchat_process(box: Box, *argv: str) -> Deferred[subprocess.CompletedProcess[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env["PYTHONPATH"] = ROOT
    return deferToThread(
        subprocess.run,
        [sys.executable, "-m", "lchat.cli", *argv, "--env-file", box.env_file],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def beat(box: Box, url: str, region: str = "") -> None:
    """Write ``url``'s heartbeat into the shared file bucket, as its router would."""
    hib = box.cfg().hibernate
    assert hib is not None
    bucket = FileBucket(hib.bucket[len("file:") :], create=True)
    body = Heartbeat(url=normalise_member_url(url), region=region, version="t", started_at=1.0)
    mesh = box.cfg().mesh
    assert mesh is not None
    # MACed with the mesh token, as a member's router does (an unsigned body is no member).
    bucket.put(member_key(hib, url), HeartbeatKeys.of(mesh.token).sign(body).to_json())


class CliTestCase(TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="ms", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        # The source box (where the CLI runs) and the peer (served here).
        self.a = Box(self.root, "box-a")
        self.b = Box(self.root, "box-b", LCHAT_MESH_REGION="fi")
        # The source is a member the peer knows (its heartbeat authenticated): its
        # lives-elsewhere rows may name it.
        source = normalise_member_url(self.a.settings["LCHAT_MESH_SELF"])
        self.peer = Served(self, self.b, members=lambda url: url == source)
        self.b.write_env(LCHAT_MESH_SELF=self.peer.url)
        os.makedirs(os.path.join(self.root, "bucket"))  # the routers would have made it

    def lchat(self, *argv: str) -> Deferred[subprocess.CompletedProcess[str]]:
        return lchat_process(self.a, *argv)


class SeedTests(CliTestCase):
    @inlineCallbacks
    def test_seed_pushes_in_scope_hibernating_routes(self) -> Any:
        self.a.add("h1.chat.example.com", version="7", replication="daily")
        self.a.add("h2.chat.example.com", home_region="fi")
        self.a.add("out.elsewhere.org")
        self.a.add("live.chat.example.com", hibernate=False)
        self.a.add("svc.chat.example.com", kind="service")
        done = yield self.lchat("mesh-seed", self.peer.url)
        self.assertEqual(done.returncode, 0, done)
        self.assertIn("2 route(s) in scope", done.stdout)
        self.assertIn("2 created", done.stdout)
        hosts_b = sorted(r.host for r in self.b.registry.load())
        self.assertEqual(hosts_b, ["h1.chat.example.com", "h2.chat.example.com"])
        h1 = self.b.registry.get("h1.chat.example.com")
        assert h1 is not None
        self.assertEqual((h1.version, h1.replication, h1.hibernate), ("7", "daily", True))
        self.assertEqual(h1.socket, hosts.socket_path(self.b.run, "h1.chat.example.com"))
        # Exactly the replicable values: the operator's OTHER line stays on the source box.
        self.assertEqual(
            config.read_env_file(self.b.env_path("h1.chat.example.com")),
            {"LCHAT_ADMIN_TOKEN": "tok-h1.chat.example.com"},
        )
        again = yield self.lchat("mesh-seed", self.peer.url)
        self.assertEqual(again.returncode, 0, again)
        self.assertIn("2 updated", again.stdout)

    @inlineCallbacks
    def test_region_adds_the_routes_homed_there(self) -> Any:
        self.a.add("h1.chat.example.com")
        self.a.add("x.deep.chat.example.com", home_region="fi")
        done = yield self.lchat("mesh-seed", self.peer.url)
        self.assertEqual(done.returncode, 0, done)
        self.assertIsNone(self.b.registry.get("x.deep.chat.example.com"))
        done = yield self.lchat("mesh-seed", "--region", "fi", self.peer.url)
        self.assertEqual(done.returncode, 0, done)
        self.assertIn("home region fi", done.stdout)
        self.assertIsNotNone(self.b.registry.get("x.deep.chat.example.com"))

    @inlineCallbacks
    def test_prune_tombstones_rows_the_source_no_longer_has(self) -> Any:
        self.a.add("keep.chat.example.com")
        yield self.lchat("mesh-seed", self.peer.url)
        # Rows on the peer: one the source deleted, one homed in the peer's region outside the
        # source's domains (not the source's to judge), one local non-hibernating space.
        self.b.add("gone.chat.example.com")
        self.b.add("fi.elsewhere.org", home_region="fi")
        self.b.add("local.chat.example.com", hibernate=False)
        write_private(hosts.db_path(self.b.data, "gone.chat.example.com"), "member data")
        done = yield self.lchat("mesh-seed", "--prune", self.peer.url)
        self.assertEqual(done.returncode, 0, done)
        self.assertIn(
            "pruned 1 row(s) this registry no longer has: gone.chat.example.com", done.stdout
        )
        remaining = sorted(r.host for r in self.b.registry.load())
        self.assertEqual(
            remaining, ["fi.elsewhere.org", "keep.chat.example.com", "local.chat.example.com"]
        )
        self.assertFalse(os.path.exists(self.b.env_path("gone.chat.example.com")))
        self.assertTrue(os.path.exists(hosts.db_path(self.b.data, "gone.chat.example.com")))

    @inlineCallbacks
    def test_prune_zero_source_guard(self) -> Any:
        # Rows, but none this box publishes in scope: out of scope (hibernating and always-on),
        # a service, and a third box's lives-elsewhere row (not this box's to publish).
        self.a.add("out.elsewhere.org")
        self.a.add("live.elsewhere.org", hibernate=False)
        self.a.add("svc.chat.example.com", kind="service")
        self.a.add("y.chat.example.com", hibernate=False, lives_at="https://box-c.example.net")
        self.b.add("x.chat.example.com")
        before = (self.b.changes(), self.b.files())
        done = yield self.lchat("mesh-seed", "--prune", self.peer.url)
        self.assertEqual(done.returncode, 1, done)
        self.assertIn("refusing to prune", done.stderr)
        self.assertIn("publishes no in-scope route", done.stderr)
        self.assertEqual((self.b.changes(), self.b.files()), before)
        self.assertEqual(self.peer.reloads, [])

    @inlineCallbacks
    def test_prune_counts_always_on_spaces_as_published(self) -> Any:
        # This box's last hibernating space went always-on, and the peer missed the flip: the
        # registry is not empty (it publishes the lives-elsewhere shape), so --prune repairs it.
        self.a.add("live.chat.example.com", hibernate=False)
        self.b.add("live.chat.example.com")  # the stale hibernating row the flip should replace
        self.b.add("gone.chat.example.com")
        done = yield self.lchat("mesh-seed", "--prune", self.peer.url)
        self.assertEqual(done.returncode, 0, done)
        self.assertIn("0 route(s) in scope", done.stdout)
        self.assertIn(
            "pruned 1 row(s) this registry no longer has: gone.chat.example.com", done.stdout
        )
        self.assertIn("flipped 1 row(s) to live here", done.stdout)
        row = self.b.registry.get("live.chat.example.com")
        assert row is not None
        self.assertEqual(
            (row.hibernate, row.lives_at),
            (False, normalise_member_url(self.a.settings["LCHAT_MESH_SELF"])),
        )
        self.assertIsNone(self.b.registry.get("gone.chat.example.com"))

    @inlineCallbacks
    def test_failures_are_reported(self) -> Any:
        self.a.add("h1.chat.example.com")
        self.a.write_env(LCHAT_MESH_TOKEN="not-the-peers-token-" + "n" * 16)
        done = yield self.lchat("mesh-seed", "--prune", self.peer.url)
        self.assertEqual(done.returncode, 1, done)
        self.assertIn("answered 401", done.stderr)
        self.assertIn("nothing was pruned", done.stderr)
        self.assertEqual(list(self.b.registry.load()), [])

    @inlineCallbacks
    def test_refusals(self) -> Any:
        done = yield self.lchat("mesh-seed", "http://box-a.example.net")
        self.assertEqual(done.returncode, 1, done)
        self.assertIn("is this box", done.stderr)
        done = yield self.lchat("mesh-seed", "https://peer.example.net/api")
        self.assertEqual(done.returncode, 1, done)
        self.assertIn("base URL", done.stderr)
        done = yield self.lchat("mesh-seed", "--region", "../x", self.peer.url)
        self.assertEqual(done.returncode, 1, done)
        self.a.write_env(LCHAT_MESH_SELF="")
        done = yield self.lchat("mesh-seed", self.peer.url)
        self.assertEqual(done.returncode, 1, done)
        self.assertIn("--env-file", done.stderr)


class FanOutTests(CliTestCase):
    @inlineCallbacks
    def test_add_instance_and_remove_replicate(self) -> Any:
        beat(self.a, self.a.settings["LCHAT_MESH_SELF"], "ie")  # ourselves: never a target
        beat(self.a, self.peer.url, "fi")
        host = "new.chat.example.com"
        done = yield self.lchat("add-instance", "--hibernate", "--replication", "batched", host)
        self.assertEqual(done.returncode, 0, done)
        self.assertIn(f"mesh: {host}: pushed to {self.peer.url}: created", done.stderr)
        token = done.stdout.split("admin token: ", 1)[1].split()[0]
        route = self.b.registry.get(host)
        assert route is not None
        self.assertEqual((route.hibernate, route.replication), (True, "batched"))
        self.assertEqual(config.read_env_file(self.b.env_path(host)), {"LCHAT_ADMIN_TOKEN": token})
        self.assertEqual(mode(self.b.env_path(host)), 0o600)
        self.assertEqual(len(self.peer.reloads), 1)

        done = yield self.lchat("remove", host)
        self.assertEqual(done.returncode, 0, done)
        self.assertIn(f"mesh: {host}: tombstoned to {self.peer.url}: deleted", done.stderr)
        self.assertIsNone(self.b.registry.get(host))
        self.assertFalse(os.path.exists(self.b.env_path(host)))
        # The source keeps its files, as remove always does.
        self.assertTrue(os.path.exists(self.a.env_path(host)))

    @inlineCallbacks
    def test_dead_and_silent_peers_never_fail_or_block_the_create(self) -> Any:
        silent = reactor.listenTCP(0, Factory.forProtocol(_Silent), interface="127.0.0.1")
        self.addCleanup(silent.stopListening)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            refused = s.getsockname()[1]
        beat(self.a, f"http://127.0.0.1:{silent.getHost().port}")
        beat(self.a, f"http://127.0.0.1:{refused}")
        beat(self.a, self.peer.url)
        host = "new.chat.example.com"
        started = time.monotonic()
        done = yield self.lchat("add-instance", "--hibernate", host)
        elapsed = time.monotonic() - started
        self.assertEqual(done.returncode, 0, done)
        self.assertLess(elapsed, mesh_cli.FANOUT_BUDGET + 10)  # the budget plus process start
        self.assertIsNotNone(self.a.registry.get(host))
        self.assertIn(f"pushed to {self.peer.url}: created", done.stderr)
        self.assertIn("no answer within", done.stderr)
        self.assertIn("2 peer(s) missed new.chat.example.com", done.stderr)
        self.assertIn("catch up with `lchat mesh-seed`", done.stderr)
        # The live peer got it in time all the same.
        self.assertIsNotNone(self.b.registry.get(host))

    @inlineCallbacks
    def test_no_mesh_or_not_hibernating_means_no_fan_out(self) -> Any:
        beat(self.a, self.peer.url)
        done = yield self.lchat("add-instance", "--no-wait", "plain.chat.example.com")
        self.assertEqual(done.returncode, 0, done)
        self.assertNotIn("mesh:", done.stderr)
        done = yield self.lchat("add-instance", "--hibernate", "x.elsewhere.org")
        self.assertEqual(done.returncode, 0, done)
        self.assertNotIn("mesh:", done.stderr)  # not a mesh host: it lives here alone
        self.a.write_env(LCHAT_MESH_SELF="")
        done = yield self.lchat("add-instance", "--hibernate", "quiet.chat.example.com")
        self.assertEqual(done.returncode, 0, done)
        self.assertNotIn("mesh:", done.stderr)
        self.assertEqual(list(self.b.registry.load()), [])

    @inlineCallbacks
    def test_no_live_peer(self) -> Any:
        done = yield self.lchat("add-instance", "--hibernate", "new.chat.example.com")
        self.assertEqual(done.returncode, 0, done)
        self.assertIn("no live peer to replicate to", done.stderr)


def member(url: str, region: str = "", me: bool = False) -> Member:
    return Member(
        url=url,
        region=region,
        version="t",
        started_at=0.0,
        last_modified=NOW,
        age=1.0,
        key="k",
        is_self=me,
    )


class TargetTests(SynchronousTestCase):
    def test_domain_and_region_union(self) -> None:
        root = tempfile.mkdtemp(prefix="mt", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        mesh = Box(root, "box-a").cfg().mesh
        assert mesh is not None
        members = [
            member("http://box-a.example.net", "ie", me=True),
            member("http://box-b.example.net", "ie"),
            member("http://box-c.example.net", "fi"),
        ]
        urls = lambda targets: [m.url for m in targets]  # noqa: E731
        self.assertEqual(
            urls(client.fan_out_targets(mesh, HOST, "", members)),
            ["http://box-b.example.net", "http://box-c.example.net"],
        )
        self.assertEqual(
            urls(client.fan_out_targets(mesh, "x.elsewhere.org", "fi", members)),
            ["http://box-c.example.net"],
        )
        self.assertEqual(client.fan_out_targets(mesh, "x.elsewhere.org", "", members), [])
        self.assertEqual(client.fan_out_targets(mesh, "x.elsewhere.org", "ie", members[:1]), [])


class MeshListingTests(CliTestCase):
    @inlineCallbacks
    def test_members_and_what_they_own(self) -> Any:
        self.a.write_env(LCHAT_MESH_HEARTBEAT="2s", LCHAT_MESH_DEAD_AFTER="5s")
        beat(self.a, "http://gone.example.net", "ie")
        yield deferLater(reactor, 5.5, lambda: None)
        me = self.a.settings["LCHAT_MESH_SELF"]
        beat(self.a, me, "ie")
        beat(self.a, self.peer.url, "fi")
        for i in range(12):
            self.a.add(f"s{i}.chat.example.com", home_region="fi" if i < 3 else "")
        self.a.add("out.elsewhere.org")
        done = yield self.lchat("mesh")
        self.assertEqual(done.returncode, 0, done)
        lines = done.stdout.splitlines()
        self.assertEqual(
            lines[0].split(), ["MEMBER", "REGION", "AGE", "STATE", "VERSION", "SPACES"]
        )
        live = [member(me, "ie"), member(self.peer.url, "fi")]
        expected: dict[str, int] = {me: 0, self.peer.url: 0}
        for i in range(12):
            best = owner(f"s{i}.chat.example.com", live, "fi" if i < 3 else "")
            assert best is not None
            expected[best.url] += 1
        rows = {line.split()[0]: line.split() for line in lines[1:]}
        self.assertEqual(rows["http://gone.example.net"][3:5], ["dead", "t"])
        self.assertEqual(rows[me][-1], str(expected[me]))
        self.assertIn("(this box)", done.stdout)
        self.assertEqual(
            rows[self.peer.url][1:],
            ["fi", rows[self.peer.url][2], "live", "t", str(expected[self.peer.url])],
        )
        self.assertEqual(sum(expected.values()), 12)

    @inlineCallbacks
    def test_mesh_off(self) -> Any:
        self.a.write_env(LCHAT_MESH_SELF="")
        done = yield self.lchat("mesh")
        self.assertEqual(done.returncode, 1, done)
        self.assertIn("LCHAT_MESH_SELF", done.stderr)
