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
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from lchat import hosts
from lchat.config import BoxConfig, ConfigError, read_env_file
from lchat.registry import Registry, RouteSource, RouteTable
from lchat.supervise import ChildSpec, Supervisor

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


class BuiltinUnits(MultiService):
    """Keeps one child per non-hibernating instance row and reports its health to the registry."""

    def __init__(
        self,
        reactor: Any,
        cfg: BoxConfig,
        routes: RouteSource,
        supervisor: Supervisor | None = None,
        run_in_thread: Callable[[Callable[[], Any]], Deferred[Any]] | None = None,
    ) -> None:
        super().__init__()
        self._reactor = reactor
        self._cfg = cfg
        self._routes = routes
        self._registry: Registry = routes.registry
        self._run = run_in_thread or routes.run_in_thread
        self.supervisor = supervisor or Supervisor(reactor, on_state=self._on_state)
        self.supervisor.setServiceParent(self)
        self._spec_errors: dict[str, str] = {}
        self._held_elsewhere: Callable[[str], bool] = lambda host: False
        routes.subscribe(self._changed)

    def defer_to(self, held: Callable[[str], bool]) -> Callable[[str], None]:
        """Leave a host alone while ``held(host)`` (the activator still runs or stops it after
        its hibernate flag was cleared: two children on one socket would fight). Returns the
        function to call when a host is released, which re-applies the table."""
        self._held_elsewhere = held

        def released(host: str) -> None:
            route = self._routes.table.get(host)
            if route is not None and route.kind == "instance" and not route.hibernate:
                self._apply(self._routes.table)

        return released

    def startService(self) -> None:
        super().startService()
        self._apply(self._routes.table)

    def _changed(self, old: RouteTable, new: RouteTable) -> None:
        self._apply(new)

    def _apply(self, table: RouteTable) -> Deferred[None]:
        d = self._run(lambda: self._desired(table))
        d.addCallback(self.supervisor.want)
        d.addErrback(lambda f: _log.failure("could not compute the spaces to run", f))
        return d

    def _desired(self, table: RouteTable) -> dict[str, ChildSpec]:
        """Runs in a thread: reads each row's env file."""
        specs: dict[str, ChildSpec] = {}
        errors: dict[str, str] = {}
        for route in table:
            if route.kind != "instance" or route.hibernate or self._held_elsewhere(route.host):
                continue
            try:
                env = space_env(self._cfg, route.host, route.socket)
                argv = tuple(self._cfg.space_argv(route.host))
            except (EnvFileError, hosts.InvalidHost) as e:
                errors[route.host] = str(e)
                continue
            specs[route.host] = ChildSpec(
                name=route.host, argv=argv, env=env, ready_socket=route.socket
            )
        for host, error in errors.items():
            if self._spec_errors.get(host) != error:
                _log.error("space {host} cannot start: {error}", host=host, error=error)
            row = table.get(host)
            if row is not None and (row.status, row.last_error) != ("failed", error):
                self._registry.set_status(host, "failed", error)
        self._spec_errors = errors
        return specs

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
