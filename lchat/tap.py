"""``twistd lchat``: command-line options and the MultiService they build."""

from __future__ import annotations

import os
import re
import resource
import signal
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from attrs import frozen
from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.endpoints import UNIXServerEndpoint, serverFromString
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure

import lchat
from lchat import config, hosts, isolation, malloc, objstore, relayout, tls, uvloop_reactor
from lchat.acme.cache import CacheSync, LocalCache, SharedCache
from lchat.acme.client import AcmeAccount
from lchat.acme.dns01 import make_provider
from lchat.acme.http01 import ChallengeResponder
from lchat.acme.issuer import Issuer
from lchat.admin import AdminAPI, AlreadyRunning, Capacity, clear_stale_socket, metrics_site
from lchat.backup.service import Backup
from lchat.buckets import boot_credentials, prepare, probe_name
from lchat.config import BoxConfig, ConfigError, mesh_bucket
from lchat.hibernation.activator import Activator
from lchat.hibernation.lifecycle import Lifecycle
from lchat.hibernation.sidecars import Sidecars
from lchat.hibernation.sweeper import Sweeper
from lchat.listener import Listener
from lchat.mesh.api import mesh_site
from lchat.mesh.client import PeerBeats
from lchat.mesh.due import DuePush
from lchat.mesh.fence import BoxFence, HolderJudge
from lchat.mesh.fleet import SpacesView
from lchat.mesh.membership import Membership
from lchat.mesh.posture import Posture, say_off
from lchat.mesh.routing import MeshRouter
from lchat.objstore.aws import NoCredentials, ResolvedCredentials
from lchat.proxy import oneread
from lchat.proxy.downstream import ProxyFactory
from lchat.proxy.serve import FrontListener, FrontPort
from lchat.proxy.upstream import UpstreamPool, client_tls_context
from lchat.redirect import RedirectToHTTPS
from lchat.registry import Registry, RegistryError, Route, RouteSource
from lchat.router import Router
from lchat.spacestats import SpaceStats
from lchat.supervise import Supervisor
from lchat.threads import RunInThread, thread_runner
from lchat.units import BuiltinUnits, Claims
from lchat.webutil import QuietSite

_log = Logger(namespace="lchat.tap")

# option name -> the variable it overrides
FLAG_VARIABLES = {
    "registry": "LCHAT_REGISTRY",
    "data-dir": "LCHAT_DATA_DIR",
    "run-dir": "LCHAT_RUN_DIR",
    "http": "LCHAT_HTTP_ADDR",
    "https": "LCHAT_HTTPS_ADDR",
    "fallback-url": "LCHAT_FALLBACK_URL",
    "units": "LCHAT_UNITS",
    "space-command": "LCHAT_SPACE_COMMAND",
}


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Run the lchat box router: route each hostname in the registry to its space's unix "
        "socket, and (LCHAT_UNITS=builtin) run the spaces as children. Settings come from the "
        "env file, then the environment, then these flags; see README.md for every variable."
    )
    optParameters = [
        [
            "env-file",
            None,
            None,
            f"Router env file (default {config.DEFAULT_ENV_FILE}; absent is fine).",
        ],
        [
            "registry",
            None,
            None,
            "LCHAT_REGISTRY: the registry database (default <data>/registry.db).",
        ],
        ["data-dir", None, None, "LCHAT_DATA_DIR: space databases and env files (default /data)."],
        [
            "run-dir",
            None,
            None,
            "LCHAT_RUN_DIR: space sockets and router.sock (default /run/lchat).",
        ],
        [
            "http",
            None,
            None,
            "LCHAT_HTTP_ADDR: plain HTTP listener, HOST:PORT or endpoint (default :80).",
        ],
        ["https", None, None, "LCHAT_HTTPS_ADDR: TLS listener (default :443), or off."],
        [
            "fallback-url",
            None,
            None,
            "LCHAT_FALLBACK_URL: 302 target for unknown hosts (default: 404).",
        ],
        ["units", None, None, "LCHAT_UNITS: auto, systemd or builtin (default auto)."],
        [
            "space-command",
            None,
            None,
            "LCHAT_SPACE_COMMAND: how to run a space; {host} is filled in.",
        ],
    ]

    def opt_version(self) -> None:
        """Print the lchat version and exit."""
        print(f"lchat {lchat.__version__}")
        raise SystemExit(0)

    def postOptions(self) -> None:
        # Before makeService imports the reactor: with no --reactor, twistd would install its
        # default (epoll) the moment anything imports it. The data plane needs uvloop's.
        uvloop_reactor.ensure()
        # Large reads reuse heap memory instead of a fresh mmap each (lchat/malloc.py).
        malloc.tune_for_streaming()


def makeService(options: Options) -> IService:
    from twisted.internet import reactor

    flags = {var: options[name] for name, var in FLAG_VARIABLES.items()}
    try:
        cfg = config.load(env_file=options["env-file"], flags=flags)
    except ConfigError as e:
        raise SystemExit(f"lchat: configuration error: {e}") from None
    try:
        return build_service(cfg, reactor)
    except (RegistryError, AlreadyRunning, ConfigError, OSError) as e:
        raise SystemExit(f"lchat: cannot start: {e}") from None


def build_service(cfg: BoxConfig, reactor: Any, poll_interval: float = 2.0) -> MultiService:
    """Everything the box runs, wired feature by feature; the logic lives in the features' own
    modules. Fails loudly on anything unusable. Services stop in reverse order: the admin API,
    the front door (listeners, then idle connections), certificates, hibernation's drain, units,
    the registry.

    The one clock is ``reactor`` (``seconds()``, unix time); the one thread runner is the
    reactor's pool (:func:`lchat.threads.thread_runner`); leases, whose deadlines must not jump
    with the wall clock, are kept on ``time.monotonic``."""
    _prepare_box(cfg)
    aws = boot_credentials(cfg)
    run = thread_runner(reactor)
    registry = Registry(cfg.registry, reactor.seconds)
    registry.migrate()
    _isolate(cfg, registry)
    routes = RouteSource(
        reactor, registry, registry.load(), run_in_thread=run, poll_interval=poll_interval
    )
    top = MultiService()
    routes.setServiceParent(top)
    _SignalReload(reactor, routes).setServiceParent(top)
    claims = Claims()  # hosts the activator runs: builtin units leave them alone
    # The spaces the router runs and their backup, stopped in that order (top's children stop
    # all at once): the backup's last sync sees the spaces' last writes.
    spaces = _InOrder("spaces")
    spaces.setServiceParent(top)
    backup = None
    if cfg.backup is not None:
        backup = _backup(reactor, cfg, routes, claims, run, aws)
        backup.setServiceParent(spaces)
    units = None
    if cfg.units == "builtin":
        units = BuiltinUnits(reactor, cfg, routes, claims, run)
        units.setServiceParent(spaces)
    pool = UpstreamPool(
        reactor,
        dial_retry=cfg.proxy.dial_retry,
        tls_context=client_tls_context(cfg.mesh.ca_file) if cfg.mesh is not None else None,
        loop=uvloop_reactor.loop_of(reactor),
    )
    hibernation = None
    if cfg.hibernate is not None:
        hibernation = _hibernation(
            reactor,
            cfg,
            routes,
            pool,
            claims,
            run,
            aws,
            backup.backup if backup else None,
            always_on=_always_on(units, routes),
        )
        hibernation.setServiceParent(top)
    certs = _certificates(top, reactor, cfg, routes, hibernation, run, aws)
    fleet = _fleet_view(reactor, cfg, routes, hibernation, units, backup)
    _front_door(top, reactor, cfg, routes, pool, hibernation, certs, run, spaces=fleet)
    _admin(top, reactor, cfg, routes, units, hibernation, certs, backup)
    _log.info(
        "lchat {version} starting: {routes} routes from {registry}, units={units}, "
        "https={https}, http={http}, admin={admin}, one-read recognisers {oneread}",
        oneread=oneread.implementation(),
        version=lchat.__version__,
        routes=len(routes.table),
        registry=cfg.registry,
        units=cfg.units,
        https=cfg.https_addr or "off",
        http=(cfg.http_addr or "off")
        + (" (redirect)" if cfg.https_addr and cfg.http_addr and cfg.http_redirect else ""),
        admin=cfg.admin_socket,
    )
    return top


def listening_ports(service: IService) -> list[IListeningPort | FrontPort]:
    """Every port the service tree listens on now (tests and diagnostics)."""
    if isinstance(service, Listener | FrontListener):
        return [service.port] if service.port is not None else []
    if isinstance(service, MultiService):
        return [port for child in service for port in listening_ports(child)]
    return []


def _prepare_box(cfg: BoxConfig) -> None:
    for warning in cfg.warnings:
        _log.warn("config: {warning}", warning=warning)
    _raise_open_files_limit()
    if not os.path.isdir(cfg.data_dir):
        raise ConfigError(f"LCHAT_DATA_DIR {cfg.data_dir} does not exist")
    os.makedirs(cfg.run_dir, mode=0o755, exist_ok=True)


def _isolate(cfg: BoxConfig, registry: Registry) -> None:
    """Every space its own user where this router can (lchat/isolation.py), said at start
    either way; refuses to start where the box requires it and the router cannot. An older
    box's flat files move into the spaces' own directories first (lchat/relayout.py: what no
    space runs from; a unit's, bootstrap moves with the units stopped)."""
    try:
        decision = isolation.decide(
            cfg.isolation,
            cfg.data_dir,
            cfg.run_dir,
            commands=(cfg.space_command[0], cfg.sidecar_command[0]),
        )
    except isolation.IsolationError as e:
        raise ConfigError(str(e)) from e
    if decision.on and cfg.units == "systemd" and not hosts.isolated(cfg.data_dir):
        running = [
            r.host
            for r in registry.load()
            if r.kind == "instance" and not r.hibernate and not r.elsewhere
        ]
        if running:
            # Their units run from the flat files now; laying the box out under them would stop
            # each at its next restart (the template refuses an isolated box without a drop-in).
            decision = isolation.Decision(
                False,
                f"isolation: OFF until `lchat bootstrap` moves the {len(running)} always-on"
                " spaces' files into their own directories (it stops their units meanwhile):"
                " every space runs as the router's user and can read its files (docs/secrets.md)",
            )
    isolation.ISOLATED.set(1 if decision.on else 0)
    if not decision.on:
        isolation.clear_ambient()
        if cfg.isolation == "off":
            _log.info("isolation: off ({why})", why=decision.why)
        else:
            _log.warn("{why}", why=decision.why)
        return
    isolation.enable(cfg.data_dir, cfg.run_dir)
    relayout.relayout(cfg.data_dir, cfg.run_dir, cfg.space_uids, registry)  # logs each step
    _log.info("isolation: on: {why}", why=decision.why)


@frozen
class _MembershipParts:
    membership: Membership
    fence: BoxFence
    store: objstore.ObjectStore | None  # LCHAT_MESH_BUCKET's own store (None: the hibernation one)
    check: _BucketCheck | None  # its boot probe


def _membership(
    reactor: Any,
    cfg: BoxConfig,
    store: objstore.ObjectStore,
    run: RunInThread,
    aws: ResolvedCredentials | None,
) -> _MembershipParts:
    """The heartbeat (in LCHAT_MESH_BUCKET, else the hibernation bucket) and the fence it makes
    of this box's liveness."""
    assert cfg.mesh is not None
    beats = mesh_bucket(cfg)
    members_store = store
    mesh_store = mesh_check = None
    if cfg.mesh.bucket is not None:
        # LCHAT_MESH_BUCKET: the heartbeats have a bucket of their own (a fleet whose regions
        # keep replicas apart); probed at start like the hibernation bucket.
        try:
            credentials = prepare(cfg, beats, what="LCHAT_MESH_BUCKET", box=aws, make_dir=True)
        except NoCredentials as e:
            raise ConfigError(f"LCHAT_MESH_BUCKET={beats.bucket}: {e}") from e
        members_store = mesh_store = objstore.open_store(
            reactor, beats, run, credentials, monotonic=time.monotonic
        )
        mesh_check = _BucketCheck(
            reactor,
            mesh_store,
            beats.key(".lchat", "probe", probe_name(cfg.box_id)),
            "LCHAT_MESH",
            beats.bucket,
        )
    # Beats reach the peers over the mesh API (verified HTTPS, the mesh token): their word keeps
    # this box alive while the bucket is out of reach (lchat.mesh.witness, docs/lease.md).
    peers = PeerBeats(reactor, cfg.mesh.token, cfg.mesh.ca_file)
    membership = Membership(
        reactor, members_store, beats, cfg.mesh, monotonic=time.monotonic, peers=peers
    )
    judge = HolderJudge(members_store, beats, cfg.mesh.dead_after, witness=membership)
    fence = BoxFence(membership, judge)
    return _MembershipParts(membership, fence, mesh_store, mesh_check)


def _backup(
    reactor: Any,
    cfg: BoxConfig,
    routes: RouteSource,
    claims: Claims,
    run: RunInThread,
    aws: ResolvedCredentials | None,
) -> _BackupService:
    """The fleet backup: its bucket (probed at start) and one replicator per database."""
    conf = cfg.backup
    assert conf is not None
    store = objstore.open_store(reactor, conf.where, run, aws, monotonic=time.monotonic)
    backup = Backup(
        reactor,
        store,
        conf,
        routes,
        claims,
        registry=cfg.registry,
        data_dir=cfg.data_dir,
        run_in_thread=run,
    )
    check = _BucketCheck(reactor, store, backup.layout.probe_key(), "LCHAT_BACKUP", conf.bucket)
    return _BackupService(check, backup)


class _SayOnce(Service):
    """Says something once, at start."""

    def __init__(self, say: Callable[[], None]) -> None:
        self._say = say

    def startService(self) -> None:
        super().startService()
        self._say()


class _InOrder(MultiService):
    """Children stopped one after the other, last added first, each waited for."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.setName(name)

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        return Deferred.fromCoroutine(self._stop_each())

    async def _stop_each(self) -> None:
        for child in reversed(list(self)):
            try:
                await maybeDeferred(child.stopService)
            except Exception:
                _log.failure("{name} did not stop cleanly", name=getattr(child, "name", child))


class _BackupService(MultiService):
    """The backup bucket's probe, then the backup (which closes the bucket when it stops)."""

    def __init__(self, check: _BucketCheck, backup: Backup) -> None:
        super().__init__()
        self.setName("backup")
        self.check = check
        self.backup = backup
        check.setServiceParent(self)
        backup.setServiceParent(self)

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        # A boot probe still in flight finishes before the backup closes its bucket (bounded).
        await _probe_done(self.check, self.check._reactor)
        self.check.stopService()
        await self.backup.stopService()


def _hibernation(
    reactor: Any,
    cfg: BoxConfig,
    routes: RouteSource,
    pool: UpstreamPool,
    claims: Claims,
    run: RunInThread,
    aws: ResolvedCredentials | None,
    backup: Backup | None,
    *,
    always_on: Callable[[], int],
) -> _Hibernation:
    """The bucket, the activator, its sweeps and (with LCHAT_MESH_SELF) the mesh. With the fleet
    backup on, a wake first takes the database from it (``Backup.release``)."""
    hib = cfg.hibernate
    assert hib is not None
    store = objstore.open_store(reactor, hib.where, run, aws, monotonic=time.monotonic)
    # The mesh's membership first: on a mesh box its heartbeat fences every lease the lifecycle
    # takes (lchat.mesh.fence, docs/lease.md).
    membership_parts = _membership(reactor, cfg, store, run, aws) if cfg.mesh is not None else None
    sidecars = Sidecars(reactor, cfg, run, Supervisor(reactor, max_restart_delay=60.0))
    lifecycle = Lifecycle(
        reactor,
        cfg,
        store,
        routes,
        run,
        sidecars,
        drop_idle=pool.drop_idle,
        monotonic=time.monotonic,
        handover=backup.release if backup is not None else None,
        fence=membership_parts.fence if membership_parts is not None else None,
    )
    activator = Activator(
        reactor,
        routes,
        lifecycle,
        claims,
        resident=always_on,  # counts against LCHAT_MAX_INSTANCES, never slept
        max_instances=cfg.max_instances,
        lapsed=membership_parts.membership.lapsed if membership_parts is not None else None,
        witness=membership_parts.membership if membership_parts is not None else None,
        bucket_reachable=(
            membership_parts.membership.bucket_reachable if membership_parts is not None else None
        ),
    )
    membership = mesh = None
    due_push: DuePush | None = None
    may_wake: Callable[[Route], bool] = _anywhere
    if membership_parts is not None:
        assert cfg.mesh is not None
        membership = membership_parts.membership
        # Neither a landed heartbeat nor the peers' word covers this box any more: every space
        # stands down before peers may judge it dead.
        membership.on_not_alive(activator.box_not_alive)
        # What its beats tell the peers: a backlog that cannot ship, the hosts awake here.
        membership.report(activator.backlog, activator.awake_hosts)
        # Alive (at start, and back from a lapse): ship the local copies the bucket lacks.
        membership.on_alive(activator.recover)
        # A peer out of reach: the requests forwarded to it fail now, not when TCP gives up.
        membership.on_unreachable(lambda url: pool.abort_peer(*_address(url)))
        mesh = MeshRouter(cfg, store, membership, activator, reactor=reactor)
        may_wake = mesh.is_owner  # due wakes fire only on the owner...
        # ...so every change of a space's next_due here reaches the peers (whoever owns it then).
        due_push = DuePush(
            reactor, cfg.mesh, cfg.data_dir, routes, membership.live, run_in_thread=run
        )
        posture: Service = Posture(reactor, cfg, membership)
    else:
        posture = _SayOnce(lambda: say_off(cfg))
    sweeper = Sweeper(
        reactor,
        activator,
        routes,
        idle=hib.idle,
        sweep=hib.sweep,
        due_sweep=hib.due_sweep,
        may_wake=may_wake,
    )
    check = _BucketCheck(
        reactor,
        store,
        hib.key(".lchat", "probe", probe_name(cfg.box_id)),
        "LCHAT_HIBERNATE",
        hib.bucket,
    )
    hibernation = _Hibernation(
        reactor,
        store,
        check,
        activator,
        sweeper,
        membership,
        mesh,
        due_push,
        mesh_store=membership_parts.store if membership_parts is not None else None,
        mesh_check=membership_parts.check if membership_parts is not None else None,
    )
    hibernation.add_bucket_user(posture)  # (no bucket: stopped with them, its timer too)
    return hibernation


@frozen
class _Certificates:
    store: tls.CertStore | None = None  # the TLS listener's certificates (HTTPS on)
    issuer: Issuer | None = None  # ACME (LCHAT_ACME_DIRECTORY not off)
    responder: ChallengeResponder | None = None  # HTTP-01, on the HTTP listener
    challenge_socket: str | None = None  # the responder's socket, when HTTP proxies


def _certificates(
    top: MultiService,
    reactor: Any,
    cfg: BoxConfig,
    routes: RouteSource,
    hibernation: _Hibernation | None,
    run: RunInThread,
    aws: ResolvedCredentials | None,
) -> _Certificates:
    """The TLS certificate store, the ACME issuer and its HTTP-01 responder, and the shared
    certificate cache (LCHAT_CERT_CACHE=s3) in the hibernation bucket."""
    if cfg.https_addr is None:
        return _Certificates()
    own = (cfg.mesh.self_host,) if cfg.mesh is not None else ()
    wanted = tls.CertificateWanted()  # the store's cue to the issuer (which connects itself)
    store = tls.CertStore(reactor, cfg.acme_cache, tls.known_hosts(routes, own), run, wanted=wanted)
    shared = None
    if cfg.cert_cache == "s3":
        assert cfg.hibernate is not None and hibernation is not None  # config refuses s3 without
        shared = SharedCache(
            hibernation.store,
            cfg.cert_cache_key,
            monotonic=time.monotonic,
            prefix=cfg.hibernate.prefix,
            box_id=cfg.box_id,
            previous_key=cfg.cert_cache_previous_key,
        )
    if cfg.acme is not None or shared is not None:
        LocalCache(cfg.acme_cache).ensure_directory()
    store.load_initial()
    store.setServiceParent(top)
    issuer = responder = challenge_socket = None
    if cfg.acme is not None:
        if cfg.http_addr is not None:
            responder = ChallengeResponder(
                lookup=shared.get_challenge if shared is not None else None,
                may_lookup=tls.known_hosts(routes, own),
                pending=shared.challenge_tokens if shared is not None else None,
                clock=reactor,
            )
        issuer = _issuer(reactor, cfg, routes, store, wanted, responder, shared, own, aws)
        issuer.setName("acme")
        if hibernation is not None and shared is not None:
            hibernation.add_bucket_user(issuer)
        else:
            issuer.setServiceParent(top)
    if shared is not None:
        assert hibernation is not None
        sync = CacheSync(
            reactor,
            shared,
            LocalCache(cfg.acme_cache),
            store.certificates,
            store.rescan,
            run,
            interval=cfg.cert_cache_sync,
            directory=cfg.acme.directory if cfg.acme is not None else "",
        )
        sync.setName("cert-cache")
        hibernation.add_bucket_user(sync)
    if responder is not None and not cfg.http_redirect:
        # Plain HTTP proxies: the proxy hands challenge paths to the responder's own socket.
        challenge_socket = os.path.join(cfg.run_dir, "acme.sock")
        clear_stale_socket(challenge_socket)
        site = QuietSite(responder.site_root())
        _listen(top, UNIXServerEndpoint(reactor, challenge_socket, mode=0o600), site)
    return _Certificates(store, issuer, responder, challenge_socket)


def _front_door(
    top: MultiService,
    reactor: Any,
    cfg: BoxConfig,
    routes: RouteSource,
    pool: UpstreamPool,
    hibernation: _Hibernation | None,
    certs: _Certificates,
    run: RunInThread,
    spaces: Callable[[], Callable[[], dict[str, Any]]] | None = None,
) -> None:
    """The router and its listeners: HTTPS, plain HTTP (redirecting, or proxying), and the
    mesh's route-replication API addressed to this box's own name (with ``spaces``, the fleet
    view: ``GET /api/mesh/spaces``)."""
    mesh_api: tuple[str, str] | None = None
    if cfg.mesh is not None:
        # Reached through the proxy by requests addressed to this box's own LCHAT_MESH_SELF
        # host (the bearer token is checked inside).
        mesh_socket = os.path.join(cfg.run_dir, "mesh.sock")
        clear_stale_socket(mesh_socket)
        membership = hibernation.membership if hibernation is not None else None
        site = mesh_site(
            routes.registry,
            cfg,
            routes.reload,
            run_in_thread=run,
            spaces=spaces,
            beats=membership.receive_beat if membership is not None else None,
            members=membership.known if membership is not None else None,
            clock=reactor.seconds,
        )
        _listen(top, UNIXServerEndpoint(reactor, mesh_socket, mode=0o600), site)
        mesh_api = (cfg.mesh.self_host, mesh_socket)
    router = Router(
        routes,
        cfg.fallback_url,
        activator=hibernation.activator if hibernation is not None else None,
        mesh=hibernation.mesh if hibernation is not None else None,
        mesh_api=mesh_api,
        acme_challenge=certs.challenge_socket,
    )
    factories: list[ProxyFactory] = []
    door = _FrontDoor(reactor, pool, factories, cfg.proxy.drain_grace)
    loop = uvloop_reactor.loop_of(reactor)
    if cfg.https_addr is not None:
        assert certs.store is not None
        secure = ProxyFactory(reactor, router, cfg.proxy, pool=pool, secure=True)
        factories.append(secure)
        FrontListener(
            loop,
            cfg.https_addr,
            secure,
            certs.store,
            first_contact_wait=cfg.proxy.first_contact_wait,
            handshake_timeout=cfg.proxy.header_timeout,
        ).setServiceParent(door)
    if cfg.http_addr is not None:
        if cfg.https_addr is not None and cfg.http_redirect:
            port = _public_port(cfg.https_addr)
            responder = certs.responder
            redirect = RedirectToHTTPS(
                https_port=None if port == 443 else port,
                acme_challenge=responder.resource() if responder is not None else None,
            )
            _listen(top, serverFromString(reactor, cfg.http_addr), QuietSite(redirect))
        else:
            proxy = ProxyFactory(reactor, router, cfg.proxy, pool=pool)
            factories.append(proxy)
            FrontListener(loop, cfg.http_addr, proxy).setServiceParent(door)
    door.setServiceParent(top)


def _admin(
    top: MultiService,
    reactor: Any,
    cfg: BoxConfig,
    routes: RouteSource,
    units: BuiltinUnits | None,
    hibernation: _Hibernation | None,
    certs: _Certificates,
    backup: _BackupService | None,
) -> None:
    """The local admin API (router.sock) and the Prometheus endpoint."""
    clear_stale_socket(cfg.admin_socket)
    membership = hibernation.membership if hibernation is not None else None
    admin = AdminAPI(
        reactor,
        routes,
        cfg.units,
        _children_status(units) if units is not None else None,
        activator=hibernation.activator if hibernation is not None else None,
        mesh=_mesh_status(membership, cfg.env_file) if membership is not None else None,
        acme=certs.issuer.status if certs.issuer is not None else None,
        backup=backup.backup.status if backup is not None else None,
        capacity=Capacity(cfg.max_instances, cfg.max_registered, _always_on(units, routes)),
        stats=SpaceStats(
            routes,
            cfg.data_dir,
            hibernation.activator.state if hibernation is not None else None,
        ).answer,
        restart=units.supervisor.restart if units is not None else None,  # lchat deploy
    )
    _listen(top, UNIXServerEndpoint(reactor, cfg.admin_socket, mode=0o600), admin.site())
    if cfg.metrics_addr is not None:
        _listen(top, serverFromString(reactor, cfg.metrics_addr), metrics_site())


def _issuer(
    reactor: Any,
    cfg: BoxConfig,
    routes: RouteSource,
    store: tls.CertStore,
    wanted: tls.CertificateWanted,
    responder: ChallengeResponder | None,
    shared: SharedCache | None,
    own: tuple[str, ...],
    aws: ResolvedCredentials | None,
) -> Issuer:
    """The ACME issuer, with the host policy: registered and ready hosts, and this box's own name."""
    acme = cfg.acme
    assert acme is not None
    dns = None
    if cfg.wildcard_domains:
        dns = make_provider(
            acme.dns_provider,
            dnsimple_token=acme.dnsimple_token,
            dnsimple_url=acme.dnsimple_url,
            dnsimple_account=acme.dnsimple_account,
            route53_zone_id=acme.route53_zone_id,
            route53_endpoint=acme.route53_endpoint,
            route53_session=aws.session if aws is not None else None,
            sleep=time.sleep,  # the providers block in the issuer's worker threads
            clock=time.monotonic,
            now=reactor.seconds,
        )

    def may_issue(host: str) -> bool:
        if host in own:
            return True
        route = routes.table.get(host)
        return route is not None and route.serveable

    issuer = Issuer(
        reactor,
        store=store,
        local=LocalCache(cfg.acme_cache),
        account=AcmeAccount(acme.directory, cfg.acme_cache, email=acme.email, ca_file=acme.ca_file),
        may_issue=may_issue,
        http01=responder,
        dns=dns,
        wildcard_domains=cfg.wildcard_domains,
        dns_resolvers=acme.dns_resolvers,
        dns_timeout=acme.dns_timeout,
        shared=shared,
        own_hosts=own,
        monotonic=time.monotonic,
        wanted=wanted,
    )
    if responder is None:
        _log.warn(
            "acme: LCHAT_HTTP_ADDR is off, so per-host certificates cannot be issued (HTTP-01 "
            "needs port 80); only wildcards (DNS-01) are"
        )
    _log.info(
        "acme: issuing certificates from {directory} (per-host: {per_host}, wildcards: "
        "{wildcards}, cache: {cache})",
        directory=acme.directory,
        per_host="HTTP-01" if responder is not None else "off",
        wildcards=", ".join("*." + d for d in cfg.wildcard_domains) or "none",
        cache=cfg.cert_cache,
    )
    return issuer


def _raise_open_files_limit() -> None:
    """Raise the soft open-files limit to the hard one: every connection, and every awake
    hibernating space (~9 each), is a descriptor, and 1024 is a common default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            _log.warn("could not raise the open-files limit from {soft}: {e}", soft=soft, e=e)
            return
        soft = hard
    if soft != resource.RLIM_INFINITY and soft < 4096:
        _log.warn(
            "open-files limit is {soft}: raise it (LimitNOFILE=) for more than a few hundred "
            "connections or awake spaces",
            soft=soft,
        )


def _always_on(units: BuiltinUnits | None, routes: RouteSource) -> Callable[[], int]:
    """How many always-on space processes run on this box now (LCHAT_MAX_INSTANCES counts them,
    and never sleeps them): builtin units' running children; under systemd, the always-on
    instance rows not failed (the CLI starts one unit per row)."""
    if units is not None:
        supervisor = units.supervisor
        return lambda: sum(1 for child in supervisor.status().values() if child.pid is not None)
    return lambda: sum(
        1
        for r in routes.table
        if r.kind == "instance" and not r.hibernate and not r.elsewhere and r.status != "failed"
    )


def _children_status(units: BuiltinUnits) -> Any:
    def status() -> dict[str, dict[str, Any]]:
        return {
            host: {
                "state": child.state,
                "pid": child.pid,
                "restarts": child.restarts,
                "last_error": child.last_error,
            }
            for host, child in units.supervisor.status().items()
        }

    return status


class _SignalReload(Service):
    """SIGHUP re-reads the registry (the operator's `systemctl reload`)."""

    def __init__(self, reactor: Any, routes: RouteSource) -> None:
        self._reactor = reactor
        self._routes = routes
        self._previous: Any = None

    def startService(self) -> None:
        super().startService()

        def handler(signum: int, frame: object) -> None:
            # Signal handlers interrupt arbitrary code; hand the work to the reactor loop.
            self._reactor.callFromThread(self._routes.reload, "SIGHUP")

        self._previous = signal.signal(signal.SIGHUP, handler)

    def stopService(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGHUP, self._previous)
        super().stopService()


class _Hibernation(MultiService):
    """The bucket, the activator, its sweeps and the mesh's membership, stopped in order: sweeps,
    then a "draining" heartbeat (peers drop us from placement and take our spaces over as we
    release them), the bucket's other users, the activator's drain (flush and release every awake
    space), the heartbeat's deletion, and only then the bucket clients."""

    def __init__(
        self,
        reactor: Any,
        store: objstore.ObjectStore,
        check: _BucketCheck,
        activator: Activator,
        sweeper: Sweeper,
        membership: Membership | None,
        mesh: MeshRouter | None,
        due_push: DuePush | None = None,
        *,
        mesh_store: objstore.ObjectStore | None = None,  # LCHAT_MESH_BUCKET's, when set
        mesh_check: _BucketCheck | None = None,
    ) -> None:
        super().__init__()
        self.setName("hibernation")
        self._reactor = reactor
        self.store = store
        self.check = check
        self.activator = activator
        self.sweeper = sweeper
        self.membership = membership
        self.mesh = mesh
        self.due_push = due_push
        self.mesh_store = mesh_store
        self.mesh_check = mesh_check
        self._bucket_users: list[Service] = []
        for service in (check, mesh_check, membership, activator, sweeper, due_push):
            if service is not None:
                service.setServiceParent(self)

    def add_bucket_user(self, service: Service) -> None:
        """A service that uses the bucket (the shared certificate cache): started with the rest,
        stopped before the bucket client closes."""
        self._bucket_users.append(service)
        service.setServiceParent(self)

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        self.sweeper.stopService()
        self.check.stopService()
        if self.mesh_check is not None:
            self.mesh_check.stopService()
        return Deferred.fromCoroutine(self._drain())

    async def _drain(self) -> None:
        # The bucket's other users stop alongside (each within a few seconds of its own)...
        users = [maybeDeferred(u.stopService) for u in reversed(self._bucket_users)]
        if self.membership is not None:
            # ...but our heartbeat says "draining" first: peers drop us from placement and take
            # our spaces over as we release them, while our leases stay fenced by a heartbeat
            # that goes on beating until the drain is over (docs/lease.md).
            await self.membership.begin_drain()
        for stopping in users:
            await stopping
        await self.activator.stopService()
        if self.due_push is not None:
            # The due times of the spaces the drain just slept reach the peers (bounded).
            await self.due_push.stopService()
        if self.membership is not None:
            # Every lease released (or given up): the heartbeat goes, and with it this box.
            await self.membership.stopService()
        await _probe_done(self.check, self._reactor)
        await self.store.close()
        if self.mesh_store is not None:
            assert self.mesh_check is not None
            await _probe_done(self.mesh_check, self._reactor)
            await self.mesh_store.close()


async def _probe_done(check: _BucketCheck, reactor: Any) -> None:
    """A boot probe still in flight must finish before its store closes (it is bounded by the
    store's own timeouts; this wait is bounded again, to keep shutdown bounded)."""
    probe: Deferred[None] = Deferred()

    def probed(result: object) -> object:
        if not probe.called:
            probe.callback(None)
        return result

    check.checked.addBoth(probed)
    probe.addTimeout(10, reactor)
    try:
        await probe
    except Exception:
        _log.warn("the bucket probe was still running at shutdown")


class _BucketCheck(Service):
    """At start, prove a bucket is reachable and writable; if not, stop the router.

    twistd builds services before its reactor runs, so the probe runs at start; a failure logs
    one line naming the variables (``<stem>_BUCKET``...) and ends the process with status 1
    (systemd shows it and retries).
    """

    def __init__(
        self,
        reactor: Any,
        store: objstore.ObjectStore,
        key: str,
        stem: str,
        bucket: str,
    ) -> None:
        self._reactor = reactor
        self.store = store
        self._key = key
        self._stem = stem  # LCHAT_HIBERNATE or LCHAT_BACKUP
        self._bucket = bucket
        self.checked: Deferred[None] = Deferred()

    def startService(self) -> None:
        super().startService()
        d = Deferred.fromCoroutine(objstore.probe_writable(self.store, self._key))
        d.addCallbacks(self._ok, self._failed)
        d.addBoth(lambda _: self.checked.callback(None) if not self.checked.called else None)

    def _ok(self, _: object) -> None:
        _log.info(
            "bucket {bucket} ({stem}_BUCKET) is reachable and writable",
            bucket=self.store.describe(),
            stem=self._stem,
        )

    def _failed(self, failure: Failure) -> None:
        stem = self._stem
        check = (
            # One URL carries the bucket, prefix, endpoint, region and the key pair's names.
            f"{stem}_BUCKET's URL and its credentials"
            if stem == "LCHAT_MESH"
            else f"{stem}_BUCKET, {stem}_ENDPOINT, {stem}_REGION, {stem}_PREFIX and the AWS "
            "credentials"
        )
        _log.critical(
            "{stem}_BUCKET={bucket}: the bucket is not usable: {error} (check {check})",
            stem=stem,
            check=check,
            bucket=self._bucket,
            error=failure.getErrorMessage(),
        )
        self.failed = failure
        if self._reactor.running:
            self._reactor.addSystemEventTrigger("after", "shutdown", os._exit, 1)
            self._reactor.stop()


def _address(url: str) -> tuple[str, int]:
    """A member URL's address and port, as a forward to it connects (lchat.mesh.forward)."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def _mesh_status(membership: Membership, env_file: str) -> Callable[[], dict[str, Any]]:
    def status() -> dict[str, Any]:
        live = membership.live()
        return {
            # The settings a create must read to fan out (lchat add-instance warns otherwise).
            "env_file": env_file,
            # May this box write on its leases (docs/lease.md)? False before the first beat and
            # once none has landed for dead_after - margin.
            "alive": membership.alive(),
            "epoch": membership.epoch,
            "live": len(live),
            "members": [
                {
                    "url": m.url,
                    "region": m.region,
                    "version": m.version,
                    "age": round(m.age, 1),
                    "self": m.self,
                }
                for m in live
            ],
            # What keeps it alive, and each peer's part (docs/lease.md, "Witnesses").
            "witness": membership.witness_status(),
        }

    return status


def _fleet_view(
    reactor: Any,
    cfg: BoxConfig,
    routes: RouteSource,
    hibernation: _Hibernation | None,
    units: BuiltinUnits | None,
    backup: _BackupService | None,
) -> Callable[[], Callable[[], dict[str, Any]]] | None:
    """``GET /api/mesh/spaces`` for ``lchat fleet`` (lchat.mesh.fleet), on a mesh box only."""
    if hibernation is None or hibernation.membership is None:
        return None
    return SpacesView(
        reactor.seconds,
        cfg,
        lambda: routes.table,
        hibernation.activator,
        hibernation.membership.live,
        children=units.supervisor.status if units is not None else None,
        backup=backup.backup.status if backup is not None else None,
    ).snapshot


def _anywhere(route: Route) -> bool:
    return True


class _FrontDoor(MultiService):
    """The proxy's listeners (its children) and their connections. Stopping is the front door's
    drain, in this order, so that no request is lost to a race with the stop:

    1. every listener accepts what the kernel already queued and closes its socket (a peer that
       dials now is refused, and routes around this box);
    2. from now on every answer closes its connection; connections idle between requests close
       now, upgraded ones too (their spaces are stopping); a connection that has not sent its
       first request yet is answered (ProxyFactory.close);
    3. the rest, requests in flight (a hibernating space's are let finish before it stops), may
       take up to ``cfg.drain_grace`` seconds; then they are aborted and idle upstream
       connections closed. TLS handshakes still in progress (connections accepted from the
       queue in step 1 among them) are waited for too, within the same grace: such a client
       becomes a connection, sends its request and gets its answer (and a mesh peer that was
       refused one routes it elsewhere).
    """

    def __init__(
        self, clock: Any, pool: UpstreamPool, factories: list[ProxyFactory], grace: float
    ) -> None:
        super().__init__()
        self.setName("front-door")
        self._clock = clock
        self._pool = pool
        self._factories = factories
        self._grace = grace

    def stopService(self) -> Deferred[None]:
        ports = [s.port for s in self if isinstance(s, FrontListener) and s.port is not None]
        listeners = [maybeDeferred(s.stopService) for s in reversed(list(self))]
        Service.stopService(self)
        return Deferred.fromCoroutine(self._drain(listeners, ports))

    async def _drain(self, listeners: list[Deferred[Any]], ports: list[FrontPort]) -> None:
        for stopped in listeners:
            try:
                await stopped
            except Exception:
                _log.failure("a listener did not stop cleanly")
        deadline = self._clock.seconds() + self._grace
        for factory in self._factories:
            factory.close()
        while True:
            for factory in self._factories:
                await factory.quiesced(max(0.0, deadline - self._clock.seconds()))
            if self._clock.seconds() >= deadline:
                break
            # Quiet only when no handshake is left *and* no factory gained a connection while
            # another was being waited for (a TLS handshake that finished meanwhile: its
            # request would otherwise meet the process's exit, unanswered).
            if not any(p.handshaking for p in ports) and not any(
                f.connections for f in self._factories
            ):
                break
            await deferLater(self._clock, 0.05, lambda: None)
        await self._pool.close()


def _public_port(address: str) -> int | None:
    """The TCP port of an endpoint string, for redirect Locations (None when not TCP)."""
    match = re.search(r"^(?:tcp6?|ssl):(\d+)", address)
    return int(match.group(1)) if match and int(match.group(1)) else None


def _listen(parent: MultiService, endpoint: Any, factory: Any) -> Listener:
    """A listener that fails the boot (rather than logging) when it cannot listen, and answers
    the connections already queued when it stops (lchat.listener)."""
    service = Listener(endpoint, factory)
    service.setServiceParent(parent)
    return service
