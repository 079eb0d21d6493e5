"""``twistd lchat``: command-line options and the MultiService they build."""

from __future__ import annotations

import os
import re
import resource
import time
from collections.abc import Callable
from typing import Any

from attrs import define
from prometheus_client import generate_latest
from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXServerEndpoint, serverFromString
from twisted.internet.interfaces import IListeningPort, IReactorCore, IReactorTime
from twisted.logger import Logger
from twisted.python import usage
from twisted.web.server import Site

import lchat
from lchat import config, isolation, malloc, objstore, relayout, uvloop_reactor
from lchat.admin import AdminAPI, AlreadyRunning, Capacity, clear_stale_socket, metrics_site
from lchat.backup import envfiles
from lchat.backup.service import Backup
from lchat.buckets import RegionBuckets, boot_credentials, prepare, probe_name
from lchat.certificates import Certificates, certificates
from lchat.config import BoxConfig, ConfigError, mesh_bucket
from lchat.hibernation.activator import Activator
from lchat.hibernation.capacity import Memory, proc_readers
from lchat.hibernation.lifecycle import Lifecycle
from lchat.hibernation.sidecars import Sidecars
from lchat.hibernation.sweeper import Sweeper
from lchat.listener import Listener, listen
from lchat.mesh.api import MeshAPI, mesh_site
from lchat.mesh.client import PeerBeats, ask_stats, ask_wake
from lchat.mesh.due import DuePush
from lchat.mesh.fence import BoxFence, HolderJudge
from lchat.mesh.fleet import SpacesView
from lchat.mesh.forward import peer_address
from lchat.mesh.membership import Membership
from lchat.mesh.placement import registered_by_owner
from lchat.mesh.posture import Posture, say_off
from lchat.mesh.routing import MeshRouter
from lchat.mesh.sync import SettingsSync
from lchat.objstore.aws import NoCredentials, ResolvedCredentials
from lchat.objstore.where import Where
from lchat.proxy import HOT, oneread
from lchat.proxy.serve import FrontListener, FrontPort
from lchat.proxy.state import FrontDoorState
from lchat.proxy.upstream import UpstreamPool, client_tls_context
from lchat.reactors import Reactor, installed, whole
from lchat.readiness import PEER_TIMEOUT, VERSION_TIMEOUT, MeshProbe, Readiness
from lchat.redirect import RedirectToHTTPS
from lchat.registry import Registry, RegistryError, RouteTable
from lchat.router import Router
from lchat.routesource import RouteSource
from lchat.shutdown import (
    BackupService,
    BucketCheck,
    FrontDoor,
    HibernationService,
    InOrder,
    SayOnce,
    SignalReload,
)
from lchat.spacestats import OWNER_TIMEOUT, MeshStats, SpaceStats
from lchat.supervise import Supervisor
from lchat.threads import RunInThread, thread_runner
from lchat.units import BuiltinUnits, Claims
from lchat.unixhttp import request as unix_request
from lchat.webutil import QuietSite
from lchat.worker_tap import front_door

_log = Logger(namespace="lchat.tap")

# option name -> the variable it overrides, and what it is
FLAGS = {
    "registry": ("LCHAT_REGISTRY", "the registry database (default <data>/registry.db)."),
    "data-dir": ("LCHAT_DATA_DIR", "space databases and env files (default /data)."),
    "run-dir": ("LCHAT_RUN_DIR", "space sockets and router.sock (default /run/lchat)."),
    "http": ("LCHAT_HTTP_ADDR", "plain HTTP listener, HOST:PORT or endpoint (default :80)."),
    "https": ("LCHAT_HTTPS_ADDR", "TLS listener (default :443), or off."),
    "fallback-url": ("LCHAT_FALLBACK_URL", "302 target for unknown hosts (default: 404)."),
    "units": ("LCHAT_UNITS", "auto, systemd or builtin (default auto)."),
    "space-command": ("LCHAT_SPACE_COMMAND", "how to run a space; {host} is filled in."),
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
        *([name, None, None, f"{var}: {what}"] for name, (var, what) in FLAGS.items()),
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
    flags = {var: options[name] for name, (var, _) in FLAGS.items()}
    try:
        cfg = config.load(env_file=options["env-file"], flags=flags)
    except ConfigError as e:
        raise SystemExit(f"lchat: configuration error: {e}") from None
    try:
        if cfg.workers == 1:
            return build_service(cfg, installed())  # one process: the whole box
        from lchat.workers import build_control  # (which imports this module)

        return build_control(cfg, installed())
    except (RegistryError, AlreadyRunning, ConfigError, OSError) as e:
        raise SystemExit(f"lchat: cannot start: {e}") from None


def build_service(
    cfg: BoxConfig, any_reactor: IReactorCore, poll_interval: float = 2.0
) -> MultiService:
    """Everything the box runs, wired feature by feature; the logic lives in the features' own
    modules. Fails loudly on anything unusable. Services stop in reverse order: the admin API,
    the front door (listeners, then idle connections), certificates, hibernation's drain, units,
    the registry.

    The one clock is ``reactor`` (``seconds()``, unix time); the one thread runner is the
    reactor's pool (:func:`lchat.threads.thread_runner`); leases, whose deadlines must not jump
    with the wall clock, are kept on ``time.monotonic``. ``any_reactor``: the installed one (or a
    test's), checked here to be whole (:func:`lchat.reactors.whole`).

    This is the whole box in one process (LCHAT_WORKERS=1); lchat.workers builds the control
    process of a box with worker processes from the same parts (:func:`control_plane`)."""
    box = control_plane(cfg, any_reactor, poll_interval)
    _front_door(
        box.top,
        box.reactor,
        cfg,
        box.routes,
        box.pool,
        box.hibernation,
        box.certs,
        box.run,
        spaces=box.fleet,
        stats=box.stats,
        probe=box.probe,
    )
    admin_api(box.top, box.reactor, cfg, box)
    log_start(cfg, box)
    return box.top


@define
class ControlPlane:
    """What :func:`control_plane` built, for the builder that adds the data plane to it."""

    top: MultiService
    reactor: Reactor
    routes: RouteSource
    run: RunInThread
    units: BuiltinUnits | None
    backup: BackupService | None
    pool: UpstreamPool
    hibernation: HibernationService | None
    certs: Certificates
    fleet: Callable[[], Callable[[], dict[str, Any]]] | None
    stats: SpaceStats
    probe: Readiness | None


def control_plane(
    cfg: BoxConfig,
    any_reactor: IReactorCore,
    poll_interval: float = 2.0,
    *,
    reload: Callable[[str], object] | None = None,
    state: FrontDoorState | None = None,
) -> ControlPlane:
    """The box less its front door and admin API: the registry and its route table, SIGHUP's
    reload (``reload``; default the table's own), the spaces and their backup, the upstream pool
    (its figures in ``state``; default a fresh one, the front door's), hibernation and the mesh,
    the certificates, and the views the front door and admin API serve."""
    reactor = whole(any_reactor)
    _prepare_box(cfg)
    aws = boot_credentials(cfg)
    run = thread_runner(reactor)
    registry = Registry(cfg.registry, reactor.seconds)
    registry.migrate()
    isolation.at_start(cfg, registry, relayout.relayout)  # (an older box's files move first)
    routes = RouteSource(
        reactor, registry, registry.load(), run_in_thread=run, poll_interval=poll_interval
    )
    top = MultiService()
    routes.setServiceParent(top)
    SignalReload(reactor, reload or routes.reload).setServiceParent(top)
    claims = Claims()  # hosts the activator runs: builtin units leave them alone
    # The spaces the router runs and their backup, stopped in that order (top's children stop
    # all at once): the backup's last sync sees the spaces' last writes.
    spaces = InOrder("spaces")
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
        # the front door's figures and buffers, one per process
        state=state if state is not None else FrontDoorState(),
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
            always_on=_always_on(units, routes),
        )
        hibernation.setServiceParent(top)
    certs = certificates(top, reactor, cfg, routes, hibernation, run, aws)
    return ControlPlane(
        top=top,
        reactor=reactor,
        routes=routes,
        run=run,
        units=units,
        backup=backup,
        pool=pool,
        hibernation=hibernation,
        certs=certs,
        fleet=_fleet_view(reactor, cfg, routes, hibernation, units, backup),
        stats=_space_stats(reactor, cfg, routes, hibernation),
        probe=_readiness(reactor, cfg, routes, hibernation),
    )


def log_start(cfg: BoxConfig, box: ControlPlane) -> None:
    """The start line, and the capacity limits."""
    _log.info(
        "lchat {version} starting: {routes} routes from {registry}, units={units}, "
        "https={https}, http={http}, admin={admin}, one-read recognisers {oneread}, "
        "hot path {hot}",
        oneread=oneread.implementation(),
        hot=HOT,
        version=lchat.__version__,
        routes=len(box.routes.table),
        registry=cfg.registry,
        units=cfg.units,
        https=cfg.https_addr or "off",
        http=(cfg.http_addr or "off")
        + (" (redirect)" if cfg.https_addr and cfg.http_addr and cfg.http_redirect else ""),
        admin=cfg.admin_socket,
    )
    _log_capacity(cfg, box.routes.table, box.hibernation is not None)


def _log_capacity(cfg: BoxConfig, table: RouteTable, hibernation: bool) -> None:
    """The capacity limits at start, and an always-on count over LCHAT_MAX_INSTANCES (rows
    added before the cap was lowered, or by hand: add-instance refuses more)."""
    always_on = sum(1 for r in table if r.always_on_here)
    limit = cfg.max_instances
    if limit and always_on > limit:
        _log.warn(
            "capacity: {n} always-on spaces are registered here, over LCHAT_MAX_INSTANCES={limit} "
            "(add-instance and hibernate --off refuse more): raise it in {env}, or hibernate "
            "some (lchat hibernate HOST --on)",
            n=always_on,
            limit=limit,
            env=cfg.env_file,
        )
    if hibernation:
        _log.info(
            "capacity: hibernating wakes are admitted by memory (LCHAT_SPACE_MEMORY={floor} MiB "
            "a space at least, reserve {reserve}); LCHAT_MAX_AWAKE={awake} (0: no fixed cap; a "
            "box upgraded from a release where LCHAT_MAX_INSTANCES also capped awake spaces "
            "sets it to keep that number); LCHAT_MAX_INSTANCES={limit} caps always-on spaces "
            "({n} here)",
            floor=cfg.space_memory >> 20,
            reserve="max(512 MiB, 5% of memory)"
            if cfg.memory_reserve is None
            else f"{cfg.memory_reserve >> 20} MiB",
            awake=cfg.max_awake,
            limit=limit,
            n=always_on,
        )


def listening_ports(service: IService) -> list[IListeningPort | FrontPort | Any]:
    """Every port the service tree listens on now (tests and diagnostics). A service with a
    ``listening_ports()`` of its own answers for itself (lchat.workers.SlotSockets: the public
    ports a control process holds for its workers, one per address)."""
    if isinstance(service, Listener | FrontListener):
        return [service.port] if service.port is not None else []
    own = getattr(service, "listening_ports", None)
    if callable(own):
        return list(own())
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


def _membership(
    reactor: Reactor,
    cfg: BoxConfig,
    store: objstore.ObjectStore,
    run: RunInThread,
    aws: ResolvedCredentials | None,
) -> tuple[Membership, BoxFence, objstore.ObjectStore | None, BucketCheck | None]:
    """The heartbeat (in LCHAT_MESH_BUCKET, else the hibernation bucket), the fence it makes of
    this box's liveness, and LCHAT_MESH_BUCKET's own store and boot probe (None, None: the
    heartbeats live in the hibernation bucket)."""
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
        mesh_check = _bucket_check(reactor, cfg, mesh_store, beats, "LCHAT_MESH")
    # Beats reach the peers over the mesh API (verified HTTPS, the mesh token): their word keeps
    # this box alive while the bucket is out of reach (lchat.mesh.witness, docs/lease.md).
    peers = PeerBeats(reactor, cfg.mesh.token, cfg.mesh.ca_file)
    membership = Membership(
        reactor, members_store, beats, cfg.mesh, monotonic=time.monotonic, peers=peers
    )
    judge = HolderJudge(members_store, beats, cfg.mesh.dead_after, witness=membership)
    return membership, BoxFence(membership, judge), mesh_store, mesh_check


def _bucket_check(
    reactor: Reactor, cfg: BoxConfig, store: objstore.ObjectStore, where: Where, stem: str
) -> BucketCheck:
    """``where``'s boot probe, writing ``<prefix>/.lchat/probe/<this box>``."""
    key = where.key(".lchat", "probe", probe_name(cfg.box_id))
    return BucketCheck(reactor, store, key, stem, where.bucket)


def _backup(
    reactor: Reactor,
    cfg: BoxConfig,
    routes: RouteSource,
    claims: Claims,
    run: RunInThread,
    aws: ResolvedCredentials | None,
) -> BackupService:
    """The fleet backup: its bucket (probed at start) and one replicator per database."""
    conf = cfg.backup
    assert conf is not None
    # Before anything starts: no key, env files, and no explicit opt-out is a refusal.
    envfiles.refuse_unprotected(cfg.data_dir, key=conf.env_key, unprotected_ok=conf.env_unprotected)
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
    check = BucketCheck(reactor, store, backup.layout.probe_key(), "LCHAT_BACKUP", conf.bucket)
    return BackupService(check, backup, reactor)


def _hibernation(
    reactor: Reactor,
    cfg: BoxConfig,
    routes: RouteSource,
    pool: UpstreamPool,
    claims: Claims,
    run: RunInThread,
    aws: ResolvedCredentials | None,
    *,
    always_on: Callable[[], int],
) -> HibernationService:
    """The bucket, the activator, its sweeps and (with LCHAT_MESH_SELF) the mesh. With the fleet
    backup on, a wake first takes the database from it (through ``claims``: lchat.units.Claims)."""
    hib = cfg.hibernate
    assert hib is not None
    store = objstore.open_store(reactor, hib.where, run, aws, monotonic=time.monotonic)
    # The mesh's membership first: on a mesh box its heartbeat fences every lease the lifecycle
    # takes (lchat.mesh.fence, docs/lease.md).
    membership = fence = mesh_store = mesh_check = None
    if cfg.mesh is not None:
        membership, fence, mesh_store, mesh_check = _membership(reactor, cfg, store, run, aws)
    sidecars = Sidecars(reactor, cfg, run, Supervisor(reactor, max_restart_delay=60.0))
    # The other regions' buckets: a space homed in one wakes from it, never from ours (the mesh
    # routes one here only under LCHAT_REGION_FAILOVER_AFTER). Opened on first use.
    regions = RegionBuckets(reactor, cfg) if cfg.region_buckets else None
    lifecycle = Lifecycle(
        reactor,
        cfg,
        store,
        routes,
        run,
        sidecars,
        drop_idle=pool.drop_idle,
        monotonic=time.monotonic,
        fence=fence,
        regions=regions,
    )
    activator = Activator(
        reactor,
        routes,
        lifecycle,
        claims,
        resident=always_on,  # shown against LCHAT_MAX_INSTANCES; never slept, never blocks a wake
        max_instances=cfg.max_instances,
        max_awake=cfg.max_awake,
        memory=_memory(cfg),
        lapsed=membership.lapsed if membership is not None else None,
        witness=membership,
        bucket_reachable=membership.bucket_reachable if membership is not None else None,
    )
    mesh = None
    due_push: DuePush | None = None
    if membership is not None:
        assert cfg.mesh is not None
        # Neither a landed heartbeat nor the peers' word covers this box any more: every space
        # stands down before peers may judge it dead.
        membership.on_not_alive(activator.box_not_alive)
        # What its beats tell the peers: a backlog that cannot ship, the hosts awake here.
        membership.report(activator.backlog, activator.awake_hosts)
        # Alive (at start, and back from a lapse): ship the local copies the bucket lacks.
        membership.on_alive(activator.recover)
        # A peer out of reach: the requests forwarded to it fail now, not when TCP gives up.
        membership.on_unreachable(lambda url: pool.abort_peer(*peer_address(url)))
        # Due wakes fire only on the owner (the sweeper asks it)...
        mesh = MeshRouter(cfg, store, membership, activator, reactor=reactor, regions=regions)
        # ...so every change of a space's next_due here reaches the peers (whoever owns it then).
        due_push = DuePush(
            reactor, cfg.mesh, cfg.data_dir, routes, membership.live, run_in_thread=run
        )
        posture: Service = Posture(reactor, cfg, membership)
    else:
        posture = SayOnce(lambda: say_off(cfg))
    sweeper = Sweeper(
        reactor,
        activator,
        routes,
        idle=hib.idle,
        sweep=hib.sweep,
        due_sweep=hib.due_sweep,
        may_wake=mesh.is_owner if mesh is not None else lambda route: True,
    )
    check = _bucket_check(reactor, cfg, store, hib.where, "LCHAT_HIBERNATE")
    hibernation = HibernationService(
        reactor,
        store,
        check,
        activator,
        sweeper,
        membership,
        mesh,
        due_push,
        mesh_store=mesh_store,
        mesh_check=mesh_check,
        regions=regions,
    )
    hibernation.add_bucket_user(posture)  # (no bucket: stopped with them, its timer too)
    return hibernation


def _settings_sync(
    reactor: Reactor,
    cfg: BoxConfig,
    routes: RouteSource,
    mesh: MeshRouter,
    membership: Membership,
    site: Site,
    run: RunInThread,
) -> SettingsSync:
    """The spaces' settings' anti-entropy (lchat.mesh.sync), applying through the mesh API's
    own upsert."""
    assert cfg.mesh is not None
    api = site.resource
    assert isinstance(api, MeshAPI)
    return SettingsSync(
        reactor,
        reactor,
        cfg.mesh,
        cfg.data_dir,
        routes.registry,
        membership.live,
        mesh.owner_url,
        api.apply,
        run_in_thread=run,
        apply_delete=api.apply_delete,
        lock=api.write_lock,
    )


def _front_door(
    top: MultiService,
    reactor: Reactor,
    cfg: BoxConfig,
    routes: RouteSource,
    pool: UpstreamPool,
    hibernation: HibernationService | None,
    certs: Certificates,
    run: RunInThread,
    spaces: Callable[[], Callable[[], dict[str, Any]]] | None = None,
    stats: SpaceStats | None = None,
    probe: Readiness | None = None,
) -> None:
    """The router and its listeners: HTTPS, plain HTTP (redirecting, or proxying), and the
    mesh's route-replication API addressed to this box's own name (with ``spaces``, the fleet
    view: ``GET /api/mesh/spaces``). One process (LCHAT_WORKERS=1) serves all of it; with
    workers, the control process builds :func:`control_router` and :func:`redirect_listener` only
    (lchat.workers)."""
    router = control_router(
        top,
        reactor,
        cfg,
        routes,
        hibernation,
        certs,
        run,
        routes.reload,
        spaces=spaces,
        stats=stats,
        probe=probe,
    )
    _public_listeners(top, reactor, cfg, router, pool, certs)


def control_router(
    top: MultiService,
    reactor: Reactor,
    cfg: BoxConfig,
    routes: RouteSource,
    hibernation: HibernationService | None,
    certs: Certificates,
    run: RunInThread,
    reload: Callable[[str], object],
    spaces: Callable[[], Callable[[], dict[str, Any]]] | None = None,
    stats: SpaceStats | None = None,
    probe: Readiness | None = None,
) -> Router:
    """The router with every control-plane seam filled: the activator, the mesh, and the mesh
    API's socket (``<run>/mesh.sock``, served here; with its settings sync). ``reload``: what a
    mesh API write calls before it answers (``routes.reload``; with workers, the reload that
    waits for them too)."""
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
            reload,
            run_in_thread=run,
            spaces=spaces,
            beats=membership.receive_beat if membership is not None else None,
            members=membership.known if membership is not None else None,
            clock=reactor.seconds,
            stats=stats.answer_here if stats is not None else None,
            holds=hibernation.activator if hibernation is not None else None,
            probe=probe.answer_here if probe is not None else None,
            owner=hibernation.mesh.owner_url
            if hibernation is not None and hibernation.mesh is not None
            else None,
        )
        listen(top, UNIXServerEndpoint(reactor, mesh_socket, mode=0o600), site)
        if hibernation is not None and membership is not None and hibernation.mesh is not None:
            sync = _settings_sync(reactor, cfg, routes, hibernation.mesh, membership, site, run)
            sync.setServiceParent(top)
            # A wake that finds its space relocated since this box's row asks the peers at once.
            hibernation.activator.moved.on_moved = sync.repair
        mesh_api = (cfg.mesh.self_host, mesh_socket)
    return Router(
        routes,
        cfg.fallback_url,
        activator=hibernation.activator if hibernation is not None else None,
        mesh=hibernation.mesh if hibernation is not None else None,
        mesh_api=mesh_api,
        acme_challenge=certs.challenge_socket,
    )


def _public_listeners(
    top: MultiService,
    reactor: Reactor,
    cfg: BoxConfig,
    router: Router,
    pool: UpstreamPool,
    certs: Certificates,
) -> FrontDoor:
    """The public listeners of a single-process box: HTTPS, and plain HTTP (proxying, or the
    redirect site), in their front door."""
    redirects = redirect_listener(top, reactor, cfg, certs)
    door = front_door(
        reactor,
        cfg,
        router,
        pool,
        certs.store,
        https=cfg.https_addr is not None,
        http=cfg.http_addr is not None and not redirects,
    )
    door.setServiceParent(top)
    return door


def redirect_listener(
    top: MultiService, reactor: Reactor, cfg: BoxConfig, certs: Certificates
) -> bool:
    """With HTTPS on and LCHAT_HTTP_REDIRECT, plain HTTP is a Twisted site redirecting to HTTPS
    (and answering ACME HTTP-01 challenges), listening in ``top``: True. Otherwise nothing is
    built (plain HTTP, if on, proxies): False."""
    if cfg.http_addr is None or cfg.https_addr is None or not cfg.http_redirect:
        return False
    port = _public_port(cfg.https_addr)
    responder = certs.responder
    redirect = RedirectToHTTPS(
        https_port=None if port == 443 else port,
        acme_challenge=responder.resource() if responder is not None else None,
    )
    listen(top, serverFromString(reactor, cfg.http_addr), QuietSite(redirect))
    return True


def admin_api(
    top: MultiService,
    reactor: Reactor,
    cfg: BoxConfig,
    box: ControlPlane,
    *,
    reload: Callable[[str], Deferred[dict[str, Any]]] | None = None,
    metrics: Callable[[], Deferred[bytes] | bytes] = generate_latest,
    workers: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """The local admin API (router.sock) and the Prometheus endpoint. With worker processes:
    ``reload`` (POST /reload: theirs too), ``metrics`` (the box's merged scrape) and ``workers``
    (their status in GET /status)."""
    routes, units, hibernation, certs = box.routes, box.units, box.hibernation, box.certs
    backup, stats, probe = box.backup, box.stats, box.probe
    clear_stale_socket(cfg.admin_socket)
    membership = hibernation.membership if hibernation is not None else None
    admin = AdminAPI(
        reactor,
        routes,
        cfg.units,
        units.supervisor.status if units is not None else None,
        activator=hibernation.activator if hibernation is not None else None,
        # (with the settings a create must read to fan out: lchat add-instance warns otherwise)
        mesh=(lambda: {"env_file": cfg.env_file, **membership.status()})
        if membership is not None
        else None,
        acme=certs.issuer.status if certs.issuer is not None else None,
        backup=backup.backup.status if backup is not None else None,
        capacity=Capacity(
            cfg.max_instances,
            cfg.max_registered,
            _always_on(units, routes),
            owned=_registered_owned(cfg, routes, membership),
        ),
        stats=stats.answer,
        probe=probe.answer if probe is not None else None,
        restart=units.supervisor.restart if units is not None else None,  # lchat deploy
        reload=reload,
        metrics=metrics,
        workers=workers,
    )
    listen(top, UNIXServerEndpoint(reactor, cfg.admin_socket, mode=0o600), admin.site())
    if cfg.metrics_addr is not None:
        listen(top, serverFromString(reactor, cfg.metrics_addr), metrics_site(metrics))


def _space_stats(
    reactor: Reactor, cfg: BoxConfig, routes: RouteSource, hibernation: HibernationService | None
) -> SpaceStats:
    """Wake-free stats (lchat.spacestats): on a mesh box, asked of the box that holds or owns a
    space, or decided by the bucket, never answered from an empty local view."""
    if hibernation is None:
        return SpaceStats(routes, cfg.data_dir)
    state = hibernation.activator.state
    mesh, hib = hibernation.mesh, cfg.hibernate
    if mesh is None or cfg.mesh is None or hib is None:
        return SpaceStats(routes, cfg.data_dir, state)
    token, ca_file = cfg.mesh.token, cfg.mesh.ca_file

    async def ask(peer: str, host: str) -> tuple[int, dict[str, Any]]:
        return await ask_stats(
            peer, token, host, reactor=reactor, ca_file=ca_file, timeout=OWNER_TIMEOUT
        )

    seam = MeshStats(
        self_url=mesh.self_url,
        in_scope=mesh.in_scope,
        answering_box=mesh.answering_box,
        ask=ask,
        store=hibernation.store,
        replica=hib.key,
        clock=reactor,
        unreachable=hibernation.membership.peer_unreachable
        if hibernation.membership is not None
        else lambda url: False,
    )
    return SpaceStats(routes, cfg.data_dir, state, seam)


def _readiness(
    reactor: Reactor, cfg: BoxConfig, routes: RouteSource, hibernation: HibernationService | None
) -> Readiness | None:
    """The readiness probe (lchat.readiness), with hibernation only; on a mesh box it probes on
    the box that holds or owns a space (POST /api/mesh/wake/<host> there)."""
    if hibernation is None:
        return None

    async def read_version(socket: str, host: str) -> tuple[int, bytes]:
        answer = await unix_request(
            reactor, socket, "GET", "/api/version", host=host, timeout=VERSION_TIMEOUT
        )
        return answer.status, answer.body

    mesh, probe_mesh = hibernation.mesh, None
    if mesh is not None and cfg.mesh is not None:
        token, ca_file = cfg.mesh.token, cfg.mesh.ca_file

        async def ask(peer: str, host: str) -> tuple[int, dict[str, Any]]:
            return await ask_wake(
                peer, token, host, reactor=reactor, ca_file=ca_file, timeout=PEER_TIMEOUT
            )

        probe_mesh = MeshProbe(mesh.self_url, mesh.in_scope, mesh.answering_box, ask)
    return Readiness(
        routes,
        hibernation.activator,
        read_version,
        reactor,
        self_url=mesh.self_url if mesh is not None else "",
        mesh=probe_mesh,
    )


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
    """How many always-on space processes run on this box now (shown against
    LCHAT_MAX_INSTANCES): builtin units' running children; under systemd, the always-on
    instance rows not failed (the CLI starts one unit per row)."""
    if units is not None:
        supervisor = units.supervisor
        return lambda: sum(1 for child in supervisor.status().values() if child.pid is not None)
    return lambda: sum(1 for r in routes.table if r.always_on_here and r.status != "failed")


def _memory(cfg: BoxConfig) -> Memory | None:
    """What admits a wake: the kernel's memory figures (lchat.hibernation.capacity); None, said
    so, where there is no /proc/meminfo to read (then only LCHAT_MAX_AWAKE limits wakes)."""
    if not os.path.exists("/proc/meminfo"):
        _log.warn("capacity: no /proc/meminfo: wakes are not admitted by memory")
        return None
    return Memory(proc_readers(), floor=cfg.space_memory, reserve=cfg.memory_reserve)


def _registered_owned(
    cfg: BoxConfig, routes: RouteSource, membership: Membership | None
) -> Callable[[], dict[str, int]] | None:
    """On a mesh box, the instance rows per box they count for (LCHAT_MAX_REGISTERED's count
    there: lchat.mesh.placement.registered_by_owner), by this box's live view."""
    mesh = cfg.mesh
    if membership is None or mesh is None:
        return None
    live = membership.live
    return lambda: registered_by_owner(routes.table, live(), mesh.self_url, mesh.domains)


def _fleet_view(
    clock: IReactorTime,
    cfg: BoxConfig,
    routes: RouteSource,
    hibernation: HibernationService | None,
    units: BuiltinUnits | None,
    backup: BackupService | None,
) -> Callable[[], Callable[[], dict[str, Any]]] | None:
    """``GET /api/mesh/spaces`` for ``lchat fleet`` (lchat.mesh.fleet), on a mesh box only."""
    if hibernation is None or hibernation.membership is None:
        return None
    return SpacesView(
        clock.seconds,
        cfg,
        lambda: routes.table,
        hibernation.activator,
        hibernation.membership.live,
        children=units.supervisor.status if units is not None else None,
        backup=backup.backup.status if backup is not None else None,
    ).snapshot


def _public_port(address: str) -> int | None:
    """The TCP port of an endpoint string, for redirect Locations (None when not TCP)."""
    match = re.search(r"^(?:tcp6?|ssl):(\d+)", address)
    return int(match.group(1)) if match and int(match.group(1)) else None
