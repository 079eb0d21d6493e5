"""A model of the heartbeat-fenced lease (docs/lease.md, issue 18): never two writers whose writes
both survive.

What runs for real, and what is modelled
----------------------------------------

A discrete-event simulation on one real-time axis drives the *real* parts that decide who may
write: each router process has its own :class:`~lchat.mesh.membership.Membership` (beats, the
liveness deadline ``holder_deadline``, the stand-down hook, the janitor), its own
:class:`~lchat.mesh.fence.BoxFence` and :class:`~lchat.mesh.fence.HolderJudge` (``judged_dead``),
and :func:`lchat.lease.acquire` / :class:`lchat.lease.LeaseKeeper` (``lease_expiry``,
``reclaim_own``, renewals, release). They talk to a model bucket through :class:`ModelStore`, an
:class:`~lchat.objstore.ObjectStore` whose writes travel through a model network. Each process
has a ``task.Clock`` that is its *monotonic* clock: it runs at ``1 + rho`` times real time (|rho|
up to 5 % here, the rule's margin is ``LIVENESS_MARGIN`` = 10 %), keeps counting while the
process is frozen, and fires the process's timers only while it runs.

The bucket's clock is real time: ``Last-Modified`` is the landing time and ``Date`` the time of
the read, both truncated to whole seconds as S3 does. Reads are instant (a read's latency only
moves the moment it reads at; a cut-off box's reads fail). Every write (PUT, DELETE) is applied
at its *landing*: at once by default (50 ms), or as a rule arranges for a box's next write of a
kind: ``hold`` (it lands whenever the ``deliver`` rule says, possibly much later: the late
write), ``mute`` (it lands, the answer is lost), ``lose`` (it never lands), ``slow`` (it lands
after a few seconds). A box cut off from the bucket (``partition``) has its writes held and its
reads failing. A sender gives up after the store's 30 s (or its own, shorter, timeout); its write
may land later all the same (a killed process's writes too: the request was sent). Conditions
(``If-Match``, ``If-None-Match``) are checked when a write lands; ETags are the MD5 of the body,
as S3's are for a plain PUT.

The activator and the replicator are modelled (:class:`ModelSpace`, :class:`ModelReplicator`),
mirroring lchat/hibernation/lifecycle.py (wake: ``fence.ready``, ``acquire``, keeper, LIST and
restore, replication start; stand-down: flush, then release unless the lease was lost, "no
release without a flush" unless replication never started) and lchat/replica/replicator.py
(``start``: the listed max txid, ``+ TAKEOVER_TXID_GAP`` after any takeover and no resume; one
upload at a time, each after ``keeper.ensure_held()``; a failed upload is retried as it was,
after a LIST that re-seeds above files it did not write). One space; a database state is the
tuple of the commits it holds: a snapshot file carries a state, a level-0 file the state it
applies to and the state after it (what LTX's checksums stand for).

Rules: let time pass; wake the space on a box; commit on its holder; put it to sleep; cut a box
off the bucket or reconnect it; trouble a box's next write of a kind (above); deliver a held
write; kill, freeze, thaw (the answers that arrived while frozen are handled before or after the
overdue timers: the event loop runs ready I/O first, or not), restart (a new epoch), or drain a
box (``begin_drain``, sleep, ``stopService``).

Invariants ("never two writers whose writes both survive")
----------------------------------------------------------

- **Timing**: a box never *sends* a replica write (the model's send is the moment its
  ``ensure_held()`` check passed) after another tenure replaced or removed its lease in the bucket.
- **What a restore reads**, after every landing: the plan of :func:`lchat.replica.restore.
  plan_files` over the bucket's files (the newest snapshot, then the contiguous files above it)
  exists once any file does (no gap); every level-0 file in it applies to exactly the state
  before it; each was sent while its writer held the lease; and no *late* file (one that landed
  after its writer's lease had been taken over) is part of it once a later holder's snapshot is
  in the bucket.

Running it
----------

``derandomize=True``: the same examples on every run (CI). ``LCHAT_FENCE_MODEL_EXAMPLES=2000``
runs that many examples instead, from a random seed each time (``LCHAT_FENCE_MODEL_STEPS``: steps
per example); a failure prints the rules that lead to it and the model's log of that run.

Not modelled: more than one space; compaction, retention and their deletes; the replicator's
periodic snapshots; the fleet backup; local warm copies (``txid_floor``); the lock vanishing
(``verify_retake``); a bucket losing data; the store's own retries (one logical write, sent
when it was checked, that may land late: the same as ``hold``); clock steps of the bucket.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import math
import os
from collections.abc import Callable, Coroutine
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from twisted.internet import task
from twisted.internet.defer import CancelledError, Deferred, DeferredLock
from twisted.trial.unittest import SynchronousTestCase

from lchat.config import MeshConfig
from lchat.lease import HeldLease, LeaseHeld, LeaseKeeper, LeaseLost, LeaseSuspended, NotAlive
from lchat.lease import acquire as acquire_lease
from lchat.lease import lease_key
from lchat.mesh.fence import BoxFence, HolderJudge
from lchat.mesh.membership import LIVENESS_MARGIN, Membership, members_prefix
from lchat.objstore import (
    UTC,
    NotFound,
    ObjectInfo,
    ObjectStoreError,
    PreconditionFailed,
    PutResult,
    StoredObject,
    StoreUnavailable,
)
from lchat.replica.restore import SNAPSHOT_LEVEL, RestoreError, plan_files, replica_files
from lchat.replica.replicator import TAKEOVER_TXID_GAP

# --- the world's constants ----------------------------------------------------------------------

HEARTBEAT = 15.0  # LCHAT_MESH_HEARTBEAT default
DEAD_AFTER = 45.0  # LCHAT_MESH_DEAD_AFTER default
TTL = 120.0  # LCHAT_LEASE_TTL: short, so that expiry takeovers happen within a run too
LATENCY = 0.05  # a write lands this long after it is sent, its answer as long after that
STORE_TIMEOUT = 30.0  # S3Store's per-attempt timeout: the sender gives up, the write may land
SYNC_GAP = 1.0  # the replicator's gap between syncs ("stream")
FLUSH_BUDGET = 30.0
RELEASE_BUDGET = 5.0
WAKE_BUDGET = 10.0
MAX_DRIFT = 0.05  # |rho|: well inside LIVENESS_MARGIN, which the rule tolerates

HOST = "space.example"
T0 = datetime.datetime(2030, 1, 1, tzinfo=UTC)


class _Where:
    """The hibernation bucket's key prefix (lchat.config's ``key``)."""

    def key(self, *parts: str) -> str:
        return "/".join(["p", *parts])


WHERE = _Where()
LOCK = lease_key("p", HOST)
REPLICA = WHERE.key(HOST)
MEMBERS = members_prefix(WHERE)

# What the model saw across all examples of a run (for the coverage test).
SEEN: collections.Counter[str] = collections.Counter()


def bucket_time(t: float) -> datetime.datetime:
    """The bucket's clock at real time ``t``, truncated to whole seconds as S3's dates are."""
    return T0 + datetime.timedelta(seconds=math.floor(t))


def file_key(level: int, lo: int, hi: int) -> str:
    return f"{REPLICA}/{level:04x}/{lo:016x}-{hi:016x}.ltx"


class ModelViolation(AssertionError):
    pass


class WakeFailed(Exception):
    pass


class ReplicatorStopped(Exception):
    pass


# --- the bucket and the network -----------------------------------------------------------------


class FileMeta:
    """What one replica upload carries (one attempt: a retry is another, alike)."""

    def __init__(
        self,
        tenure: Tenure,
        level: int,
        txid: int,
        pre: tuple[str, ...] | None,
        post: tuple[str, ...],
    ) -> None:
        self.tenure = tenure
        self.level = level
        self.lo = 1 if level == SNAPSHOT_LEVEL else txid
        self.hi = txid
        self.pre = pre  # the state a level-0 file applies to (None: a snapshot)
        self.post = post
        self.key = file_key(level, self.lo, self.hi)
        self.sent_at = 0.0
        self.sent_while_held = True
        self.landed_late = False  # landed after the lease was no longer its writer's

    def attempt(self) -> FileMeta:
        copy = FileMeta(self.tenure, self.level, self.hi, self.pre, self.post)
        return copy

    def body(self) -> bytes:
        return repr((self.level, self.lo, self.hi, self.pre, self.post)).encode()

    def describe(self) -> str:
        what = "snapshot" if self.level == SNAPSHOT_LEVEL else "level-0"
        return f"{what} txid {self.hi} by {self.tenure.name}"


class Obj:
    def __init__(self, key: str, body: bytes, landed: float, meta: FileMeta | None) -> None:
        self.key = key
        self.body = body
        self.etag = hashlib.md5(body).hexdigest()  # noqa: S324 -- S3's ETag of a plain PUT
        self.landed = landed
        self.meta = meta

    def info(self) -> ObjectInfo:
        return ObjectInfo(self.key, len(self.body), self.etag, bucket_time(self.landed))


class Request:
    """One write on the wire. ``land_at`` None: held until the ``deliver`` rule lands it."""

    def __init__(
        self,
        seq: int,
        proc: Proc,
        op: str,
        key: str,
        body: bytes,
        if_match: str | None,
        if_none_match: bool,
        meta: FileMeta | None,
    ) -> None:
        self.seq = seq
        self.proc = proc
        self.op = op
        self.key = key
        self.body = body
        self.if_match = if_match
        self.if_none_match = if_none_match
        self.meta = meta
        self.sent_at = 0.0
        self.waiter: Deferred[Any] = Deferred()
        self.timeout: Any = None
        self.land_at: float | None = None
        self.lands = True
        self.answers = True
        self.landed = False
        self.answer_at: float | None = None
        self.result: Any = None

    @property
    def kind(self) -> str:
        if self.key.startswith(MEMBERS):
            return "beat" if self.op == "put" else "hbdel"
        return "lock" if self.key == LOCK else "replica"

    def describe(self) -> str:
        what = self.meta.describe() if self.meta is not None else self.kind
        return f"#{self.seq} {self.op} {what} from {self.proc.name}"


FATES = [("hold", 0.0), ("mute", 0.0), ("lose", 0.0), ("slow", 3.0), ("slow", 16.0), ("slow", 31.0)]


class ModelStore:
    """One process's view of the model bucket: instant reads, writes through the network."""

    def __init__(self, sim: Sim, proc: Proc) -> None:
        self.sim = sim
        self.proc = proc

    def describe(self) -> str:
        return "the model bucket"

    def _reachable(self) -> None:
        if not self.proc.box.link_up:
            raise StoreUnavailable("cut off from the bucket (model)")

    async def get(self, key: str) -> StoredObject:
        self._reachable()
        obj = self.sim.bucket.get(key)
        if obj is None:
            raise NotFound("no such key", key)
        return StoredObject(obj.info(), obj.body)

    async def head(self, key: str) -> ObjectInfo:
        return (await self.get(key)).info

    async def list(self, prefix: str) -> list[ObjectInfo]:
        self._reachable()
        return [o.info() for k, o in sorted(self.sim.bucket.items()) if k.startswith(prefix)]

    async def now(self) -> datetime.datetime:
        self._reachable()
        return bucket_time(self.sim.now)

    async def put(
        self,
        key: str,
        body: bytes,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
        metadata: Any = None,
        content_type: str = "application/octet-stream",
    ) -> PutResult:
        result: PutResult = await self.sim.send(
            self.proc, "put", key, body, if_match, if_none_match, None
        )
        return result

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        await self.sim.send(self.proc, "delete", key, b"", if_match, False, None)

    async def upload(self, meta: FileMeta) -> PutResult:
        result: PutResult = await self.sim.send(
            self.proc, "put", meta.key, meta.body(), None, False, meta
        )
        return result

    async def close(self) -> None:
        pass


# --- boxes, processes, tenures ------------------------------------------------------------------


class Box:
    def __init__(self, index: int, rho: float) -> None:
        self.index = index
        self.rate = 1.0 + rho
        self.offset = 10_000.0 * (index + 1)  # monotonic clocks have their own origins
        self.url = f"https://box{index}.example"
        self.owner = f"box{index}"  # cfg.box_id: the same across restarts
        self.link_up = True
        self.trouble: dict[str, tuple[str, float]] = {}
        self.proc: Proc | None = None
        self.restarts = 0

    def mono(self, t: float) -> float:
        return self.offset + self.rate * t

    def real(self, m: float) -> float:
        return (m - self.offset) / self.rate


class Proc:
    """One router process of a box: its clock, its membership, the space it runs (if any)."""

    def __init__(self, sim: Sim, box: Box) -> None:
        self.sim = sim
        self.box = box
        self.name = f"{box.owner}.p{box.restarts}"
        self.clock = task.Clock()
        self.clock.rightNow = box.mono(sim.now)
        self.store = ModelStore(sim, self)
        mesh = MeshConfig(
            self_url=box.url,
            domains=("example",),
            token="t" * 32,
            region="",
            heartbeat=HEARTBEAT,
            dead_after=DEAD_AFTER,
        )
        self.membership = Membership(
            self.clock,
            self.store,  # type: ignore[arg-type]
            WHERE,
            mesh,
            started_at=0.0,
            monotonic=self.clock.seconds,
            epoch=self.name,
        )
        self.fence = BoxFence(
            self.membership,
            HolderJudge(self.store, WHERE, DEAD_AFTER),  # type: ignore[arg-type]
        )
        self.membership.on_not_alive(self.not_alive)
        self.state = "running"  # running | frozen | dead
        self.pending: list[Request] = []  # answers that arrived while frozen
        self.tenure: Tenure | None = None
        self.waking: Deferred[None] | None = None
        self.draining = False

    @property
    def running(self) -> bool:
        return self.state == "running"

    def not_alive(self) -> None:
        """The activator's ``box_not_alive``: every space stands down now."""
        self.sim.log(f"{self.name}: liveness deadline passed: standing every space down")
        SEEN["stand-down: not alive"] += 1
        if self.tenure is not None and self.tenure.keeper is not None:
            self.tenure.keeper.holds()
        elif self.waking is not None and not self.waking.called:
            self.waking.cancel()

    async def sleep(self, seconds: float) -> None:
        d: Deferred[None] = Deferred()
        self.clock.callLater(seconds, lambda: d.called or d.callback(None))
        await d


class Tenure:
    """One acquisition of the lease by one process, until it is lost or released."""

    def __init__(self, sim: Sim, proc: Proc, lease: HeldLease, index: int) -> None:
        self.sim = sim
        self.proc = proc
        self.lease = lease
        self.name = f"{proc.name}#{index}"
        self.keeper: LeaseKeeper | None = None
        self.rep = ModelReplicator(sim, self)
        self.local: tuple[str, ...] = ()
        self.commits = 0
        self.serving = False
        self.replicating = False
        self.lost: str | None = None
        self.stopping = False
        self.ended = False

    @property
    def took_over(self) -> bool:
        return self.lease.took_over_from is not None

    def on_lost(self, why: str) -> None:
        self.lost = why
        self.sim.log(f"{self.name}: lease lost ({why})")
        self.sim.spawn(self.sim.stand_down(self))


class ModelReplicator:
    """lchat/replica/replicator.py, reduced to what decides which file lands where."""

    def __init__(self, sim: Sim, tenure: Tenure) -> None:
        self.sim = sim
        self.tenure = tenure
        self.known: set[str] = set()
        self.ours_max = 0
        self.txid = 0
        self.need_snapshot = True
        self.queue: list[FileMeta] = []
        self.pos: tuple[str, ...] = ()
        self.check: str | None = None
        self.started = False
        self.stopped = False
        self.writing: Deferred[Any] | None = None
        self.lock = DeferredLock()
        self.call: Any = None

    async def start(self, listing: list[ObjectInfo], after_takeover: bool, resume: int | None) -> None:
        files = replica_files(listing)
        self.txid = max((f.max_txid for f in files), default=0)
        if after_takeover:
            resume = None
            self.txid += TAKEOVER_TXID_GAP
        for f in files:
            self._remember(f.info.key, f.max_txid)
        self.need_snapshot = not (resume is not None and 0 < resume == self.txid)
        self.pos = self.tenure.local
        self.started = True
        await self.lock.acquire()
        try:
            await self._sync()
        finally:
            self.lock.release()
        if self.stopped:
            raise ReplicatorStopped(self.tenure.lost or "stopped")
        if self.queue:
            raise StoreUnavailable("initial upload not done")

    def _remember(self, key: str, hi: int) -> None:
        self.known.add(key)
        self.ours_max = max(self.ours_max, hi)

    def pending(self) -> bool:
        return bool(self.queue) or self.need_snapshot or self.tenure.local != self.pos

    def schedule(self) -> None:
        if self.stopped or (self.call is not None and self.call.active()):
            return
        self.call = self.tenure.proc.clock.callLater(SYNC_GAP, self._tick)

    def _tick(self) -> None:
        self.call = None
        self.sim.spawn(self._tick_async())

    async def _tick_async(self) -> None:
        await self.lock.acquire()
        try:
            await self._sync()
        except (ObjectStoreError, ReplicatorStopped):
            pass
        finally:
            self.lock.release()
        if self.pending():
            self.schedule()

    async def flush(self) -> None:
        """``flush(check=True)``: raises unless everything committed is in the bucket."""
        await self.lock.acquire()
        try:
            if self.stopped:
                raise ReplicatorStopped(self.tenure.lost or "stopped")
            self.check = self.check or "flush"
            await self._sync()
            if self.stopped:
                raise ReplicatorStopped(self.tenure.lost or "stopped")
            if self.queue:
                raise StoreUnavailable(f"{len(self.queue)} files not uploaded")
        finally:
            self.lock.release()

    async def _sync(self) -> None:
        if self.stopped:
            return
        if self.check is not None:
            await self._check_bucket()
        if not await self._drain():
            return
        if self.need_snapshot:
            self._enqueue(FileMeta(self.tenure, SNAPSHOT_LEVEL, self.txid + 1, None, self.tenure.local))
            self.need_snapshot = False
        elif self.tenure.local != self.pos:
            self._enqueue(FileMeta(self.tenure, 0, self.txid + 1, self.pos, self.tenure.local))
        await self._drain()

    def _enqueue(self, meta: FileMeta) -> None:
        self.queue.append(meta)
        self.pos = meta.post
        self.txid = meta.hi

    async def _check_bucket(self) -> None:
        """``_check_locked``: files we did not write (a snapshot, or above our newest txid) or
        files of ours gone: re-seed with a snapshot above everything seen."""
        listing = await self.tenure.proc.store.list(REPLICA + "/")
        files = replica_files(listing)
        known = self.known | {m.key for m in self.queue}
        foreign = [
            f
            for f in files
            if f.info.key not in known
            and (f.level == SNAPSHOT_LEVEL or f.max_txid > self.ours_max)
        ]
        # (Nothing deletes replica files in this model and the bucket loses none: no "missing".)
        self.check = None
        if foreign:
            self.queue = []
            self.txid = max([self.txid, *(f.max_txid for f in foreign)])
            self.need_snapshot = True
            self.sim.log(f"{self.tenure.name}: files it did not write appeared: re-seeds")

    async def _drain(self) -> bool:
        while self.queue:
            meta = self.queue[0]
            if self.stopped:
                return False
            keeper = self.tenure.keeper
            assert keeper is not None
            try:
                keeper.ensure_held()
            except LeaseSuspended:
                return False
            except LeaseLost as e:
                self.stopped = True
                raise ReplicatorStopped(str(e)) from e
            attempt = meta.attempt()
            self.sim.sending(attempt)
            d = Deferred.fromCoroutine(self.tenure.proc.store.upload(attempt))
            self.writing = d
            try:
                await d
            except CancelledError:
                raise ReplicatorStopped(self.tenure.lost or "stopped") from None
            except ObjectStoreError:
                self.check = self.check or "write_error"
                return False
            finally:
                self.writing = None
            self.queue.pop(0)
            self._remember(meta.key, meta.hi)
        return True

    def stop(self) -> None:
        self.stopped = True
        if self.call is not None and self.call.active():
            self.call.cancel()
        if self.writing is not None:
            self.writing.cancel()


# --- the simulation -----------------------------------------------------------------------------


def _state(state: tuple[str, ...] | None) -> str:
    if state is None:
        return "nothing"
    return f"{len(state)} commits" + (f" up to {state[-1]}" if state else "")


class Sim:
    """The world: real time, the bucket, the network, the boxes, and what was seen."""

    def __init__(self, rhos: list[float]) -> None:
        self.now = 0.0
        self.boxes = [Box(i, rho) for i, rho in enumerate(rhos)]
        self.bucket: dict[str, Obj] = {}
        self.flying: list[Request] = []  # sent, not landed (land_at None: held)
        self.answering: list[Request] = []  # landed (or lost), the answer on its way
        self.seq = 0
        self.lines: list[str] = []
        self.violations: list[str] = []
        self.errors: list[BaseException] = []
        self.tenures: list[Tenure] = []
        self.lease_order: dict[str, int] = {}  # lease_id -> when its first version landed
        self.lease_names: dict[str, str] = {}  # lease_id -> tenure name
        for box in self.boxes:
            self.log(f"{box.owner}: clock rate {box.rate:.3f}")
            self.start(box)

    # -- bookkeeping -----------------------------------------------------------------------

    def log(self, line: str) -> None:
        self.lines.append(f"{self.now:9.3f}  {line}")

    def violation(self, what: str) -> None:
        SEEN["violation: " + what.split(":")[0]] += 1
        self.log("VIOLATION " + what)
        if len(self.violations) < 5:
            self.violations.append(what)

    def report(self) -> str:
        tail = self.lines[-80:]
        return (
            "\n".join(self.violations)
            + "\n\nthe model's log (real time, last lines):\n"
            + "\n".join(tail)
        )

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> Deferred[Any]:
        d = Deferred.fromCoroutine(coro)
        d.addErrback(self._crashed)
        return d

    def _crashed(self, failure: Any) -> None:
        if failure.check(CancelledError):
            return None
        self.errors.append(failure.value)
        return None

    def tenure_of(self, lease_id: str) -> str:
        return self.lease_names.get(lease_id, f"lease {lease_id[:6]}")

    # -- boxes -----------------------------------------------------------------------------

    def start(self, box: Box) -> Proc:
        proc = Proc(self, box)
        box.proc = proc
        box.restarts += 1
        self.log(f"{proc.name}: starts (epoch {proc.name})")
        proc.membership.startService()
        return proc

    def kill(self, proc: Proc) -> None:
        self.log(f"{proc.name}: killed ({len(proc.pending)} answers unread)")
        proc.state = "dead"
        proc.pending = []

    def freeze(self, proc: Proc) -> None:
        self.log(f"{proc.name}: frozen")
        proc.state = "frozen"

    def thaw(self, proc: Proc, io_first: bool) -> None:
        """The process runs again: its monotonic clock counted the freeze. What arrived while it
        was frozen and the timers that fell due meanwhile run now, in one order or the other."""
        self.log(f"{proc.name}: thawed ({'answers' if io_first else 'timers'} first)")
        SEEN["thaw, " + ("answers first" if io_first else "timers first")] += 1
        proc.state = "running"
        proc.clock.rightNow = max(proc.clock.rightNow, proc.box.mono(self.now))
        pending, proc.pending = proc.pending, []
        if io_first:
            for r in pending:
                self.resolve(r)
            proc.clock.advance(0)
        else:
            proc.clock.advance(0)
            for r in pending:
                self.resolve(r)

    # -- the network -----------------------------------------------------------------------

    def send(
        self,
        proc: Proc,
        op: str,
        key: str,
        body: bytes,
        if_match: str | None,
        if_none_match: bool,
        meta: FileMeta | None,
    ) -> Deferred[Any]:
        self.seq += 1
        r = Request(self.seq, proc, op, key, body, if_match, if_none_match, meta)
        r.sent_at = self.now
        box = proc.box
        mode, delay = box.trouble.pop(r.kind, None) or (("ok", 0.0) if box.link_up else ("hold", 0.0))
        if mode == "ok":
            r.land_at = self.now + LATENCY
        elif mode == "slow":
            r.land_at = self.now + delay
        elif mode == "mute":
            r.land_at = self.now + LATENCY
            r.answers = False
        elif mode == "lose":
            r.lands = False
            r.result = StoreUnavailable("the write was lost (model)", key)
            r.answer_at = self.now + LATENCY
        if r.lands:
            self.flying.append(r)
        else:
            self.answering.append(r)
        if mode != "ok" or r.kind == "replica":
            self.log(f"sends {r.describe()}" + ("" if mode == "ok" else f" [{mode}]"))
        r.timeout = proc.clock.callLater(STORE_TIMEOUT, self._timed_out, r)
        return r.waiter

    def _timed_out(self, r: Request) -> None:
        if not r.waiter.called:
            r.waiter.errback(StoreUnavailable(f"no answer within {STORE_TIMEOUT:g}s (model)", r.key))

    def held(self) -> list[Request]:
        return [r for r in self.flying if r.land_at is None]

    def land(self, r: Request) -> None:
        self.flying.remove(r)
        r.landed = True
        obj = self.bucket.get(r.key)
        if (r.if_none_match and obj is not None) or (
            r.if_match is not None and (obj is None or obj.etag != r.if_match)
        ):
            r.result = PreconditionFailed("precondition failed (model)", r.key)
            outcome = "412"
        elif r.op == "delete":
            gone = self.bucket.pop(r.key, None)
            r.result = None
            outcome = "deleted" if gone is not None else "nothing to delete"
            if gone is not None and r.kind == "hbdel":
                mine = r.key == r.proc.membership.key
                SEEN["heartbeat deleted by " + ("its box" if mine else "the janitor")] += 1
        else:
            new = Obj(r.key, r.body, self.now, r.meta)
            self.bucket[r.key] = new
            r.result = PutResult(r.key, new.etag)
            outcome = "written"
        late = self.now - r.sent_at > 1.0
        if r.kind != "beat" or outcome != "written" or late:
            self.log(f"lands {r.describe()}: {outcome}" + (f" (sent at {r.sent_at:.3f})" if late else ""))
        if r.kind == "beat" and late and outcome == "written":
            SEEN["heartbeat landed late"] += 1
        if r.key == LOCK and outcome == "written":
            from lchat.lease import LeaseRecord

            record = LeaseRecord.parse(r.body)
            if record.lease_id not in self.lease_order:
                self.lease_order[record.lease_id] = len(self.lease_order) + 1
                self.log(
                    f"lock: now {record.owner} (box {record.box}, epoch {record.epoch}, "
                    f"generation {record.generation})"
                )
        if r.meta is not None and outcome == "written":
            holder = self.holder()
            if holder != r.meta.tenure.lease.lease_id:
                r.meta.landed_late = True
                SEEN["replica write landed after its lease ended"] += 1
            self.check_restore()
        if r.answers:
            r.answer_at = self.now + LATENCY
            self.answering.append(r)

    def answer(self, r: Request) -> None:
        self.answering.remove(r)
        if r.proc.state == "dead":
            return
        if r.proc.state == "frozen":
            r.proc.pending.append(r)
            return
        self.resolve(r)

    def resolve(self, r: Request) -> None:
        if r.timeout is not None and r.timeout.active():
            r.timeout.cancel()
        if r.waiter.called:
            return
        if isinstance(r.result, Exception):
            r.waiter.errback(r.result)
        else:
            r.waiter.callback(r.result)

    # -- time ------------------------------------------------------------------------------

    def _sync_clocks(self) -> None:
        for box in self.boxes:
            proc = box.proc
            if proc is not None and proc.running:
                proc.clock.rightNow = max(proc.clock.rightNow, box.mono(self.now))

    def _next(self) -> tuple[float, int, int, Any] | None:
        best: tuple[float, int, int, Any] | None = None
        for r in self.flying:
            if r.land_at is not None and (best is None or (r.land_at, 0, r.seq) < best[:3]):
                best = (r.land_at, 0, r.seq, r)
        for r in self.answering:
            assert r.answer_at is not None
            if best is None or (r.answer_at, 1, r.seq) < best[:3]:
                best = (r.answer_at, 1, r.seq, r)
        for box in self.boxes:
            proc = box.proc
            if proc is None or not proc.running:
                continue
            calls = proc.clock.getDelayedCalls()
            if calls:
                m = min(c.getTime() for c in calls)
                t = box.real(m)
                if best is None or (t, 2, box.index) < best[:3]:
                    best = (t, 2, box.index, (proc, m))
        return best

    def run_until(self, target: float) -> None:
        for _ in range(100_000):
            event = self._next()
            if event is None or event[0] > target:
                break
            self.now = max(self.now, event[0])
            self._sync_clocks()
            kind, what = event[1], event[3]
            if kind == 0:
                self.land(what)
            elif kind == 1:
                self.answer(what)
            else:
                proc, m = what
                proc.clock.rightNow = max(proc.clock.rightNow, m)
                proc.clock.advance(0)
        else:
            raise RuntimeError("the model's event loop does not settle")
        self.now = max(self.now, target)
        self._sync_clocks()

    def settle(self) -> None:
        self.run_until(self.now)

    # -- the lease and the replica, as the bucket has them ----------------------------------

    def holder(self) -> str | None:
        """The lease_id the bucket's lock names now (None: no lock)."""
        from lchat.lease import LeaseRecord

        obj = self.bucket.get(LOCK)
        return None if obj is None else LeaseRecord.parse(obj.body).lease_id

    def sending(self, meta: FileMeta) -> None:
        """A replica upload passed its ``ensure_held()`` check and goes out now."""
        meta.sent_at = self.now
        holder = self.holder()
        if holder != meta.tenure.lease.lease_id:
            meta.sent_while_held = False
            now_held = "released" if holder is None else f"held by {self.tenure_of(holder)}"
            self.violation(
                f"a write sent after its lease ended: {meta.tenure.name} sends {meta.describe()}"
                f" while the lock is {now_held}"
            )

    def check_restore(self) -> None:
        """What a restore would read now, checked (see the module docstring)."""
        infos = [o.info() for k, o in self.bucket.items() if o.meta is not None]
        files = replica_files(infos)
        if not files:
            return
        try:
            plan = plan_files(files)
        except RestoreError as e:
            self.violation(f"no restore possible: {e}")
            return
        state: tuple[str, ...] | None = None
        for f in plan:
            meta = self.bucket[f.info.key].meta
            assert meta is not None
            if f.level != SNAPSHOT_LEVEL and meta.pre != state:
                self.violation(
                    f"a restore mixes two writers: it applies {meta.describe()} (written for "
                    f"{_state(meta.pre)}) to {_state(state)}"
                )
            state = meta.post
            if not meta.sent_while_held:
                self.violation(f"a restore reads a write sent after its lease ended: {meta.describe()}")
            if meta.landed_late:
                order = self.lease_order.get(meta.tenure.lease.lease_id, 0)
                newer = [
                    o.meta
                    for o in self.bucket.values()
                    if o.meta is not None
                    and o.meta.level == SNAPSHOT_LEVEL
                    and self.lease_order.get(o.meta.tenure.lease.lease_id, 0) > order
                ]
                if newer:
                    self.violation(
                        f"a restore reads a late write: {meta.describe()} landed after its lease "
                        f"ended, and {newer[0].describe()} is in the bucket"
                    )

    # -- the activator (lchat/hibernation/lifecycle.py) --------------------------------------

    async def wake(self, proc: Proc, restore_for: float) -> None:
        try:
            await proc.fence.ready(proc.clock, WAKE_BUDGET)
            lease = await acquire_lease(
                proc.store,  # type: ignore[arg-type]
                LOCK,
                proc.box.owner,
                TTL,
                host=HOST,
                monotonic=proc.clock.seconds,
                reclaim_own=True,
                box=proc.fence.box,
                epoch=proc.fence.epoch,
                holder_check=proc.fence.holder_check,
            )
        except (NotAlive, LeaseHeld, ObjectStoreError) as e:
            self.log(f"{proc.name}: not woken: {type(e).__name__}: {e}")
            return
        finally:
            proc.waking = None
        tenure = Tenure(self, proc, lease, len(self.tenures) + 1)
        self.tenures.append(tenure)
        self.lease_names[lease.lease_id] = tenure.name
        proc.tenure = tenure
        why = lease.took_over_because or "free"
        SEEN[f"acquired: {why}"] += 1
        self.log(f"{tenure.name}: holds the lease ({why}; generation {lease.generation})")
        keeper = LeaseKeeper(
            proc.clock,
            proc.store,  # type: ignore[arg-type]
            lease,
            tenure.on_lost,
            monotonic=proc.clock.seconds,
            alive=proc.fence.alive,
        )
        tenure.keeper = keeper
        keeper.start()
        if tenure.stopping:
            return
        try:
            listing = await proc.store.list(REPLICA + "/")
            restored = self.restore(listing, tenure)
            await proc.sleep(restore_for)  # the download, the spawn
            if tenure.stopping:
                return
            await tenure.rep.start(listing, tenure.took_over, None if tenure.took_over else restored)
        except (ObjectStoreError, ReplicatorStopped, WakeFailed) as e:
            self.log(f"{tenure.name}: wake failed: {type(e).__name__}: {e}")
            SEEN["wake failed after the lease was taken"] += 1
            await self.stand_down(tenure)
            return
        tenure.replicating = True
        tenure.serving = True
        self.log(f"{tenure.name}: serving from txid {tenure.rep.txid}")

    def restore(self, listing: list[ObjectInfo], tenure: Tenure) -> int | None:
        files = replica_files(listing)
        if not files:
            tenure.local = ()
            return None
        try:
            plan = plan_files(files)
        except RestoreError as e:
            raise WakeFailed(f"restore: {e}") from e
        state: tuple[str, ...] | None = None
        for f in plan:
            obj = self.bucket.get(f.info.key)
            if obj is None or obj.meta is None:
                raise WakeFailed(f"restore: {f.info.key} vanished")
            if f.level != SNAPSHOT_LEVEL and obj.meta.pre != state:
                raise WakeFailed(f"restore: {f.info.key} does not apply (checksum)")
            state = obj.meta.post
        assert state is not None
        tenure.local = state
        return plan[-1].max_txid

    def commit(self, tenure: Tenure) -> None:
        tenure.commits += 1
        tenure.local = (*tenure.local, f"{tenure.name}.{tenure.commits}")
        tenure.rep.schedule()

    async def stand_down(self, tenure: Tenure) -> None:
        """``_release``: flush unless lost; release only after a flush, or when replication
        never started; else leave the lease to expire."""
        if tenure.stopping:
            return
        tenure.stopping = True
        tenure.serving = False
        flushed = False
        try:
            if tenure.lost is None and tenure.replicating:
                flushed = await self.flush(tenure)
        finally:
            tenure.rep.stop()
        keeper = tenure.keeper
        assert keeper is not None
        if tenure.lost is not None:
            pass
        elif flushed or not tenure.replicating:
            released = await keeper.release(RELEASE_BUDGET)
            self.log(f"{tenure.name}: released: {released}")
        else:
            keeper.stop()
            self.log(f"{tenure.name}: final flush failed: lease left to expire")
        tenure.ended = True
        if tenure.proc.tenure is tenure:
            tenure.proc.tenure = None

    async def flush(self, tenure: Tenure) -> bool:
        clock = tenure.proc.clock
        deadline = clock.seconds() + FLUSH_BUDGET
        while True:
            try:
                await tenure.rep.flush()
                return True
            except ReplicatorStopped:
                return False
            except ObjectStoreError:
                if clock.seconds() >= deadline:
                    return False
            await tenure.proc.sleep(1.0)

    async def drain(self, proc: Proc) -> None:
        proc.draining = True
        self.log(f"{proc.name}: draining")
        await proc.membership.begin_drain()
        if proc.waking is not None:
            proc.waking.cancel()
        if proc.tenure is not None:
            await self.stand_down(proc.tenure)
        await proc.membership.stopService()
        if proc.state != "dead":
            self.log(f"{proc.name}: drained, exits")
            proc.state = "dead"


# --- the state machine --------------------------------------------------------------------------

ADVANCES = [0.1, 1.0, 5.0, 14.0, 16.0, 30.0, 41.0, 46.0, 60.0, 125.0, 460.0]
ALL = frozenset(
    {"cut", "trouble", "deliver", "kill", "freeze", "restart", "drain", "sleep", "edge"}
)


def _feature(name: str) -> Callable[[Any], bool]:
    return lambda self: name in self.features and self.sim is not None


class FenceModel(RuleBasedStateMachine):
    """See the module docstring."""

    rhos: st.SearchStrategy[float] = st.sampled_from([0.0, -MAX_DRIFT, MAX_DRIFT, -0.02, 0.03])
    features: frozenset[str] = ALL
    raise_violations = True

    def __init__(self) -> None:
        super().__init__()
        self.sim: Sim | None = None

    @property
    def world(self) -> Sim:
        assert self.sim is not None
        return self.sim

    def proc(self, box: int) -> Proc | None:
        b = self.world.boxes[box % len(self.world.boxes)]
        return b.proc

    def running(self, box: int) -> Proc | None:
        proc = self.proc(box)
        return proc if proc is not None and proc.running else None

    @initialize(n=st.integers(2, 4), data=st.data())
    def boxes(self, n: int, data: st.DataObject) -> None:
        self.sim = Sim([data.draw(self.rhos, label=f"rho{i}") for i in range(n)])
        self.sim.settle()

    @rule(dt=st.sampled_from(ADVANCES))
    def advance(self, dt: float) -> None:
        self.world.run_until(self.world.now + dt)

    @precondition(_feature("edge"))
    @rule(past=st.sampled_from([0.0, 0.6, 2.0]), expiry=st.booleans())
    def advance_to_the_edge(self, past: float, expiry: bool) -> None:
        """To just past the first moment the lock's holder may be judged dead (its heartbeat) or
        its lease expired: where a holder that believed too long would meet its successor."""
        from lchat.lease import LeaseRecord, lease_expiry

        sim = self.world
        lock = sim.bucket.get(LOCK)
        if lock is None:
            return
        record = LeaseRecord.parse(lock.body)
        if expiry:
            when = lease_expiry(lock.info().last_modified, record.ttl_seconds, TTL)
        else:
            beat = next((o for k, o in sim.bucket.items() if k.startswith(MEMBERS) and record.box and k.endswith(_member_name(record.box))), None)
            if beat is None:
                return
            when = beat.info().last_modified + datetime.timedelta(seconds=1 + DEAD_AFTER)
        target = (when - T0).total_seconds() + past
        if target > sim.now:
            sim.run_until(target)

    @rule(box=st.integers(0, 3), restore_for=st.sampled_from([0.1, 3.0, 20.0]))
    def wake(self, box: int, restore_for: float) -> None:
        proc = self.running(box)
        if proc is None or proc.tenure is not None or proc.waking is not None or proc.draining:
            return
        d = self.world.spawn(self.world.wake(proc, restore_for))
        if not d.called and proc.tenure is None:
            proc.waking = d
        self.world.settle()

    @rule(box=st.integers(0, 3))
    def commit(self, box: int) -> None:
        proc = self.running(box)
        if proc is None or proc.tenure is None or not proc.tenure.serving:
            return
        self.world.commit(proc.tenure)
        self.world.settle()

    @precondition(_feature("sleep"))
    @rule(box=st.integers(0, 3))
    def sleep(self, box: int) -> None:
        proc = self.running(box)
        if proc is None or proc.tenure is None or not proc.tenure.serving:
            return
        self.world.log(f"{proc.tenure.name}: goes to sleep")
        self.world.spawn(self.world.stand_down(proc.tenure))
        self.world.settle()

    @precondition(_feature("cut"))
    @rule(box=st.integers(0, 3))
    def cut_or_reconnect(self, box: int) -> None:
        b = self.world.boxes[box % len(self.world.boxes)]
        b.link_up = not b.link_up
        self.world.log(f"{b.owner}: {'reconnected to' if b.link_up else 'cut off from'} the bucket")
        self.world.settle()

    @precondition(_feature("trouble"))
    @rule(
        box=st.integers(0, 3),
        kind=st.sampled_from(["replica", "beat", "lock", "hbdel"]),
        fate=st.sampled_from(FATES),
    )
    def trouble(self, box: int, kind: str, fate: tuple[str, float]) -> None:
        """The box's next write of ``kind`` is held, answered never, lost, or slow."""
        b = self.world.boxes[box % len(self.world.boxes)]
        b.trouble[kind] = fate

    @precondition(lambda self: "deliver" in self.features and self.sim is not None and bool(self.sim.held()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """A held write lands now."""
        held = self.world.held()
        r = data.draw(st.sampled_from(held), label="write")
        r.land_at = self.world.now
        self.world.settle()

    @precondition(_feature("kill"))
    @rule(box=st.integers(0, 3))
    def kill(self, box: int) -> None:
        proc = self.proc(box)
        if proc is not None and proc.state != "dead":
            self.world.kill(proc)
            self.world.settle()

    @precondition(_feature("freeze"))
    @rule(box=st.integers(0, 3))
    def freeze(self, box: int) -> None:
        proc = self.running(box)
        if proc is not None:
            self.world.freeze(proc)

    @precondition(_feature("freeze"))
    @rule(box=st.integers(0, 3), io_first=st.booleans())
    def thaw(self, box: int, io_first: bool) -> None:
        proc = self.proc(box)
        if proc is not None and proc.state == "frozen":
            self.world.thaw(proc, io_first)
            self.world.settle()

    @precondition(_feature("restart"))
    @rule(box=st.integers(0, 3))
    def restart(self, box: int) -> None:
        b = self.world.boxes[box % len(self.world.boxes)]
        if b.proc is None or b.proc.state == "dead":
            self.world.start(b)
            self.world.settle()

    @precondition(_feature("drain"))
    @rule(box=st.integers(0, 3))
    def drain(self, box: int) -> None:
        proc = self.running(box)
        if proc is not None and not proc.draining:
            self.world.spawn(self.world.drain(proc))
            self.world.settle()

    @invariant()
    def never_two_writers(self) -> None:
        if self.sim is None:
            return
        if self.sim.errors:
            raise self.sim.errors[0]
        if self.sim.violations and self.raise_violations:
            raise ModelViolation(self.sim.report())


def _member_name(url: str) -> str:
    from lchat.mesh.membership import encode_member_name

    return "/" + encode_member_name(url)


# --- the tests ----------------------------------------------------------------------------------


def model_settings(examples: int, steps: int, **overrides: Any) -> settings:
    """``derandomize`` for CI; ``LCHAT_FENCE_MODEL_EXAMPLES`` (and ``_STEPS``) for a longer,
    random search on a developer's machine."""
    wanted = os.environ.get("LCHAT_FENCE_MODEL_EXAMPLES")
    options: dict[str, Any] = {
        "max_examples": int(wanted) if wanted else examples,
        "stateful_step_count": int(os.environ.get("LCHAT_FENCE_MODEL_STEPS", steps)),
        "derandomize": not wanted,
        "database": None,
        "deadline": None,
        "suppress_health_check": list(HealthCheck),
        "report_multiple_bugs": False,
        "print_blob": False,
    }
    options.update(overrides)
    return settings(**options)


class FenceModelTests(SynchronousTestCase):
    def test_never_two_writers(self) -> None:
        """Drift within the margin, every fault the model has: no violation."""
        run_state_machine_as_test(FenceModel, settings=model_settings(150, 40))

    def test_drift_beyond_the_margin_is_caught(self) -> None:
        """Proof that the model can see the bug class the margin is for: a holder whose
        monotonic clock runs 20 % slow (twice the margin) still believes it holds the lease
        when a peer has already taken it over, and writes."""
        machine = type(
            "SlowClocks",
            (FenceModel,),
            {"rhos": st.just(-0.2), "features": frozenset({"cut", "kill", "edge"})},
        )
        with self.assertRaises(ModelViolation) as caught:
            run_state_machine_as_test(
                machine,
                settings=model_settings(
                    300, 30, phases=[Phase.generate], verbosity=Verbosity.quiet
                ),
            )
        self.assertIn("a write sent after its lease ended", str(caught.exception))
