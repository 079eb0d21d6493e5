"""The box's bucket, opened by a CLI command."""

from __future__ import annotations

import os
import time
from typing import Any

from lchat.config import BoxConfig, bucket_key_env
from lchat.objstore import ObjectStore, needs_credentials, open_store
from lchat.objstore.aws import ResolvedCredentials, box_credentials, resolve_credentials
from lchat.objstore.where import Where
from lchat.threads import thread_runner


async def open_bucket(reactor: Any, cfg: BoxConfig) -> ObjectStore:
    """The bucket of ``LCHAT_HIBERNATE_*`` on ``reactor`` (the caller closes it).

    An S3 bucket's AWS credentials are resolved here, once, from the process environment over the
    env file's ``AWS_*`` values (the router's rule), in the reactor's thread pool: the chain may
    read files or ask the instance metadata service. No credentials: :class:`NoCredentials`
    (an ``ObjectStoreError``) naming what was tried.
    """
    hib = cfg.hibernate
    assert hib is not None, "the caller checks that hibernation is configured"
    run = thread_runner(reactor)
    credentials: ResolvedCredentials | None = None
    if needs_credentials(hib.bucket):
        credentials = await run(box_credentials, cfg)
    return open_store(
        reactor,
        hib.bucket,
        run,
        monotonic=time.monotonic,
        region=hib.region,
        endpoint=hib.endpoint,
        credentials=credentials,
    )


async def open_region_bucket(
    reactor: Any, cfg: BoxConfig, where: Where, what: str = "LCHAT_MESH_BUCKET"
) -> ObjectStore:
    """``where``'s store (an ``LCHAT_REGION_BUCKETS`` entry or ``LCHAT_MESH_BUCKET``), signed for
    its own region, with its own key pair when it names one (:func:`lchat.config.bucket_key_env`;
    an unset variable is a ``ConfigError``), else the box's standard chain. A ``file:`` bucket's
    directory is made on first use, as the id ledger's is."""
    run = thread_runner(reactor)
    credentials: ResolvedCredentials | None = None
    if needs_credentials(where.bucket):
        env = bucket_key_env(cfg, where, what)
        if env is None:
            credentials = await run(box_credentials, cfg)
        else:
            credentials = await run(resolve_credentials, env)
    else:
        await run(os.makedirs, where.bucket[len("file:") :], 0o700, True)
    return open_store(
        reactor,
        where.bucket,
        run,
        monotonic=time.monotonic,
        region=where.s3_region,
        endpoint=where.endpoint,
        credentials=credentials,
    )


async def open_mesh_bucket(reactor: Any, cfg: BoxConfig) -> ObjectStore:
    """The bucket the mesh's heartbeats live in (:func:`lchat.config.mesh_bucket`)."""
    if cfg.mesh is not None and cfg.mesh.bucket is not None:
        return await open_region_bucket(reactor, cfg, cfg.mesh.bucket)
    return await open_bucket(reactor, cfg)
