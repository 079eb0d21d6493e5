"""Request and response bodies that do not sit in memory: ``put_file``'s upload, read in worker
threads a chunk at a time (:class:`FileProducer`), and a response read into memory or streamed
into a file through a writer thread (:class:`BodyReader`). Nothing touches the disk on the
reactor thread."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO

from attrs import frozen
from twisted.internet import error
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IConsumer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from lchat.deferutil import fire
from lchat.objstore import ObjectStoreError
from lchat.threads import RunInThread

_WRITE_CHUNK = 1024 * 1024  # get_to_file hands the writer thread this much at a time
_WRITE_HIGH_WATER = 4 * 1024 * 1024  # and pauses the socket when this much is waiting
# put_file reads its file in the thread pool this much at a time. Each chunk costs the reactor a
# round trip to the pool (tens of microseconds): FileBodyProducer's 64 KiB would be 16k of them
# per GiB, 256 KiB is 4k. Larger buys little (the transport sends at most 128 KiB per send()) and
# costs memory: an upload holds about two chunks (one being sent, one read ahead).
_READ_CHUNK = 256 * 1024


@frozen
class FileBody:
    """A file to upload: its path and the size it had when the upload began."""

    path: str
    size: int


@implementer(IBodyProducer)
class FileProducer:
    """``put_file``'s request body: the file, read in a worker thread a chunk at a time.

    Nothing touches the disk on the reactor thread: the descriptor is opened (``_open_for_upload``),
    read (``_read_chunk``) and closed in the pool. At most one read is in flight and at most one
    chunk waits for the consumer (one chunk of read-ahead), so an upload holds about two chunks
    whatever the file's size; the transport pauses us while its buffer is full.

    Reads are positional (``pread``), so there is no shared file offset and every
    ``startProducing`` starts again at byte 0 on the same descriptor: a restart abandons the
    earlier run (a read still in flight for it is dropped when it lands). ``pauseProducing``,
    ``resumeProducing`` and ``stopProducing`` act on the current run.

    ``startProducing``'s Deferred fires once exactly ``length`` bytes are written; it fails with
    :class:`ObjectStoreError` if the file turns out shorter or longer than ``length`` (it changed
    under us), or with the read's ``OSError``. As IBodyProducer requires, it never fires after
    ``stopProducing``; cancelling it stops the run. The owner awaits ``close()``, which fails a run
    still going (with ``CancelledError``), waits for a read in flight and closes the descriptor.
    """

    def __init__(
        self,
        run_in_thread: RunInThread,
        fd: int,
        path: str,
        size: int,
        progress: Callable[[], None] | None = None,
    ) -> None:
        self.length = size
        self.path = path
        # Called on the reactor thread before each chunk is written (feeds an upload's watchdog).
        self.progress = progress
        self._run_in_thread = run_in_thread
        self._fd = fd
        self._closing = False
        self._run = 0  # bumped by every start and stop: a result for an older run is dropped
        self._consumer: IConsumer | None = None
        self._done: Deferred[None] | None = None
        self._paused = False
        self._offset = 0  # the next byte to read
        self._written = 0
        self._ahead: bytes | None = None  # read, waiting for the consumer
        self._reading = False
        self._idle_waiters: list[Deferred[None]] = []

    @classmethod
    async def open(cls, run_in_thread: RunInThread, body: FileBody) -> FileProducer:
        """A producer of ``body``, its file opened (in a thread) and still of its size."""
        fd: int = await run_in_thread(_open_for_upload, body.path, body.size)
        return cls(run_in_thread, fd, body.path, body.size)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        if self._closing:
            raise RuntimeError(f"the upload body for {self.path} is closed")
        self.stopProducing()  # a restart (a retried request) begins again at byte 0
        self._consumer = consumer
        self._done = done = Deferred[None](self._cancel)
        self._paused = False
        self._offset = self._written = 0
        self._pump()
        return done

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._pump()

    def stopProducing(self) -> None:
        self._run += 1
        self._consumer = None
        self._done = None
        self._ahead = None

    async def close(self) -> None:
        """Stop, let a read in flight land, and close the file (in a thread)."""
        self._closing = True
        done = self._done
        self.stopProducing()
        if done is not None:
            # Abandoned mid-run: the store answered before the body was all sent. Fail the run,
            # so the HTTP client lets go of us and can finish closing that connection.
            done.errback(CancelledError(f"the upload of {self.path} was abandoned"))
        while self._reading:
            waiter = Deferred[None]()
            self._idle_waiters.append(waiter)
            await waiter
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            await self._run_in_thread(os.close, fd)

    def _cancel(self, done: Deferred[None]) -> None:
        if done is self._done:
            self.stopProducing()

    def _pump(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return  # stopped, finished or failed
        if self._ahead is not None and not self._paused:
            chunk, self._ahead = self._ahead, None
            self._written += len(chunk)
            run = self._run
            if self.progress is not None:
                self.progress()
            try:
                consumer.write(chunk)  # the transport may pause (or even stop) us from in here
            except BaseException:
                if run == self._run:
                    self._fail(Failure())
                return
            if run != self._run:
                return
        if self._written == self.length:
            done = self._done
            self.stopProducing()
            assert done is not None
            done.callback(None)
        elif self._ahead is None and not self._reading:
            self._read()  # read ahead even while paused: the next chunk is ready on resume

    def _read(self) -> None:
        want = min(_READ_CHUNK, self.length - self._offset)
        # The last read asks for one byte more: getting it means the file grew under us.
        ask = want + 1 if self._offset + want == self.length else want
        self._reading = True
        d = self._run_in_thread(_read_chunk, self._fd, self._offset, ask)
        d.addBoth(self._got, self._run, want)

    def _got(self, result: bytes | Failure, run: int, want: int) -> None:
        self._reading = False
        if run != self._run:
            # A stopped or restarted run's read: drop it (the current run may be waiting to read).
            pass
        elif isinstance(result, Failure):
            self._fail(result)
        elif len(result) != want:
            self._fail(Failure(ObjectStoreError(f"{self.path} changed size while being uploaded")))
        else:
            self._offset += want
            self._ahead = result
        self._pump()
        if not self._reading:
            waiters, self._idle_waiters = self._idle_waiters, []
            fire(waiters, None)

    def _fail(self, failure: Failure) -> None:
        done = self._done
        self.stopProducing()
        if done is not None:
            done.errback(failure)


class BodyReader(Protocol):
    """Reads a response body into memory, or into a file through a writer thread.

    File mode never holds more than about ``_WRITE_HIGH_WATER`` bytes: past that the socket is
    paused until the thread has caught up. ``done`` fires with the body (memory mode) or ``b""``
    once everything is written; cancelling it aborts the connection.
    """

    def __init__(
        self,
        run_in_thread: RunInThread,
        sink: IO[bytes] | None,
        progress: Callable[[], None] | None = None,
    ) -> None:
        self.done: Deferred[bytes] = Deferred(lambda _: self._abort())
        self.received = 0
        self._run_in_thread = run_in_thread
        self._sink = sink
        self._progress = progress
        self._chunks: list[bytes] = []
        self._pending = 0
        self._writing = False
        self._idle_waiters: list[Deferred[None]] = []
        self._paused = False
        self._open = True
        self._failure: Failure | None = None
        self._aborted = False

    def dataReceived(self, data: bytes) -> None:
        self.received += len(data)
        if self._progress is not None:
            self._progress()
        self._chunks.append(data)
        self._pending += len(data)
        if self._sink is None:
            return
        if self._pending >= _WRITE_CHUNK:
            self._flush()
        if self._pending >= _WRITE_HIGH_WATER and not self._paused and self.transport:
            self._paused = True
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = Failure(error.ConnectionDone())) -> None:  # noqa: B008
        self._open = False
        if reason.check(ResponseDone, PotentialDataLoss) is None:
            self._failure = reason
            self._chunks = []
            self._pending = 0
        if self._sink is None:
            fire([self.done], self._failure or b"".join(self._chunks))
            self._chunks = []
            return
        self._flush()

    def _flush(self) -> None:
        if self._writing:
            return  # _written() calls us again
        if self._chunks and not self._aborted:
            data = b"".join(self._chunks)
            self._chunks = []
            self._pending = 0
            assert self._sink is not None
            self._writing = True
            d = self._run_in_thread(self._sink.write, data)
            d.addCallbacks(self._written, self._write_failed)
            return
        if not self._open or self._aborted:
            fire([self.done], self._failure or b"")

    def _written(self, _: object) -> None:
        self._writing = False
        if self._paused and self._open and not self._aborted and self.transport:
            self._paused = False
            self.transport.resumeProducing()  # type: ignore[attr-defined]
        if self._pending >= _WRITE_CHUNK or not self._open or self._aborted:
            self._flush()
        self._notify_idle()

    def _write_failed(self, failure: Failure) -> None:
        self._writing = False
        self._chunks = []
        self._abort()
        fire([self.done], failure)
        self._notify_idle()

    def _notify_idle(self) -> None:
        if not self._writing:
            waiters, self._idle_waiters = self._idle_waiters, []
            fire(waiters, None)

    def _abort(self) -> None:
        self._aborted = True
        if self._open and self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]

    async def quiesce(self) -> None:
        """Wait until no write to the sink is in flight (before closing it)."""
        while self._writing:
            waiter = Deferred[None]()
            self._idle_waiters.append(waiter)
            await waiter


def _open_for_upload(path: str, size: int) -> int:
    """A descriptor for positional reads of ``path``, still ``size`` bytes long. Thread only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != size:
            raise ObjectStoreError(f"{path} changed size while being uploaded")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_chunk(fd: int, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset``, fewer only at the end of the file. Thread only."""
    parts: list[bytes] = []
    while size > 0:
        data = os.pread(fd, size, offset)
        if not data:
            break
        parts.append(data)
        offset += len(data)
        size -= len(data)
    return b"".join(parts)


def rewind(f: IO[bytes]) -> None:
    f.seek(0)
    f.truncate()
