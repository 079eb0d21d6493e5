"""The per-space single-writer lease: ``<prefix>/<host>/lock.json`` in the bucket (docs/design.md §5).
``lock``: the object, its expiry rule, acquire and release; ``keeper``: keeping it while held.

Whoever holds a space's lease is its one writer (docs/design.md §10, invariant 1); everyone else fails
loudly with :class:`LeaseHeld`. The bucket's conditional writes are the only arbiter:

- :func:`acquire` creates the object with ``If-None-Match: *``; if it exists and has expired it
  takes it over with ``If-Match: <etag>`` and ``generation + 1``; a lease that is still live raises
  :class:`LeaseHeld`; losing a 412 race re-reads and reports the winner.
- :class:`LeaseKeeper` renews with ``If-Match`` every TTL/3 and reports the loss once, before the
  lease could expire; given ``verify_retake``, it re-takes a lock found *gone*;
- :func:`release` deletes with ``If-Match``, never anybody else's lease.

Expiry rule (:func:`lease_expiry`): a version of ``lock.json`` may be taken over once the bucket's
clock (``store.now()``, its ``Date``) reaches ``floor(Last-Modified) + 1 s + ceil(TTL)``, where TTL
is the larger of the record's ``ttl_seconds`` and the judging box's own TTL. Both clocks are the
bucket's, so a box whose clock is wrong can neither steal nor keep a lease. Stores report
``Last-Modified`` truncated to whole seconds, so the real write happened before ``floor + 1 s``:
judging from there is never early (a truncated ``Date`` only makes "now" earlier: later still).
The larger TTL wins because the holder stands down by its *own* TTL (written in the record); a
record without ``ttl_seconds`` (a Litestream leaser wrote it, or it is corrupt) is judged by ours.
``expires_at`` in the body is informational (for humans and tools): it is computed from the
bucket's clock, never ours, but judgement never reads it. A live lock naming our own ``owner`` is
held too: a wedged earlier process of this box may still be writing.

The holder's side is safe by construction: its deadline counts from the local monotonic time *before*
the successful write was sent, which precedes the real write, which precedes ``Last-Modified``'s
upper bound above. So the holder stops believing before anyone else may start.

Each acquisition writes a random ``lease_id``. Only its holder ever writes a record carrying it,
so when a conditional write fails because a store-level retry already applied our own write (the
response was lost), re-reading and finding our ``lease_id`` proves the write was ours.
"""

# ruff: noqa: F401 -- the imports are this package's public names

from lchat.lease.keeper import LeaseKeeper
from lchat.lease.lock import (
    BOX_NOT_ALIVE,
    LOCK_NAME,
    HeldLease,
    HolderCheck,
    LeaseHeld,
    LeaseLost,
    LeaseRecord,
    LeaseSuspended,
    NotAlive,
    acquire,
    lease_expiry,
    lease_key,
    release,
    rfc3339,
)
