"""lchat.buckets: the one opener — a refusal names the setting the bucket came from, a file:
bucket's directory is made only where asked, a must-exist one is never made."""

from __future__ import annotations

import os
import shutil
import tempfile
from unittest import mock

from twisted.trial.unittest import TestCase

from lchat import config
from lchat.buckets import open_bucket
from lchat.cli import release as release_cli
from lchat.config import ConfigError
from lchat.objstore import ObjectStoreError
from lchat.objstore.where import Where
from lchat.reactors import installed
from lchat.release import settings as release_settings

reactor = installed()


def _exists(path: str) -> bool:
    return os.path.exists(path)


class OpenBucketTests(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="buckets", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        # The process environment is the test's own: no key variable leaks in.
        patcher = mock.patch.dict(os.environ, clear=True)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.cfg = config.load(
            env_file=os.devnull,
            environ={"LCHAT_DATA_DIR": self.dir, "LCHAT_RUN_DIR": self.dir},
            systemd_present=False,
        )

    async def test_the_release_mirrors_unset_keys_name_its_variable(self) -> None:
        # Before the one opener, every bucket without a mesh label was "LCHAT_MESH_BUCKET".
        settings = release_settings.read(
            {
                "LCHAT_RELEASE_MIRROR_URL": "s3://rel-mirror/feed?endpoint=http://127.0.0.1:9"
                "&access_key_env=MIRROR_KEY&secret_key_env=MIRROR_SECRET"
            },
            {},
        )
        with self.assertRaises(ConfigError) as caught:
            await release_cli._mirror_store(reactor, self.cfg, settings)
        self.assertEqual(
            str(caught.exception),
            "LCHAT_RELEASE_MIRROR_URL's keys are in MIRROR_KEY and MIRROR_SECRET, which are unset",
        )

    async def test_a_file_bucket_is_made_only_when_asked(self) -> None:
        where = Where("file:" + os.path.join(self.dir, "made"))
        store = await open_bucket(reactor, self.cfg, where)
        await store.close()
        self.assertFalse(_exists(where.directory))  # a write makes it, not the open
        store = await open_bucket(reactor, self.cfg, where, make_dir=True)
        try:
            self.assertEqual(await store.list(""), [])
            self.assertEqual(os.stat(where.directory).st_mode & 0o777, 0o700)
        finally:
            await store.close()

    async def test_a_must_exist_file_bucket_is_never_made(self) -> None:
        where = Where("file:" + os.path.join(self.dir, "absent"))
        store = await open_bucket(reactor, self.cfg, where, must_exist=True)
        try:
            with self.assertRaises(ObjectStoreError):
                await store.put("x", b"y")
        finally:
            await store.close()
        self.assertFalse(_exists(where.directory))
