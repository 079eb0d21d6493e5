"""The router's boot checks on the written ``router.env``, as the service user: ``config.load``,
the backup's key policy (no ``LCHAT_BACKUP_KEY`` while env files exist), the AWS credentials,
each bucket's write probe (``python -m lchat.cli.bootstrap --probe ENV``)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from attrs import frozen

from lchat import config
from lchat.backup import envfiles
from lchat.cli.bootstrap.request import Account, name_of, owner_of
from lchat.config import BoxConfig, ConfigError
from lchat.objstore.where import Where

if TYPE_CHECKING:
    from lchat.reactors import Reactor

PROBE_TIMEOUT = 60.0  # one bucket's write probe (a PUT and a DELETE, with botocore's retries)
PROBES_TIMEOUT = 300.0  # the whole probe process, as the service user


def probe_as(user: str, env_path: str) -> tuple[list[str], list[str]]:
    """Run :func:`probe` in a child as the service user, with the environment the router gets
    from its unit (none of this shell's variables: no AWS_* nor LCHAT_* of root's), so the checks
    see what the router will see, starting with whether it can read its env file.

    When the service user cannot run this Python at all (an interpreter in a private home, as on
    a development machine; never a box's /opt/lchat/venv), the checks run here instead, in that
    same environment, and the env file's ownership is judged from its owner and mode."""
    account = owner_of(user)
    env = _router_environment(user)
    argv = [sys.executable, "-m", "lchat.cli.bootstrap", "--probe", env_path]
    drop: dict[str, Any] = {"user": account.uid, "group": account.gid, "extra_groups": []}
    setpriv = shutil.which("setpriv")  # util-linux, on every Debian box
    if setpriv is not None:
        ids = [f"--reuid={account.uid}", f"--regid={account.gid}", "--clear-groups"]
        argv, drop = [setpriv, *ids, "--no-new-privs", *argv], {}
    try:
        done = subprocess.run(
            argv,
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=PROBES_TIMEOUT,
            check=False,
            **drop,
        )
    except subprocess.TimeoutExpired:
        return [], [f"the settings checks did not finish in {PROBES_TIMEOUT:g} s (a bucket hangs?)"]
    except PermissionError:
        return _probe_here(user, account, env, env_path)
    try:
        found = json.loads(done.stdout)
        return list(found["ok"]), list(found["left"])
    except (ValueError, KeyError, TypeError):
        if setpriv is not None and "failed to execute" in done.stderr:
            return _probe_here(user, account, env, env_path)
        lines = [x.strip() for x in done.stderr.splitlines() if x.strip()]
        return [], [
            f"the settings checks failed to run as {user} (exit {done.returncode}): "
            f"{lines[-1] if lines else 'no output'}"
        ]


def _router_environment(user: str) -> dict[str, str]:
    """What the router's unit gives it: a PATH, the service user's HOME, nothing else."""
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": pwd.getpwnam(user).pw_dir or "/nonexistent",
        "LANG": "C.UTF-8",
    }


def _probe_here(
    user: str, account: Account, env: Mapping[str, str], env_path: str
) -> tuple[list[str], list[str]]:
    st = os.stat(env_path)
    readable = (
        (st.st_uid == account.uid and st.st_mode & stat.S_IRUSR)
        or (st.st_gid == account.gid and st.st_mode & stat.S_IRGRP)
        or st.st_mode & stat.S_IROTH
    )
    if not readable:
        return [], [f"{env_path}: the service user {user} cannot read it (it must own it)"]
    os.environ.clear()  # this process ends after the checks: they see the router's environment
    os.environ.update(env)
    ok, left = probe(env_path, file_buckets=False)
    note = f"(checked as {name_of(os.geteuid())}: {sys.executable} is not executable by {user})"
    return [*ok, note], left


def probe(env_path: str, *, file_buckets: bool = True) -> tuple[list[str], list[str]]:
    """The router's boot checks on ``env_path``, reusing its own code: ``config.load`` (every
    setting, the ACME ones among them), the AWS credential resolution (``lchat.buckets``), and a
    write probe of each bucket (hibernation, mesh, backup). Returns (fine, left to do).

    ``file_buckets=False`` (not running as the service user): a ``file:`` bucket is not probed,
    since the probe would leave directories in it the router could not write."""
    from lchat.buckets import boot_credentials

    ok: list[str] = []
    if not os.access(env_path, os.R_OK):
        return ok, [f"{env_path}: the service user cannot read it (it must own it, mode 0600)"]
    try:
        cfg = config.load(env_file=env_path, environ={}, systemd_present=False)
    except ConfigError as e:
        return ok, [f"fix {env_path}: {e}"]
    left = [f"{env_path}: {warning}" for warning in cfg.warnings]
    ok.append(f"{env_path}: the router accepts its settings")
    if cfg.backup is not None:
        try:  # the router's refusal at start, said as it says it
            unprotected = envfiles.refuse_unprotected(
                cfg.data_dir, key=cfg.backup.env_key, unprotected_ok=cfg.backup.env_unprotected
            )
        except ConfigError as e:
            return ok, [*left, f"fix {env_path}: {e}"]
        if unprotected:
            ok.append(
                f"LCHAT_BACKUP_ENV=unprotected: {len(unprotected)} env file(s) (space secrets) "
                f"are NOT in the backup (no LCHAT_BACKUP_KEY)"
            )
    ok.append(_certificates_line(cfg))
    try:
        boot_credentials(cfg)  # the router's refusal, said as it says it
    except ConfigError as e:
        return ok, [*left, f"AWS credentials (in {env_path}, or an instance role): {e}"]
    if cfg.hibernate is None:
        ok.append("no hibernation bucket (LCHAT_HIBERNATE_BUCKET unset): no hibernation, no mesh")
    buckets = _buckets(cfg)
    if not file_buckets:
        for b in buckets:
            if b.where.is_file:
                ok.append(f"{b.setting}: not probed (not as the service user)")
        buckets = [b for b in buckets if not b.where.is_file]
    if buckets:
        from lchat.cli import runner

        for b, error in runner.run(lambda reactor: _probe_buckets(reactor, cfg, buckets)):
            if error is None:
                ok.append(f"{b.setting}: reachable and writable")
            else:
                left.append(
                    f"{b.setting}: the bucket is not usable: {error} (check its settings in "
                    f"{env_path} and the AWS credentials)"
                )
    return ok, left


def _certificates_line(cfg: BoxConfig) -> str:
    if cfg.https_addr is None:
        return "certificates: HTTPS is off (LCHAT_HTTPS_ADDR=off)"
    if cfg.acme is None:
        return (
            f"certificates: no issuance (LCHAT_ACME_DIRECTORY=off): the files in "
            f"{cfg.acme_cache} are served as they are"
        )
    wildcards = ", ".join("*." + d for d in cfg.wildcard_domains)
    return (
        f"certificates: issued by {cfg.acme.directory}; per-host (HTTP-01) "
        f"{'on' if cfg.http_addr else 'off: LCHAT_HTTP_ADDR is off'}; wildcards "
        + (f"{wildcards} over DNS-01 ({cfg.acme.dns_provider})" if wildcards else "none")
        + f"; cache {cfg.cert_cache}"
    )


@frozen
class _Bucket:
    """A bucket the router probes at start: the setting it comes from, where it is, whether its
    ``file:`` directory is made on first use (``LCHAT_MESH_BUCKET``'s), and the key probed."""

    stem: str
    where: Where
    make_dir: bool
    key: str

    @property
    def setting(self) -> str:
        return f"{self.stem}_BUCKET={self.where.bucket}"


def _buckets(cfg: BoxConfig) -> list[_Bucket]:
    """The buckets the router probes at start, with the keys it probes."""
    from lchat.backup.layout import Layout
    from lchat.buckets import probe_name
    from lchat.config import mesh_bucket

    found = []
    probe_key = probe_name(cfg.box_id)
    hib = cfg.hibernate
    if hib is not None:
        found.append(
            _Bucket("LCHAT_HIBERNATE", hib.where, False, hib.key(".lchat", "probe", probe_key))
        )
        if cfg.mesh is not None and cfg.mesh.bucket is not None:
            beats = mesh_bucket(cfg)
            found.append(
                _Bucket("LCHAT_MESH", beats, True, beats.key(".lchat", "probe", probe_key))
            )
    backup = cfg.backup
    if backup is not None:
        key = Layout(backup.prefix, backup.box).probe_key()
        found.append(_Bucket("LCHAT_BACKUP", backup.where, False, key))
    return found


async def _probe_buckets(
    reactor: Reactor, cfg: BoxConfig, buckets: list[_Bucket]
) -> list[tuple[_Bucket, str | None]]:
    """Each bucket opened by the one opener (:func:`lchat.buckets.open_bucket`) and probed: why
    it is not usable, or None."""
    from twisted.internet.defer import Deferred

    from lchat import objstore
    from lchat.buckets import open_bucket

    results: list[tuple[_Bucket, str | None]] = []
    for b in buckets:
        try:
            store = await open_bucket(
                reactor, cfg, b.where, what=f"{b.stem}_BUCKET", make_dir=b.make_dir
            )
        except Exception as e:
            results.append((b, str(e) or type(e).__name__))
            continue
        try:
            probing = Deferred.fromCoroutine(objstore.probe_writable(store, b.key))
            probing.addTimeout(PROBE_TIMEOUT, reactor)
            await probing
            results.append((b, None))
        except Exception as e:
            results.append((b, str(e) or type(e).__name__))
        finally:
            await store.close()
    return results
