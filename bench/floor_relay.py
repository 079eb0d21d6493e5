"""The floor under any proxy written in Python on uvloop: a relay that copies bytes between each
client connection and one upstream connection of its own, and does nothing else (no parsing,
no routing, no headers added or taken out, no pool, no deadlines, no metrics).

``bench/proxy_vs_nginx.py --floor`` runs it beside nginx and the router, on the same backend and
the same wrk load: the router's CPU per request above this relay's is what its HTTP work costs
(almost all of it in the interpreter: the relay makes the same system calls per request), and
this relay's against nginx's is what uvloop and the kernel cost on their own. Not a proxy to use:
it relays a request as it came, ``Host`` and all, and closes both sides when either does.

    floor_relay.py --port PORT --upstream /path/to/backend.sock
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop


class Upstream(asyncio.Protocol):
    __slots__ = ("client", "transport")

    def __init__(self, client: Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        client = self.client.transport
        if client is not None:
            client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client.transport is not None:
            self.client.transport.close()


class Client(asyncio.Protocol):
    __slots__ = ("early", "transport", "upstream")

    def __init__(self, path: str) -> None:
        self.transport: asyncio.Transport | None = None
        self.upstream: Upstream | None = None
        self.early: list[bytes] = []  # what came before the upstream connection was made
        asyncio.get_running_loop().create_task(self._dial(path))

    async def _dial(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_unix_connection(lambda: Upstream(self), path)
        self.upstream = upstream
        assert upstream.transport is not None
        for data in self.early:
            upstream.transport.write(data)
        self.early.clear()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        upstream = self.upstream
        if upstream is None or upstream.transport is None:
            self.early.append(data)
        else:
            upstream.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()


async def serve(port: int, upstream: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(upstream), "127.0.0.1", port, backlog=4096)
    print(f"floor relay on 127.0.0.1:{port} -> {upstream}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the backend's unix socket")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()
