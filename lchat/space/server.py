"""The reference space server's lifecycle (docs/design.md §8): listen, tick, drain; and `main`.

`SpaceServer` opens the store, listens on the unix socket and runs the scheduler; on SIGTERM it
drains in order (listener, in-flight requests, connections, database). `main` is `lchat space`.
"""

from __future__ import annotations

import argparse
import os
import socket
import stat
import sys

from attrs import define
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.endpoints import UNIXServerEndpoint
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import LoopingCall
from twisted.logger import (
    FilteringLogObserver,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web.server import Site

from lchat.reactors import Reactor, installed
from lchat.space.api import Api, Space, SpaceSite, Tracker
from lchat.space.config import ENV_HELP, Config, ConfigError
from lchat.space.store import Store
from lchat.space.ws import Hub

log = Logger(namespace="lchat.space")

TICK = 1.0  # scheduler period, seconds
DRAIN_TIMEOUT = 10.0  # in-flight requests may finish within this on SIGTERM
CLOSE_TIMEOUT = 5.0  # then connections get this long to flush and close


class Connections(WrappingFactory):
    """Tracks every connection, so the drain can close them and wait until they are gone."""

    noisy = False

    def __init__(self, wrapped: Site) -> None:
        super().__init__(wrapped)
        self.live: Tracker[ProtocolWrapper] = Tracker()

    def registerProtocol(self, p: ProtocolWrapper) -> None:
        super().registerProtocol(p)
        self.live.add(p)

    def unregisterProtocol(self, p: ProtocolWrapper) -> None:
        super().unregisterProtocol(p)
        self.live.discard(p)


@define
class SpaceServer:
    """Lifecycle: open the store, listen, tick; on shutdown, drain and close in order."""

    reactor: Reactor
    config: Config
    failed: bool = False  # starting, or closing the database, failed: exit 1
    _space: Space | None = None
    _site: SpaceSite | None = None
    _connections: Connections | None = None
    _port: IListeningPort | None = None
    _ticker: LoopingCall | None = None
    _ticking: Deferred[LoopingCall] | None = None
    _started: Deferred[None] | None = None

    def start(self) -> Deferred[None]:
        self._started = Deferred.fromCoroutine(self._start())
        return self._started

    async def _start(self) -> None:
        store = await Store.open(self.reactor, self.config.db)
        self._space = space = Space(self.reactor, store, Hub(), self.config)
        self._site = SpaceSite(Api(space), self.reactor)
        self._connections = Connections(self._site)
        # A deep accept queue: a wake releases every queued request at once.
        endpoint = UNIXServerEndpoint(self.reactor, self.config.socket, backlog=1024, mode=0o660)
        self._port = await endpoint.listen(self._connections)
        self._ticker = LoopingCall(lambda: Deferred.fromCoroutine(space.tick()))
        self._ticker.clock = self.reactor
        self._ticking = self._ticker.start(TICK, now=True)
        log.info(
            "space {host} listening on {socket}", host=self.config.host, socket=self.config.socket
        )

    async def stop(self) -> None:
        """The SIGTERM drain: refuse new work, finish what is in flight, close the DB.

        A failing step is logged and the drain goes on: the database always gets closed.
        """
        if self._started is not None:
            try:
                await self._started
            except Exception:
                log.debug("start failed (already reported); cleaning up what it left")
        log.info("space {host} draining", host=self.config.host)
        if self._space is not None:
            self._space.draining = True
        steps = [
            ("stopping the scheduler", self._stop_ticker),
            ("closing the listener", self._stop_listening),
            ("waiting for in-flight requests", self._wait_for_requests),
            ("closing connections", self._close_connections),
        ]
        for what, step in steps:
            try:
                await step()
            except Exception:
                log.failure("drain: {what} failed", what=what)
        if self._space is not None:
            try:
                await self._space.store.close()
            except Exception:
                log.failure("closing the database failed")
                self.failed = True
        log.info("space {host} stopped", host=self.config.host)

    def abandon(self) -> None:
        """After the reactor stopped: never leave the DB thread keeping the process alive."""
        if self._space is not None:
            self._space.store.abandon()

    async def _stop_ticker(self) -> None:
        if self._ticker is not None and self._ticker.running:
            self._ticker.stop()
            assert self._ticking is not None
            await self._ticking  # a tick in progress finishes its delivery and pushes

    async def _stop_listening(self) -> None:
        if self._port is None:
            return
        stopped = self._port.stopListening()  # also removes the socket file
        try:
            if stopped is not None:
                await stopped
        except FileNotFoundError:
            log.warn("socket {socket} was already removed", socket=self.config.socket)

    async def _wait_for_requests(self) -> None:
        if self._site is not None:
            await self._bounded(self._site.inflight.idle(), DRAIN_TIMEOUT, "in-flight requests")

    async def _close_connections(self) -> None:
        if self._space is not None:
            self._space.hub.close_all()
        if self._connections is not None:
            for conn in self._connections.live:
                conn.loseConnection()  # flushes responses first
            await self._bounded(self._connections.live.idle(), CLOSE_TIMEOUT, "connections")

    async def _bounded(self, idle: Deferred[None], seconds: float, what: str) -> None:
        try:
            await idle.addTimeout(seconds, self.reactor)
        except TimeoutError:
            log.warn("gave up waiting for {what} after {seconds}s", what=what, seconds=seconds)


def claim_socket(path: str) -> str | None:
    """Why we must not listen on `path`, or None (after removing a stale socket file)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return f"{path} exists and is not a socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            pass  # nobody listening: a leftover from a crash
        except OSError as e:
            return f"cannot probe {path}: {e}"
        else:
            return f"another process is already listening on {path}"
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        return f"cannot remove stale socket {path}: {e}"
    return None


def start_logging() -> None:
    # Our own events at info; Twisted's chatter (port opened/closed, factories) only from warn.
    predicate = LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)
    predicate.setLogLevelForNamespace("lchat", LogLevel.info)
    observer = FilteringLogObserver(textFileLogObserver(sys.stderr), [predicate])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)


def run(reactor: Reactor, config: Config) -> int:
    """Run the space on `reactor` until it stops (SIGTERM/SIGINT); return the exit code."""
    server = SpaceServer(reactor, config)

    def failed(failure: Failure) -> None:
        server.failed = True
        log.error(
            "space {host} failed to start: {error}",
            host=config.host,
            error=failure.getErrorMessage(),
        )
        reactor.stop()

    reactor.addSystemEventTrigger(
        "before", "shutdown", lambda: Deferred.fromCoroutine(server.stop())
    )
    reactor.callWhenRunning(lambda: server.start().addErrback(failed))
    reactor.run()
    server.abandon()
    return 1 if server.failed else 0


def parse_no_options(
    argv: list[str] | None, prog: str, description: str, env_help: str
) -> int | None:
    """The command line of a program configured only by its environment: ``--help`` (which
    lists the variables) or nothing. Returns an exit status when the program should stop."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=env_help,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return None


# What a space process never hands to its own children (they read os.environ).
SECRETS = ("LCHAT_ADMIN_TOKEN", "LCHAT_BOT_TOKEN")


def environment(environ: os._Environ[str]) -> dict[str, str]:
    """The space's settings: the environment, under its systemd credential
    (``LoadCredential=env:...``: ``$CREDENTIALS_DIRECTORY/env``, readable by this unit's user
    only) where it has one. The secrets are then taken out of ``environ``: nothing this process
    starts inherits them."""
    settings = dict(environ)
    credentials = environ.get("CREDENTIALS_DIRECTORY")
    if credentials:
        from lchat.config import ConfigError as EnvFileError
        from lchat.config import read_env_file

        path = os.path.join(credentials, "env")
        try:
            settings.update(read_env_file(path, must_exist=True))
        except EnvFileError as e:
            raise ConfigError(str(e)) from e
    for name in SECRETS:
        environ.pop(name, None)
    return settings


def main(argv: list[str] | None = None) -> int:
    stop = parse_no_options(
        argv,
        "lchat space",
        "Run the reference lchat space server (configured by environment).",
        ENV_HELP,
    )
    if stop is not None:
        return stop
    try:
        config = Config.from_env(environment(os.environ))
    except ConfigError as e:
        print(f"lchat space: {e}", file=sys.stderr)
        return 2
    problem = claim_socket(config.socket)
    if problem is not None:
        print(f"lchat space: refusing to start: {problem}", file=sys.stderr)
        return 1
    start_logging()
    return run(installed(), config)
