"""A world of real routers, each in a Linux network namespace of its own, whose links a test cuts
(issue 28, "tests with real cuts"). Needs root and ``ip`` (iproute2); no iptables, nft or tc.

The layout, one world per test process at a time (several may run in parallel: every name and the
/24 are the world's own)::

    root namespace: the test, its clients, a bridge lmb<id> at 10.A.B.1/24
      +-- veth -- namespace lchatmn-<id>-box0:   router + its spaces, 10.A.B.10:8443
      +-- veth -- namespace lchatmn-<id>-box1:   router + its spaces, 10.A.B.11:8443
      +-- veth -- namespace lchatmn-<id>-bucket: moto or SeaweedFS, 10.A.B.9:<port>

A cut between two namespaces is a silent blackhole both ways without a firewall: each side gets a
permanent neighbour entry sending the other's address to a MAC nobody has, so packets vanish
(connects and established connections time out, nothing is refused). The clients in the root
namespace are never cut: they reach every box through the bridge. Usage::

    world = MeshWorld(boxes=2, kind="moto", spaces_per_box=2, settings={...})
    world.start()                         # network, bucket server, routers: every box sees all
    world.wake_all()                      # every space woken by a first POST (on its owner)
    load = Load(world).start()            # numbered POSTs to every space through every box
    time.sleep(3)
    load.mark("cut"); world.isolate(world.boxes[0])      # or cut(a, b), cut_bucket(box),
    time.sleep(10)                                        # freeze_bucket(), kill(box) ...
    load.mark("heal"); world.rejoin(world.boxes[0])       # heal(a, b), heal_bucket(box), ...
    load.wait_served("heal", timeout=20)
    result = load.finish()                # stop, read every space back, count
    assert not result.lost(), result.summary() + world.logs()
    world.settle()                        # everything healed, every box live, every space served
    world.close()                         # routers, bucket server, namespaces, bridge, files

Everything blocks (call it from a thread under trial: ``deferToThread``). ``close`` tears it all
down; a world whose process died without closing it is reaped by the next world created on this
machine (its state file under /run/lchat-meshnet names its owner's pid).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import functools
import http.client
import ipaddress
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lchat.cli.dev_cert import make_dev_certs
from lchat.hosts import normalise_member_url
from lchat.mesh import placement
from tests import s3servers
from tests.routerproc import ROOT, kill_spaces_under
from tests.test_mesh import DOMAIN, TOKEN, Box

STATE_DIR = "/run/lchat-meshnet"
NS_PREFIX = "lchatmn-"
BRIDGE_PREFIX = "lmb"
VETH_PREFIX = "lmv"
INNER_IF = "mn0"  # each namespace's end of its veth
BLACKHOLE_MAC = "02:00:00:00:00:01"  # a cut sends the peer's address here: nobody has it
BOX_PORT = 8443  # every box listens on its own namespace's address, so one port for all
ROOM = "load"

# The settings every world's routers get (before the bucket, the mesh names and the CA, which the
# world fills in). A world's ``settings`` and a box's ``box_settings`` override them; a value of
# None removes a key. Mesh timing scaled as in tests/test_mesh.py.
DEFAULT_SETTINGS: dict[str, str | None] = {
    "LCHAT_HIBERNATE_IDLE": "10m",  # nothing sleeps during a world's life
    "LCHAT_LEASE_TTL": "10m",  # failover by box liveness, never by a lease's TTL
    "LCHAT_MESH_HEARTBEAT": "300ms",
    "LCHAT_MESH_DEAD_AFTER": "1500ms",
    "LCHAT_ACME_DIRECTORY": "off",  # the certificates are placed by the world
}


# -- the network ---------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


_unavailable: list[str | None] = []


def unavailable() -> str | None:
    """Why namespaces cannot be used here (not root, no ``ip``, ``ip netns`` refused), or None."""
    if _unavailable:
        return _unavailable[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "needs root (network namespaces, a bridge, veth pairs)"
    elif shutil.which("ip") is None:
        reason = "needs ip (iproute2)"
    else:
        probe = f"{NS_PREFIX}probe-{os.getpid()}"
        try:
            _ip("netns", "add", probe)
            _ip("netns", "exec", probe, "ip", "link", "set", "lo", "up")
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            reason = f"ip netns does not work here: {e}"
        finally:
            _ip("netns", "del", probe, check=False)
    _unavailable.append(reason)
    return reason


@dataclass
class Node:
    """One namespace: a box's or the bucket server's."""

    name: str
    ns: str
    ip: str
    veth: str  # the root namespace's end, enslaved to the bridge

    def argv(self, argv: Iterable[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def pids(self) -> list[int]:
        proc = _ip("netns", "pids", self.ns, check=False)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(os.path.join(STATE_DIR, "lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in ``ns``, wait for them, delete it."""
    deadline = time.monotonic() + 10
    while True:
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)


def _teardown(state: dict[str, Any]) -> None:
    for ns in state.get("namespaces", []):
        _kill_namespace(ns)
    for veth in state.get("veths", []):
        _ip("link", "del", veth, check=False)  # gone with its namespace, unless a process lingers
    if state.get("bridge"):
        _ip("link", "del", state["bridge"], check=False)
    for path in state.get("dirs", []):
        if path.startswith(tempfile.gettempdir() + os.sep):
            shutil.rmtree(path, ignore_errors=True)


def _reap_stale() -> None:
    """Tear down what worlds of dead processes left (under the lock): their state files first,
    then any namespace or bridge of ours that no state file names (a crash mid-creation)."""
    named: set[str] = set()
    for entry in sorted(os.listdir(STATE_DIR)):
        if not entry.endswith(".json"):
            continue
        path = os.path.join(STATE_DIR, entry)
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            os.unlink(path)
            continue
        if _start_time(int(state.get("pid", 0))) == state.get("start"):
            named.update(state.get("namespaces", []))
            named.add(state.get("bridge", ""))
            continue
        _teardown(state)
        os.unlink(path)
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        probe = re.fullmatch(re.escape(NS_PREFIX) + r"probe-(\d+)", ns)
        if probe and os.path.exists(f"/proc/{probe.group(1)}"):
            continue  # another process's availability probe, under way
        if ns.startswith(NS_PREFIX) and ns not in named:
            _kill_namespace(ns)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.match(r"\d+: (\S+?)[:@]", line)
        if m and m.group(1).startswith(BRIDGE_PREFIX) and m.group(1) not in named:
            _ip("link", "del", m.group(1), check=False)


def _free_subnet() -> str:
    """A /24 in 10.200.0.0-10.250.255.0 that no world, address or route of this machine uses."""
    used: list[ipaddress.IPv4Network] = []
    for entry in os.listdir(STATE_DIR):
        if entry.endswith(".json"):
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(STATE_DIR, entry)) as f,
            ):
                used.append(ipaddress.IPv4Network(json.load(f)["subnet"] + ".0/24"))
    for line in _ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            used.append(ipaddress.IPv4Interface(m.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
            dest = line.split()[1] if dest != "default" and len(line.split()) > 1 else ""
        with contextlib.suppress(ValueError):
            net = ipaddress.IPv4Network(dest, strict=False)
            if net.prefixlen > 0:
                used.append(net)
    start = secrets.randbelow(51 * 256)
    for k in range(51 * 256):
        i = (start + k) % (51 * 256)
        candidate = ipaddress.IPv4Network(f"10.{200 + i // 256}.{i % 256}.0/24")
        if not any(candidate.overlaps(u) for u in used):
            return str(candidate.network_address).rsplit(".", 1)[0]
    raise RuntimeError("no free /24 in 10.200.0.0/16-10.250.0.0/16")


class Network:
    """A bridge, one namespace per node, a veth pair each; cuts as blackholing neighbour entries."""

    def __init__(self, names: list[str]) -> None:
        self.closed = False
        self.cuts: set[frozenset[str]] = set()
        with _locked():
            _reap_stale()
            wid = secrets.token_hex(3)
            self.wid = wid
            self.subnet = _free_subnet()
            self.bridge = f"{BRIDGE_PREFIX}{wid}"
            self.gateway = f"{self.subnet}.1"
            self.nodes = {
                name: Node(name, f"{NS_PREFIX}{wid}-{name}", f"{self.subnet}.{9 + i}", "")
                for i, name in enumerate(names)
            }
            for i, node in enumerate(self.nodes.values()):
                node.veth = f"{VETH_PREFIX}{wid}{i}"  # at most 3 + 6 + 2 = 11 characters
            self.state_file = os.path.join(STATE_DIR, f"{wid}.json")
            self.state: dict[str, Any] = {
                "pid": os.getpid(),
                "start": _start_time(os.getpid()),
                "subnet": self.subnet,
                "bridge": self.bridge,
                "namespaces": [n.ns for n in self.nodes.values()],
                "veths": [n.veth for n in self.nodes.values()],
                "dirs": [],
            }
            self._write_state()
            try:
                self._create()
            except BaseException:
                self.close()
                raise

    def _write_state(self) -> None:
        tmp = self.state_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.state, f)
        os.replace(tmp, self.state_file)

    def own(self, path: str) -> None:
        """``path`` (a temporary directory) goes with this network when a later world reaps it
        (this process died without closing it)."""
        with _locked():
            self.state["dirs"].append(path)
            self._write_state()

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node in self.nodes.values():
            _ip("netns", "add", node.ns)
            _ip(
                "link", "add", node.veth, "type", "veth", "peer", "name", INNER_IF, "netns", node.ns
            )
            _ip("link", "set", node.veth, "master", self.bridge, "up")
            _ip("-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", INNER_IF)
            _ip("-n", node.ns, "link", "set", INNER_IF, "up")
            _ip("-n", node.ns, "link", "set", "lo", "up")

    def _blackhole(self, a: Node, b: Node, on: bool) -> None:
        if on:
            _ip(
                "-n",
                a.ns,
                "neigh",
                "replace",
                b.ip,
                "lladdr",
                BLACKHOLE_MAC,
                "dev",
                INNER_IF,
                "nud",
                "permanent",
            )
        else:
            _ip("-n", a.ns, "neigh", "del", b.ip, "dev", INNER_IF, check=False)

    def cut(self, a: str, b: str) -> None:
        """No packet between ``a`` and ``b``, either way, from now on (silent: no RST, no ICMP)."""
        x, y = self.nodes[a], self.nodes[b]
        self._blackhole(x, y, True)
        self._blackhole(y, x, True)
        self.cuts.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        x, y = self.nodes[a], self.nodes[b]
        self._blackhole(x, y, False)
        self._blackhole(y, x, False)
        self.cuts.discard(frozenset((a, b)))

    def heal_all(self) -> None:
        for pair in list(self.cuts):
            a, b = sorted(pair)
            self.heal(a, b)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _teardown(
            {
                "namespaces": [n.ns for n in self.nodes.values()],
                "veths": [n.veth for n in self.nodes.values()],
                "bridge": self.bridge,
            }
        )
        with contextlib.suppress(OSError):
            os.unlink(self.state_file)


# -- the bucket server in its namespace ----------------------------------------------------------


class NsS3Server(s3servers.S3Server):
    """tests/s3servers.py's moto or SeaweedFS server, run inside ``node``'s namespace and bound to
    its address: a dedicated server (freezing it freezes nobody else's tests)."""

    def __init__(self, kind: s3servers.Kind, node: Node) -> None:
        super().__init__(kind)
        self.node = node
        self.endpoint = f"http://{node.ip}:{self.port}"

    def _argv(self) -> list[str]:
        return self.node.argv(a.replace("127.0.0.1", self.node.ip) for a in super()._argv())

    def _answers(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            try:
                s.connect((self.node.ip, self.port))
            except OSError:
                return False
        return True


def weed_available() -> bool:
    return os.access(os.path.join(s3servers.BIN, "weed"), os.X_OK)


# -- certificates --------------------------------------------------------------------------------


def ip_certificate(certs: str, ca_path: str, address: str, out: str) -> None:
    """``out``: a key and a certificate for IP ``address`` signed by the dev CA in ``certs`` (a
    box's ``default.pem``: the mesh API at https://<address>:port, no SNI), mode 0600. As
    tests/test_mesh.py's ``_ip_certificate``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    with open(os.path.join(certs, "dev-ca.key"), "rb") as f:
        ca_key = serialization.load_pem_private_key(f.read(), password=None)
    with open(ca_path, "rb") as f:
        ca = x509.load_pem_x509_certificate(f.read())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ) + cert.public_bytes(serialization.Encoding.PEM)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, pem)
    os.close(fd)


# -- boxes ---------------------------------------------------------------------------------------


# MeshWorld(precise_logs=True): the routers log through this twistd ``--logger`` instead of
# twistd's own observer: the same lines, their times with milliseconds
# (2026-12-04T22:55:02.123+0000). It is defined in the router's ``-c`` program (as
# ``__main__.precise_observer``): a module imported for it would import the reactor before the
# router installs its own.
PRECISE_OBSERVER = """
def precise_observer():
    import os, time
    from twisted.logger import FileLogObserver, formatEventAsClassicLogText

    def stamp(t):
        if t is None:
            return "-"
        local = time.localtime(t)
        return (
            time.strftime("%Y-%m-%dT%H:%M:%S", local)
            + ".%03d" % int(t % 1 * 1000)
            + time.strftime("%z", local)
        )

    out = os.fdopen(os.dup(1), "w", buffering=1)  # twistd points sys.stdout at the log
    return FileLogObserver(out, lambda e: formatEventAsClassicLogText(e, formatTime=stamp))
"""


class NsBox(Box):
    """tests/test_mesh.py's Box, its router (and so its spaces) run inside ``node``'s namespace,
    listening on the namespace's address, which is also its LCHAT_MESH_SELF."""

    def __init__(self, root: str, name: str, node: Node, port: int = BOX_PORT) -> None:
        super().__init__(root, name, node.ip, port)
        self.node = node
        self.settings: dict[str, str] = {}
        self.environ: dict[str, str] = {}  # extra environment (the bucket's credentials)
        self.starts = 0
        self.precise_logs = False  # log times with milliseconds (PRECISE_OBSERVER)

    def start(self, settings: dict[str, str] | None = None) -> None:
        if settings is not None:
            self.settings = settings
        self.write_env(self.settings)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
        env.update(self.environ)
        env["PYTHONPATH"] = ROOT
        env.setdefault("LCHAT_WORKERS", "1")  # one process a box (the default: one a core)
        self.starts += 1
        with open(os.path.join(self.dir, "router.log"), "ab") as log:
            log.write(f"===== meshnet: start #{self.starts} of {self.name} =====\n".encode())
            log.flush()
            program = "from twisted.scripts.twistd import run; run()"
            logger: list[str] = []
            if self.precise_logs:
                program = PRECISE_OBSERVER + "\n" + program
                logger = ["--logger=__main__.precise_observer"]
            self.proc = subprocess.Popen(
                self.node.argv(
                    [
                        sys.executable,
                        "-c",
                        program,
                        "--nodaemon",
                        "--pidfile=",
                        *logger,
                        "lchat",
                        "--env-file",
                        self.env_file,
                    ]
                ),
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        """SIGKILL the router and every space: every process in the namespace (as a box's power
        loss). The namespace and its address stay."""
        for _ in range(50):
            pids = self.node.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        kill_spaces_under(self.dir)
        if self.proc is not None:
            self.proc.wait()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def admin_get(self, path: str, timeout: float = 3.0) -> tuple[int, bytes]:
        return self.admin_call("GET", path, timeout)

    def status(self) -> dict[str, Any]:
        _, body = self.admin_get("/status")
        result: dict[str, Any] = json.loads(body)
        return result

    def metrics(self) -> str:
        return self.admin_get("/metrics")[1].decode("utf-8", "replace")

    def replica_lag(self) -> float | None:
        """The largest ``lchat_replica_lag_seconds`` of this box's awake spaces (None: none)."""
        values = [
            float(m.group(1))
            for m in re.finditer(
                r"^lchat_replica_lag_seconds\{[^}]*\} (\S+)$", self.metrics(), re.MULTILINE
            )
        ]
        return max(values) if values else None

    def log_lines(self) -> list[str]:
        try:
            return self.log().splitlines()
        except OSError:
            return []


# -- the world -----------------------------------------------------------------------------------


NOTABLE = (
    "stand",  # standing every space down, standing down: isolated
    "holder dead",
    "restarted (epoch",
    "took the lease",
    "taken over",
    "restored",
    "keeping the local db",
    "new epoch",
    "landed again",
    "lands in the bucket again",
    "member gone",
    "member joined",
    "stale",
    "reseed",
    "peers' word",
    "relay",
    "witness",
    "isolated",
    "#critical",
    "#error",
)

_worlds = itertools.count()


class MeshWorld:
    """Routers in namespaces on one bucket server in its own namespace; see the module's doc."""

    def __init__(
        self,
        boxes: int = 2,
        kind: s3servers.Kind = "moto",
        spaces_per_box: int = 2,
        settings: dict[str, str | None] | None = None,
        box_settings: dict[str, dict[str, str | None]] | None = None,
        root: str | None = None,
        precise_logs: bool = False,
    ) -> None:
        self.n = boxes
        self.precise_logs = precise_logs  # router log times with milliseconds
        self.kind: s3servers.Kind = kind
        self.spaces_per_box = spaces_per_box
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.box_settings = box_settings or {}
        self.root = root or tempfile.mkdtemp(prefix=f"meshnet{next(_worlds)}-", dir="/tmp")
        self.net: Network | None = None
        self.server: NsS3Server | None = None
        self.boxes: list[NsBox] = []
        self.hosts: list[str] = []
        self.frozen = False
        self.ca = ""
        self.bucket = ""
        self.closed = False
        atexit.register(self.close)

    def __repr__(self) -> str:
        net = self.net
        return f"<MeshWorld {self.n} boxes, {self.kind}, {net.subnet + '.0/24' if net else '-'}>"

    # -- start and stop ---------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> MeshWorld:
        """Create the network, the bucket server and the routers (each box's registry knows every
        space); return once every box answers and sees every box live."""
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, timeout: float) -> None:
        names = ["bucket", *(f"box{i}" for i in range(self.n))]
        self.net = Network(names)
        self.net.own(self.root)
        bucket_node = self.net.nodes["bucket"]
        self.server = NsS3Server(self.kind, bucket_node)
        self.net.own(self.server.dir)
        self.server.start_sync()
        self.bucket = self.server.new_bucket_sync()
        certs = os.path.join(self.root, "certs")
        self.ca, _, _ = make_dev_certs(certs, ["*." + DOMAIN])
        wildcard = os.path.join(certs, f"wildcard-{DOMAIN}.pem")
        self.boxes = [NsBox(self.root, f"box{i}", self.net.nodes[f"box{i}"]) for i in range(self.n)]
        for box in self.boxes:
            box.precise_logs = self.precise_logs
            os.makedirs(box.acme, mode=0o700)
            shutil.copy(wildcard, box.acme)
            os.chmod(os.path.join(box.acme, os.path.basename(wildcard)), 0o600)
            ip_certificate(certs, self.ca, box.address, os.path.join(box.acme, "default.pem"))
            box.environ = {
                "AWS_ACCESS_KEY_ID": self.server.credentials.access_key,
                "AWS_SECRET_ACCESS_KEY": self.server.credentials.secret_key,
            }
            box.settings = self.box_config(box)
        self.hosts = self._spread_hosts()
        for box in self.boxes:
            for host in self.hosts:
                box.add_space(host)
        for box in self.boxes:
            box.start()
        self.wait_ready(timeout)

    def box_config(self, box: NsBox) -> dict[str, str]:
        """``box``'s settings: the defaults, the bucket and mesh names, the world's and the box's
        overrides (None removes a key)."""
        assert self.server is not None
        merged: dict[str, str | None] = {
            "LCHAT_HIBERNATE_BUCKET": self.bucket,
            "LCHAT_HIBERNATE_ENDPOINT": self.server.endpoint,
            "LCHAT_HIBERNATE_REGION": self.server.region,
            "LCHAT_MESH_DOMAINS": DOMAIN,
            "LCHAT_MESH_TOKEN": TOKEN,
            "LCHAT_MESH_CA_FILE": self.ca,
            **self.settings,
            **self.box_settings.get(box.name, {}),
        }
        return {k: v for k, v in merged.items() if v is not None}

    def _spread_hosts(self) -> list[str]:
        """``spaces_per_box`` space names the rendezvous hash gives to each box."""

        def owner(host: str) -> NsBox:
            return max(self.boxes, key=lambda b: placement.score(normalise_member_url(b.url), host))

        hosts: list[str] = []
        for host in (f"c{i}.{DOMAIN}" for i in range(2000)):
            if sum(1 for h in hosts if owner(h) is owner(host)) < self.spaces_per_box:
                hosts.append(host)
            if len(hosts) == self.n * self.spaces_per_box:
                break
        return sorted(hosts, key=lambda h: (self.boxes.index(owner(h)), h))

    def close(self) -> None:
        """Everything down: routers and spaces, the bucket server, namespaces, bridge, files."""
        if self.closed:
            return
        self.closed = True
        for box in self.boxes:
            with contextlib.suppress(Exception):
                box.kill()
        if self.server is not None:
            with contextlib.suppress(Exception):
                if self.frozen:
                    self.server.resume()
            with contextlib.suppress(Exception):
                self.server.destroy_sync()
        if self.net is not None:
            self.net.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- controls ---------------------------------------------------------------------------------

    def _net(self) -> Network:
        assert self.net is not None, "not started"
        return self.net

    def box(self, name: str | NsBox) -> NsBox:
        return name if isinstance(name, NsBox) else next(b for b in self.boxes if b.name == name)

    def cut(self, a: str | NsBox, b: str | NsBox) -> None:
        """Box ``a`` and box ``b`` no longer reach each other (silently); both still reach the
        bucket and their clients."""
        self._net().cut(self.box(a).name, self.box(b).name)

    def heal(self, a: str | NsBox, b: str | NsBox) -> None:
        self._net().heal(self.box(a).name, self.box(b).name)

    def cut_bucket(self, box: str | NsBox) -> None:
        """``box`` no longer reaches the bucket; its peers and clients still reach it."""
        self._net().cut(self.box(box).name, "bucket")

    def heal_bucket(self, box: str | NsBox) -> None:
        self._net().heal(self.box(box).name, "bucket")

    def isolate(self, box: str | NsBox) -> None:
        """``box`` reaches neither the bucket nor any peer; its clients still reach it."""
        name = self.box(box).name
        self._net().cut(name, "bucket")
        for other in self.boxes:
            if other.name != name:
                self._net().cut(name, other.name)

    def rejoin(self, box: str | NsBox) -> None:
        name = self.box(box).name
        self._net().heal(name, "bucket")
        for other in self.boxes:
            if other.name != name:
                self._net().heal(name, other.name)

    def freeze_bucket(self) -> None:
        """SIGSTOP the bucket server (every thread stopped when this returns): connections stay
        open, nothing answers."""
        assert self.server is not None
        self.frozen = True
        self.server.pause()

    def thaw_bucket(self) -> None:
        assert self.server is not None
        self.server.resume()
        self.frozen = False

    def kill(self, box: str | NsBox) -> None:
        """SIGKILL ``box``'s router and its spaces."""
        self.box(box).kill()

    def restart(self, box: str | NsBox, timeout: float = 30.0) -> None:
        """Start ``box``'s router again (killed first if running), with its current settings;
        returns once its admin socket answers."""
        b = self.box(box)
        if b.running():
            b.kill()
        b.start(self.box_config(b))
        _wait(lambda: _answers(b) or not b.running(), timeout, f"{b.name} to answer")
        if not b.running():
            raise AssertionError(f"{b.name} exited at start:\n{self.logs(b)}")

    def heal_all(self) -> None:
        """No cut left and the bucket thawed."""
        self._net().heal_all()
        if self.frozen:
            self.thaw_bucket()

    # -- state ------------------------------------------------------------------------------------

    def live(self, box: NsBox) -> int:
        try:
            return int(box.status().get("mesh", {}).get("live", 0))
        except (OSError, ValueError):
            return 0

    def alive(self, box: NsBox) -> bool:
        try:
            return bool(box.status().get("mesh", {}).get("alive"))
        except (OSError, ValueError):
            return False

    def holders(self) -> dict[str, list[str]]:
        """host -> the boxes that have it awake (or waking, or stopping: any state)."""
        out: dict[str, list[str]] = {h: [] for h in self.hosts}
        for box in self.boxes:
            try:
                hosts = box.status().get("hosts", {})
            except (OSError, ValueError):
                continue
            for host, entry in hosts.items():
                if host in out and entry.get("state") == "awake":
                    out[host].append(box.name)
        return out

    def holder(self, host: str) -> NsBox | None:
        names = self.holders().get(host, [])
        return self.box(names[0]) if len(names) == 1 else None

    def spaces_of(self, box: str | NsBox) -> list[str]:
        name = self.box(box).name
        return [h for h, names in self.holders().items() if name in names]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Every box answers, is alive and sees every box live."""
        for box in self.boxes:
            _wait(functools.partial(_up_or_exited, box), timeout, f"{box.name} up")
            if not box.running():
                raise AssertionError(f"{box.name} exited at start:\n{self.logs(box)}")
        _wait(
            lambda: all(self.alive(b) and self.live(b) == self.n for b in self.boxes),
            timeout,
            f"every box alive and seeing {self.n} live",
            lambda: self.logs(),
        )

    def post(self, box: NsBox, host: str, body: str, timeout: float = 20.0) -> int:
        try:
            return self.client.request(
                box,
                host,
                f"/api/rooms/{ROOM}/messages",
                "POST",
                json.dumps({"body": body}).encode(),
                timeout,
            )[0]
        except Exception:
            return 0

    @property
    def client(self) -> Client:
        return Client(self.ca)

    def wake_all(self, timeout: float = 60.0) -> dict[str, str]:
        """Every space awake on exactly one box (woken by a POST through the first box, which
        sends it to its owner), and served through every box. Returns host -> holder."""
        deadline = time.monotonic() + timeout
        pending = set(self.hosts)
        while pending and time.monotonic() < deadline:
            for host in sorted(pending):
                if self.post(self.boxes[0], host, "wake") == 201:
                    pending.discard(host)
            if pending:
                time.sleep(0.3)
        if pending:
            raise AssertionError(f"could not wake {sorted(pending)}:\n{self.logs()}")
        for box in self.boxes:
            for host in self.hosts:
                _wait(
                    functools.partial(self._served, box, host),
                    max(1.0, deadline - time.monotonic()),
                    f"{host} served through {box.name}",
                    lambda: self.logs(),
                )
        holders = self.holders()
        wrong = {h: names for h, names in holders.items() if len(names) != 1}
        if wrong:
            raise AssertionError(f"spaces not awake on exactly one box: {wrong}\n{self.logs()}")
        return {h: names[0] for h, names in holders.items()}

    def _served(self, box: NsBox, host: str) -> bool:
        return self.post(box, host, "ping") == 201

    def settle(self, timeout: float = 60.0) -> dict[str, str]:
        """Back to a clean start for the next scenario: every cut healed, the bucket thawed,
        every router running (a dead one restarted), every box live, every space served through
        every box. If that does not come within ``timeout``, every router is restarted once (a
        kill -9) and it is tried again. Returns host -> holder."""
        self.heal_all()
        for box in self.boxes:
            if not box.running():
                self.restart(box)
        try:
            self.wait_ready(timeout / 2)
            return self.wake_all(timeout / 2)
        except AssertionError:
            for box in self.boxes:
                box.kill()
            for box in self.boxes:
                with open(os.path.join(box.dir, "router.log"), "ab") as f:
                    f.write(b"===== meshnet: settle failed: every router restarted =====\n")
                self.restart(box)
            self.wait_ready(timeout)
            return self.wake_all(timeout)

    # -- logs -------------------------------------------------------------------------------------

    def logs(self, *boxes: NsBox, tail: int = 30) -> str:
        """The last ``tail`` lines of each box's router log (all boxes by default)."""
        out = []
        for box in boxes or tuple(self.boxes):
            lines = box.log_lines()
            out.append(f"--- {box.name} {box.url} (router.log, last {tail} lines)")
            out.extend(_trim(line) for line in lines[-tail:])
        return "\n".join(out)

    def notable(self, since: float | None = None, patterns: Iterable[str] = NOTABLE) -> str:
        """The router log lines of interest (stand-downs, takeovers, restores, epochs, members
        joining and leaving, tracebacks: their last line), every box, from wall-clock time
        ``since`` on (whole seconds)."""
        pats = tuple(p for p in patterns if p != "Traceback")
        out = []
        for box in self.boxes:
            at: float | None = None
            lines = box.log_lines()
            for i, line in enumerate(lines):
                stamp = _log_time(line)
                at = stamp if stamp is not None else at
                if since is not None and at is not None and at < int(since):
                    continue
                if "Traceback (most recent call last)" in line:
                    end = i + 1
                    while end < len(lines) and _log_time(lines[end]) is None:
                        end += 1
                    tail = [x.strip() for x in lines[i + 1 : end] if x.strip()]
                    last = tail[-1] if tail else ""
                    out.append(f"{box.name}: (traceback) {_trim(last)}")
                elif stamp is not None and any(p in line for p in pats):
                    out.append(f"{box.name}: {_trim(line)}")
        return "\n".join(out)

    def log_sizes(self) -> dict[str, int]:
        """Each box's router log size now (for :meth:`save_logs`)."""
        sizes = {}
        for box in self.boxes:
            try:
                sizes[box.name] = os.path.getsize(os.path.join(box.dir, "router.log"))
            except OSError:
                sizes[box.name] = 0
        return sizes

    def save_logs(self, prefix: str, since: dict[str, int] | None = None) -> list[str]:
        """Copy each box's router log (from the offsets ``since``, see :meth:`log_sizes`) to
        ``<prefix>-<box>.log``; returns the paths written."""
        paths = []
        for box in self.boxes:
            path = f"{prefix}-{box.name}.log"
            try:
                with (
                    open(os.path.join(box.dir, "router.log"), "rb") as src,
                    open(path, "wb") as dst,
                ):
                    src.seek((since or {}).get(box.name, 0))
                    shutil.copyfileobj(src, dst)
            except OSError:
                continue
            paths.append(path)
        return paths

    def count(self, pattern: str, since: float | None = None) -> dict[str, int]:
        """How many lines of each box's log contain ``pattern`` (from wall time ``since``)."""
        counts = {}
        for box in self.boxes:
            n = 0
            for line in box.log_lines():
                if pattern in line:
                    at = _log_time(line)
                    if since is None or at is None or at >= int(since):
                        n += 1
            counts[box.name] = n
        return counts


def _trim(line: str, n: int = 400) -> str:
    return line if len(line) <= n else line[:n] + " ..."


def _log_time(line: str) -> float | None:
    """A router log line's time (wall clock; with its milliseconds when it has them)."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?([+-]\d{4})", line)
    if not m:
        return None
    t = datetime.datetime.strptime(m.group(1) + m.group(3), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    return t + float(m.group(2) or 0)


def _up_or_exited(box: NsBox) -> bool:
    return _answers(box) or not box.running()


def _answers(box: NsBox) -> bool:
    try:
        box.status()
    except (OSError, ValueError, IndexError):
        return False
    return True


def _wait(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    details: Callable[[], str] | None = None,
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}"
                + (f"\n{details()}" if details else "")
            )
        time.sleep(0.1)


# -- clients -------------------------------------------------------------------------------------


class Client:
    """HTTPS to a box's address for a space (SNI and Host), verified with the world's CA; one
    connection per request, as tests/test_mesh.py's ``request``."""

    _contexts: dict[str, ssl.SSLContext] = {}
    _lock = threading.Lock()

    def __init__(self, ca: str) -> None:
        with self._lock:
            if ca not in self._contexts:
                self._contexts[ca] = ssl.create_default_context(cafile=ca)
            self.context = self._contexts[ca]

    def request(
        self,
        box: Box,
        host: str,
        path: str,
        method: str = "GET",
        body: bytes = b"",
        timeout: float = 20.0,
    ) -> tuple[int, bytes, dict[str, str]]:
        raw = socket.create_connection((box.address, box.port), timeout=timeout)
        try:
            tls = self.context.wrap_socket(raw, server_hostname=host)
            # (Not HTTPSConnection: it builds a default context, the system's CAs loaded,
            # ~30 ms of CPU, for each connection.)
            conn = http.client.HTTPConnection(host, box.port, timeout=timeout)
            conn.sock = tls
            headers = {"Host": host, "Connection": "close"}
            if body:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            return resp.status, data, {k.lower(): v for k, v in resp.getheaders()}
        finally:
            raw.close()


def read_back(world: MeshWorld, host: str, timeout: float = 30.0) -> list[str] | None:
    """Every message body of ``host``'s load room, through whichever box serves it (its holder
    first), paged; None when no box served it whole within ``timeout``."""
    client = world.client
    deadline = time.monotonic() + timeout
    while True:
        holder = world.holder(host)
        order = ([holder] if holder else []) + [b for b in world.boxes if b is not holder]
        for box in order:
            bodies: list[str] = []
            after = 0
            try:
                while True:
                    status, data, _ = client.request(
                        box,
                        host,
                        f"/api/rooms/{ROOM}/messages?after={after}&limit=1000",
                        timeout=10.0,
                    )
                    if status != 200:
                        break
                    messages = json.loads(data)["messages"]
                    bodies.extend(m["body"] for m in messages)
                    if len(messages) < 1000:
                        return bodies
                    after = messages[-1]["id"]
            except Exception:  # noqa: S112 (any box that serves it will do)
                continue
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


# -- the load ------------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One request of the load: times are monotonic; ``status`` 0 = no answer (timeout, reset,
    TLS failure: see ``error``)."""

    kind: str  # "write" (POST) or "read" (GET)
    box: str
    host: str
    body: str
    start: float
    end: float = 0.0
    status: int = 0
    retry_after: str | None = None
    read_only: str | None = None  # the answer's X-Lchat-Read-Only (an isolated box's reads)
    error: str = ""

    @property
    def acked(self) -> bool:
        return self.kind == "write" and self.status == 201

    @property
    def ok(self) -> bool:
        return self.status == (201 if self.kind == "write" else 200)

    @property
    def refused(self) -> bool:
        """A 503 with Retry-After: the refusal a client can act on."""
        return self.status == 503 and self.retry_after is not None

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class Sample:
    """One look at a box's admin socket by the load's monitor."""

    at: float
    box: str
    alive: bool | None
    live: int | None
    awake: tuple[str, ...]
    lag: float | None
    witness: dict[str, Any] | None = None  # GET /status's mesh.witness (each peer's part)


@dataclass
class LoadResult:
    attempts: list[Attempt]
    marks: dict[str, float]  # name -> monotonic time
    started: float  # monotonic
    wall: float  # time.time() at ``started``
    hosts: list[str]
    boxes: list[str]
    readback: dict[str, set[str] | None] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    skipped: int = 0  # ticks not sent: every slot of their stream was out

    # -- selection ----------------------------------------------------------------------------

    def select(
        self,
        kind: str = "write",
        since: float | str | None = None,
        until: float | str | None = None,
        boxes: Iterable[str] | None = None,
        hosts: Iterable[str] | None = None,
    ) -> list[Attempt]:
        """Attempts of ``kind`` that started in [since, until) (monotonic times or mark names)."""
        t0, t1 = self._t(since, float("-inf")), self._t(until, float("inf"))
        bs = set(boxes) if boxes is not None else None
        hs = set(hosts) if hosts is not None else None
        return [
            a
            for a in self.attempts
            if a.kind == kind
            and t0 <= a.start < t1
            and (bs is None or a.box in bs)
            and (hs is None or a.host in hs)
        ]

    def _t(self, t: float | str | None, default: float) -> float:
        if t is None:
            return default
        return self.marks[t] if isinstance(t, str) else t

    def failed(self, kind: str = "write", **kw: Any) -> list[Attempt]:
        return [a for a in self.select(kind, **kw) if not a.ok]

    def lost(self) -> list[Attempt]:
        """Acknowledged writes missing from the read-back (of the spaces read back)."""
        out = []
        for a in self.attempts:
            got = self.readback.get(a.host)
            if a.acked and got is not None and a.body not in got:
                out.append(a)
        return out

    def unread(self) -> list[str]:
        return [h for h in self.hosts if self.readback.get(h) is None]

    def served_again(self, mark: str | float) -> dict[str, float | None]:
        """Per space, seconds from ``mark`` until it was served again through every box: the end
        of the first acknowledged write started after the last failed one (of that box), the
        latest over the boxes; 0 when nothing failed after ``mark``; None when never served
        again."""
        t = self._t(mark, 0.0)
        out: dict[str, float | None] = {}
        for host in self.hosts:
            worst: float | None = 0.0
            for box in self.boxes:
                attempts = self.select("write", boxes=[box], hosts=[host])
                fails = [a for a in attempts if not a.ok and a.end >= t]
                if not fails:
                    continue
                last = max(a.start for a in fails)
                oks = [a.end for a in attempts if a.ok and a.start > last]
                if not oks:
                    worst = None
                    break
                back = max(0.0, min(oks) - t)
                worst = back if worst is None else max(worst, back)
            out[host] = worst
        return out

    def max_lag(self, since: float | str | None = None, until: float | str | None = None) -> float:
        t0, t1 = self._t(since, float("-inf")), self._t(until, float("inf"))
        lags = [s.lag for s in self.samples if s.lag is not None and t0 <= s.at < t1]
        return max(lags, default=0.0)

    def lag_back_under(self, limit: float, mark: str | float) -> float | None:
        """Seconds from ``mark`` until every box's replica lag was under ``limit`` (and stayed
        so for the rest of the run); None if it never was."""
        t = self._t(mark, 0.0)
        late = [s.at for s in self.samples if s.at >= t and s.lag is not None and s.lag >= limit]
        after = [s.at for s in self.samples if s.at > max(late, default=t)]
        if not after:
            return None
        return max(0.0, (max(late) if late else t) - t)

    # -- reporting ----------------------------------------------------------------------------

    def rel(self, t: float) -> str:
        return f"{t - self.started:+.1f}s"

    def wall_of(self, t: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(self.wall + (t - self.started)))

    def summary(self, failures: int = 8) -> str:
        """A readable account: phases, failures, lost writes, recovery, a timeline per box."""
        lines = []
        marks = sorted(self.marks.items(), key=lambda kv: kv[1])
        lines.append(
            "marks: "
            + ", ".join(f"{n} {self.rel(t)} ({self.wall_of(t)})" for n, t in marks)
            + f"; load from {self.wall_of(self.started)}"
        )
        bounds = [("start", self.started), *marks, ("end", float("inf"))]
        for (n0, t0), (n1, t1) in itertools.pairwise(bounds):
            for kind in ("write", "read"):
                sel = self.select(kind, since=t0, until=t1)
                if not sel:
                    continue
                lines.append(f"  [{n0} .. {n1}) {kind}s: {_counts(sel)}")
        writes = self.select("write")
        lines.append(f"writes: {_counts(writes)}")
        reads = self.select("read")
        if reads:
            lines.append(f"reads: {_counts(reads)}")
        if self.skipped:
            lines.append(f"ticks skipped (every slot of their stream out): {self.skipped}")
        bad = [a for a in self.attempts if not a.ok]
        if bad:
            lines.append(f"first failures (of {len(bad)}):")
            for a in sorted(bad, key=lambda a: a.start)[:failures]:
                lines.append("  " + self.describe(a))
        lost = self.lost()
        unread = self.unread()
        acked = sum(1 for a in writes if a.acked)
        lines.append(
            f"acknowledged writes lost: {len(lost)} of {acked}"
            + (f" (read back failed for {unread}: their losses are not counted)" if unread else "")
        )
        if lost:
            by: dict[tuple[str, str], list[Attempt]] = {}
            for a in lost:
                by.setdefault((a.box, a.host), []).append(a)
            for (box, host), items in sorted(by.items()):
                lines.append(
                    f"  via {box} to {host}: {len(items)}, acknowledged "
                    f"{self.rel(min(a.end for a in items))} .. {self.rel(max(a.end for a in items))}"
                )
        for name, _ in marks:
            back = self.served_again(name)
            if any(v != 0.0 for v in back.values()):
                lines.append(
                    f"served again after {name}: "
                    + ", ".join(
                        f"{h.split('.')[0]} {'never' if v is None else f'{v:.1f}s'}"
                        for h, v in back.items()
                    )
                )
        if self.samples:
            lines.append(f"replica lag max: {self.max_lag():.1f}s")
            lines.extend(self.transitions())
        lines.extend(self.timeline())
        return "\n".join(lines)

    def describe(self, a: Attempt) -> str:
        what = f"{a.status}" + (f" Retry-After {a.retry_after}" if a.retry_after else "")
        if a.status == 0:
            what = f"no answer ({a.error})"
        elif a.error:
            what += f" {a.error}"
        return (
            f"{a.kind} via {a.box} to {a.host.split('.')[0]} at {self.rel(a.start)}: {what} "
            f"after {a.latency:.2f}s"
        )

    def transitions(self) -> list[str]:
        """Changes of each box's alive flag, live count and awake spaces, as the monitor saw."""
        out = []
        last: dict[str, tuple[Any, ...]] = {}
        for s in self.samples:
            key = (s.alive, s.live, s.awake)
            if last.get(s.box) != key:
                awake = ",".join(h.split(".")[0] for h in s.awake) or "-"
                out.append(
                    f"  {self.rel(s.at)} {s.box}: alive={s.alive} live={s.live} awake={awake}"
                )
                last[s.box] = key
        return ["monitor (changes):", *out] if out else []

    def timeline(self) -> list[str]:
        """One character per second and box, writes by start time: '.' all acknowledged,
        's' some acknowledged slowly (after more than SLOW), 'r' some refused fast (503 +
        Retry-After, < 1 s), 'R' refused slowly, 'x' some other failure (other status, no
        answer), ' ' none started; '|' at a mark."""
        if not self.attempts:
            return []
        end = max(a.start for a in self.attempts)
        n = int(end - self.started) + 1
        mark_at = {int(t - self.started) for t in self.marks.values()}
        out = [
            "timeline (1 char/s, writes by start; . ok, s ok slowly, r 503+RA fast, R 503+RA "
            "slowly, x other failure):"
        ]
        for box in self.boxes:
            cells = []
            for i in range(n):
                sel = [
                    a
                    for a in self.attempts
                    if a.kind == "write" and a.box == box and i <= a.start - self.started < i + 1
                ]
                c = " "
                if sel:
                    c = "."
                    if any(a.ok and a.latency > SLOW for a in sel):
                        c = "s"
                    if any(a.refused and a.latency < 1.0 for a in sel):
                        c = "r"
                    if any(a.refused and a.latency >= 1.0 for a in sel):
                        c = "R"
                    if any(not a.ok and not a.refused for a in sel):
                        c = "x"
                cells.append(("|" if i in mark_at else "") + c)
            out.append(f"  {box:>5} {''.join(cells)}")
        return out


SLOW = 2.0  # an answer as asked that took longer than this is "slow" in the summaries


def _counts(attempts: list[Attempt]) -> str:
    ok = sum(1 for a in attempts if a.ok)
    slow = [a for a in attempts if a.ok and a.latency > SLOW]
    refused = [a for a in attempts if a.refused]
    other = [a for a in attempts if not a.ok and not a.refused and a.status]
    silent = [a for a in attempts if a.status == 0]
    statuses: dict[int, int] = {}
    for a in other:
        statuses[a.status] = statuses.get(a.status, 0) + 1
    text = f"{len(attempts)} sent, {ok} ok"
    if slow:
        text += f" ({len(slow)} after more than {SLOW:g}s, max {max(a.latency for a in slow):.1f}s)"
    if refused:
        text += f", {len(refused)} 503+Retry-After (max {max(a.latency for a in refused):.2f}s)"
    if other:
        text += f", other statuses {statuses} (max {max(a.latency for a in other):.2f}s)"
    if silent:
        errors: dict[str, int] = {}
        for a in silent:
            errors[a.error.split(":")[0]] = errors.get(a.error.split(":")[0], 0) + 1
        text += f", {len(silent)} no answer {errors} (max {max(a.latency for a in silent):.2f}s)"
    return text


class Load:
    """Client threads in the root namespace: numbered POSTs to every space through every box at
    ``rate`` per second per (box, space), GETs at ``read_rate``, each with ``timeout``, a new
    connection and a thread of its own per request, sent on time whatever the earlier ones
    are doing (a hang does not slow the load down); at most ``inflight`` requests of one
    (box, space, kind) out at once (default: all that ``timeout`` can hold; a tick that finds
    them all out is skipped and counted in ``skipped``). A monitor reads each box's admin socket
    every ``monitor`` seconds (alive, live members, awake spaces, replica lag)."""

    def __init__(
        self,
        world: MeshWorld,
        hosts: list[str] | None = None,
        boxes: list[NsBox] | None = None,
        rate: float = 4.0,
        read_rate: float = 1.0,
        timeout: float = 20.0,
        inflight: int | None = None,
        monitor: float = 0.5,
    ) -> None:
        self.world = world
        self.hosts = list(hosts or world.hosts)
        self.boxes = list(boxes or world.boxes)
        self.rate = rate
        self.read_rate = read_rate
        self.timeout = timeout
        self.inflight = inflight
        self.monitor_every = monitor
        self.client = world.client
        self.attempts: list[Attempt] = []
        self.samples: list[Sample] = []
        self.marks: dict[str, float] = {}
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.started = 0.0
        self.wall = 0.0
        self.tag = secrets.token_hex(2)  # the bodies of this load's writes are its own
        self.skipped = 0
        self.requests: list[threading.Thread] = []
        self._requests_lock = threading.Lock()

    def start(self) -> Load:
        self.started = time.monotonic()
        self.wall = time.time()
        for box in self.boxes:
            for host in self.hosts:
                for kind, rate in (("write", self.rate), ("read", self.read_rate)):
                    if rate <= 0:
                        continue
                    cap = self.inflight or int(rate * self.timeout) + 2
                    stream = _Stream(self, box, host, kind, rate, cap)
                    self.threads.append(threading.Thread(target=stream.schedule, daemon=True))
        if self.monitor_every > 0:
            self.threads.append(threading.Thread(target=self._monitor, daemon=True))
        for t in self.threads:
            t.start()
        return self

    def mark(self, name: str) -> float:
        """Note an event (a cut, a heal) on the load's clock; returns its monotonic time."""
        t = time.monotonic()
        self.marks[name] = t
        return t

    def _monitor(self) -> None:
        while not self.stopping.wait(self.monitor_every):
            for box in self.boxes:
                at = time.monotonic()
                try:
                    status = box.status()
                    mesh = status.get("mesh", {})
                    awake = tuple(
                        sorted(
                            h
                            for h, e in status.get("hosts", {}).items()
                            if e.get("state") == "awake"
                        )
                    )
                    lag = box.replica_lag()
                    self.samples.append(
                        Sample(
                            at,
                            box.name,
                            mesh.get("alive"),
                            mesh.get("live"),
                            awake,
                            lag,
                            mesh.get("witness"),
                        )
                    )
                except Exception:
                    self.samples.append(Sample(at, box.name, None, None, (), None))

    def ok_after(self, t: float, box: str, host: str) -> bool:
        """An acknowledged write to ``host`` through ``box`` that started after ``t`` and after
        the last failed one of that pair."""
        mine = [a for a in self.attempts if a.kind == "write" and a.box == box and a.host == host]
        last_fail = max((a.start for a in mine if a.end and not a.ok), default=t)
        return any(a.ok and a.start > max(t, last_fail) for a in mine)

    def calm(self, window: float = 2.0) -> bool:
        """The last ``window`` seconds were clean: every request started in them that ended was
        answered as asked, none started more than a second ago is still out, and the monitor's
        last look found every box alive (the load alone, before any fault)."""
        now = time.monotonic()
        if now - self.started < window:
            return False
        for a in list(self.attempts):
            if a.start >= now - window and a.end and not a.ok:
                return False
            if not a.end and a.start < now - 1.0:
                return False
        last: dict[str, Sample] = {}
        for sample in list(self.samples):
            last[sample.box] = sample
        return all(s.alive for s in last.values()) and len(last) == len(self.boxes)

    def wait_calm(self, window: float = 2.0, timeout: float = 15.0) -> bool:
        """Wait until :meth:`calm`; False if not within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.calm(window):
                return True
            time.sleep(0.2)
        return False

    def wait_served(self, mark: str, timeout: float = 30.0) -> float | None:
        """Wait until every space was served again through every box after ``mark``; returns the
        seconds it took (None: not within ``timeout``)."""
        t = self.marks[mark]
        deadline = t + timeout
        while time.monotonic() < deadline:
            if all(self.ok_after(t, b.name, h) for b in self.boxes for h in self.hosts):
                return time.monotonic() - t
            time.sleep(0.2)
        return None

    def stop(self) -> None:
        """No new request; wait for those out (each ends within ``timeout``)."""
        self.stopping.set()
        for t in self.threads:
            t.join(self.timeout + 5)
        deadline = time.monotonic() + self.timeout + 5
        with self._requests_lock:
            requests = list(self.requests)
        for t in requests:
            t.join(max(0.0, deadline - time.monotonic()))

    def finish(self, read_back_timeout: float = 30.0) -> LoadResult:
        """Stop, read every space back, and count."""
        self.stop()
        result = LoadResult(
            attempts=[a for a in self.attempts if a.end],
            marks=dict(self.marks),
            started=self.started,
            wall=self.wall,
            hosts=self.hosts,
            boxes=[b.name for b in self.boxes],
            samples=list(self.samples),
            skipped=self.skipped,
        )
        deadline = time.monotonic() + read_back_timeout  # for them all
        for host in self.hosts:
            got = read_back(self.world, host, max(1.0, deadline - time.monotonic()))
            result.readback[host] = set(got) if got is not None else None
        return result


class _Stream:
    """One (box, space, kind): a scheduler thread that starts a request thread per tick."""

    def __init__(self, load: Load, box: NsBox, host: str, kind: str, rate: float, cap: int) -> None:
        self.load = load
        self.box = box
        self.host = host
        self.kind = kind
        self.period = 1.0 / rate
        self.slots = threading.BoundedSemaphore(cap)

    def schedule(self) -> None:
        load = self.load
        at = load.started + secrets.randbelow(1000) / 1000 * self.period
        n = 0
        while True:
            delay = at - time.monotonic()
            if delay > 0 and load.stopping.wait(delay):
                return
            if load.stopping.is_set():
                return
            n += 1
            if self.slots.acquire(blocking=False):
                t = threading.Thread(target=self.send, args=(n,), daemon=True)
                with load._requests_lock:
                    load.requests = [r for r in load.requests if r.is_alive()]
                    load.requests.append(t)
                t.start()
            else:
                load.skipped += 1
            at += self.period
            if at < time.monotonic() - self.period:
                at = time.monotonic()  # a stalled scheduler skips ticks, never bunches them

    def send(self, n: int) -> None:
        load = self.load
        body = f"{load.tag}-{self.box.name}-{self.host.split('.')[0]}-{n}"
        attempt = Attempt(self.kind, self.box.name, self.host, body, time.monotonic())
        load.attempts.append(attempt)
        try:
            if self.kind == "write":
                payload = json.dumps({"body": body}).encode()
                path = f"/api/rooms/{ROOM}/messages"
                status, data, headers = load.client.request(
                    self.box, self.host, path, "POST", payload, load.timeout
                )
            else:
                path = f"/api/rooms/{ROOM}/messages?limit=1"
                status, data, headers = load.client.request(
                    self.box, self.host, path, timeout=load.timeout
                )
            attempt.status = status
            attempt.retry_after = headers.get("retry-after")
            attempt.read_only = headers.get("x-lchat-read-only")
            if status >= 400:
                attempt.error = data[:120].decode("utf-8", "replace").strip()
        except Exception as e:
            attempt.error = f"{type(e).__name__}: {e}"[:160]
        finally:
            attempt.end = time.monotonic()
            self.slots.release()
