"""lchat.files: the one atomic writer (write_atomic; Replacement for a body written in pieces),
used for env files, certificates, the clean-sleep marker, a sidecar's schedule. Real files in a
temp directory; faults are injected at the os-call level, and one real crash (SIGKILL before the
rename) runs in a child process."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from lchat import files
from lchat.files import write_atomic


class WriteAtomicTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="files-")
        self.addCleanup(lambda: subprocess.run(["rm", "-rf", self.dir], check=False))
        self.path = os.path.join(self.dir, "a.env")

    def mode(self, path: str) -> int:
        return stat.S_IMODE(os.stat(path).st_mode)

    def leftovers(self) -> list[str]:
        return sorted(n for n in os.listdir(self.dir) if n != "a.env")

    def test_writes_the_bytes_with_exactly_the_mode_whatever_the_umask(self) -> None:
        for umask, mode in ((0o000, 0o600), (0o077, 0o644), (0o022, 0o640)):
            old = os.umask(umask)
            try:
                write_atomic(self.path, b"X=1\n" * 3, mode)
            finally:
                os.umask(old)
            with open(self.path, "rb") as f:
                self.assertEqual(f.read(), b"X=1\n" * 3)
            self.assertEqual(self.mode(self.path), mode, f"umask {umask:o}")
        self.assertEqual(self.leftovers(), [])

    def test_the_mode_is_right_from_the_first_byte(self) -> None:
        """A secret is never readable by anyone the mode excludes, not even while it is written:
        the first write already goes to a file with the final mode (umask 0 would otherwise leave
        0666 - nothing here may rely on the umask)."""
        seen: list[int] = []
        real_write = os.write

        def write(fd: int, data: bytes) -> int:
            seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
            return real_write(fd, data)

        old = os.umask(0)
        try:
            self.patch(os, "write", write)
            write_atomic(self.path, b"LCHAT_ADMIN_TOKEN=secret\n", 0o600)
        finally:
            os.umask(old)
        self.assertTrue(seen)
        self.assertEqual(set(seen), {0o600})

    def test_the_old_file_stays_whole_until_the_new_one_is_complete(self) -> None:
        """Readers see the old bytes while the new ones are written, and a failure before the
        rename (a full disk at the second chunk) leaves the old file exactly as it was and no
        temp file behind."""
        write_atomic(self.path, b"old contents\n", 0o600)
        seen_by_reader: list[bytes] = []
        calls = [0]
        real_write = os.write

        def write(fd: int, data: bytes) -> int:
            calls[0] += 1
            with open(self.path, "rb") as f:
                seen_by_reader.append(f.read())
            if calls[0] == 2:
                raise OSError(28, "No space left on device")
            return real_write(fd, bytes(data[:5]))  # short writes: the rest comes in more calls

        self.patch(os, "write", write)
        with self.assertRaises(OSError):
            write_atomic(self.path, b"new contents, longer than one short write\n", 0o600)
        self.assertEqual(seen_by_reader, [b"old contents\n", b"old contents\n"])
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b"old contents\n")
        self.assertEqual(self.leftovers(), [])

    def test_a_failed_fsync_leaves_the_old_file(self) -> None:
        write_atomic(self.path, b"old\n", 0o600)

        def fsync(fd: int) -> None:
            raise OSError(5, "Input/output error")

        self.patch(os, "fsync", fsync)
        with self.assertRaises(OSError):
            write_atomic(self.path, b"new\n", 0o600)
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b"old\n")
        self.assertEqual(self.leftovers(), [])

    def test_a_crash_before_the_rename_leaves_the_old_file_whole(self) -> None:
        """A real crash (SIGKILL once the new bytes are written and synced, before the rename):
        the target is still the complete old file; only a hidden ``*.tmp`` is left, which
        directory scanners (the certificate store) skip."""
        write_atomic(self.path, b"old\n" * 1000, 0o600)
        script = (
            "import os, signal, sys\n"
            "from lchat import files\n"
            "real = os.fsync\n"
            "def fsync(fd):\n"
            "    real(fd)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "os.fsync = fsync\n"
            "files.write_atomic(sys.argv[1], b'new\\n' * 100000, 0o600)\n"
        )
        child = subprocess.run([sys.executable, "-c", script, self.path], check=False)
        self.assertEqual(child.returncode, -signal.SIGKILL)
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b"old\n" * 1000)
        (left,) = self.leftovers()
        self.assertTrue(left.startswith(".a.env.") and left.endswith(".tmp"), left)

    def test_the_directory_is_fsynced_unless_told_not_to(self) -> None:
        synced: list[str] = []
        self.patch(files, "fsync_directory", synced.append)
        write_atomic(self.path, b"1", 0o600)
        write_atomic(self.path, b"2", 0o600, fsync_dir=False)
        self.assertEqual(synced, [self.dir])

    def test_a_symlink_at_the_target_is_replaced_not_followed(self) -> None:
        elsewhere = os.path.join(self.dir, "elsewhere")
        with open(elsewhere, "wb") as f:
            f.write(b"not yours\n")
        os.symlink(elsewhere, self.path)
        write_atomic(self.path, b"mine\n", 0o600)
        self.assertFalse(os.path.islink(self.path))
        with open(elsewhere, "rb") as f:
            self.assertEqual(f.read(), b"not yours\n")

    def test_a_replacement_is_written_in_pieces_then_committed_or_discarded(self) -> None:
        write_atomic(self.path, b"old\n", 0o600)
        staged = files.Replacement(self.path, 0o640)
        staged.file.write(b"new ")
        staged.file.write(b"bytes\n")
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b"old\n")  # nothing shows before the commit
        staged.commit()
        dropped = files.Replacement(self.path)
        dropped.file.write(b"never\n")
        dropped.discard()
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b"new bytes\n")
        self.assertEqual(self.mode(self.path), 0o640)
        self.assertEqual(self.leftovers(), [])
