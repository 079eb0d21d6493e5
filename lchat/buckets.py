"""Opening a bucket (:class:`lchat.objstore.where.Where`): its credentials, then its store.

One rule for the router and every command: a bucket that names its own key pair
(``access_key_env``/``secret_key_env``) is signed with it (:func:`bucket_key_env`); any other S3
bucket with the box's standard chain (:func:`lchat.objstore.aws.box_credentials`); a ``file:``
bucket needs none. Core, not ``lchat.cli``: the router opens ``LCHAT_MESH_BUCKET`` with it too.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from twisted.internet.defer import Deferred

from lchat.config import BoxConfig, ConfigError, mesh_bucket
from lchat.deferutil import observe
from lchat.objstore import ObjectStore, open_store
from lchat.objstore.aws import (
    NoCredentials,
    ResolvedCredentials,
    box_credentials,
    resolve_credentials,
)
from lchat.objstore.where import Where
from lchat.reactors import Reactor
from lchat.threads import thread_runner


class HasEnvFile(Protocol):
    """A box's or home's configuration: its env file's values."""

    @property
    def file_env(self) -> Mapping[str, str]: ...

    @property
    def aws_env(self) -> Mapping[str, str]: ...


def bucket_key_env(cfg: HasEnvFile, where: Where, what: str) -> dict[str, str] | None:
    """The environment the standard AWS chain resolves ``where``'s credentials from, when it
    names its own key pair (``access_key_env``/``secret_key_env``, read from the env file or the
    process environment, which wins as it does for ``AWS_*``); ``None`` when the box's own
    credentials serve it. A named variable that is unset is a :class:`ConfigError` naming
    ``what`` (``region fi``, ``LCHAT_MESH_BUCKET``)."""
    if not where.access_key_env:
        return None
    env = {**cfg.file_env, **os.environ}
    missing = [n for n in (where.access_key_env, where.secret_key_env) if not env.get(n)]
    if missing:
        raise ConfigError(
            f"{what}'s keys are in {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} unset"
        )
    keep = {k: v for k, v in env.items() if k in ("AWS_REGION", "AWS_DEFAULT_REGION")}
    return {
        **keep,
        "AWS_ACCESS_KEY_ID": env[where.access_key_env],
        "AWS_SECRET_ACCESS_KEY": env[where.secret_key_env],
    }


def prepare(
    cfg: HasEnvFile,
    where: Where,
    *,
    what: str = "the bucket",
    box: ResolvedCredentials | None = None,
    make_dir: bool = False,
) -> ResolvedCredentials | None:
    """What opening ``where`` needs, made ready. Blocking (the chain may read files or ask the
    instance metadata service): at boot, or in a thread. A ``file:`` bucket: None, its directory
    made first with ``make_dir`` (a read of a missing root fails). An S3 bucket: its own key pair,
    else ``box`` (the box's credentials, already resolved), else the box's chain resolved now.
    Raises ``NoCredentials`` or, for an unset key variable, ``ConfigError``."""
    if where.is_file:
        if make_dir:
            os.makedirs(where.directory, 0o700, exist_ok=True)
        return None
    env = bucket_key_env(cfg, where, what)
    if env is not None:
        return resolve_credentials(env)
    return box if box is not None else box_credentials(cfg)


async def open_bucket(
    reactor: Reactor,
    cfg: HasEnvFile,
    where: Where,
    *,
    what: str = "the bucket",
    make_dir: bool = False,
    must_exist: bool = False,
) -> ObjectStore:
    """``where``'s store on ``reactor`` (the caller closes it; :func:`lchat.objstore.open_store`),
    :func:`prepare` run in the reactor's thread pool; ``what`` names the bucket in a refusal."""
    run = thread_runner(reactor)
    credentials = await run(lambda: prepare(cfg, where, what=what, make_dir=make_dir))
    return open_store(
        reactor, where, run, credentials, monotonic=time.monotonic, must_exist=must_exist
    )


async def open_mesh_bucket(reactor: Reactor, cfg: BoxConfig) -> ObjectStore:
    """The bucket the mesh's heartbeats live in (:func:`lchat.config.mesh_bucket`); an
    ``LCHAT_MESH_BUCKET`` of ``file:`` is made on first use, the hibernation bucket is not."""
    assert cfg.mesh is not None
    own = cfg.mesh.bucket is not None
    return await open_bucket(reactor, cfg, mesh_bucket(cfg), what="LCHAT_MESH_BUCKET", make_dir=own)


def boot_credentials(cfg: BoxConfig) -> ResolvedCredentials | None:
    """The AWS credentials, resolved once at boot by the standard chain (the process
    environment over the env file's ``AWS_*``, then profiles, then container and instance
    roles), when an S3 bucket or Route53 needs them."""
    s3 = cfg.hibernate is not None and not cfg.hibernate.where.is_file
    backup = cfg.backup is not None and not cfg.backup.where.is_file
    route53 = (
        cfg.acme is not None
        and bool(cfg.wildcard_domains)
        and cfg.acme.dns_provider.strip().lower() == "route53"
    )
    if not (s3 or backup or route53):
        return None
    try:
        return box_credentials(cfg)
    except NoCredentials as e:
        if s3:
            assert cfg.hibernate is not None
            raise ConfigError(f"LCHAT_HIBERNATE_BUCKET={cfg.hibernate.bucket}: {e}") from e
        if backup:
            assert cfg.backup is not None
            raise ConfigError(f"LCHAT_BACKUP_BUCKET={cfg.backup.bucket}: {e}") from e
        raise ConfigError(f"LCHAT_DNS_PROVIDER=route53: {e}") from e


def probe_name(box: str) -> str:
    """The name of ``box``'s write-probe object (``<prefix>/.lchat/probe/<name>``): the router's
    boot check and bootstrap's write there."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", box)[:200] or "box"


Opener = Callable[[Reactor, HasEnvFile, Where, str], Awaitable[ObjectStore]]


def _open(reactor: Reactor, cfg: HasEnvFile, where: Where, what: str) -> Awaitable[ObjectStore]:
    return open_bucket(reactor, cfg, where, what=what)


class RegionBuckets:
    """The other regions' hibernation buckets (``LCHAT_REGION_BUCKETS``) as the router uses them:
    each opened on first use with :func:`open_bucket` (so signed as ``lchat relocate`` signs
    it), then kept until :meth:`close`. Only a region whose bucket is not this box's own (another
    bucket, prefix or endpoint) is *foreign*: every other route wakes from this box's bucket.

    Invariant: one store per region at a time; callers that ask together share one opening; a
    failed opening is not remembered (the next call tries again) and is raised as it came
    (:class:`~lchat.config.ConfigError` for an unset key variable, ``NoCredentials``)."""

    def __init__(self, reactor: Reactor, cfg: BoxConfig, opener: Opener = _open) -> None:
        self._reactor = reactor
        self._cfg = cfg
        self._opener = opener
        here = cfg.hibernate.where if cfg.hibernate is not None else None
        self._foreign = {
            region: where
            for region, where in cfg.region_buckets.items()
            if here is None or not where.same_place(here)
        }
        self._stores: dict[str, ObjectStore] = {}
        self._opening: dict[str, Deferred[ObjectStore]] = {}

    def foreign(self, region: str) -> Where | None:
        """``region``'s bucket when it is not this box's own; None otherwise (no region, this
        box's region, a region sharing its bucket, or one ``LCHAT_REGION_BUCKETS`` does not
        name: such a space lives where this box does)."""
        return self._foreign.get(region) if region else None

    async def store(self, region: str) -> ObjectStore:
        """The open store of foreign ``region``'s bucket (KeyError for a region that is not)."""
        where = self._foreign[region]
        have = self._stores.get(region)
        if have is not None:
            return have
        opening = self._opening.get(region)
        if opening is None:
            opening = Deferred.fromCoroutine(self._open(region, where))
            if not opening.called:  # (an opener that answered at once has nothing to share)
                self._opening[region] = opening
        return await observe(opening)

    async def _open(self, region: str, where: Where) -> ObjectStore:
        try:
            store = await self._opener(self._reactor, self._cfg, where, f"region {region}")
        finally:
            self._opening.pop(region, None)
        self._stores[region] = store
        return store

    async def close(self) -> None:
        """Close every store opened (at the router's stop, after the last space slept)."""
        stores, self._stores = self._stores, {}
        for store in stores.values():
            await store.close()
