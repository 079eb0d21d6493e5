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
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred

from lchat import hosts, lease
from lchat.cli import admin_client
from lchat.cli import mesh as mesh_cli
from lchat.config import BoxConfig, RegionBucket
from lchat.objstore import ObjectInfo, ObjectStore, ObjectStoreError, needs_credentials, open_store
from lchat.objstore.aws import ResolvedCredentials, resolve_credentials
from lchat.registry import Registry
from lchat.replica.restore import replica_files
from lchat.threads import RunInThread, thread_runner

SUMMARY = "move a hibernating space to another region (copy its replica, flip home_region)"
DEFAULT_TIMEOUT = 3600.0  # the whole relocation: a large replica's download + re-upload
SLEEP_TIMEOUT = 150.0  # POST /sleep: as `lchat hibernate --off` waits for it
FENCE_RELEASE_BUDGET = 15.0
_REGION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

Say = Callable[[str], None]
_T = TypeVar("_T")


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
    source = route.home_region or (cfg.mesh.region if cfg.mesh is not None else "")
    steps: dict[str, Any] = {"host": host, "from": source, "to": dest}
    if route.home_region == dest:
        steps["result"] = "nothing to do"
        _report(args, steps, [f"{host}: already in {dest}: nothing to do"], out)
        return 0
    src_bucket, dst_bucket = _buckets(cfg, source, dest)
    lines: list[str] = []
    fanned: list[str] = []

    def flip() -> None:
        """Step 2: the registry column, the router, the peers (``fan_out_upsert`` never raises)."""
        updated = registry.update(host, home_region=dest)
        notify_router(cfg)
        mesh_cli.fan_out_upsert(cfg, updated, fanned.append)

    if src_bucket is None or dst_bucket is None or src_bucket.same_place(dst_bucket):
        steps["store"] = {"copied": False, "why": "shared bucket"}
        lines.append(
            "store: no copy — source and destination share the same bucket (the shared-bucket case)"
        )
        flip()
    else:
        steps["store"] = _copy_and_flip(cfg, host, src_bucket, dst_bucket, args.timeout, flip, note)
        store = steps["store"]
        lines.append(
            f"store: copied {store['objects']} objects ({store['bytes']} bytes, "
            f"{store['skipped']} already there) {store['from']} → {store['to']} by "
            f"{store['method']}, lock.json excluded; newest txid {store['txid']}"
        )
    steps["home_region"] = dest
    steps["fan_out"] = fanned
    steps["result"] = "relocated"
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
    _report(args, steps, [f"relocated {host}: {source or '(no region)'} → {dest}", *lines], out)
    return 0


def _report(args: argparse.Namespace, steps: dict[str, Any], lines: list[str], out: Say) -> None:
    if args.json:
        out(json.dumps(steps, ensure_ascii=False, sort_keys=True))
    else:
        for line in lines:
            out(line)


def _buckets(
    cfg: BoxConfig, source: str, dest: str
) -> tuple[RegionBucket | None, RegionBucket | None]:
    """Each side's bucket; (None, None) when every region shares this box's bucket."""
    if not cfg.region_buckets:
        return None, None
    by_region = {b.region: b for b in cfg.region_buckets}
    hib = cfg.hibernate
    assert hib is not None
    # A space without a home region lives wherever this box keeps its replicas.
    here = RegionBucket(
        region="", bucket=hib.bucket, prefix=hib.prefix, s3_region=hib.region, endpoint=hib.endpoint
    )
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
    src: RegionBucket,
    dst: RegionBucket,
    timeout: float,
    flip: Callable[[], None],
    note: Say,
) -> dict[str, Any]:
    hib = cfg.hibernate
    assert hib is not None
    _sleep_first(cfg, host, note)
    owner = f"{cfg.box_id} (lchat relocate)"

    async def main(reactor: Any) -> dict[str, Any]:
        run_in_thread = thread_runner(reactor)
        src_store = await _open(reactor, cfg, src, run_in_thread)
        dst_store = await _open(reactor, cfg, dst, run_in_thread)
        fences: list[tuple[ObjectStore, lease.HeldLease]] = []
        try:
            for store, where in ((src_store, src), (dst_store, dst)):
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
                        f"{host}: its lease in region {where.region or 'here'} ({_url(where)}) is "
                        f"held by {e.owner} until {lease.rfc3339(e.expires_at)}: it is awake "
                        f"there (or a relocation is running). Let it sleep on that box (`lchat "
                        f"hibernate {host} --off` sleeps it, or wait for its idle timeout), then "
                        f"retry; nothing was copied or flipped"
                    ) from e
                fences.append((store, held))
            started = time.monotonic()
            result = await _copy(reactor, host, src, dst, src_store, dst_store, run_in_thread)
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
        result: dict[str, Any] = _on_reactor(main, timeout)
    except ObjectStoreError as e:
        raise RelocateError(f"{host}: the bucket failed ({e}); nothing was flipped: retry") from e
    except TimeoutError as e:
        raise RelocateError(f"{host}: the relocation did not finish ({e}); retry") from e
    return result


def _on_reactor(main: Callable[[Any], Coroutine[Any, Any, _T]], budget: float) -> _T:
    """Run ``main(reactor)`` on the *global* reactor within ``budget`` seconds (then
    :class:`TimeoutError`). Not a reactor of our own, as the mesh fan-out uses: an upload's body
    producer is driven by the global reactor's cooperator, so a PUT on another reactor never
    finishes. Started here (once per process) when it is not running; handed to it when it runs
    in another thread (tests call the command from a worker thread)."""
    from twisted.internet import reactor
    from twisted.internet.threads import blockingCallFromThread
    from twisted.python.threadable import isInIOThread

    from lchat.cli.replica import _run_on_reactor

    r: Any = reactor

    async def bounded(r: Any) -> _T:
        d = Deferred.fromCoroutine(main(r))
        d.addTimeout(budget, r)
        try:
            return await d
        except defer.TimeoutError as e:
            raise TimeoutError(f"not finished within {budget:g}s") from e

    if not r.running:
        return _run_on_reactor(bounded)
    if isInIOThread():
        raise RuntimeError("relocate would block the reactor's own thread")

    def start() -> Deferred[Any]:
        return Deferred.fromCoroutine(bounded(r))

    result: _T = cast(_T, blockingCallFromThread(r, start))
    return result


def _sleep_first(cfg: BoxConfig, host: str, note: Say) -> None:
    """Ask this box's router to sleep the space (flush, release the lease), as ``lchat hibernate
    --off`` does. A router that is not running has nothing awake; another box's wake shows up as
    its lease, which the fence refuses."""
    try:
        response = admin_client.sleep_space(cfg.admin_socket, host, SLEEP_TIMEOUT)
    except admin_client.Unreachable:
        return
    except admin_client.ProtocolError as e:
        raise RelocateError(
            f"{host}: the router did not finish putting it to sleep within {SLEEP_TIMEOUT:g}s "
            f"({e}); nothing was copied or flipped: retry"
        ) from e
    if response.status == 200:
        note(f"{host}: asleep on this box (flushed to the bucket, lease released)")
    elif response.status not in (404, 409):
        note(f"the router answered {response.status} to /sleep for {host}; checking the lease")


async def _open(
    reactor: Any, cfg: BoxConfig, where: RegionBucket, run_in_thread: RunInThread
) -> ObjectStore:
    """``where``'s store, signed for its own region, with its own keys when it names them."""
    credentials: ResolvedCredentials | None = None
    if needs_credentials(where.bucket):
        env = {**cfg.aws_env, **os.environ}
        if where.access_key_env:
            # The named variables may sit in the env file (beside the AWS_* ones) or the process
            # environment, which wins as it does for AWS_*.
            env = {**cfg.file_env, **os.environ}
            missing = [n for n in (where.access_key_env, where.secret_key_env) if not env.get(n)]
            if missing:
                raise RelocateError(
                    f"LCHAT_REGION_BUCKETS: region {where.region}'s keys are in "
                    f"{' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} unset"
                )
            keep = {k: v for k, v in env.items() if k in ("AWS_REGION", "AWS_DEFAULT_REGION")}
            env = {
                **keep,
                "AWS_ACCESS_KEY_ID": env[where.access_key_env],
                "AWS_SECRET_ACCESS_KEY": env[where.secret_key_env],
            }
        credentials = await run_in_thread(resolve_credentials, env)
    else:
        # A file: region's directory is made on first use, as the id ledger's is.
        await run_in_thread(os.makedirs, where.bucket[len("file:") :], 0o700, True)
    return open_store(
        reactor,
        where.bucket,
        run_in_thread,
        monotonic=time.monotonic,
        region=where.s3_region,
        endpoint=where.endpoint,
        credentials=credentials,
    )


async def _copy(
    reactor: Any,
    host: str,
    src: RegionBucket,
    dst: RegionBucket,
    src_store: ObjectStore,
    dst_store: ObjectStore,
    run_in_thread: RunInThread,
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
            f"{dst_txid:016x} > {src_txid:016x}): it was written in {dst.region} after an earlier "
            f"move, and copying would put stale bytes over newer ones. Nothing was copied or "
            f"flipped; if {dst.region} is where it lives, flip only its home_region"
        )
    same_store = (src.bucket, src.endpoint) == (dst.bucket, dst.endpoint)
    method = "server-side copy" if same_store else "download + re-upload"
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


def _is_lock(info: ObjectInfo, directory: str) -> bool:
    return info.key == directory + lease.LOCK_NAME


def _newest_txid(infos: list[ObjectInfo]) -> int:
    files = replica_files(infos)
    return max((f.max_txid for f in files), default=0)


def _url(where: RegionBucket) -> str:
    if where.bucket.startswith("file:"):
        return where.bucket + (f"/{where.prefix}" if where.prefix else "")
    return f"s3://{where.bucket}" + (f"/{where.prefix}" if where.prefix else "")


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
