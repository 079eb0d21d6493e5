"""Consistency machinery for replicating a space's database while the space keeps writing it.

Synchronous; every method runs in a worker thread (never on the reactor), one call at a time.

Tables we add to the space's database (the only things we add; both tiny):

``_lchat_replica_seq (id INTEGER PRIMARY KEY, seq INTEGER)``
    One row (id 1). We bump it at open so the WAL exists with a header, and read it to hold our
    long-lived read transaction.
``_lchat_replica_lock (id INTEGER)``
    Always empty. ``BEGIN IMMEDIATE`` on our lock connection takes the database's write lock for
    the few milliseconds of the checkpoint dance; the transaction is always rolled back.

Why the log cannot be reset past what we shipped (SQLite's WAL locking):

- We hold a read transaction (connection A) *anchored* at a point where everything in the log up
  to its end had been shipped: it is taken only while our lock connection L holds the write lock,
  right after the caller captured the log's committed tail.
- A checkpoint copies frames into the database file only up to the oldest reader's snapshot, and
  the log restarts (overwriting frames) only once it is fully copied and no reader uses it. So,
  while A is held, frames after the anchor are never overwritten. If the log was fully copied when
  A began, A reads "from the database file only", which blocks *any* further copying: the log can
  then restart at most once, and only when everything in it had been shipped. That one restart is
  followed (salt-1 + 1) rather than treated as a reset — only from the anchor itself.

The dance (:meth:`ReplicaDB.checkpoint`), which lets the space keep writing (its writes wait while
L holds the write lock: the space needs a busy timeout; ours waits at most ``lock_timeout_ms``):

1. PASSIVE checkpoint on L without any lock: copies frames up to A's anchor (the slow part, with
   its fsync) while the space writes on.
2. L ``BEGIN IMMEDIATE`` + write to ``_lchat_replica_lock``: the space's writes now wait.
3. Read the committed tail after the caller's ``shipped`` position; hand it to ``capture`` (the
   caller copies its pages now), or give up if there is a tail and no ``capture``.
4. Release A; PASSIVE checkpoint on A (only the tail is left to copy); take A again — anchored at
   the log's end, which is now exactly what the caller has.
5. Roll back L: the space writes on.
6. TRUNCATE mode, if step 4 copied everything: ``wal_checkpoint(TRUNCATE)`` on L with a few-ms busy
   timeout. It can only truncate what is already copied and shipped — A (reading the database
   file only) blocks copying anything newer, so a commit that slips in first makes it give up.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Literal

from attrs import frozen

from lchat.replica import wal
from lchat.replica.ltx import lock_pgno
from lchat.replica.wal import Segment, WALPosition, WALReset, WALRewritten

SEQ_TABLE = "_lchat_replica_seq"
LOCK_TABLE = "_lchat_replica_lock"

CheckpointMode = Literal["PASSIVE", "TRUNCATE"]


class PageFds:
    """Descriptors for page reads that stay open for the life of the process, one per file.

    POSIX drops every lock a process holds on a file when *any* descriptor of that file is
    closed. A database that other code in this process also uses through SQLite (the router's
    own registry, which the fleet backup replicates) would lose that code's locks at a moment it
    cannot know whenever a replicator's own descriptor closed: at a stop, at each retry of a
    failed start. So such replicators borrow their descriptor from here and never close it.
    Keyed by the file (device, inode): a database replaced by a rename gets a fresh descriptor;
    one whose file has no name left (``st_nlink == 0``) is closed when next looked at, since no
    lock on a deleted file protects anything. Thread-safe (replicators open in worker threads).
    """

    def __init__(self) -> None:
        self._fds: dict[tuple[int, int], int] = {}
        self._mu = threading.Lock()

    def fd(self, path: str) -> int:
        st = os.lstat(path)  # and O_NOFOLLOW below: a link planted by the space is refused
        with self._mu:
            for key, fd in list(self._fds.items()):
                if os.fstat(fd).st_nlink == 0:
                    del self._fds[key]
                    os.close(fd)
            key = (st.st_dev, st.st_ino)
            known = self._fds.get(key)
            if known is None:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                got = os.fstat(fd)
                if (got.st_dev, got.st_ino) != key:  # replaced between the stat and the open
                    key = (got.st_dev, got.st_ino)
                    if key in self._fds:
                        os.close(fd)
                        return self._fds[key]
                self._fds[key] = fd
                return fd
            return known

    def __len__(self) -> int:
        return len(self._fds)


class ReplicaDBError(Exception):
    """The database cannot be replicated (not WAL mode, closed, or SQLite refused)."""


@frozen
class CheckpointResult:
    mode: CheckpointMode
    done: bool  # the checkpoint ran (False: skipped, see ``reason``)
    reason: str | None = None
    busy: bool = False  # SQLite's first result column: could not complete
    log_frames: int = 0
    checkpointed_frames: int = 0
    truncated: bool = False
    position: WALPosition | None = None  # the new anchor: what the caller has shipped/captured
    reset: WALReset | WALRewritten | None = None  # the log was not where ``shipped`` said


@frozen
class Snapshot:
    """A consistent image of the database at ``position`` (``None``: no log, file only)."""

    position: WALPosition | None
    page_size: int
    page_count: int


class ReplicaDB:
    """The space's database as the replicator sees it. Call :meth:`open` first, :meth:`close` last."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout_ms: int = 5000,
        lock_timeout_ms: int = 5000,
        truncate_busy_ms: int = 5,
        min_checkpoint_pages: int = 1000,
        truncate_pages: int = 10000,
        page_fds: PageFds | None = None,
    ) -> None:
        self.path = os.fspath(path)
        # Where the descriptor for page reads comes from: None = our own, closed by close();
        # a PageFds = one kept open for the process's life (see PageFds).
        self._page_fds = page_fds
        self.wal_path = self.path + "-wal"
        self.busy_timeout_ms = busy_timeout_ms
        self.lock_timeout_ms = lock_timeout_ms
        self.truncate_busy_ms = truncate_busy_ms
        self.min_checkpoint_pages = min_checkpoint_pages
        self.truncate_pages = truncate_pages
        self._reader: sqlite3.Connection | None = None  # A: holds the read transaction
        self._locker: sqlite3.Connection | None = None  # L: write lock, our writes, checkpoints
        # Where our read transaction was taken: the caller must have shipped at least this far.
        self._anchor: WALPosition | None = None
        self._dbfd: int | None = None  # see open(): never closed before close()
        self._page_size = 0
        self._mu = threading.Lock()  # calls come from pool threads; never two at once

    # -- lifecycle ---------------------------------------------------------------------------

    def _connect(self, timeout_ms: int) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/ROLLBACK ourselves; pool threads share connections.
        # mode=rw: never create the database (a file removed since open() checked it must not
        # come back empty and be shipped as the newest state).
        conn = sqlite3.connect(
            f"file:{urllib.parse.quote(self.path)}?mode=rw",
            uri=True,
            timeout=timeout_ms / 1000,
            isolation_level=None,
            check_same_thread=False,
        )
        # SQLite resolves a link at the database's name (its journals it opens O_NOFOLLOW): a
        # space that made its database a link to another's, or to the registry, is refused.
        opened = conn.execute("PRAGMA database_list").fetchone()[2]
        expected = os.path.join(
            os.path.realpath(os.path.dirname(self.path)), os.path.basename(self.path)
        )
        if opened != expected:
            conn.close()
            raise ReplicaDBError(f"{self.path} is a link to {opened}: refusing to replicate it")
        conn.execute(f"PRAGMA busy_timeout = {int(timeout_ms)}")
        # Our own writes must never start a checkpoint: only the dance checkpoints.
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        return conn

    def open(self) -> WALPosition | None:
        """Switch to WAL, add our tables, hold the read transaction; return the anchor.

        The anchor is the end of the log's committed frames (``None`` if there is no log): a
        snapshot taken now (:meth:`snapshot`) is at exactly that position.
        """
        with self._mu:
            if not os.path.exists(self.path):
                raise ReplicaDBError(f"{self.path}: no such database")
            self._locker = lk = self._connect(self.lock_timeout_ms)
            self._reader = self._connect(self.busy_timeout_ms)
            # One descriptor for direct page reads, open until close(): POSIX drops every lock a
            # process holds on a file when ANY descriptor of it is closed, so a transient
            # open()/close() here would silently release SQLite's locks and let the space's last
            # connection checkpoint and delete the WAL under our read transaction.
            if self._page_fds is not None:
                self._dbfd = self._page_fds.fd(self.path)
            else:
                self._dbfd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            mode = lk.execute("PRAGMA journal_mode = wal").fetchone()[0]
            if str(mode).lower() != "wal":
                raise ReplicaDBError(f"{self.path}: journal_mode is {mode}, cannot switch to wal")
            lk.execute(
                f"CREATE TABLE IF NOT EXISTS {SEQ_TABLE} (id INTEGER PRIMARY KEY, seq INTEGER)"
            )
            lk.execute(f"CREATE TABLE IF NOT EXISTS {LOCK_TABLE} (id INTEGER)")
            # A write guarantees a log with a header exists (an empty one tells us nothing).
            lk.execute(
                "INSERT INTO _lchat_replica_seq (id, seq) VALUES (1, 1) "
                "ON CONFLICT (id) DO UPDATE SET seq = seq + 1"
            )
            self._page_size = int(lk.execute("PRAGMA page_size").fetchone()[0])
            # Find the end without the lock (may be long), then finish under it (short).
            seg = wal.read_committed(self.wal_path, None)
            pos = seg.end if isinstance(seg, Segment) else None
            self._write_lock()
            try:
                tail = wal.read_committed(self.wal_path, pos)
                if not isinstance(tail, Segment):
                    tail = wal.read_committed(self.wal_path, None)
                pos = tail.end if isinstance(tail, Segment) else None
                self._begin_read()
            finally:
                lk.execute("ROLLBACK")
            self._anchor = pos
            return pos

    def close(self) -> None:
        with self._mu:
            for conn in (self._reader, self._locker):
                if conn is not None:
                    conn.close()
            self._reader = self._locker = None
            if self._dbfd is not None and self._page_fds is None:
                os.close(self._dbfd)
            self._dbfd = None
            self._anchor = None

    def _fd(self) -> int:
        if self._dbfd is None:
            raise ReplicaDBError(f"{self.path}: not open")
        return self._dbfd

    def _conns(self) -> tuple[sqlite3.Connection, sqlite3.Connection]:
        if self._reader is None or self._locker is None:
            raise ReplicaDBError("ReplicaDB is not open")
        return self._reader, self._locker

    def _begin_read(self) -> None:
        rd, _ = self._conns()
        if rd.in_transaction:
            rd.execute("ROLLBACK")
        rd.execute("BEGIN")
        # A read statement is what actually takes the snapshot (BEGIN alone is deferred).
        rd.execute("SELECT COUNT(1) FROM _lchat_replica_seq").fetchone()

    def _write_lock(self) -> None:
        _, lk = self._conns()
        lk.execute("BEGIN IMMEDIATE")
        try:
            # Rolled back always; the write just makes the intent explicit in a trace.
            lk.execute("INSERT INTO _lchat_replica_lock (id) VALUES (1)")
        except BaseException:
            lk.execute("ROLLBACK")
            raise

    # -- reading -----------------------------------------------------------------------------

    def read_committed(
        self, since: WALPosition | None, *, max_bytes: int | None = None
    ) -> Segment | WALReset | WALRewritten | None:
        """Committed frames after ``since``, following a restart only from our anchor (see top)."""
        with self._mu:
            self._conns()
            follow = since is not None and since == self._anchor
            return wal.read_committed(
                self.wal_path, since, follow_restart=follow, max_bytes=max_bytes
            )

    def snapshot(self) -> tuple[Snapshot, Iterator[tuple[int, bytes]]]:
        """A consistent image at the log's current committed end, as ``(pgno, page)`` ascending.

        Pages come from the log (re-verified) where it has them, else from the database file. This
        is consistent while we hold the read transaction (see top): the file changes only by
        copying frames we overlay anyway, and if the log restarts under us it had been fully
        copied, so the file then holds every page at our position.
        """
        with self._mu:
            self._conns()
            seg = wal.read_committed(self.wal_path, None)
        ps = self._page_size
        if isinstance(seg, Segment) and seg.commit:
            count = seg.commit
            pos: WALPosition | None = seg.end
        else:
            count = _db_file_pages(self._fd(), ps)
            pos = seg.end if isinstance(seg, Segment) else None
        snap = Snapshot(pos, ps, count)
        return snap, self._snapshot_pages(seg if isinstance(seg, Segment) else None, count)

    def _snapshot_pages(self, seg: Segment | None, count: int) -> Iterator[tuple[int, bytes]]:
        ps, lock = self._page_size, lock_pgno(self._page_size)
        reader = wal.WALReader(self.wal_path) if seg is not None else None
        fd = self._fd()
        try:
            for pgno in range(1, count + 1):
                if pgno == lock:
                    continue
                data: bytes | None = None
                if reader is not None and seg is not None and pgno in seg.pages:
                    try:
                        data = reader.read_page(seg.header, seg.pages[pgno])
                    except wal.WALError:
                        data = None  # restarted under us: the file has it (see above)
                if data is None:
                    data = os.pread(fd, ps, (pgno - 1) * ps)
                    data = data.ljust(ps, b"\0")
                yield pgno, data
        finally:
            if reader is not None:
                reader.close()

    # -- checkpoints -------------------------------------------------------------------------

    def wanted_checkpoint(self, shipped: WALPosition | None) -> CheckpointMode | None:
        """PASSIVE once the current log holds ~``min_checkpoint_pages`` frames; TRUNCATE once
        the file is past ``truncate_pages`` (a restart reuses the file but never shrinks it)."""
        fs = self._page_size + wal.FRAME_HEADER_SIZE
        try:
            size = os.path.getsize(self.wal_path)
        except FileNotFoundError:
            return None
        if size >= wal.WAL_HEADER_SIZE + self.truncate_pages * fs:
            return "TRUNCATE"
        frames = 0 if shipped is None else (shipped.offset - wal.WAL_HEADER_SIZE) // fs
        if frames >= self.min_checkpoint_pages:
            return "PASSIVE"
        return None

    def checkpoint(
        self,
        mode: CheckpointMode,
        shipped: WALPosition | None,
        capture: Callable[[Segment], None] | None = None,
    ) -> CheckpointResult:
        """The dance (see top). ``shipped``: everything before it is durable (or captured).

        Contract: committed frames after ``shipped`` are passed to ``capture`` while the space is
        held off; ``capture`` must copy their pages before returning (after the checkpoint the log
        may be overwritten) and the caller must ship them before anything later. Without
        ``capture``, a tail means the checkpoint is skipped (``reason``) and nothing changes.
        On ``reset`` the caller must take a fresh snapshot.
        """
        with self._mu:
            rd, lk = self._conns()
            # 1. The bulk copy, up to our anchor, while the space writes on.
            lk.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            # 2. Hold the space's writers off.
            try:
                self._write_lock()
            except sqlite3.OperationalError as e:
                return CheckpointResult(mode, False, reason=f"write lock: {e}")
            try:
                # 3. The committed tail, under the lock: nothing can commit after it now.
                follow = shipped is not None and shipped == self._anchor
                tail = wal.read_committed(self.wal_path, shipped, follow_restart=follow)
                if isinstance(tail, WALReset | WALRewritten):
                    return CheckpointResult(mode, False, reason=tail.reason, reset=tail)
                end = shipped
                if tail is not None:
                    if not tail.empty:
                        if capture is None:
                            return CheckpointResult(
                                mode, False, reason="unshipped committed frames", position=shipped
                            )
                        capture(tail)
                    end = tail.end
                # 4. Release A, copy the rest, re-anchor A at the (frozen) end of the log.
                rd.execute("ROLLBACK")
                try:
                    busy, log, done = rd.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                finally:
                    self._begin_read()
                self._anchor = end
            finally:
                # 5. The space writes on.
                lk.execute("ROLLBACK")
            truncated = False
            if mode == "TRUNCATE" and not busy and log == done:
                # 6. Only already-copied (so shipped) frames can go; see the module docstring.
                lk.execute(f"PRAGMA busy_timeout = {int(self.truncate_busy_ms)}")
                try:
                    tbusy, tlog, _ = lk.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                    truncated = not tbusy and tlog == 0
                except sqlite3.OperationalError:
                    truncated = False
                finally:
                    lk.execute(f"PRAGMA busy_timeout = {int(self.lock_timeout_ms)}")
            return CheckpointResult(
                mode,
                True,
                busy=bool(busy),
                log_frames=int(log),
                checkpointed_frames=int(done),
                truncated=truncated,
                position=end,
            )


def _db_file_pages(fd: int, page_size: int) -> int:
    """Database size in pages from the file header (valid-for == change counter), else its size."""
    hdr = os.pread(fd, 100, 0)
    size = os.fstat(fd).st_size
    if len(hdr) == 100 and hdr[92:96] == hdr[24:28]:
        n = int.from_bytes(hdr[28:32], "big")
        if n:
            return n
    return size // page_size
