"""A registry the CLI creates as root belongs to the router's user (the data directory's owner).

Found by the box test (tests/box): README's "A real box" runs ``sudo lchat release fetch`` and
``sudo lchat deploy 1.0.0 --all`` before the router's first start; the deploy created
``/data/registry.db`` as root, 0644, and the router then died at every start with "registry
/data/registry.db: attempt to write a readonly database".
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from lchat import config
from lchat.cli import main

SERVICE_UID = 65534  # nobody: any user but root


class RegistryOwnerTests(SynchronousTestCase):
    def setUp(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("needs root: the CLI run by root is what creates a root-owned file")
        self.top = tempfile.mkdtemp(prefix="lchat-regowner-")
        self.addCleanup(shutil.rmtree, self.top, True)
        self.data = os.path.join(self.top, "data")
        os.mkdir(self.data, 0o750)
        os.chown(self.data, SERVICE_UID, SERVICE_UID)
        self.env = os.path.join(self.top, "router.env")
        with open(self.env, "w") as f:
            f.write(f"LCHAT_DATA_DIR={self.data}\nLCHAT_RUN_DIR={self.top}/run\n")
        self.cfg = config.load(env_file=self.env, environ={}, systemd_present=False)

    def test_a_new_registry_is_the_data_directory_owners(self) -> None:
        main.open_registry(self.cfg)
        st = os.stat(self.cfg.registry)
        self.assertEqual((st.st_uid, st.st_gid), (SERVICE_UID, SERVICE_UID))
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o640)
        # A usable database, migrated: a second open finds it as it left it.
        main.open_registry(self.cfg).load()

    def test_an_existing_registry_keeps_its_owner(self) -> None:
        with open(self.cfg.registry, "w"):
            pass
        main.open_registry(self.cfg)
        self.assertEqual(os.stat(self.cfg.registry).st_uid, 0)
