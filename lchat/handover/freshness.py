"""``lchat hibernate <host> --off``'s data check: is this box's ``<data>/<host>.db`` the newest
copy of the space, so that the always-on unit about to own it loses nothing?

A hibernating space runs wherever its lease is taken: on a mesh (or on two boxes sharing a bucket
prefix) it may last have run on *another* box, and this box's local file is then older than the
bucket's replica. The unit never restores anything: it serves whatever file it finds. So before
the flag is cleared, :func:`read_freshness` compares the local file with the bucket (one LIST):

- the local file is *current* when its clean-sleep marker (``<db>-lchat.json``, written by the
  activator at a sleep and valid only while the files are untouched) names the bucket's newest
  txid, or when the bucket holds no replica at all (nothing was ever written anywhere else: the
  local file, or no file for a space that never woke, is all there is);
- otherwise the newest copy is in the bucket, and only the router's activator may fetch it: it
  restores under the space's lease (so no other box writes meanwhile), moves a stale local copy
  aside, and refuses a bucket that is behind a local copy (``diverged``). ``--off`` asks it for
  one wake and one sleep, then checks again (see ``lchat.handover.hibernate``).

Invariant: nothing here writes a byte, locally or in the bucket.
"""

from __future__ import annotations

from attrs import frozen

from lchat.config import BoxConfig
from lchat.handover.seams import Bucket
from lchat.hibernation.localdb import BucketView, local_state
from lchat.objstore.where import Where


@frozen
class Freshness:
    """The local database against the bucket's replica, as one LIST and one stat saw them."""

    db: str
    bucket: BucketView
    present: bool  # <db> exists
    marker: int | None  # the bucket txid it is exactly (a valid clean-sleep marker), else None

    @property
    def current(self) -> bool:
        """Whether the unit may take the local file as it is without losing a write."""
        if self.bucket.newest == 0:
            return True  # no replica anywhere: nothing newer than what is here
        return self.present and self.marker == self.bucket.newest

    def describe(self) -> str:
        """Why (not), for an operator: both sides' txids."""
        if not self.present:
            here = f"{self.db} does not exist"
        elif self.marker is None:
            here = f"{self.db} has no valid clean-sleep marker (its txid is unknown)"
        else:
            here = f"{self.db} is txid {self.marker}"
        return f"{here}; the bucket has {self.bucket.describe()}"


def foreign_bucket(cfg: BoxConfig, home_region: str) -> Where | None:
    """The bucket of ``home_region`` when it is not this box's (``LCHAT_REGION_BUCKETS``): such a
    space's replica and lease live there, and this box's activator never wakes it (the router's
    ``region_down``), so ``--off`` cannot fetch it here."""
    hib = cfg.hibernate
    if hib is None or not home_region:
        return None
    where = cfg.region_buckets.get(home_region)
    return None if where is None or where.same_place(hib.where) else where


def read_freshness(bucket: Bucket, prefix: str, db: str) -> Freshness:
    """One LIST of ``prefix`` (``<prefix>/<host>/``) in the hibernation bucket and a stat of the
    local files. Raises ``ObjectStoreError`` (the bucket did not answer) or ``TimeoutError``."""
    view = BucketView.of(bucket.list(prefix))
    # The stat after the LIST: a sleep that lands in between makes the file look newer than the
    # bucket we saw (never current by mistake: its marker names a txid the LIST did not have).
    local = local_state(db)
    return Freshness(db=db, bucket=view, present=local.present, marker=local.marker_txid)
