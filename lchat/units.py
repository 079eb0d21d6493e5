"""How non-hibernating spaces are kept running: by systemd, or by the router itself (``builtin``).

With ``LCHAT_UNITS=systemd`` the CLI starts and stops ``lchat@<host>`` units and the router only
routes. With ``builtin`` (containers, ``make run``) the router runs every non-hibernating instance
row as its own child through :class:`lchat.supervise.Supervisor`, and writes the child's health back
to the row: ``ready`` once it answers, ``failed`` with ``last_error`` when it cannot start.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat import builds, hosts, isolation
from lchat.child import ChildSpec
from lchat.config import BoxConfig, ConfigError, read_env_file
from lchat.isolation import IsolationError, SpaceUser
from lchat.registry import Registry, Route, RouteTable
from lchat.routesource import RouteSource
from lchat.supervise import Supervisor
from lchat.threads import RunInThread

_log = Logger(namespace="lchat.units")

# What a child inherits from the router's own environment; everything else comes from its env file.
INHERITED = ("PATH", "LANG", "LC_ALL", "TZ", "HOME", "PYTHONPATH", "TMPDIR")


class EnvFileError(Exception):
    pass


def space_env(
    cfg: BoxConfig,
    host: str,
    socket: str,
    environ: Mapping[str, str] = os.environ,
    env_file: str | None = None,
) -> dict[str, str]:
    """The complete environment of ``host``'s space: inherited basics, its env file, the contract.

    The env file is read fresh each time (an operator may rotate a token) and refused when group or
    others can read it: it holds the space's only plaintext admin token. ``env_file``: another
    file than ``<data>/<host>.env`` (a staged sidecar's ``<host>-bot.env``).
    """
    path = env_file or hosts.env_path(cfg.data_dir, host)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise EnvFileError(f"env file {path} is missing (add-instance writes it)") from None
    if mode & 0o077:
        raise EnvFileError(
            f"env file {path} is readable by group or others (mode {mode & 0o777:o}): "
            f"run chmod 600 {path}"
        )
    try:
        file_env = read_env_file(path, must_exist=True)
    except ConfigError as e:
        raise EnvFileError(str(e)) from e
    env = {k: environ[k] for k in INHERITED if k in environ}
    env.update(file_env)
    env.update(
        LCHAT_HOST=host,
        LCHAT_SOCKET=socket,
        LCHAT_DB=hosts.db_path(cfg.data_dir, host),
    )
    return env


def space_user(cfg: BoxConfig, host: str, socket: str) -> SpaceUser | None:
    """Who ``host``'s space runs as on a box that isolates its spaces (its directories made
    ready, lchat.isolation.prepare; raises IsolationError); None: as the router."""
    if not hosts.isolated(cfg.data_dir):
        return None
    return isolation.prepare(cfg.data_dir, cfg.space_uids, host, socket)


class Claims:
    """Who runs a space and its database right now: the router's one ownership registry.

    The activator claims a host from the start of a wake to the end of its stand-down; while it
    does, builtin units leave the host alone (after a row's hibernate flag is cleared, two
    children on one socket would fight) and the fleet backup runs no replicator on its database.
    A party that may run a database registers how it lets go (:meth:`on_hand_over`): a wake
    awaits :meth:`hand_over` before it touches the database, so one database never has two
    replicators. :meth:`release` gives the host back to every listener. Reactor thread only."""

    def __init__(self) -> None:
        self._hosts: set[str] = set()
        self._released: list[Callable[[str], object]] = []
        self._let_go: list[Callable[[str, str], Deferred[None]]] = []

    def __contains__(self, host: object) -> bool:
        return host in self._hosts

    def claim(self, host: str) -> None:
        self._hosts.add(host)

    def on_hand_over(self, let_go: Callable[[str, str], Deferred[None]]) -> None:
        """``let_go(host, database path)`` fires once the registering party runs nothing on
        that path, and keeps off it until the host's claim is released."""
        self._let_go.append(let_go)

    def hand_over(self, host: str, db_path: str) -> Deferred[None]:
        """Fires once no other party runs ``db_path`` (``host`` claimed): every registered
        :meth:`on_hand_over` has let go."""
        if len(self._let_go) == 1:
            return self._let_go[0](host, db_path)
        waits: Deferred[Any] = gatherResults([let_go(host, db_path) for let_go in self._let_go])
        return waits.addCallback(lambda _: None)

    def release(self, host: str) -> None:
        """``host`` is no longer run elsewhere: tell every listener."""
        if host in self._hosts:
            self._hosts.discard(host)
            for listener in list(self._released):
                try:
                    listener(host)
                except Exception:
                    _log.failure("claims listener failed for {host}", host=host)

    def on_release(self, listener: Callable[[str], object]) -> None:
        self._released.append(listener)


class BuiltinUnits(MultiService):
    """Keeps one child per non-hibernating instance row (not claimed by the activator) and reports
    its health to the registry."""

    def __init__(
        self,
        reactor: IReactorTime,
        cfg: BoxConfig,
        routes: RouteSource,
        claims: Claims,
        run_in_thread: RunInThread,
        supervisor: Supervisor | None = None,
    ) -> None:
        super().__init__()
        self._cfg = cfg
        self._routes = routes
        self._registry: Registry = routes.registry
        self._run = run_in_thread
        self._claims = claims
        self.supervisor = supervisor or Supervisor(reactor, on_state=self._on_state)
        self.supervisor.setServiceParent(self)
        self._spec_errors: dict[str, str] = {}
        # Each _apply's desired set is built in a thread: two in flight may finish in either
        # order. Only the newest is handed to the supervisor (an older one landing last would
        # stop a space a newer table wants: seen when `hibernate --off` raced a cancelled wake).
        self._applying = 0
        routes.subscribe(lambda old, new: self._apply(new))
        claims.on_release(self._released)

    def _released(self, host: str) -> None:
        route = self._routes.table.get(host)
        if route is not None and route.kind == "instance" and not route.hibernate:
            self._apply(self._routes.table)

    def startService(self) -> None:
        super().startService()
        self._apply(self._routes.table)

    def _apply(self, table: RouteTable) -> Deferred[None]:
        # Which rows is decided here, on the reactor thread (the claims are the activator's
        # state); only reading their env files happens in a thread.
        rows = [r for r in table if r.always_on_here and r.host not in self._claims]
        cfg = self._cfg
        self._applying += 1
        d = self._run(lambda: _specs(cfg, rows))
        d.addCallback(self._want, table, self._applying)
        d.addErrback(lambda f: _log.failure("could not compute the spaces to run", f))
        return d

    def _want(
        self,
        built: tuple[dict[str, ChildSpec], dict[str, str]],
        table: RouteTable,
        generation: int,
    ) -> None:
        if generation != self._applying:
            return  # a newer table's set is on its way (or was applied already): it decides
        specs, errors = built
        for host, error in errors.items():
            if self._spec_errors.get(host) != error:
                _log.error("space {host} cannot start: {error}", host=host, error=error)
            row = table.get(host)
            if row is not None and (row.status, row.last_error) != ("failed", error):
                self._write(host, "failed", error)
        self._spec_errors = errors
        self.supervisor.want(specs)

    def _on_state(self, host: str, state: str, detail: str) -> None:
        route = self._routes.table.get(host)
        if route is None:
            return
        if state == "ready" and (route.status != "ready" or route.last_error):
            self._write(host, "ready", "")
        elif state == "failed" and (route.status, route.last_error) != ("failed", detail):
            self._write(host, "failed", detail)

    def _write(self, host: str, status: Any, detail: str) -> None:
        d = self._run(lambda: self._registry.set_status(host, status, detail))
        d.addCallback(lambda _: self._routes.reload(f"{host} is {status}"))
        d.addErrback(
            lambda f: _log.failure("could not record {host} as {s}", f, host=host, s=status)
        )


def _specs(cfg: BoxConfig, rows: list[Route]) -> tuple[dict[str, ChildSpec], dict[str, str]]:
    """Runs in a thread: each row's child, from its env file; or why it cannot start."""
    specs: dict[str, ChildSpec] = {}
    errors: dict[str, str] = {}
    for route in rows:
        try:
            env = space_env(cfg, route.host, route.socket)
            argv = tuple(builds.space_argv(cfg.space_command, route.host))
            user = space_user(cfg, route.host, route.socket)
        except (EnvFileError, hosts.InvalidHost, IsolationError, OSError) as e:
            errors[route.host] = str(e)
            continue
        specs[route.host] = ChildSpec(
            name=route.host, argv=argv, env=env, ready_socket=route.socket, user=user
        )
    return specs, errors
