"""``lchat add-instance``'s last step: an always-on space started by its unit and health-checked
(systemd), or by the router's supervisor, which records the verdict in the row (builtin)."""

from __future__ import annotations

from attrs import field, frozen

from lchat import admin_client
from lchat.admin_client import RouterAdmin
from lchat.config import BoxConfig
from lchat.handover import HandoverError
from lchat.handover.hibernate import POLL_INTERVAL, health_check, one_line
from lchat.handover.router import STATUS_TIMEOUT, Router, Say, absent
from lchat.handover.seams import Clock, Units
from lchat.registry import Registry, Route
from lchat.systemd_units import UnitError


@frozen
class Start:
    cfg: BoxConfig
    registry: Registry
    router: Router
    units: Units
    clock: Clock = field(factory=Clock)

    def __call__(self, host: str, socket: str, timeout: float, *, wait: bool) -> int:
        if self.units.systemd:
            return self._with_systemd(host, socket, timeout, wait)
        return self._with_router(host, timeout, wait)

    def _with_systemd(self, host: str, socket: str, timeout: float, wait: bool) -> int:
        registry, router, say = self.registry, self.router, self.router.say
        try:
            self.units.start(host, socket)
        except UnitError as e:
            registry.set_status(host, "failed", str(e))
            router.notify()
            raise HandoverError(f"{host} failed: {e}") from e
        if not wait:
            # Nobody else would ever mark it ready: under systemd the router only routes, it does
            # not watch units. systemd keeps the unit running; the router's dial retry covers its
            # first seconds. So it is routed now, unchecked (without --no-wait it is checked).
            registry.set_status(host, "ready")
            router.notify()
            say.out(
                f"{host}: started {self.units.name(host)}; routed without a health check (--no-wait)"
            )
            return 0
        # A row still "creating": a verdict either way is written and the router told.
        return health_check(self.units, router, registry, host, socket, timeout, record=True)

    def _with_router(self, host: str, timeout: float, wait: bool) -> int:
        """Builtin units: the router's supervisor runs the child and records its health."""
        router, say = self.router, self.router.say
        try:
            router.try_reload()
        except admin_client.Unreachable as e:
            if absent(e):
                say.warn(
                    f"router is not running ({self.cfg.admin_socket}): {host} will start when it does"
                )
                return 0
            say.note(f"cannot reach the router ({e}); its registry poll will start {host}")
        if not wait:
            say.out(f"{host} is registered; the router is starting it")
            return 0
        route = self._wait_for_verdict(host, timeout)
        if route.status == "ready":
            # The supervisor wrote "ready" and then asked its own table to reload: a request sent
            # the moment we saw the row could still meet the old table (a 503). A reload asked
            # for now answers once a table read after the row was ready is in force.
            router.notify()
            say.out(f"{host} is ready")
            return 0
        if route.status == "failed":
            raise HandoverError(
                f"{host} failed: {one_line(route.last_error) or 'no error recorded'}"
            )
        raise HandoverError(f"{host} is still {route.status} after {timeout:g}s")

    def _wait_for_verdict(self, host: str, timeout: float) -> Route:
        deadline = self.clock.monotonic() + timeout
        while True:
            route = self.registry.get(host)
            if route is None:
                raise HandoverError(f"{host} was removed while it was starting")
            if route.status != "creating" or self.clock.monotonic() >= deadline:
                return route
            self.clock.sleep(POLL_INTERVAL)


def warn_if_born_dark(cfg: BoxConfig, admin: RouterAdmin, host: str, say: Say) -> None:
    """The seed's incident: a create whose settings lack the mesh, on a box whose router is a
    mesh member, does not fan out, and the space is born dark on its peers (404 there)."""
    if cfg.mesh is not None:
        return
    try:
        response = admin.status(STATUS_TIMEOUT)
        mesh = response.json().get("mesh") if response.status == 200 else None
    except (admin_client.Unreachable, admin_client.ProtocolError, ValueError, AttributeError):
        return
    if not isinstance(mesh, dict):
        return
    right = mesh.get("env_file") or "the router's env file"
    say.warn(
        f"the running router is a mesh member, but {cfg.env_file} has no LCHAT_MESH_SELF: "
        f"{host} was not replicated to its peers, which answer 404 for it whenever they own it. "
        f"Use `--env-file {right}` for creates on this box; catch each peer up now with "
        f"`lchat mesh-seed <peer URL> --env-file {right}`"
    )
