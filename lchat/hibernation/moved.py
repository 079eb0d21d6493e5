"""The moved marker: a wake never restores a copy its space has been relocated away from, even on
a box that missed the relocation's fan-out (docs/mesh.md, "Relocating a space").

With per-region buckets, ``lchat relocate`` leaves ``<source prefix>/<host>/moved.json`` (a
:class:`MovedRecord`: the destination region ``to`` and the settings generation ``gen`` the flip
gave the row) in the *source* bucket, written while it holds the space's lease in both buckets,
and deletes the destination's marker (a move back). A box whose row missed the flip (it was
down at the fan-out, and its anti-entropy has not run yet) still places the space in the old
region and would wake the source bucket's older copy. :meth:`MovedCheck.check` runs under the
lease, before anything is restored (one GET, and only on a box with per-region buckets): the
marker names another region than this box's row, and the row's generation is below the
marker's, so the row is older than the move: the wake fails ``503 moved`` (a short
Retry-After), and this box asks its peers for the host's row at once (``on_moved``: the settings
sync, :meth:`lchat.mesh.sync.SettingsSync.repair`); the next request goes where the row now
says. A row whose generation is at or above the marker's is newer than the move (the space was
removed and added again, say): the marker is stale and the wake goes on.

Invariants: the marker is written only under both fences, so never while a box runs the space;
a refusal writes nothing; a marker that cannot be parsed is left as it is (evidence) and the wake
goes on, logged once per host; a marker that cannot be read fails the wake (``bucket``), never
passes it. A refusal is counted in ``lchat_wakes_total{outcome="moved"}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from attrs import define, field, frozen
from twisted.logger import Logger

from lchat import hosts
from lchat.hibernation.space import WakeFailed
from lchat.objstore import NotFound, ObjectStore, ObjectStoreError

_log = Logger(namespace="lchat.activator")

MOVED_NAME = "moved.json"  # <prefix>/<host>/moved.json, beside lock.json and the replica
MOVED_RETRY = 2.0  # Retry-After of a moved refusal: the sync it triggers takes about a second


class BadMarker(ValueError):
    """A ``moved.json`` that is not a marker."""


@frozen
class MovedRecord:
    """Where a space went: region ``to``, at settings generation ``gen`` (its row's after the
    flip); ``at`` (unix seconds) and ``by`` (the box that ran ``lchat relocate``) for people."""

    to: str
    gen: int
    at: float = 0.0
    by: str = ""

    def to_bytes(self) -> bytes:
        doc = {"to": self.to, "gen": self.gen, "at": self.at, "by": self.by}
        return json.dumps(doc, sort_keys=True).encode() + b"\n"

    @classmethod
    def parse(cls, body: bytes) -> MovedRecord:
        """The marker in ``body``, or :class:`BadMarker` naming what is wrong with it."""
        try:
            doc = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise BadMarker(f"not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise BadMarker("not a JSON object")
        to, gen, at = doc.get("to"), doc.get("gen"), doc.get("at", 0)
        if not isinstance(to, str) or not to:
            raise BadMarker(f"to {to!r} is not a region")
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
            raise BadMarker(f"gen {gen!r} is not a generation")
        if not isinstance(at, int | float) or isinstance(at, bool):
            raise BadMarker(f"at {at!r} is not a time")
        return cls(to=to, gen=gen, at=float(at), by=str(doc.get("by", "")))


def moved_key(prefix: str, host: str) -> str:
    """``<prefix>/<host>/moved.json`` (the host normalised, raising ``hosts.InvalidHost``)."""
    return "/".join(p for p in (prefix.strip("/"), hosts.normalise(host), MOVED_NAME) if p)


async def write(store: ObjectStore, prefix: str, host: str, record: MovedRecord) -> None:
    """Leave the marker (``lchat relocate``, under both fences). Raises the store's errors."""
    await store.put(moved_key(prefix, host), record.to_bytes())


async def clear(store: ObjectStore, prefix: str, host: str) -> bool:
    """Delete the marker (a move back into this bucket); whether there was one."""
    key = moved_key(prefix, host)
    try:
        await store.head(key)
    except NotFound:
        return False
    await store.delete(key)
    return True


@define
class MovedCheck:
    """Refuses a wake of a copy its space was moved away from (the module docstring).
    ``enabled``: this box has per-region buckets (else nothing is read); ``on_moved(host)``:
    called at a refusal (the router sets it to the settings sync's repair of that host)."""

    store: ObjectStore
    prefix: str  # LCHAT_HIBERNATE_PREFIX
    enabled: bool
    on_moved: Callable[[str], object] | None = None
    clock: Callable[[], float] = time.time
    _warned: set[str] = field(factory=set)  # hosts whose unreadable marker was logged

    async def check(self, host: str, home_region: str, settings_gen: int) -> None:
        """Return when ``host`` (its row here: ``home_region``, ``settings_gen``) may wake from
        this box's bucket; raise :class:`WakeFailed` (``moved``: the bucket's copy was moved to
        another region after this row; ``bucket``: the marker could not be read)."""
        if not self.enabled:
            return
        key = moved_key(self.prefix, host)
        try:
            got = await self.store.get(key)
        except NotFound:
            return
        except ObjectStoreError as e:
            raise WakeFailed(host, "bucket", f"the moved marker {key}: {e}") from e
        try:
            moved = MovedRecord.parse(got.body)
        except BadMarker as e:
            if host not in self._warned:
                if len(self._warned) > 10_000:
                    self._warned.clear()
                self._warned.add(host)
                _log.error(
                    "activator: {host}: {key} is not a moved marker ({error}): left as it is, "
                    "and not enforced; delete it (or fix it) once you know where {host} lives",
                    host=host,
                    key=key,
                    error=e,
                )
            return
        if moved.to == home_region or settings_gen >= moved.gen:
            return  # the row knows of the move, or is newer than it (added again since)
        _log.warn(
            "activator: {host}: not woken: it moved to region {to} (settings gen {gen}, by "
            "{by}), but this box's row still says {home} (gen {mine}): it missed the "
            "relocation's fan-out; answering 503 and asking the peers for its row now (or run "
            "`lchat mesh-seed`)",
            host=host,
            to=moved.to,
            gen=moved.gen,
            by=moved.by or "lchat relocate",
            home=home_region or "(no region)",
            mine=settings_gen,
        )
        if self.on_moved is not None:
            self.on_moved(host)
        raise WakeFailed(
            host,
            "moved",
            f"{host} moved to region {moved.to} (gen {moved.gen}); this box's row is gen "
            f"{settings_gen}",
            MOVED_RETRY,
        )
