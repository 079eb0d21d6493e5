"""The posture line a mesh box logs at start: its peers as the bucket shows them, and whether each
answers on its URL (real memberships on a FileStore bucket, a real listener, the real reactor)."""

from __future__ import annotations

import os
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import TestCase

from lchat import config
from lchat.config import HibernateConfig
from lchat.mesh.membership import Membership
from lchat.mesh.posture import Posture
from lchat.objstore.file import FileStore
from lchat.threads import thread_runner

reactor: Any = _reactor
TOKEN = "t" * 32


class PostureTests(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.root = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(self.root, "bucket"))
        self.store = FileStore(reactor, os.path.join(self.root, "bucket"), thread_runner(reactor))
        self.hib = HibernateConfig(bucket="file:x", region="", prefix="p", endpoint="", idle=60)
        self.lines: list[dict[str, Any]] = []
        observer: Any = self.lines.append
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def cfg(self, url: str) -> config.BoxConfig:
        env = os.path.join(self.root, f"{len(os.listdir(self.root))}.env")
        with open(env, "w") as f:
            f.write(
                f"LCHAT_DATA_DIR={self.root}\nLCHAT_RUN_DIR={self.root}\n"
                f"LCHAT_HIBERNATE_BUCKET=file:{self.root}/bucket\nLCHAT_MESH_SELF={url}\n"
                f"LCHAT_MESH_DOMAINS=example.com\nLCHAT_MESH_TOKEN={TOKEN}\n"
                f"LCHAT_MESH_REGION=ie\nLCHAT_MESH_HEARTBEAT=200ms\nLCHAT_HTTP_REDIRECT=off\n"
            )
        return config.load(env_file=env, environ={})

    def member(self, cfg: config.BoxConfig) -> Membership:
        assert cfg.mesh is not None
        membership = Membership(reactor, self.store, self.hib, cfg.mesh)
        membership.startService()
        self.addCleanup(membership.stopService)
        return membership

    async def posture(self, cfg: config.BoxConfig, membership: Membership) -> str:
        posture = Posture(reactor, cfg, membership)
        posture.startService()
        self.addCleanup(posture.stopService)
        line: str = await posture.said
        return line

    async def test_live_peers_and_whether_they_answer(self) -> None:
        listener = reactor.listenTCP(0, Factory.forProtocol(Protocol), interface="127.0.0.1")
        self.addCleanup(listener.stopListening)
        answering = f"http://127.0.0.1:{listener.getHost().port}"
        silent = "http://127.0.0.1:9"  # discard: nothing listens there
        peers = [self.member(self.cfg(url)) for url in (answering, silent)]
        # The peers' first beats are in the bucket before this box reads it (the posture says
        # what the first read shows).
        while not all(p.beats >= 1 for p in peers):
            await deferLater(reactor, 0.02, lambda: None)
        me = self.cfg("http://127.0.0.1:1")
        line = await self.posture(me, self.member(me))
        self.assertIn(
            "mesh posture: on as http://127.0.0.1:1 (region ie), domains example.com", line
        )
        self.assertIn(f"2 peers live, 1 reachable: {answering};", line)
        self.assertIn(f"`lchat --env-file {me.env_file}` fan out to them", line)
        warned = [e for e in self.lines if "NOT reachable" in str(e.get("log_format", ""))]
        self.assertEqual(len(warned), 1)
        self.assertEqual(warned[0]["unreachable"], silent)

    async def test_alone(self) -> None:
        me = self.cfg("http://127.0.0.1:1")
        line = await self.posture(me, self.member(me))
        self.assertIn("0 peers live, 0 reachable;", line)
