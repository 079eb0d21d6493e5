"""``lchat.units.BuiltinUnits``: which always-on spaces the router's supervisor runs.

The desired set is computed on the reactor (rows, the activator's claims) and built in a thread
(each row's env file): here the "thread" is a Deferred the test fires, in whatever order it likes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.trial.unittest import SynchronousTestCase

from lchat import config, envfile, hosts
from lchat.child import ChildSpec
from lchat.registry import Registry, Route
from lchat.routesource import RouteSource
from lchat.supervise import Supervisor
from lchat.units import BuiltinUnits, Claims

T = TypeVar("T")
HOST = "f.example.com"


class RecordingSupervisor(Supervisor):
    """A real supervisor that records each desired set instead of spawning anything."""

    def __init__(self, reactor: IReactorTime) -> None:
        super().__init__(reactor)
        self.wanted: list[list[str]] = []

    def want(self, specs: Mapping[str, ChildSpec]) -> None:
        self.wanted.append(sorted(specs))


class DesiredSetTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = tempfile.mkdtemp(prefix="units", dir="/tmp")  # short: socket paths
        self.addCleanup(shutil.rmtree, root, True)
        data = os.path.join(root, "data")
        os.makedirs(data)
        env_file = os.path.join(root, "router.env")
        with open(env_file, "w") as f:
            f.write(f"LCHAT_DATA_DIR={data}\nLCHAT_RUN_DIR={os.path.join(root, 'run')}\n")
        self.cfg = config.load(env_file=env_file, environ={})
        envfile.write_token(hosts.env_path(data, HOST), "t" * 32)
        self.clock = task.Clock()
        self.registry = Registry(os.path.join(data, "registry.db"), time.time)
        self.registry.migrate()
        self.registry.insert(
            Route(
                host=HOST,
                kind="instance",
                socket=hosts.socket_path(self.cfg.run_dir, HOST),
                db_path=hosts.db_path(data, HOST),
                status="ready",
            )
        )
        self.threads: list[tuple[Deferred[Any], Callable[[], Any]]] = []
        self.routes = RouteSource(
            self.clock,
            self.registry,
            self.registry.load(),
            run_in_thread=self.in_thread,
            poll_interval=3600,
        )
        self.claims = Claims()
        self.supervisor = RecordingSupervisor(self.clock)
        self.units = BuiltinUnits(
            self.clock, self.cfg, self.routes, self.claims, self.in_thread, self.supervisor
        )

    def in_thread(self, f: Callable[[], T]) -> Deferred[T]:
        d: Deferred[T] = Deferred()
        self.threads.append((d, f))
        return d

    def finish(self, index: int) -> None:
        d, f = self.threads.pop(index)
        d.callback(f())

    def test_the_newest_desired_set_wins_whatever_order_the_threads_finish(self) -> None:
        """A wake holds the space (claimed) when the table changes; its release follows at once.
        The set built for the claimed moment finishing last must not stop the space."""
        self.claims.claim(HOST)
        self.units.startService()  # builds the set without HOST (claimed)
        self.claims.release(HOST)  # builds the set with it
        self.assertEqual(len(self.threads), 2)
        self.finish(1)  # the newer set first...
        self.finish(0)  # ...then the older one
        self.assertEqual(self.supervisor.wanted, [[HOST]])

    def test_in_order_both_are_applied_the_newest_last(self) -> None:
        self.claims.claim(HOST)
        self.units.startService()
        self.claims.release(HOST)
        self.finish(0)  # the older set, superseded before it finished: not applied
        self.finish(0)
        self.assertEqual(self.supervisor.wanted, [[HOST]])

    def test_a_lone_change_is_applied(self) -> None:
        self.units.startService()
        self.finish(0)
        self.assertEqual(self.supervisor.wanted, [[HOST]])
        self.claims.claim(HOST)  # (a claim alone applies nothing; its release does)
        self.claims.release(HOST)
        self.finish(0)
        self.assertEqual(self.supervisor.wanted, [[HOST], [HOST]])


class ClaimsTests(SynchronousTestCase):
    def test_a_hand_over_waits_for_every_party_that_may_run_the_database(self) -> None:
        claims = Claims()
        self.successResultOf(claims.hand_over("a.example", "/data/a.db"))  # nobody: at once
        first: Deferred[None] = Deferred()
        second: Deferred[None] = Deferred()
        asked: list[tuple[str, str]] = []

        def party(let_go: Deferred[None]) -> Callable[[str, str], Deferred[None]]:
            def release(host: str, db: str) -> Deferred[None]:
                asked.append((host, db))
                return let_go

            return release

        claims.on_hand_over(party(first))
        claims.on_hand_over(party(second))
        d = claims.hand_over("a.example", "/data/a.db")
        self.assertEqual(asked, [("a.example", "/data/a.db")] * 2)
        first.callback(None)
        self.assertNoResult(d)
        second.callback(None)
        self.assertIsNone(self.successResultOf(d))
