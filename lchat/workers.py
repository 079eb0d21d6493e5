"""The control process of a box with worker processes (``LCHAT_WORKERS`` >= 2): ``twistd lchat``
builds this instead of the single process (lchat.tap.makeService).

The control process runs the whole control plane as a single process does (the registry's
writers, builtin units, backup, hibernation's activator and the mesh, ACME, the admin API) and no
public listener of its own, except the port-80 redirect site (HTTPS on, LCHAT_HTTP_REDIRECT).
The data plane is N ``twistd lchat-worker --slot k`` processes (lchat.worker_tap) that it starts
and keeps running through its worker pool (lchat.workerpool). What it builds for them:

- the **slot sockets**: per slot and per public address the workers serve (HTTPS; plain HTTP when
  it proxies), one socket bound with ``SO_REUSEPORT`` here, at build time (as root, before
  privileges drop); slot k's are inherited by worker k as descriptors 3 (HTTPS) and 4 (HTTP).
  The kernel spreads new connections over the slots, and a slot's queue outlives its worker (a
  replacement serves what queued while it restarted). Port 0 is resolved once: every slot gets
  the first one's port;
- the **hop door**: ``<run>/workers/hop.sock``, where a full router (``ProxyFactory(trusted_hop=
  True)``) serves the requests a worker cannot (a hibernating host's wake and in-flight ticket, a
  mesh forward): one activator per box, so wakes through any worker coalesce;
- ``<run>/workers/control.sock`` (a worker's first-contact ``cert-wanted`` reaches the issuer);
- the **session-ticket key** ``<run>/workers/tls-ticket.key`` (HTTPS on), rotated every 12 h;
- the **reloads**: SIGHUP, ``POST /reload`` and the mesh API's writes re-read control's table and
  then wait for every ready worker's (bounded); any other swap of control's table, and every
  change of its certificates, is pushed to the workers without waiting;
- **one metrics scrape** for the box: control's own registry merged with every worker's.

Invariants: ``<run>/workers`` is mode 0700 (the hop socket trusts its clients' forwarding headers:
only the router's user may connect); the workers start after the hop door, the control socket and
the ticket key exist; at stop (SIGTERM to control alone: systemd's ``KillMode=mixed``), control's
copies of the slot sockets close at once, then every worker drains and exits (SIGKILL after
``drain_grace + 10`` s), then the hop door drains, while the rest of the box stops as a single
process's does.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

from attrs import evolve
from prometheus_client import REGISTRY, Gauge, generate_latest
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXServerEndpoint
from twisted.internet.interfaces import IReactorCore
from twisted.logger import Logger

from lchat import tap, ticketkeys, uvloop_reactor
from lchat.admin import clear_stale_socket
from lchat.child import ChildSpec
from lchat.config import BoxConfig
from lchat.listener import listen
from lchat.metricsmerge import MergedMetrics, MetricsTextError
from lchat.proxy.downstream import ProxyFactory
from lchat.proxy.serve import FrontListener, bind, parse_address, sock_address
from lchat.proxy.state import FrontDoorState
from lchat.registry import RouteTable
from lchat.routesource import RouteSource
from lchat.shutdown import FrontDoor, InOrder
from lchat.worker_tap import routes_version, worker_socket, workers_dir
from lchat.workerchannel import ask, control_site
from lchat.workerpool import WorkerPool

_log = Logger(namespace="lchat.workers")

# The descriptors a worker finds its slot's sockets at (lchat.worker_tap's --fds).
FDS = {"https": 3, "http": 4}
HOP_HEADER_SLACK = 4096  # the worker's X-Forwarded-For/-Proto on a head at the public limit
TICKET_KEY_ROTATION = 12 * 3600.0
KILL_AFTER_GRACE = 10.0  # a draining worker is SIGKILLed this long after drain_grace

_slot_sockets = Gauge(
    "lchat_worker_slot_sockets",
    "Listening sockets the control process holds for its workers' slots",
)


def build_control(
    cfg: BoxConfig, any_reactor: IReactorCore, poll_interval: float = 2.0
) -> MultiService:
    """The control process's service tree for ``cfg.workers`` (>= 2) workers (the module
    docstring). Fails loudly on anything unusable, as lchat.tap.build_service does; the slot
    sockets are bound here."""
    assert cfg.workers >= 2
    reload = _BoxReload()
    # The hop door's figures: only its requests (with their true labels), which the workers'
    # scrapes leave out; the rest of the data plane's figures are the workers'.
    box = tap.control_plane(
        cfg,
        any_reactor,
        poll_interval,
        reload=reload.table,
        state=FrontDoorState(report="requests"),
    )
    reactor, routes, certs, top = box.reactor, box.routes, box.certs, box.top
    router = tap.control_router(
        top,
        reactor,
        cfg,
        routes,
        box.hibernation,
        certs,
        box.run,
        reload.table,
        spaces=box.fleet,
        stats=box.stats,
        probe=box.probe,
    )
    tap.redirect_listener(top, reactor, cfg, certs)
    here = workers_dir(cfg)
    _private_directory(here)
    workers = InOrder("workers")  # stopped last added first: sockets, then the pool, then hops
    workers.setServiceParent(top)
    # The hop door: control's own router serving what workers hand over.
    hop_path = os.path.join(here, "hop.sock")
    hop = ProxyFactory(
        reactor,
        router,
        evolve(
            cfg.proxy,
            access_log=False,  # (the worker logged the request)
            max_header_bytes=cfg.proxy.max_header_bytes + HOP_HEADER_SLACK,
        ),
        pool=box.pool,
        state=box.pool.state,
        trusted_hop=True,
    )
    hop_door = FrontDoor(reactor, box.pool, [hop], cfg.proxy.drain_grace, metrics=REGISTRY)
    loop = uvloop_reactor.loop_of(reactor)
    FrontListener(loop, f"unix:{hop_path}", hop).setServiceParent(hop_door)
    hop_door.setServiceParent(workers)
    # A worker's first handshake for a host without a certificate asks the issuer here.
    control_sock = os.path.join(here, "control.sock")
    clear_stale_socket(control_sock)
    site = control_site(cert_wanted=certs.issuer.want if certs.issuer is not None else None)
    listen(workers, UNIXServerEndpoint(reactor, control_sock, mode=0o600), site)
    slots = SlotSockets(cfg, cfg.workers)
    specs = [worker_spec(cfg, slot, slots.fds(slot)) for slot in range(1, cfg.workers + 1)]
    store = certs.store
    merged = MergedMetrics(REGISTRY)
    pool = WorkerPool(
        reactor,
        specs,
        ask,
        routes_fingerprint=lambda: routes_version(routes.table),
        certificates=(lambda: len(store.certificates())) if store is not None else None,
        on_ended=merged.ended,  # (a slot's counters carried across its restart)
        kill_timeout=cfg.proxy.drain_grace + KILL_AFTER_GRACE,
    )
    reload.pool, reload.routes = pool, routes
    if certs.store is not None:
        key_file = os.path.join(here, "tls-ticket.key")
        # Written when it starts (before the pool starts a worker), then every 12 h; each new
        # key reaches the workers with the certificates' rescan push.
        ticketkeys.RotatingKeyFile(
            reactor, key_file, pool.certificates_changed, interval=TICKET_KEY_ROTATION
        ).setServiceParent(workers)
        certs.store.subscribe(pool.certificates_changed)
    routes.subscribe(lambda old, new: reload.table_changed())
    pool.setServiceParent(workers)
    slots.setServiceParent(workers)  # (last added: closed first at stop)
    tap.admin_api(
        top,
        reactor,
        cfg,
        box,
        reload=reload.answer,
        metrics=lambda: Deferred.fromCoroutine(_scrape(pool, merged)),
        workers=pool.status,
    )
    tap.log_start(cfg, box)
    _log.info(
        "lchat control process: {n} workers (LCHAT_WORKERS), slot sockets {addresses}, hop {hop}",
        n=cfg.workers,
        addresses=", ".join(slots.describe()) or "none",
        hop=hop_path,
    )
    return top


def worker_spec(cfg: BoxConfig, slot: int, fds: Mapping[str, int]) -> ChildSpec:
    """Slot ``slot``'s worker process: ``twistd lchat-worker`` on this interpreter, its slot
    sockets (``fds``: name -> our descriptor) at the descriptors :data:`FDS` names, its settings
    the control process's snapshot (no env file: an edit to router.env meanwhile never reaches
    a restarted worker), its output the control process's (the journal, once), tagged ``w<k>``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env.update(cfg.settings)
    argv = [
        sys.executable,
        "-c",
        "from twisted.scripts.twistd import run; run()",
        "--nodaemon",
        "--pidfile=",
        "--logger=lchat.worker_tap.log_observer",
        "lchat-worker",
        "--slot",
        str(slot),
        "--fds",
        ",".join(f"{name}={FDS[name]}" for name in fds),
    ]
    return ChildSpec(
        name=str(slot),
        argv=argv,
        env=env,
        ready_socket=worker_socket(cfg, slot),
        fds={FDS[name]: fd for name, fd in fds.items()},
        inherit_output=True,
        noun="worker",
    )


class SlotSockets(Service):
    """The workers' listening sockets, bound when built: per public address the workers serve,
    one ``SO_REUSEPORT`` socket per slot, all on the first one's port (port 0 resolves once). A
    unix address has one socket, shared by every slot. Closed at stop (control's copies: each
    worker closes its own as it drains)."""

    def __init__(self, cfg: BoxConfig, n: int) -> None:
        self._by_name: dict[str, list[socket.socket]] = {}
        self._closed = False
        https = cfg.https_addr is not None
        addresses = {"https": cfg.https_addr}
        if cfg.http_addr is not None and not (https and cfg.http_redirect):
            addresses["http"] = cfg.http_addr
        try:
            for name, address in addresses.items():
                if address is not None:
                    self._by_name[name] = bind_slots(address, n)
        except BaseException:
            self.close()
            raise
        _slot_sockets.set(sum(len({s.fileno() for s in ss}) for ss in self._by_name.values()))

    def fds(self, slot: int) -> dict[str, int]:
        """Slot ``slot``'s (1-based) descriptors, by name (``https``, ``http``)."""
        return {name: socks[slot - 1].fileno() for name, socks in self._by_name.items()}

    def sockets(self) -> dict[str, list[socket.socket]]:
        return {name: list(socks) for name, socks in self._by_name.items()}

    def listening_ports(self) -> list[SlotPort]:
        """One port per address (lchat.tap.listening_ports: tests find the box's ports)."""
        if self._closed:
            return []
        return [SlotPort(socks[0], name == "https") for name, socks in self._by_name.items()]

    def describe(self) -> list[str]:
        out = []
        for name, socks in self._by_name.items():
            where = socks[0].getsockname()
            out.append(f"{name} {where if isinstance(where, str) else where[1]} x{len(socks)}")
        return out

    def stopService(self) -> None:
        super().stopService()
        self.close()

    def close(self) -> None:
        self._closed = True
        for socks in self._by_name.values():
            for sock in socks:
                sock.close()
        _slot_sockets.set(0)


class SlotPort:
    """A slot socket as a listening port looks to diagnostics: its address, and whether it is
    the HTTPS one."""

    def __init__(self, sock: socket.socket, secure: bool) -> None:
        self.secure = secure
        self._host = sock_address(sock)

    def getHost(self) -> Any:  # IPv4Address, IPv6Address or UNIXAddress
        return self._host


def bind_slots(address: str, n: int) -> list[socket.socket]:
    """``n`` listening sockets on ``address`` with ``SO_REUSEPORT`` (port 0: the port the first
    one got, for all); a unix address: one socket, listed ``n`` times."""
    family, _ = parse_address(address)
    first = bind(address, reuse_port=True)
    if family == socket.AF_UNIX:
        return [first] * n
    socks = [first]
    try:
        host, port = first.getsockname()[:2]
        escaped = host.replace(":", "\\:")
        again = f"{'tcp6' if family == socket.AF_INET6 else 'tcp'}:{port}:interface={escaped}"
        socks.extend(bind(again, reuse_port=True) for _ in range(n - 1))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


class _BoxReload:
    """A reload of the box: control's route table, then every ready worker's (their acks
    waited for, bounded by the pool). ``table`` for SIGHUP and the mesh API's writes, ``answer``
    for ``POST /reload`` (which says how many workers are current)."""

    def __init__(self) -> None:
        self.routes: RouteSource | None = None
        self.pool: WorkerPool | None = None
        self._reloading = 0  # box reloads re-reading control's table right now

    def table_changed(self) -> None:
        """Control's route table swapped: every ready worker reloads (no wait), unless a box
        reload is re-reading it: that one asks every worker next and waits for the acks, so a
        worker gets one ``/reload`` per reload, not two. (A swap by the registry poll during it
        is covered by the same ask: each worker re-reads the registry then.)"""
        if self._reloading == 0 and self.pool is not None:
            self.pool.table_changed()

    def table(self, reason: str) -> Deferred[RouteTable]:
        return Deferred.fromCoroutine(self._reload(reason)).addCallback(lambda both: both[0])

    def answer(self, reason: str) -> Deferred[dict[str, Any]]:
        def body(both: tuple[RouteTable, dict[str, Any]]) -> dict[str, Any]:
            table, workers = both
            return {"routes": len(table), "workers": workers}

        return Deferred.fromCoroutine(self._reload(reason)).addCallback(body)

    async def _reload(self, reason: str) -> tuple[RouteTable, dict[str, Any]]:
        assert self.routes is not None and self.pool is not None
        self._reloading += 1
        try:
            table = await self.routes.reload(reason)
        finally:
            self._reloading -= 1
        acks = await self.pool.reload_all(reason)
        return table, acks


async def _scrape(pool: WorkerPool, merged: MergedMetrics) -> bytes:
    """The box's metrics: every ready worker's ``/metrics`` (asked at once, each within the
    pool's scrape timeout; one that does not answer, or answers with something that is not
    Prometheus text, is left out of this round: its gauges go, its counters are carried),
    merged into control's own registry."""
    texts = await pool.scrape()
    for slot, text in sorted(texts.items()):
        try:
            merged.update(slot, text)
        except MetricsTextError as e:
            _log.warn("{why}", why=str(e))
    return generate_latest(merged)


def _private_directory(path: str) -> None:
    """``path`` made, mode 0700 whatever it was (the hop socket trusts whoever can connect)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
