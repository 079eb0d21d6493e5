"""The box's bucket, opened by a CLI command."""

from __future__ import annotations

import os
from typing import Any

from twisted.internet.threads import deferToThreadPool

from lchat.config import BoxConfig
from lchat.objstore import ObjectStore, needs_credentials, open_store
from lchat.objstore.aws import ResolvedCredentials, resolve_credentials


async def open_bucket(reactor: Any, cfg: BoxConfig) -> ObjectStore:
    """The bucket of ``LCHAT_HIBERNATE_*`` on ``reactor`` (the caller closes it).

    An S3 bucket's AWS credentials are resolved here, once, from the process environment over the
    env file's ``AWS_*`` values (the router's rule), in the reactor's thread pool: the chain may
    read files or ask the instance metadata service. No credentials: :class:`NoCredentials`
    (an ``ObjectStoreError``) naming what was tried.
    """
    hib = cfg.hibernate
    assert hib is not None, "the caller checks that hibernation is configured"
    credentials: ResolvedCredentials | None = None
    if needs_credentials(hib.bucket):
        env = {**cfg.aws_env, **os.environ}
        credentials = await deferToThreadPool(
            reactor, reactor.getThreadPool(), resolve_credentials, env
        )
    return open_store(
        reactor, hib.bucket, region=hib.region, endpoint=hib.endpoint, credentials=credentials
    )
