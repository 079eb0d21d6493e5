"""``lchat relocate <host> --to <region>``: move a hibernating space to another region on purpose,
over the seams (:mod:`lchat.handover.seams`): the router admin (sleep and hold, release), the
mesh's peers (who is live where, the flip's fan-out), the region buckets, and DNS.

Three steps, in this order (docs/mesh.md, "Relocating a space"):

1. **Store copy.** A destination box wakes the space by restoring it from *its* region's bucket,
   so the replica must be there first. Regions that share one bucket (no ``LCHAT_REGION_BUCKETS``,
   or both regions' entries naming the same bucket, prefix and endpoint): no copy. Per-region
   buckets: with the space held asleep here and its lease taken in *both* buckets as a fence (a
   wake anywhere fails while it copies, so no writer can change the replica mid-copy, and no
   destination box can wake a half-copied one), ``<prefix>/<host>/`` is copied without
   ``lock.json`` (:func:`copy_replica`); fences and holds are released after step 2, whatever
   happened. A fence met held by a live peer (the space is awake there) is not a refusal: that
   peer's router is asked through the mesh API (:class:`lchat.handover.seams.PeerHolds`) to sleep
   the space (final replica flushed, lease released) and hold it asleep, and the fence is taken
   again; so the command works from any box of the mesh.
2. **Flip + fan-out.** ``home_region`` is set in the registry, the router told, and the route
   pushed to every live in-scope peer, so the mesh places the space on a destination-region box.
3. **DNS** (``--move-dns``): the host's own records pointed at the destination's live boxes.

Invariants: only hibernating spaces move (a live instance's database is on this box's disk); a
re-run of a finished relocation changes nothing; stale source bytes never overwrite newer
destination bytes (the destination's newest txid ahead of the source's is a refusal); nothing is
flipped unless the copy is complete; a DNS move that fails leaves the relocation standing and
says so. Never a second writer: the copy runs only under both fences, which no box holds while
it runs the space, and the destination box takes a fresh lease at its first wake (``lock.json``
is never copied). A lease held by a box that is not a live member, by another relocation, by a
peer that does not answer the hold in time, or by an older peer without the call (404) is a
refusal naming it. Every hold (here and on each peer asked) has a deadline (the relocation's
timeout plus a minute, at most an hour), so a crashed relocation never strands a space, and is
lifted on every way out, an interruption included. A space with no ``home_region`` under
per-region buckets moves only with ``--from REGION``: which bucket holds it is never guessed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

from attrs import field, frozen
from twisted.internet import defer

from lchat import admin_client, builds, lease
from lchat.admin_client import RouterAdmin
from lchat.buckets import bucket_key_env
from lchat.config import BoxConfig, ConfigError
from lchat.config.mesh import REGION_LABEL
from lchat.handover import HandoverError
from lchat.handover.hibernate import SLEEP_TIMEOUT
from lchat.handover.router import Router, Say
from lchat.handover.seams import AddressRecords, Clock, Mesh, MeshHolds, PeerHolds, RegionStores
from lchat.hibernation import moved
from lchat.mesh.client import MeshCallError
from lchat.mesh.members import Member
from lchat.mesh.placement import normalise_member_url
from lchat.objstore import ObjectInfo, ObjectStore, ObjectStoreError
from lchat.objstore.s3 import S3Store
from lchat.objstore.where import Where
from lchat.reactors import Reactor
from lchat.registry import Registry
from lchat.replica.restore import replica_files
from lchat.threads import RunInThread

MAX_HOLD = 3600.0  # the router's bound on a hold (POST /sleep?hold=S)
FENCE_RELEASE_BUDGET = 15.0
# A peer asked to hold a space answers once it is asleep (as this box's router does for /sleep).
PEER_HOLD_TIMEOUT = SLEEP_TIMEOUT + 10.0
PEER_RELEASE_TIMEOUT = 10.0  # each peer's POST /api/mesh/release (best effort: holds expire)

Report = Callable[[dict[str, Any], list[str]], None]  # the steps (--json) and their lines
Members = list[Member] | Exception  # the mesh's live members, or why they could not be read


@frozen
class Relocation:
    """One ``lchat relocate``; :meth:`__call__` raises :class:`HandoverError` for a refusal or a
    failure (nothing flipped, except where the message says the move stands)."""

    cfg: BoxConfig
    registry: Registry
    admin: RouterAdmin
    peers: Mesh
    buckets: RegionStores
    dns: AddressRecords
    say: Say
    report: Report
    clock: Clock = field(factory=Clock)
    peer_holds: PeerHolds | None = None  # None: the mesh API's (MeshHolds)

    def __call__(
        self, host: str, dest: str, *, move_dns: bool, timeout: float, source: str = ""
    ) -> int:
        """``source``: ``--from REGION``, needed exactly when the space has no ``home_region``
        and the regions keep their replicas in different buckets."""
        cfg, say = self.cfg, self.say
        if not REGION_LABEL.fullmatch(dest):
            raise HandoverError(f"--to {dest!r} must be letters, digits, '.', '_' or '-'")
        if source and not REGION_LABEL.fullmatch(source):
            raise HandoverError(f"--from {source!r} must be letters, digits, '.', '_' or '-'")
        route = self.registry.get(host)
        if route is None:
            raise HandoverError(f"{host} is not registered")
        if route.kind != "instance":
            raise HandoverError(
                f"{host} is a service (a server lchat does not run): it cannot move"
            )
        if not route.hibernate:
            raise HandoverError(
                f"{host} is a live instance: its database is on this box's disk, so no other box "
                f"can restore it. Convert it first with `lchat hibernate {host} --on`, then "
                f"relocate"
            )
        if cfg.hibernate is None:
            raise HandoverError(
                "relocating needs the hibernation bucket: set LCHAT_HIBERNATE_BUCKET"
            )
        if move_dns:
            if cfg.mesh is None:
                raise HandoverError(
                    "--move-dns points the record at the destination region's live boxes, which "
                    "only the mesh knows: set LCHAT_MESH_SELF (or move the record by hand)"
                )
            try:
                self.dns.check(host)
            except HandoverError as e:
                raise HandoverError(f"{e}; nothing was copied or flipped") from e
        source = self._source(host, route.home_region, source)
        steps: dict[str, Any] = {"host": host, "from": source, "to": dest}
        if route.home_region == dest:
            steps["result"] = "nothing to do"
            done = [f"{host}: already in {dest}: nothing to do"]
            if move_dns:
                members = self._members()
                if isinstance(members, Exception):
                    raise HandoverError(
                        f"{host}: could not read the mesh's members ({members}) to move its record"
                    ) from members
                live = sorted(m.url for m in members if m.region == dest)
                self._dns_step(host, dest, live, steps, done)
            self.report(steps, done)
            return 0
        src, dst = self._buckets(source, dest)
        shared = src is None or dst is None or src.same_place(dst)
        members = self._members() if cfg.mesh is not None else []
        # Before anything moves: with per-region buckets, no live box in ``dest`` is a refusal.
        placed = self._placement(host, dest, shared, members)
        lines: list[str] = []
        fanned: list[str] = []
        if shared:
            steps["store"] = {"copied": False, "why": "shared bucket"}
            lines.append(
                "store: no copy — source and destination share the same bucket (the shared-bucket "
                "case)"
            )
            self._flip(host, dest, fanned)
            # Awake here, it would keep being served here until its idle sleep: sleep it now, so
            # its next request wakes it where the mesh now places it (the lease hands it over).
            if self._sleep_here(host):
                say.note(f"{host}: slept on this box; its next request wakes it in {dest}")
        else:
            assert src is not None and dst is not None
            peers = frozenset(
                normalise_member_url(m.url) for m in (members if isinstance(members, list) else [])
            )
            steps["store"] = self._copy_and_flip(
                host,
                (source, dest),
                (src, dst),
                timeout,
                lambda: self._flip(host, dest, fanned),
                peers,
            )
            store = steps["store"]
            lines.append(
                f"store: copied {store['objects']} objects ({store['bytes']} bytes, "
                f"{store['skipped']} already there) {store['from']} → {store['to']} by "
                f"{store['method']}, lock.json excluded; newest txid {store['txid']}"
            )
        if placed is not None:
            steps["placement"] = placed
        steps["home_region"] = dest
        steps["fan_out"] = fanned
        steps["result"] = "relocated"
        if placed is not None and not placed["live_boxes"]:
            lines.append(
                f"placement: no live box in {dest} yet — the mesh places {host} on the whole "
                f"fleet until one joins (availability wins over residency; the bucket is shared)"
            )
        if cfg.mesh is None:
            lines.append(
                f"home_region flipped (no mesh on this box: no peers to tell) — {host} → {dest}"
            )
        else:
            lines.append(
                f"home_region flipped + route re-fanned-out to peers — the mesh now places "
                f"{host} on a {dest} box"
            )
        for line in fanned:
            say.note(line)
        headline = f"relocated {host}: {source or '(no region)'} → {dest}"
        if move_dns:
            live = placed["live_boxes"] if placed is not None else []
            try:
                self._dns_step(host, dest, live, steps, lines)
            except HandoverError as e:
                # The move stands: report it, then the record that did not follow.
                self.report(steps, [headline, *lines])
                raise HandoverError(
                    f"{host} is relocated to {dest}, but its DNS record was not moved: {e}. The "
                    f"wildcard and the mesh's forwarding keep it reachable; re-run with --move-dns"
                ) from e
        self.report(steps, [headline, *lines])
        return 0

    # --- the mesh ------------------------------------------------------------------------------

    def _members(self) -> Members:
        try:
            return self.peers.members()
        except (ObjectStoreError, ConfigError, defer.TimeoutError, TimeoutError) as e:
            return e

    def _source(self, host: str, home_region: str, given: str) -> str:
        """The region the space moves from: its ``home_region``; without one, ``--from``, which
        per-region buckets require (which bucket holds it is never guessed), else this box's."""
        if home_region:
            if given and given != home_region:
                raise HandoverError(
                    f"--from {given}: {host}'s home_region is {home_region}, so it moves from "
                    f"there: drop --from (nothing was copied or flipped)"
                )
            return home_region
        if given:
            return given
        if self.cfg.region_buckets:
            raise HandoverError(
                f"{host} has no home_region, and the regions keep their replicas in different "
                f"buckets (LCHAT_REGION_BUCKETS: {', '.join(sorted(self.cfg.region_buckets))}): "
                f"say which region's bucket holds it with --from REGION; nothing was copied or "
                f"flipped"
            )
        return self.cfg.mesh.region if self.cfg.mesh is not None else ""

    def _placement(
        self, host: str, dest: str, shared: bool, members: Members
    ) -> dict[str, Any] | None:
        """The destination region's live boxes, from the mesh's heartbeats as read before
        anything moves (None without a mesh). With per-region buckets and none of them live, the
        move is refused: placement would fall back to a box of another region, whose bucket holds
        no current copy (the router refuses to wake it there, so the space would be down until a
        ``dest`` box joins). With a shared bucket any box can wake it, so the move goes ahead."""
        if self.cfg.mesh is None:
            return None
        if isinstance(members, Exception):
            if shared:
                self.say.note(
                    f"could not read the mesh's members ({members}): placement in {dest} not "
                    f"checked"
                )
                return None
            raise HandoverError(
                f"{host}: could not read the mesh's members ({members}), so whether a {dest} box "
                f"is live is unknown; nothing was copied or flipped: retry"
            ) from members
        live = sorted(m.url for m in members if m.region == dest)
        if not live and not shared:
            raise HandoverError(
                f"{host}: no live box in region {dest}, and {dest} keeps its replicas in its own "
                f"bucket: placement would fall back to a box of another region, which cannot wake "
                f"it from there. Start a {dest} box (LCHAT_MESH_REGION={dest}) first, or relocate "
                f"to a region that has one; nothing was copied or flipped"
            )
        return {"region": dest, "live_boxes": live}

    def _flip(self, host: str, dest: str, fanned: list[str]) -> None:
        """Step 2: the registry column, the router, the peers (a push never raises; each peer's
        outcome is a line in ``fanned``)."""
        updated = self.registry.update(host, home_region=dest)
        Router(self.admin, self.say).notify()
        self.peers.push_reporting(updated, fanned.append)

    def _dns_step(
        self, host: str, dest: str, live: list[str], steps: dict[str, Any], lines: list[str]
    ) -> None:
        """``--move-dns``: the host's own records made the addresses of ``dest``'s live boxes
        (``live``: their mesh URLs). No live box there (a shared bucket's fallback): left alone,
        said so. Raises :class:`HandoverError` when the DNS host refuses or fails."""
        if not live:
            steps["dns"] = {"changed": False, "why": f"no live box in {dest}"}
            lines.append(f"dns: not moved — no live box in {dest} to point {host} at")
            return
        line, steps["dns"] = self.dns.point(host, live)
        lines.append(line)

    # --- this box's router ---------------------------------------------------------------------

    def _sleep_and_hold(self, host: str, hold: float) -> bool:
        """Ask this box's router to sleep the space (flush, release the lease), as ``lchat
        hibernate --off`` does, and to keep it asleep for ``hold`` seconds (requests meanwhile
        get 503 with a short Retry-After instead of waking it again before the fence is taken).
        Whether a hold was placed. A router that is not running has nothing awake; another box's
        wake shows up as its lease, which the fence refuses."""
        try:
            response = self.admin.sleep_held(host, hold, SLEEP_TIMEOUT)
        except admin_client.Unreachable:
            return False
        except admin_client.ProtocolError as e:
            # The hold may have been placed before the sleep timed out: lift it.
            self._release_hold(host)
            raise HandoverError(
                f"{host}: the router did not finish putting it to sleep within "
                f"{SLEEP_TIMEOUT:g}s ({e}); nothing was copied or flipped: retry"
            ) from e
        if response.status == 200:
            self.say.note(f"{host}: asleep on this box and held asleep while it moves")
            return True
        if response.status not in (404, 409):
            # The hold was placed before the sleep failed: lift it (the lease decides).
            self._release_hold(host)
            self.say.note(
                f"the router answered {response.status} to /sleep for {host}; checking the lease"
            )
        return False

    def _sleep_here(self, host: str) -> bool:
        """After a shared-bucket flip: sleep the space if this box's router runs it (best effort:
        otherwise it moves at its idle sleep). Whether it was asleep-by-us."""
        try:
            status = self.admin.status(admin_client.DEFAULT_TIMEOUT).json()
            state = status["hosts"].get(host, {}).get("state")
            if state not in ("awake", "waking"):
                return False
            response = self.admin.sleep(host, SLEEP_TIMEOUT)
        except (admin_client.Unreachable, admin_client.ProtocolError, ValueError, KeyError):
            return False
        return response.status == 200

    def _release_hold(self, host: str) -> None:
        """Lift the hold (it also ends by itself at its deadline)."""
        try:
            self.admin.release(host)
        except (admin_client.Unreachable, admin_client.ProtocolError) as e:
            self.say.note(
                f"{host}: could not lift the hold on this box's router ({e}); it ends by itself"
            )

    # --- the copy ------------------------------------------------------------------------------

    def _buckets(self, source: str, dest: str) -> tuple[Where | None, Where | None]:
        """Each side's bucket; (None, None) when every region shares this box's bucket."""
        by_region = self.cfg.region_buckets
        if not by_region:
            return None, None
        assert self.cfg.hibernate is not None
        here = self.cfg.hibernate.where  # a space without a home region lives where this box does
        for region in (source, dest):
            if region and region not in by_region:
                raise HandoverError(
                    f"LCHAT_REGION_BUCKETS has no bucket for region {region!r} (it names "
                    f"{', '.join(sorted(by_region))}): add REGION=s3://BUCKET/PREFIX?... for it"
                )
        return by_region.get(source, here), by_region[dest]

    def _copy_and_flip(
        self,
        host: str,
        labels: tuple[str, str],  # the source's and the destination's mesh region ("": here)
        wheres: tuple[Where, Where],
        timeout: float,
        flip: Callable[[], None],
        live: frozenset[str],  # the live members' URLs (normalised), as read before anything
    ) -> dict[str, Any]:
        """The copy and the flip under both fences, with this box's router holding the space
        asleep throughout, and every live peer found holding its lease asked to sleep and hold
        it too; the holds are lifted after the flip (a request then goes to the destination) or
        the failure, an interruption included."""
        hib = self.cfg.hibernate
        assert hib is not None
        owner = f"{self.cfg.box_id} (lchat relocate)"
        monotonic = self.clock.monotonic
        held = False  # once this box's router holds the space asleep
        asked: list[str] = []  # the peers asked to hold it (lifted last, whatever happened)
        hold = min(timeout + 60.0, MAX_HOLD)

        async def fence(reactor: Reactor, store: ObjectStore, where: Where, label: str) -> Any:
            """The lease at ``where`` for the relocation. Met held by a live peer not asked
            yet, that peer is asked to sleep and hold the space, and the lease taken again:
            at most once per peer, so this ends."""
            while True:
                try:
                    return await lease.acquire(
                        store,
                        lease.lease_key(where.prefix, host),
                        owner,
                        hib.lease_ttl,
                        host=host,
                        monotonic=monotonic,
                    )
                except lease.LeaseHeld as e:
                    peer = normalise_member_url(e.owner) if e.owner.startswith("http") else ""
                    if not peer or peer not in live or peer in asked or peer == self._me():
                        raise _lease_held(host, label, where, e) from e
                    asked.append(peer)  # before the call: an unanswered one may have held it
                    try:
                        await self._hold_on_peer(reactor, host, peer, hold, (label, where, e))
                    except _HoldRefused:
                        asked.remove(peer)  # it answered no: there is no hold there to lift
                        raise

        async def main(reactor: Reactor) -> dict[str, Any]:
            nonlocal held
            run_in_thread = self.buckets.threads(reactor)
            held = await run_in_thread(self._sleep_and_hold, host, hold)
            stores = [
                await self.buckets.open(reactor, where, f"region {label}")
                for where, label in zip(wheres, labels, strict=True)
            ]
            fences: list[tuple[ObjectStore, lease.HeldLease]] = []
            try:
                for store, where, label in zip(stores, wheres, labels, strict=True):
                    fences.append((store, await fence(reactor, store, where, label)))
                started = monotonic()
                result = await copy_replica(
                    host,
                    wheres,
                    (stores[0], stores[1]),
                    run_in_thread,
                    dest=labels[1],
                    one_account=one_account(self.cfg, *wheres),
                )
                if monotonic() - started > hib.lease_ttl * 0.9:
                    raise HandoverError(
                        f"{host}: the copy took longer than the lease TTL ({hib.lease_ttl:g}s), "
                        f"so the fence may have lapsed: re-run (objects already copied are "
                        f"skipped); nothing was flipped"
                    )
                # Flipped while both fences hold: no box can write the source after the copy
                # and before the peers forward to the destination region.
                await run_in_thread(flip)
                await self._mark_moved(host, labels[1], wheres, (stores[0], stores[1]))
                return result
            finally:
                for store, fence_held in fences:
                    await lease.release(reactor, store, fence_held, FENCE_RELEASE_BUDGET)
                for store in stores:
                    await store.close()

        try:
            result: dict[str, Any] = self.buckets.run(main, timeout)
        except ObjectStoreError as e:
            raise HandoverError(
                f"{host}: the bucket failed ({e}); nothing was flipped: retry"
            ) from e
        except ConfigError as e:
            raise HandoverError(f"LCHAT_REGION_BUCKETS: {e}") from e
        except TimeoutError as e:
            raise HandoverError(f"{host}: the relocation did not finish ({e}); retry") from e
        finally:
            if asked:
                self._release_peers(host, asked, hold)
            if held:
                self._release_hold(host)
        return result

    async def _mark_moved(
        self,
        host: str,
        dest: str,
        wheres: tuple[Where, Where],
        stores: tuple[ObjectStore, ObjectStore],
    ) -> None:
        """After the flip, still under both fences: the source bucket's marker says where the
        space went (a box that missed the fan-out refuses to wake the old copy there:
        :mod:`lchat.hibernation.moved`), and the destination's marker of an earlier move away
        from it goes. A failure is a note: the move stands, and such a box is then repaired by
        its anti-entropy alone."""
        route = self.registry.get(host)
        gen = route.settings_gen if route is not None else 0
        record = moved.MovedRecord(to=dest, gen=gen, at=self.clock.wall(), by=self.cfg.box_id)
        try:
            await moved.clear(stores[1], wheres[1].prefix, host)
            await moved.write(stores[0], wheres[0].prefix, host, record)
        except ObjectStoreError as e:
            self.say.note(
                f"{host}: could not leave the moved marker in {url(wheres[0])}/{host}/ ({e}): "
                f"the move stands, but a box that missed the fan-out may wake the old copy "
                f"until its settings sync runs (or `lchat mesh-seed` on it)"
            )

    def _me(self) -> str:
        return normalise_member_url(self.cfg.mesh.self_url) if self.cfg.mesh is not None else ""

    async def _hold_on_peer(
        self,
        reactor: Reactor,
        host: str,
        peer: str,
        hold: float,
        met: tuple[str, Where, lease.LeaseHeld],  # the fence's region, bucket, and its holder
    ) -> None:
        """Ask ``peer`` (a live member holding the space's lease) to sleep it and hold it asleep
        for ``hold`` seconds; returns once it is asleep there. Raises :class:`HandoverError`:
        no answer in time, an older peer without the call (404: today's refusal), a refusal."""
        label, where, held = met
        holds = self.peer_holds if self.peer_holds is not None else MeshHolds(self.cfg)
        self.say.note(f"{host}: awake on {peer}: asking it to sleep it and hold it asleep")
        try:
            status, answer = await holds.hold(reactor, peer, host, hold, PEER_HOLD_TIMEOUT)
        except MeshCallError as e:
            raise HandoverError(
                f"{host}: it is awake on {peer} (its lease in region {label or 'here'}), which "
                f"did not answer the request to sleep it and hold it asleep ({e}); nothing was "
                f"copied or flipped: retry, or run the command on that box"
            ) from e
        if status == 200:
            self.say.note(f"{host}: asleep on {peer} and held asleep there while it moves")
            return
        if status == 404 and not answer.get("reason"):  # an lchat without POST /api/mesh/hold
            raise _HoldRefused(str(_lease_held(host, label, where, held)))
        error = answer.get("error") if isinstance(answer.get("error"), str) else ""
        # A 5xx may come after the hold was placed (it is lifted); a 4xx placed none.
        refusal = _HoldRefused if 400 <= status < 500 else HandoverError
        raise refusal(
            f"{host}: {peer} answered {status} to the request to sleep it and hold it asleep"
            f"{': ' + error if error else ''}; nothing was copied or flipped: retry"
        )

    def _release_peers(self, host: str, peers: list[str], hold: float) -> None:
        """Lift the holds the peers placed (best effort: each also ends by itself at its
        deadline, ``hold`` seconds after it began). A peer's failure, or the whole call timing
        out, is a note, never an exception: it runs on every way out, after the real outcome."""
        holds = self.peer_holds if self.peer_holds is not None else MeshHolds(self.cfg)
        failed: dict[str, str] = {}

        async def main(reactor: Reactor) -> None:
            for peer in peers:
                try:
                    status, _ = await holds.release(reactor, peer, host, PEER_RELEASE_TIMEOUT)
                except MeshCallError as e:
                    failed[peer] = str(e)
                    continue
                if status != 200:
                    failed[peer] = f"it answered {status}"

        try:
            self.buckets.run(main, PEER_RELEASE_TIMEOUT * len(peers) + 5.0)
        except (TimeoutError, defer.TimeoutError) as e:
            failed.update({p: str(e) for p in peers if p not in failed})
        for peer, why in failed.items():
            self.say.note(
                f"{host}: could not lift the hold on {peer} ({why}); it ends by itself within "
                f"{hold:g}s"
            )


async def copy_replica(
    host: str,
    wheres: tuple[Where, Where],
    stores: tuple[ObjectStore, ObjectStore],
    run_in_thread: RunInThread,
    *,
    dest: str,
    one_account: bool = False,
) -> dict[str, Any]:
    """``<src>/<host>/`` to ``<dst>/<host>/`` without ``lock.json``, what the destination had
    and the source has not deleted; refused when the destination is ahead, or when afterwards
    its newest txid is not the source's."""
    src, dst = wheres
    src_store, dst_store = stores
    src_dir, dst_dir = src.key(host) + "/", dst.key(host) + "/"
    source = [
        i for i in await src_store.list(src_dir) if not is_lock(i, src_dir) and not is_marker(i)
    ]
    there = {i.key[len(dst_dir) :]: i for i in await dst_store.list(dst_dir)}
    there.pop(lease.LOCK_NAME, None)  # our own fence
    there.pop(moved.MOVED_NAME, None)  # an earlier move's marker: cleared after the flip
    src_txid = newest_txid(source)
    dst_txid = newest_txid(list(there.values()))
    if not source:
        raise HandoverError(f"{host}: no replica under {url(src)}/{host}/: nothing to copy")
    if dst_txid > src_txid:
        raise HandoverError(
            f"{host}: the destination {url(dst)}/{host}/ is ahead of the source (newest txid "
            f"{dst_txid:016x} > {src_txid:016x}): it was written in {dest} after an earlier "
            f"move, and copying would put stale bytes over newer ones. Nothing was copied or "
            f"flipped; if {dest} is where it lives, flip only its home_region"
        )
    same_store = (src.bucket, src.endpoint) == (dst.bucket, dst.endpoint)
    # Two buckets of one account on one endpoint: CopyObject into the destination, named from
    # the source bucket (no byte through this box). Anything else streams through a temp file.
    across = not same_store and one_account and isinstance(dst_store, S3Store)
    method = "server-side copy" if same_store or across else "download + re-upload"
    copied = skipped = size = 0
    for info in source:
        rel = info.key[len(src_dir) :]
        target = dst_dir + rel
        existing = there.get(rel)
        # Replica files are immutable under their name (level and txid range): same size, same
        # file. The build floor is not ("1.3" and "1.4" are one size): always copied, so the
        # destination never keeps an older floor.
        if existing is not None and existing.size == info.size and rel != builds.BUILD_RECORD:
            skipped += 1
            continue
        if same_store:
            await src_store.copy(info.key, target)
        elif across:
            assert isinstance(dst_store, S3Store)
            await dst_store.copy(info.key, target, source_bucket=src.bucket)
        else:
            await _stream(src_store, dst_store, info.key, target, run_in_thread)
        copied += 1
        size += info.size
    # Files the destination had that the source does not (an older stay there) go: a restore must
    # see exactly the source's lineage.
    wanted = {i.key[len(src_dir) :] for i in source}
    for rel in sorted(set(there) - wanted):
        await dst_store.delete(dst_dir + rel)
    after = [i for i in await dst_store.list(dst_dir) if not is_lock(i, dst_dir)]
    if newest_txid(after) != src_txid:
        raise HandoverError(
            f"{host}: after the copy the destination's newest txid is "
            f"{newest_txid(after):016x}, not the source's {src_txid:016x}; nothing was flipped"
        )
    return {
        "copied": True,
        "from": f"{url(src)}/{host}/",
        "to": f"{url(dst)}/{host}/",
        "method": method,
        "objects": copied,
        "skipped": skipped,
        "bytes": size,
        "txid": f"{src_txid:016x}",
    }


async def _stream(
    src_store: ObjectStore,
    dst_store: ObjectStore,
    key: str,
    target: str,
    run_in_thread: RunInThread,
) -> None:
    """Through a private temp file: the object is never held whole in memory."""
    fd, path = await run_in_thread(tempfile.mkstemp, ".part", "lchat-relocate-")
    await run_in_thread(os.close, fd)
    try:
        await src_store.get_to_file(key, path)
        await dst_store.put_file(target, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            await run_in_thread(os.unlink, path)


def one_account(cfg: BoxConfig, src: Where, dst: Where) -> bool:
    """Whether ``dst``'s store may copy ``src``'s objects on the server: two S3 buckets on one
    endpoint (the same explicit endpoint, or AWS in the same region) reached with the same access
    key (both the box's own credentials, or the same named key). Read from the configuration
    only: resolving a role's credentials could block."""
    if src.is_file or dst.is_file:
        return False
    if src.endpoint.rstrip("/") != dst.endpoint.rstrip("/"):
        return False
    if not src.endpoint and (src.s3_region or "us-east-1") != (dst.s3_region or "us-east-1"):
        return False
    keys = [(bucket_key_env(cfg, w, "") or {}).get("AWS_ACCESS_KEY_ID") for w in (src, dst)]
    return keys[0] == keys[1]


class _HoldRefused(HandoverError):
    """A peer answered the request to hold a space with a refusal: it placed no hold."""


def _lease_held(host: str, label: str, where: Where, e: lease.LeaseHeld) -> HandoverError:
    """The refusal for a lease another box holds, naming it."""
    return HandoverError(
        f"{host}: its lease in region {label or 'here'} ({url(where)}) is held by {e.owner} "
        f"until {lease.rfc3339(e.expires_at)}: it is awake there (or a relocation is running). "
        f"Let it sleep on that box (`lchat hibernate {host} --off` sleeps it, or wait for its "
        f"idle timeout), then retry; nothing was copied or flipped"
    )


def is_lock(info: ObjectInfo, directory: str) -> bool:
    return info.key == directory + lease.LOCK_NAME


def is_marker(info: ObjectInfo) -> bool:
    """A moved marker (never copied: it describes the bucket it is in)."""
    return info.key.rsplit("/", 1)[-1] == moved.MOVED_NAME


def newest_txid(infos: list[ObjectInfo]) -> int:
    return max((f.max_txid for f in replica_files(infos)), default=0)


def url(where: Where) -> str:
    """The bucket and prefix, without how it is reached (``str(where)`` has that)."""
    return str(Where(where.bucket, where.prefix))
