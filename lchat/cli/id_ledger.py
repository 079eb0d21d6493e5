"""``lchat add-instance --mint`` and ``lchat id-ledger``: the CLI side of :mod:`lchat.ledger`.

A CLI run is one create, but the ledger hands out blocks of ~100 ids. The rest of a block is kept
for the next run on this box in ``<data>/id-ledger.json`` (the *box block*), advanced before an id
is used, under an exclusive lock on ``<data>/id-ledger.lock`` so two runs on one box never take
the same id; a run that dies after taking its id leaves the id unused, never reissued. Without
``LCHAT_CLOUD_ID_LEDGER`` the same file holds the box's local counter (``local``): the next id is
the larger of it and the highest minted id under the domain + 1, so an id whose space was removed
(its files stay) is not minted again on this box.

The commands are synchronous: their bucket work runs on a reactor of its own per call
(:func:`lchat.cli.runner.run`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from twisted.internet.task import deferLater

from lchat import hosts
from lchat.buckets import open_bucket
from lchat.cli import runner
from lchat.config import BoxConfig
from lchat.files import write_atomic
from lchat.ledger import (
    FIRST_ID,
    LEDGER_KEY,
    MAX_ID,
    Block,
    Counter,
    IdLedger,
    LedgerError,
    minted_host,
    minted_ids,
)
from lchat.objstore import ObjectStore, ObjectStoreError
from lchat.objstore.where import Where
from lchat.reactors import Reactor

SUMMARY = "show the shared id ledger (LCHAT_CLOUD_ID_LEDGER), or seed it above a namespace's ids"
STATE_FILE = "id-ledger.json"
LOCK_FILE = "id-ledger.lock"
LOCK_TIMEOUT = 30.0

Out = Callable[[str], None]
_T = TypeVar("_T")


def add_arguments(parser: argparse.ArgumentParser, add_common: Callable[[Any], None]) -> None:
    actions = parser.add_subparsers(dest="ledger_action", metavar="<action>", required=True)
    show = actions.add_parser("show", help="print the counter's next id and this box's block")
    add_common(show)
    seed = actions.add_parser(
        "seed",
        help="raise the counter above N (conditional; never lowers it)",
        description="Raise the shared counter so its next id is above N (conditional; never "
        "lowers it). Run it once before switching a namespace that already has minted spaces "
        "onto the ledger, with N = the highest id there (add-instance --mint names it).",
    )
    add_common(seed)
    seed.add_argument(
        "--above", type=_id_floor, required=True, metavar="N", help="highest id in use"
    )


def _id_floor(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < MAX_ID - 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range")
    return value


def run(args: argparse.Namespace, cfg: BoxConfig, out: Out) -> int:
    url = cfg.id_ledger
    if url is None:
        raise LedgerError(
            f"no id ledger: set LCHAT_CLOUD_ID_LEDGER (s3://BUCKET[/PREFIX][?region=R&endpoint=URL]"
            f" or file:PATH) in {cfg.env_file}"
        )

    async def work(reactor: Reactor) -> int:
        store, ledger = await _open(reactor, cfg, url)
        try:
            if args.ledger_action == "seed":
                before, after = await ledger.seed_above(args.above)
                if before == after:
                    out(f"id ledger {url}: next is {before}, already above {args.above}; unchanged")
                else:
                    out(f"id ledger {url}: next {before} -> {after} (seeded above {args.above})")
                return 0
            counter = await ledger.read()
            out(f"id ledger: {url} (key {ledger.key})")
            where = "" if counter.etag is not None else " (no counter yet: the first block)"
            out(f"next: {counter.next}{where}")
            return 0
        finally:
            await store.close()

    code = _run(work)
    if args.ledger_action == "show":
        block = _load_state(cfg.data_dir).get("ledger")
        if isinstance(block, dict) and block.get("url") == str(url):
            left = int(block["end"]) - int(block["next"])
            out(f"this box's block: {block['next']}..{int(block['end']) - 1} ({left} left)")
        else:
            out("this box's block: none (the next --mint takes one)")
    return code


def mint(cfg: BoxConfig, existing_hosts: list[str], domain: str, note: Out) -> str:
    """Draw the next id for ``domain`` and return ``<id>.<domain>`` (not yet registered).

    With the ledger, refuses (:class:`LedgerError`, naming ``lchat id-ledger seed --above N``)
    while the namespace's highest minted id in ``existing_hosts`` is at or above the counter's
    next: fresh ids would re-mint live hostnames.
    """
    hosts.normalise(f"1.{domain}")  # a domain no minted host could live under fails before any work
    seen = minted_ids(existing_hosts, domain)
    highest = max(seen, default=0)
    with _box_lock(cfg.data_dir):
        state = _load_state(cfg.data_dir)
        if cfg.id_ledger is None:
            local = state.get("local")
            stored = int(local["next"]) if isinstance(local, dict) else FIRST_ID
            n = max(stored, highest + 1)
            state["local"] = {"next": n + 1}
            _save_state(cfg.data_dir, state)
            note(
                f"no LCHAT_CLOUD_ID_LEDGER: id {n} from this box's own counter (the highest "
                f"minted id under {domain} + 1, never an id minted here before); boxes minting "
                f"under {domain} at once could collide: set LCHAT_CLOUD_ID_LEDGER to share one "
                f"id space"
            )
        else:
            n, how = _draw(cfg, cfg.id_ledger, state, highest, domain)
            _save_state(cfg.data_dir, state)
            note(f"id {n} from the id ledger {cfg.id_ledger} ({how})")
    return minted_host(n, domain)


def _draw(
    cfg: BoxConfig, url: Where, state: dict[str, Any], highest: int, domain: str
) -> tuple[int, str]:
    """One id off the box block, or off a fresh block; ``state`` is updated (the caller saves it
    before the id is used, so a crash skips the id rather than reissuing it)."""
    cached = state.get("ledger")
    if not (isinstance(cached, dict) and cached.get("url") == str(url)):
        cached = None

    async def work(reactor: Reactor) -> tuple[Counter, Block | None]:
        store, ledger = await _open(reactor, cfg, url)
        try:
            counter = await ledger.read()
            if highest >= counter.next:
                raise LedgerError(
                    f"{domain} already holds minted id {highest}, at or above the id ledger's next "
                    f"({counter.next}): fresh ids would re-mint live hostnames. Seed the ledger "
                    f"above it first (once, from any box): lchat id-ledger seed --above {highest}"
                )
            # A box block whose next id is not above the namespace's highest would re-mint a
            # live hostname further on: skip the rest of it (never reissued) for a fresh one.
            usable = cached is not None and highest < int(cached["next"]) < int(cached["end"])
            if cached is not None and usable:
                if int(cached["end"]) > counter.next:
                    raise LedgerError(
                        f"the id ledger {url} says next is {counter.next}, below the end of this "
                        f"box's block ({cached['end']}): the counter was reset or replaced. Seed "
                        f"it again: lchat id-ledger seed --above {int(cached['end']) - 1}"
                    )
                return counter, None
            return counter, await ledger.take_block()
        finally:
            await store.close()

    _counter, block = _run(work)
    if block is None:
        assert cached is not None
        start, end, how = int(cached["next"]), int(cached["end"]), "this box's block"
    else:
        start, end, how = block.start, block.end, f"a new block of {len(block)}"
    state["ledger"] = {"url": str(url), "next": start + 1, "end": end}
    return start, f"{how}: {end - start - 1} ids left on this box"


async def _open(reactor: Reactor, cfg: BoxConfig, url: Where) -> tuple[ObjectStore, IdLedger]:
    """The ledger's store (the caller closes it) and the ledger on it (a ``file:`` ledger's
    directory is made on first use)."""
    store = await open_bucket(reactor, cfg, url, what="LCHAT_CLOUD_ID_LEDGER", make_dir=True)
    ledger = IdLedger(
        store, url.key(LEDGER_KEY), sleep=lambda s: deferLater(reactor, s, lambda: None)
    )
    return store, ledger


def _run(work: Callable[[Reactor], Coroutine[Any, Any, _T]]) -> _T:
    """``work(reactor)`` on the CLI's runner; a failure of the bucket is a :class:`LedgerError`."""
    try:
        return runner.run(work)
    except ObjectStoreError as e:
        # The bucket is down, or the credentials may not read or write the counter.
        raise LedgerError(f"the id ledger's bucket failed: {e}; nothing was taken") from e


# --- the box's state file ----------------------------------------------------------------------


@contextlib.contextmanager
def _box_lock(data_dir: str) -> Iterator[None]:
    path = os.path.join(data_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LedgerError(
                        f"another lchat add-instance --mint holds {path} after "
                        f"{LOCK_TIMEOUT:g}s; retry"
                    ) from None
                time.sleep(0.05)  # synchronous CLI: nothing else to run meanwhile
        yield
    finally:
        os.close(fd)  # releases the lock


def _load_state(data_dir: str) -> dict[str, Any]:
    path = os.path.join(data_dir, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise LedgerError(
            f"{path} is not JSON ({e}): move it aside only if no --mint is running"
        ) from e
    return doc if isinstance(doc, dict) else {}


def _save_state(data_dir: str, state: dict[str, Any]) -> None:
    """Atomically: a crash leaves the old state or the new."""
    write_atomic(os.path.join(data_dir, STATE_FILE), json.dumps(state).encode("utf-8"))
