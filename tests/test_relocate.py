"""``lchat relocate``: LCHAT_REGION_BUCKETS, and a real cross-implementation move (moto → SeaweedFS)
that the stock ``litestream restore`` reads back."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sqlite3
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import attrs
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from lchat import config
from lchat.buckets import open_bucket
from lchat.builds import BuildRecord
from lchat.cli import main as cli_main
from lchat.cli import relocate
from lchat.config import BoxConfig, ConfigError
from lchat.handover import HandoverError
from lchat.handover.relocate import one_account
from lchat.objstore.where import Where
from lchat.reactors import installed
from lchat.registry import Registry, Route
from lchat.replica import ltx
from tests import replicas
from tests.s3servers import S3Server, shared_server, store_for
from tests.test_replica_cli import snapshot_pages

HOST = "chat.example.com"


def _load(env: dict[str, str]) -> BoxConfig:
    base = {"LCHAT_DATA_DIR": "/tmp", "LCHAT_RUN_DIR": "/tmp"}
    return config.load(env_file=os.devnull, environ={**base, **env}, systemd_present=False)


class RegionBucketsConfigTests(TestCase):
    HIB = {"LCHAT_HIBERNATE_BUCKET": "bucket-ie", "LCHAT_HIBERNATE_PREFIX": "prod"}

    def refused(self, env: dict[str, str], *words: str) -> None:
        with self.assertRaises(ConfigError) as e:
            _load(env)
        self.assertIn("LCHAT_REGION_BUCKETS", str(e.exception))
        for word in words:
            self.assertIn(word, str(e.exception))

    def test_unset_means_one_shared_bucket(self) -> None:
        self.assertEqual(_load(self.HIB).region_buckets, {})

    def test_entries_parse_with_region_endpoint_and_key_names(self) -> None:
        cfg = _load(
            {
                **self.HIB,
                "LCHAT_REGION_BUCKETS": "ie=s3://bucket-ie/prod?region=eu-west-1, "
                "fi=s3://bucket-fi/p/q?endpoint=https://s3.fi.example/&region=eu-north-1"
                "&access_key_env=FI_KEY&secret_key_env=FI_SECRET",
            }
        )
        self.assertEqual(list(cfg.region_buckets), ["fi", "ie"])  # sorted by region
        fi, ie = cfg.region_buckets["fi"], cfg.region_buckets["ie"]
        self.assertEqual(ie, Where("bucket-ie", "prod", "eu-west-1"))
        self.assertEqual(
            (fi.bucket, fi.prefix, fi.endpoint, fi.s3_region, fi.access_key_env, fi.secret_key_env),
            ("bucket-fi", "p/q", "https://s3.fi.example", "eu-north-1", "FI_KEY", "FI_SECRET"),
        )
        self.assertEqual(fi.key(HOST, "lock.json"), f"p/q/{HOST}/lock.json")

    def test_refusals_name_the_variable(self) -> None:
        self.refused({"LCHAT_REGION_BUCKETS": "ie=s3://bucket-ie"}, "LCHAT_HIBERNATE_BUCKET")
        self.refused({**self.HIB, "LCHAT_REGION_BUCKETS": "s3://bucket-ie"}, "REGION=")
        self.refused({**self.HIB, "LCHAT_REGION_BUCKETS": "ie=s3://a-b,ie=s3://c-d"}, "twice")
        self.refused({**self.HIB, "LCHAT_REGION_BUCKETS": "i e=s3://a-b"}, "region")
        self.refused({**self.HIB, "LCHAT_REGION_BUCKETS": "ie=s3://a-b?colour=red"}, "colour")
        self.refused({**self.HIB, "LCHAT_REGION_BUCKETS": "ie=http://a-b"}, "s3://")
        self.refused(
            {**self.HIB, "LCHAT_REGION_BUCKETS": "ie=s3://a-b?access_key_env=K"}, "secret_key_env"
        )
        self.refused(
            {**self.HIB, "LCHAT_REGION_BUCKETS": "ie=s3://a-b?access_key_env=1&secret_key_env=S"},
            "variable name",
        )

    def test_the_boxs_own_region_is_its_hibernation_bucket(self) -> None:
        mesh = {
            "LCHAT_MESH_SELF": "https://box1.example.net",
            "LCHAT_MESH_DOMAINS": "example.com",
            "LCHAT_MESH_TOKEN": "t" * 32,
            "LCHAT_MESH_REGION": "ie",
        }
        # Left out: implied from LCHAT_HIBERNATE_*.
        cfg = _load({**self.HIB, **mesh, "LCHAT_REGION_BUCKETS": "fi=s3://bucket-fi/prod"})
        self.assertEqual(
            [(r, b.bucket, b.prefix) for r, b in cfg.region_buckets.items()],
            [("fi", "bucket-fi", "prod"), ("ie", "bucket-ie", "prod")],
        )
        # Given and the same: accepted.
        _load({**self.HIB, **mesh, "LCHAT_REGION_BUCKETS": "ie=s3://bucket-ie/prod"})
        # Given and different: refused, naming both.
        self.refused(
            {**self.HIB, **mesh, "LCHAT_REGION_BUCKETS": "ie=s3://bucket-ie/other"},
            "LCHAT_HIBERNATE_",
            "'other'",
        )


def _snapshot(db: str, txid: int) -> tuple[str, bytes]:
    """A level-9 snapshot of ``db`` at ``txid``: (its name under the replica dir, its bytes)."""
    page_size, count, pages = snapshot_pages(db)
    header = ltx.LTXHeader(
        page_size=page_size,
        commit=count,
        min_txid=1,
        max_txid=txid,
        timestamp=int(time.time() * 1000),
    )
    name = ltx.object_key("", 9, 1, txid).lstrip("/")
    return name, ltx.encode(header, pages)


class RelocateTests(TestCase):
    """Region ``ie`` on a moto bucket, region ``fi`` on a SeaweedFS bucket, each with its own keys
    (named through ``access_key_env``/``secret_key_env``)."""

    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]  # trial waits for it
        self.dir = tempfile.mkdtemp(prefix="reloc", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.moto: S3Server = await shared_server("moto")
        self.weed: S3Server = await shared_server("seaweedfs")
        self.ie_bucket = await self.moto.new_bucket()
        self.fi_bucket = await self.weed.new_bucket()
        self.ie = store_for(self.moto, self.ie_bucket)
        self.fi = store_for(self.weed, self.fi_bucket)
        self.addCleanup(self.ie.close)
        self.addCleanup(self.fi.close)
        # A real database, replicated to ie as one snapshot at txid 5.
        self.db = os.path.join(self.dir, "source.db")
        conn = sqlite3.connect(self.db)
        conn.execute("CREATE TABLE m (id INTEGER PRIMARY KEY, body BLOB)")
        conn.executemany(
            "INSERT INTO m (body) VALUES (?)", [(os.urandom(200),) for _ in range(300)]
        )
        conn.commit()
        conn.close()
        name, body = _snapshot(self.db, 5)
        await self.ie.put(f"prod/{HOST}/{name}", body)
        self.registry = Registry(os.path.join(self.dir, "registry.db"), time.time)
        self.registry.migrate()
        self.registry.insert(
            Route(
                host=HOST,
                kind="instance",
                socket=os.path.join(self.dir, f"{HOST}.sock"),
                status="ready",
                hibernate=True,
                home_region="ie",
            )
        )
        self.extra: dict[str, str] = {}  # more settings for the relocating box

    def env(self) -> dict[str, str]:
        m, w = self.moto, self.weed
        env = {
            "LCHAT_DATA_DIR": self.dir,
            "LCHAT_RUN_DIR": self.dir,
            "LCHAT_HIBERNATE_BUCKET": self.ie_bucket,
            "LCHAT_HIBERNATE_PREFIX": "prod",
            "LCHAT_HIBERNATE_ENDPOINT": m.endpoint,
            "LCHAT_HIBERNATE_REGION": m.region,
            "AWS_ACCESS_KEY_ID": m.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": m.credentials.secret_key,
            "FI_KEY": w.credentials.access_key,
            "FI_SECRET": w.credentials.secret_key,
        }
        env["LCHAT_REGION_BUCKETS"] = (
            f"ie=s3://{self.ie_bucket}/prod?endpoint={m.endpoint}&region={m.region},"
            f"fi=s3://{self.fi_bucket}/prod?endpoint={w.endpoint}&region={w.region}"
            f"&access_key_env=FI_KEY&secret_key_env=FI_SECRET"
        )
        return env

    def config(self) -> BoxConfig:
        path = os.path.join(self.dir, "router.env")
        with open(path, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in {**self.env(), **self.extra}.items())
        return config.load(env_file=path, environ={}, systemd_present=False)

    async def relocate(self, to: str = "fi", *, as_json: bool = False) -> tuple[int, str, str]:
        """Run the command as ``lchat relocate`` does, in a thread (it runs a reactor of its own).
        The keys are given in an env file: the process environment must not carry moto's."""
        cfg = self.config()
        out, err = io.StringIO(), io.StringIO()
        args = argparse.Namespace(
            host=HOST, to=to, json=as_json, timeout=60.0, move_dns=False, source=""
        )

        def call() -> int:
            with redirect_stdout(out), redirect_stderr(err):
                try:
                    return relocate.run(
                        args, cfg, lambda _cfg: self.registry, cli_main._out, cli_main._note
                    )
                except HandoverError as e:  # as lchat's main() reports it
                    return cli_main._fail(str(e))

        code = await deferToThread(call)
        return code, out.getvalue(), err.getvalue()

    async def keys(self, store: Any) -> list[str]:
        return [i.key for i in await store.list(f"prod/{HOST}/")]

    async def test_moves_the_replica_from_moto_to_seaweedfs(self) -> None:
        source_keys = await self.keys(self.ie)
        code, out, err = await self.relocate()
        self.assertEqual(code, 0, err)
        lines = out.splitlines()
        self.assertEqual(lines[0], f"relocated {HOST}: ie → fi")
        self.assertTrue(lines[1].startswith("store: copied 1 objects"), lines)
        self.assertIn("download + re-upload", lines[1])
        self.assertIn("lock.json excluded", lines[1])
        self.assertTrue(lines[2].startswith("home_region flipped"), lines)
        route = self.registry.get(HOST)
        assert route is not None
        self.assertEqual(route.home_region, "fi")
        # The destination holds the replica and no lease (a destination box takes a fresh one);
        # the source is as it was, its lock included (absent: released by the sleep), plus the
        # marker of where the space went (lchat.hibernation.moved), which is never copied.
        dest_keys = await self.keys(self.fi)
        self.assertEqual(
            [k.rsplit("/", 1)[1] for k in dest_keys], [k.rsplit("/", 1)[1] for k in source_keys]
        )
        self.assertNotIn(f"prod/{HOST}/lock.json", dest_keys)
        self.assertEqual(
            await self.keys(self.ie), sorted([*source_keys, f"prod/{HOST}/moved.json"])
        )
        # The stock litestream reads the destination replica back to the same database.
        restored = os.path.join(self.dir, "restored.db")
        await replicas.litestream_restore(self.weed, self.fi_bucket, f"prod/{HOST}", restored)
        self.assertEqual(replicas.dump(restored), replicas.dump(self.db))
        # Re-run: nothing to do, nothing copied.
        code, out, err = await self.relocate()
        self.assertEqual((code, out.strip()), (0, f"{HOST}: already in fi: nothing to do"), err)
        self.assertEqual(await self.keys(self.fi), dest_keys)

    async def test_one_bucket_two_prefixes_is_a_server_side_copy(self) -> None:
        # fi keeps its replicas in the same moto bucket and endpoint as ie, under another prefix:
        # CopyObject on the server, no bytes through this box; relocate's own lease on the source
        # (held during the copy) does not travel.
        m = self.moto
        self.extra["LCHAT_REGION_BUCKETS"] = (
            f"ie=s3://{self.ie_bucket}/prod?endpoint={m.endpoint}&region={m.region},"
            f"fi=s3://{self.ie_bucket}/prod-fi?endpoint={m.endpoint}&region={m.region}"
        )
        source_keys = await self.keys(self.ie)
        code, out, err = await self.relocate(as_json=True)
        self.assertEqual(code, 0, err)
        steps = json.loads(out)
        self.assertEqual(
            (steps["store"]["method"], steps["store"]["objects"]), ("server-side copy", 1)
        )
        self.assertEqual(steps["store"]["bytes"], len(_snapshot(self.db, 5)[1]))
        dest = [i.key for i in await self.ie.list(f"prod-fi/{HOST}/")]
        self.assertEqual(
            sorted(k.rsplit("/", 1)[1] for k in dest),
            sorted(k.rsplit("/", 1)[1] for k in source_keys),
        )
        self.assertNotIn(f"prod-fi/{HOST}/lock.json", dest)
        restored = os.path.join(self.dir, "restored.db")
        await replicas.litestream_restore(self.moto, self.ie_bucket, f"prod-fi/{HOST}", restored)
        self.assertEqual(replicas.dump(restored), replicas.dump(self.db))

    async def test_the_build_floor_travels_over_an_older_one_of_the_same_size(self) -> None:
        # The space's build floor (build.json) is not immutable like a replica file: the
        # destination's older record of the same size is replaced, never kept.
        m = self.moto
        self.extra["LCHAT_REGION_BUCKETS"] = (
            f"ie=s3://{self.ie_bucket}/prod?endpoint={m.endpoint}&region={m.region},"
            f"fi=s3://{self.ie_bucket}/prod-fi?endpoint={m.endpoint}&region={m.region}"
        )
        ran, stale = BuildRecord("1.4", 1.0, "box-a"), BuildRecord("1.3", 1.0, "box-a")
        await self.ie.put(f"prod/{HOST}/build.json", ran.to_bytes())
        await self.ie.put(f"prod-fi/{HOST}/build.json", stale.to_bytes())
        code, _out, err = await self.relocate()
        self.assertEqual(code, 0, err)
        got = await self.ie.get(f"prod-fi/{HOST}/build.json")
        self.assertEqual(BuildRecord.parse(got.body), ran)

    async def test_two_buckets_of_one_account_on_one_endpoint_copy_on_the_server(self) -> None:
        # fi keeps its replicas in another moto bucket, same endpoint, same keys: CopyObject into
        # fi's bucket naming ie's as the source (no byte through this box). With fi's own key
        # pair (another account, as far as the configuration says) the bytes stream instead.
        m = self.moto
        fi_bucket = await m.new_bucket()
        fi = store_for(m, fi_bucket)
        self.addCleanup(fi.close)
        self.extra["LCHAT_REGION_BUCKETS"] = (
            f"ie=s3://{self.ie_bucket}/prod?endpoint={m.endpoint}&region={m.region},"
            f"fi=s3://{fi_bucket}/prod?endpoint={m.endpoint}&region={m.region}"
        )
        source = {i.key: i.size for i in await self.ie.list(f"prod/{HOST}/")}
        code, out, err = await self.relocate(as_json=True)
        self.assertEqual(code, 0, err)
        steps = json.loads(out)
        self.assertEqual(
            (steps["store"]["method"], steps["store"]["objects"]), ("server-side copy", 1)
        )
        copied = {i.key: i.size for i in await fi.list(f"prod/{HOST}/")}
        self.assertEqual(copied, {k: v for k, v in source.items() if not k.endswith("lock.json")})
        restored = os.path.join(self.dir, "restored.db")
        await replicas.litestream_restore(self.moto, fi_bucket, f"prod/{HOST}", restored)
        self.assertEqual(replicas.dump(restored), replicas.dump(self.db))

    async def test_each_regions_store_is_signed_for_its_own_region(self) -> None:
        # The copy's clients: each region's store signs for that region (SigV4's scope), and
        # answers (moto and SeaweedFS take any region in the scope, so the scope is read back).
        m, w = self.moto, self.weed
        self.extra["LCHAT_REGION_BUCKETS"] = (
            f"ie=s3://{self.ie_bucket}/prod?endpoint={m.endpoint}&region=eu-west-1,"
            f"fi=s3://{self.fi_bucket}/prod?endpoint={w.endpoint}&region=eu-north-1"
            f"&access_key_env=FI_KEY&secret_key_env=FI_SECRET"
        )
        cfg = self.config()
        reactor = installed()
        regions = {"ie": "eu-west-1", "fi": "eu-north-1"}
        self.assertEqual(sorted(cfg.region_buckets), ["fi", "ie"])
        for label, where in cfg.region_buckets.items():
            region = regions[label]
            store = await open_bucket(reactor, cfg, where, make_dir=True)
            try:
                self.assertTrue(store.describe().endswith(f"(region {region})"), store.describe())
                await store.list("prod/")
            finally:
                await store.close()

    def test_one_account_is_judged_from_the_configuration(self) -> None:
        m = self.moto
        cfg = self.config()
        ie = Where("b1", "prod", m.region, m.endpoint)
        same = Where("b2", "prod", m.region, m.endpoint)
        own_key = attrs.evolve(same, access_key_env="FI_KEY", secret_key_env="FI_SECRET")
        elsewhere = attrs.evolve(same, endpoint=self.weed.endpoint)
        aws_ie = Where("b1", "", "eu-west-1")
        aws_fi = Where("b2", "", "eu-north-1")
        self.assertTrue(one_account(cfg, ie, same))
        self.assertFalse(one_account(cfg, ie, own_key))  # FI_KEY is weed's key
        self.assertFalse(one_account(cfg, ie, elsewhere))
        self.assertFalse(one_account(cfg, aws_ie, aws_fi))  # two AWS regions
        self.assertTrue(one_account(cfg, aws_ie, attrs.evolve(aws_fi, s3_region="eu-west-1")))
        self.assertFalse(one_account(cfg, ie, Where(f"file:{self.dir}/b")))
