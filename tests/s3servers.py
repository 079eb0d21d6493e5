"""Real S3 servers for tests, started on free loopback ports: moto's server and SeaweedFS.

Reusable by any test that needs a bucket (the conformance suite, the lease, the replicator):

    for kind in KINDS:                        # "moto", "seaweedfs"
        server = await shared_server(kind)    # started once per test process, killed at exit
        bucket = await server.new_bucket()    # a fresh, empty bucket per test keeps tests apart
        store = store_for(server, bucket)     # an S3Store signed for it (S3Store kwargs pass on)
        # server.endpoint, server.bucket, server.credentials, server.region, server.client()

    server = await start_server("seaweedfs")  # a private server a test may kill and restart
    server.pause(); server.resume()           # SIGSTOP/SIGCONT: a hung store
    await server.stop()                       # SIGKILL to its process group; idempotent
    await server.start()                      # same port (and, for SeaweedFS, same data)
    await server.destroy()                    # stop and remove its directory; idempotent

Both servers check signatures: moto is switched into its IAM-auth mode once its user and bucket exist
(so a wrong secret is refused), SeaweedFS gets a static identity through ``-s3.config``. A moto restart
loses every object and key (it keeps everything in memory); ``start()`` provisions it again and updates
``credentials`` *in place* (botocore ``Credentials`` is mutable), so a store built on them keeps working.

Everything blocking (spawning, polling the port, boto3 calls) has a synchronous form (``*_sync``, usable
from ``setUpClass`` and ``atexit``) and an async form that runs it in the reactor's thread pool.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Literal

import boto3  # type: ignore[import-untyped]
import botocore.config  # type: ignore[import-untyped]
import botocore.credentials  # type: ignore[import-untyped]

from lchat.objstore.s3 import S3Store
from lchat.reactors import installed
from lchat.threads import thread_runner

Kind = Literal["moto", "seaweedfs"]
KINDS: tuple[Kind, ...] = ("moto", "seaweedfs")
REGION = "us-east-1"
BIN = os.path.dirname(sys.executable)  # the venv's bin: moto_server and weed live beside python
START_TIMEOUT = 30.0

_bucket_counter = itertools.count()


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports nobody listens on right now (held open together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def _in_thread(f: Any, *args: Any) -> Any:
    return await thread_runner(installed())(f, *args)


class ServerLifecycle:
    """The async side and the log of a test server process whose ``start_sync``/``stop_sync``/
    ``destroy_sync`` block; it logs to ``<dir>/server.log``. Shared with tests/acmeservers.py."""

    dir: str

    def start_sync(self) -> None:
        raise NotImplementedError

    def stop_sync(self) -> None:
        raise NotImplementedError

    def destroy_sync(self) -> None:
        raise NotImplementedError

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(os.path.join(self.dir, "server.log"), "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    async def start(self) -> None:
        await _in_thread(self.start_sync)

    async def stop(self) -> None:
        await _in_thread(self.stop_sync)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def destroy(self) -> None:
        await _in_thread(self.destroy_sync)


class S3Server(ServerLifecycle):
    """One S3 server process. ``endpoint``, ``bucket``, ``credentials`` and ``region`` are what a client needs."""

    def __init__(self, kind: Kind) -> None:
        self.kind: Kind = kind
        self.region = REGION
        self.dir = tempfile.mkdtemp(prefix=f"lchat-{kind}-")
        self.bucket = f"lchat-test-{kind}"
        self.credentials = botocore.credentials.Credentials("", "")
        self._proc: subprocess.Popen[bytes] | None = None
        self._destroyed = False
        if kind == "moto":
            (self.port,) = free_ports(1)
            self._ports: list[int] = [self.port]
        else:
            self._ports = self._seaweed_ports()
            self.port = self._ports[0]
            # SeaweedFS takes its identities from a file; a fresh key pair per server.
            self.credentials = botocore.credentials.Credentials(
                "AKSW" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30)
            )
            with open(os.path.join(self.dir, "s3.json"), "w") as f:
                json.dump(
                    {
                        "identities": [
                            {
                                "name": "lchat",
                                "credentials": [
                                    {
                                        "accessKey": self.credentials.access_key,
                                        "secretKey": self.credentials.secret_key,
                                    }
                                ],
                                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                            }
                        ]
                    },
                    f,
                )
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __repr__(self) -> str:
        return f"<S3Server {self.kind} {self.endpoint} running={self.running}>"

    # -- process ---------------------------------------------------------------------------------

    @staticmethod
    def _seaweed_ports() -> list[int]:
        # weed mini opens master, volume, filer, s3 (each with a gRPC port) and an admin server (its
        # web UI off, WebDAV, Iceberg and Lance off; no metrics or debug port unless asked). Its
        # plugin worker dials the admin gRPC at admin-http-port + 10000 whatever -admin.port.grpc says,
        # so we pick an admin port whose +10000 neighbour is free too and pass that explicitly.
        for _ in range(50):
            ports = free_ports(9)
            admin = next((p for p in ports if p + 10000 < 65536 and port_is_free(p + 10000)), None)
            if admin is None:
                continue
            rest = [p for p in ports if p != admin]
            return [*rest, admin]
        raise RuntimeError("no free port pair for the SeaweedFS admin server")

    def _argv(self) -> list[str]:
        if self.kind == "moto":
            return [os.path.join(BIN, "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]
        s3, s3g, master, masterg, volume, volumeg, filer, filerg, admin = self._ports
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=True)
        return [
            os.path.join(BIN, "weed"),
            f"-logdir={self.dir}",  # its log files, else left in /tmp by every server
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3g}",
            f"-master.port={master}",
            f"-master.port.grpc={masterg}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volumeg}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filerg}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin + 10000}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # AWS refuses a PUT into a missing bucket; SeaweedFS would create it for an admin identity.
            "-s3.autoCreateBucket=false",
            f"-s3.config={os.path.join(self.dir, 's3.json')}",
            f"-filer.localSocket={os.path.join(self.dir, 'filer.sock')}",
            f"-s3.localSocket={os.path.join(self.dir, 's3.sock')}",
            f"-bucket={self.bucket}",
        ]

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _answers(self) -> bool:
        return port_answers(self.port)

    def start_sync(self) -> None:
        """Spawn the server (no-op if running), wait until its S3 port answers, provision it."""
        if self._destroyed:
            raise RuntimeError("this server was destroyed")
        if self.running:
            return
        log = open(os.path.join(self.dir, "server.log"), "ab")  # the child inherits it
        try:
            self._proc = subprocess.Popen(
                self._argv(),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() kills everything it forked
            )
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop_sync()
                raise RuntimeError(f"{self.kind} did not start on {self.endpoint}:\n{tail}")
            time.sleep(0.05)
        if self.kind == "moto":
            self._provision_moto()
        else:
            self._wait_for_seaweed_bucket(deadline)

    def stop_sync(self) -> None:
        """Kill the server's whole process group at once (a crash, not a shutdown). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if self.kind == "seaweedfs":
            # weed leaves unix sockets named after its gRPC ports in /tmp; ours only, by exact name.
            for name in ("master", "volume", "filer", "s3", "admin"):
                for port in [*self._ports, self._ports[-1] + 10000]:
                    with contextlib.suppress(OSError):
                        os.unlink(f"/tmp/seaweedfs-{name}-grpc-{port}.sock")

    def destroy_sync(self) -> None:
        """Stop and remove the data directory; the object cannot be started again."""
        self.stop_sync()
        self._destroyed = True
        shutil.rmtree(self.dir, ignore_errors=True)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open, nothing answers (a hung store). Returns
        once every thread of it has stopped: a stop reaches each thread of a multi-threaded
        server (SeaweedFS is Go) only when it next enters the kernel, and a request sent in that
        window would still be answered."""
        assert self._proc is not None
        os.killpg(self._proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not _all_threads_stopped(self._proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self!r} did not stop within 5 s of SIGSTOP")
            time.sleep(0.002)

    def resume(self) -> None:
        assert self._proc is not None
        os.killpg(self._proc.pid, signal.SIGCONT)

    # -- provisioning and helpers ----------------------------------------------------------------

    def client(self, service: str = "s3") -> Any:
        """A boto3 client for setting up and checking state outside the store under test."""
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.credentials.access_key or "unauthenticated",
            aws_secret_access_key=self.credentials.secret_key or "unauthenticated",
            config=botocore.config.Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 3, "mode": "standard"},
                connect_timeout=5,
                read_timeout=30,
            ),
        )

    def _provision_moto(self) -> None:
        # moto starts with authentication off: create an all-powerful IAM user and the bucket, then
        # switch authentication on (POST /moto-api/reset-auth with 0 unauthenticated actions left).
        iam = self.client("iam")
        iam.create_user(UserName="lchat")
        iam.put_user_policy(
            UserName="lchat",
            PolicyName="all",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName="lchat")["AccessKey"]
        self.client().create_bucket(Bucket=self.bucket)
        import urllib.request

        req = urllib.request.Request(  # noqa: S310  (http on loopback, a URL we built)
            f"{self.endpoint}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "application/octet-stream"},  # else it is parsed as a form
        )
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310  (loopback, our own URL)
            resp.read()
        # In place: a store holding this object signs with the new key after a restart.
        self.credentials.access_key = key["AccessKeyId"]
        self.credentials.secret_key = key["SecretAccessKey"]

    def _wait_for_seaweed_bucket(self, deadline: float) -> None:
        # The S3 port opens before -bucket has created the bucket (and before the filer is wired up).
        s3 = self.client()
        while True:
            try:
                s3.head_bucket(Bucket=self.bucket)
                return
            except Exception:
                if time.monotonic() > deadline or not self.running:
                    raise
                time.sleep(0.05)

    def new_bucket_sync(self, name: str | None = None) -> str:
        name = name or f"lchat-{os.getpid()}-{next(_bucket_counter)}-{secrets.token_hex(3)}"
        self.client().create_bucket(Bucket=name)
        return name

    async def new_bucket(self, name: str | None = None) -> str:
        """Create and return a fresh empty bucket (a test's private namespace)."""
        result: str = await _in_thread(self.new_bucket_sync, name)
        return result


_shared: dict[Kind, S3Server] = {}
_shared_lock = threading.Lock()  # callers may race from the reactor's thread pool


def shared_server_sync(kind: Kind) -> S3Server:
    """The process-wide server of ``kind``, started on first use and killed when the process exits.

    Tests must not stop it (use :func:`start_server` for a private one) and should work in their own
    bucket (:meth:`S3Server.new_bucket`). If an earlier test left it dead, it is started again.
    """
    with _shared_lock:
        server = _shared.get(kind)
        if server is None:
            server = _shared[kind] = S3Server(kind)
            atexit.register(server.destroy_sync)
        server.start_sync()
        return server


async def shared_server(kind: Kind) -> S3Server:
    result: S3Server = await _in_thread(shared_server_sync, kind)
    return result


def store_for(server: S3Server, bucket: str | None = None, **kwargs: Any) -> S3Store:
    """An :class:`S3Store` on ``server`` (its default bucket unless told), path-style, signed with
    the server's credentials. Keyword arguments go to ``S3Store`` (``timeout``, ``retries``, ...).
    The caller closes it (``addCleanup(store.close)``)."""
    reactor = installed()
    options: dict[str, Any] = {
        "endpoint": server.endpoint,
        "region": server.region,
        "credentials": server.credentials,
        "timeout": 10.0,
        "retries": 2,
        "run_in_thread": thread_runner(reactor),
        "monotonic": time.monotonic,
        **kwargs,
    }
    return S3Store(reactor, bucket or server.bucket, **options)


async def start_server(kind: Kind) -> S3Server:
    """A private server (the caller destroys it, e.g. ``self.addCleanup(server.destroy)``)."""
    server = S3Server(kind)
    try:
        await server.start()
    except BaseException:
        await server.destroy()
        raise
    return server


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in the stopped state (``T``), as /proc shows it."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone: nothing answers either
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("T", "t"):
            return False
    return True
