# cython: language_level=3
"""A prototype, not the router: the one-read exchange as Cython ``cdef class``es (the hot state in
typed fields), doing the per-request work of lchat's one-read path for a repeated request on a
kept-alive connection: the request recognised by lchat's recogniser (and reused when it repeats),
routed by a dict lookup, an exchange record made, the upstream head (X-Forwarded-For/-Proto) written
to a pooled upstream connection, the response recognised and spliced by lchat's recogniser, written
back, the upstream released to the pool, counters kept. No general path: anything else is dropped.

What it answers (docs/performance.md, "Issue 33: the floor under the router"): how much of the
router's 3.5 µs per request above the floor relay (bench/floor_relay.py) a compiled exchange would
leave. Run by ``bench/proxy_vs_nginx.py --prototype`` (bench/compiled_exchange.py builds it).
"""
import asyncio
from libc.time cimport time as ctime
from lchat.proxy import oneread
from lchat.proxy.exchange import plain_upstream_head

cdef object recognise_request = oneread.request
cdef object recognise_response = oneread.response

cdef class Stats:
    cdef public long requests, one_read, spliced, bytes_down, in_flight

cdef class Ex:
    cdef public object method, head, target, upstream
    cdef public double started, deadline
    cdef public bint keep_alive, body_complete
    cdef public int status
    cdef public long bytes_out

cdef class Pool:
    cdef public list idle
    cdef public str path
    cdef public object loop
    def __init__(self, path, loop):
        self.idle = []
        self.path = path
        self.loop = loop

cdef class Upstream:
    cdef public object transport
    cdef public Client client
    cdef public Pool pool
    cdef public bint reusable
    def __init__(self, Pool pool):
        self.pool = pool
        self.reusable = True
    def connection_made(self, t):
        self.transport = t
    def data_received(self, bytes data):
        cdef Client c = self.client
        if c is None:
            self.reusable = False
            return
        whole = recognise_response(data)
        if whole is None:
            c.transport.write(data)  # (prototype: no general path)
            return
        status, length, out = whole
        c.finish(<int>status, <long>length, out, data)
        self.client = None
        self.pool.idle.append(self)
    def connection_lost(self, exc):
        try:
            self.pool.idle.remove(self)
        except ValueError:
            pass
    def eof_received(self):
        return False

cdef class Client:
    cdef public object transport
    cdef object last_whole, last_request, last_head
    cdef bytes client_bytes
    cdef Pool pool
    cdef dict routes
    cdef Stats stats
    cdef Ex active
    cdef public long served
    cdef double deadline
    cdef list early
    def __init__(self, Pool pool, dict routes, Stats stats):
        self.pool = pool
        self.routes = routes
        self.stats = stats
        self.early = []
    def connection_made(self, t):
        self.transport = t
        peer = t.get_extra_info("peername")
        self.client_bytes = str(peer[0]).encode("latin-1")
    def data_received(self, bytes data):
        cdef Ex ex
        cdef Upstream up
        if self.active is not None or not data.endswith(b"\r\n\r\n"):
            return  # (prototype: no general path)
        whole = recognise_request(data, 65536, 100, self.last_whole)
        if whole is None:
            return
        if whole is not self.last_whole or self.last_head is None:
            self.last_whole = whole
            self.last_head = self.routes.get(whole.host)
            self.last_request = plain_upstream_head(
                whole.method, whole.target, whole.lines, self.client_bytes, b"http")
        ex = Ex()
        ex.started = ctime(NULL)
        ex.method = whole.method
        ex.keep_alive = not whole.close
        ex.body_complete = True
        ex.head = self.last_head
        self.active = ex
        self.stats.in_flight += 1
        idle = self.pool.idle
        if idle:
            up = idle.pop()
            up.client = self
            ex.upstream = up
            up.transport.write(self.last_request)
            self.deadline = ex.started + 60.0
        else:
            self.early.append(self.last_request)
            asyncio.get_event_loop().create_task(self.dial())
    async def dial(self):
        cdef Upstream up
        loop = asyncio.get_event_loop()
        _, up = await loop.create_unix_connection(lambda: Upstream(self.pool), self.pool.path)
        up.client = self
        self.active.upstream = up
        for d in self.early:
            up.transport.write(d)
        self.early.clear()
    cdef finish(self, int status, long length, bytes out, bytes data):
        cdef Ex ex = self.active
        cdef Stats st = self.stats
        ex.status = status
        ex.bytes_out = length
        st.bytes_down += length
        st.one_read += 1
        if out is not data:
            st.spliced += 1
        self.transport.write(out)
        ex.upstream = None
        self.active = None
        self.served += 1
        st.in_flight -= 1
        st.requests += 1
        self.deadline = ex.started + 75.0
    def connection_lost(self, exc):
        self.transport = None

def serve_factory(str path, loop):
    pool = Pool(path, loop)
    routes = {"bench.localhost": ("bench.localhost", path)}
    stats = Stats()
    return lambda: Client(pool, routes, stats)
