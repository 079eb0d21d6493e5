"""Runs the compiled-exchange prototype (bench/exchange_cdef.pyx) as a proxy on 127.0.0.1:PORT
in front of one backend's unix socket, for ``bench/proxy_vs_nginx.py --prototype``. It builds the
prototype on first use with Cython's ``pyximport`` (``.venv/bin/pip install cython``).

    compiled_exchange.py --port PORT --upstream /path/to/backend.sock
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # lchat, for its recognisers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the backend's unix socket")
    args = parser.parse_args()
    try:
        import pyximport
    except ImportError:
        sys.exit("the compiled-exchange prototype needs Cython: .venv/bin/pip install cython")
    pyximport.install(language_level=3)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import exchange_cdef  # type: ignore[import-not-found]

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        factory = exchange_cdef.serve_factory(args.upstream, loop)
        server = await loop.create_server(factory, "127.0.0.1", args.port, backlog=4096)
        print(f"compiled-exchange prototype on 127.0.0.1:{args.port}", flush=True)
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
