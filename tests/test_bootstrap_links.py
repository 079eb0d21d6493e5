"""``lchat bootstrap`` (root) follows no link the service user could have planted (issue 29,
item 10): its data dir and ``router.env`` are the service user's to write, so a re-run of
bootstrap on a box whose space was compromised must not hand a file outside them to that user,
nor copy one into ``router.env``. Real runs, as tests/test_bootstrap.py does them (as root)."""

from __future__ import annotations

import os
import stat
import tempfile

from lchat.envfile import hand_to
from tests.test_bootstrap import _require_root, _Root, _service_user

SECRET = "OTHER_SERVICE_TOKEN=s3cr3t\n"


class LinkTests(_Root):
    def setUp(self) -> None:
        _require_root()
        _service_user()
        self.root = self.make_root()
        self.etc = tempfile.mkdtemp(prefix="etc-", dir=self.root)  # stands in for /etc
        os.chmod(self.etc, 0o755)
        self.secret = os.path.join(self.etc, "other.env")  # a root-only file in env syntax
        with open(self.secret, "w") as f:
            f.write(SECRET)
        os.chmod(self.secret, 0o600)

    def owner_and_mode(self, path: str) -> tuple[int, int, int]:
        st = os.lstat(path)
        return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)

    def test_a_data_dir_that_is_a_link_is_refused(self) -> None:
        os.symlink(self.etc, os.path.join(self.root, "data"))
        done = self.bootstrap(self.root, "--set", "LCHAT_ACME_DIRECTORY=off")
        self.assertEqual(self.owner_and_mode(self.etc), (0, 0, 0o755))
        self.assertEqual(sorted(os.listdir(self.etc)), ["other.env"])
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("is a symbolic link", done.stderr)

    def test_a_router_env_that_is_a_link_or_a_second_name_is_refused(self) -> None:
        data = os.path.join(self.root, "data")
        os.mkdir(data, 0o750)
        env_file = os.path.join(data, "router.env")
        for plant in (os.symlink, os.link):
            with self.subTest(plant=plant.__name__):
                plant(self.secret, env_file)
                done = self.bootstrap(self.root, "--set", "LCHAT_ACME_DIRECTORY=off")
                self.assertEqual(self.owner_and_mode(self.secret), (0, 0, 0o600))
                with open(self.secret) as f:
                    self.assertEqual(f.read(), SECRET)
                if not os.path.islink(env_file) and not os.path.samefile(env_file, self.secret):
                    with open(env_file) as f:  # not copied into a file the user owns
                        self.assertNotIn("s3cr3t", f.read())
                self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
                self.assertIn(env_file, done.stderr)
                os.unlink(env_file)

    def test_hand_to_never_hands_over_a_file_with_a_second_name(self) -> None:
        """``lchat.envfile.hand_to`` (root fixing an env file's owner) meets a hard link to a
        root-only file where the env file was: it refuses, and the file keeps its owner."""
        env = os.path.join(self.root, "space.env")
        os.link(self.secret, env)
        with self.assertRaises(OSError) as caught:
            hand_to(env, 4242, 4242)
        self.assertIn("another name", str(caught.exception))
        self.assertEqual(self.owner_and_mode(self.secret), (0, 0, 0o600))
