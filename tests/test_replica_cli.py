"""`lchat replica ls` and `lchat replica restore`, end to end: a real process, a real file bucket."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time

from twisted.trial.unittest import TestCase

from lchat.objstore.file import FileBucket
from lchat.replica import ltx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "chat.example.com"


def snapshot_pages(db: str) -> tuple[int, int, list[tuple[int, bytes]]]:
    with open(db, "rb") as f:
        data = f.read()
    page_size = int.from_bytes(data[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    count = len(data) // page_size
    lock = ltx.lock_pgno(page_size)
    pages = [
        (n, data[(n - 1) * page_size : n * page_size]) for n in range(1, count + 1) if n != lock
    ]
    return page_size, count, pages


class ReplicaCliTests(TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.bucket = os.path.join(self.dir, "bucket")
        self.env = os.path.join(self.dir, "router.env")
        with open(self.env, "w") as f:
            f.write(
                f"LCHAT_DATA_DIR={self.dir}\nLCHAT_RUN_DIR={self.dir}\n"
                f"LCHAT_HIBERNATE_BUCKET=file:{self.bucket}\nLCHAT_HIBERNATE_PREFIX=prod\n"
            )
        # A real database, shipped as a level-9 snapshot in the bucket's layout.
        self.source = os.path.join(self.dir, "source.db")
        conn = sqlite3.connect(self.source)
        conn.execute("CREATE TABLE m (id INTEGER PRIMARY KEY, body BLOB)")
        conn.executemany(
            "INSERT INTO m (body) VALUES (?)", [(os.urandom(300),) for _ in range(200)]
        )
        conn.commit()
        conn.close()
        page_size, count, pages = snapshot_pages(self.source)
        header = ltx.LTXHeader(
            page_size=page_size,
            commit=count,
            min_txid=1,
            max_txid=1,
            timestamp=int(time.time() * 1000),
        )
        store = FileBucket(self.bucket, create=True)
        store.put(ltx.object_key(f"prod/{HOST}", 9, 1, 1), ltx.encode(header, pages))

    def lchat(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lchat.cli", *args, "--env-file", self.env],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": ROOT},
        )

    def dump(self, path: str) -> list[str]:
        conn = sqlite3.connect(path)
        try:
            return list(conn.iterdump())
        finally:
            conn.close()

    def test_ls_lists_levels_and_the_newest_txid(self) -> None:
        result = self.lchat("replica", "ls", HOST)
        self.assertEqual(result.returncode, 0, result.stderr)
        header, row = result.stdout.splitlines()[:2]
        self.assertEqual(header.split()[:2], ["LEVEL", "MIN"])
        self.assertEqual(row.split()[:3], ["9", "0000000000000001", "0000000000000001"])
        self.assertIn("newest txid 0000000000000001", result.stdout)

    def test_restore_rebuilds_the_database_and_refuses_to_overwrite(self) -> None:
        out = os.path.join(self.dir, "restored.db")
        result = self.lchat("replica", "restore", HOST, "-o", out)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(self.dump(out), self.dump(self.source))
        again = self.lchat("replica", "restore", HOST, "-o", out)
        self.assertEqual(again.returncode, 1)
        self.assertEqual(len(again.stderr.strip().splitlines()), 1, again.stderr)

    def test_unknown_host_and_hostile_names_are_one_line_errors(self) -> None:
        for host in ("nobody.example.com", "../etc", "a/b"):
            result = self.lchat("replica", "restore", host, "-o", os.path.join(self.dir, "x.db"))
            self.assertEqual(result.returncode, 1, (host, result.stderr))
            self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
            self.assertFalse(os.path.exists(os.path.join(self.dir, "x.db")))
