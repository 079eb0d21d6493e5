"""A real systemd for the box tests (``make test-box``): Debian 12 booted as PID 1 in ``systemd-nspawn``.

The machines this project is built and tested on do not run systemd themselves (no machined, no
system bus), yet nspawn boots a Debian 12 systemd there in about a second, and every sandbox
directive of ``ops/systemd/*.service`` is applied inside. What that takes, learnt the hard way:

- ``--register=no --keep-unit``: without either, nspawn asks machined or systemd over the system
  bus and stops with ``Failed to open system bus``.
- nspawn runs in a cgroup of its own (``/sys/fs/cgroup/{systemd,unified}/<name>``), created here
  and removed after it stops: with ``--keep-unit`` it builds ``payload/`` and ``supervisor/`` where
  it starts, which would otherwise be the host's root cgroup.
- a tmpfs on ``/run/systemd/nspawn``: ``/run`` is on the root disk here, and nspawn refuses to
  remove its propagation directory from a disk file system at exit.
- no ``machinectl``: commands reach the box through ``nsenter`` into its PID 1's namespaces, with
  a clean environment (the host's ``PIP_*``/``LCHAT_*`` never leak in).
- ``--private-network``: the box has only its own loopback, so the router binds *its* :80 and
  :443, and nothing in the box reaches the network. The wheels are built on the host, with
  Debian's ``/usr/bin/python3`` (the box's Python, 3.11), and installed offline.
- limits: ``LimitNOFILE=`` is capped at the host's hard limit (20000) without a word; memory,
  task and CPU controls are accepted and not enforced.

Invariants:

- The Debian root file system is built once per machine with ``debootstrap`` (about a minute,
  from the mirror the host's apt uses) into ``$LCHAT_BOX_CACHE`` (``/var/cache/lchat-box``),
  keyed by suite and package list, and never written afterwards: each box boots an overlay whose
  upper layer is the run's own scratch directory, removed with the box. A half-built root file
  system is never used (it is renamed into place only when debootstrap succeeded).
- Every process this module starts is ended by its pid; a box that will not power off is sent
  SIGTERM, then SIGKILL, through its nspawn pid only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

SUITE = "bookworm"
# What the box needs beyond minbase: systemd as PID 1, its bus, ps, the Python the README's step 1
# installs (already there, so apt-get needs no network) and sudo (the README's commands use it).
PACKAGES = ("systemd", "systemd-sysv", "dbus", "procps", "python3", "python3-venv", "sudo")
CACHE = Path(os.environ.get("LCHAT_BOX_CACHE", "/var/cache/lchat-box"))
HOST_PYTHON = "/usr/bin/python3"  # Debian's, the same version as the box's python3
BOX_PYTHON = (3, 11)
INPATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ROOT = Path(__file__).resolve().parent.parent
# What a copy of the source for a wheel leaves out (tests/test_wheel.py does the same).
_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "var",
    "build",
    "dist",
    "*.egg-info",
    "_trial_temp*",
    "__pycache__",
    "*.so",
    "_oneread_c.c",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    "dropin.cache",
)


class BoxError(RuntimeError):
    """The box could not be built, booted or driven; the message says which step and why."""


def say(text: str) -> None:
    """Progress on stderr (a cold run spends a minute in debootstrap: say so)."""
    print(f"[box] {text}", file=sys.stderr, flush=True)


def unavailable() -> str | None:
    """Why no box can run on this machine, in one line; None when one can."""
    if os.geteuid() != 0:
        return "not root (nspawn and debootstrap need root)"
    for tool, package in (
        ("systemd-nspawn", "systemd-container"),
        ("debootstrap", "debootstrap"),
        ("nsenter", "util-linux"),
    ):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    if "\toverlay\n" not in filesystems:
        return "the kernel has no overlay file system (the cached root stays read-only through one)"
    if not Path("/sys/fs/cgroup").is_dir():
        return "no /sys/fs/cgroup"
    probe = subprocess.run(
        [HOST_PYTHON, "-c", "import sys, pip; print(*sys.version_info[:2])"],
        capture_output=True,
        text=True,
    )
    want = " ".join(map(str, BOX_PYTHON))
    if probe.returncode != 0 or probe.stdout.strip() != want:
        return f"{HOST_PYTHON} with pip, Python {want} (the box's), is needed to build the wheels"
    return None


def _run(argv: Sequence[str], what: str, log: Path | None = None, **kw: object) -> str:
    """Run a host command; its output goes to `log` (when given); a failure is a BoxError."""
    done = subprocess.run(list(argv), capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    output = done.stdout + done.stderr
    if log is not None:
        log.write_text(output)
    if done.returncode != 0:
        raise BoxError(f"{what} failed (exit {done.returncode}):\n{output[-3000:]}")
    return str(done.stdout)


def mirror() -> str:
    """The Debian mirror the host's apt uses (the first non-security one), else Debian's own."""
    texts = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.suffix in ("", ".list", ".sources") and path.is_file():
            texts.append(path.read_text(errors="replace"))
    pattern = re.compile(
        r"^\s*(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\w+://\S*?/debian/?)(?:\s|$)", re.MULTILINE
    )
    for text in texts:
        for match in pattern.finditer(text):
            return match.group(1)
    return "http://deb.debian.org/debian"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder at a time per cache (two clones running make test-box at once wait here)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def rootfs() -> Path:
    """The cached Debian root file system, built with debootstrap when missing."""
    key = hashlib.sha256(f"{SUITE} minbase {','.join(PACKAGES)}".encode()).hexdigest()[:12]
    path = CACHE / f"rootfs-{SUITE}-{key}"
    ready = path / ".lchat-box-ready"
    if ready.exists():
        return path
    with _locked(CACHE / ".lock"):
        if ready.exists():
            return path
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        url = mirror()
        say(f"building the box's root file system (once per machine, ~1 min): {SUITE} from {url}")
        t0 = time.monotonic()
        _run(
            [
                "nice",
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(partial),
                url,
            ],
            "debootstrap",
            log=CACHE / "debootstrap.log",
        )
        # A box has no kernel, so no /usr/lib/modules: make it, so that ProtectKernelModules= has
        # something to mask, as on a real box.
        (partial / "usr/lib/modules").mkdir(parents=True, exist_ok=True)
        (partial / ".lchat-box-ready").write_text(f"{SUITE} {' '.join(PACKAGES)} from {url}\n")
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)
        say(f"root file system ready in {time.monotonic() - t0:.0f} s: {path}")
    return path


def build_wheels(out: Path) -> Path:
    """The project's wheel and its dependencies' into `out`, built with the box's Python on the
    host from a copy of the checkout (pip's in-tree build would write into it). Dependency wheels
    are kept in the cache and reused; the project's own is always built afresh."""
    keep = CACHE / "wheels"
    keep.mkdir(parents=True, exist_ok=True)
    src = out.parent / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    out.mkdir(parents=True, exist_ok=True)
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    _run(
        [
            "nice",
            HOST_PYTHON,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--find-links",
            str(keep),
            "-w",
            str(out),
            str(src),
        ],
        f"pip wheel (with {HOST_PYTHON})",
        log=out.parent / "pip-wheel.log",
        env=env,
        cwd=str(out.parent),
    )
    shutil.rmtree(src, ignore_errors=True)
    ours = [p for p in out.glob("lchat-*.whl")]
    if len(ours) != 1:
        raise BoxError(f"pip wheel made {len(ours)} lchat wheels in {out}")
    for wheel in out.glob("*.whl"):
        if wheel not in ours and not (keep / wheel.name).exists():
            shutil.copy2(wheel, keep / wheel.name)
    return ours[0]


def _cgroup_dirs(name: str) -> list[Path]:
    return [
        Path("/sys/fs/cgroup") / h / name
        for h in ("systemd", "unified")
        if (Path("/sys/fs/cgroup") / h).is_dir()
    ]


def _remove_cgroups(name: str) -> None:
    for top in _cgroup_dirs(name):
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


class Box:
    """One booted container: an overlay of the cached root file system, systemd as its PID 1.

    `root` is the box's ``/`` as the host sees it (files written there are the box's files).
    """

    def __init__(self, lower: Path, scratch: Path, name: str) -> None:
        self.lower = lower
        self.scratch = scratch
        self.name = name
        self.root = scratch / "root"
        self.boot_log = scratch / "boot.log"
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.leader = 0  # the box's PID 1, as a host pid
        self.boots = 0

    # --- life -------------------------------------------------------------------------------
    def mount(self) -> None:
        for d in ("upper", "work", "root"):
            (self.scratch / d).mkdir(parents=True, exist_ok=True)
        _run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={self.lower},upperdir={self.scratch / 'upper'},workdir={self.scratch / 'work'}",
                str(self.root),
            ],
            "mounting the box's overlay",
        )
        etc = self.root / "etc"
        (etc / "hostname").write_text(f"{self.name}\n")
        (etc / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n127.0.1.1\t{self.name}\n::1\tlocalhost ip6-localhost\n"
        )
        # Nothing periodic in a test box.
        for unit in (
            "apt-daily.timer",
            "apt-daily-upgrade.timer",
            "dpkg-db-backup.timer",
            "e2scrub_all.timer",
            "e2scrub_reap.service",
        ):
            link = etc / "systemd/system" / unit
            link.unlink(missing_ok=True)
            link.symlink_to("/dev/null")

    def boot(self, timeout: float = 60) -> None:
        """Start nspawn and wait until the box's systemd says ``running``."""
        nspawn_dir = Path("/run/systemd/nspawn")
        nspawn_dir.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mountpoint", "-q", str(nspawn_dir)]).returncode != 0:
            _run(
                ["mount", "-t", "tmpfs", "-o", "mode=0755,size=1m", "tmpfs", str(nspawn_dir)],
                "the tmpfs on /run/systemd/nspawn",
            )
        _remove_cgroups(self.name)
        cgroups = _cgroup_dirs(self.name)
        for d in cgroups:
            d.mkdir(exist_ok=True)

        def into_own_cgroup() -> None:
            for d in cgroups:
                (d / "cgroup.procs").write_text(str(os.getpid()))

        argv = [
            "systemd-nspawn",
            "--boot",
            f"--directory={self.root}",
            f"--machine={self.name}",
            "--register=no",
            "--keep-unit",
            "--console=read-only",
            "--link-journal=no",
            "--private-network",
        ]
        log = open(self.boot_log, "ab")
        try:
            self.nspawn = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=into_own_cgroup,
            )
        finally:
            log.close()
        self.boots += 1
        deadline = time.monotonic() + timeout
        self.leader = 0
        own_ns = os.readlink("/proc/self/ns/pid")
        while not self.leader:
            if self.nspawn.poll() is not None:
                raise BoxError(
                    f"systemd-nspawn exited ({self.nspawn.returncode}):\n{self._boot_tail()}"
                )
            if time.monotonic() > deadline:
                raise BoxError(f"no PID 1 in the box after {timeout:.0f} s:\n{self._boot_tail()}")
            for child in _children(self.nspawn.pid):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{child}/ns/pid") != own_ns:
                        self.leader = child
            time.sleep(0.1)
        state = ""
        while time.monotonic() < deadline:
            # The private bus socket appears a moment after PID 1 starts.
            done = self.run(
                "systemctl is-system-running --wait",
                check=False,
                timeout=deadline - time.monotonic(),
            )
            state = done.stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.3)
        if state != "running":
            failed = self.run("systemctl --failed --no-pager", check=False).stdout
            raise BoxError(
                f"the box did not boot (state {state!r}):\n{failed}\n{self._boot_tail()}"
            )

    def reboot(self, timeout: float = 60) -> None:
        """``systemctl reboot`` in the box: nspawn exits (133, "restart me") and is started again
        on the same overlay, as systemd-nspawn@.service would."""
        assert self.nspawn is not None
        self.run("systemctl reboot", check=False)
        try:
            code = self.nspawn.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BoxError(f"the box did not go down for its reboot in {timeout:.0f} s") from None
        if code != 133:
            raise BoxError(f"nspawn exited {code} on a reboot, not 133:\n{self._boot_tail()}")
        self.boot(timeout)

    def poweroff(self, timeout: float = 60) -> None:
        """Power off (SIGTERM, then SIGKILL, to our nspawn pid if it will not), remove the
        cgroups, unmount and delete the overlay's upper layer."""
        if self.nspawn is not None and self.nspawn.poll() is None:
            if self.leader:
                self.run("systemctl poweroff", check=False, timeout=10)
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None:
                    say(f"the box is still up: {sig.name} to nspawn {self.nspawn.pid}")
                    with contextlib.suppress(ProcessLookupError):
                        self.nspawn.send_signal(sig)
                try:
                    self.nspawn.wait(timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        _remove_cgroups(self.name)
        if os.path.ismount(self.root):
            subprocess.run(["umount", str(self.root)], check=False)
        if not os.path.ismount(self.root):
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _boot_tail(self) -> str:
        try:
            return self.boot_log.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no boot log)"

    # --- commands ---------------------------------------------------------------------------
    def run(
        self,
        command: str | Sequence[str],
        *,
        check: bool = True,
        timeout: float = 120,
        env: Mapping[str, str] | None = None,
        cwd: str = "/root",
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `command` (a shell line for bash, or an argv) as root in the box, in its own
        namespaces with a clean environment (and `env` on top)."""
        if not self.leader:
            raise BoxError("the box is not running")
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        base = {
            "PATH": INPATH,
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "HOME": "/root",
            "SYSTEMD_PAGER": "",
            "SYSTEMD_COLORS": "0",
        }
        base.update(env or {})
        full = [
            "nsenter",
            f"--target={self.leader}",
            "--all",
            "--",
            "env",
            "-i",
            f"--chdir={cwd}",
            *(f"{k}={v}" for k, v in base.items()),
            *argv,
        ]
        try:
            done = subprocess.run(
                full, capture_output=True, text=True, errors="replace", timeout=timeout, input=input
            )
        except subprocess.TimeoutExpired as e:
            out = (
                e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            )
            err = (
                e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
            )
            done = subprocess.CompletedProcess(full, 124, out, err)
        if check and done.returncode != 0:
            shown = command if isinstance(command, str) else shlex.join(command)
            raise BoxError(
                f"in the box: {shown!r} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        return done

    def journal(self, unit: str, since: str = "", grep: str = "") -> str:
        """The unit's journal (messages only) since a ``date '+%F %T'`` of the box."""
        args = ["journalctl", "--no-pager", "-o", "cat", "-u", unit]
        if since:
            args += ["--since", since]
        out = self.run(args, check=False).stdout
        if grep:
            return "\n".join(line for line in out.splitlines() if grep in line)
        return out

    def now(self) -> str:
        return self.run(["date", "+%F %T"]).stdout.strip()

    def wait_for(
        self,
        what: str,
        probe: str,
        timeout: float = 30,
        interval: float = 0.5,
        explain: str | None = None,
    ) -> str:
        """Run the shell line `probe` until it succeeds; its output, or a BoxError naming `what`
        (with the output of the shell line `explain`, when given: the journal that says why)."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.run(probe, check=False, timeout=max(1, deadline - time.monotonic()))
            if done.returncode == 0:
                return done.stdout
            if time.monotonic() > deadline:
                why = ""
                if explain is not None:
                    told = self.run(explain, check=False, timeout=30)
                    why = f"\n--- {explain}\n{told.stdout}{told.stderr}"
                raise BoxError(
                    f"{what}: not after {timeout:.0f} s ({probe!r}: {done.stdout}{done.stderr})"
                    + why
                )
            time.sleep(interval)

    def write(self, path: str, text: str, mode: int = 0o644) -> Path:
        """A file in the box (as root), written from the host."""
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)
        return target


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


SCRATCH_PARENT = Path("/var/tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(parent: Path = SCRATCH_PARENT) -> None:
    """What a test process that died (a CI timeout's SIGKILL) left: its box is powered off by
    the pid of the nspawn that runs it, its overlay unmounted and removed, its cgroups removed.
    Only boxes named after a test process that no longer exists are touched."""
    for scratch in parent.glob("lchat-box-*-*"):
        match = re.fullmatch(r"lchat-box-(\d+)-\w+", scratch.name)
        if match is None or _alive(int(match.group(1))):
            continue
        name = f"lchat-box-{match.group(1)}"
        for pid in _nspawn_pids(name):
            say(f"a box left by a dead test process: SIGTERM to its nspawn {pid}")
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                deadline = time.monotonic() + 15
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.2)
                if not _alive(pid):
                    break
        _remove_cgroups(name)
        root = scratch / "root"
        if os.path.ismount(root):
            subprocess.run(["umount", str(root)], check=False)
        if not os.path.ismount(root):
            shutil.rmtree(scratch, ignore_errors=True)


def _nspawn_pids(name: str) -> list[int]:
    """The systemd-nspawn processes running the box called `name`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"systemd-nspawn") and f"--machine={name}".encode() in argv:
            found.append(int(proc.name))
    return found


def start() -> Box:
    """Build (or reuse) the root file system, then mount and boot a fresh box."""
    sweep_stale()
    lower = rootfs()
    name = f"lchat-box-{os.getpid()}"
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=SCRATCH_PARENT))
    box = Box(lower, scratch, name)
    try:
        box.mount()
        box.boot()
    except BaseException:
        box.poweroff()
        raise
    return box


# --- README -----------------------------------------------------------------------------------
def readme_commands(heading: str, readme: Path = ROOT / "README.md") -> list[str]:
    """The shell commands of one README section, in order: every ```sh block between `heading`
    and the next heading of the same or a higher level, comments dropped, continuations joined."""
    lines = readme.read_text().splitlines()
    try:
        start_at = lines.index(heading)
    except ValueError:
        raise BoxError(f"README.md has no heading {heading!r}") from None
    level = len(heading) - len(heading.lstrip("#"))
    commands: list[str] = []
    in_block = False
    pending = ""
    for line in lines[start_at + 1 :]:
        if not in_block and re.match(rf"^#{{1,{level}}} ", line):
            break
        if line.startswith("```"):
            in_block = line.strip() == "```sh" and not in_block
            continue
        if not in_block:
            continue
        code = re.sub(r"(^|\s+)#.*$", "", line).rstrip()
        if code.endswith("\\"):
            pending += code[:-1].rstrip() + " "
            continue
        code = (pending + code.strip()).strip()
        pending = ""
        if code:
            commands.append(code)
    if not commands:
        raise BoxError(f"README.md's {heading!r} has no sh block")
    return commands


if __name__ == "__main__":
    # `python -m tests.systembox --check`: one line and exit 1 when no box can run here.
    why = unavailable()
    if why is not None:
        print(f"make test-box: skipped: {why}")
        sys.exit(1)
    sys.exit(0)
