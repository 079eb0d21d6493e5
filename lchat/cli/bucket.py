"""The box's bucket, opened by a CLI command."""

from __future__ import annotations

import os
import time
from typing import Any

from lchat.config import BoxConfig
from lchat.objstore import ObjectStore, needs_credentials, open_store
from lchat.objstore.aws import ResolvedCredentials, resolve_credentials
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
        env = {**cfg.aws_env, **os.environ}
        credentials = await run(resolve_credentials, env)
    return open_store(
        reactor,
        hib.bucket,
        run,
        monotonic=time.monotonic,
        region=hib.region,
        endpoint=hib.endpoint,
        credentials=credentials,
    )
