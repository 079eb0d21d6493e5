# ruff: noqa: S608  (table names are our own w<n>, never input)
"""Child processes for ``tests/test_replication_workloads.py`` (run as ``python -m`` or by path).

program  DB JSON          run a generated workload program (a JSON list of ops), then exit
mono     DB N SLEEP       commit rows 1..N one transaction each (plus a counter row), then exit
torn     DB               commit a little, then spill an uncommitted transaction into the WAL
                          and wait to be SIGKILLed inside it
replicate DB BUCKET PATH OPTS_JSON
                          run a Replicator against a FileStore; print "started <txid>" once the
                          initial snapshot is up; on a line "flush" on stdin: flush, print
                          "flushed <txid>", stop and exit 0. Meant to be SIGKILLed at random.
"""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import sys
import time
from typing import Any

from lchat.threads import thread_runner


def _blob(rnd: random.Random, size: int) -> bytes:
    return rnd.randbytes(size)


def run_program(db: str, ops: list[list[Any]]) -> None:
    """Interpret ``ops``; every op is valid in any state (indices are taken modulo what exists)."""
    conn = sqlite3.connect(db, isolation_level=None, timeout=30)
    conn.execute("PRAGMA busy_timeout = 30000")
    rnd = random.Random(1234)
    # Our own tables: w<n>(id INTEGER PRIMARY KEY, v BLOB, extra columns c<k> ...)
    tables: list[str] = []
    indexes: list[str] = []
    counter = [0]

    def fresh(prefix: str) -> str:
        counter[0] += 1
        return f"{prefix}{counter[0]}"

    def table(i: int) -> str | None:
        return tables[i % len(tables)] if tables else None

    def create_table() -> None:
        name = fresh("w")
        conn.execute(f"CREATE TABLE {name}(id INTEGER PRIMARY KEY, v BLOB, n INTEGER)")
        tables.append(name)

    def do(op: list[Any]) -> None:
        kind = op[0]
        if kind == "sleep":
            time.sleep(op[1] / 1000)
            return
        if kind == "vacuum":
            conn.execute("VACUUM")
            return
        if kind == "auto_vacuum":  # ["auto_vacuum", mode]: header change, whole-file rewrite
            conn.execute(f"PRAGMA auto_vacuum = {op[1]}")
            conn.execute("VACUUM")
            return
        if kind == "incremental_vacuum":  # shrinks the file when auto_vacuum is incremental
            conn.execute(f"PRAGMA incremental_vacuum({op[1]})").fetchall()
            return
        if kind == "checkpoint":  # the space's own checkpoint attempt (short busy timeout)
            conn.execute("PRAGMA busy_timeout = 50")
            conn.execute(f"PRAGMA wal_checkpoint({op[1]})").fetchall()
            conn.execute("PRAGMA busy_timeout = 30000")
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            for sub in op[1] if kind == "txn" else [op]:
                step(sub)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def step(op: list[Any]) -> None:
        kind = op[0]
        if kind == "create_table":
            create_table()
            return
        t = table(op[1])
        if t is None:
            create_table()
            t = tables[-1]
        if kind == "insert":  # ["insert", table, rows, size]
            conn.executemany(
                f"INSERT INTO {t}(v, n) VALUES (?, ?)",
                [(_blob(rnd, op[3]), rnd.randrange(1000)) for _ in range(op[2])],
            )
        elif kind == "blob":  # ["blob", table, size]: overflow pages
            conn.execute(f"INSERT INTO {t}(v, n) VALUES (?, -1)", (_blob(rnd, op[2]),))
        elif kind == "update":  # ["update", table, modulus, size]
            conn.execute(
                f"UPDATE {t} SET v = ?, n = n + 1 WHERE id % ? = 0", (_blob(rnd, op[3]), op[2])
            )
        elif kind == "delete":  # ["delete", table, modulus]
            conn.execute(f"DELETE FROM {t} WHERE id % ? = 0", (op[2],))
        elif kind == "drop_table":
            conn.execute(f"DROP TABLE {t}")
            tables.remove(t)
            live = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
            indexes[:] = [i for i in indexes if i in live]
        elif kind == "create_index":
            name = fresh("i")
            conn.execute(f"CREATE INDEX {name} ON {t}(n, v)")
            indexes.append(name)
        elif kind == "drop_index":
            if indexes:
                conn.execute(f"DROP INDEX {indexes.pop(op[1] % len(indexes))}")
        elif kind == "add_column":
            conn.execute(f"ALTER TABLE {t} ADD COLUMN {fresh('c')} TEXT DEFAULT 'x'")
        elif kind == "big":  # ["big", table, pages]: one transaction of many pages
            conn.executemany(
                f"INSERT INTO {t}(v, n) VALUES (?, 0)",
                [(_blob(rnd, 3000),) for _ in range(op[2])],
            )
        else:
            raise ValueError(f"unknown op {op!r}")

    for op in ops:
        do(op)
        time.sleep(0.02)  # let the replicator's 30 ms ticks interleave with the program
    conn.close()


def mono_value(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (1 + i % 40)


def run_mono(db: str, n: int, pause: float) -> None:
    conn = sqlite3.connect(db, isolation_level=None, timeout=30)
    conn.execute("PRAGMA busy_timeout = 30000")
    start = conn.execute("SELECT count(*) FROM log").fetchone()[0]
    for i in range(start + 1, n + 1):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO log(id, v) VALUES (?, ?)", (i, mono_value(i)))
        conn.execute("UPDATE head SET k = ? WHERE id = 1", (i,))
        if i % 25 == 0:  # now and then a large row (overflow pages)
            conn.execute("INSERT INTO big(k, v) VALUES (?, ?)", (i, mono_value(i) * 400))
        conn.execute("COMMIT")
        time.sleep(pause)
    conn.close()


def run_torn(db: str) -> None:
    """Commit a little, then write a transaction big enough to spill uncommitted frames into the
    WAL (tiny page cache), say so, and wait to be SIGKILLed inside it."""
    conn = sqlite3.connect(db, isolation_level=None, timeout=30)
    conn.execute("PRAGMA busy_timeout = 30000")
    conn.execute("PRAGMA cache_size = 5")
    for i in range(5):
        conn.execute("INSERT INTO log(v) VALUES (?)", (mono_value(i),))
        time.sleep(0.02)
    conn.execute("BEGIN IMMEDIATE")
    for i in range(400):
        conn.execute("INSERT INTO log(v) VALUES (?)", (mono_value(i) * 20,))
    print("spilled", flush=True)
    time.sleep(60)


def run_replicator(db: str, bucket: str, path: str, opts: dict[str, Any]) -> None:
    from twisted.internet import stdio
    from twisted.internet.defer import Deferred
    from twisted.protocols.basic import LineReceiver

    from lchat.objstore.file import FileStore
    from lchat.reactors import installed
    from lchat.replica.replicator import Replicator

    reactor = installed()

    rep = Replicator(
        reactor,
        FileStore(reactor, bucket, run_in_thread=thread_runner(reactor)),
        db,
        path,
        interval=opts.get("interval", 0.05),
        db_options=opts.get("db_options"),
        tmp_dir=opts.get("tmp_dir"),
    )
    status = [1]

    def failed(f: Any) -> None:
        print(f.getTraceback(), file=sys.stderr)
        reactor.stop()

    async def flush_and_stop() -> None:
        try:
            await rep.flush()
            print(f"flushed {rep.txid}", flush=True)
            status[0] = 0
        finally:
            await rep.stop()
            reactor.stop()

    class Commands(LineReceiver):
        delimiter = b"\n"

        def lineReceived(self, line: bytes) -> None:
            if line.strip() == b"flush":
                Deferred.fromCoroutine(flush_and_stop()).addErrback(failed)

    async def main() -> None:
        await rep.start()
        print(f"started {rep.txid}", flush=True)
        stdio.StandardIO(Commands())

    reactor.callWhenRunning(lambda: Deferred.fromCoroutine(main()).addErrback(failed))
    reactor.run()
    sys.exit(status[0])


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "program":
        with open(sys.argv[3]) as f:
            run_program(sys.argv[2], json.load(f))
    elif mode == "mono":
        run_mono(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif mode == "torn":
        run_torn(sys.argv[2])
    elif mode == "replicate":
        run_replicator(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
    else:
        raise SystemExit(f"unknown mode {mode}")
