"""lchat.objstore.file specifics: the key -> path mapping, cross-process atomicity with real processes,
crash leftovers, keys that try to escape the root, permissions, and the thread/timeout seams.

The semantics it shares with the S3 stores are in tests/test_objstore.py (the conformance suite).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial import unittest

import lchat
from lchat.objstore import (
    NotFound,
    PreconditionFailed,
    StoreUnavailable,
)
from lchat.objstore import file as filemod
from lchat.objstore.file import (
    FileBucket,
    FileStore,
    KeyRefused,
    decode_segment,
    encode_segment,
)
from lchat.objstore.where import file_bucket
from lchat.reactors import installed
from lchat.threads import thread_runner

reactor = installed()
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(lchat.__file__)))

# A child process using the store through its blocking API.
CHILD_PRELUDE = """
import os, sys, time
from lchat.objstore import PreconditionFailed
from lchat.objstore.file import FileBucket
root, key, go, me = sys.argv[1:5]
bucket = FileBucket(root)
while not os.path.exists(go):
    time.sleep(0.001)
"""

CREATE_RACE = (
    CHILD_PRELUDE
    + """
try:
    bucket.put(key, me.encode(), if_none_match=True)
    print("won")
except PreconditionFailed:
    print("lost")
"""
)

# Read-modify-write with If-Match and retry: no increment may be lost.
INCREMENTS = (
    CHILD_PRELUDE
    + """
done = 0
while done < 25:
    current = bucket.get(key)
    n = int(current.body)
    try:
        bucket.put(key, str(n + 1).encode(), if_match=current.info.etag)
        done += 1
    except PreconditionFailed:
        pass
print("ok")
"""
)

STREAM_FROM_FIFO = """
import sys
from lchat.objstore.file import FileBucket
root, key, fifo = sys.argv[1:4]
FileBucket(root).put_file(key, fifo)
print("finished")
"""


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": PROJECT}


def _reap(p: subprocess.Popen[Any]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


def all_paths(top: str) -> Iterator[str]:
    for directory, dirs, files in os.walk(top):
        for name in dirs + files:
            yield os.path.join(directory, name)


class Base(unittest.TestCase):
    def fresh_root(self) -> str:
        root = os.path.abspath(self.mktemp())
        os.makedirs(root)
        return root

    def setUp(self) -> None:
        self.root = self.fresh_root()
        self.bucket = FileBucket(self.root)


class EncodingTests(unittest.TestCase):
    def test_examples(self) -> None:
        assert encode_segment("lock.json") == "lock.json"
        assert encode_segment("a b+c") == "a%20b%2Bc"
        assert encode_segment("é") == "%C3%A9"
        assert encode_segment("..") == ".."  # safe: names always carry an @o/@d suffix
        assert encode_segment("") == ""
        assert encode_segment("@%/\x00") == "%40%25%2F%00"

    def test_non_canonical_names_are_not_ours(self) -> None:
        assert decode_segment("a%2bb") is None  # lower-case hex
        assert decode_segment("a b") is None  # a raw byte we would have encoded
        assert decode_segment("%C3") is None  # not UTF-8
        assert decode_segment("%G0") is None
        assert decode_segment("%4") is None

    @given(st.text())
    @settings(max_examples=300, deadline=None)
    def test_segment_round_trip(self, segment: str) -> None:
        try:
            stem = encode_segment(segment)
        except UnicodeEncodeError:
            return  # lone surrogates: refused as keys
        assert decode_segment(stem) == segment
        assert "/" not in stem and "\x00" not in stem and "@" not in stem
        assert stem.isascii()

    @given(st.text(min_size=1, max_size=60))
    @settings(max_examples=200, deadline=None)
    def test_every_key_maps_under_objects(self, key: str) -> None:
        bucket = FileBucket("/srv/bucket")
        try:
            directory, path = bucket._object_path(key)
        except KeyRefused:
            return
        assert os.path.normpath(path) == path
        assert path.startswith("/srv/bucket/objects/")
        parts = path[len("/srv/bucket/objects/") :].split("/")
        assert len(parts) == key.count("/") + 1
        assert all(p not in ("", ".", "..") for p in parts)
        assert all(p.endswith("@d") for p in parts[:-1]) and parts[-1].endswith("@o")
        assert os.path.dirname(path) == directory

    def test_layout_on_disk(self) -> None:
        root = os.path.abspath(self.mktemp())
        os.makedirs(root)
        bucket = FileBucket(root)
        bucket.put("space/a b/lock.json", b"body", metadata={"k": "v"})
        path = os.path.join(root, "objects", "space@d", "a%20b@d", "lock.json@o")
        with open(path, "rb") as f:
            assert f.read(4) == b"body"  # the body comes first: head -c works on an object file


class ListingPropertyTests(unittest.TestCase):
    """list(prefix) against a model: any keys, any prefix, S3's answer (sorted, prefix-filtered)."""

    alphabet = st.sampled_from(["a", "b", "/", " ", "+", "é", ".", "%"])

    @given(
        keys=st.sets(st.text(alphabet, min_size=1, max_size=6), max_size=12),
        prefixes=st.lists(st.text(alphabet, max_size=4), min_size=1, max_size=4),
    )
    @settings(max_examples=60, deadline=None)
    def test_list_matches_model(self, keys: set[str], prefixes: list[str]) -> None:
        root = tempfile.mkdtemp(prefix="lchat-list-")
        try:
            bucket = FileBucket(root)
            for key in keys:
                bucket.put(key, key.encode())
            for prefix in [*prefixes, ""]:
                expected = sorted(k for k in keys if k.startswith(prefix))
                listed = bucket.list(prefix)
                assert [i.key for i in listed] == expected, (prefix, keys)
                assert all(i.size == len(i.key.encode()) for i in listed)
        finally:
            shutil.rmtree(root)


class ParseBucketTests(unittest.TestCase):
    def test_parse(self) -> None:
        assert file_bucket("file:/var/lib/lchat/bucket") == "file:/var/lib/lchat/bucket"
        assert file_bucket("file:/a/b/../c/") == "file:/a/c"
        assert file_bucket("file:var/bucket") == "file:" + os.path.join(os.getcwd(), "var/bucket")
        for bad in ("file:", "file:/a\x00b"):
            with self.assertRaises(ValueError):
                file_bucket(bad)


class EscapeTests(Base):
    """Keys are text from the network's point of view: none may reach outside the root."""

    HOSTILE = [
        "../x",
        "../../etc/passwd",
        "/abs",
        "/",
        "//",
        "a/../../b",
        "./.",
        "..",
        ".",
        "x\x00y",
        "a//b",
        "dir/",
        "@o",
        "a@d/b",
        "%2e%2e/x",
        "\\..\\x",
    ]

    def test_hostile_keys_stay_inside(self) -> None:
        outside = os.path.dirname(self.root)
        before = set(os.listdir(outside))
        for key in self.HOSTILE:
            put = self.bucket.put(key, key.encode())
            got = self.bucket.get(key)
            assert (got.body, got.info.key, got.info.etag) == (key.encode(), key, put.etag), key
        assert set(os.listdir(outside)) == before
        real_objects = os.path.realpath(os.path.join(self.root, "objects"))
        for path in all_paths(os.path.join(self.root, "objects")):
            assert os.path.realpath(path).startswith(real_objects + os.sep), path
        assert [i.key for i in self.bucket.list("")] == sorted(self.HOSTILE)
        for key in self.HOSTILE:
            self.bucket.delete(key)
        assert self.bucket.list("") == []
        assert os.listdir(os.path.join(self.root, "objects")) == []  # empty directories pruned

    def test_refused_keys(self) -> None:
        for key in ("", "\ud800", "x" * 1025, "é" * 100, "a/" + "%" * 90):
            with self.assertRaises(KeyRefused):
                self.bucket.put(key, b"x")
            with self.assertRaises(KeyRefused):
                self.bucket.get(key)
        assert self.bucket.list("é" * 100) == []  # no key can be there
        assert self.bucket.list("\ud800") == []
        assert issubclass(KeyRefused, filemod.ObjectStoreError)


class CrossProcessTests(Base):
    """Real processes racing on one root: flock makes check-and-write atomic among them."""

    def spawn(self, script: str, key: str, go: str, n: int) -> list[subprocess.Popen[str]]:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, self.root, key, go, str(i)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=child_env(),
            )
            for i in range(n)
        ]
        for p in procs:
            self.addCleanup(_reap, p)
        return procs

    def finish(self, procs: list[subprocess.Popen[str]]) -> list[str]:
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            outs.append(out.strip())
        return outs

    def test_create_race_has_one_winner(self) -> None:
        for attempt in range(3):
            key = f"space/lock-{attempt}.json"
            go = os.path.join(self.root, f"go-{attempt}")
            procs = self.spawn(CREATE_RACE, key, go, 6)
            time.sleep(0.5)  # let the interpreters start and spin on the go file
            open(go, "w").close()
            outs = self.finish(procs)
            assert sorted(outs) == ["lost"] * 5 + ["won"], outs
            winner = outs.index("won")
            assert self.bucket.get(key).body == str(winner).encode()

    def test_no_lost_updates(self) -> None:
        self.bucket.put("counter", b"0")
        go = os.path.join(self.root, "go")
        procs = self.spawn(INCREMENTS, "counter", go, 4)
        time.sleep(0.3)
        open(go, "w").close()
        assert self.finish(procs) == ["ok"] * 4
        assert self.bucket.get("counter").body == b"100"


class CrashTests(Base):
    def test_leftovers_are_ignored(self) -> None:
        self.bucket.put("k/one", b"1")
        directory = os.path.join(self.root, "objects", "k@d")
        # A writer that died before its rename, a stranger's file, a name we never write.
        for name, data in (("@t999.dead", b"half"), ("README", b"hi"), ("x%zz@o", b"?")):
            with open(os.path.join(directory, name), "wb") as f:
                f.write(data)
        assert [i.key for i in self.bucket.list("")] == ["k/one"]
        assert self.bucket.get("k/one").body == b"1"
        self.bucket.put("k/one", b"2", if_match=self.bucket.head("k/one").etag)
        self.bucket.delete("k/one")
        assert self.bucket.list("") == []

    def test_corrupt_object_is_unavailable_not_garbage(self) -> None:
        self.bucket.put("c", b"fine")
        self.bucket.put("d", b"fine")
        path = os.path.join(self.root, "objects", "c@o")
        with open(path, "r+b") as f:
            f.seek(-2, os.SEEK_END)
            f.write(b"\xff\xff")  # the trailer length now points nowhere
        with self.assertRaises(StoreUnavailable):
            self.bucket.get("c")
        assert [i.key for i in self.bucket.list("")] == ["d"]  # skipped and logged
        self.flushLoggedErrors()
        self.bucket.put("e", b"body")
        path = os.path.join(self.root, "objects", "e@o")
        with open(path, "r+b") as f:
            f.write(b"BODY")  # bit rot: the ETag no longer matches
        dest = os.path.join(self.root, "out")
        with self.assertRaises(StoreUnavailable):
            self.bucket.get_to_file("e", dest)
        assert not os.path.exists(dest)
        assert [n for n in os.listdir(self.root) if n.startswith("out")] == []

    def test_killed_writer_leaves_old_version(self) -> None:
        """SIGKILL a process mid-put_file: the old version stays whole, the temp file is inert."""
        self.bucket.put("big", b"old version")
        fifo = os.path.join(self.root, "fifo")
        os.mkfifo(fifo)
        child = subprocess.Popen(
            [sys.executable, "-c", STREAM_FROM_FIFO, self.root, "big", fifo],
            env=child_env(),
            stdout=subprocess.PIPE,
        )
        self.addCleanup(_reap, child)
        with open(fifo, "wb") as w:
            w.write(b"n" * (4 * 1024 * 1024))
            w.flush()
            directory = os.path.join(self.root, "objects")
            deadline = time.monotonic() + 10
            while not any(n.startswith("@t") for n in os.listdir(directory)):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        assert self.bucket.get("big").body == b"old version"
        assert [i.key for i in self.bucket.list("")] == ["big"]
        assert any(n.startswith("@t") for n in os.listdir(os.path.join(self.root, "objects")))
        self.bucket.put("big", b"new", if_match=self.bucket.head("big").etag)  # lock was released
        assert self.bucket.get("big").body == b"new"


class RootTests(unittest.TestCase):
    def test_missing_root_is_unavailable(self) -> None:
        root = os.path.abspath(self.mktemp())
        bucket = FileBucket(root)
        for op in (
            lambda: bucket.get("k"),
            lambda: bucket.head("k"),
            lambda: bucket.put("k", b"x"),
            lambda: bucket.delete("k"),
            lambda: bucket.list(""),
            lambda: bucket.now(),
        ):
            with self.assertRaises(StoreUnavailable) as caught:
                op()
            assert "does not exist" in str(caught.exception)
        assert not os.path.exists(root)  # never created behind the operator's back

    def test_create_makes_a_private_root(self) -> None:
        root = os.path.abspath(os.path.join(self.mktemp(), "deeper"))
        bucket = FileBucket(root, create=True)
        bucket.put("k", b"x")
        assert os.stat(root).st_mode & 0o777 == 0o700
        assert bucket.get("k").body == b"x"

    def test_fresh_root_is_an_empty_bucket(self) -> None:
        root = os.path.abspath(self.mktemp())
        os.makedirs(root)
        bucket = FileBucket(root)
        assert bucket.list("") == []
        with self.assertRaises(NotFound):
            bucket.get("k")
        bucket.delete("k")
        assert isinstance(bucket.now(), datetime.datetime)

    def test_root_is_a_file(self) -> None:
        root = os.path.abspath(self.mktemp())
        with open(root, "w") as f:
            f.write("not a directory")
        bucket = FileBucket(root)
        for op in (lambda: bucket.get("k"), lambda: bucket.put("k", b"x"), lambda: bucket.list("")):
            with self.assertRaises(StoreUnavailable):
                op()

    def test_unreadable_root_is_access_denied(self) -> None:
        """Run as another user in a child process (root ignores permission bits)."""
        root = os.path.abspath(self.mktemp())
        os.makedirs(root, mode=0o700)
        FileBucket(root).put("k", b"x")
        script = """
import os, sys
from lchat.objstore import AccessDenied
from lchat.objstore.file import FileBucket
if os.geteuid() == 0:  # root ignores permission bits: become nobody (after the imports)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
bucket = FileBucket(sys.argv[1])
for name, op in [("get", lambda: bucket.get("k")), ("put", lambda: bucket.put("k", b"y")),
                 ("list", lambda: bucket.list("")), ("delete", lambda: bucket.delete("k")),
                 ("now", bucket.now)]:
    try:
        op()
        print(name, "succeeded")
    except AccessDenied as e:
        print(name, "denied", e)
"""
        if os.geteuid() != 0:
            os.chmod(root, 0)
            self.addCleanup(os.chmod, root, 0o700)
        out = subprocess.run(
            [sys.executable, "-c", script, root],
            env=child_env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        lines = out.strip().splitlines()
        assert [line.split()[:2] for line in lines] == [
            [n, "denied"] for n in ("get", "put", "list", "delete", "now")
        ], out
        assert root in lines[0]
        assert FileBucket(root).get("k").body == b"x"

    def test_lock_held_elsewhere_is_unavailable_not_a_hang(self) -> None:
        root = os.path.abspath(self.mktemp())
        os.makedirs(root)
        bucket = FileBucket(root, lock_timeout=0.2)
        bucket.put("k", b"x")
        stripe = zlib.crc32(b"k") % filemod.LOCK_STRIPES
        fd = os.open(os.path.join(root, "locks", f"{stripe:02x}"), os.O_RDWR)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        with self.assertRaises(StoreUnavailable):
            bucket.put("k", b"y")
        assert time.monotonic() - started < 2
        assert bucket.get("k").body == b"x"  # readers never wait for the lock
        fcntl.flock(fd, fcntl.LOCK_UN)
        bucket.put("k", b"y")


class ClockTests(Base):
    def test_last_modified_never_goes_back(self) -> None:
        now = [1_700_000_000.0]
        fake = type(
            "FakeTime",
            (),
            {
                "time": staticmethod(lambda: now[0]),
                "monotonic": staticmethod(time.monotonic),
                "sleep": staticmethod(time.sleep),
            },
        )
        self.patch(filemod, "time", fake)
        self.bucket.put("k", b"1")
        first = self.bucket.head("k").last_modified
        assert first == datetime.datetime.fromtimestamp(1_700_000_000, datetime.UTC)
        now[0] -= 3600  # the machine's clock steps back an hour
        self.bucket.put("k", b"2")
        assert self.bucket.head("k").last_modified == first
        self.bucket.put("other", b"x")  # a new key simply takes the clock
        assert self.bucket.head("other").last_modified < first


class AsyncSeamTests(unittest.TestCase):
    def test_every_call_goes_through_run_in_thread(self) -> None:
        root = os.path.abspath(self.mktemp())
        os.makedirs(root)
        calls: list[Callable[[], Any]] = []

        def run(f: Callable[[], Any]) -> Deferred[Any]:
            calls.append(f)
            return succeed(f())

        store = FileStore(reactor, root, run_in_thread=run)

        async def exercise() -> None:
            await store.put("k", b"x")
            await store.get("k")
            await store.head("k")
            await store.list("")
            await store.copy("k", "k2")
            await store.delete("k2")
            await store.now()
            dest = os.path.join(root, "dest")
            await store.get_to_file("k", dest)
            await store.put_file("k3", dest)

        d = Deferred.fromCoroutine(exercise())
        self.successResultOf(d)
        assert len(calls) == 9
        assert store.describe() == f"file:{root}"

    def test_a_hung_disk_times_out(self) -> None:
        clock = Clock()
        store = FileStore(clock, "/nowhere", run_in_thread=lambda f: Deferred(), timeout=5.0)
        d = Deferred.fromCoroutine(store.head("k"))
        self.assertNoResult(d)
        clock.advance(5)
        self.failureResultOf(d, StoreUnavailable)

    async def test_root_vanishes_mid_upload(self) -> None:
        """A streamed put_file whose root disappears half way: StoreUnavailable, nothing left."""
        base = os.path.abspath(self.mktemp())  # noqa: ASYNC240  (no I/O: a string)
        root = os.path.join(base, "bucket")
        os.makedirs(root)
        store = FileStore(reactor, root, run_in_thread=thread_runner(reactor))
        fifo = os.path.join(base, "fifo")
        os.mkfifo(fifo)
        upload = Deferred.fromCoroutine(store.put_file("space/db", fifo))
        # Opening the write end blocks until the store's thread opened the read end.
        w = await _in_thread(lambda: open(fifo, "wb"))
        with w:
            w.write(b"x" * (2 * 1024 * 1024))
            w.flush()
            os.rename(root, root + ".unmounted")
            w.write(b"y" * 1024)
        with self.assertRaises(StoreUnavailable) as caught:
            await upload
        assert "does not exist" in str(caught.exception)
        os.rename(root + ".unmounted", root)
        assert await store.list("") == []

    async def test_run_in_thread_default_uses_threads(self) -> None:
        root = os.path.abspath(self.mktemp())  # noqa: ASYNC240  (no I/O: a string)
        os.makedirs(root)
        import threading

        seen: list[str] = []
        store = FileStore(reactor, root, run_in_thread=thread_runner(reactor))
        original = FileBucket.put

        def spy(*args: Any, **kwargs: Any) -> Any:
            seen.append(threading.current_thread().name)
            return original(*args, **kwargs)

        self.patch(FileBucket, "put", spy)
        await store.put("k", b"x")
        assert seen and seen[0] != threading.main_thread().name


def _in_thread(f: Callable[[], Any]) -> Deferred[Any]:
    from twisted.internet.threads import deferToThreadPool

    return deferToThreadPool(reactor, reactor.getThreadPool(), f)


class ConcurrencyInProcessTests(Base):
    def test_many_threads_one_key(self) -> None:
        """Threads race create-only on one key through separate lock descriptors: one winner."""
        import threading

        results: list[str] = []
        barrier = threading.Barrier(8)

        def attempt(i: int) -> None:
            barrier.wait()
            try:
                self.bucket.put("k", str(i).encode(), if_none_match=True)
                results.append("won")
            except PreconditionFailed:
                results.append("lost")

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["lost"] * 7 + ["won"]

    def test_readers_see_whole_versions(self) -> None:
        """A reader racing writers and deletes sees a whole version or NotFound, never a mix."""
        import threading

        bodies = {bytes([c]) * 300_000 for c in b"abc"}
        stop = threading.Event()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                for i in range(150):
                    if i % 10 == 9:
                        self.bucket.delete("k")
                    else:
                        self.bucket.put("k", sorted(bodies)[i % 3])
            except BaseException as e:
                errors.append(e)
            finally:
                stop.set()

        writer = threading.Thread(target=write)
        writer.start()
        reads = 0
        while not stop.is_set():
            try:
                got = self.bucket.get("k")
            except NotFound:
                continue
            assert got.body in bodies and got.info.size == len(got.body)
            reads += 1
        writer.join()
        assert not errors, errors
        assert reads > 0

    def test_pruning_races_writers_in_the_same_directory(self) -> None:
        """Deletes prune empty directories while other keys are written into them: no errors."""
        import threading

        errors: list[BaseException] = []

        def churn(key: str) -> None:
            try:
                for _ in range(150):
                    self.bucket.put(key, b"x")
                    assert self.bucket.get(key).body == b"x"
                    self.bucket.delete(key)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=churn, args=(k,)) for k in ("p/q/a", "p/q/b", "p/r")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert self.bucket.list("") == []
        assert os.listdir(os.path.join(self.root, "objects")) == []

    def test_delete_prunes_and_racing_writer_recovers(self) -> None:
        self.bucket.put("a/b/c/d", b"x")
        self.bucket.delete("a/b/c/d")
        assert os.listdir(os.path.join(self.root, "objects")) == []
        self.bucket.put("a/b/c/d", b"y")  # directories made again
        assert self.bucket.get("a/b/c/d").body == b"y"
