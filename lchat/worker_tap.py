"""``twistd lchat-worker``: one data-plane process of a box running ``LCHAT_WORKERS`` >= 2.

The control process (``twistd lchat``, lchat.workers) starts N of these through its worker pool,
each with its slot's listening sockets already bound (``SO_REUSEPORT``, one per slot and public
address) and inherited as descriptors (``--fds https=3,http=4``). A worker serves the data plane
only: its own view of the registry (:class:`~lchat.routesource.RouteSource`, read-only: control
migrated it) and of the certificate cache (:class:`~lchat.tls.CertStore`, with the box's shared
session-ticket key), an upstream pool and today's router, whose control-plane seams go to the
control process: hibernating and lives-elsewhere rows over ``<run>/workers/hop.sock``
(lchat.controlhop), the mesh API and ACME HTTP-01 to control's own ``mesh.sock`` and
``acme.sock``. Its channel site ``<run>/workers/worker-<k>.sock`` (lchat.workerchannel) answers the
pool's readiness probe, watchdog, reload and rescan pushes and metrics scrapes.

Invariants:

- it imports no control plane (mesh, ACME, backup, hibernation, the object stores' clients):
  tests/test_worker_tap.py checks ``sys.modules`` in a fresh process;
- it never outlives the control process: ``PR_SET_PDEATHSIG`` (SIGTERM, so it drains) from its
  first moment, and a once-a-second check of its parent's pid for a death the signal missed;
- it is ready (its channel site answers) only once its listeners serve: the site starts last;
- its settings are the control process's snapshot (``BoxConfig.settings``, in its environment;
  no env file is read), so a restarted worker runs what its siblings run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from prometheus_client import REGISTRY, generate_latest
from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import UNIXServerEndpoint
from twisted.internet.interfaces import IReactorCore
from twisted.internet.task import LoopingCall
from twisted.logger import FileLogObserver, ILogObserver, Logger, formatEventAsClassicLogText
from twisted.python import usage

import lchat
from lchat import config, malloc, tls, uvloop_reactor
from lchat.admin import clear_stale_socket
from lchat.config import BoxConfig, ConfigError
from lchat.controlhop import HopActivator, HopMesh
from lchat.listener import listen
from lchat.proxy.downstream import ProxyFactory
from lchat.proxy.serve import FrontListener
from lchat.proxy.state import FrontDoorState
from lchat.proxy.upstream import UpstreamPool
from lchat.reactors import Reactor, installed, whole
from lchat.registry import Registry, RegistryError, RouteTable
from lchat.router import Router
from lchat.routesource import RouteSource
from lchat.shutdown import FrontDoor, SignalReload
from lchat.threads import thread_runner
from lchat.workerchannel import WorkerLink, worker_site

_log = Logger(namespace="lchat.worker")

PR_SET_PDEATHSIG = 1  # linux/prctl.h
FD_NAMES = ("https", "http")  # the public addresses a slot may have, in the control's order
PARENT_CHECK = 1.0  # seconds between checks that the control process is still the parent


def workers_dir(cfg: BoxConfig) -> str:
    """``<run>/workers``: the control channel's sockets and the ticket key (mode 0700)."""
    return os.path.join(cfg.run_dir, "workers")


def worker_socket(cfg: BoxConfig, slot: int) -> str:
    """Slot ``slot``'s channel socket, which the control process's pool asks."""
    return os.path.join(workers_dir(cfg), f"worker-{slot}.sock")


def parse_fds(text: str) -> dict[str, int]:
    """``https=3,http=4`` -> ``{"https": 3, "http": 4}`` (names from :data:`FD_NAMES`, each once;
    descriptors 3 and up)."""
    fds: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, number = item.partition("=")
        if not sep or name not in FD_NAMES or name in fds or not number.isdigit():
            raise usage.UsageError(
                f"--fds {text!r}: expected NAME=FD[,NAME=FD] with NAME one of "
                f"{', '.join(FD_NAMES)}, each once"
            )
        if int(number) < 3:
            raise usage.UsageError(f"--fds {text!r}: {name}'s descriptor must be 3 or more")
        fds[name] = int(number)
    return fds


class Options(usage.Options):
    synopsis = "--slot K [--fds https=3,http=4]"
    longdesc = (
        "One data-plane worker of an lchat box router running LCHAT_WORKERS >= 2. The router's "
        "control process (twistd lchat) starts these itself, with their listening sockets "
        "inherited; an operator never runs one by hand. Settings come from the environment "
        "the control process gives it (no env file is read)."
    )
    optParameters = [
        ["slot", None, None, "This worker's slot, 1 to LCHAT_WORKERS.", int],
        [
            "fds",
            None,
            "",
            "Inherited listening sockets, NAME=FD[,NAME=FD] with NAME https or http.",
        ],
    ]

    def postOptions(self) -> None:
        if self["slot"] is None or self["slot"] < 1:
            raise usage.UsageError("--slot K (1 or more) is required")
        self["fds"] = parse_fds(self["fds"])
        # Before makeService imports the reactor (lchat.tap's Options explain).
        uvloop_reactor.ensure()
        malloc.tune_for_streaming()


def makeService(options: Options) -> IService:
    parent = die_with_parent()
    try:
        cfg = config.load(env_file=os.devnull)  # the control process's snapshot, in our env
    except ConfigError as e:
        raise SystemExit(f"lchat-worker: configuration error: {e}") from None
    try:
        socks = inherited_sockets(options["fds"])
        return build_worker(cfg, installed(), options["slot"], socks, parent=parent)
    except (RegistryError, ConfigError, OSError) as e:
        raise SystemExit(f"lchat-worker {options['slot']}: cannot start: {e}") from None


def die_with_parent() -> int:
    """Have the kernel SIGTERM this process when its parent, the control process, dies (a
    drain, as systemd's stop would); exit now if it is already gone (it died before the prctl:
    this process was handed to init). Returns the parent's pid, which :class:`_ParentWatch`
    keeps checking. (The control process's pid is not passed in: twistd's own daemon mode forks
    after building the service, so the builder's pid need not be the parent.)"""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = os.getppid()
    if parent == 1:
        raise SystemExit("lchat-worker: the control process is gone")
    return parent


def inherited_sockets(fds: Mapping[str, int]) -> dict[str, socket.socket]:
    """The listening sockets at ``fds`` (name -> descriptor); an error naming one that is not."""
    socks: dict[str, socket.socket] = {}
    for name, fd in fds.items():
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            raise ConfigError(f"--fds {name}={fd}: not an inherited socket ({e})") from None
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ConfigError(f"--fds {name}={fd}: the socket is not listening")
        socks[name] = sock
    return socks


def build_worker(
    cfg: BoxConfig,
    any_reactor: IReactorCore,
    slot: int,
    socks: Mapping[str, socket.socket],
    *,
    poll_interval: float = 2.0,
    parent: int | None = None,
) -> MultiService:
    """A worker's service tree: the route table, the certificates, the front door on ``socks``
    (``https``, ``http``: the slot's inherited listening sockets), and last the channel site.
    ``parent``: the control process's pid (None: not watched; a test's in-process build)."""
    reactor = whole(any_reactor)
    run = thread_runner(reactor)
    here = workers_dir(cfg)
    https = cfg.https_addr is not None
    proxies_http = cfg.http_addr is not None and not (https and cfg.http_redirect)
    wanted = {"https"} if https else set()
    wanted |= {"http"} if proxies_http else set()
    if set(socks) != wanted:
        raise ConfigError(
            f"worker {slot} was given sockets for {sorted(socks) or 'nothing'}, its settings "
            f"serve {sorted(wanted) or 'nothing'}"
        )
    registry = Registry(cfg.registry, reactor.seconds)  # (no migrate: control did, before us)
    routes = RouteSource(
        reactor, registry, registry.load(), run_in_thread=run, poll_interval=poll_interval
    )
    top = MultiService()
    routes.setServiceParent(top)
    SignalReload(reactor, routes.reload).setServiceParent(top)  # (control pushes; harmless)
    if parent is not None:
        _ParentWatch(reactor, parent).setServiceParent(top)
    store = None
    if https:
        own = (cfg.mesh.self_host,) if cfg.mesh is not None else ()
        wanted_cue = tls.CertificateWanted()
        store = tls.CertStore(
            reactor,
            cfg.acme_cache,
            tls.known_hosts(routes, own),
            run,
            wanted=wanted_cue,
            ticket_key_file=os.path.join(here, "tls-ticket.key"),
        )
        if cfg.acme is not None:
            # A first handshake for a host without a certificate asks control's issuer; held
            # here until control's rescan push brings it (or control says none is coming).
            link = WorkerLink(reactor, os.path.join(here, "control.sock"), store)
            wanted_cue.connect(link.want)
        store.load_initial()
        store.setServiceParent(top)
    pool = UpstreamPool(
        reactor,
        dial_retry=cfg.proxy.dial_retry,
        tls_context=None,  # a worker never dials a mesh peer: control's hop does
        loop=uvloop_reactor.loop_of(reactor),
        state=FrontDoorState(),
    )
    router = worker_router(cfg, routes)
    door = front_door(
        reactor, cfg, router, pool, store, https="https" in socks, http="http" in socks, socks=socks
    )
    door.setServiceParent(top)

    def reloaded(table: RouteTable) -> Mapping[str, Any]:
        return {"fingerprint": routes_version(table), "routes": len(table)}

    def reload(reason: str) -> Deferred[Mapping[str, Any]]:
        return routes.reload(reason).addCallback(reloaded)

    def rescanned(_: object) -> Mapping[str, Any]:
        return {"certificates": len(store.certificates()) if store is not None else 0}

    def rescan() -> Deferred[Mapping[str, Any]]:
        done: Deferred[Any] = store.rescan() if store is not None else succeed(None)
        return done.addCallback(rescanned)

    def status() -> dict[str, Any]:
        stats = pool.state.stats
        return {
            "slot": slot,
            "pid": os.getpid(),
            "version": lchat.__version__,
            "routes_fingerprint": routes_version(routes.table),
            "routes": len(routes.table),
            "certificates": len(store.certificates()) if store is not None else 0,
            "connections": stats.connections,
            "accepted": stats.accepted,
            "in_flight": stats.in_flight,
            "upgraded": stats.upgraded,
            "draining": not door.running,
        }

    channel = worker_socket(cfg, slot)
    clear_stale_socket(channel)  # (a killed predecessor's)
    site = worker_site(reload, rescan, status, lambda: generate_latest(REGISTRY), slot=slot)
    # Last: the pool's readiness probe answers only once the listeners above serve.
    listen(top, UNIXServerEndpoint(reactor, channel, mode=0o600), site)
    _log.info(
        "lchat worker {slot} ({version}) starting: {routes} routes, serving {socks}",
        slot=slot,
        version=lchat.__version__,
        routes=len(routes.table),
        socks=", ".join(f"{name} fd {s.fileno()}" for name, s in socks.items()) or "nothing",
    )
    return top


def front_door(
    reactor: Reactor,
    cfg: BoxConfig,
    router: Router,
    pool: UpstreamPool,
    store: tls.CertStore | None,
    *,
    https: bool,
    http: bool,
    socks: Mapping[str, socket.socket] | None = None,
) -> FrontDoor:
    """The proxy's public listeners in their front door (not yet in a tree): HTTPS when
    ``https`` (with ``store``), plain HTTP proxying when ``http``; each on its inherited socket
    in ``socks`` (a worker's slot: ``https``, ``http``) when given, else bound on cfg's address
    (the single process)."""
    socks = socks or {}
    factories: list[ProxyFactory] = []
    door = FrontDoor(reactor, pool, factories, cfg.proxy.drain_grace, metrics=REGISTRY)
    loop = uvloop_reactor.loop_of(reactor)
    if https:
        assert cfg.https_addr is not None and store is not None
        secure = ProxyFactory(reactor, router, cfg.proxy, pool=pool, secure=True, state=pool.state)
        factories.append(secure)
        FrontListener(
            loop,
            cfg.https_addr,
            secure,
            store,
            sock=socks.get("https"),
            first_contact_wait=cfg.proxy.first_contact_wait,
            handshake_timeout=cfg.proxy.header_timeout,
        ).setServiceParent(door)
    if http:
        assert cfg.http_addr is not None
        plain = ProxyFactory(reactor, router, cfg.proxy, pool=pool, state=pool.state)
        factories.append(plain)
        FrontListener(loop, cfg.http_addr, plain, sock=socks.get("http")).setServiceParent(door)
    return door


def worker_router(cfg: BoxConfig, routes: RouteSource) -> Router:
    """A worker's router: a single process's, with its control-plane seams pointed at the control
    process (the paths it listens on: lchat.tap.control_router, lchat.certificates,
    lchat.workers)."""
    hop = os.path.join(workers_dir(cfg), "hop.sock")
    hibernating = cfg.hibernate is not None
    challenge = (
        cfg.https_addr is not None
        and cfg.acme is not None
        and cfg.http_addr is not None
        and not cfg.http_redirect
    )
    return Router(
        routes,
        cfg.fallback_url,
        activator=HopActivator(hop) if hibernating else None,
        mesh=HopMesh(hop) if hibernating and cfg.mesh is not None else None,
        mesh_api=(cfg.mesh.self_host, os.path.join(cfg.run_dir, "mesh.sock"))
        if cfg.mesh is not None
        else None,
        acme_challenge=os.path.join(cfg.run_dir, "acme.sock") if challenge else None,
    )


class _ParentWatch(Service):
    """Stops the reactor (the worker drains and exits) once the control process ``parent`` is no
    longer this process's parent: the belt to ``PR_SET_PDEATHSIG``'s braces."""

    def __init__(self, reactor: Reactor, parent: int) -> None:
        self._reactor = reactor
        self._parent = parent
        self._loop = LoopingCall(self._check)
        self._loop.clock = reactor

    def startService(self) -> None:
        super().startService()
        self._loop.start(PARENT_CHECK, now=True)

    def stopService(self) -> None:
        if self._loop.running:
            self._loop.stop()
        super().stopService()

    def _check(self) -> None:
        if os.getppid() != self._parent:
            _log.warn("the control process {pid} is gone: stopping", pid=self._parent)
            self._loop.stop()
            self._reactor.stop()


def routes_version(table: RouteTable) -> int | None:
    """What tells two processes' tables of one registry apart: the registry's write counter
    (the last part of the table's fingerprint; None for a table not loaded from a file). The
    fingerprint's file stats are not comparable across processes: a process closing the last
    connection checkpoints the WAL, which changes them without a write."""
    last = table.fingerprint[-1] if table.fingerprint else None
    return last if isinstance(last, int) else None


def slot_of(argv: list[str]) -> str:
    """The ``--slot`` value on a worker's command line ("?" if none): the log observer's tag is
    made before twistd has parsed the options."""
    for i, arg in enumerate(argv):
        if arg == "--slot" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--slot="):
            return arg.split("=", 1)[1]
    return "?"


def log_observer(out: TextIO | None = None, argv: list[str] | None = None) -> ILogObserver:
    """twistd's ``--logger`` for a worker: the classic lines, their system tagged ``w<k>``
    (``[w2 lchat.proxy#info]``): the journal files the worker's lines under the control
    process's pid (they share its stdout), so the tag is what tells the workers apart."""
    tag = f"w{slot_of(sys.argv if argv is None else argv)}"
    if out is None:
        out = os.fdopen(os.dup(1), "w", buffering=1)  # twistd points sys.stdout at the log

    def format_event(event: dict[str, Any]) -> str | None:
        system = event.get("log_system")
        if system is None:
            level = event.get("log_level")
            system = f"{event.get('log_namespace', '-')}#{level.name if level else '-'}"
        return formatEventAsClassicLogText({**event, "log_system": f"{tag} {system}"})

    return FileLogObserver(out, format_event)
