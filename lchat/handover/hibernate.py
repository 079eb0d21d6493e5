"""``lchat hibernate <host> --on`` and ``--off``: a space handed from its unit to the router's
activator and back, over the four seams (:mod:`lchat.handover.seams`).

Invariants: the host stays serveable throughout (a request in a socket-dead gap rides the
router's dial retry); a refusal before the first change leaves the row, the units and the peers
as they were; ``--off`` never hands the unit a database older than the bucket's newest copy.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import attrs
from attrs import field, frozen

from lchat import admin_client, envfile, hosts
from lchat.admin_client import RouterAdmin
from lchat.config import BoxConfig
from lchat.handover import HandoverError
from lchat.handover.freshness import Freshness, foreign_bucket, read_freshness
from lchat.handover.router import Router, Say, absent, json_body
from lchat.handover.seams import Bucket, Clock, Peers, Units
from lchat.hibernation.localdb import LEASE_SUFFIX, MARKER_SUFFIX
from lchat.objstore import ObjectStoreError
from lchat.registry import Registry, Route
from lchat.systemd_units import UnitError

# POST /sleep answers once the activator has stopped the sidecar, asked next-due, stopped the space,
# flushed and released the lease: each step has its own budget (activator.Budgets), summed here.
SLEEP_TIMEOUT = 150.0
POLL_INTERVAL = 0.2
# The activator's states of a hibernating space (docs/design.md §7); "asleep" is the absence of one.
ACTIVATOR_BUSY = ("waking", "awake", "stopping")


def one_line(text: str) -> str:
    return " ".join(text.split())


def refuse_if_backed_up(listed_in: str | None, host: str, db: str, unchanged: str) -> None:
    """Two replicators on one database corrupt each other's state (the seed's sharpest edge).
    ``listed_in``: the box-wide backup config when it lists ``db``, else None."""
    if listed_in is not None:
        raise HandoverError(
            f"refusing: the box-wide backup replicator still tracks {db} ({listed_in} lists "
            f"it), and two replicators on one database corrupt each other: regenerate the backup "
            f"config without {host} (re-run the fleet backup script), then retry ({unchanged})"
        )


def hand_env_files_to_router(cfg: BoxConfig, host: str, say: Say, *, quiet: bool = False) -> None:
    """chown ``<host>.env`` (and a staged ``<host>-bot.env``) to the router's user, mode private.
    ``quiet``: say nothing when nothing needed doing."""
    uid, gid = envfile.owner_of_router(cfg.admin_socket, cfg.registry, cfg.data_dir)
    env = hosts.env_path(cfg.data_dir, host)
    for path in (env, hosts.bot_env_path(cfg.data_dir, host)):
        if not os.path.exists(path):
            if path == env:
                say.warn(f"{path} is missing: the space cannot start without it")
            continue
        right, what = envfile.hand_to(path, uid, gid)
        if not (right and quiet):
            say.out(f"{host}: {os.path.basename(path)}: {what}")


def forget_clean_sleep(db: str) -> None:
    """Remove the activator's clean-sleep marker: it vouches that the local database is exactly
    the bucket's newest state (the activator then resumes the replica without a snapshot), which
    stops being true as soon as anything else writes the database."""
    for record in (MARKER_SUFFIX, LEASE_SUFFIX):  # (the lease record: no lease writes it now)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(db + record)


def health_check(
    units: Units,
    router: Router,
    registry: Registry,
    host: str,
    socket: str,
    timeout: float,
    *,
    record: bool,
) -> int:
    """GET /api/version on its socket until it answers. ``record``: write the verdict to the row
    (systemd; with builtin units the router's supervisor does that itself)."""
    if units.answers(socket, host, timeout):
        if record:
            route = registry.get(host)
            if route is not None and (route.status != "ready" or route.last_error):
                registry.set_status(host, "ready")
                router.notify()
        router.say.out(f"{host} is ready")
        return 0
    route = registry.get(host)
    if not record and route is not None and route.status == "failed":
        raise HandoverError(f"{host} failed: {one_line(route.last_error) or 'no error recorded'}")
    error = f"not answering on {socket} after {timeout:g}s"
    if record:
        registry.set_status(host, "failed", error)
        router.notify()
    raise HandoverError(f"{host} failed: {error}")


@frozen
class Hibernation:
    """``hibernate --on`` (:meth:`on`) and ``--off`` (:meth:`off`) of one box's spaces.
    ``backed_up(db)``: the box-wide backup config when it lists ``db``, else None."""

    cfg: BoxConfig
    registry: Registry
    admin: RouterAdmin
    units: Units
    peers: Peers
    bucket: Bucket | None  # the hibernation bucket (None: LCHAT_HIBERNATE_BUCKET unset)
    say: Say
    backed_up: Callable[[str], str | None]
    clock: Clock = field(factory=Clock)

    @property
    def router(self) -> Router:
        return Router(self.admin, self.say)

    # --- --on ------------------------------------------------------------------------------------

    def on(self, route: Route, timeout: float) -> int:
        """The seed's order: env file ownership; the flag; refuse while the backup replicator
        tracks the database; stop and disable the units; reload; one warm request."""
        host, say = route.host, self.say
        if self.cfg.hibernate is None:
            raise HandoverError(
                f"hibernating {host} needs a hibernation bucket: set LCHAT_HIBERNATE_BUCKET in the "
                f"router's env file and restart the router, then retry"
            )
        db = route.database(self.cfg.data_dir)
        # 1. The activator reads the env file as the router's user; systemd read it as root.
        hand_env_files_to_router(self.cfg, host, say)
        # Looked at before anything changes, so that the usual refusal leaves the row untouched.
        refuse_if_backed_up(self.backed_up(db), host, db, "the hibernate flag is unchanged")
        # 2. The flag.
        if route.hibernate:
            say.out(f"{host}: already hibernating (flag on); checking the remaining steps")
        else:
            # The unit may have written since any earlier sleep: the activator must not trust a
            # marker.
            forget_clean_sleep(db)
            self.registry.update(host, hibernate=True, status="ready", last_error="")
            say.out(f"{host}: hibernate flag set")
        # 3. Checked again with the flag set: a backup config regenerated from now on skips it.
        unchanged = "unchanged" if route.hibernate else "back as it was"
        try:
            refuse_if_backed_up(self.backed_up(db), host, db, f"the hibernate flag is {unchanged}")
        except HandoverError:
            if not route.hibernate:
                self.registry.update(
                    host, hibernate=False, status=route.status, last_error=route.last_error
                )
                say.note(f"{host}: the hibernate flag was set and is off again")
            raise
        # 4. The units: the sidecar first (an orphaned bot would knock on a dead socket).
        if self.units.systemd:
            has_bot = os.path.exists(hosts.bot_env_path(self.cfg.data_dir, host))
            for sidecar in (True, False) if has_bot else (False,):
                try:
                    self.units.stop(host, sidecar=sidecar)
                except UnitError as e:
                    raise HandoverError(
                        f"{e}; {host} is flagged hibernating: fix the unit and re-run "
                        f"`lchat hibernate {host} --on` (or `--off` to hand it back)"
                    ) from e
                say.out(f"{host}: stopped and disabled {self.units.name(host, sidecar=sidecar)}")
        else:
            say.out(f"{host}: the router stops running it as a builtin unit on reload")
        # 5. Reload.
        if not self.router.reload():
            say.warn(f"the router is not running: {host} wakes on its first request once it runs")
            return 0
        say.out(f"{host}: router reloaded")
        # A builtin child is stopped by the reload, asynchronously: the activator's space would
        # refuse to start over its socket. systemd's `disable --now` has already waited for it.
        self._wait_released(route.socket, host, timeout, handover=True)
        # 6. One warm request: the activator wakes it now rather than on a member's first one.
        code = self._warm(host, timeout)
        # 7. The peers (mesh): the hibernating row replaces whatever they hold (a lives-elsewhere
        # row, or nothing). Only once it is awake here, under its lease, with its replica in the
        # bucket: a peer that owns it by hash forwards to the lease holder, and never wakes it
        # from a bucket this box has not written yet. Until then the peers' lives-elsewhere rows
        # forward here.
        self._fan_out_flip(host)
        return code

    def _warm(self, host: str, timeout: float) -> int:
        say = self.say
        try:
            response = self.admin.wake(host, timeout)
        except admin_client.Unreachable as e:
            say.warn(
                f"cannot reach the router for the warm request ({e}): {host} wakes on its first one"
            )
            return 0
        except admin_client.ProtocolError as e:
            raise HandoverError(
                f"{host}: no answer to the warm request within {timeout:g}s ({e}); the router "
                f"goes on waking it (see `lchat instances`)"
            ) from e
        body = json_body(response)
        if response.status == 200:
            say.out(
                f"{host}: awake after the warm request ({body.get('seconds', '?')}s); hibernating"
            )
            return 0
        if response.status == 409:
            say.warn(
                f"the running router has no activator (LCHAT_HIBERNATE_BUCKET is unset in its "
                f"environment): {host} answers 503 until the router is restarted with it"
            )
            return 0
        if response.status == 404:
            say.warn(
                f"the router does not see {host} as hibernating yet "
                f"({body.get('error', 'not found')}); it picks the change up within seconds and "
                f"wakes it on its first request"
            )
            return 0
        error = body.get("error") or f"the router answered {response.status}"
        raise HandoverError(f"{host}: the warm request failed: {error}")

    def _fan_out_flip(self, host: str) -> None:
        """``--on``'s fan-out: the row as it is now, to the live peers, once the running router
        says the space is awake here; otherwise say how the peers catch up."""
        if not self.peers.active:
            return
        route = self.registry.get(host)
        if route is None or not route.hibernate:
            return
        hosts_now = (self.router.status() or {}).get("hosts")
        entry = hosts_now.get(host) if isinstance(hosts_now, dict) else None
        if isinstance(entry, dict) and entry.get("state") == "awake":
            self.peers.push(route)
        elif self.peers.replicates(route):
            self.say.note(
                f"mesh: {host} is not awake here yet, so its peers were not told: they keep "
                f"forwarding it here; once it has woken here, run `lchat hibernate {host} --on` "
                f"again or `lchat mesh-seed <peer>`"
            )

    # --- --off -----------------------------------------------------------------------------------

    def off(self, route: Route, timeout: float) -> int:
        """The mirror image: the activator checkpoints the space to the bucket, releases its lease
        and stops it; the flag is cleared; once the socket has no listener the unit starts again,
        is health-checked, and then its sidecar unit starts."""
        cfg, host, socket, say, units = self.cfg, route.host, route.socket, self.say, self.units
        systemd = units.systemd
        expected = hosts.socket_path(cfg.run_dir, host, isolated=hosts.isolated(cfg.data_dir))
        if systemd and (socket != expected or not expected.endswith(f"/{host}.sock")):
            raise HandoverError(
                f"{host}: its socket {socket} is not {expected}, the path "
                f"lchat@.service uses; systemd units cannot run it (LCHAT_UNITS=builtin can)"
            )
        db = route.database(cfg.data_dir)
        if route.hibernate:
            # Before anything changes: a refusal here (the bucket cannot be read, the newest copy
            # is in the bucket but no router runs to fetch it) leaves the peers and the row as
            # they were.
            self._precheck_newest_copy(route, db)
        # 0. The peers (mesh) first: they swap their hibernating row for the lives-elsewhere
        # shape, forward its requests here from now on, and put it to sleep (flushed, lease
        # released) where it was awake. After this a peer can no longer wake it while the unit
        # runs here.
        self.peers.push(attrs.evolve(route, hibernate=False, next_due=0))
        if route.hibernate:
            # 1. Asleep now, while the flag is still on: /sleep answers once flushed, released.
            self._sleep_now(host)
            # An instance refuses to start over a socket that still has a listener.
            self._wait_released(socket, host, timeout)
            # 1b. The unit serves whatever file it finds: the newest copy must be here first (the
            # space may last have run on another box, and the peers have just flushed it).
            self._newest_copy_here(host, db, timeout)
            # The unit writes the database from now on: the marker of a clean sleep stops being
            # true.
            forget_clean_sleep(db)
            self.registry.update(host, hibernate=False, next_due=0)
            say.out(f"{host}: hibernate flag cleared")
        else:
            say.out(f"{host}: not hibernating (flag already off); checking the remaining steps")
        # 2. Reload: the activator lets go of it (had a request woken it again, the reload
        # sleeps it).
        router_up = self.router.reload()
        if router_up:
            say.out(f"{host}: router reloaded")
        if not systemd:
            if not router_up:
                say.warn(f"the router is not running: it starts {host} when it starts")
                return 0
            # 3. Builtin: the router starts it on the reload and records its health in the row.
            return health_check(
                units, self.router, self.registry, host, socket, timeout, record=False
            )
        if route.hibernate:
            self._wait_released(socket, host, timeout)
        # 3. systemd: the unit, its health, then the sidecar unit.
        try:
            self.units.start(host, socket)
        except UnitError as e:
            self.registry.set_status(host, "failed", str(e))
            self.router.notify()
            raise HandoverError(f"{host} failed: {e}") from e
        say.out(f"{host}: enabled and started {self.units.name(host)}")
        code = health_check(units, self.router, self.registry, host, socket, timeout, record=True)
        if os.path.exists(hosts.bot_env_path(cfg.data_dir, host)):
            self.units.start_sidecar(host)
            say.out(f"{host}: enabled and started {self.units.name(host, sidecar=True)}")
        return code

    def _freshness(self, host: str, db: str) -> Freshness:
        """The local database against the bucket (one LIST); a bucket that does not answer is a
        refusal: without it nobody can tell whether another box wrote the space since."""
        hib = self.cfg.hibernate
        assert hib is not None and self.bucket is not None, "the caller checks hibernation is on"
        try:
            return read_freshness(self.bucket, hib.key(host) + "/", db)
        except (ObjectStoreError, TimeoutError) as e:
            raise HandoverError(
                f"{host}: cannot read the bucket to check that {db} is the newest copy of the "
                f"space ({one_line(str(e))[:300]}); it stays hibernating (nothing was handed to "
                f"its unit): retry `lchat hibernate {host} --off` once the bucket answers"
            ) from e

    def _precheck_newest_copy(self, route: Route, db: str) -> None:
        """``--off``'s refusals that must come before the peers are told: a space whose replica
        lives in another region's bucket, and a stale local file with no router here to fetch
        the newest copy (the activator restores only under the space's lease; the CLI never
        does)."""
        host = route.host
        if self.cfg.hibernate is None:
            return  # no bucket: no activator ever ran it, so it ran nowhere but in its unit
        foreign = foreign_bucket(self.cfg, route.home_region)
        if foreign is not None:
            raise HandoverError(
                f"{host} is homed in region {route.home_region}, whose replicas live in "
                f"{foreign.bucket} (LCHAT_REGION_BUCKETS), not in this box's bucket: this box "
                f"cannot fetch its newest copy. Run `lchat hibernate {host} --off` on a box of "
                f"region {route.home_region}, or first `lchat relocate {host} --to <this box's "
                f"region>`; nothing changed"
            )
        fresh = self._freshness(host, db)
        if fresh.current or self.router.status() is not None:
            return
        raise HandoverError(
            f"{host}: {fresh.describe()}: the newest copy is in the bucket (the space last ran "
            f"on another box, or was not slept cleanly here), and only the router's activator "
            f"fetches it, under the space's lease, but no router answers on "
            f"{self.cfg.admin_socket}. Nothing changed (still hibernating): start the router, "
            f"then re-run `lchat hibernate {host} --off`"
        )

    def _newest_copy_here(self, host: str, db: str, timeout: float) -> None:
        """Make ``db`` the bucket's newest copy before the unit owns it, or refuse (the flag
        stays on). When it is not already (see :meth:`_stale_copy`), the activator wakes it here
        once, under its lease (it moves a stale local file aside and restores; it refuses a
        bucket behind a local copy), and sleeps it (flushed, a marker at the newest txid); then
        it is checked again. Peers already forward the space here, so no other box wakes it."""
        if self.cfg.hibernate is None:
            return
        stale = self._stale_copy(host, db, timeout)
        if stale is None:
            return
        self.say.out(
            f"{host}: {stale.describe()}: fetching the newest copy from the bucket under the "
            f"space's lease (one wake here, then a sleep)"
        )
        self._restore_by_wake(host, timeout)
        self._sleep_now(host)
        stale = self._stale_copy(host, db, timeout, fetched=True)
        if stale is not None:
            raise HandoverError(
                f"{host}: after the wake and sleep here, {stale.describe()}: it stays hibernating "
                f"(nothing was handed to its unit). See the router's log (`activator: {host}`), "
                f"then re-run `lchat hibernate {host} --off`"
            )

    def _stale_copy(
        self, host: str, db: str, timeout: float, *, fetched: bool = False
    ) -> Freshness | None:
        """None when the unit may take the local database as it is, else what the check saw.

        It may when the file is the bucket's newest copy (:attr:`Freshness.current`), or when a
        request has woken the space here again since the sleep (the flag is still on): the
        activator wakes only under the space's lease and from its newest copy, and the reload
        that hands the space to its unit sleeps it with a full flush first. A wake in progress
        here is waited out (its outcome decides); the state is read after the file, and a space
        that went back to sleep in between is read once more."""
        deadline = self.clock.monotonic() + timeout
        reread = False
        while True:
            fresh = self._freshness(host, db)
            if fresh.current:
                if fresh.bucket.newest:
                    now = "now " if fetched else ""
                    self.say.out(
                        f"{host}: {db} is {now}the newest copy (txid {fresh.bucket.newest})"
                    )
                return None
            state = (self.router.entry(host) or {}).get("state")
            if state in ("awake", "stopping"):
                self.say.out(
                    f"{host}: {state} here again (a request woke it under its lease, from the "
                    f"newest copy): the router flushes it to this box's file before the unit starts"
                )
                return None
            if state == "waking" and self.clock.monotonic() < deadline:
                self.clock.sleep(POLL_INTERVAL)
                continue
            if state in (None, "asleep") and not reread:
                reread = True  # asleep now: it may have slept (marker written) since the read
                continue
            return fresh

    def _restore_by_wake(self, host: str, timeout: float) -> None:
        """``POST /wake`` until it answers 200; a lease a peer is still releasing (its sleep, on
        the lives-elsewhere push) is waited out until ``timeout``. Anything else is a refusal."""
        deadline = self.clock.monotonic() + timeout
        then = (
            f"it stays hibernating here (nothing was handed to its unit), and the peers forward "
            f"it here: fix that and re-run `lchat hibernate {host} --off`, or run `lchat "
            f"hibernate {host} --on` to give the peers its hibernating row back"
        )
        while True:
            try:
                response = self.admin.wake(host, timeout)
            except (admin_client.Unreachable, admin_client.ProtocolError) as e:
                raise HandoverError(
                    f"{host}: the wake that fetches its newest copy failed ({e}); {then}"
                ) from e
            body = json_body(response)
            if response.status == 200:
                self.say.out(
                    f"{host}: woken here from the newest copy ({body.get('seconds', '?')}s)"
                )
                return
            if response.status == 409:
                raise HandoverError(
                    f"{host}: the running router has no activator (LCHAT_HIBERNATE_BUCKET is unset "
                    f"in its environment), so it cannot fetch the newest copy; {then}"
                )
            error = body.get("error") or f"the router answered {response.status}"
            if body.get("reason") == "lease_held" and self.clock.monotonic() < deadline:
                self.clock.sleep(1.0)
                continue
            raise HandoverError(
                f"{host}: the wake that fetches its newest copy failed: {error}; {then}"
            )

    def _wait_released(
        self, socket: str, host: str, timeout: float, *, handover: bool = False
    ) -> None:
        """Until the old process has let go of the socket. ``handover`` (``--on``): or the
        activator already has it, and a socket still held at ``timeout`` is only a warning."""
        deadline = self.clock.monotonic() + timeout
        while self.units.listening(socket):
            if handover and (self.router.entry(host) or {}).get("state") in ACTIVATOR_BUSY:
                return
            if self.clock.monotonic() >= deadline:
                if handover:
                    self.say.warn(
                        f"something still listens on {socket} after {timeout:g}s: the wake may fail"
                    )
                    return
                raise HandoverError(
                    f"{host}: something still listens on {socket} after {timeout:g}s, and the "
                    f"space would refuse to start over it: stop that process, then retry"
                )
            self.clock.sleep(POLL_INTERVAL)

    def _sleep_now(self, host: str) -> None:
        try:
            response = self.admin.sleep(host, SLEEP_TIMEOUT)
        except admin_client.Unreachable as e:
            if not absent(e):
                self.say.note(f"cannot reach the router ({e}) to put {host} to sleep first")
            return
        except admin_client.ProtocolError as e:
            raise HandoverError(
                f"{host}: the router did not finish putting it to sleep within "
                f"{SLEEP_TIMEOUT:g}s ({e}); nothing changed here: retry"
            ) from e
        body = json_body(response)
        if response.status == 200:
            self.say.out(f"{host}: asleep (flushed to the bucket, lease released)")
        elif response.status == 409:
            self.say.note(f"the running router has no activator: {host} was not running under it")
        else:
            self.say.note(
                f"the router answered {response.status} to /sleep: {body.get('error', '')}"
            )
