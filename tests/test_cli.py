"""End-to-end tests of the ``lchat`` command line against temporary box directories.

The CLI runs in-process (``main([...])`` with stdout/stderr captured); the router's admin API, spaces
and services are real HTTP servers on real unix sockets, and ``systemctl`` is a real executable put
first on PATH that records its arguments and starts a space the way systemd would.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import shutil
import signal
import socket
import socketserver
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from attrs import frozen
from twisted.trial.unittest import SynchronousTestCase

import lchat
from lchat import hosts
from lchat.cli.main import main
from lchat.registry import Registry, Route

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "t0ken-for-tests-0123456789"


@frozen
class Result:
    code: int
    out: str
    err: str


# --- real HTTP servers on unix sockets ---------------------------------------------------------


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    on_request: Callable[[str, str], tuple[int, dict[str, object]]]
    seen: list[tuple[str, str]]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _UnixHTTPServer

    def _answer(self) -> None:
        self.server.seen.append((self.command, self.path))
        code, body = self.server.on_request(self.command, self.path)
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def address_string(self) -> str:  # unix peers have no address
        return "unix"

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve_http(
    path: str, on_request: Callable[[str, str], tuple[int, dict[str, object]]]
) -> _UnixHTTPServer:
    server = _UnixHTTPServer(path, _Handler)
    server.on_request = on_request
    server.seen = []
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


# The stand-in space systemd starts in the systemd tests: /api/version on $LCHAT_SOCKET, nothing more.
STUB_SPACE = """
import http.server, json, os, socketserver
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"version": "stub", "build": os.environ["LCHAT_HOST"]}).encode()
        self.send_response(200 if self.path == "/api/version" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def address_string(self):
        return "unix"
    def log_message(self, *a):
        pass
assert os.environ["LCHAT_ADMIN_TOKEN"]
socketserver.UnixStreamServer(os.environ["LCHAT_SOCKET"], H).serve_forever()
"""

# systemctl, as far as the CLI can tell. MODE: "space" (the reference space), "stub" (STUB_SPACE),
# "idle" (succeeds, starts nothing) or "fail" (exit 1 like a unit that does not start).
SYSTEMCTL = """#!{python}
import json, os, subprocess, sys, time
sys.path.insert(0, {repo!r})
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
mode = {mode!r}
if mode == "fail":
    print("Job for lchat@x.service failed because the control process exited", file=sys.stderr)
    sys.exit(1)
args = sys.argv[1:]
if args[:2] == ["enable", "--now"] and mode in ("space", "stub"):
    from lchat import config, hosts
    from lchat.registry import Registry
    host = args[2].split("@", 1)[1]
    route = Registry({registry!r}, time.time).get(host)
    token = config.read_env_file(hosts.env_path({data!r}, host), must_exist=True)["LCHAT_ADMIN_TOKEN"]
    env = dict(os.environ, LCHAT_HOST=host, LCHAT_SOCKET=route.socket, LCHAT_DB=route.db_path,
               LCHAT_ADMIN_TOKEN=token)
    argv = [sys.executable, "-m", "lchat.space"] if mode == "space" else [sys.executable, {stub!r}]
    with open({space_log!r}, "ab") as out:
        child = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True)
    with open({pids!r}, "a") as f:
        f.write(f"{{child.pid}}\\n")
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _stop(pid: int) -> None:
    """Stop a process started by a stand-in systemctl (not our child: it was reparented)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if _gone(pid):
                return
            time.sleep(0.05)


# --- the fixture --------------------------------------------------------------------------------


class CliTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        # Unix socket paths must stay short: keep the root in /tmp with a tiny name.
        self.root = tempfile.mkdtemp(prefix="cl", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.data_dir = os.path.join(self.root, "data")
        self.run_dir = os.path.join(self.root, "run")
        os.mkdir(self.data_dir)
        os.mkdir(self.run_dir)
        self.env_file = os.path.join(self.root, "router.env")
        self.write_router_env()
        self.registry = Registry(os.path.join(self.data_dir, "registry.db"), clock=time.time)
        self.admin_socket = os.path.join(self.run_dir, "router.sock")
        self._isolate_environ()

    def _isolate_environ(self) -> None:
        # The box's own LCHAT_* variables must not leak into a test; restore everything afterwards.
        saved = dict(os.environ)

        def restore() -> None:
            os.environ.clear()
            os.environ.update(saved)

        self.addCleanup(restore)
        for name in [n for n in os.environ if n.startswith("LCHAT_")]:
            del os.environ[name]

    def row(self, host: str) -> Route | None:
        self.registry.migrate()  # a refused command may not have created the registry at all
        return self.registry.get(host)

    def rows(self) -> list[Route]:
        self.registry.migrate()
        return list(self.registry.load())

    def write_router_env(self, units: str = "builtin", **extra: str) -> None:
        lines = [f"LCHAT_UNITS={units}", *(f"{k}={v}" for k, v in extra.items())]
        with open(self.env_file, "w") as f:
            f.write("\n".join(lines) + "\n")

    def common(self, **overrides: str) -> list[str]:
        options = {"env_file": self.env_file, "data_dir": self.data_dir, "run_dir": self.run_dir}
        options.update(overrides)
        return [arg for k, v in options.items() for arg in ("--" + k.replace("_", "-"), v)]

    def lchat(self, *argv: str, **overrides: str) -> Result:
        """Run ``lchat <argv> <common options>`` in-process (options after the command name)."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*argv, *self.common(**overrides)])
        return Result(code, out.getvalue(), err.getvalue())

    def assertFailed(self, result: Result, *fragments: str) -> None:
        self.assertEqual(result.code, 1, result)
        lines = result.err.splitlines()
        self.assertEqual(len([ln for ln in lines if ln.startswith("lchat: error: ")]), 1, result)
        for fragment in fragments:
            self.assertIn(fragment, result.err)

    def admin_server(self, verdict: tuple[str, str] | None = None) -> _UnixHTTPServer:
        """A stand-in router: answers POST /reload and, like its supervisor, records a verdict."""

        def on_request(method: str, path: str) -> tuple[int, dict[str, object]]:
            if (method, path) != ("POST", "/reload"):
                return 404, {"error": "not found"}
            table = self.registry.load()
            if verdict is not None:
                for route in table:
                    if route.status == "creating":
                        self.registry.set_status(route.host, verdict[0], verdict[1])  # type: ignore[arg-type]
            return 200, {"routes": len(table)}

        server = serve_http(self.admin_socket, on_request)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        return server

    def fake_systemctl(self, mode: str) -> str:
        """Put a recording ``systemctl`` first on PATH; returns the file its argv lines go to."""
        bin_dir = os.path.join(self.root, "bin")
        os.makedirs(bin_dir, exist_ok=True)
        log, pids = os.path.join(self.root, "systemctl.log"), os.path.join(self.root, "pids")
        stub = os.path.join(self.root, "stub_space.py")
        with open(stub, "w") as f:
            f.write(STUB_SPACE)
        script = os.path.join(bin_dir, "systemctl")
        with open(script, "w") as f:
            f.write(
                SYSTEMCTL.format(
                    python=sys.executable,
                    repo=REPO,
                    log=log,
                    mode=mode,
                    registry=self.registry.path,
                    data=self.data_dir,
                    stub=stub,
                    space_log=os.path.join(self.root, "space.log"),
                    pids=pids,
                )
            )
        os.chmod(script, 0o755)
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        self.addCleanup(self._stop_spaces, pids)
        return log

    def _stop_spaces(self, pids: str) -> None:
        if os.path.exists(pids):
            with open(pids) as f:
                for line in f:
                    _stop(int(line))

    def systemctl_calls(self, log: str) -> list[list[str]]:
        if not os.path.exists(log):
            return []
        with open(log) as f:
            return [json.loads(line) for line in f]

    def env_token(self, host: str) -> str:
        with open(hosts.env_path(self.data_dir, host)) as f:
            return f.read().strip().removeprefix("LCHAT_ADMIN_TOKEN=")


def token_from(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("admin token: ")]
    assert len(lines) == 1, out
    return lines[0].removeprefix("admin token: ")


# --- instances, version -------------------------------------------------------------------------


class InstancesTests(CliTestCase):
    def test_empty(self) -> None:
        result = self.lchat("instances")
        self.assertEqual(result.code, 0, result)
        self.assertEqual(
            result.out.split(),
            [
                "HOST",
                "KIND",
                "STATUS",
                "STATE",
                "VERSION",
                "HIBERNATE",
                "REPLICATION",
                "NEXT-DUE",
                "SOCKET",
            ],
        )
        self.assertTrue(os.path.exists(self.registry.path))

    def test_rows_sorted_with_last_error(self) -> None:
        self.registry.migrate()
        self.registry.insert(
            Route("zed.example.com", kind="service", socket="/srv/z.sock", status="ready")
        )
        self.registry.insert(
            Route(
                "abc.example.com",
                kind="instance",
                socket="/run/lchat/abc.example.com.sock",
                status="failed",
                last_error="exec format error\nsecond line",
                version="1.2.3",
                hibernate=True,
                replication="daily",
            )
        )
        result = self.lchat("instances")
        self.assertEqual(result.code, 0, result)
        lines = result.out.splitlines()
        self.assertEqual(len(lines), 4, result.out)
        self.assertEqual(
            lines[1].split(),
            [
                "abc.example.com",
                "instance",
                "failed",
                "?",  # STATE: no router to ask
                "1.2.3",
                "on",
                "daily",
                "-",  # NEXT-DUE
                "/run/lchat/abc.example.com.sock",
            ],
        )
        self.assertEqual(lines[2], "  last error: exec format error second line")
        self.assertEqual(
            lines[3].split(),
            ["zed.example.com", "service", "ready", "?", "-", "off", "stream", "-", "/srv/z.sock"],
        )

    def test_json(self) -> None:
        self.assertEqual(self.lchat("add-instance", "a.example.com", "--home-region", "fi").code, 0)
        result = self.lchat("instances", "--json")
        self.assertEqual(result.code, 0, result)
        [row] = json.loads(result.out)
        extra = {"state", "live_version", "canary"}  # canary, live_version: lchat deploy's
        self.assertEqual(set(row), {a.name for a in Route.__attrs_attrs__} | extra)
        self.assertIsNone(row["state"], "no router to ask")
        self.assertEqual((row["host"], row["home_region"]), ("a.example.com", "fi"))
        self.assertNotIn(self.env_token("a.example.com"), result.out)

    def test_json_empty(self) -> None:
        result = self.lchat("instances", "--json")
        self.assertEqual((result.code, json.loads(result.out)), (0, []))


class ClosedPipeTests(CliTestCase):
    """``lchat instances | head`` or ``| grep -q`` (make run does the latter): a reader that
    leaves early ends the command quietly, exit 141 as for SIGPIPE, not with an error line."""

    def run_into(self, stdout: int) -> subprocess.CompletedProcess[bytes]:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(
            [
                sys.executable,
                "-c",
                "from lchat.cli.main import run; run()",
                "instances",
                *self.common(),
            ],
            stdout=stdout,
            stderr=subprocess.PIPE,
            cwd=root,
            env={**os.environ, "PYTHONPATH": root},
            timeout=60,
        )

    def test_a_reader_gone_is_a_quiet_141(self) -> None:
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before anything was written
        try:
            done = self.run_into(write_end)
        finally:
            os.close(write_end)
        self.assertEqual((done.returncode, done.stderr), (128 + signal.SIGPIPE, b""))

    def test_a_reader_that_stays_gets_everything(self) -> None:
        done = self.run_into(subprocess.PIPE)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertTrue(done.stdout.startswith(b"HOST"), done.stdout)


class VersionAndHelpTests(CliTestCase):
    def test_version(self) -> None:
        result = self.lchat("version")
        self.assertEqual((result.code, result.out), (0, f"lchat {lchat.__version__}\n"))

    def test_module_entry_point(self) -> None:
        env = dict(os.environ, PYTHONPATH=REPO)
        done = subprocess.run(
            [sys.executable, "-m", "lchat.cli", "version"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        self.assertEqual((done.returncode, done.stdout), (0, f"lchat {lchat.__version__}\n"))

    def test_help_lists_every_command(self) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(main(["--help"]), 0)
        for command in ("instances", "add-instance", "add-service", "remove", "version", "space"):
            self.assertIn(f"    {command} ", out.getvalue())

    def test_space_is_handed_its_arguments(self) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(main(["--env-file", self.env_file, "space", "--help"]), 0)
        self.assertIn("usage: lchat space", out.getvalue())

    def test_usage_error_is_exit_2(self) -> None:
        with contextlib.redirect_stderr(io.StringIO()):
            self.assertEqual(main(["add-instance"]), 2)
            self.assertEqual(main(["add-instance", "a.example.com", "--replication", "hourly"]), 2)
            self.assertEqual(main([]), 2)


class ConfigErrorTests(CliTestCase):
    def test_bad_variable_is_named(self) -> None:
        self.write_router_env(LCHAT_HIBERNATE_IDLE="0")
        self.assertFailed(self.lchat("instances"), "LCHAT_HIBERNATE_IDLE")

    def test_explicit_env_file_must_exist(self) -> None:
        result = self.lchat("instances", env_file=os.path.join(self.root, "nope.env"))
        self.assertFailed(result, "--env-file", "nope.env")

    def test_missing_data_dir_is_named(self) -> None:
        result = self.lchat("instances", data_dir=os.path.join(self.root, "missing"))
        self.assertFailed(result, "LCHAT_DATA_DIR")

    def test_options_before_the_command(self) -> None:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*self.common(), "add-instance", "b.example.com", "--no-wait"])
        self.assertEqual(code, 0, err.getvalue())
        self.assertIsNotNone(self.row("b.example.com"))


# --- add-instance -------------------------------------------------------------------------------


class AddInstanceTests(CliTestCase):
    def test_minted_token_env_file_and_row(self) -> None:
        result = self.lchat("add-instance", "chat-a.example.com")
        self.assertEqual(result.code, 0, result)
        token = token_from(result.out)
        self.assertGreaterEqual(len(token), 40)
        path = hosts.env_path(self.data_dir, "chat-a.example.com")
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        with open(path) as f:
            self.assertEqual(f.read(), f"LCHAT_ADMIN_TOKEN={token}\n")
        self.assertNotIn(token, result.err)
        route = self.row("chat-a.example.com")
        assert route is not None
        self.assertEqual(
            (route.kind, route.status, route.hibernate, route.replication, route.home_region),
            ("instance", "creating", False, "stream", ""),
        )
        self.assertEqual(route.socket, hosts.socket_path(self.run_dir, "chat-a.example.com"))
        self.assertEqual(route.db_path, hosts.db_path(self.data_dir, "chat-a.example.com"))
        # Builtin units and no router: a warning, and the router starts it when it comes up.
        self.assertIn("router is not running", result.err)
        self.assertIn(self.admin_socket, result.err)
        self.assertNotIn(
            os.path.basename(path) + ".", " ".join(os.listdir(self.data_dir))
        )  # no temp left

    def test_given_token_replication_region(self) -> None:
        result = self.lchat(
            "add-instance",
            "chat-b.example.com",
            "--admin-token",
            TOKEN,
            "--replication",
            "batched",
            "--home-region",
            "eu-central-1",
        )
        self.assertEqual(result.code, 0, result)
        self.assertEqual(token_from(result.out), TOKEN)
        self.assertEqual(self.env_token("chat-b.example.com"), TOKEN)
        route = self.row("chat-b.example.com")
        assert route is not None
        self.assertEqual((route.replication, route.home_region), ("batched", "eu-central-1"))

    def test_bad_token_refused(self) -> None:
        for bad in ("short", "has space in it 0123456789", "x" * 257, "line\nbreak0123456789"):
            self.assertFailed(self.lchat("add-instance", "c.example.com", "--admin-token", bad))
        self.assertEqual(os.listdir(self.data_dir), [])

    def test_hibernate_needs_bucket(self) -> None:
        result = self.lchat("add-instance", "h.example.com", "--hibernate")
        self.assertFailed(result, "LCHAT_HIBERNATE_BUCKET")
        self.assertFalse(os.path.exists(hosts.env_path(self.data_dir, "h.example.com")))
        self.assertIsNone(self.row("h.example.com"))

    def test_hibernate_with_bucket(self) -> None:
        self.write_router_env(units="systemd", LCHAT_HIBERNATE_BUCKET="file:/tmp/x")
        log = self.fake_systemctl("idle")
        result = self.lchat(
            "add-instance", "h.example.com", "--hibernate", "--replication", "daily"
        )
        self.assertEqual(result.code, 0, result)
        route = self.row("h.example.com")
        assert route is not None
        self.assertEqual(
            (route.status, route.hibernate, route.replication), ("ready", True, "daily")
        )
        self.assertEqual(self.systemctl_calls(log), [])
        self.assertIn("router not running", result.err)
        self.assertTrue(os.path.exists(hosts.env_path(self.data_dir, "h.example.com")))

    def test_a_create_that_cannot_fan_out_on_a_mesh_box_warns(self) -> None:
        # The seed's incident: lchat ran with an env file lacking the mesh settings on a box whose
        # router is a mesh member; the space would be born dark on the peers.
        self.write_router_env(LCHAT_HIBERNATE_BUCKET="file:/tmp/x")
        status: dict[str, object] = {
            "hosts": {},
            "mesh": {"env_file": "/data/router.env", "live": 2, "members": []},
        }

        def on_request(method: str, path: str) -> tuple[int, dict[str, object]]:
            if (method, path) == ("POST", "/reload"):
                return 200, {"routes": 1}
            if (method, path) == ("GET", "/status"):
                return 200, status
            return 404, {"error": "not found"}

        server = serve_http(self.admin_socket, on_request)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        result = self.lchat("add-instance", "h.example.com", "--hibernate")
        self.assertEqual(result.code, 0, result)
        self.assertIn("the running router is a mesh member", result.err)
        self.assertIn("h.example.com was not replicated to its peers", result.err)
        self.assertIn("--env-file /data/router.env", result.err)
        # A router without the mesh: nothing to say.
        del status["mesh"]
        quiet = self.lchat("add-instance", "i.example.com", "--hibernate")
        self.assertNotIn("mesh member", quiet.err)

    def test_duplicate_refused(self) -> None:
        self.assertEqual(self.lchat("add-instance", "d.example.com").code, 0)
        before = self.env_token("d.example.com")
        result = self.lchat("add-instance", "D.example.com", "--admin-token", TOKEN)
        self.assertFailed(result, "d.example.com is already registered")
        self.assertEqual(self.env_token("d.example.com"), before)

    def test_hostile_hosts_change_nothing(self) -> None:
        self.lchat("instances")  # create the registry so its files are part of the snapshot
        before = sorted(os.listdir(self.data_dir)), sorted(os.listdir(self.run_dir))
        for bad in ("../x", "a/b", "a" * 300 + ".example.com", "a\x00b.example.com", "/etc/passwd"):
            result = self.lchat("add-instance", bad)
            self.assertFailed(result)
            self.assertEqual(len(result.err.splitlines()), 1, result)
            self.assertNotIn("\x00", result.err)
        self.assertEqual(
            (sorted(os.listdir(self.data_dir)), sorted(os.listdir(self.run_dir))), before
        )
        self.assertEqual(len(self.rows()), 0)

    def test_host_is_normalised(self) -> None:
        result = self.lchat("add-instance", "UPPER.Example.COM.")
        self.assertEqual(result.code, 0, result)
        self.assertIsNotNone(self.row("upper.example.com"))
        self.assertTrue(os.path.exists(os.path.join(self.data_dir, "upper.example.com.env")))

    def test_reuses_token_of_removed_space(self) -> None:
        token = token_from(self.lchat("add-instance", "r.example.com").out)
        self.assertEqual(self.lchat("remove", "r.example.com").code, 0)
        path = hosts.env_path(self.data_dir, "r.example.com")
        os.chmod(path, 0o644)
        result = self.lchat("add-instance", "r.example.com")
        self.assertEqual((result.code, token_from(result.out)), (0, token), result)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        # An explicit token replaces it, and the operator's other settings survive.
        with open(path, "a") as f:
            f.write("SPACE_SETTING=kept\n")
        self.assertEqual(self.lchat("remove", "r.example.com").code, 0)
        result = self.lchat("add-instance", "r.example.com", "--admin-token", TOKEN)
        self.assertEqual((result.code, token_from(result.out)), (0, TOKEN), result)
        with open(path) as f:  # the token rewritten where it was (envfile.assign)
            self.assertEqual(f.read(), f"LCHAT_ADMIN_TOKEN={TOKEN}\nSPACE_SETTING=kept\n")


class BuiltinUnitsTests(CliTestCase):
    def test_router_marks_ready(self) -> None:
        server = self.admin_server(("ready", ""))
        result = self.lchat("add-instance", "b.example.com", "--timeout", "5")
        self.assertEqual(result.code, 0, result)
        # Once to start it; once more after the row is ready, so that the router's table has the
        # ready row before the command returns (a request right after it is never a 503).
        self.assertEqual(server.seen.count(("POST", "/reload")), 2, server.seen)
        self.assertIn("b.example.com is ready", result.out)
        route = self.row("b.example.com")
        assert route is not None
        self.assertEqual(route.status, "ready")

    def test_router_marks_failed(self) -> None:
        self.admin_server(("failed", "exec /opt/lchat/live/f.example.com: no such file"))
        result = self.lchat("add-instance", "f.example.com", "--timeout", "5")
        self.assertFailed(result, "f.example.com failed", "exec /opt/lchat/live/f.example.com")
        token_from(result.out)  # the token was still shown: the row and env file exist

    def test_router_silent_times_out(self) -> None:
        self.admin_server(None)
        result = self.lchat("add-instance", "s.example.com", "--timeout", "0.5")
        self.assertFailed(result, "still creating after 0.5s")

    def test_no_wait(self) -> None:
        server = self.admin_server(None)
        result = self.lchat("add-instance", "n.example.com", "--no-wait")
        self.assertEqual(result.code, 0, result)
        self.assertEqual(server.seen, [("POST", "/reload")])


class SystemdUnitsTests(CliTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.write_router_env(units="systemd")

    def test_unit_started_and_health_checked(self) -> None:
        log = self.fake_systemctl("stub")
        server = self.admin_server(None)
        result = self.lchat("add-instance", "sd.example.com", "--timeout", "10")
        self.assertEqual(result.code, 0, result)
        self.assertEqual(self.systemctl_calls(log), [["enable", "--now", "lchat@sd.example.com"]])
        route = self.row("sd.example.com")
        assert route is not None
        self.assertEqual(route.status, "ready")
        self.assertIn(("POST", "/reload"), server.seen)

    def test_with_the_fleet_backup_its_replicator_unit_is_enabled_with_the_space(self) -> None:
        # lchat-backup@<host> is wanted by lchat@<host>: enabled first, the space's start pulls it.
        self.write_router_env(units="systemd", LCHAT_BACKUP_BUCKET="file:/tmp/x")
        log = self.fake_systemctl("stub")
        self.admin_server(None)
        result = self.lchat("add-instance", "bk.example.com", "--timeout", "10")
        self.assertEqual(result.code, 0, result)
        self.assertEqual(
            self.systemctl_calls(log),
            [
                ["enable", "lchat-backup@bk.example.com"],
                ["enable", "--now", "lchat@bk.example.com"],
            ],
        )

    def test_reference_space(self) -> None:
        log = self.fake_systemctl("space")
        result = self.lchat("add-instance", "ref.example.com", "--timeout", "20")
        self.assertEqual(result.code, 0, result)
        self.assertEqual(self.systemctl_calls(log), [["enable", "--now", "lchat@ref.example.com"]])
        route = self.row("ref.example.com")
        assert route is not None
        self.assertEqual(route.status, "ready")

    def test_host_too_long_for_a_unit_socket_is_refused(self) -> None:
        log = self.fake_systemctl("stub")
        host = ("a" * 60) + "." + ("b" * 60) + ".example.com"
        result = self.lchat("add-instance", host)
        self.assertFailed(result, "too long for a unix socket", "LCHAT_UNITS=builtin")
        self.assertIsNone(self.row(host))
        self.assertEqual(self.systemctl_calls(log), [])

    def test_unit_fails(self) -> None:
        self.fake_systemctl("fail")
        result = self.lchat("add-instance", "bad.example.com")
        self.assertFailed(result, "systemctl enable --now lchat@bad.example.com failed (exit 1)")
        route = self.row("bad.example.com")
        assert route is not None
        self.assertEqual(route.status, "failed")
        self.assertIn("control process exited", route.last_error)

    def test_not_answering(self) -> None:
        self.fake_systemctl("idle")
        result = self.lchat("add-instance", "q.example.com", "--timeout", "0.5")
        socket_path = hosts.socket_path(self.run_dir, "q.example.com")
        self.assertFailed(result, f"not answering on {socket_path} after 0.5s")
        route = self.row("q.example.com")
        assert route is not None
        self.assertEqual(
            (route.status, route.last_error),
            ("failed", f"not answering on {socket_path} after 0.5s"),
        )
        listing = self.lchat("instances")
        self.assertIn(f"  last error: not answering on {socket_path}", listing.out)

    def test_remove_stop(self) -> None:
        log = self.fake_systemctl("idle")
        self.assertEqual(self.lchat("add-instance", "st.example.com", "--no-wait").code, 0)
        result = self.lchat("remove", "st.example.com", "--stop")
        self.assertEqual(result.code, 0, result)
        self.assertEqual(
            self.systemctl_calls(log),
            [
                ["enable", "--now", "lchat@st.example.com"],
                ["disable", "--now", "lchat@st.example.com"],
            ],
        )
        self.assertIsNone(self.row("st.example.com"))


# --- add-service, remove ------------------------------------------------------------------------


class AddServiceTests(CliTestCase):
    def test_answering_socket(self) -> None:
        path = os.path.join(self.root, "svc.sock")
        service = serve_http(path, lambda method, p: (404, {"error": "not here"}))
        self.addCleanup(service.server_close)
        self.addCleanup(service.shutdown)
        admin = self.admin_server(None)
        result = self.lchat("add-service", "Svc.Example.com", "--socket", path)
        self.assertEqual(result.code, 0, result)
        self.assertEqual(service.seen, [("GET", "/")])
        self.assertEqual(admin.seen, [("POST", "/reload")])
        route = self.row("svc.example.com")
        assert route is not None
        self.assertEqual((route.kind, route.status, route.socket), ("service", "ready", path))

    def test_missing_socket(self) -> None:
        path = os.path.join(self.root, "nothing.sock")
        self.assertFailed(self.lchat("add-service", "svc.example.com", "--socket", path), path)
        self.assertIsNone(self.row("svc.example.com"))

    def test_silent_socket(self) -> None:
        # A socket file nobody listens on any more: refused, nothing written.
        path = os.path.join(self.root, "dead.sock")
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        sock.close()
        result = self.lchat("add-service", "svc.example.com", "--socket", path)
        self.assertFailed(result, "does not answer HTTP")
        self.assertEqual(len(self.rows()), 0)

    def test_not_a_socket_or_relative(self) -> None:
        self.assertFailed(
            self.lchat("add-service", "a.example.com", "--socket", self.env_file),
            "not a unix socket",
        )
        self.assertFailed(
            self.lchat("add-service", "a.example.com", "--socket", "rel.sock"), "absolute"
        )


class RemoveTests(CliTestCase):
    def test_remove_keeps_files(self) -> None:
        self.assertEqual(self.lchat("add-instance", "k.example.com").code, 0)
        db = hosts.db_path(self.data_dir, "k.example.com")
        with open(db, "w") as f:
            f.write("data")
        env = hosts.env_path(self.data_dir, "k.example.com")
        before = self.env_token("k.example.com")
        admin = self.admin_server(None)
        result = self.lchat("remove", "K.example.com.", "--stop")
        self.assertEqual(result.code, 0, result)
        self.assertIsNone(self.row("k.example.com"))
        self.assertEqual(admin.seen, [("POST", "/reload")])
        self.assertIn("the router stops", result.err)
        with open(db) as f:
            self.assertEqual(f.read(), "data")
        self.assertTrue(os.path.exists(env))
        self.assertEqual(self.env_token("k.example.com"), before)

    def test_remove_unknown(self) -> None:
        self.assertFailed(
            self.lchat("remove", "ghost.example.com"), "ghost.example.com is not registered"
        )
