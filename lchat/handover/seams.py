"""The four seams a hand-over command works through, each a Protocol with its thin real adapter.

- :class:`lchat.admin_client.RouterAdmin`: the running router's admin socket (:mod:`lchat.admin`),
  one call each; raises :class:`lchat.admin_client.Unreachable` (nothing listens) or ``ProtocolError``.
- :class:`Units`: how this box runs a space outside the activator (builtin: the router's
  supervisor; systemd: ``lchat@<host>``), and its socket (listened on? answering?).
- :class:`Peers`: the mesh's fan-out of a row to the live peers (never raises).
- :class:`Bucket`: one LIST of the hibernation bucket (an :class:`lchat.objstore.ObjectStore`).

``lchat relocate`` asks more of the mesh (:class:`Mesh`: the live members; :class:`PeerHolds`: a
peer's router asked to sleep a space it holds and keep it asleep) and of the buckets
(:class:`RegionStores`: the two it copies between), and has a fifth, :class:`AddressRecords` (DNS).

Tests pass in-memory fakes for the first three and a real ``FileStore`` for the bucket.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from attrs import frozen

from lchat import admin_client, systemd_units
from lchat.config import BoxConfig
from lchat.mesh import client as mesh_client
from lchat.mesh.members import Member
from lchat.objstore import ObjectInfo, ObjectStore
from lchat.objstore.where import Where
from lchat.reactors import Reactor
from lchat.registry import Route
from lchat.threads import RunInThread, thread_runner

Runner = Callable[[Callable[[Reactor], Coroutine[Any, Any, Any]], float], Any]


class Units(Protocol):
    @property
    def systemd(self) -> bool: ...  # LCHAT_UNITS=systemd: the CLI drives them, else the router

    def name(self, host: str, *, sidecar: bool = False) -> str: ...
    def stop(self, host: str, *, sidecar: bool = False) -> None: ...  # raises UnitError
    def start(self, host: str, socket: str) -> None: ...  # its user and drop-ins, then the unit
    def start_sidecar(self, host: str) -> None: ...
    def listening(self, socket: str) -> bool: ...
    def answers(self, socket: str, host: str, timeout: float) -> bool: ...


class Peers(Protocol):
    @property
    def active(self) -> bool: ...  # the mesh is on (LCHAT_MESH_SELF)

    def push(self, route: Route) -> object: ...
    def replicates(self, route: Route) -> bool: ...


class Bucket(Protocol):
    def list(self, prefix: str) -> list[ObjectInfo]: ...  # ObjectStoreError, TimeoutError


@frozen
class Clock:
    """Blocking time for a synchronous command: the real one, or a test's that sleeps at once."""

    monotonic: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    wall: Callable[[], float] = time.time  # unix seconds, for records people read


@frozen
class BoxUnits:
    """:class:`Units` of this box: ``systemctl`` and the spaces' unix sockets."""

    cfg: BoxConfig
    poll: float = 0.2

    @property
    def systemd(self) -> bool:
        return self.cfg.units == "systemd"

    def name(self, host: str, *, sidecar: bool = False) -> str:
        return systemd_units.unit_name(host, sidecar=sidecar)

    def stop(self, host: str, *, sidecar: bool = False) -> None:
        systemd_units.disable_now(host, sidecar=sidecar)

    def start(self, host: str, socket: str) -> None:
        systemd_units.install_space(self.cfg, host, socket)
        if self.cfg.backup is not None:
            # Wanted by lchat@<host>: it starts with the space, and its writes keep shipping
            # while the router is down (docs/backup.md).
            systemd_units.enable_backup(host)
        systemd_units.enable_now(host)

    def start_sidecar(self, host: str) -> None:
        systemd_units.enable_now(host, sidecar=True)

    def listening(self, socket: str) -> bool:
        return admin_client.has_listener(socket)

    def answers(self, socket: str, host: str, timeout: float) -> bool:
        return admin_client.wait_for_version(socket, host, timeout, self.poll)


@frozen
class FanOut:
    """:class:`Peers` as the CLI's mesh fan-out (``lchat.cli.mesh``) wired in by the CLI."""

    active: bool
    push: Callable[[Route], object]  # what it returns is not used
    replicates: Callable[[Route], bool]


@frozen
class StoreBucket:
    """:class:`Bucket` over an ObjectStore opened for each LIST on a reactor of its own
    (``run``: ``lchat.cli.runner.run``; tests: one that runs it inline)."""

    open: Callable[[Reactor], Awaitable[ObjectStore]]
    run: Runner
    budget: float = 60.0  # the bucket's credentials and one LIST

    def list(self, prefix: str) -> list[ObjectInfo]:
        async def main(reactor: Reactor) -> list[ObjectInfo]:
            store = await self.open(reactor)
            try:
                return await store.list(prefix)
            finally:
                await store.close()

        listing: list[ObjectInfo] = self.run(main, self.budget)
        return listing


# --- lchat relocate -----------------------------------------------------------------------------


class Mesh(Protocol):
    """What ``lchat relocate`` asks of the mesh: the live members (each box's region), and a
    push whose per-peer outcomes are reported, one line each."""

    def members(self) -> list[Member]: ...  # ObjectStoreError, ConfigError, TimeoutError
    def push_reporting(self, route: Route, report: Callable[[str], None]) -> object: ...


@frozen
class MeshFanOut:
    """:class:`Mesh` as the CLI's mesh reads and fan-out (``lchat.cli.mesh``)."""

    members: Callable[[], list[Member]]
    push_reporting: Callable[[Route, Callable[[str], None]], object]


@frozen
class RegionStores:
    """The region buckets ``lchat relocate`` copies between: ``open(reactor, where, what)`` on
    the reactor ``run`` gives the copy (``lchat.cli.runner.run``; tests: one that runs it
    inline), and the thread runner a copied file streams through (tests: one that runs at once)."""

    open: Callable[[Reactor, Where, str], Awaitable[ObjectStore]]
    run: Runner
    threads: Callable[[Reactor], RunInThread] = thread_runner


class PeerHolds(Protocol):
    """A peer's router, asked through its mesh API to sleep a space and hold it asleep
    (``POST /api/mesh/hold``), then to lift the hold (``POST /api/mesh/release``): each call's
    (status, JSON answer), any status; :class:`lchat.mesh.client.MeshCallError` when no answer
    came within ``timeout``."""

    async def hold(
        self,
        reactor: Reactor,
        peer_url: str,
        host: str,
        seconds: float,
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[int, dict[str, Any]]: ...

    async def release(
        self,
        reactor: Reactor,
        peer_url: str,
        host: str,
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[int, dict[str, Any]]: ...


@frozen
class MeshHolds:
    """:class:`PeerHolds` over :mod:`lchat.mesh.client` with the box's mesh token and CA."""

    cfg: BoxConfig

    async def hold(
        self,
        reactor: Reactor,
        peer_url: str,
        host: str,
        seconds: float,
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[int, dict[str, Any]]:
        mesh = self.cfg.mesh
        assert mesh is not None
        return await mesh_client.hold_space(
            peer_url,
            mesh.token,
            host,
            seconds,
            ca_file=mesh.ca_file,
            timeout=timeout,
            reactor=reactor,
        )

    async def release(
        self,
        reactor: Reactor,
        peer_url: str,
        host: str,
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[int, dict[str, Any]]:
        mesh = self.cfg.mesh
        assert mesh is not None
        return await mesh_client.release_space(
            peer_url, mesh.token, host, ca_file=mesh.ca_file, timeout=timeout, reactor=reactor
        )


class AddressRecords(Protocol):
    """A host's own address records (``relocate --move-dns``); each call raises
    ``HandoverError`` saying what to fix."""

    def check(self, host: str) -> None: ...  # before anything moves; no I/O
    def point(
        self, host: str, member_urls: list[str]
    ) -> tuple[str, dict[str, Any]]: ...  # line, JSON
