"""``twistd lchat-home``: the home service (docs/home.md). ``makeService`` only wires; the routes
are lchat.home.api (over HTTP: lchat.home.resource), the stores lchat.home.sqlite_store /
lchat.home.s3_store, the ceremonies lchat.home.stateless.

At start the store is opened and checked; a store that cannot be used stops the process with
status 1 and one line naming the settings (misconfiguration fails at boot, never limps). Then the
API listens on ``LCHAT_HOME_SOCKET`` (the router proxies ``home.<domain>`` there), optionally on
``LCHAT_HOME_TCP``, and ``/status`` + ``/metrics`` are served on ``LCHAT_HOME_ADMIN_SOCKET``.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from twisted.application.service import IService, MultiService
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint, UNIXServerEndpoint
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import Request

import lchat
from lchat import objstore
from lchat.admin import clear_stale_socket
from lchat.buckets import prepare
from lchat.config import ConfigError
from lchat.home import config as home_config
from lchat.home.api import HomeAPI
from lchat.home.limits import Limits
from lchat.home.passkeys import Passkeys
from lchat.home.resource import CappedRequest, HomeResource
from lchat.home.revocation import RevocationFeed, TokenCache
from lchat.home.stateless import Ceremonies, load_session_keys
from lchat.home.store import VaultStore
from lchat.objstore.aws import NoCredentials
from lchat.reactors import Reactor, TCPReactor, installed
from lchat.threads import RunInThread, thread_runner
from lchat.webutil import QuietSite

_log = Logger(namespace="lchat.home")


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Run lchat's home service: passkeys, link tokens and each user's encrypted vault, on a "
        "unix socket the router proxies home.<domain> to. Settings come from the env file, then "
        "the environment, then these flags; see docs/home.md."
    )
    optParameters = [
        [
            "env-file",
            None,
            None,
            f"Env file (default {home_config.DEFAULT_ENV_FILE}; absent is fine).",
        ],
        ["data-dir", None, None, "LCHAT_DATA_DIR (default /data): home.db lives here."],
        ["run-dir", None, None, "LCHAT_RUN_DIR (default /run/lchat): home.sock lives here."],
        [
            "socket",
            None,
            None,
            "LCHAT_HOME_SOCKET: the API's unix socket (default <run>/home.sock).",
        ],
        ["tcp", None, None, "LCHAT_HOME_TCP: also listen on HOST:PORT."],
        ["store", None, None, "LCHAT_HOME_STORE: sqlite (default) or s3."],
    ]

    def opt_version(self) -> None:
        """Print the lchat version and exit."""
        print(f"lchat-home {lchat.__version__}")
        raise SystemExit(0)


def makeService(options: Options) -> IService:
    flags = {
        "LCHAT_DATA_DIR": options["data-dir"],
        "LCHAT_RUN_DIR": options["run-dir"],
        "LCHAT_HOME_SOCKET": options["socket"],
        "LCHAT_HOME_TCP": options["tcp"],
        "LCHAT_HOME_STORE": options["store"],
    }
    try:
        cfg = home_config.load(env_file=options["env-file"], flags=flags)
        keys, warning = load_session_keys(cfg.session_key, accept=cfg.session_key_accept)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"lchat-home: {e}") from e
    return build_service(installed(), cfg, keys, warning)


def build_service(
    reactor: Reactor, cfg: home_config.HomeConfig, keys: Any, warning: str | None
) -> IService:
    """Everything, wired; nothing runs until the service starts."""
    ceremonies = Ceremonies.from_keys(keys, reactor.seconds)
    passkeys = Passkeys(rp_name=cfg.rp_name)
    return HomeService(reactor, cfg, ceremonies, passkeys, warning)


class HomeService(MultiService):
    """Opens and checks the store, then listens. Stops in reverse: listeners, then the store."""

    def __init__(
        self,
        reactor: Reactor,
        cfg: home_config.HomeConfig,
        ceremonies: Ceremonies,
        passkeys: Passkeys,
        warning: str | None,
    ) -> None:
        super().__init__()
        self._reactor = reactor
        self.cfg = cfg
        self._ceremonies = ceremonies
        self._passkeys = passkeys
        self._warning = warning
        self.store: VaultStore | None = None
        self.api: HomeAPI | None = None
        self.feed: RevocationFeed | None = None
        self._ports: list[Any] = []
        self._started_at = reactor.seconds()
        self.ready: Deferred[None] = Deferred()

    def startService(self) -> None:
        super().startService()
        if self._warning:
            _log.warn("home: {warning}", warning=self._warning)
        d = Deferred.fromCoroutine(self._start())
        d.addCallbacks(lambda _: self.ready.callback(None), self._failed)

    async def _start(self) -> None:
        cfg = self.cfg
        run = thread_runner(self._reactor)
        store = await open_store(self._reactor, cfg, run)
        self.store = store
        await store.check()
        # The feed polls at once and then every LCHAT_HOME_REVOCATION_POLL seconds; until a
        # poll succeeds the token cache does not answer (every request reads the store).
        self.feed = RevocationFeed(
            store, TokenCache(self._reactor.seconds), self._reactor, cfg.revocation_poll
        )
        self.feed.start()
        self.api = HomeAPI(
            store,
            self._ceremonies,
            self._passkeys,
            rp_id=cfg.rp_id,
            origins=cfg.origins,
            clock=self._reactor.seconds,
            feed=self.feed,
            limits=Limits.build(dict(cfg.rates), self._reactor.seconds, cfg.limit_keys),
            max_devices=cfg.max_devices,
            vault_max=cfg.vault_max,
            step_up_window=cfg.step_up_window,
        )
        site = QuietSite(HomeResource(self.api, cfg.trusted_proxies))
        site.requestFactory = CappedRequest  # a body past 64 KiB: 413 before it is buffered
        for path in (cfg.socket, cfg.admin_socket):
            # A socket left by a process that is gone is removed; one that answers is another
            # home process: refused (AlreadyRunning), never taken over.
            await run(_prepare_socket, path)
        self._ports.append(
            await UNIXServerEndpoint(self._reactor, cfg.socket, mode=0o660).listen(site)
        )
        admin = QuietSite(_Admin(self))
        self._ports.append(
            await UNIXServerEndpoint(self._reactor, cfg.admin_socket, mode=0o600).listen(admin)
        )
        if cfg.tcp is not None:
            host, port = cfg.tcp
            endpoint = (
                TCP6ServerEndpoint(self._reactor, port, interface=host)
                if ":" in host
                else TCP4ServerEndpoint(self._reactor, port, interface=host)
            )
            self._ports.append(await endpoint.listen(site))
        _log.info(
            "home: serving on {socket}{tcp} (store {store}, relying party {rp_id}, origins "
            "{origins}); admin on {admin}",
            socket=cfg.socket,
            tcp=f" and {cfg.tcp[0]}:{cfg.tcp[1]}" if cfg.tcp else "",
            store=store.describe(),
            rp_id=cfg.rp_id,
            origins=", ".join(cfg.origins),
            admin=cfg.admin_socket,
        )

    def _failed(self, failure: Failure) -> None:
        _log.critical(
            "home: cannot start: {error} (check LCHAT_HOME_STORE and its settings: "
            "LCHAT_HOME_DB, or LCHAT_HOME_S3_BUCKET/_REGION/_PREFIX/_ENDPOINT and the AWS "
            "credentials)",
            error=failure.getErrorMessage(),
        )
        if self._reactor.running:
            self._reactor.addSystemEventTrigger("after", "shutdown", os._exit, 1)
            self._reactor.stop()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        for port in self._ports:
            await port.stopListening()
        self._ports.clear()
        if self.feed is not None:
            await self.feed.stop()
        if self.store is not None:
            await self.store.close()

    def status(self) -> dict[str, Any]:
        return {
            "version": lchat.__version__,
            "uptime": round(self._reactor.seconds() - self._started_at, 3),
            "store": self.store.describe() if self.store is not None else None,
            "ready": self.api is not None,
            "rp_id": self.cfg.rp_id,
            "origins": list(self.cfg.origins),
            "session_key": "ephemeral" if self._warning else "configured",
            "revocation_poll": self.cfg.revocation_poll,
            "revocation_feed_ok": self.feed.cache.trusted if self.feed is not None else False,
            "cached_tokens": len(self.feed.cache) if self.feed is not None else 0,
            "limits": self.api.limits.describe() if self.api is not None else {},
            "max_devices": self.cfg.max_devices,
            "vault_max": self.cfg.vault_max,
            "step_up_window": self.cfg.step_up_window,
        }


def _prepare_socket(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    clear_stale_socket(path)


async def open_store(
    reactor: TCPReactor, cfg: home_config.HomeConfig, run: RunInThread
) -> VaultStore:
    """The configured store: SQLite (``LCHAT_HOME_DB``) or S3 (``LCHAT_HOME_S3_*``)."""
    if cfg.store == "sqlite":
        from lchat.home.sqlite_store import SQLiteVaultStore

        os.makedirs(os.path.dirname(cfg.db), exist_ok=True)
        return await SQLiteVaultStore.open(cfg.db, run, IReactorTime(reactor))
    from lchat.home.s3_store import S3VaultStore

    where = cfg.s3
    assert where is not None
    try:
        credentials = await run(prepare, cfg, where)
    except NoCredentials as e:
        raise ConfigError(f"LCHAT_HOME_S3_BUCKET={where.bucket}: {e}") from e
    objects = objstore.open_store(reactor, where, run, credentials, monotonic=time.monotonic)
    return S3VaultStore(objects, IReactorTime(reactor), where.prefix, random.SystemRandom())  # type: ignore[arg-type]  # (open_store gives an S3Store, which is versioned)


class _Admin(Resource):
    isLeaf = True

    def __init__(self, service: HomeService) -> None:
        super().__init__()
        self._service = service

    def render_GET(self, request: Request) -> bytes:
        if request.path == b"/metrics":
            request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode())
            return generate_latest()
        if request.path == b"/status":
            request.setHeader(b"content-type", b"application/json")
            return json.dumps(self._service.status(), sort_keys=True).encode() + b"\n"
        request.setResponseCode(404)
        return b'{"error": "not found"}\n'


__all__ = ["HomeService", "Options", "build_service", "makeService"]
