"""lchat/ticketkeys.py against the running Python and OpenSSL.

:func:`ticketkeys.install` writes through a private CPython layout (the ``SSL_CTX *`` after the
``_ssl._SSLContext`` object header) with ``SSL_CTX_ctrl``. These tests exist to fail loudly when a
Python or OpenSSL release moves it: the key is read back, and the property the workers need (a
TLS 1.3 ticket from one process's listener resumes on another's, across the SNI switch to a
certificate context) is checked over in-memory handshakes.
"""

from __future__ import annotations

import os
import ssl
import stat
from typing import Any

from cryptography.hazmat.primitives import serialization
from twisted.internet import task
from twisted.trial.unittest import SynchronousTestCase

from lchat import certfiles, ticketkeys
from lchat.ticketkeys import KEY_BYTES, RotatingKeyFile, TicketKeyError
from tests.test_tls import TestCA, captured_logs, memory_connect, read_ticket_key, sample

NAME = "tickets.lchat.test"


class Listener:
    """What the certificate store builds: a certificate-less dispatch context whose SNI callback
    switches each connection to the certificate's own context."""

    def __init__(self, ca: TestCA) -> None:
        key, cert = ca.issue(NAME)
        self.certificate = certfiles.server_context()
        fd = os.memfd_create("ticketkeys-test")
        try:
            pem = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ) + cert.public_bytes(serialization.Encoding.PEM)
            os.write(fd, pem)
            self.certificate.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        self.dispatch = certfiles.server_context()
        self.switched = 0
        self.dispatch.sni_callback = self._switch

    def _switch(self, connection: Any, server_name: str | None, context: Any) -> None:
        self.switched += 1
        connection.context = self.certificate


class InstallTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.ca = TestCA()
        self.client = ssl.create_default_context(cadata=self.ca.pem.decode("ascii"))

    def session_from(self, listener: Listener) -> ssl.SSLSession:
        end = memory_connect(listener.dispatch, self.client, NAME, None)
        self.assertFalse(end.session_reused)
        session = end.session
        assert session is not None
        self.assertTrue(session.has_ticket, "no TLS 1.3 ticket reached the client")
        return session

    def test_install_then_read_ticket_key(self) -> None:
        ctx = certfiles.server_context()
        own = read_ticket_key(ctx)  # OpenSSL's random key, made with the context
        key = ticketkeys.new_key()
        self.assertEqual(len(key), KEY_BYTES)
        self.assertNotEqual(own, key)
        ticketkeys.install(ctx, key)
        self.assertEqual(read_ticket_key(ctx), key)
        other = ticketkeys.new_key()
        ticketkeys.install(ctx, other)  # a rotation replaces it
        self.assertEqual(read_ticket_key(ctx), other)

    def test_same_key_resumes_across_listeners_and_the_sni_switch(self) -> None:
        a, b, c = Listener(self.ca), Listener(self.ca), Listener(self.ca)
        # Without a shared key, another listener's ticket does not resume (OpenSSL's own keys):
        # what the shared key is for.
        self.assertFalse(
            memory_connect(b.dispatch, self.client, NAME, self.session_from(a)).session_reused
        )
        key = ticketkeys.new_key()
        ticketkeys.install(a.dispatch, key)
        ticketkeys.install(b.dispatch, key)
        ticketkeys.install(c.dispatch, ticketkeys.new_key())
        session = self.session_from(a)
        resumed = memory_connect(b.dispatch, self.client, NAME, session)
        self.assertTrue(resumed.session_reused, "a ticket from A did not resume on B")
        self.assertEqual(b.switched, 2)  # the SNI callback switched both of B's connections
        self.assertFalse(
            memory_connect(c.dispatch, self.client, NAME, session).session_reused
        )  # another key

    def test_without_the_session_cache_tickets_still_resume(self) -> None:
        """nginx's ``ssl_session_cache off``: OpenSSL stores no session per full handshake, and
        a TLS 1.3 ticket resumes as before (it carries the session itself), on the same
        listener and, with a shared key, on another."""
        a, b = Listener(self.ca), Listener(self.ca)
        for listener in (a, b):
            pointer = ticketkeys._ssl_ctx(listener.dispatch)
            self.assertEqual(ticketkeys._libssl().ctrl(pointer, 45, 0, None), 2)  # SERVER
            ticketkeys.no_session_cache(listener.dispatch)
            self.assertEqual(ticketkeys._libssl().ctrl(pointer, 45, 0, None), 0)  # OFF
        key = ticketkeys.new_key()
        ticketkeys.install(a.dispatch, key)
        ticketkeys.install(b.dispatch, key)
        session = self.session_from(a)
        self.assertTrue(memory_connect(a.dispatch, self.client, NAME, session).session_reused)
        self.assertTrue(memory_connect(b.dispatch, self.client, NAME, session).session_reused)

    def test_a_python_whose_layout_is_unknown_is_refused_before_any_call(self) -> None:
        def never() -> Any:
            raise AssertionError("libssl was reached on a refused Python")

        self.patch(ticketkeys, "_libssl", never)
        self.patch(ticketkeys, "PYTHON", (3, 14))
        with self.assertRaises(TicketKeyError) as e:
            ticketkeys.install(certfiles.server_context(), ticketkeys.new_key())
        self.assertIn(
            "Python 3.14 is not one whose ssl context layout lchat knows", str(e.exception)
        )

    def test_no_session_cache_refuses_what_it_cannot_reach_before_any_call(self) -> None:
        def never() -> Any:
            raise AssertionError("libssl was reached")

        self.patch(ticketkeys, "_libssl", never)
        with self.assertRaises(TicketKeyError) as e:
            ticketkeys.no_session_cache(object())  # type: ignore[arg-type]
        self.assertIn("not an ssl.SSLContext: object", str(e.exception))
        self.patch(ticketkeys, "PYTHON", (3, 14))
        with self.assertRaises(TicketKeyError) as e:
            ticketkeys.no_session_cache(certfiles.server_context())
        self.assertIn("Python 3.14", str(e.exception))

    def test_a_pointer_that_is_not_the_contexts_is_refused_before_writing(self) -> None:
        real = ticketkeys._libssl()
        calls: list[int] = []

        class Lying:
            def get_options(self, pointer: int) -> int:
                return int(real.get_options(pointer)) ^ 1

            def ctrl(self, *args: Any) -> int:
                calls.append(args[1])
                return 1

        self.patch(ticketkeys, "_libssl", Lying)
        ctx = certfiles.server_context()
        with self.assertRaises(TicketKeyError) as e:
            ticketkeys.install(ctx, ticketkeys.new_key())
        self.assertIn("layout is not the one lchat knows", str(e.exception))
        self.assertEqual(calls, [])

    def test_a_key_of_the_wrong_length_is_refused(self) -> None:
        for key in (b"", b"x" * 48, b"x" * 81):
            with self.assertRaises(TicketKeyError):
                ticketkeys.install(certfiles.server_context(), key)


class FileTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.path = os.path.join(self.dir, "tls-ticket.key")
        self.logs = captured_logs(self)

    def test_written_0600_atomically_and_read_ticket_key(self) -> None:
        first, second = ticketkeys.new_key(), ticketkeys.new_key()
        ticketkeys.write(self.path, first)
        before = os.stat(self.path)
        self.assertEqual(stat.S_IMODE(before.st_mode), 0o600)
        self.assertEqual(ticketkeys.read(self.path), first)
        ticketkeys.write(self.path, second)
        after = os.stat(self.path)
        # A new file renamed over the old one: a reader holds the old key or the new one whole.
        self.assertNotEqual(before.st_ino, after.st_ino)
        self.assertEqual(stat.S_IMODE(after.st_mode), 0o600)
        self.assertEqual(ticketkeys.read(self.path), second)
        self.assertEqual(os.listdir(self.dir), ["tls-ticket.key"])  # no temp file left

    def test_bad_files_are_refused_naming_the_path(self) -> None:
        with self.assertRaises(TicketKeyError) as e:
            ticketkeys.read(self.path)
        self.assertIn(f"cannot read {self.path}", str(e.exception))
        with open(self.path, "wb") as f:
            f.write(b"short")
        os.chmod(self.path, 0o600)
        with self.assertRaises(TicketKeyError) as e:
            ticketkeys.read(self.path)
        self.assertIn("holds 5 bytes", str(e.exception))
        ticketkeys.write(self.path, ticketkeys.new_key())
        os.chmod(self.path, 0o644)
        with self.assertRaises(TicketKeyError) as e:
            ticketkeys.read(self.path)
        self.assertIn("readable by other users (mode 0644", str(e.exception))

    def test_rotation_on_the_clock(self) -> None:
        clock = task.Clock()
        rotated: list[bytes] = []
        writer = RotatingKeyFile(
            clock, self.path, lambda: rotated.append(ticketkeys.read(self.path)), interval=3600
        )
        ok = sample("lchat_tls_ticket_key_writes_total", outcome="ok")
        writer.startService()
        self.addCleanup(writer.stopService)
        first = ticketkeys.read(self.path)
        self.assertEqual(rotated, [])  # the first write tells nobody
        clock.advance(3599)
        self.assertEqual(ticketkeys.read(self.path), first)
        clock.advance(1)
        self.assertEqual(len(rotated), 1)
        self.assertNotEqual(rotated[0], first)
        self.assertEqual(ticketkeys.read(self.path), rotated[0])
        self.assertEqual(sample("lchat_tls_ticket_key_writes_total", outcome="ok"), ok + 2)
        self.assertEqual(sample("lchat_tls_ticket_key_written_timestamp_seconds"), 3600)
        # A failed write keeps the key in place, tells nobody, and is tried again next time.
        self.patch(ticketkeys.files, "write_atomic", _refuse)
        clock.advance(3600)
        self.assertEqual(len(rotated), 1)
        self.assertEqual(ticketkeys.read(self.path), rotated[0])
        self.assertEqual(
            len([e for e in self.logs if "cannot write the session ticket key" in e]), 1
        )
        self.patch(ticketkeys.files, "write_atomic", _real_write_atomic)
        clock.advance(3600)
        self.assertEqual(len(rotated), 2)
        writer.stopService()
        clock.advance(3600 * 5)
        self.assertEqual(len(rotated), 2)


_real_write_atomic = ticketkeys.files.write_atomic


def _refuse(*args: Any, **kw: Any) -> None:
    raise PermissionError(13, "Permission denied")
