"""An object store that counts what one database's backup costs: requests, bytes, the last error.

Wraps the backup bucket's one client per database, so the counters are the database's own
(``lchat_backup_requests_total{db,op}``, ``lchat_backup_bytes_total{db,direction}``) and the
status page can say what failed last. Behaviour is the wrapped store's, unchanged.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Awaitable, Mapping
from typing import IO, TypeVar, Unpack

from prometheus_client import Counter
from twisted.internet.interfaces import IReactorTime

from lchat.objstore import ObjectInfo, ObjectStore, PutOptions, PutResult, StoredObject

REQUESTS = Counter(
    "lchat_backup_requests_total", "Backup bucket requests by database and operation", ["db", "op"]
)
BYTES = Counter(
    "lchat_backup_bytes_total",
    "Backup bytes by database and direction (up, down)",
    ["db", "direction"],
)
ERRORS = Counter("lchat_backup_errors_total", "Failed backup bucket requests by database", ["db"])

_T = TypeVar("_T")


class MeteredStore:
    """``store`` as seen by database ``db``'s replicator (:class:`~lchat.objstore.ObjectStore`)."""

    def __init__(self, store: ObjectStore, db: str, clock: IReactorTime) -> None:
        self._store = store
        self.db = db
        self._clock = clock  # when the last error happened
        self.requests = 0
        self.bytes_up = 0
        self.last_error = ""
        self.last_error_at = 0.0

    def forget(self) -> None:
        """Drop this database's series (it is no longer backed up by this router)."""
        for labels in list(REQUESTS._metrics):
            if labels[0] == self.db:
                REQUESTS.remove(*labels)
        for counter, labels in ((BYTES, ("up",)), (BYTES, ("down",)), (ERRORS, ())):
            with contextlib.suppress(KeyError):
                counter.remove(self.db, *labels)

    async def _count(self, op: str, work: Awaitable[_T]) -> _T:
        self.requests += 1
        REQUESTS.labels(self.db, op).inc()
        try:
            return await work
        except Exception as e:
            ERRORS.labels(self.db).inc()
            self.last_error = f"{op}: {e}"
            self.last_error_at = self._clock.seconds()
            raise

    def describe(self) -> str:
        return self._store.describe()

    async def get(self, key: str) -> StoredObject:
        got = await self._count("get", self._store.get(key))
        BYTES.labels(self.db, "down").inc(len(got.body))
        return got

    async def get_to_file(self, key: str, path: str) -> ObjectInfo:
        info = await self._count("get", self._store.get_to_file(key, path))
        BYTES.labels(self.db, "down").inc(info.size)
        return info

    async def get_into(self, key: str, sink: IO[bytes]) -> int:
        n = await self._count("get", self._store.get_into(key, sink))
        BYTES.labels(self.db, "down").inc(n)
        return n

    async def head(self, key: str) -> ObjectInfo:
        return await self._count("head", self._store.head(key))

    async def put(self, key: str, body: bytes, **options: Unpack[PutOptions]) -> PutResult:
        result = await self._count("put", self._store.put(key, body, **options))
        self.bytes_up += len(body)
        BYTES.labels(self.db, "up").inc(len(body))
        return result

    async def put_file(
        self, key: str, path: str, *, metadata: Mapping[str, str] | None = None
    ) -> PutResult:
        # A temp file the replicator just wrote: a stat from the page cache, not a blocking read.
        size = os.path.getsize(path)  # noqa: ASYNC240
        result = await self._count("put", self._store.put_file(key, path, metadata=metadata))
        self.bytes_up += size
        BYTES.labels(self.db, "up").inc(size)
        return result

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        await self._count("delete", self._store.delete(key, if_match=if_match))

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return await self._count("list", self._store.list(prefix))

    async def copy(self, source: str, destination: str) -> PutResult:
        return await self._count("copy", self._store.copy(source, destination))

    async def now(self) -> datetime.datetime:
        return await self._store.now()

    async def close(self) -> None:
        """The shared client is the service's to close, not one database's."""
