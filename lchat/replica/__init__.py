"""Replication: a space's SQLite database as Litestream-0.5-compatible LTX files in the bucket.

``wal.py`` reads the WAL, ``ltx.py`` is the LTX codec, ``restore.py`` rebuilds a database from a
replica (docs/design.md §6; the layout is in docs/bucket.md).
"""
