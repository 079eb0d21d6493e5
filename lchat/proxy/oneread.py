"""Requests and responses that arrive whole in one read, recognised without the general parser.

Most traffic through a router is small: a request head without a body, answered by a response
whose head and body come in one read. For those the proxy's general path (httptools with a Python
callback per element, then our checks) costs more than everything else on the request's path
together (docs/performance.md). Here each is recognised by one compiled pattern instead.

The invariant that makes this safe: **these recognisers accept a strict subset of what the general
path accepts, and for that subset the proxy does exactly what the general path would**. Anything
unusual — another method, a body, HTTP/1.0, a tab or a byte over 0x7e anywhere, a header the proxy
drops or rewrites, two messages in one read, a response not all here — is declined (``None``) and
goes the general way, which decides (and refuses) as it always did. The one exception to "a
header the proxy drops" is the lines both paths take out the same way, leaving every other byte
as it came: a request's ``Connection: keep-alive`` or ``Connection: close`` (then the
connection closes after the answer, which says so) and ``TE``, a response's keep-alive lines
(lchat.proxy.http.RESPONSE_SPLICED). ``tests/test_proxy_oneread.py`` holds both paths to that,
including on generated inputs and on heads real servers send.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from lchat.proxy.http import (
    REQUEST_SPECIAL,
    RESPONSE_SPECIAL,
    RESPONSE_SPLICED,
    RESPONSE_SPLICED_TOKENS,
    SPECIAL_PREFIXES,
)

# RFC 9110 §5.6.2 token characters: a header name.
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]++"
# A field line as the recognisers take it: a token, a colon, then visible ASCII and spaces only
# (no tab, no obs-text, no control byte), ending in CRLF.
_LINE = _TOKEN + rb":[ -~]*+\r\n"
# (The repeats are possessive, ``*+``: each stops at a byte the next element cannot start with
# (a token at its colon, a value at its CR, the lines at the empty line's CR), so backtracking
# could never find another match: the same language, matched without saving a backtrack point.)

# GET or HEAD (they carry no body unless a framing header says so, and then we decline), an
# origin-form target of visible ASCII, HTTP/1.1 exactly.
_REQUEST_LINE = re.compile(rb"(GET|HEAD) (/[!-~]*+) HTTP/1\.1\r\n")
# The rest of the read: field lines and the empty line, nothing after it (one message).
_HEADERS = re.compile(rb"(?:" + _LINE + rb")*+\r\n")


def declined_names(special: frozenset[bytes]) -> tuple[bytes, ...]:
    """The names of a shared set (lchat.proxy.http) the recognisers look for one by one: those
    that no prefix of ``SPECIAL_PREFIXES`` covers (the prefixes are looked for as such)."""
    return tuple(sorted(n for n in special if not n.startswith(SPECIAL_PREFIXES)))


REQUEST_DECLINED = declined_names(REQUEST_SPECIAL)
RESPONSE_DECLINED = declined_names(RESPONSE_SPECIAL)


def _alternation(alternatives: list[bytes]) -> bytes:
    """Regex fragments (each starting with a literal letter) as one alternation, those with the
    same first letter grouped behind it, in their order: the scan then tries one byte per line
    where the alternatives do not start, not each literal."""
    groups: dict[bytes, list[bytes]] = {}
    for alternative in alternatives:
        groups.setdefault(alternative[:1], []).append(alternative)
    return b"|".join(
        group[0] if len(group) == 1 else first + b"(?:" + b"|".join(a[1:] for a in group) + b")"
        for first, group in groups.items()
    )


_PREFIXES = [re.escape(prefix) for prefix in SPECIAL_PREFIXES]
# A name with an underscore (lowercased: the token characters without "_", then one).
_UNDERSCORED = rb"[!#$%&'*+.^`|~0-9a-z-]*_"

# Request header names (lowercased, after a newline) that the general path drops, rewrites, reads
# for framing, or refuses: declined here. One ``Connection`` line naming ``keep-alive`` or
# ``close`` alone, and one ``TE`` line, are taken out first (browsers send the first on every
# HTTP/1.1 request, clients that close after one answer (health checks, API tools, wrk's
# new-connection runs) the second, and Firefox ``TE: trailers`` through a proxy; the general path
# passes none on, and none changes anything else it does but for the close). The pattern starts with a literal newline so that it is tried at line starts
# only.
_REQUEST_DECLINED = re.compile(
    rb"\n(?:"
    + _UNDERSCORED
    + b"|"
    + _alternation([re.escape(name) + b":" for name in REQUEST_DECLINED] + _PREFIXES)
    + b")"
)
_CONNECTION_LINE = re.compile(rb"^connection: *(keep-alive|close) *\r\n", re.M | re.I)
_TE_LINE = re.compile(rb"^te:[ -~]*+\r\n", re.M | re.I)

# A final response with a body length (2xx to 5xx), HTTP/1.1; its head must be the read's start.
_RESPONSE = re.compile(rb"HTTP/1\.1 ([2-5][0-9][0-9]) [ -~]*+(\r\n(?:" + _LINE + rb")*+)\r\n")
# In a response head (lowercased, after a newline): its Content-Length and its value, or a name
# that makes the general path decline to forward the head byte for byte (a hop-by-hop, internal
# or underscored header; another framing; a Content-Length with anything but digits). Nothing
# after a value is consumed (a lookahead): the next line's newline starts the next match.
_RESPONSE_ALTERNATIVES = _alternation(
    [rb"content-length: *([0-9]{1,18}) *(?=\r\n)"]
    + [re.escape(name) + b":" for name in RESPONSE_DECLINED]
    + _PREFIXES
)
_RESPONSE_NAMES = re.compile(rb"\n(?:" + _RESPONSE_ALTERNATIVES + b"|" + _UNDERSCORED + b")")
# The same for a head with no underscore anywhere (the usual one), which cannot match the
# underscored-name branch: without it the scan tries a few literals per line, not a token loop.
_RESPONSE_NAMES_PLAIN = re.compile(rb"\n(?:" + _RESPONSE_ALTERNATIVES + b")")
# A line the general path takes out of a head it otherwise forwards as it came (lowered, after a
# newline; lchat.proxy.http.RESPONSE_SPLICED): Connection naming keep-alive or upgrade only
# (spaces around the commas, no empty element), Keep-Alive, Upgrade. Its name is its group.
_SPLICED_TOKEN = rb"(?:" + b"|".join(sorted(RESPONSE_SPLICED_TOKENS)) + rb")"
_RESPONSE_SPLICED_LINE = re.compile(
    rb"(?<=\n)(?:(connection): *"
    + _SPLICED_TOKEN
    + rb" *(?:, *"
    + _SPLICED_TOKEN
    + rb" *)*+|(keep-alive):[ -~]*+|(upgrade):[ -~]*+)\r\n"
)
assert {b"connection", b"keep-alive", b"upgrade"} == RESPONSE_SPLICED  # (the pattern's names)


class WholeRequest(NamedTuple):
    """A bodyless request whose head is the whole read."""

    method: bytes  # GET or HEAD
    target: bytes  # origin-form
    host: bytes  # the one Host header's value, lowercased, without surrounding spaces
    lines: bytes  # the header lines that go upstream as they came, each ending in CRLF
    block: bytes  # the header lines as they came, and the empty line: what a next one compares
    close: bool  # the client said ``Connection: close``: its connection closes after the answer


def request(
    data: bytes, max_bytes: int, max_headers: int, previous: WholeRequest | None = None
) -> WholeRequest | None:
    """``data`` (one read) as a :class:`WholeRequest`, or ``None``: the general path decides.

    Declined beyond ``max_bytes`` or ``max_headers`` too (the general path refuses with the
    limit's own status). ``previous``, the last request recognised on the same connection: a
    client sends the same header lines request after request, and lines already checked are not
    checked again (one comparison of bytes instead)."""
    if len(data) > max_bytes:
        return None
    request_line = _REQUEST_LINE.match(data)
    if request_line is None:
        return None
    method, target = request_line.groups()
    if (
        previous is not None
        and len(data) - request_line.end() == len(previous.block)
        and data.endswith(previous.block)
    ):
        if method == previous.method and target == previous.target:
            return previous  # (the same request again: nothing new to make)
        return WholeRequest(
            method, target, previous.host, previous.lines, previous.block, previous.close
        )
    block = data[request_line.end() :]
    if _HEADERS.fullmatch(block) is None or block.count(b"\n") - 1 > max_headers:
        return None
    lines = block[:-2]
    lowered = b"\n" + lines.lower()
    close = False
    if _REQUEST_DECLINED.search(lowered) is not None:
        connection = _CONNECTION_LINE.search(lines)
        if connection is not None:
            close = connection.group(1).lower() == b"close"
            lines = lines[: connection.start()] + lines[connection.end() :]
        lines = _TE_LINE.sub(b"", lines, count=1)
        lowered = b"\n" + lines.lower()
        if _REQUEST_DECLINED.search(lowered) is not None:
            return None
    # Exactly one Host (none, or two, is the general path's 400).
    at = lowered.find(b"\nhost:")
    if at < 0 or lowered.find(b"\nhost:", at + 6) >= 0:
        return None
    host = lowered[at + 6 : lowered.index(b"\r", at)].strip(b" ")
    return WholeRequest(method, target, host, lines, block, close)


def response(data: bytes) -> tuple[int, int, bytes] | None:
    """``(status, body length, what the client gets)`` when ``data`` (the first read of a
    response to a GET) is a whole final response framed by one ``Content-Length``, with nothing
    after it, whose head can be forwarded byte for byte but for the hop-by-hop lines servers
    send on an ordinary answer (lchat.proxy.http.RESPONSE_SPLICED, at most one line of each
    name): what the client gets is ``data`` itself, or ``data`` with those lines taken out (the
    general path's splice, lchat.proxy.http.without_lines). Else ``None``: the general path
    parses it."""
    match = _RESPONSE.match(data)
    if match is None:
        return None
    # (The lines start with the status line's CRLF: every name follows a newline.) One
    # Content-Length with digits is one match with its value; anything else we look for is
    # another match, or a match without a value.
    lowered = match.group(2).lower()
    out = data
    if b"\nconnection:" in lowered or b"\nkeep-alive:" in lowered or b"\nupgrade:" in lowered:
        spliced = list(_RESPONSE_SPLICED_LINE.finditer(lowered))
        if len({line.lastindex for line in spliced}) != len(spliced):
            return None  # two lines of one name
        # The lines taken out of both: any Connection, Keep-Alive or Upgrade line left (another
        # Connection, say ``close``) is declined below with every other special name.
        head_at = match.start(2)
        kept, out_parts, at = [], [], 0
        for line in spliced:
            start, end = line.span()
            kept.append(lowered[at:start])
            out_parts.append(data[head_at + at : head_at + start])
            at = end
        kept.append(lowered[at:])
        out_parts.append(data[head_at + at :])
        lowered = b"".join(kept)
        out = data[:head_at] + b"".join(out_parts)
    found = (_RESPONSE_NAMES if b"_" in lowered else _RESPONSE_NAMES_PLAIN).findall(lowered)
    if len(found) != 1 or not found[0]:
        return None
    length = found[0]
    size = int(length)
    status = int(match.group(1))
    if match.end() + size != len(data) or status == 204 or status == 304:
        return None
    return status, size, out


# The same recognisers as byte scanners in C (lchat/proxy/_oneread_c.pyx), when built: the
# functions above stay the reference (tests/test_proxy_oneread.py holds the two to each other).
COMPILED = False  # whether request/response are the C scanners (the router logs it at start)
# What the C module must say it implements (its API): 2 since ``response`` returns the bytes the
# client gets, 3 since a request's ``Connection: close`` is taken (WholeRequest.close). A module built from an older .pyx (a checkout updated without a rebuild: `make
# install` rebuilds it) would answer in the old form: it is not used, and the start line says so.
API = 3
STALE = False  # the C module is there but built from another version of the .pyx
try:
    from lchat.proxy import _oneread_c
except ImportError:  # (no compiler where it was installed: the patterns above do the work)
    pass
else:
    if getattr(_oneread_c, "API", 1) != API:
        STALE = True
    else:
        _oneread_c.configure(WholeRequest, REQUEST_DECLINED, RESPONSE_DECLINED, SPECIAL_PREFIXES)
        request, response = _oneread_c.request, _oneread_c.response
        COMPILED = True


def implementation() -> str:
    """Which recognisers serve, for the start line and the benchmarks' header."""
    if COMPILED:
        return "compiled (lchat/proxy/_oneread_c)"
    if STALE:
        return (
            "patterns (lchat/proxy/_oneread_c is a build of an older version: rebuild it with "
            "`make install` or `pip install .`; ~2-3 µs more CPU per request meanwhile)"
        )
    return "patterns (lchat/proxy/_oneread_c not built: ~2-3 µs more CPU per request)"
