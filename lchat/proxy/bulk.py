"""Bulk bodies read into buffers of our own (``asyncio.BufferedProtocol``), not a new ``bytes`` per read.

uvloop hands a plain Protocol each read (up to 256 KiB) as a new ``bytes``: a heap allocation and a
copy out of its own read buffer, per read. While a ``Content-Length`` body with at least
:data:`MIN_BULK` bytes still to come streams from one side to the other, the reading side's
transport gets a :class:`BulkReader` instead: uvloop reads (``recv_into``) straight into
:class:`Buffers`' current buffer, and the owner writes a slice of it to the other transport.

One set of buffers (the front door's, lchat.proxy.state) serves every connection of the process: uvloop calls ``get_buffer``, reads, and
calls ``buffer_updated`` in one go, and what a read brought is written on before
``buffer_updated`` returns. Only one thing keeps a reference past that: **uvloop's ``write`` does
not copy what it could not send at once**: it keeps a memoryview of it (``UVStream._buffer_write``
casts any non-``bytes`` object to a memoryview; a partial ``_try_write`` keeps ``data[sent:]``;
``uv_write`` holds the Py_buffer until the write completes). So after each write the owner asks the
transport for its unsent size, and when anything is left, :meth:`Buffers.lend` sets the buffer aside
until its bytes are sent (the unsent output is at most what was written after them), and the next
read goes into another one: one set aside before and sent since, or a new one (a handful in all).

Anything but the plain middle of such a body (its last read, a read the owner cannot take this
way) puts the owner back as the transport's protocol and hands it the read as ``bytes``, exactly as
uvloop would have: the general code does what it always did.
"""

from __future__ import annotations

import asyncio
from typing import Any
from typing import Protocol as TypingProtocol

READ_SIZE = 1024 * 1024  # up to 1 MiB a read: a quarter of the reads (uvloop reads 256 KiB)
MIN_BULK = 256 * 1024  # a body with less than this still to come stays on the general path
MAX_LENT = 32  # buffers tracked while lent; beyond, the oldest is left to uvloop (and the GC)


class Sink(TypingProtocol):
    """What a bulk read is written to: counts the bytes it wrote that way (``bulk_written``)."""

    bulk_written: int


class Buffers:
    """The process's read buffers: ``view`` is the current one."""

    __slots__ = ("_array", "_lent", "allocated", "lent_count", "view")

    def __init__(self) -> None:
        self._array = bytearray(READ_SIZE)
        self.view = memoryview(self._array)
        # (transport, sink, buffer, end): the transport may still hold unsent bytes of the
        # buffer, the last of which was byte ``end`` of what ``sink`` wrote the bulk way.
        self._lent: list[tuple[Any, Sink, bytearray, int]] = []
        self.allocated = 1
        self.lent_count = 0

    def lend(self, transport: Any, sink: Sink) -> None:
        """The current buffer was just written to ``transport`` (``sink.bulk_written`` counts it)
        and some of it is still unsent: keep it aside until it is sent; read into another from
        now on: one lent before whose bytes are all sent, or a new one.

        Sent, for sure: the transport's unsent output is the *last* bytes written to it (FIFO),
        so when it is no more than what ``sink`` wrote after a buffer's end, the buffer is out.
        (Writes to it not counted in ``bulk_written`` only make the test stricter.)"""
        lent = self._lent
        lent.append((transport, sink, self._array, sink.bulk_written))
        self.lent_count += 1
        array = None
        for i in range(len(lent) - 1):
            t, s, a, end = lent[i]
            if t.get_write_buffer_size() <= s.bulk_written - end:
                array = a
                del lent[i]
                break
        if array is None:
            if len(lent) > MAX_LENT:
                del lent[0]
            array = bytearray(READ_SIZE)
            self.allocated += 1
        self._array = array
        self.view = memoryview(array)


class BulkOwner(TypingProtocol):
    def bulk_received(self, nbytes: int) -> None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def eof_received(self) -> bool | None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...


class BulkReader(asyncio.BufferedProtocol):
    """The transport's protocol while a bulk body streams: reads go into ``buffers``' current
    one; every other callback goes to the owner, as if it were the protocol."""

    __slots__ = ("buffers", "owner")

    def __init__(self, owner: BulkOwner, buffers: Buffers) -> None:
        self.owner = owner
        self.buffers = buffers

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffers.view

    def buffer_updated(self, nbytes: int) -> None:
        self.owner.bulk_received(nbytes)

    def eof_received(self) -> bool | None:
        return self.owner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.owner.pause_writing()

    def resume_writing(self) -> None:
        self.owner.resume_writing()
