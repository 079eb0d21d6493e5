"""The id ledger (``lchat.ledger``): one S3 counter, block-allocated by conditional writes, and
``lchat add-instance --mint`` / ``lchat id-ledger`` on top of it.

The block CAS runs on a ``FileStore`` and on moto's server (real HTTP, signed requests); the
property test races 8 minters x 50 ids through two separate store clients ("two boxes").
The CLI tests run ``lchat`` in-process from a worker thread while the reactor runs (the
ledger's bucket work is handed to it), as a box's add-instance would run it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from attrs import frozen
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial import unittest

from lchat import config
from lchat.cli.main import main
from lchat.ledger import (
    DEFAULT_BLOCK,
    LEDGER_KEY,
    Block,
    IdLedger,
    LedgerContention,
    LedgerError,
    minted_host,
    minted_ids,
    parse_id,
)
from lchat.objstore import ObjectStore, PreconditionFailed, PutResult, StoredObject
from lchat.objstore.file import FileStore
from lchat.objstore.where import Where, parse_where
from lchat.reactors import installed
from lchat.registry import Registry
from lchat.threads import thread_runner
from tests import s3servers

reactor = installed()


def _sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


def ledger_on(store: ObjectStore, **kwargs: Any) -> IdLedger:
    options: dict[str, Any] = {"sleep": _sleep, "rng": random.Random(7), **kwargs}
    return IdLedger(store, "fleet/" + LEDGER_KEY, **options)


# --- pure parts ----------------------------------------------------------------------------------


class IdsAndUrlsTests(unittest.SynchronousTestCase):
    def test_ids_are_decimal_first_labels(self) -> None:
        self.assertEqual(parse_id("1201"), 1201)
        for label in ("chat", "0", "007", "8oe", "12a", ""):
            self.assertIsNone(parse_id(label), label)
        self.assertEqual(minted_host(1201, "Example.COM"), "1201.example.com")
        names = [
            "3.example.com",
            "chat.example.com",
            "9.other.com",
            "7.a.example.com",
            "12.example.com",
        ]
        self.assertEqual(sorted(minted_ids(names, "example.com")), [3, 12])

    def test_urls(self) -> None:
        url = parse_where(
            "s3://ids-bucket/fleet/ids?region=eu-west-1&endpoint=http://127.0.0.1:9/", keys=False
        )
        self.assertEqual(url, Where("ids-bucket", "fleet/ids", "eu-west-1", "http://127.0.0.1:9"))
        self.assertEqual(url.key(LEDGER_KEY), "fleet/ids/" + LEDGER_KEY)
        self.assertEqual(str(parse_where(str(url), keys=False)), str(url))
        self.assertEqual(parse_where("s3://ids-bucket", keys=False).key(LEDGER_KEY), LEDGER_KEY)
        self.assertEqual(parse_where("file:/tmp/x", keys=False).bucket, "file:/tmp/x")
        for bad in (
            "ids-bucket",
            "s3://Bad_Bucket",
            "s3://ids-bucket/a/../b",
            "s3://ids-bucket?colour=red",
            "s3://ids-bucket?endpoint=ftp://x",
            "s3://ids-bucket?region=a%20b",
            "file:",
            "https://ids-bucket",
            "s3://ids-bucket?access_key_env=K&secret_key_env=S",  # the ledger names no keys
        ):
            with self.assertRaises(ValueError, msg=bad):
                parse_where(bad, keys=False)

    def test_config(self) -> None:
        def load(**env: str) -> config.BoxConfig:
            return config.load(env_file="/nonexistent-env", environ=env)

        with self.assertRaises(config.ConfigError):
            config.load(env_file="/nonexistent-env")  # an explicit missing file is an error
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root)
        env_file = os.path.join(root, "router.env")
        with open(env_file, "w") as f:
            f.write(f"LCHAT_DATA_DIR={root}\nLCHAT_RUN_DIR={root}\n")
        cfg = config.load(env_file=env_file, environ={})
        self.assertEqual((cfg.cloud_region, cfg.id_ledger), ("", None))
        cfg = config.load(
            env_file=env_file,
            environ={"LCHAT_CLOUD_REGION": "ie", "LCHAT_CLOUD_ID_LEDGER": "s3://ids-bucket/p"},
        )
        self.assertEqual(cfg.cloud_region, "ie")
        self.assertEqual(cfg.id_ledger, Where("ids-bucket", "p"))
        self.assertEqual(cfg.warnings, ())
        for env in ({"LCHAT_CLOUD_REGION": "i e"}, {"LCHAT_CLOUD_ID_LEDGER": "ids-bucket"}):
            with self.assertRaises(config.ConfigError):
                config.load(env_file=env_file, environ=env)


# --- the block CAS on real stores ---------------------------------------------------------------


class _Interloper:
    """A real store that lets another writer advance the counter right after each of our reads
    (every conditional write of ours then loses): a deterministic race, on real bytes."""

    def __init__(self, store: ObjectStore, rival: IdLedger) -> None:
        self._store = store
        self._rival = rival
        self.reads = 0

    def describe(self) -> str:
        return self._store.describe()

    async def get(self, key: str) -> StoredObject:
        got = await self._store.get(key)
        self.reads += 1
        await self._rival.take_block(1)
        return got

    async def put(self, key: str, body: bytes, **kwargs: Any) -> PutResult:
        return await self._store.put(key, body, **kwargs)


if TYPE_CHECKING:
    _Mixin = unittest.TestCase
else:
    _Mixin = object  # not a TestCase itself, or trial would run the store-less base


class CasMixin(_Mixin):
    """The ledger's invariants against a store; subclasses say which (``make_store``)."""

    async def make_store(self) -> ObjectStore:
        raise NotImplementedError

    async def store(self) -> ObjectStore:
        s = await self.make_store()
        self.addCleanup(lambda: Deferred.fromCoroutine(s.close()))
        return s

    async def test_blocks_advance_by_conditional_writes(self) -> None:
        store = await self.store()
        ledger = ledger_on(store)
        self.assertEqual((await ledger.read()).next, 1)  # absent: the first block starts at 1
        self.assertIsNone((await ledger.read()).etag)
        self.assertEqual(await ledger.take_block(), Block(1, 1 + DEFAULT_BLOCK))
        self.assertEqual(await ledger.take_block(5), Block(101, 106))
        stored = await store.get("fleet/" + LEDGER_KEY)
        self.assertEqual(json.loads(stored.body), {"next": 106})
        # A stale version cannot be written over: exactly what the CAS relies on.
        stale = stored.info.etag
        await ledger.take_block(1)
        with self.assertRaises(PreconditionFailed):
            await store.put("fleet/" + LEDGER_KEY, b'{"next": 1}', if_match=stale)
        self.assertEqual((await ledger.read()).next, 107)

    async def test_seed_raises_never_lowers(self) -> None:
        ledger = ledger_on(await self.store())
        self.assertEqual(await ledger.seed_above(57), (1, 58))  # creates the counter
        self.assertEqual(await ledger.seed_above(10), (58, 58))  # lower: unchanged
        self.assertEqual(await ledger.seed_above(57), (58, 58))  # equal: already above
        self.assertEqual(await ledger.take_block(), Block(58, 158))
        self.assertEqual(await ledger.seed_above(1000), (158, 1001))
        self.assertEqual((await ledger.read()).next, 1001)

    async def test_an_abandoned_block_is_never_reissued(self) -> None:
        store = await self.store()
        # Its taker dies having handed out 1..3: 4..10 are simply never used.
        self.assertEqual(await ledger_on(store, block=10).take_block(), Block(1, 11))
        survivor = ledger_on(store, block=10)
        self.assertEqual(
            [await survivor.take_block() for _ in range(2)], [Block(11, 21), Block(21, 31)]
        )

    async def test_contention_is_retried_then_refused(self) -> None:
        store = await self.store()
        rival = ledger_on(store)
        await rival.take_block(1)  # the counter exists: every read of ours is then overtaken
        # Every write of ours loses: a bounded number of fresh reads, then a clear error.
        loser = _Interloper(store, rival)
        ledger = IdLedger(loser, rival.key, sleep=_sleep, attempts=4, backoff=0.001)  # type: ignore[arg-type]
        with self.assertRaises(LedgerContention) as caught:
            await ledger.take_block()
        self.assertIn("4 conditional writes", str(caught.exception))
        self.assertEqual(loser.reads, 4)
        self.assertEqual((await rival.read()).next, 6)  # 1 + the rival's five 1-id blocks

    async def test_unreadable_counter_is_never_overwritten(self) -> None:
        store = await self.store()
        await store.put("fleet/" + LEDGER_KEY, b'{"next": "lots"}')
        ledger = ledger_on(store)
        for attempt in (ledger.take_block(), ledger.seed_above(5)):
            with self.assertRaises(LedgerError):
                await attempt
        self.assertEqual((await store.get("fleet/" + LEDGER_KEY)).body, b'{"next": "lots"}')


class AtomicCasMixin(CasMixin):
    """The ledger's promise under racing takers, which holds where the bucket's conditional
    write is atomic: S3, SeaweedFS, the file store. Not on moto's server: its conditional PUT
    checks the ETag, then writes, with no lock between, on a threaded server (moto/s3/
    responses.py ``put_object``), so two racing PUTs with one ``If-Match`` can both succeed
    (fc37: 441 distinct ids of 448 under a loaded -j3 run) — a property of the stand-in, not of
    the ledger."""

    async def test_property_concurrent_takers_on_two_boxes_never_collide(self) -> None:
        """8 takers x 8 blocks, small blocks so they race on nearly every one, split over two
        separate store clients: every id in one block only, each taker's blocks increasing."""
        boxes = [await self.store(), await self.store()]
        ledgers = [
            IdLedger(
                boxes[i % 2],
                "fleet/" + LEDGER_KEY,
                sleep=_sleep,
                block=7,
                attempts=200,
                backoff=0.005,
                rng=random.Random(i),
            )
            for i in range(8)
        ]

        async def run(ledger: IdLedger) -> list[int]:
            ids: list[int] = []
            for _ in range(8):
                block = await ledger.take_block()
                ids.extend(range(block.start, block.end))
            return ids

        results: list[list[int]] = await gatherResults(
            [Deferred.fromCoroutine(run(ledger)) for ledger in ledgers]
        )
        everything = [n for ids in results for n in ids]
        self.assertEqual(len(set(everything)), 8 * 8 * 7, "an id was taken twice")
        for ids in results:
            self.assertEqual(ids, sorted(ids), "a taker's blocks must increase")
        # Blocks are disjoint and whole: the counter ends exactly at the blocks taken.
        self.assertEqual((await ledger_on(boxes[0]).read()).next, 1 + 8 * 8 * 7)


class FileStoreCasTests(AtomicCasMixin, unittest.TestCase):
    async def make_store(self) -> ObjectStore:
        root = tempfile.mkdtemp(prefix="ledger-")
        self.addCleanup(shutil.rmtree, root, True)
        if not hasattr(self, "_root"):
            self._root = root
        # Two "boxes" on a file: bucket are two FileStores on one directory.
        return FileStore(reactor, self._root, run_in_thread=thread_runner(reactor), create=True)


class MotoCasTests(CasMixin, unittest.TestCase):
    timeout = 60

    async def make_store(self) -> ObjectStore:
        server = await s3servers.shared_server("moto")
        if not hasattr(self, "_bucket"):
            self._bucket = await server.new_bucket()
        return s3servers.store_for(server, self._bucket)


# --- the CLI --------------------------------------------------------------------------------------


@frozen
class Result:
    code: int
    out: str
    err: str


class MintCliTests(unittest.TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="lm", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.data_dir = os.path.join(self.root, "data")
        self.run_dir = os.path.join(self.root, "run")
        os.mkdir(self.data_dir)
        os.mkdir(self.run_dir)
        self.env_file = os.path.join(self.root, "router.env")
        self.ledger_dir = os.path.join(self.root, "ledger")
        saved = dict(os.environ)

        def restore() -> None:
            os.environ.clear()
            os.environ.update(saved)

        self.addCleanup(restore)
        for name in [n for n in os.environ if n.startswith(("LCHAT_", "AWS_"))]:
            del os.environ[name]
        self.registry = Registry(os.path.join(self.data_dir, "registry.db"), clock=time.time)

    def write_env(self, **extra: str) -> None:
        lines = {
            "LCHAT_UNITS": "builtin",
            "LCHAT_HIBERNATE_BUCKET": "file:" + os.path.join(self.root, "bucket"),
            **extra,
        }
        with open(self.env_file, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in lines.items()))

    async def lchat(self, *argv: str) -> Result:
        common = [
            "--env-file",
            self.env_file,
            "--data-dir",
            self.data_dir,
            "--run-dir",
            self.run_dir,
        ]

        def run() -> Result:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([*argv, *common])
            return Result(code, out.getvalue(), err.getvalue())

        result: Result = await deferToThread(run)
        return result

    def homes(self) -> Mapping[str, str]:
        self.registry.migrate()
        return {r.host: r.home_region for r in self.registry.load()}

    async def test_mint_end_to_end_on_moto_with_cloud_region(self) -> None:
        server = await s3servers.shared_server("moto")
        bucket = await server.new_bucket()
        self.write_env(
            LCHAT_CLOUD_REGION="ie",
            LCHAT_CLOUD_ID_LEDGER=f"s3://{bucket}/ids?endpoint={server.endpoint}&region={server.region}",
            AWS_ACCESS_KEY_ID=server.credentials.access_key,
            AWS_SECRET_ACCESS_KEY=server.credentials.secret_key,
            AWS_EC2_METADATA_DISABLED="true",
        )
        first = await self.lchat("add-instance", "--mint", "example.com", "--hibernate")
        self.assertEqual(first.code, 0, first)
        self.assertIn("1.example.com is registered", first.out)
        self.assertIn("id 1 from the id ledger", first.err)
        # The second create draws from this box's block: no new block taken.
        second = await self.lchat(
            "add-instance", "--mint", "example.com", "--hibernate", "--home-region", "fi"
        )
        self.assertEqual(second.code, 0, second)
        self.assertIn("this box's block", second.err)
        self.assertEqual(self.homes(), {"1.example.com": "ie", "2.example.com": "fi"})
        counter = server.client().get_object(Bucket=bucket, Key="ids/" + LEDGER_KEY)
        self.assertEqual(json.loads(counter["Body"].read()), {"next": 1 + DEFAULT_BLOCK})
        shown = await self.lchat("id-ledger", "show")
        self.assertEqual(shown.code, 0, shown)
        self.assertIn(f"next: {1 + DEFAULT_BLOCK}", shown.out)
        self.assertIn("this box's block: 3..100 (98 left)", shown.out)

    async def test_namespace_above_the_counter_refuses_until_seeded(self) -> None:
        self.write_env(LCHAT_CLOUD_ID_LEDGER="file:" + self.ledger_dir)
        made = await self.lchat("add-instance", "57.example.com", "--hibernate")
        self.assertEqual(made.code, 0, made)
        refused = await self.lchat("add-instance", "--mint", "example.com", "--hibernate")
        self.assertEqual(refused.code, 1, refused)
        self.assertIn("holds minted id 57", refused.err)
        self.assertIn("lchat id-ledger seed --above 57", refused.err)
        self.assertEqual(set(self.homes()), {"57.example.com"})
        seeded = await self.lchat("id-ledger", "seed", "--above", "57")
        self.assertEqual(seeded.code, 0, seeded)
        self.assertIn("next 1 -> 58 (seeded above 57)", seeded.out)
        again = await self.lchat("id-ledger", "seed", "--above", "30")
        self.assertIn("next is 58, already above 30; unchanged", again.out)
        minted = await self.lchat("add-instance", "--mint", "example.com", "--hibernate")
        self.assertEqual(minted.code, 0, minted)
        # One id space: another domain draws from the same block.
        other = await self.lchat("add-instance", "--mint", "other.net", "--hibernate")
        self.assertEqual(other.code, 0, other)
        self.assertEqual(set(self.homes()), {"57.example.com", "58.example.com", "59.other.net"})
        # A host registered by hand inside this box's block: the rest of the block is skipped.
        made = await self.lchat("add-instance", "90.example.com", "--hibernate")
        self.assertEqual(made.code, 0, made)
        after = await self.lchat("add-instance", "--mint", "example.com", "--hibernate")
        self.assertEqual(after.code, 0, after)
        self.assertIn("158.example.com", self.homes())

    async def test_without_a_ledger_the_box_counts_itself(self) -> None:
        self.write_env()
        made = await self.lchat("add-instance", "41.example.com", "--hibernate")
        self.assertEqual(made.code, 0, made)
        first = await self.lchat("add-instance", "--mint", "example.com", "--hibernate")
        self.assertEqual(first.code, 0, first)
        self.assertIn("no LCHAT_CLOUD_ID_LEDGER", first.err)
        self.assertIn("42.example.com", self.homes())
        removed = await self.lchat("remove", "42.example.com")
        self.assertEqual(removed.code, 0, removed)
        # A removed space's id (its files stay) is not minted again on this box.
        second = await self.lchat("add-instance", "--mint", "example.com", "--hibernate")
        self.assertEqual(second.code, 0, second)
        self.assertEqual(set(self.homes()), {"41.example.com", "43.example.com"})
        self.assertEqual(self.homes()["43.example.com"], "")
        shown = await self.lchat("id-ledger", "show")
        self.assertEqual(shown.code, 1, shown)
        self.assertIn("set LCHAT_CLOUD_ID_LEDGER", shown.err)

    async def test_host_xor_mint(self) -> None:
        self.write_env()
        for argv in (("add-instance",), ("add-instance", "a.example.com", "--mint", "example.com")):
            result = await self.lchat(*argv)
            self.assertEqual(result.code, 2, result)  # a usage error, as argparse reports it
            self.assertIn("--mint", result.err)
        self.assertEqual(self.homes(), {})
