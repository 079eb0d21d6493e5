"""TLS session-ticket keys shared by processes: the key file, its rotation, and installing a key
on a stdlib :class:`ssl.SSLContext`.

A TLS 1.3 client resumes (no certificate, no signature: a fraction of a full handshake's CPU) by
presenting a ticket the server encrypted with its ticket key. OpenSSL makes a random key per
context; a box running several worker processes on one port must give them one key, or a
reconnect resumes only when the kernel hands it to the worker that issued its ticket.

The stdlib has no call for it, so :func:`install` reaches OpenSSL through ``ctypes``:
``SSL_CTX_ctrl(ctx, SSL_CTRL_SET_TLSEXT_TICKET_KEYS, 80, key)`` on the ``SSL_CTX *`` that
CPython keeps right after the object header of its ``_ssl._SSLContext``. That layout is private:
it is allowed only on the Python versions it was checked on (:data:`SUPPORTED_PYTHONS`), checked
again on every call (the options OpenSSL reports through the pointer must be the ones the object
reports), and the key is read back. Any doubt raises :class:`TicketKeyError` *before* anything
is written through the pointer; the caller logs it and serves on with OpenSSL's own key (the
only cost: reconnects through another worker make full handshakes). ``tests/test_ticketkeys.py``
pins all of it against the running Python and OpenSSL.

The key is set on the context a connection *starts* on (the certificate store's SNI dispatch
context): OpenSSL encrypts and decrypts tickets with that ``session_ctx``'s keys even after the
SNI callback switches the connection to its certificate's context.

OpenSSL holds one key per context: a rotation makes tickets issued under the old key fail over
to a full handshake (never an error). Rotating every 12 h with OpenSSL's 2 h ticket lifetime
costs at most one full handshake per client twice a day.
"""

from __future__ import annotations

import ctypes
import functools
import os
import ssl
import stat
import sys
from collections.abc import Callable

from prometheus_client import Counter, Gauge
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from lchat import files

KEY_BYTES = 80  # OpenSSL's tlsext ticket keys: 16 name + 32 HMAC secret + 32 AES secret
DEFAULT_INTERVAL = 12 * 3600.0
# Python versions whose PySSLContext starts with PyObject_HEAD then ``SSL_CTX *ctx`` (checked in
# Modules/_ssl.c of each; re-check the layout before adding one).
SUPPORTED_PYTHONS = frozenset({(3, 11), (3, 12), (3, 13)})
PYTHON = sys.version_info[:2]  # a module name, so a test can pretend to be another Python
_SSL_CTRL_SET_SESS_CACHE_MODE = 44
_SSL_CTRL_GET_SESS_CACHE_MODE = 45
_SSL_SESS_CACHE_OFF = 0
_SSL_CTRL_GET_TLSEXT_TICKET_KEYS = 58
_SSL_CTRL_SET_TLSEXT_TICKET_KEYS = 59

_log = Logger(namespace="lchat.tls")

_rotations = Counter(
    "lchat_tls_ticket_key_writes_total",
    "Session-ticket key file writes (start and rotations), by outcome",
    ["outcome"],
)
for _outcome in ("ok", "failed"):
    _rotations.labels(_outcome)
_written = Gauge(
    "lchat_tls_ticket_key_written_timestamp_seconds",
    "When the session-ticket key file was last written (unix time)",
)


class TicketKeyError(Exception):
    """A ticket key could not be read, written or installed; the message says why."""


def new_key() -> bytes:
    """A fresh random ticket key."""
    return os.urandom(KEY_BYTES)


def write(path: str, key: bytes) -> None:
    """Replace ``path`` with ``key``, atomically (a reader sees the old key or the new, never
    half of one), mode 0600."""
    _check_length(key)
    # No directory fsync: after a crash, a stale or missing key costs full handshakes only,
    # and the writer makes a new key when it starts again.
    files.write_atomic(path, key, 0o600, fsync_dir=False)


def read(path: str) -> bytes:
    """The key in ``path``. Raises :class:`TicketKeyError` (naming the path) when it cannot be
    read, is not :data:`KEY_BYTES` long, or other users may read it (a leaked key lets whoever
    holds it decrypt recorded resumed sessions)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise TicketKeyError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise TicketKeyError(f"{path} is not a regular file")
        if mode & 0o077:
            raise TicketKeyError(
                f"{path} is readable by other users (mode {stat.S_IMODE(mode):04o}; want 0600)"
            )
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise TicketKeyError(f"{path} holds {len(key)} bytes, not a {KEY_BYTES}-byte ticket key")
    return key


# --- installing a key on a context ---------------------------------------------------------------


class _LibSSL:
    """The three OpenSSL entry points used, from the libssl the running ``_ssl`` is linked to
    (never another copy on the system: its ``SSL_CTX`` would be a different struct)."""

    def __init__(self) -> None:
        import _ssl  # the stdlib's extension module: dlsym on it searches its own libssl

        lib = ctypes.CDLL(_ssl.__file__)
        self.ctrl = lib.SSL_CTX_ctrl
        self.ctrl.restype = ctypes.c_long
        self.ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
        self.get_options = lib.SSL_CTX_get_options
        self.get_options.restype = ctypes.c_uint64
        self.get_options.argtypes = [ctypes.c_void_p]


@functools.cache
def _libssl() -> _LibSSL:
    return _LibSSL()


def install(ctx: ssl.SSLContext, key: bytes) -> None:
    """Make ``ctx`` encrypt and decrypt session tickets with ``key`` (:data:`KEY_BYTES` long).

    Raises :class:`TicketKeyError` and changes nothing when this Python or OpenSSL is not one the
    private layout was checked on, the pointer does not look like ``ctx``'s ``SSL_CTX``, or the
    key read back differs. Call it on the reactor thread, between handshakes (never from inside
    a callback of a handshake on ``ctx``).
    """
    _check_length(key)
    if PYTHON not in SUPPORTED_PYTHONS:
        raise TicketKeyError(
            f"Python {PYTHON[0]}.{PYTHON[1]} is not one whose ssl context layout lchat knows "
            f"(known: {', '.join(f'{a}.{b}' for a, b in sorted(SUPPORTED_PYTHONS))})"
        )
    if ssl.OPENSSL_VERSION_INFO < (1, 1, 1):
        raise TicketKeyError(f"{ssl.OPENSSL_VERSION} is older than OpenSSL 1.1.1")
    if not isinstance(ctx, ssl.SSLContext):
        raise TicketKeyError(f"not an ssl.SSLContext: {type(ctx).__name__}")
    lib = _libssl()
    pointer = _ssl_ctx(ctx)
    given = ctypes.create_string_buffer(key, KEY_BYTES)
    if lib.ctrl(pointer, _SSL_CTRL_SET_TLSEXT_TICKET_KEYS, KEY_BYTES, given) != 1:
        raise TicketKeyError("OpenSSL refused the ticket key (SSL_CTRL_SET_TLSEXT_TICKET_KEYS)")
    back = ctypes.create_string_buffer(KEY_BYTES)
    got = lib.ctrl(pointer, _SSL_CTRL_GET_TLSEXT_TICKET_KEYS, KEY_BYTES, back)
    if got != 1 or back.raw != key:
        raise TicketKeyError("the ticket key OpenSSL reads back is not the one installed")


def no_session_cache(ctx: ssl.SSLContext) -> None:
    """Turn off OpenSSL's server-side session cache on ``ctx`` (nginx's ``ssl_session_cache
    off``). TLS 1.3 resumes with stateless tickets, which need no cache: by default OpenSSL
    still stores every full handshake's session in the context's table (a lock and an
    allocation per connection, and a scan of the table every 255). Raises
    :class:`TicketKeyError` where :func:`install` would, changing nothing."""
    if PYTHON not in SUPPORTED_PYTHONS:
        raise TicketKeyError(f"Python {PYTHON[0]}.{PYTHON[1]}: ssl context layout unknown")
    if not isinstance(ctx, ssl.SSLContext):
        raise TicketKeyError(f"not an ssl.SSLContext: {type(ctx).__name__}")
    lib = _libssl()
    pointer = _ssl_ctx(ctx)
    lib.ctrl(pointer, _SSL_CTRL_SET_SESS_CACHE_MODE, _SSL_SESS_CACHE_OFF, None)
    if lib.ctrl(pointer, _SSL_CTRL_GET_SESS_CACHE_MODE, 0, None) != _SSL_SESS_CACHE_OFF:
        raise TicketKeyError("OpenSSL kept its session cache on (SSL_CTRL_SET_SESS_CACHE_MODE)")


def _ssl_ctx(ctx: ssl.SSLContext) -> int:
    """``ctx``'s ``SSL_CTX *``, checked: a pointer that is not this context's SSL_CTX would
    report other options (the stdlib sets several by default, and ctx.options reads them from
    its own SSL_CTX)."""
    pointer = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    if not pointer:
        raise TicketKeyError("the ssl context holds no SSL_CTX where lchat expects it")
    reported = _libssl().get_options(pointer)
    if reported != int(ctx.options):
        raise TicketKeyError(
            f"the ssl context layout is not the one lchat knows (OpenSSL reports options "
            f"{reported:#x} where the context says {int(ctx.options):#x})"
        )
    return pointer


def _check_length(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise TicketKeyError(f"a ticket key is {KEY_BYTES} bytes, not {len(key)}")


# --- the file's writer ---------------------------------------------------------------------------


class RotatingKeyFile(Service):
    """Keeps a fresh key in ``path``: writes one when started, then a new one every ``interval``
    seconds on ``reactor``'s clock, calling ``on_rotate()`` after each rotation (so readers
    rescan; the write at start calls nobody: whatever starts after it reads the file itself).

    A failed write is logged and counted, and the previous key stays (tickets keep resuming);
    the next rotation tries again. The file is small and lives in the run directory (a tmpfs):
    writes happen on the reactor thread.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        path: str,
        on_rotate: Callable[[], object],
        interval: float = DEFAULT_INTERVAL,
        make_key: Callable[[], bytes] = new_key,
    ) -> None:
        self._reactor = reactor
        self.path = path
        self._on_rotate = on_rotate
        self._interval = interval
        self._make_key = make_key
        self._loop: LoopingCall | None = None

    def startService(self) -> None:
        super().startService()
        self._write()
        self._loop = LoopingCall(self._rotate)
        self._loop.clock = self._reactor
        self._loop.start(self._interval, now=False).addErrback(
            lambda f: _log.failure("tls: the ticket key rotation loop died", f)
        )

    def stopService(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        super().stopService()

    def _rotate(self) -> None:
        if self._write():
            self._on_rotate()

    def _write(self) -> bool:
        try:
            write(self.path, self._make_key())
        except (OSError, TicketKeyError) as e:
            _rotations.labels("failed").inc()
            _log.error(
                "tls: cannot write the session ticket key {path}: {error} (the previous key, if "
                "any, stays in use; trying again in {interval:.0f}s)",
                path=self.path,
                error=e,
                interval=self._interval,
            )
            return False
        _rotations.labels("ok").inc()
        _written.set(self._reactor.seconds())
        return True
