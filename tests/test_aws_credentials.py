"""lchat.objstore.aws.resolve_credentials: botocore's chain, resolved once, over a given environment.

Each source is real: static keys, a shared credentials file and profile, and a container role
served by an HTTP endpoint on loopback (the way ECS hands them out); the credentials found are then
used against moto's server (tests/s3servers.py), so "resolved" means "signs requests S3 accepts".
The instance metadata service is switched off (``AWS_EC2_METADATA_DISABLED``) except where a test
is about it, so that no test waits on 169.254.169.254.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from collections.abc import Iterator

from botocore.credentials import RefreshableCredentials  # type: ignore[import-untyped]
from twisted.internet.endpoints import serverFromString
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from lchat.objstore import UTC, open_store
from lchat.objstore.aws import (
    NoCredentials,
    ResolvedCredentials,
    box_credentials,
    resolve_credentials,
)
from lchat.objstore.s3 import S3Store
from lchat.objstore.where import Where
from lchat.reactors import installed
from lchat.threads import thread_runner
from tests import s3servers

reactor = installed()

# Nothing from this machine: no shared files, no instance metadata service.
ISOLATED = {
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
    "AWS_CONFIG_FILE": "/nonexistent/config",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class _ContainerAgent(Resource):
    """The ECS container credentials endpoint: each GET hands out the keys, expiring in
    ``expires_in``; ``calls`` lists the Authorization header of each request."""

    isLeaf = True

    def __init__(self, access_key: str, secret_key: str, expires_in: datetime.timedelta) -> None:
        super().__init__()
        self.access_key, self.secret_key = access_key, secret_key
        self.expires_in = expires_in
        self.calls: list[bytes | None] = []

    def render_GET(self, request: Request) -> bytes:
        self.calls.append(request.getHeader(b"authorization"))
        request.setHeader(b"connection", b"close")  # nothing left open when the test ends
        expires = datetime.datetime.now(UTC) + self.expires_in
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {
                "AccessKeyId": self.access_key,
                "SecretAccessKey": self.secret_key,
                "Token": "",
                "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        ).encode()


class ResolveCredentialsTests(TestCase):
    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]  # trial waits for it
        self.server = await s3servers.shared_server("moto")
        self.bucket = await self.server.new_bucket()

    async def resolve(self, env: dict[str, str]) -> ResolvedCredentials:
        """In a thread, as its docstring asks (here the reactor also serves the container agent)."""
        resolved: ResolvedCredentials = await deferToThread(resolve_credentials, env)
        return resolved

    async def round_trip(self, resolved: ResolvedCredentials, region: str = "") -> S3Store:
        """The credentials sign a PUT and a GET the server accepts."""
        where = Where(self.bucket, s3_region=region, endpoint=self.server.endpoint)
        store = open_store(
            reactor, where, thread_runner(reactor), resolved, monotonic=time.monotonic
        )
        assert isinstance(store, S3Store)
        self.addCleanup(store.close)
        await store.put("chain", b"resolved")
        self.assertEqual((await store.get("chain")).body, b"resolved")
        return store

    async def test_keys_and_region_from_the_given_environment_not_the_process(self) -> None:
        keys = self.server.credentials
        env = {
            **ISOLATED,
            "AWS_ACCESS_KEY_ID": keys.access_key,
            "AWS_SECRET_ACCESS_KEY": keys.secret_key,
            "AWS_DEFAULT_REGION": "eu-central-1",
        }
        with _process_env(AWS_ACCESS_KEY_ID="AKIDPROCESSONLY", AWS_DEFAULT_REGION=None):
            resolved = await self.resolve(env)
        self.assertEqual(resolved.credentials.access_key, keys.access_key)
        self.assertEqual(resolved.credentials.method, "env")
        self.assertEqual(resolved.region, "eu-central-1")
        store = await self.round_trip(resolved)
        self.assertEqual(
            store.signer.region, "eu-central-1"
        )  # no LCHAT_HIBERNATE_REGION: the chain's

    async def test_the_process_environment_is_not_read_behind_our_back(self) -> None:
        process = {"AWS_ACCESS_KEY_ID": "AKIDPROCESS", "AWS_SECRET_ACCESS_KEY": "process-secret"}
        with _process_env(**process):
            with self.assertRaises(NoCredentials):
                await self.resolve(dict(ISOLATED))

    async def test_a_profile_in_a_shared_credentials_file(self) -> None:
        keys = self.server.credentials
        path = _write(
            self.mktemp(),
            f"[default]\naws_access_key_id = AKIDWRONG\naws_secret_access_key = wrong\n\n"
            f"[lchat]\naws_access_key_id = {keys.access_key}\n"
            f"aws_secret_access_key = {keys.secret_key}\n",
        )
        env = {**ISOLATED, "AWS_SHARED_CREDENTIALS_FILE": path, "AWS_PROFILE": "lchat"}
        resolved = await self.resolve(env)
        self.assertEqual(resolved.credentials.method, "shared-credentials-file")
        self.assertEqual(resolved.region, "")
        await self.round_trip(resolved, region=self.server.region)

    async def test_a_container_role_refreshes_off_the_reactor(self) -> None:
        keys = self.server.credentials
        # Expiring in 5 minutes: inside botocore's refresh window, so every use refreshes.
        agent = _ContainerAgent(keys.access_key, keys.secret_key, datetime.timedelta(minutes=5))
        port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(Site(agent))
        self.addCleanup(port.stopListening)
        env = {
            **ISOLATED,
            "AWS_CONTAINER_CREDENTIALS_FULL_URI": f"http://127.0.0.1:{port.getHost().port}/creds",
            "AWS_CONTAINER_AUTHORIZATION_TOKEN": "task-token",
        }
        resolved = await self.resolve(env)
        self.assertEqual(resolved.credentials.method, "container-role")
        self.assertIsInstance(resolved.credentials, RefreshableCredentials)
        self.assertEqual(agent.calls, [b"task-token"])  # the token came from env too
        # A refresh is a blocking HTTP call to the agent, which this reactor serves: made on the
        # reactor thread it could never be answered, so the round trip proves it ran off it.
        await self.round_trip(resolved, region=self.server.region)
        self.assertGreaterEqual(len(agent.calls), 2, "the S3 client never refreshed")
        self.assertEqual(set(agent.calls), {b"task-token"})

    async def test_nothing_found_names_every_place_it_looked(self) -> None:
        with self.assertRaises(NoCredentials) as caught:
            await self.resolve(dict(ISOLATED))
        message = str(caught.exception)
        for looked in (
            "AWS_ACCESS_KEY_ID",
            "profile 'default'",
            "/nonexistent/credentials (absent)",
            "/nonexistent/config (absent)",
            "container role",
            "disabled by AWS_EC2_METADATA_DISABLED",
        ):
            self.assertIn(looked, message)

    async def test_a_broken_source_is_named(self) -> None:
        path = _write(self.mktemp(), "[other]\naws_access_key_id = A\naws_secret_access_key = B\n")
        env = {**ISOLATED, "AWS_SHARED_CREDENTIALS_FILE": path, "AWS_PROFILE": "missing"}
        with self.assertRaises(NoCredentials) as caught:
            await self.resolve(env)
        self.assertIn("The config profile (missing) could not be found", str(caught.exception))

    async def test_half_a_key_pair_is_named(self) -> None:
        with self.assertRaises(NoCredentials) as caught:
            await self.resolve({**ISOLATED, "AWS_ACCESS_KEY_ID": "AKIDHALF"})
        self.assertIn("Partial credentials found in env", str(caught.exception))


def _write(path: str, text: str) -> str:
    path = os.path.abspath(path)
    with open(path, "w") as f:
        f.write(text)
    return path


@contextlib.contextmanager
def _process_env(**values: str | None) -> Iterator[None]:
    """This process's environment with ``values`` set (None: unset), put back afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _Box:
    """What box_credentials reads of a configuration: its env file's AWS_* values."""

    def __init__(self, **aws_env: str) -> None:
        self.aws_env = aws_env


class BoxCredentialsTests(TestCase):
    def test_the_env_file_answers_and_the_process_environment_wins(self) -> None:
        """Every bucket opener's one rule (lchat.objstore.aws.box_credentials)."""
        box = _Box(AWS_ACCESS_KEY_ID="AKIAFROMTHEFILE00000", AWS_SECRET_ACCESS_KEY="file-secret")
        unset = {n: None for n in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")}
        with _process_env(**unset):
            self.assertEqual(box_credentials(box).credentials.access_key, "AKIAFROMTHEFILE00000")
        process = {"AWS_ACCESS_KEY_ID": "AKIAFROMTHEPROCESS00", "AWS_SECRET_ACCESS_KEY": "p-secret"}
        with _process_env(**{**unset, **process}):
            resolved = box_credentials(box)
        self.assertEqual(resolved.credentials.access_key, "AKIAFROMTHEPROCESS00")
        self.assertEqual(resolved.credentials.secret_key, "p-secret")
