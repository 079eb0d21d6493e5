"""lchat.envfile: the one rule for setting a variable in an env file (assign), as the CLI's
token writer and bootstrap use it."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from lchat import envfile


class AssignTests(SynchronousTestCase):
    def test_the_winning_assignment_else_the_commented_one_else_a_new_line(self) -> None:
        lines = ["# mine", "A=1", "export A = 2", "#B=example", "# B=again"]
        self.assertTrue(envfile.assign(lines, "A", "3"))  # the last one, the one that wins
        self.assertFalse(envfile.assign(lines, "B", "x y"))  # the example's line becomes it
        self.assertFalse(envfile.assign(lines, "C", "4"))
        self.assertEqual(lines, ["# mine", "A=1", "A=3", "B=x y", "# B=again", "C=4"])
        with self.assertRaises(ValueError):
            envfile.assign(lines, "D", "two\nlines")

    def test_the_token_is_set_in_place_the_rest_kept_mode_0600(self) -> None:
        directory = tempfile.mkdtemp(prefix="envfile-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "a.env")
        envfile.write_token(path, "first")
        with open(path, "a") as f:
            f.write("LCHAT_BOT_EVERY=5m\n")
        os.chmod(path, 0o644)
        envfile.write_token(path, "second")
        with open(path) as f:
            self.assertEqual(f.read(), "LCHAT_ADMIN_TOKEN=second\nLCHAT_BOT_EVERY=5m\n")
        self.assertEqual(envfile.read_token(path), "second")
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)

    def test_an_edit_keeps_the_files_owner(self) -> None:
        """``lchat env`` run as root over a hibernating space's env file, which the router's
        user owns and reads at each wake: the file stays that user's (before: root's, mode
        0600, and the space's next wake could not read it)."""
        if os.geteuid() != 0:
            # (Only root can give a file away: as anyone else the edit writes it as its own.)
            raise self.skipTest("needs root to make a file another user owns")
        directory = tempfile.mkdtemp(prefix="envfile-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "a.example.com.env")
        with open(path, "w") as f:
            f.write("LCHAT_ADMIN_TOKEN=t\n")
        os.chown(path, 4321, 4322)
        envfile.edit(path, {"LCHAT_SPACE_NAME": "Team"}, ())
        st = os.stat(path)
        self.assertEqual((st.st_uid, st.st_gid), (4321, 4322))
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o600)
        with open(path) as f:
            self.assertEqual(f.read(), "LCHAT_ADMIN_TOKEN=t\nLCHAT_SPACE_NAME=Team\n")
