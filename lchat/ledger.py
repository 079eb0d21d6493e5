"""One id space across regions: a shared, S3-backed, block-allocated monotonic counter.

A region-placed fleet mints its spaces at one region-neutral domain (``<id>.example.com``), so two
provisioners in two regions minting at once must never pick the same id. The ledger
(``LCHAT_CLOUD_ID_LEDGER``) is one small object in a bucket, ``<prefix>/id-ledger/next.json``::

    {"next": 1201}

``next`` is the first id nobody has been handed yet. A minter takes a whole *block* of ids at a
time (:data:`DEFAULT_BLOCK`) by advancing ``next`` with one conditional write (``put(if_match=
<the ETag it read>)``, or ``put(if_none_match=True)`` while the object does not exist yet), then
hands the ids out of its block without touching the bucket again: roughly one S3 write per
hundred creates.

Invariants:

- ``next`` only ever grows: every write is conditional on the version that was read, and every
  write's value is larger than the value read. Two writers racing on one version: exactly one
  wins, the other re-reads and retries (bounded, with jittered backoff, then
  :class:`LedgerContention`).
- Blocks are disjoint, so no id is handed out twice. A block is never reused: a minter that
  crashes with ids left in its block simply leaves them unused (ids are cheap; uniqueness is not).
- A counter object we cannot read as ``{"next": <int >= 1>}`` is never overwritten: the ledger
  refuses (:class:`LedgerError`) instead of guessing, since a guess could re-mint live hostnames.

Minted ids are written in decimal without leading zeros (``1201.example.com``): a first label of
digits only is unambiguous, where a base36 or sqid form would also parse ``chat`` as an id. The
namespace check (:func:`minted_ids`) reads a domain's existing minted ids back from the
registry the same way.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from attrs import frozen

from lchat import hosts
from lchat.backoff import Backoff

if TYPE_CHECKING:
    from lchat.objstore import ObjectStore

FIRST_ID = 1  # the first id an empty ledger hands out
DEFAULT_BLOCK = 100  # ids taken per conditional write
MAX_ID = 10**18  # far beyond any fleet; keeps a label (and JSON readers) sane
LEDGER_KEY = "id-ledger/next.json"
DEFAULT_ATTEMPTS = 10  # conditional writes tried before giving up under contention
DEFAULT_BACKOFF = 0.05  # seconds: the first retry waits up to this, doubling each time
MAX_BACKOFF = 2.0

_MINTED_LABEL = re.compile(r"[1-9][0-9]{0,17}")


class LedgerError(Exception):
    """The ledger cannot be used as it stands (a bad URL, an unreadable counter, a refusal)."""


class LedgerContention(LedgerError):
    """Every conditional write lost to another minter, ``attempts`` times in a row."""


# --- ids ----------------------------------------------------------------------------------------


def parse_id(label: str) -> int | None:
    """The minted id a first label spells, or None when it is not one (``chat``, ``007``)."""
    return int(label) if _MINTED_LABEL.fullmatch(label) else None


def minted_host(n: int, domain: str) -> str:
    """``<id>.<domain>`` (the id in decimal, no leading zeros), normalised
    (:class:`lchat.hosts.InvalidHost` when it cannot be a host)."""
    if not FIRST_ID <= n < MAX_ID:
        raise ValueError(f"id {n} is out of range")
    return hosts.normalise(f"{n}.{domain}")


def minted_ids(hostnames: Iterable[str], domain: str) -> list[int]:
    """The ids already minted under ``domain``: hosts directly under it whose first label is a
    minted id (:func:`parse_id`). Other hosts (``chat.example.com``) are not in the id space."""
    under = (h for h in hostnames if h != domain and hosts.covers(domain, h))
    return [n for n in (parse_id(h.split(".", 1)[0]) for h in under) if n is not None]


# --- the counter --------------------------------------------------------------------------------


@frozen
class Counter:
    """The counter as read: ``next`` (``FIRST_ID`` when the object does not exist yet) and the
    ETag a conditional write must match (None: absent, so the write must create it)."""

    next: int
    etag: str | None


@frozen
class Block:
    """Ids ``[start, end)``, taken by one conditional write and handed out by one minter only."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


Sleep = Callable[[float], Awaitable[object]]


class IdLedger:
    """The counter object in ``store`` under ``key``: read it, take blocks, seed it.

    ``sleep(seconds)`` waits between contended attempts (``deferLater`` on the reactor; a fake in
    tests); ``rng`` jitters the waits so racing minters spread out instead of colliding again.
    """

    def __init__(
        self,
        store: ObjectStore,
        key: str = LEDGER_KEY,
        *,
        sleep: Sleep,
        block: int = DEFAULT_BLOCK,
        attempts: int = DEFAULT_ATTEMPTS,
        backoff: float = DEFAULT_BACKOFF,
        rng: random.Random | None = None,
    ) -> None:
        if block < 1 or attempts < 1:
            raise ValueError("block and attempts must be at least 1")
        self._store = store
        self.key = key
        self.block = block
        self._sleep = sleep
        self._attempts = attempts
        self._retries = Backoff(backoff, MAX_BACKOFF, jitter=(0.0, 1.0))  # full jitter
        self._rng = rng or random.Random()  # noqa: S311 -- jitter, not a secret

    def describe(self) -> str:
        return f"{self._store.describe()} key {self.key}"

    async def read(self) -> Counter:
        """The counter now (one GET). A counter we cannot parse raises :class:`LedgerError`."""
        from lchat.objstore import NotFound

        try:
            stored = await self._store.get(self.key)
        except NotFound:
            return Counter(next=FIRST_ID, etag=None)
        return Counter(next=self._parse(stored.body), etag=stored.info.etag)

    async def take_block(self, size: int | None = None) -> Block:
        """Advance ``next`` by ``size`` (default: the ledger's block) and return the ids skipped
        over: this caller's alone, whoever else is minting."""
        size = self.block if size is None else size
        if size < 1:
            raise ValueError("a block holds at least one id")

        def advance(now: int) -> int | None:
            if now + size >= MAX_ID:
                raise LedgerError(f"the id ledger ({self.describe()}) is exhausted at {now}")
            return now + size

        old, new = await self._advance(advance)
        assert new is not None and new == old + size
        return Block(start=old, end=new)

    async def seed_above(self, floor: int) -> tuple[int, int]:
        """Raise ``next`` to ``floor + 1`` unless it is already above ``floor``; never lowers it.
        Returns (``next`` before, ``next`` after); equal when nothing changed."""
        if not 0 <= floor < MAX_ID - 1:
            raise ValueError(f"--above {floor} is out of range")
        return await self._advance(lambda now: None if now > floor else floor + 1)

    async def _advance(self, step: Callable[[int], int | None]) -> tuple[int, int]:
        """Read, compute the new ``next`` (None: leave it), write it conditionally on what was
        read; on a lost race, wait (jittered, doubling) and start over from a fresh read."""
        from lchat.objstore import PreconditionFailed

        for attempt in range(1, self._attempts + 1):
            counter = await self.read()
            new = step(counter.next)
            if new is None:
                return counter.next, counter.next
            assert new > counter.next, "the ledger only moves forward"
            body = json.dumps({"next": new}).encode() + b"\n"
            try:
                await self._store.put(
                    self.key,
                    body,
                    if_match=counter.etag,  # None: none there yet, so create only
                    if_none_match=counter.etag is None,
                    content_type="application/json",
                )
            except PreconditionFailed:
                if attempt == self._attempts:
                    break
                # Full jitter: anywhere below the step, so racing minters spread out.
                await self._sleep(self._retries.jittered(self._retries.delay(attempt), self._rng))
                continue
            return counter.next, new
        raise LedgerContention(
            f"the id ledger ({self.describe()}) changed under every one of {self._attempts} "
            f"conditional writes: too many minters at once. Nothing was taken; retry"
        )

    def _parse(self, body: bytes) -> int:
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        value = doc.get("next") if isinstance(doc, dict) else None
        if type(value) is not int or not FIRST_ID <= value < MAX_ID:
            raise LedgerError(
                f'the id ledger ({self.describe()}) does not hold {{"next": <id>}} '
                f"({body[:80]!r}): refusing to guess (a guess could re-mint live hostnames); "
                f"fix or remove the object by hand"
            )
        return value
