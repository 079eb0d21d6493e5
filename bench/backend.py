"""A deliberately fast HTTP/1.1 backend on a unix socket, so that benchmarks measure the proxy.

Plain asyncio protocol, no framework: every request costs a few microseconds, far less than any
proxy in front of it. Routes (any Host):

  GET /big?bytes=N        N bytes of zeros (Content-Length), written with flow control
  POST|PUT /upload        reads and counts the body (Content-Length or chunked); answers
                          {"received": N}
  GET /ws (Upgrade)       WebSocket echo: every data frame comes back with the same opcode
  GET /__bench/stats      {"connections", "requests", "body_bytes"} since start, not counting
                          this request: how often a proxy dialled, how much of a body arrived
  anything else           200 with a fixed small body (--body-size bytes, default 100), its
                          head minimal or as Node's http sends it (--head node-like)

Keep-alive and pipelining are supported; ``Connection: close`` is honoured.

    python bench/backend.py --socket /tmp/x/backend.sock
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import email.utils
import hashlib
import json
import os
import signal
import struct
import sys
from urllib.parse import parse_qs, urlsplit

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC11B85"
ZEROS = bytes(1 << 20)  # one shared 1 MiB chunk for /big
MAX_HEAD = 64 * 1024
# Counters for the harness (GET /__bench/stats); a dict increment costs nothing next to a request.
STATS = {"connections": 0, "requests": 0, "body_bytes": 0}


# The small answer's head: ``minimal`` (status, Content-Type, Content-Length), or ``node-like``,
# the head Node's http sends (captured from Node 20's ``res.writeHead(200, {...}); res.end(...)``:
# Date, ``Connection: keep-alive`` and ``Keep-Alive: timeout=5`` after the application's
# headers), whose hop-by-hop lines a proxy must take out. (Its Date is the start's: a proxy does
# the same work whatever it says.)
HEADS = ("minimal", "node-like")


def small_response(size: int, head_style: str = "minimal") -> bytes:
    body = (b"ok " + b"x" * max(0, size - 4) + b"\n")[: max(size, 1)]
    head = (
        b"HTTP/1.1 200 OK\r\n"
        b"Content-Type: text/plain\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n"
    )
    if head_style == "node-like":
        date = email.utils.formatdate(usegmt=True).encode()
        head += b"Date: " + date + b"\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n"
    return head + b"\r\n" + body


class Head:
    """A parsed request head: just what the routes need."""

    __slots__ = ("chunked", "close", "length", "method", "target", "upgrade", "ws_key")

    def __init__(self, raw: bytes) -> None:
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            raise ValueError("bad request line")
        self.method, self.target, version = parts
        self.close = version == b"HTTP/1.0"
        self.length = 0
        self.chunked = False
        self.upgrade = False
        self.ws_key = b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip()
            if name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()
            elif name == b"connection":
                tokens = {t.strip().lower() for t in value.split(b",")}
                if b"close" in tokens:
                    self.close = True
                elif b"keep-alive" in tokens:
                    self.close = False
            elif name == b"upgrade":
                self.upgrade = value.lower() == b"websocket"
            elif name == b"sec-websocket-key":
                self.ws_key = value


class HTTP(asyncio.Protocol):
    def __init__(self, small: bytes) -> None:
        self.small = small
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.sending = 0  # bytes of /big still to write
        self.after_big_close = False
        self.body_left = 0  # Content-Length body bytes still to consume
        self.chunked: bytearray | None = None  # raw chunked body not yet decoded
        self.received = 0
        self.pending: Head | None = None  # an upload whose body is being consumed
        self.ws: WebSocket | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=4 << 20)
        STATS["connections"] += 1

    def data_received(self, data: bytes) -> None:
        if self.ws is not None:
            self.ws.feed(data)
            return
        self.buf += data
        out: list[bytes] = []
        try:
            self._process(out)
        except ValueError:
            out.append(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            self._flush(out)
            self._close()
            return
        self._flush(out)

    def _flush(self, out: list[bytes]) -> None:
        if out and self.transport is not None:
            # One write per batch of pipelined requests: one syscall, not one per response.
            self.transport.write(b"".join(out))

    def _process(self, out: list[bytes]) -> None:
        while self.buf and self.transport is not None and not self.sending:
            if self.pending is not None:
                if not self._consume_body():
                    return
                head, self.pending = self.pending, None
                reply = json.dumps({"received": self.received}).encode()
                out.append(_json_response(reply, head.close))
                if head.close:
                    self._flush(out)
                    out.clear()
                    self._close()
                    return
                continue
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    raise ValueError("head too large")
                return
            head = Head(bytes(self.buf[:end]))
            del self.buf[: end + 4]
            STATS["requests"] += 1
            path = head.target.split(b"?", 1)[0]
            if head.length or head.chunked:
                # Any request with a body is counted (the upload route; others are not used).
                self.pending = head
                self.received = 0
                self.body_left = head.length
                self.chunked = bytearray() if head.chunked else None
                continue
            if path == b"/ws" and head.upgrade:
                self._flush(out)
                out.clear()
                self._upgrade(head)
                return
            if path == b"/__bench/stats":
                mine = {**STATS, "connections": STATS["connections"] - 1}
                mine["requests"] -= 1
                out.append(_json_response(json.dumps(mine).encode(), head.close))
            elif path == b"/ws":
                out.append(b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\n\r\n")
            elif path == b"/upload":
                out.append(_json_response(b'{"received": 0}', head.close))
            elif path == b"/big":
                self._flush(out)
                out.clear()
                self._start_big(head)
                return
            else:
                out.append(self.small)
            if head.close:
                self._flush(out)
                out.clear()
                self._close()
                return

    def _consume_body(self) -> bool:
        """Eat buffered body bytes; True once the whole body is in."""
        if self.chunked is None:
            take = min(self.body_left, len(self.buf))
            del self.buf[:take]
            self.body_left -= take
            self.received += take
            STATS["body_bytes"] += take
            return self.body_left == 0
        # chunked: <hex size>\r\n<data>\r\n ... 0\r\n\r\n
        while True:
            if self.body_left:
                take = min(self.body_left, len(self.buf))
                del self.buf[:take]
                self.body_left -= take
                self.received += take
                STATS["body_bytes"] += take
                if self.body_left:
                    return False
                continue
            line_end = self.buf.find(b"\r\n")
            if line_end < 0:
                return False
            line = bytes(self.buf[:line_end])
            if line == b"":  # the CRLF after a chunk's data
                del self.buf[:2]
                continue
            size = int(line.split(b";", 1)[0], 16)
            if size == 0:
                trailer_end = self.buf.find(b"\r\n\r\n", line_end)
                if trailer_end < 0:
                    return False
                del self.buf[: trailer_end + 4]
                return True
            del self.buf[: line_end + 2]
            self.body_left = size

    def _start_big(self, head: Head) -> None:
        query = parse_qs(urlsplit(head.target.decode("latin-1")).query)
        size = int(query.get("bytes", ["1048576"])[0])
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            b"Content-Length: " + str(size).encode() + b"\r\n\r\n"
        )
        self.sending = size
        self.after_big_close = head.close
        self._pump()

    def _pump(self) -> None:
        # Write until the transport says it is full; resume_writing() calls us again.
        transport = self.transport
        while self.sending and not self.paused and transport is not None:
            n = min(self.sending, len(ZEROS))
            transport.write(ZEROS if n == len(ZEROS) else ZEROS[:n])
            self.sending -= n
        if not self.sending and transport is not None and not self.paused:
            if self.after_big_close:
                self._close()
            elif self.buf:
                self.data_received(b"")

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.sending:
            self._pump()

    def _upgrade(self, head: Head) -> None:
        assert self.transport is not None
        accept = base64.b64encode(hashlib.sha1(head.ws_key + WS_GUID).digest())
        self.transport.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        self.ws = WebSocket(self.transport)
        rest, self.buf = bytes(self.buf), bytearray()
        if rest:
            self.ws.feed(rest)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def _json_response(body: bytes, close: bool) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + (b"\r\nConnection: close" if close else b"")
        + b"\r\n\r\n"
        + body
    )


class WebSocket:
    """Server side of RFC 6455, echo only: frames come back as they came, unmasked."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data
        while True:
            frame = parse_frame(self.buf)
            if frame is None:
                return
            fin_opcode, payload, used = frame
            del self.buf[:used]
            opcode = fin_opcode & 0x0F
            if opcode == 0x8:  # close: answer it and hang up
                self.transport.write(encode_frame(0x88, payload[:2]))
                self.transport.close()
                return
            if opcode == 0x9:  # ping -> pong
                self.transport.write(encode_frame(0x8A, payload))
            elif opcode != 0xA:  # text, binary, continuation: echo
                self.transport.write(encode_frame(fin_opcode, payload))


def parse_frame(buf: bytearray) -> tuple[int, bytes, int] | None:
    """(first byte, unmasked payload, bytes used) or None if the frame is not complete."""
    if len(buf) < 2:
        return None
    first, second = buf[0], buf[1]
    length = second & 0x7F
    pos = 2
    if length == 126:
        if len(buf) < 4:
            return None
        length = struct.unpack_from("!H", buf, 2)[0]
        pos = 4
    elif length == 127:
        if len(buf) < 10:
            return None
        length = struct.unpack_from("!Q", buf, 2)[0]
        pos = 10
    mask = b""
    if second & 0x80:
        mask = bytes(buf[pos : pos + 4])
        pos += 4
    if len(buf) < pos + length:
        return None
    payload = bytes(buf[pos : pos + length])
    if mask:
        payload = unmask(payload, mask)
    return first, payload, pos + length


def unmask(payload: bytes, mask: bytes) -> bytes:
    # XOR with the mask repeated, as one big integer: fast enough without numpy.
    key = (mask * (len(payload) // 4 + 1))[: len(payload)]
    n = int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")
    return n.to_bytes(len(payload), "big")


def encode_frame(first: int, payload: bytes, mask: bytes = b"") -> bytes:
    length = len(payload)
    mask_bit = 0x80 if mask else 0
    if length < 126:
        head = struct.pack("!BB", first, mask_bit | length)
    elif length < 1 << 16:
        head = struct.pack("!BBH", first, mask_bit | 126, length)
    else:
        head = struct.pack("!BBQ", first, mask_bit | 127, length)
    if mask:
        return head + mask + unmask(payload, mask)
    return head + payload


async def serve(path: str, body_size: int, head_style: str = "minimal") -> None:
    small = small_response(body_size, head_style)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: HTTP(small), path, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"backend listening on {path}", file=sys.stderr, flush=True)
    async with server:
        await stop.wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="unix socket path to listen on")
    parser.add_argument("--body-size", type=int, default=100, help="small response body bytes")
    parser.add_argument(
        "--head",
        choices=HEADS,
        default="minimal",
        help="the small answer's head: minimal (status, Content-Type, Content-Length) or "
        "node-like (as Node's http: Date, Connection: keep-alive, Keep-Alive: timeout=5 too)",
    )
    args = parser.parse_args()
    asyncio.run(serve(args.socket, args.body_size, args.head))


if __name__ == "__main__":
    main()
