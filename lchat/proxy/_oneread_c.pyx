# cython: language_level=3, boundscheck=False, wraparound=False
"""lchat.proxy.oneread's recognisers as byte scanners in C (optional; oneread.py is the reference).

``request`` and ``response`` accept exactly what oneread.py's patterns accept (its ``request`` and
``response`` when this module is not built) and return the same values (tests/test_proxy_oneread.py
compares them on generated inputs): one pass over the head instead of the patterns, the lowered
copy and the findall list.

The names they decline are not written here: oneread.py hands them over (``configure``), made from
the header policy's shared sets (lchat.proxy.http). Until then both decline everything.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcmp, memcpy

# The form of the answers (oneread.API must match: it does not use a build of another form).
# 2: ``response`` returns (status, body length, the bytes the client gets).
# 3: ``request`` takes ``Connection: close`` too (WholeRequest's sixth field, ``close``).
API = 3

WholeRequest = None  # set by configure (oneread.py's NamedTuple)

cdef enum:
    MAX_NAMES = 32


cdef struct Names:
    Py_ssize_t count
    const char* name[MAX_NAMES]  # lower case
    Py_ssize_t size[MAX_NAMES]


# Declined by name (request, response), or by any of these prefixes; each name a pointer into a
# bytes object kept alive in _configured.
cdef Names REQUEST_NAMES, RESPONSE_NAMES, PREFIXES
cdef bint CONFIGURED = False
cdef list _configured = []


cdef void _fill(Names* names, tuple values) except *:
    if len(values) > MAX_NAMES:
        raise ValueError(f"more than {MAX_NAMES} declined names")
    names.count = len(values)
    for k, value in enumerate(values):
        names.name[k] = PyBytes_AS_STRING(value)
        names.size[k] = PyBytes_GET_SIZE(value)


def configure(whole_request, tuple request_names, tuple response_names, tuple prefixes):
    """The NamedTuple ``request`` returns, the header names each recogniser declines (lower
    case), and the name prefixes both decline."""
    global WholeRequest, CONFIGURED
    values = (request_names, response_names, prefixes)
    for group in values:
        for value in group:
            if type(value) is not bytes or value != value.lower():
                raise ValueError(f"not a lower-case bytes name: {value!r}")
    _configured[:] = values
    _fill(&REQUEST_NAMES, request_names)
    _fill(&RESPONSE_NAMES, response_names)
    _fill(&PREFIXES, prefixes)
    WholeRequest = whole_request
    CONFIGURED = True

# RFC 9110 token characters.
cdef unsigned char TOKEN[256]
cdef int _i
for _i in range(256):
    TOKEN[_i] = 0
cdef bytes _TOKENS = b"!#$%&'*+.^_`|~-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
cdef const unsigned char* _t = <const unsigned char*>PyBytes_AS_STRING(_TOKENS)
for _i in range(PyBytes_GET_SIZE(_TOKENS)):
    TOKEN[_t[_i]] = 1


cdef inline unsigned char low(unsigned char c) noexcept nogil:
    return c + 32 if 65 <= c <= 90 else c


cdef inline bint name_is(const unsigned char* p, Py_ssize_t n, const char* lit, Py_ssize_t m) noexcept nogil:
    """The name p[:n], lowered, is ``lit`` (lower case, m bytes)."""
    cdef Py_ssize_t k
    if n != m:
        return False
    for k in range(m):
        if low(p[k]) != <unsigned char>lit[k]:
            return False
    return True


cdef inline bint name_starts(const unsigned char* p, Py_ssize_t n, const char* lit, Py_ssize_t m) noexcept nogil:
    cdef Py_ssize_t k
    if n < m:
        return False
    for k in range(m):
        if low(p[k]) != <unsigned char>lit[k]:
            return False
    return True


cdef inline Py_ssize_t field_line(const unsigned char* p, Py_ssize_t i, Py_ssize_t n,
                                  Py_ssize_t* colon) noexcept nogil:
    """A field line at ``i`` (token, colon, visible ASCII and spaces, CRLF): the index after its
    CRLF, its colon's index in ``colon``; -1 if it is not one."""
    cdef Py_ssize_t start = i
    while i < n and TOKEN[p[i]]:
        i += 1
    if i == start or i >= n or p[i] != 58:  # ':'
        return -1
    colon[0] = i
    i += 1
    while i < n and 32 <= p[i] <= 126:
        i += 1
    if i + 1 >= n or p[i] != 13 or p[i + 1] != 10:
        return -1
    return i + 2


cdef inline bint has_underscore(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(n):
        if p[k] == 95:
            return True
    return False


cdef inline bint declined(const unsigned char* p, Py_ssize_t n, const Names* names) noexcept nogil:
    """The name p[:n] is declined: underscored, one of ``names``, or with one of PREFIXES."""
    cdef Py_ssize_t k
    if has_underscore(p, n):
        return True
    for k in range(names.count):
        if name_is(p, n, names.name[k], names.size[k]):
            return True
    for k in range(PREFIXES.count):
        if name_starts(p, n, PREFIXES.name[k], PREFIXES.size[k]):
            return True
    return False


cdef inline bint spliced_token(const unsigned char* p, Py_ssize_t v, Py_ssize_t e,
                               Py_ssize_t* after) noexcept nogil:
    """p[v:e] starts with keep-alive or upgrade (any case; lchat.proxy.http's
    RESPONSE_SPLICED_TOKENS): the index after it in ``after``."""
    if name_starts(p + v, e - v, b"keep-alive", 10):
        after[0] = v + 10
        return True
    if name_starts(p + v, e - v, b"upgrade", 7):
        after[0] = v + 7
        return True
    return False


cdef inline bint spliced_connection(const unsigned char* p, Py_ssize_t colon, Py_ssize_t end) noexcept nogil:
    """The value after ``colon`` up to the CRLF ending at ``end`` is
    ' *token *(, *token *)*' with each token keep-alive or upgrade (any case)."""
    cdef Py_ssize_t v = colon + 1
    cdef Py_ssize_t e = end - 2
    while v < e and p[v] == 32:
        v += 1
    if not spliced_token(p, v, e, &v):
        return False
    while True:
        while v < e and p[v] == 32:
            v += 1
        if v == e:
            return True
        if p[v] != 44:  # ','
            return False
        v += 1
        while v < e and p[v] == 32:
            v += 1
        if not spliced_token(p, v, e, &v):
            return False


def response(bytes data not None):
    """oneread.response: ``(status, body length, what the client gets)`` or ``None``."""
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t i, line, colon = 0, nlen, v, d0, d1, k, at, total, first
    cdef int status
    cdef long long size = -1
    cdef int found = 0
    # The lines taken out (RESPONSE_SPLICED), by name: connection, keep-alive, upgrade.
    cdef Py_ssize_t cut0[3]
    cdef Py_ssize_t cut1[3]
    cdef int cuts = 0
    cdef char* o
    cut0[0] = cut0[1] = cut0[2] = -1
    if not CONFIGURED or n < 13 or memcmp(p, b"HTTP/1.1 ", 9) != 0:
        return None
    if not (50 <= p[9] <= 53 and 48 <= p[10] <= 57 and 48 <= p[11] <= 57 and p[12] == 32):
        return None
    status = (p[9] - 48) * 100 + (p[10] - 48) * 10 + (p[11] - 48)
    i = 13
    while i < n and 32 <= p[i] <= 126:
        i += 1
    if i + 1 >= n or p[i] != 13 or p[i + 1] != 10:
        return None
    i += 2
    while True:
        if i + 1 < n and p[i] == 13 and p[i + 1] == 10:
            i += 2  # the empty line: the head ends
            break
        line = i
        i = field_line(p, i, n, &colon)
        if i < 0:
            return None
        nlen = colon - line
        if name_is(p + line, nlen, b"content-length", 14):
            found += 1
            # ' *([0-9]{1,18}) *' up to the CRLF, else a Content-Length we decline
            v = colon + 1
            while p[v] == 32:
                v += 1
            d0 = v
            while 48 <= p[v] <= 57:
                v += 1
            d1 = v
            while p[v] == 32:
                v += 1
            if d1 == d0 or d1 - d0 > 18 or v != i - 2:
                return None
            size = 0
            for v in range(d0, d1):
                size = size * 10 + (p[v] - 48)
        elif name_is(p + line, nlen, b"connection", 10) and spliced_connection(p, colon, i):
            if cut0[0] >= 0:
                return None  # two lines of one name
            cut0[0], cut1[0] = line, i
            cuts += 1
        elif name_is(p + line, nlen, b"keep-alive", 10):
            if cut0[1] >= 0:
                return None
            cut0[1], cut1[1] = line, i
            cuts += 1
        elif name_is(p + line, nlen, b"upgrade", 7):
            if cut0[2] >= 0:
                return None
            cut0[2], cut1[2] = line, i
            cuts += 1
        elif declined(p + line, nlen, &RESPONSE_NAMES):
            return None
    if found != 1 or size < 0:
        return None
    if i + size != n or status == 204 or status == 304:
        return None
    if cuts == 0:
        return status, size, data
    # The read without the lines taken out, in their order.
    total = n
    for k in range(3):
        if cut0[k] >= 0:
            total -= cut1[k] - cut0[k]
    out = PyBytes_FromStringAndSize(NULL, total)
    o = PyBytes_AS_STRING(out)
    at = 0
    while True:
        first = -1
        for k in range(3):
            if cut0[k] >= at and (first < 0 or cut0[k] < cut0[first]):
                first = k
        if first < 0:
            break
        memcpy(o, p + at, cut0[first] - at)
        o += cut0[first] - at
        at = cut1[first]
    memcpy(o, p + at, n - at)
    return status, size, out


cdef inline int connection_line(const unsigned char* p, Py_ssize_t colon, Py_ssize_t end) noexcept nogil:
    """The value after ``colon`` up to the CRLF ending at ``end``: 1 if it is ' *keep-alive *',
    2 if ' *close *' (any case), else 0."""
    cdef Py_ssize_t v = colon + 1
    cdef Py_ssize_t e = end - 2
    cdef int which
    while v < e and p[v] == 32:
        v += 1
    if e - v >= 10 and name_starts(p + v, e - v, b"keep-alive", 10):
        which = 1
        v += 10
    elif e - v >= 5 and name_starts(p + v, e - v, b"close", 5):
        which = 2
        v += 5
    else:
        return 0
    while v < e and p[v] == 32:
        v += 1
    return which if v == e else 0


def request(bytes data not None, Py_ssize_t max_bytes, Py_ssize_t max_headers, previous=None):
    """oneread.request: a WholeRequest or ``None``."""
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t i, m, t0, t1, head_start, line, colon = 0, nlen
    cdef Py_ssize_t lines = 0, drop0 = -1, drop1 = -1, host0 = -1, host1 = -1
    cdef Py_ssize_t te0 = -1, te1 = -1, a0, a1, b0, b1
    cdef int connection
    cdef bint close = False
    cdef bytes block, prev_block, prev_target
    cdef tuple prev
    if not CONFIGURED or n > max_bytes:
        return None
    if n >= 4 and memcmp(p, b"GET ", 4) == 0:
        m = 3
    elif n >= 5 and memcmp(p, b"HEAD ", 5) == 0:
        m = 4
    else:
        return None
    t0 = m + 1
    if t0 >= n or p[t0] != 47:  # '/'
        return None
    i = t0 + 1
    while i < n and 33 <= p[i] <= 126:
        i += 1
    t1 = i
    if n - i < 11 or memcmp(p + i, b" HTTP/1.1\r\n", 11) != 0:
        return None
    head_start = i + 11
    method = b"GET" if m == 3 else b"HEAD"
    if isinstance(previous, tuple) and len(<tuple>previous) == 6:
        # (A WholeRequest is a tuple: its fields by index, without an attribute lookup each.)
        prev = <tuple>previous
        prev_block = <bytes>prev[4]
        if n - head_start == PyBytes_GET_SIZE(prev_block) and memcmp(
            p + head_start, PyBytes_AS_STRING(prev_block), n - head_start
        ) == 0:
            prev_target = <bytes>prev[1]
            if (
                prev[0] == method
                and PyBytes_GET_SIZE(prev_target) == t1 - t0
                and memcmp(p + t0, PyBytes_AS_STRING(prev_target), t1 - t0) == 0
            ):
                return previous  # (the same request again: nothing made, nothing copied)
            return WholeRequest(method, data[t0:t1], prev[2], prev[3], prev_block, prev[5])
    target = data[t0:t1]
    i = head_start
    while True:
        if i + 1 < n and p[i] == 13 and p[i + 1] == 10:
            i += 2
            break
        line = i
        i = field_line(p, i, n, &colon)
        if i < 0:
            return None
        lines += 1
        nlen = colon - line
        if name_is(p + line, nlen, b"host", 4):
            if host0 >= 0:
                return None  # two Hosts
            host0 = colon + 1
            host1 = i - 2
        elif name_is(p + line, nlen, b"connection", 10):
            if drop0 >= 0:
                return None
            connection = connection_line(p, colon, i)
            if connection == 0:
                return None
            close = connection == 2
            drop0, drop1 = line, i
        elif name_is(p + line, nlen, b"te", 2):
            if te0 >= 0:
                return None  # two TE lines
            te0, te1 = line, i
        elif declined(p + line, nlen, &REQUEST_NAMES):
            return None
    if i != n or lines > max_headers or host0 < 0:
        return None
    while host0 < host1 and p[host0] == 32:
        host0 += 1
    while host1 > host0 and p[host1 - 1] == 32:
        host1 -= 1
    host = data[host0:host1].lower()
    block = data[head_start:]
    if te0 >= 0 and drop0 < 0:
        drop0, drop1, te0 = te0, te1, -1
    if drop0 < 0:
        header_lines = data[head_start : n - 2]
    elif te0 < 0:
        header_lines = data[head_start:drop0] + data[drop1 : n - 2]
    else:  # both lines taken out, in their order
        a0, a1, b0, b1 = (drop0, drop1, te0, te1) if drop0 < te0 else (te0, te1, drop0, drop1)
        header_lines = data[head_start:a0] + data[a1:b0] + data[b1 : n - 2]
    return WholeRequest(method, target, host, header_lines, block, close)
