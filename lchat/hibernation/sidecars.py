"""Bot sidecars of hibernating spaces: a staged ``<data>/<host>-bot.env`` makes the activator run
the space's bot beside it while it is awake, and stop it first when it sleeps
(docs/hibernation.md, "Bot sidecars"). Supervised with restarts like a builtin unit; a sidecar
that cannot start never fails its space's wake ("members before bots")."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat import builds, hosts
from lchat.child import ChildSpec
from lchat.config import BoxConfig
from lchat.hibernation.floor import sidecar_argv
from lchat.hibernation.space import Space, sidecar_name
from lchat.supervise import Supervisor
from lchat.threads import RunInThread
from lchat.units import space_env, space_user

_log = Logger(namespace="lchat.activator")

STEP_FAILURES = Counter(
    "lchat_sleep_step_failures_total", "Sleep steps that failed or ran out of time", ["step"]
)


class Sidecars(Service):
    """The sidecars of awake spaces, kept by one :class:`Supervisor`."""

    def __init__(
        self,
        reactor: IReactorTime,
        cfg: BoxConfig,
        run_in_thread: RunInThread,
        supervisor: Supervisor,
    ) -> None:
        self._reactor = reactor
        self._cfg = cfg
        self._run = run_in_thread
        self._supervisor = supervisor
        self._specs: dict[str, ChildSpec] = {}

    def startService(self) -> None:
        super().startService()
        self._supervisor.startService()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return self._supervisor.stopService()

    def status(self, host: str) -> dict[str, Any] | None:
        child = self._supervisor.status().get(sidecar_name(host))
        return None if child is None else {"state": child.state, "pid": child.pid}

    def start(self, space: Space, still_wanted: Callable[[], bool]) -> None:
        """Run ``space``'s sidecar if one is staged; ``still_wanted()`` is asked once the env
        file is read (the space may have stood down meanwhile)."""
        host = space.host
        bot_env = hosts.bot_env_path(self._cfg.data_dir, host)

        def build() -> ChildSpec | None:
            if not os.path.exists(bot_env):
                return None
            argv = sidecar_argv(
                builds.space_argv(self._cfg.sidecar_command, host, sidecar=True), space.lifted_to
            )
            if argv is None:
                _log.warn(
                    "activator: {host}: woke on its floor's build {build}, which has no bot "
                    "sidecar: its sidecar is not started (the link's is older)",
                    host=host,
                    build=space.lifted_to,
                )
                return None
            env = space_env(self._cfg, host, space.socket, env_file=bot_env)
            env["LCHAT_DB"] = space.db
            return ChildSpec(
                name=sidecar_name(host),
                argv=tuple(argv),
                env=env,
                user=space_user(self._cfg, host, space.socket),  # the space's own user
            )

        def got(spec: ChildSpec | None) -> None:
            if spec is None or not still_wanted():
                return
            _log.info("activator: {host} starting its bot sidecar", host=host)
            self._want(host, spec)

        def failed(f: Failure) -> None:
            _log.error(
                "activator: {host} sidecar not started: {error}",
                host=host,
                error=f.getErrorMessage(),
            )

        self._run(build).addCallbacks(got, failed)

    async def stop(self, host: str, budget: float) -> None:
        """Stop ``host``'s sidecar, if it runs one; returns once it exited, or after ``budget``
        seconds (then counted and logged)."""
        name = sidecar_name(host)
        if name not in self._specs:
            return
        child = self._supervisor.child(name)
        self._want(host, None)
        if child is not None:
            ended = child.ended
            ended.addTimeout(budget, self._reactor)
            try:
                await ended
            except CancelledError:
                STEP_FAILURES.labels("sidecar").inc()
                _log.warn("activator: {host} sidecar did not stop in time", host=host)

    def _want(self, host: str, spec: ChildSpec | None) -> None:
        name = sidecar_name(host)
        if spec is None:
            self._specs.pop(name, None)
        else:
            self._specs[name] = spec
        self._supervisor.want(self._specs)
