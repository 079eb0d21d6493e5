"""``lchat relocate <host> --to <region>``: move a hibernating space to another region on purpose.

Three steps, in this order (docs/mesh.md, "Relocating a space"):

1. **Store copy.** A destination box wakes the space by restoring it from *its* region's bucket,
   so the replica must be there first. Regions that share one bucket (no ``LCHAT_REGION_BUCKETS``,
   or both regions' entries naming the same bucket, prefix and endpoint): no copy. Per-region
   buckets: the running router is asked to sleep the space (flushed, lease released), then this
   command takes the space's lease in *both* buckets as a fence (a wake anywhere fails while it
   copies, so no writer can change the replica mid-copy, and no destination box can wake a
   half-copied one), copies ``<prefix>/<host>/`` to the destination prefix **without**
   ``lock.json`` (a server-side CopyObject within one bucket and endpoint; a streamed download +
   re-upload otherwise, the destination client signed for the destination's region), checks that
   the destination's newest txid is the source's, and releases both fences after step 2.
2. **Flip + fan-out.** ``home_region`` is set in the registry and the route is pushed to every
   live in-scope peer (:func:`lchat.cli.mesh.fan_out_upsert`), so the mesh places the space on a
   destination-region box.

Invariants: only hibernating spaces move (a live instance's database is on this box's disk); a
re-run of a finished relocation changes nothing; stale source bytes never overwrite newer
destination bytes (the destination's newest txid ahead of the source's is a refusal); a lease
held by another box is a refusal naming it; nothing is flipped unless the copy is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred

from lchat import admin_client, hosts, lease
from lchat.buckets import bucket_key_env, open_bucket
from lchat.cli import mesh as mesh_cli
from lchat.cli import move_dns as move_dns_cli
from lchat.cli import runner
from lchat.config import BoxConfig, ConfigError
from lchat.mesh.membership import Member
from lchat.objstore import ObjectInfo, ObjectStore, ObjectStoreError
from lchat.objstore.s3 import S3Store
from lchat.objstore.where import Where
from lchat.registry import Registry
from lchat.replica.restore import replica_files
from lchat.threads import RunInThread, thread_runner

SUMMARY = "move a hibernating space to another region (copy its replica, flip home_region)"
DEFAULT_TIMEOUT = 3600.0  # the whole relocation: a large replica's download + re-upload
SLEEP_TIMEOUT = 150.0
MAX_HOLD = 3600.0  # the router's bound on a hold (POST /sleep?hold=S)  # POST /sleep: as `lchat hibernate --off` waits for it
FENCE_RELEASE_BUDGET = 15.0
MEMBERS_BUDGET = 30.0  # one read of the mesh's heartbeats (a LIST and a few GETs)
_REGION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

Say = Callable[[str], None]


class RelocateError(Exception):
    """A refusal or failure; one ``lchat: error:`` line. Nothing was flipped."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("host", help="the space's hostname (a hibernating instance)")
    parser.add_argument(
        "--to",
        dest="to",
        required=True,
        metavar="REGION",
        help="the destination region (a LCHAT_MESH_REGION; its bucket from LCHAT_REGION_BUCKETS)",
    )
    parser.add_argument(
        "--move-dns",
        action="store_true",
        help="also point the host's own A/AAAA records at the destination region's live boxes "
        "(Route53 only: LCHAT_DNS_PROVIDER=route53; not needed for correctness)",
    )
    parser.add_argument("--json", action="store_true", help="print the steps as one JSON object")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"bound of the whole relocation (default {DEFAULT_TIMEOUT:g}); the copy must also "
        "finish within the lease TTL (LCHAT_LEASE_TTL), or it is refused before the flip",
    )


def run(
    args: argparse.Namespace,
    cfg: BoxConfig,
    registry: Registry,
    out: Say,
    note: Say,
    notify_router: Callable[[BoxConfig], None],
) -> int:
    """The command. Raises :class:`RelocateError` for a refusal (the caller prints it)."""
    host = hosts.normalise(args.host)
    dest: str = args.to
    if not _REGION.fullmatch(dest):
        raise RelocateError(f"--to {dest!r} must be letters, digits, '.', '_' or '-'")
    route = registry.get(host)
    if route is None:
        raise RelocateError(f"{host} is not registered")
    if route.kind != "instance":
        raise RelocateError(f"{host} is a service (a server lchat does not run): it cannot move")
    if not route.hibernate:
        raise RelocateError(
            f"{host} is a live instance: its database is on this box's disk, so no other box can "
            f"restore it. Convert it first with `lchat hibernate {host} --on`, then relocate"
        )
    if cfg.hibernate is None:
        raise RelocateError("relocating needs the hibernation bucket: set LCHAT_HIBERNATE_BUCKET")
    move_dns: bool = getattr(args, "move_dns", False)
    if move_dns:
        if cfg.mesh is None:
            raise RelocateError(
                "--move-dns points the record at the destination region's live boxes, which "
                "only the mesh knows: set LCHAT_MESH_SELF (or move the record by hand)"
            )
        try:
            move_dns_cli.require_route53(cfg, host)
        except move_dns_cli.MoveDNSError as e:
            raise RelocateError(f"{e}; nothing was copied or flipped") from e
    source = route.home_region or (cfg.mesh.region if cfg.mesh is not None else "")
    steps: dict[str, Any] = {"host": host, "from": source, "to": dest}
    if route.home_region == dest:
        steps["result"] = "nothing to do"
        done = [f"{host}: already in {dest}: nothing to do"]
        if move_dns:
            members = runner.run(lambda reactor: _read_members(reactor, cfg), MEMBERS_BUDGET + 5)
            if isinstance(members, Exception):
                raise RelocateError(
                    f"{host}: could not read the mesh's members ({members}) to move its record"
                ) from members
            _dns_step(
                cfg, host, dest, sorted(m.url for m in members if m.region == dest), steps, done
            )
        _report(args, steps, done, out)
        return 0
    src_bucket, dst_bucket = _buckets(cfg, source, dest)
    lines: list[str] = []
    fanned: list[str] = []

    def flip() -> None:
        """Step 2: the registry column, the router, the peers (``fan_out_upsert`` never raises)."""
        updated = registry.update(host, home_region=dest)
        notify_router(cfg)
        mesh_cli.fan_out_upsert(cfg, updated, fanned.append)

    shared = src_bucket is None or dst_bucket is None or src_bucket.same_place(dst_bucket)
    placed: dict[str, Any] | None = None
    if shared:
        if cfg.mesh is not None:
            members = runner.run(lambda reactor: _read_members(reactor, cfg), MEMBERS_BUDGET + 5)
            placed = _placement(cfg, host, dest, shared, members, note)
        steps["store"] = {"copied": False, "why": "shared bucket"}
        lines.append(
            "store: no copy — source and destination share the same bucket (the shared-bucket case)"
        )
        flip()
        # Awake here, it would keep being served here until its idle sleep: sleep it now, so its
        # next request wakes it where the mesh now places it (the lease hands it over).
        if _sleep_here(cfg, host):
            note(f"{host}: slept on this box; its next request wakes it in {dest}")
    else:
        assert src_bucket is not None and dst_bucket is not None

        def check_placement(members: list[Member] | Exception) -> None:
            nonlocal placed
            placed = _placement(cfg, host, dest, shared, members, note)

        steps["store"] = _copy_and_flip(
            cfg,
            host,
            (source, dest),
            src_bucket,
            dst_bucket,
            args.timeout,
            flip,
            note,
            check_placement,
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
            f"placement: no live box in {dest} yet — the mesh places {host} on the whole fleet "
            f"until one joins (availability wins over residency; the bucket is shared)"
        )
    if cfg.mesh is None:
        lines.append(
            f"home_region flipped (no mesh on this box: no peers to tell) — {host} → {dest}"
        )
    else:
        lines.append(
            f"home_region flipped + route re-fanned-out to peers — the mesh now places {host} on "
            f"a {dest} box"
        )
    for line in fanned:
        note(line)
    if move_dns:
        live = placed["live_boxes"] if placed is not None else []
        try:
            _dns_step(cfg, host, dest, live, steps, lines)
        except RelocateError as e:
            # The move stands: report it, then the record that did not follow.
            _report(
                args, steps, [f"relocated {host}: {source or '(no region)'} → {dest}", *lines], out
            )
            raise RelocateError(
                f"{host} is relocated to {dest}, but its DNS record was not moved: {e}. The "
                f"wildcard and the mesh's forwarding keep it reachable; re-run with --move-dns"
            ) from e
    _report(args, steps, [f"relocated {host}: {source or '(no region)'} → {dest}", *lines], out)
    return 0


def _dns_step(
    cfg: BoxConfig, host: str, dest: str, live: list[str], steps: dict[str, Any], lines: list[str]
) -> None:
    """``--move-dns``: the host's own records made the addresses of ``dest``'s live boxes
    (``live``: their mesh URLs). No live box there (a shared bucket's fallback): left alone,
    said so. Raises :class:`RelocateError` when Route53 refuses or fails."""
    if not live:
        steps["dns"] = {"changed": False, "why": f"no live box in {dest}"}
        lines.append(f"dns: not moved — no live box in {dest} to point {host} at")
        return
    try:
        addresses = move_dns_cli.destination_addresses(live)
        moved = move_dns_cli.move_dns(cfg, host, addresses)
    except move_dns_cli.MoveDNSError as e:
        raise RelocateError(str(e)) from e
    steps["dns"] = moved.as_json()
    lines.append(moved.line)


def _placement(
    cfg: BoxConfig, host: str, dest: str, shared: bool, members: list[Member] | Exception, note: Say
) -> dict[str, Any] | None:
    """The destination region's live boxes, from the mesh's heartbeats as read before anything
    moves (``members``; the exception if the read failed; None without a mesh). With per-region
    buckets and none of them live, the move is refused: placement would fall back to a box of
    another region, whose bucket holds no current copy (the router refuses to wake it there, so
    the space would be down until a ``dest`` box joins). With a shared bucket any box can wake
    it, so the move goes ahead and says so."""
    if cfg.mesh is None:
        return None
    if isinstance(members, Exception):
        if shared:
            note(f"could not read the mesh's members ({members}): placement in {dest} not checked")
            return None
        raise RelocateError(
            f"{host}: could not read the mesh's members ({members}), so whether a {dest} box is "
            f"live is unknown; nothing was copied or flipped: retry"
        ) from members
    live = sorted(m.url for m in members if m.region == dest)
    if not live and not shared:
        raise RelocateError(
            f"{host}: no live box in region {dest}, and {dest} keeps its replicas in its own "
            f"bucket: placement would fall back to a box of another region, which cannot wake "
            f"it from there. Start a {dest} box (LCHAT_MESH_REGION={dest}) first, or relocate "
            f"to a region that has one; nothing was copied or flipped"
        )
    return {"region": dest, "live_boxes": live}


async def _read_members(reactor: Any, cfg: BoxConfig) -> list[Member] | Exception:
    """The mesh's live members, or the error that kept us from reading them."""
    try:
        d = Deferred.fromCoroutine(mesh_cli.read_mesh_members(reactor, cfg))
        d.addTimeout(MEMBERS_BUDGET, reactor)
        return await d
    except (ObjectStoreError, ConfigError, defer.TimeoutError) as e:
        return e


def _report(args: argparse.Namespace, steps: dict[str, Any], lines: list[str], out: Say) -> None:
    if args.json:
        out(json.dumps(steps, ensure_ascii=False, sort_keys=True))
    else:
        for line in lines:
            out(line)


def _buckets(cfg: BoxConfig, source: str, dest: str) -> tuple[Where | None, Where | None]:
    """Each side's bucket; (None, None) when every region shares this box's bucket."""
    if not cfg.region_buckets:
        return None, None
    by_region = cfg.region_buckets
    assert cfg.hibernate is not None
    here = cfg.hibernate.where  # a space without a home region lives where this box keeps its own
    for region in (source, dest):
        if region and region not in by_region:
            raise RelocateError(
                f"LCHAT_REGION_BUCKETS has no bucket for region {region!r} (it names "
                f"{', '.join(sorted(by_region))}): add REGION=s3://BUCKET/PREFIX?... for it"
            )
    return by_region.get(source, here), by_region[dest]


# --- the copy -----------------------------------------------------------------------------------


def _copy_and_flip(
    cfg: BoxConfig,
    host: str,
    labels: tuple[str, str],  # the source's and the destination's mesh region ("": here)
    src: Where,
    dst: Where,
    timeout: float,
    flip: Callable[[], None],
    note: Say,
    check_placement: Callable[[list[Member] | Exception], None],
) -> dict[str, Any]:
    held: list[bool] = []  # set once this box's router holds the space asleep

    def sleep_and_hold() -> None:
        held.append(_sleep_and_hold(cfg, host, min(timeout + 60.0, MAX_HOLD), note))

    try:
        return _fenced_copy_and_flip(
            cfg, host, labels, src, dst, timeout, flip, check_placement, sleep_and_hold
        )
    finally:
        # After the flip (and the router's reload): a request now goes to the destination.
        if any(held):
            _release_hold(cfg, host, note)


def _fenced_copy_and_flip(
    cfg: BoxConfig,
    host: str,
    labels: tuple[str, str],
    src: Where,
    dst: Where,
    timeout: float,
    flip: Callable[[], None],
    check_placement: Callable[[list[Member] | Exception], None],
    sleep_and_hold: Callable[[], None],
) -> dict[str, Any]:
    hib = cfg.hibernate
    assert hib is not None
    owner = f"{cfg.box_id} (lchat relocate)"

    async def main(reactor: Any) -> dict[str, Any]:
        run_in_thread = thread_runner(reactor)
        if cfg.mesh is not None:
            # Before anything moves: a destination region without a live box is a refusal.
            check_placement(await _read_members(reactor, cfg))
        await run_in_thread(sleep_and_hold)
        src_store, dst_store = [
            await open_bucket(reactor, cfg, where, what=f"region {label}", make_dir=True)
            for where, label in zip((src, dst), labels, strict=True)
        ]
        fences: list[tuple[ObjectStore, lease.HeldLease]] = []
        try:
            for store, where, label in zip((src_store, dst_store), (src, dst), labels, strict=True):
                try:
                    held = await lease.acquire(
                        store,
                        lease.lease_key(where.prefix, host),
                        owner,
                        hib.lease_ttl,
                        host=host,
                        monotonic=time.monotonic,
                    )
                except lease.LeaseHeld as e:
                    raise RelocateError(
                        f"{host}: its lease in region {label or 'here'} ({_url(where)}) is "
                        f"held by {e.owner} until {lease.rfc3339(e.expires_at)}: it is awake "
                        f"there (or a relocation is running). Let it sleep on that box (`lchat "
                        f"hibernate {host} --off` sleeps it, or wait for its idle timeout), then "
                        f"retry; nothing was copied or flipped"
                    ) from e
                fences.append((store, held))
            started = time.monotonic()
            result = await _copy(
                reactor,
                host,
                src,
                dst,
                src_store,
                dst_store,
                run_in_thread,
                dest=labels[1],
                one_account=_one_account(cfg, src, dst),
            )
            if time.monotonic() - started > hib.lease_ttl * 0.9:
                raise RelocateError(
                    f"{host}: the copy took longer than the lease TTL ({hib.lease_ttl:g}s), so "
                    f"the fence may have lapsed: re-run (objects already copied are skipped); "
                    f"nothing was flipped"
                )
            # Flipped while both fences hold: no box can write the source after the copy and
            # before the peers forward to the destination region.
            await run_in_thread(flip)
            return result
        finally:
            for store, held in fences:
                await lease.release(reactor, store, held, FENCE_RELEASE_BUDGET)
            await src_store.close()
            await dst_store.close()

    try:
        result: dict[str, Any] = runner.run(main, timeout)
    except ObjectStoreError as e:
        raise RelocateError(f"{host}: the bucket failed ({e}); nothing was flipped: retry") from e
    except ConfigError as e:
        raise RelocateError(f"LCHAT_REGION_BUCKETS: {e}") from e
    except TimeoutError as e:
        raise RelocateError(f"{host}: the relocation did not finish ({e}); retry") from e
    return result


def _sleep_and_hold(cfg: BoxConfig, host: str, hold: float, note: Say) -> bool:
    """Ask this box's router to sleep the space (flush, release the lease), as ``lchat hibernate
    --off`` does, and to keep it asleep for ``hold`` seconds (requests meanwhile get 503 with a
    short Retry-After instead of waking it again before the fence is taken). Whether a hold was
    placed. A router that is not running has nothing awake; another box's wake shows up as its
    lease, which the fence refuses."""
    try:
        response = admin_client.sleep_space(cfg.admin_socket, host, SLEEP_TIMEOUT, hold=hold)
    except admin_client.Unreachable:
        return False
    except admin_client.ProtocolError as e:
        # The hold may have been placed before the sleep timed out: lift it.
        _release_hold(cfg, host, note)
        raise RelocateError(
            f"{host}: the router did not finish putting it to sleep within {SLEEP_TIMEOUT:g}s "
            f"({e}); nothing was copied or flipped: retry"
        ) from e
    if response.status == 200:
        note(f"{host}: asleep on this box and held asleep while it moves")
        return True
    if response.status not in (404, 409):
        note(f"the router answered {response.status} to /sleep for {host}; checking the lease")
    return False


def _sleep_here(cfg: BoxConfig, host: str) -> bool:
    """After a shared-bucket flip: sleep the space if this box's router runs it (best effort:
    otherwise it moves at its idle sleep). Whether it was asleep-by-us."""
    try:
        state = admin_client.status(cfg.admin_socket).json()["hosts"].get(host, {}).get("state")
        if state not in ("awake", "waking"):
            return False
        response = admin_client.sleep_space(cfg.admin_socket, host, SLEEP_TIMEOUT)
    except (admin_client.Unreachable, admin_client.ProtocolError, ValueError, KeyError):
        return False
    return response.status == 200


def _release_hold(cfg: BoxConfig, host: str, note: Say) -> None:
    """Lift the hold (it also ends by itself at its deadline)."""
    try:
        admin_client.release(cfg.admin_socket, host)
    except (admin_client.Unreachable, admin_client.ProtocolError) as e:
        note(f"{host}: could not lift the hold on this box's router ({e}); it ends by itself")


async def _copy(
    reactor: Any,
    host: str,
    src: Where,
    dst: Where,
    src_store: ObjectStore,
    dst_store: ObjectStore,
    run_in_thread: RunInThread,
    *,
    dest: str,
    one_account: bool = False,
) -> dict[str, Any]:
    src_dir, dst_dir = src.key(host) + "/", dst.key(host) + "/"
    source = [i for i in await src_store.list(src_dir) if not _is_lock(i, src_dir)]
    there = {i.key[len(dst_dir) :]: i for i in await dst_store.list(dst_dir)}
    there.pop(lease.LOCK_NAME, None)  # our own fence
    src_txid = _newest_txid(source)
    dst_txid = _newest_txid(list(there.values()))
    if not source:
        raise RelocateError(f"{host}: no replica under {_url(src)}/{host}/: nothing to copy")
    if dst_txid > src_txid:
        raise RelocateError(
            f"{host}: the destination {_url(dst)}/{host}/ is ahead of the source (newest txid "
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
        # Replica files are immutable under their name (level and txid range): same size, same file.
        if existing is not None and existing.size == info.size:
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
    after = [i for i in await dst_store.list(dst_dir) if not _is_lock(i, dst_dir)]
    if _newest_txid(after) != src_txid:
        raise RelocateError(
            f"{host}: after the copy the destination's newest txid is "
            f"{_newest_txid(after):016x}, not the source's {src_txid:016x}; nothing was flipped"
        )
    return {
        "copied": True,
        "from": f"{_url(src)}/{host}/",
        "to": f"{_url(dst)}/{host}/",
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
        try:
            await run_in_thread(os.unlink, path)
        except FileNotFoundError:
            pass


def _one_account(cfg: BoxConfig, src: Where, dst: Where) -> bool:
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


def _is_lock(info: ObjectInfo, directory: str) -> bool:
    return info.key == directory + lease.LOCK_NAME


def _newest_txid(infos: list[ObjectInfo]) -> int:
    files = replica_files(infos)
    return max((f.max_txid for f in files), default=0)


def _url(where: Where) -> str:
    """The bucket and prefix, without how it is reached (``str(where)`` has that)."""
    return str(Where(where.bucket, where.prefix))


def run_cli(
    args: argparse.Namespace,
    cfg: BoxConfig,
    open_registry: Callable[[BoxConfig], Registry],
    out: Say,
    note: Say,
    notify_router: Callable[[BoxConfig], None],
    fail: Callable[[str], int],
) -> int:
    """``lchat relocate``'s handler: a refusal is one ``lchat: error:`` line, exit status 1."""
    try:
        return run(args, cfg, open_registry(cfg), out, note, notify_router)
    except RelocateError as e:
        return fail(str(e))
