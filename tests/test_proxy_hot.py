"""lchat.proxy.hot, built two ways from one file: compiled by Cython (hot.pxd) or run as Python.

The behaviour of the one-read path is the proxy's tests' (tests/test_proxy_oneread.py's
differential tests and the rest run against the compiled module in `make test`); here: the two
builds agree on their fields, the right one is chosen (a stale build is never run), the compiled
fields read and write like slots and refuse a wrong type instead of crashing, and the Python
build passes the differential tests too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

import lchat.proxy
from lchat.proxy import hot, hot_choice, hot_digest
from lchat.proxy.upstream import UpstreamConnection, UpstreamPool
from lchat.router import LocalSocket

HERE = Path(lchat.proxy.__file__).parent
ROOT = Path(__file__).resolve().parent.parent
CLASSES = ("HotStats", "Exchange", "ClientCore", "UpstreamCore", "PoolCore")


def pxd_fields() -> dict[str, set[str]]:
    """Each cdef class's fields, as hot.pxd declares them."""
    fields: dict[str, set[str]] = {}
    current = ""
    for line in (HERE / "hot.pxd").read_text().splitlines():
        m = re.match(r"cdef class (\w+):", line)
        if m:
            current = m.group(1)
            fields[current] = set()
            continue
        m = re.match(r"    cdef public object (.*)$", line)
        if m and current:
            fields[current] |= {name.strip() for name in m.group(1).split(",")}
    return fields


class BuildTests(SynchronousTestCase):
    def test_the_pxd_declares_every_slot_and_nothing_else(self) -> None:
        """The compiled classes have exactly the Python ones' fields: a field only one of them
        has would be an AttributeError in one build alone."""
        declared = pxd_fields()
        self.assertEqual(set(declared), set(CLASSES))
        for name in CLASSES:
            with self.subTest(cls=name):
                self.assertEqual(declared[name], set(getattr(hot, name).__slots__))

    def test_subclasses_add_no_field(self) -> None:
        """Every field lives in the core (compiled: a struct member); a subclass's own slot
        would be a second, slower kind of field the one-read path cannot see."""
        from lchat.proxy.client import ClientConnection
        from lchat.proxy.downstream import Downstream, HopDownstream
        from lchat.proxy.relay import Relay

        for cls in (ClientConnection, Relay, Downstream, HopDownstream, UpstreamConnection):
            with self.subTest(cls=cls.__name__):
                self.assertEqual(cls.__dict__.get("__slots__"), ())

    def test_which_build_runs(self) -> None:
        source = "a" * 64
        self.assertEqual(
            hot_choice(True, False, source, source), (True, "compiled (lchat/proxy/hot)")
        )
        used, said = hot_choice(True, False, "b" * 64, source)
        self.assertFalse(used)
        self.assertIn("another version of hot.py", said)
        self.assertIn("make install", said)
        used, said = hot_choice(True, False, "", source)  # (no digest: built by hand)
        self.assertFalse(used)
        used, said = hot_choice(True, True, source, source)
        self.assertEqual((used, said), (False, "Python (LCHAT_PURE_PYTHON is set)"))
        used, said = hot_choice(False, False, "", "")
        self.assertFalse(used)
        self.assertIn("not compiled", said)

    def test_the_digest_covers_both_files(self) -> None:
        """A change to hot.py or to hot.pxd makes a build of the old ones stale."""
        tmp = Path(self.mktemp())
        tmp.mkdir()
        for name in ("hot.py", "hot.pxd"):
            (tmp / name).write_bytes((HERE / name).read_bytes())
        self.assertEqual(hot_digest(tmp), hot_digest(HERE))
        for name in ("hot.py", "hot.pxd"):
            with self.subTest(changed=name):
                before = hot_digest(tmp)
                with (tmp / name).open("a") as f:
                    f.write("\n# changed\n")
                self.assertNotEqual(hot_digest(tmp), before)

    def test_a_compiled_module_that_does_not_load_is_the_python_build(self) -> None:
        """(Built for another Python, or any failure at its import): the router still starts,
        on the Python build, and its start line says why."""
        saved = sys.modules["lchat.proxy.hot"]
        self.addCleanup(sys.modules.__setitem__, "lchat.proxy.hot", saved)

        def broken(name: str) -> ModuleType:
            raise ImportError(f"{name}: undefined symbol: _PyFoo")

        said = lchat.proxy._choose_hot(import_compiled=broken)
        if not hot.COMPILED:
            return  # (nothing compiled is chosen in this run: nothing to fail)
        self.assertIn("did not load", said)
        self.assertIn("undefined symbol", said)
        loaded = sys.modules["lchat.proxy.hot"]
        self.assertIsNot(loaded, saved)
        self.assertFalse(loaded.COMPILED)
        self.assertTrue(str(loaded.__file__).endswith("hot.py"))

    def test_the_module_loaded_is_the_one_chosen(self) -> None:
        self.assertEqual(hot.COMPILED, lchat.proxy.HOT.startswith("compiled"))
        if os.environ.get("LCHAT_PURE_PYTHON"):
            self.assertFalse(hot.COMPILED)
        if hot.COMPILED:
            self.assertFalse(str(hot.__file__).endswith(".py"))


class FieldTests(SynchronousTestCase):
    """What the compiled fields must be to Python: slots (either build passes these)."""

    def test_fields_read_and_write_like_slots(self) -> None:
        for name in CLASSES:
            cls = getattr(hot, name)
            with self.subTest(cls=name):
                probe = cls.__new__(cls)
                for field in cls.__slots__:
                    value = object()
                    setattr(probe, field, value)
                    self.assertIs(getattr(probe, field), value)
                if hot.COMPILED:  # (a member descriptor, as CPython makes for a slot)
                    kind = type(cls.__dict__[cls.__slots__[0]])
                    self.assertEqual(kind.__name__, "member_descriptor")
                with self.assertRaises(AttributeError):
                    probe.not_a_field = 1

    def test_a_wrong_type_in_a_field_is_an_error_not_a_crash(self) -> None:
        """Compiled, the one-read path reads some fields as typed objects: what a field holds is
        checked when it is read so (a TypeError), never trusted."""
        pool = UpstreamPool(Clock())
        conn = UpstreamConnection(pool, "/nonexistent")
        conn.handler = object()  # type: ignore[assignment]  # (not a client connection)
        conn.request_sent = True
        if hot.COMPILED:
            with self.assertRaises(TypeError):
                conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        pool._idle["/nonexistent"] = ["not a connection"]  # type: ignore[list-item]
        target = LocalSocket(host="x.test", path="/nonexistent")
        if hot.COMPILED:
            with self.assertRaises(TypeError):
                pool.take_idle(target)

    def test_an_exchange_recognised_whole_has_no_containers(self) -> None:
        """A one-read request's url, headers, body and replay are shared empty values: an append
        fails loudly (never leaks into another request); a parsed one's are its own."""
        whole = hot.Exchange(0.0, b"GET", False)
        for field in ("url", "headers", "body", "forwarded_for", "replay"):
            with self.subTest(field=field):
                self.assertEqual(len(getattr(whole, field)), 0)
                with self.assertRaises(AttributeError):
                    getattr(whole, field).append(b"x")
        parsed = hot.Exchange(0.0, b"POST")
        parsed.body.append(b"x")
        self.assertEqual(hot.Exchange(0.0, b"POST").body, [])
        self.assertEqual(parsed.version, "1.1")
        self.assertTrue(parsed.keep_alive)
        self.assertEqual(parsed.refused_why, "stopping")


class PythonBuildTests(TestCase):
    """The Python build of hot.py (what a box without a compiler runs) passes the differential
    tests the compiled one passes in this run."""

    def test_the_python_build_passes_the_differential_tests(self) -> None:
        if not hot.COMPILED:
            self.skipTest("this run is the Python build already")
        ran = subprocess.run(
            [
                sys.executable,
                "-m",
                "twisted.trial",
                "--reactor=uvloop",
                "--temp-directory",
                os.path.abspath(self.mktemp()),
                "tests.test_proxy_oneread",
                "tests.test_proxy_bulk_differential",
                "tests.test_proxy_hot",
            ],
            cwd=ROOT,
            env={**os.environ, "LCHAT_PURE_PYTHON": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(ran.returncode, 0, ran.stdout[-4000:] + ran.stderr[-2000:])
        self.assertIn("PASSED", ran.stdout)
