"""What the benchmarks share: processes, nginx and router set-up, /proc readings, markdown.

Everything listens on 127.0.0.1 or on unix sockets in a temporary directory; every process is
started in its own session so that cleanup can kill its whole process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import http.client
import io
import json
import os
import platform
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent  # the venv running us: its twistd and lchat run the live tree
HOST = "bench.localhost"  # the Host every benchmark request carries
NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/bin/nginx")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- tools


def which(name: str) -> str | None:
    found = shutil.which(name)
    if found is None and name == "nginx":
        found = next((p for p in NGINX_CANDIDATES if os.access(p, os.X_OK)), None)
    return found


def ensure_tools(packages: Sequence[str]) -> None:
    """Install the Debian packages (nginx, wrk, curl) a benchmark needs, if they are missing."""
    missing = [p for p in packages if which(p) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        sys.exit(
            f"missing {', '.join(missing)}: install them (Debian: apt-get install {' '.join(missing)})"
        )
    log(f"installing {' '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env)
    # The Debian package may start its own nginx on :80; it is not ours and it must not compete
    # for the CPU we measure on. Stop it through the init script if one did start.
    if "nginx" in missing and Path("/run/nginx.pid").exists():
        subprocess.run(["service", "nginx", "stop"], check=False)


def raise_nofile() -> int:
    """Raise the soft open-files limit to the hard one (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---------------------------------------------------------------- processes


class Processes:
    """Starts processes in their own sessions; ``close()`` kills every group it started."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        cpus: str | None = None,
    ) -> subprocess.Popen[bytes]:
        if cpus is not None:
            argv = ["taskset", "-c", cpus, *argv]
        out = open(self.workdir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        out.close()
        self.started.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.started:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {self.tail(name)}")

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            text = (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, proc: subprocess.Popen[bytes] | None, timeout: float = 30.0) -> None:
        """SIGTERM one process's group (SIGKILL after ``timeout``) and forget it, so the
        liveness checks do not trip over a process stopped on purpose."""
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.started = [(n, p) for n, p in self.started if p is not proc]

    def close(self) -> None:
        # Newest first (the router before the backend it proxies to); TERM, then KILL.
        for _name, proc in reversed(self.started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _name, proc in reversed(self.started):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group, too
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.started.clear()


def _die_with_parent() -> None:
    # Should this script be SIGKILLed (no finally runs), the kernel still stops its children.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def workspace(keep: bool = False) -> Iterator[tuple[Path, Processes]]:
    """A temp dir and a process set; both are cleaned up however the benchmark ends."""
    tmp = Path(tempfile.mkdtemp(prefix="lchat-bench-"))
    procs = Processes(tmp)
    # A SIGTERM (e.g. from `timeout`) must run the cleanup too, not just Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield tmp, procs
    finally:
        procs.close()
        signal.signal(signal.SIGTERM, previous)
        if keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def wait_until(check: Callable[[], bool], timeout: float, what: str, procs: Processes) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check_alive()
        if check():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_status(port: int, path: str = "/", host: str = HOST, timeout: float = 2.0) -> int | None:
    """Status of a GET through a proxy on 127.0.0.1:port, or None if it does not answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Host": host})
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        conn.close()


def client_tls_context(cafile: Path) -> ssl.SSLContext:
    """A client context that trusts only the bench's dev CA and checks the host name."""
    context = ssl.create_default_context(cafile=str(cafile))
    context.set_alpn_protocols(["http/1.1"])
    return context


def https_status(port: int, host: str, cafile: Path, timeout: float = 2.0) -> int | None:
    """Status of a GET over TLS to 127.0.0.1:port with SNI ``host``, the certificate verified
    against ``cafile``; None if the handshake or the request fails."""
    info = tls_probe(port, host, cafile, timeout)
    return info[0] if info is not None else None


def tls_probe(
    port: int, host: str, cafile: Path, timeout: float = 2.0
) -> tuple[int, str, str] | None:
    """(status, TLS version, cipher) of one verified GET over TLS with SNI ``host``, or None."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
            with client_tls_context(cafile).wrap_socket(raw, server_hostname=host) as s:
                s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                head = s.recv(64)
                cipher = s.cipher()
                return (
                    int(head.split(b" ", 2)[1]),
                    s.version() or "?",
                    cipher[0] if cipher else "?",
                )
    except (OSError, ValueError, IndexError):
        return None


def unix_answers(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1)
            s.connect(str(path))
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/1.1")
    except OSError:
        return False


def backend_stats(path: Path) -> dict[str, int]:
    """bench/backend.py's counters, asked directly on its socket (not through a proxy)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(b"GET /__bench/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    stats: dict[str, int] = json.loads(data.split(b"\r\n\r\n", 1)[1])
    return stats


# ---------------------------------------------------------------- the three servers


def start_backend(
    procs: Processes, tmp: Path, cpus: str | None = None, head: str = "minimal"
) -> Path:
    """bench/backend.py on a unix socket; ``head``: its small answer's (``--head``)."""
    path = tmp / "backend.sock"
    procs.start(
        "backend",
        [sys.executable, str(BENCH / "backend.py"), "--socket", str(path), "--head", head],
        cpus=cpus,
    )
    wait_until(lambda: unix_answers(path), 10, "the backend", procs)
    return path


# nginx as a backend: ``return 200`` with bench/backend.py's small body, on a unix socket. Its
# answers carry nginx's own head (Server, Date, Content-Type, Content-Length, Connection:
# keep-alive), the head a space built on nginx sends through a proxy.
NGINX_BACKEND_CONF = """\
# generated by bench/benchlib.py: nginx as the backend
worker_processes 1;
daemon off;
master_process on;
pid {tmp}/nginx-backend.pid;
error_log {tmp}/nginx-backend-error.log warn;
worker_rlimit_nofile {nofile};
{user}
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-backend-tmp/client;
    proxy_temp_path {tmp}/nginx-backend-tmp/proxy;
    fastcgi_temp_path {tmp}/nginx-backend-tmp/fastcgi;
    uwsgi_temp_path {tmp}/nginx-backend-tmp/uwsgi;
    scgi_temp_path {tmp}/nginx-backend-tmp/scgi;
    keepalive_requests 100000000;
    keepalive_timeout 1h;
    default_type text/plain;
    server {{
        listen unix:{socket} backlog=4096;
        location / {{ return 200 "{body}"; }}
    }}
}}
"""


def start_nginx_backend(
    procs: Processes, tmp: Path, cpus: str | None = None, body_size: int = 100
) -> tuple[Path, subprocess.Popen[bytes]]:
    """nginx answering every request ``return 200`` with bench/backend.py's small body (the
    same bytes, ``body_size`` of them) on a unix socket: the socket, and its master process."""
    nginx = which("nginx")
    assert nginx is not None
    path = tmp / "backend-nginx.sock"
    (tmp / "nginx-backend-tmp").mkdir(exist_ok=True)
    nofile = raise_nofile()
    body = (b"ok " + b"x" * max(0, body_size - 4) + b"\n")[: max(body_size, 1)]
    conf = tmp / "nginx-backend.conf"
    conf.write_text(
        NGINX_BACKEND_CONF.format(
            tmp=tmp,
            nofile=nofile,
            connections=min(nofile // 2, 16384),
            user="user root;" if os.geteuid() == 0 else "",
            socket=path,
            body=body.decode().replace("\n", "\\n"),
        )
    )
    proc = procs.start(
        "nginx-backend",
        [nginx, "-p", str(tmp), "-e", str(tmp / "nginx-backend-error.log"), "-c", str(conf)],
        cpus=cpus,
    )
    wait_until(lambda: unix_answers(path), 10, "nginx as the backend", procs)
    return path, proc


def start_space(procs: Processes, tmp: Path, cpus: str | None = None) -> Path:
    """The reference space server (lchat/space) on a unix socket, for a second backend row."""
    path = tmp / "space.sock"
    env = {
        **os.environ,
        "LCHAT_SOCKET": str(path),
        "LCHAT_DB": str(tmp / "space.db"),
        "LCHAT_HOST": "space.localhost",
    }
    procs.start("space", [sys.executable, "-m", "lchat.space"], env=env, cpus=cpus)
    wait_until(lambda: unix_answers(path), 30, "the reference space", procs)
    return path


NGINX_CONF = """\
# generated by bench/benchlib.py
worker_processes {workers};
daemon off;
master_process on;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
worker_rlimit_nofile {nofile};
{user}
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-tmp/client;
    proxy_temp_path {tmp}/nginx-tmp/proxy;
    fastcgi_temp_path {tmp}/nginx-tmp/fastcgi;
    uwsgi_temp_path {tmp}/nginx-tmp/uwsgi;
    scgi_temp_path {tmp}/nginx-tmp/scgi;
    keepalive_requests 100000000;  # the router never closes a busy keep-alive connection either
{tls_settings}
{upstreams}
{servers}
}}
"""

NGINX_UPSTREAM = """\
    upstream {name} {{
        server unix:{socket};
        keepalive {keepalive};
        keepalive_requests 100000000;
    }}
"""

# The same headers the router sets: Host kept, X-Forwarded-For/-Proto.
NGINX_SERVER = """\
    server {{
        listen 127.0.0.1:{port}{listen_options};
{tls_listen}        server_name {host};
        proxy_http_version 1.1;
        proxy_set_header Host $host;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_set_header X-Forwarded-Proto $scheme;
        location / {{
            proxy_pass http://{name};
            proxy_set_header Connection "";
        }}
        # Bulk transfers stream both ways, as the router's proxy should: no 1 GB temp files.
        # Unbuffered nginx reads in proxy_buffer_size / client_body_buffer_size pieces (4-8k by
        # default, ~550 MB/s here); 256k lets it move what it can.
        location /big {{
            proxy_pass http://{name};
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_buffer_size 256k;
            proxy_buffers 4 256k;
            proxy_busy_buffers_size 512k;
        }}
        location /upload {{
            proxy_pass http://{name};
            proxy_set_header Connection "";
            client_max_body_size 0;
            proxy_request_buffering off;
            client_body_buffer_size 256k;
        }}
        location /ws {{
            proxy_pass http://{name};
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection "upgrade";
            proxy_read_timeout 1h;
        }}
    }}
"""


# TLS for the --tls variant: the same certificate files as the router's, chosen by SNI per
# server block as the router chooses a per-host context. The router offers TLS 1.2 and 1.3 and
# resumes no sessions (no session cache, no tickets): nginx is set to the same, so that neither
# side saves or spends work the other does not. HTTP/1.1 only (no `http2`), as the router.
NGINX_TLS_SETTINGS = """\
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache off;
    ssl_session_tickets off;
"""

NGINX_TLS_LISTEN = """\
        listen 127.0.0.1:{port}{options} ssl;
        ssl_certificate {pem};
        ssl_certificate_key {pem};
"""


def start_nginx(
    procs: Processes,
    tmp: Path,
    upstreams: dict[str, Path],
    cpus: str | None = None,
    keepalive: int = 64,
    tls: tuple[int, Path] | None = None,
    workers: int = 1,
) -> tuple[int, subprocess.Popen[bytes]]:
    """nginx with upstream keep-alive; ``upstreams`` maps a Host to a backend socket.

    ``keepalive`` is how many idle upstream connections each worker keeps: below the number of
    client connections, nginx closes and re-dials some after every burst.

    ``workers``: nginx's ``worker_processes`` (1, the figures' history, unless a benchmark
    compares many cores: then the router gets as many, :func:`start_router`).

    ``tls``: (port, certificate directory) also listens with TLS on that port, each host with
    ``<dir>/<host>.pem`` (key and chain in one file, the router's layout: see
    :func:`dev_certificates`).
    """
    nginx = which("nginx")
    assert nginx is not None
    port = free_port()
    (tmp / "nginx-tmp").mkdir(exist_ok=True)
    nofile = raise_nofile()
    blocks_up, blocks_srv = [], []
    for i, (host, sock) in enumerate(upstreams.items()):
        name = f"backend{i}"
        blocks_up.append(NGINX_UPSTREAM.format(name=name, socket=sock, keepalive=keepalive))
        # Listen options may be given once per address: on the first server block.
        options = " backlog=4096" if i == 0 else ""
        tls_listen = ""
        if tls is not None:
            pem = tls[1] / f"{host}.pem"
            tls_listen = NGINX_TLS_LISTEN.format(port=tls[0], options=options, pem=pem)
        blocks_srv.append(
            NGINX_SERVER.format(
                name=name, port=port, host=host, listen_options=options, tls_listen=tls_listen
            )
        )
    conf = tmp / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            tmp=tmp,
            nofile=nofile,
            connections=min(nofile // 2, 16384),
            # As root nginx would drop its worker to "nobody", who cannot open our 0700 temp dir.
            user="user root;" if os.geteuid() == 0 else "",
            tls_settings=NGINX_TLS_SETTINGS if tls is not None else "",
            workers=workers,
            upstreams="".join(blocks_up),
            servers="".join(blocks_srv),
        )
    )
    proc = procs.start(
        "nginx",
        [nginx, "-p", str(tmp), "-e", str(tmp / "nginx-error.log"), "-c", str(conf)],
        cpus=cpus,
    )
    host = next(iter(upstreams))
    wait_until(lambda: http_status(port, host=host) is not None, 10, "nginx", procs)
    # (every worker up before anything is measured: its CPU is counted from the start)
    wait_until(lambda: len(children(proc.pid)) >= workers, 10, f"nginx's {workers} workers", procs)
    if tls is not None:
        ca = tls[1] / DEV_CA
        wait_until(lambda: https_status(tls[0], host, ca) == 200, 10, "nginx over TLS", procs)
    return port, proc


def router_label(rev: str | None) -> str:
    """What a run measured: the working tree, a commit, or a source tree on ``PYTHONPATH``."""
    if rev is not None:
        return f"commit {short_sha(rev)} (a git archive of it, whatever the working tree holds)"
    label = f"working tree at {machine_commit()}"
    if os.environ.get("PYTHONPATH"):
        # The router (and the CLI) import lchat from there, before the venv's editable install.
        label += f"; PYTHONPATH={os.environ['PYTHONPATH']} comes first for the router"
    return label


ROUTER_DATA = "router-data"  # in the temp dir: the router's LCHAT_DATA_DIR
DEV_CA = "dev-ca.pem"  # lchat dev-cert's CA, in the certificate directory


def dev_certificates(tmp: Path, hosts: Sequence[str], rev: str | None = None) -> Path:
    """``lchat dev-cert`` for ``hosts`` into the router's certificate directory (the default
    ``LCHAT_ACME_CACHE``, ``<data>/acme``), as README says for trying HTTPS: one 0600 file per
    host, ``<host>.pem``, with the ECDSA P-256 key and the chain, and ``dev-ca.pem`` to verify
    them. nginx serves the very same files. Returns the directory."""
    directory = tmp / ROUTER_DATA / "acme"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env.update(router_source(tmp, rev, reuse=True))
    subprocess.run(
        [sys.executable, "-m", "lchat.cli", "dev-cert", "--out", str(directory), *hosts],
        check=True,
        env=env,
        capture_output=True,
    )
    return directory


def short_sha(rev: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def router_source(tmp: Path, rev: str | None, reuse: bool = False) -> dict[str, str]:
    """Environment that makes the router run ``rev`` (a ``git archive`` of it).

    Without ``rev`` the router is the working tree (the venv's editable install). With it, the
    benchmark measures a fixed commit even while the tree is being edited, or compares two commits.
    ``reuse``: an archive already unpacked in ``tmp`` is used as it is.
    """
    if rev is None:
        return {}
    sha = short_sha(rev)
    dest = tmp / f"router-src-{sha}"
    if reuse and dest.exists():
        return {"PYTHONPATH": str(dest)}
    dest.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", sha], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return {"PYTHONPATH": str(dest)}


def start_router(
    procs: Processes,
    tmp: Path,
    services: dict[str, Path],
    cpus: str | None = None,
    rev: str | None = None,
    https_port: int | None = None,
    workers: int = 1,
) -> tuple[int, subprocess.Popen[bytes]]:
    """``twistd -n lchat`` with an env file in ``tmp``; each Host routed with ``lchat add-service``.

    ``workers``: ``LCHAT_WORKERS`` (the data-plane processes). 1 unless a benchmark compares many
    cores, so that every figure stays comparable with the single-process history (the router's
    own default is one per core). With more, the start waits until the router's ``/status``
    lists them all serving (a router that does not list its workers yet: its children).

    ``rev``: run that commit of lchat instead of the working tree (see :func:`router_source`).
    ``https_port``: also listen with TLS there (``LCHAT_HTTPS_ADDR``), serving the certificates
    :func:`dev_certificates` put in its default certificate directory (call it first); plain HTTP
    then proxies too (``LCHAT_HTTP_REDIRECT=off``) and nothing is issued
    (``LCHAT_ACME_DIRECTORY=off``).
    """
    port = free_port()
    data, run = tmp / ROUTER_DATA, tmp / "router-run"
    data.mkdir(exist_ok=True)
    run.mkdir(exist_ok=True)
    if https_port is None:
        tls_settings = ["LCHAT_HTTPS_ADDR=off"]
    else:
        tls_settings = [
            f"LCHAT_HTTPS_ADDR=127.0.0.1:{https_port}",
            "LCHAT_HTTP_REDIRECT=off",
            "LCHAT_ACME_DIRECTORY=off",
        ]
    env_file = tmp / "router.env"
    env_file.write_text(
        "\n".join(
            [
                f"LCHAT_DATA_DIR={data}",
                f"LCHAT_RUN_DIR={run}",
                f"LCHAT_HTTP_ADDR=127.0.0.1:{port}",
                *tls_settings,
                "LCHAT_UNITS=builtin",
                f"LCHAT_WORKERS={workers}",
                # As the nginx beside it (client_max_body_size 0): bulk.py uploads 1 GiB.
                "LCHAT_MAX_BODY=0",
                "",
            ]
        )
    )
    # Our own environment may carry LCHAT_* from a developer's shell: the env file alone decides.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env.update(router_source(tmp, rev, reuse=True))
    for host, sock in services.items():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "lchat.cli",
                "add-service",
                host,
                "--socket",
                str(sock),
                "--env-file",
                str(env_file),
            ],
            check=True,
            env=env,
            capture_output=True,
        )
    proc = procs.start(
        "router",
        [str(BIN / "twistd"), "-n", "--pidfile=", "lchat", "--env-file", str(env_file)],
        env=env,
        cpus=cpus,
    )
    host = next(iter(services))
    seen: list[int | None] = []

    def ready() -> bool:
        seen.append(http_status(port, host=host))
        if seen[-1] == 200 and https_port is not None:
            seen.append(https_status(https_port, host, data / "acme" / DEV_CA))
        return seen[-1] == 200

    try:
        wait_until(ready, 30, "the router", procs)
        if workers > 1:
            wait_workers(procs, run / "router.sock", proc.pid, workers)
    except RuntimeError as e:
        raise RuntimeError(
            f"{e}; last answer {seen[-1] if seen else None}; router log:\n{procs.tail('router')}"
        ) from None
    return port, proc


def router_workers(admin_sock: Path) -> list[dict[str, Any]]:
    """The router's data-plane workers as its admin ``/status`` lists them (``workers``: a
    ``list`` of ``{slot, pid, connections, accepted, ...}``, or that list itself); ``[]`` when it
    lists none (one process: ``LCHAT_WORKERS=1``, or a router from before the workers) or does not
    answer."""
    try:
        status, body = admin(admin_sock, "GET", "/status", timeout=10)
    except OSError:
        return []
    if status != 200:
        return []
    try:
        workers = json.loads(body).get("workers")
    except (ValueError, AttributeError):
        return []
    if isinstance(workers, dict):
        workers = workers.get("list")
    if not isinstance(workers, list):
        return []
    return [w for w in workers if isinstance(w, dict)]


def wait_workers(procs: Processes, admin_sock: Path, pid: int, workers: int) -> None:
    """Wait (up to 30 s) until the router at ``pid`` runs ``workers`` data-plane processes. A
    router that runs one however many it is asked for (a build from before ``LCHAT_WORKERS``) is
    measured all the same, with a warning: the summary's many-core lines say so too."""
    deadline = time.monotonic() + 30
    serving = workers_serving(admin_sock, pid)
    while serving < workers and time.monotonic() < deadline:
        procs.check_alive()
        time.sleep(0.2)
        serving = workers_serving(admin_sock, pid)
    if serving < workers:
        log(
            f"warning: the router runs {max(serving, 1)} data-plane process(es), not "
            f"LCHAT_WORKERS={workers}: measuring it as it is"
        )


def workers_serving(admin_sock: Path, pid: int) -> int:
    """How many data-plane processes the router at ``pid`` runs now: the workers its ``/status``
    lists, or else its child processes (the benchmarks' routers run no spaces of their own)."""
    listed = router_workers(admin_sock)
    if listed:
        return sum(1 for w in listed if w.get("pid"))
    return len(children(pid))


def router_reactor(procs: Processes, name: str, pid: int) -> str:
    """Which reactor the router runs on, from its own log line, and whether uvloop is loaded in
    its process (its extension module in ``/proc/<pid>/maps``): the data plane must run on it."""
    reactor = "?"
    with contextlib.suppress(OSError):
        for line in (procs.workdir / f"{name}.log").read_text(errors="replace").splitlines():
            if "reactor class: " in line:
                reactor = line.split("reactor class: ", 1)[1].strip().rstrip(".")
                break
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return reactor
    uvloop = "uvloop" in maps
    # The one-read recognisers: the C scanners when built (lchat/proxy/_oneread_c), else patterns.
    compiled = "_oneread_c" in maps
    # The hot path: lchat/proxy/hot compiled (its extension module mapped), else its Python.
    hot = "/hot.cpython" in maps
    return (
        f"{reactor}, uvloop {'loaded' if uvloop else 'NOT loaded'} in the router's process, "
        f"one-read recognisers {'compiled' if compiled else 'patterns (NOT compiled)'}, "
        f"hot path {'compiled' if hot else 'Python (NOT compiled)'}"
    )


def install_router_reactor() -> None:
    """For a process about to become ``twistd lchat`` (a benchmark's ``--child-router``, which
    imports lchat modules to patch them first): install the reactor the router runs on now, so
    that no import installs twistd's default one before ``lchat``'s options would install it.
    A commit from before the uvloop reactor has no ``lchat.uvloop_reactor``: twistd's default."""
    try:
        from lchat import uvloop_reactor
    except ImportError:
        return
    if not uvloop_reactor.installed():
        uvloop_reactor.install()


# ---------------------------------------------------------------- /proc


def proc_status(pid: int, field: str) -> int:
    """A kB field of /proc/<pid>/status (VmRSS, VmHWM), in KiB; 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where not permitted."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime+stime of the processes, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def tree_cpu(pid: int) -> float:
    """utime+stime of ``pid`` and of the children it has reaped, in seconds (0 if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent not idle since boot (all CPUs, /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    # guest time is already counted in user time
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process and its waited-for children (wrk, curl): user + system seconds."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def proxy_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    """The processes doing a proxy's work: nginx's master and worker, or the router itself.

    With ``taskset`` in front, Popen's pid is taskset's, which execs the program: same pid.
    """
    return [proc.pid, *children(proc.pid)]


def nginx_worker(proc: subprocess.Popen[bytes]) -> int:
    workers = children(proc.pid)
    return workers[0] if workers else proc.pid


# ---------------------------------------------------------------- reporting


def machine() -> dict[str, str]:
    """The facts a reader needs to compare a run with another."""

    def run(argv: Sequence[str]) -> str:
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, cwd=ROOT)
        except (OSError, subprocess.TimeoutExpired):
            return "?"
        return (done.stdout + done.stderr).strip()

    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError):
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kib / 1024 / 1024:.1f} GiB"
    twisted = run([sys.executable, "-c", "import twisted; print(twisted.__version__)"])
    nginx = which("nginx")
    wrk = which("wrk")
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": machine_commit(),
        "cpus": f"{os.cpu_count()} x {cpu}",
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "twisted": twisted,
        "nginx": run([nginx, "-v"]).replace("nginx version: ", "") if nginx else "-",
        "wrk": run([wrk, "-v"]).split(" Copyright")[0] if wrk else "-",
    }


def machine_commit() -> str:
    def git(*argv: str) -> str:
        try:
            done = subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True)
        except OSError:
            return "?"
        return done.stdout.strip() if done.returncode == 0 else "?"

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else "")


def machine_markdown(info: dict[str, str]) -> str:
    return "\n".join(f"- {k}: {v}" for k, v in info.items())


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


# ---------------------------------------------------------------- the router's admin socket


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix socket (the router's admin API)."""

    def __init__(self, path: str, timeout: float = 60.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


def admin(sock: Path, method: str, path: str, timeout: float = 120.0) -> tuple[int, bytes]:
    """One request to the router's admin socket: (status, body)."""
    conn = UnixHTTPConnection(str(sock), timeout=timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()
