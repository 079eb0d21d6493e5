"""Install like a box does: the built wheel, in a fresh venv, run from a neutral directory.

An editable install puts the checkout on ``sys.path`` and so finds ``twisted/plugins`` there: it
proves nothing about the wheel. Here the source tree is copied aside, built into a wheel, and
installed with its dependencies into a throwaway venv that has never seen the checkout. Then the
installed ``twistd`` must know ``lchat``, start the router, and the router must serve a space run by
the installed ``lchat space``, with Twisted's plugin cache missing, stale, or not writable (a box's
venv is root's; the router runs as the service user).
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import attrs
from twisted.trial.unittest import SkipTest, TestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = os.path.join(ROOT, "ops", "systemd")  # the systemd units bootstrap installs
_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "var",
    "build",
    "dist",
    "*.egg-info",
    "_trial_temp*",
    "__pycache__",
    "*.so",  # in-place builds of lchat/proxy/_oneread_c and hot: the wheel compiles its own
    "_oneread_c.c",
    "hot.c",
    "_hot_digest.py",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    "dropin.cache",
)
_NOBODY = 65534


def _clean_env() -> dict[str, str]:
    """The environment of a shell on a box: nothing that points into the checkout."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("LCHAT_")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.frozen
class _Install:
    """A wheel built from a copy of the source, installed with its dependencies in a new venv."""

    top: str
    venv: str
    plugins: str

    def bin(self, name: str) -> str:
        return os.path.join(self.venv, "bin", name)


def _check(argv: list[str]) -> None:
    done = subprocess.run(argv, env=_clean_env(), capture_output=True, text=True, cwd="/")
    if done.returncode != 0:
        raise AssertionError(f"{argv[:3]} failed:\n{done.stdout}\n{done.stderr}")


@functools.cache
def _install() -> _Install:
    """Built once per test process (trial has no setUpClass), removed at exit."""
    top = tempfile.mkdtemp(prefix="lchat-wheel-")
    atexit.register(shutil.rmtree, top, True)
    os.chmod(top, 0o755)  # the unprivileged run below must reach the venv
    src = os.path.join(top, "src")
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    wheels = os.path.join(top, "wheels")
    _check([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, src])
    (wheel,) = [os.path.join(wheels, n) for n in os.listdir(wheels) if n.endswith(".whl")]
    venv = os.path.join(top, "venv")
    _check([sys.executable, "-m", "venv", venv])
    pip = os.path.join(venv, "bin", "pip")
    _check([pip, "install", "-q", "--disable-pip-version-check", wheel])
    site = subprocess.check_output(
        [
            os.path.join(venv, "bin", "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        env=_clean_env(),
        text=True,
    ).strip()
    return _Install(top, venv, os.path.join(site, "twisted", "plugins"))


class WheelInstallTests(TestCase):
    timeout = 600

    def setUp(self) -> None:
        self.box = _install()
        self.plugins = self.box.plugins
        self.bin = self.box.bin

    def neutral_dir(self) -> str:
        path = tempfile.mkdtemp(dir=self.box.top, prefix="cwd-")
        os.chmod(path, 0o777)
        return path

    def twistd(
        self, *args: str, as_user: int | None = None, cwd: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        argv = [self.bin("twistd"), *args]
        if as_user is not None:
            argv = ["setpriv", f"--reuid={as_user}", f"--regid={as_user}", "--clear-groups", *argv]
        return subprocess.run(
            argv,
            cwd=cwd or self.neutral_dir(),
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    def assert_knows_lchat(self, as_user: int | None = None) -> None:
        """Every plugin: the router (``twistd lchat``), its data-plane worker (``twistd
        lchat-worker``, which the router starts with LCHAT_WORKERS >= 2) and home (``twistd
        lchat-home``)."""
        listing = self.twistd("--help", as_user=as_user)
        self.assertEqual(listing.returncode, 0, listing.stderr)
        commands = listing.stdout.split("Commands:")[-1]
        self.assertIn("lchat ", commands)
        self.assertIn("lchat-home ", commands)
        self.assertIn("lchat-worker ", commands)
        for plugin in ("lchat", "lchat-home"):
            usage = self.twistd(plugin, "--help", as_user=as_user)
            self.assertEqual(usage.returncode, 0, usage.stderr)
            self.assertIn("--env-file", usage.stdout)
        usage = self.twistd("lchat-worker", "--help", as_user=as_user)
        self.assertEqual(usage.returncode, 0, usage.stderr)
        self.assertIn("--slot", usage.stdout)
        self.assertIn("--fds", usage.stdout)

    def test_the_wheel_carries_the_plugin(self) -> None:
        self.assertTrue(os.path.isfile(os.path.join(self.plugins, "lchat_plugin.py")))
        self.assertTrue(os.path.isfile(os.path.join(self.plugins, "lchat_home_plugin.py")))
        self.assertTrue(os.path.isfile(os.path.join(self.plugins, "lchat_worker_plugin.py")))
        # Twisted's own package is untouched: the plugin directory stays Twisted's.
        self.assertTrue(os.path.isfile(os.path.join(self.plugins, "__init__.py")))

    def test_the_wheel_carries_the_compiled_recognisers(self) -> None:
        """The build compiled lchat/proxy/_oneread_c.pyx (the one-read path's C scanners) and
        lchat/proxy/hot.py (its hot path) into the wheel (docs/performance.md): the router runs
        them, not the Python fallbacks; and what it checks the hot build against is there."""
        done = subprocess.run(
            [
                self.bin("python"),
                "-c",
                "from lchat.proxy import HOT, hot, oneread;"
                " print(oneread.COMPILED, hot.COMPILED, HOT)",
            ],
            env=_clean_env(),
            capture_output=True,
            text=True,
            cwd="/",
        )
        self.assertEqual(
            (done.returncode, done.stdout.strip()),
            (0, "True True compiled (lchat/proxy/hot)"),
            done.stderr,
        )

    def test_twistd_knows_lchat_from_a_neutral_directory(self) -> None:
        self.assert_knows_lchat()

    def test_a_stale_plugin_cache_is_harmless(self) -> None:
        """A cache written before lchat was installed (an upgrade, a venv reused), and dated
        after the plugin file, still yields the plugin."""
        cache = os.path.join(self.plugins, "dropin.cache")
        plugin = os.path.join(self.plugins, "lchat_plugin.py")
        aside = plugin + ".aside"
        os.rename(plugin, aside)
        try:
            self.assertEqual(self.twistd("--help").returncode, 0)
        finally:
            os.rename(aside, plugin)
        with open(cache, "rb") as f:
            self.assertNotIn("lchat_plugin", pickle.load(f))  # noqa: S301 (Twisted's own file)
        old = time.time() - 86400
        os.utime(plugin, (old, old))
        self.assert_knows_lchat()

    def test_an_unwritable_plugin_cache_is_harmless(self) -> None:
        """The service user cannot write root's venv: no cache, and none can be made."""
        cache = os.path.join(self.plugins, "dropin.cache")
        if os.path.exists(cache):
            os.remove(cache)
        if os.getuid() == 0:
            if shutil.which("setpriv") is None:
                raise SkipTest("setpriv (util-linux) is needed to run as another user")
            self.assert_knows_lchat(as_user=_NOBODY)
        else:
            mode = os.stat(self.plugins).st_mode
            os.chmod(self.plugins, 0o555)
            self.addCleanup(os.chmod, self.plugins, mode)
            self.assert_knows_lchat()
        self.assertFalse(os.path.exists(cache))

    def test_the_installed_router_serves_a_space(self) -> None:
        """The box's whole path: the installed CLI adds a space, the installed ``twistd lchat``
        runs it with the installed ``lchat space``, and a request reaches it."""
        box = self.neutral_dir()
        data, run = os.path.join(box, "data"), os.path.join(box, "run")
        os.makedirs(data)
        port = _free_port()
        env_file = os.path.join(box, "router.env")
        with open(env_file, "w") as f:
            f.write(
                "\n".join(
                    [
                        f"LCHAT_DATA_DIR={data}",
                        f"LCHAT_RUN_DIR={run}",
                        f"LCHAT_HTTP_ADDR=127.0.0.1:{port}",
                        "LCHAT_HTTPS_ADDR=off",
                        "LCHAT_ACME_DIRECTORY=off",
                        "LCHAT_UNITS=builtin",
                        "LCHAT_WORKERS=1",  # (one process: the default starts one a core)
                        f"LCHAT_SPACE_COMMAND={self.bin('lchat')} space",
                        "",
                    ]
                )
            )
        added = subprocess.run(
            [self.bin("lchat"), "add-instance", "wheel.example.com", "--env-file", env_file],
            cwd=box,
            env=_clean_env(),
            capture_output=True,
            text=True,
        )
        self.assertEqual(added.returncode, 0, added.stderr)
        log_path = os.path.join(box, "router.log")
        with open(log_path, "wb") as log:
            router = subprocess.Popen(
                [self.bin("twistd"), "--nodaemon", "--pidfile=", "lchat", "--env-file", env_file],
                cwd=box,
                env=_clean_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def stop() -> None:
            router.terminate()
            try:
                router.wait(30)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()

        self.addCleanup(stop)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/version", headers={"Host": "wheel.example.com"}
        )
        deadline = time.monotonic() + 60
        answer = ""
        while time.monotonic() < deadline and router.poll() is None:
            try:
                with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
                    answer = response.read().decode()
                    break
            except (OSError, urllib.error.URLError):
                time.sleep(0.2)
        with open(log_path) as f:
            log_text = f.read()
        self.assertIn('"version"', answer, f"no answer from the space; router log:\n{log_text}")

    def test_the_wheel_carries_the_bootstrap_units_and_the_example(self) -> None:
        """A box installed from the wheel can bootstrap (``lchat bootstrap``, test_bootstrap.py):
        the units and the example env file are in it. (Here rather than there: one wheel build
        per test process.)"""
        box = self.box
        python = box.bin("python")
        where = subprocess.check_output(
            [python, "-c", "import lchat.ops as o; print(o.UNITS_DIR); print(o.ENV_EXAMPLE)"],
            env=_clean_env(),
            cwd="/",
            text=True,
        ).split()
        units_dir, example = where
        self.assertTrue(units_dir.startswith(box.venv), units_dir)
        self.assertFalse(os.path.islink(units_dir))
        for name in os.listdir(UNITS):
            with open(os.path.join(UNITS, name)) as f, open(os.path.join(units_dir, name)) as g:
                self.assertEqual(f.read(), g.read(), name)
        with open(example) as f, open(os.path.join(ROOT, "etc", "router.env.example")) as g:
            self.assertEqual(f.read(), g.read())
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root, True)
        done = subprocess.run(
            [box.bin("lchat"), "bootstrap", "--root", root, "--user", "root", "--dry-run"],
            env=_clean_env(),
            cwd="/",
            capture_output=True,
            text=True,
            check=False,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn(
            f"to do    install {root}/etc/systemd/system/lchat-router.service", done.stdout
        )
        self.assertIn(
            f"to do    install {root}/etc/systemd/system/lchat-spaces.target", done.stdout
        )
