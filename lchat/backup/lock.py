"""The one-replicator-per-database lock: ``flock(<data>/.backup/<name>.lock)``.

The router's backup and ``lchat backup replicate`` (the ``lchat-backup@<host>`` and
``lchat-backup-home`` units that keep shipping while the router is down) replicate the same
databases to the same replica paths. Two replicators on one database corrupt each other's state
(the seeds: "Never let two replicators track one database"), so exclusivity is enforced here,
not only promised by the order units start in.

Invariants:

- A replicator of database ``name`` runs only while its process holds
  ``flock(<data>/.backup/<name>.lock, LOCK_EX | LOCK_NB)`` on a descriptor of its own, from
  before the replicator opens the database until after it closed it.
- ``flock`` locks belong to the open file description: two :class:`ReplicaLock` of one file in
  one process exclude each other like two processes do, and the kernel drops a dead process's
  lock (a crash never leaves a database locked). They are never POSIX ``fcntl`` locks, so closing
  this descriptor never touches SQLite's locks on the database (lchat/backup/selection.py).
- The file is never deleted (deleting a locked file would let a second holder lock a new one at
  the same path). What it says (pid and role of the last holder) is for the operator only.
"""

from __future__ import annotations

import errno
import fcntl
import os

LOCK_DIR = ".backup"  # under the data dir: no glob of the backup's (top-level *.db) matches it


def lock_path(data_dir: str, name: str) -> str:
    """``<data>/.backup/<name>.lock`` (``name``: the database's name in the backup layout)."""
    return os.path.join(os.path.abspath(data_dir), LOCK_DIR, f"{name}.lock")


class ReplicaLock:
    """The lock of one database's replica (see the module docstring). Blocking calls (they touch
    the local disk only): run them in a thread from the reactor."""

    def __init__(self, path: str, role: str) -> None:
        self.path = path
        self.role = role  # who holds it, written into the file: "router", "lchat backup replicate"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock if nobody holds it: True (held now, or already), False (held
        elsewhere). Raises OSError when the lock file cannot be made or opened."""
        if self._fd is not None:
            return True
        os.makedirs(os.path.dirname(self.path), 0o750, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {self.role}\n".encode(), 0)
        except OSError:
            pass  # what it says is for the operator; the lock itself is held
        return True

    def release(self) -> None:
        """Let go (closing the descriptor drops the flock). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def holder(self) -> str:
        """What the file says of its last holder ("1234 lchat backup replicate"), or ""."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                return f.read(200).strip()
        except OSError:
            return ""
