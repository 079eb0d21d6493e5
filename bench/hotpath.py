"""The router's own Python per proxied request, with no sockets and no kernel in the figure.

Drives the real ``Downstream`` and ``UpstreamConnection`` in memory (transports that only count
writes, a pooled upstream connection, a router that names one local socket): a client's request in
one read, the space's whole response in one read, over and over on one kept-alive connection. Two
request shapes: wrk's (``Host`` only) and a browser's (11 header lines, cookies, ``Connection:
keep-alive``). The anchor, in the same run, is the proxy's general path (the one-read recognisers
of ``lchat/proxy/oneread.py`` switched off): the ratio is what the short path saves.

    .venv/bin/python bench/hotpath.py [--requests 20000] [--rounds 7]
        [--response all|minimal|nginx|node-like]

The space's answer has a minimal head, or the head nginx or Node's http sends (with
``Connection: keep-alive``/``Keep-Alive``, which the proxy takes out): each row says which.

Prints the best round of each (the least disturbed by the rest of the machine), in µs of this
process's CPU time per request (time spent waiting for a core on a busy machine is not in it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from twisted.internet.task import Clock

from lchat.config import ProxyConfig
from lchat.proxy import HOT, oneread
from lchat.proxy.downstream import ProxyFactory
from lchat.proxy.upstream import UpstreamConnection, UpstreamPool, target_key
from lchat.router import LocalSocket, RequestHead, Target

HOST = b"bench.localhost"
REQUESTS = {
    "wrk": b"GET / HTTP/1.1\r\nHost: bench.localhost\r\n\r\n",
    "browser": (
        b"GET /api/messages?after=123 HTTP/1.1\r\nHost: bench.localhost\r\n"
        b"User-Agent: Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 Chrome/120\r\n"
        b"Accept: application/json\r\nAccept-Language: en-US,en;q=0.9\r\n"
        b"Accept-Encoding: gzip, deflate, br\r\nReferer: https://bench.localhost/\r\n"
        b"Cookie: _ga=GA1.2.3; session=abcdef0123456789\r\nSec-Fetch-Site: same-origin\r\n"
        b"Sec-Fetch-Mode: cors\r\nSec-Fetch-Dest: empty\r\nConnection: keep-alive\r\n\r\n"
    ),
}
BODY = b"x" * 100
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: backend\r\nContent-Type: text/plain\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
# The space's answer: a minimal head, or the heads nginx and Node's http send (their hop-by-hop
# lines taken out on the way: tests/test_proxy_oneread.py has the captures these follow).
RESPONSES = {
    "minimal": RESPONSE,
    "nginx": (
        b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Sat, 05 Dec 2026 15:37:49 GMT\r\n"
        b"Content-Type: text/plain\r\nContent-Length: %d\r\nConnection: keep-alive\r\n\r\n%s"
        % (len(BODY), BODY)
    ),
    "node-like": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
        b"Date: Sat, 05 Dec 2026 15:37:50 GMT\r\nConnection: keep-alive\r\n"
        b"Keep-Alive: timeout=5\r\n\r\n%s" % (len(BODY), BODY)
    ),
}


class CountingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: Any) -> None:
        self.writes += 1

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 50000) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class OneSpace:
    def __init__(self) -> None:
        self.target = LocalSocket(host=HOST.decode(), path="/nonexistent/bench.sock")

    def route(self, head: RequestHead) -> Target:
        return self.target


def per_request(request: bytes, count: int, rounds: int, response: bytes = RESPONSE) -> float:
    """Best round's µs of CPU per request through a fresh proxy and connection."""
    clock = Clock()
    routes = OneSpace()
    pool = UpstreamPool(clock)
    factory = ProxyFactory(clock, routes, ProxyConfig(), pool=pool)
    upstream = UpstreamConnection(pool, target_key(routes.target))
    upstream.connection_made(CountingTransport())
    pool.release(upstream)
    client = factory()
    client_transport = CountingTransport()
    client.connection_made(client_transport)

    def one() -> None:
        client.data_received(request)
        upstream.data_received(response)

    for _ in range(2000):
        one()
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(count):
            one()
        best = min(best, (time.process_time() - start) / count * 1e6)
    assert client_transport.writes >= count, "the responses did not reach the client"
    client.connection_lost(None)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--response",
        choices=["all", *RESPONSES],
        default="all",
        help="the space's answer's head: minimal, as nginx or as Node's http sends it (all: each)",
    )
    args = parser.parse_args()
    print(f"hot path: {HOT}\n")
    print("| request | response | one-read path µs/req | general path µs/req | ratio |")
    print("|---|---|---|---|---|")
    saved = oneread.request, oneread.response
    heads = list(RESPONSES) if args.response == "all" else [args.response]
    for name, request in REQUESTS.items():
        for head in heads:
            response = RESPONSES[head]
            short = per_request(request, args.requests, args.rounds, response)
            oneread.request = lambda *a, **k: None
            oneread.response = lambda *a, **k: None
            try:
                general = per_request(request, args.requests, args.rounds, response)
            finally:
                oneread.request, oneread.response = saved
            print(f"| {name} | {head} | {short:.2f} | {general:.2f} | {short / general:.2f}x |")


if __name__ == "__main__":
    main()
