"""AWS credentials, resolved once: botocore's standard chain over an environment we are given.

The router (and each CLI command that opens the bucket) resolves the credentials at start and
hands them to :class:`lchat.objstore.s3.S3Store` (through :func:`lchat.objstore.open_store`);
nothing resolves them again later, and nothing writes AWS settings into ``os.environ``. What a
refresh needs stays inside the credentials: an instance or container role resolves to botocore
``RefreshableCredentials``, which the S3 client refreshes (in a thread) shortly before they expire.

The chain is botocore's own, in its order — environment keys, shared credentials and config files
(with their profile, role assumption, SSO, ``credential_process``), then a container role, then
the instance role (IMDS) — except that the AWS_* settings it reads come from ``env`` instead of
the process environment: the static keys and ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``AWS_SHARED_CREDENTIALS_FILE``/``AWS_CONFIG_FILE``, ``AWS_DEFAULT_REGION``, the container
credentials variables and ``AWS_EC2_METADATA_DISABLED``. Two botocore providers read
``os.environ`` whatever we do (web identity: ``AWS_WEB_IDENTITY_TOKEN_FILE``/``AWS_ROLE_ARN``;
``credential_source = Environment`` in a role profile): for those, the variables must be in the
process's environment, where EKS and ECS put them anyway.

Resolving blocks (files, the container agent, the instance metadata service: up to a few seconds
off EC2): call :func:`resolve_credentials` before the reactor runs, or in a thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from attrs import frozen

from lchat.objstore import AccessDenied

__all__ = ["NoCredentials", "ResolvedCredentials", "resolve_credentials"]


class NoCredentials(AccessDenied):
    """The chain found no usable credentials; the message names what was tried."""


@frozen
class ResolvedCredentials:
    """What the standard chain resolved to, once.

    ``credentials`` is botocore's ``Credentials`` (``RefreshableCredentials`` for roles: keep the
    object, it refreshes itself). ``region`` is the chain's default region (``AWS_DEFAULT_REGION``,
    or the profile's ``region``), ``""`` when it names none. ``session`` is the botocore session
    that resolved them, for other botocore clients (Route53): it hands out these same
    credentials and reads the same ``env``.
    """

    credentials: Any
    region: str
    session: Any


class HasAwsEnv(Protocol):
    """A box's or home's configuration: the ``AWS_*`` values of its env file."""

    @property
    def aws_env(self) -> Mapping[str, str]: ...


def box_credentials(cfg: HasAwsEnv) -> ResolvedCredentials:
    """The credentials every bucket opener of a box or of home uses: the standard chain over
    the env file's ``AWS_*`` values, the process environment winning. Blocking; raises
    :class:`NoCredentials` as :func:`resolve_credentials` does."""
    return resolve_credentials({**cfg.aws_env, **os.environ})


def resolve_credentials(env: Mapping[str, str]) -> ResolvedCredentials:
    """Resolve the standard AWS credential chain once, reading AWS_* settings from ``env``, the
    whole environment the chain should see (:func:`box_credentials`'s, for a box or home).

    Blocking. Raises :class:`NoCredentials`, naming every place it looked, when nothing in the
    chain gives credentials, or when a source it found is broken (a profile that does not exist,
    half a key pair, a role that cannot be assumed).
    """
    import botocore.exceptions  # type: ignore[import-untyped]
    import botocore.session  # type: ignore[import-untyped]
    from botocore.credentials import (  # type: ignore[import-untyped]
        ContainerProvider,
        EnvProvider,
        create_credential_resolver,
    )

    environ = dict(env)
    session = botocore.session.Session()
    try:
        _read_settings_from(session, environ)
        resolver = create_credential_resolver(session)
        # botocore's chain, its order kept; the providers that read variables directly read ours.
        for provider in (EnvProvider(environ=environ), ContainerProvider(environ=environ)):
            resolver.insert_after(provider.METHOD, provider)
            resolver.remove(provider.METHOD)  # the first of the two: botocore's, on os.environ
        if _imds_disabled(environ):
            resolver.remove("iam-role")
        session.register_component("credential_provider", resolver)
        credentials = session.get_credentials()
        region = session.get_config_variable("region") or ""
    except botocore.exceptions.BotoCoreError as e:
        raise NoCredentials(f"AWS credentials: {e} (the chain tried {_tried(environ)})") from e
    if credentials is None:
        raise NoCredentials(f"no AWS credentials found: tried {_tried(environ)}")
    return ResolvedCredentials(credentials=credentials, region=str(region), session=session)


def _read_settings_from(session: Any, environ: Mapping[str, str]) -> None:
    """Make every setting botocore reads from the environment (profile, files, region, IMDS
    options, ...) come from ``environ``: the same chains botocore builds, over another mapping."""
    from botocore.configprovider import (  # type: ignore[import-untyped]
        BOTOCORE_DEFAUT_SESSION_VARIABLES,
        ConfigChainFactory,
    )

    chains = ConfigChainFactory(session=session, environ=environ)
    store = session.get_component("config_store")
    for name, spec in BOTOCORE_DEFAUT_SESSION_VARIABLES.items():
        config_key, env_names, default, convert = spec
        store.set_config_provider(
            name,
            chains.create_config_chain(
                instance_name=name,
                env_var_names=env_names,
                config_property_names=config_key,
                default=default,
                conversion_func=convert,
            ),
        )


def _imds_disabled(environ: Mapping[str, str]) -> bool:
    return environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true"


def _tried(environ: Mapping[str, str]) -> str:
    """The chain's sources as an operator would check them, with what each had to offer."""
    profile = environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE") or "default"
    files = []
    for variable, default in (
        ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
        ("AWS_CONFIG_FILE", "~/.aws/config"),
    ):
        path = os.path.expanduser(environ.get(variable) or default)
        files.append(path if os.path.exists(path) else f"{path} (absent)")
    keys = "set" if "AWS_ACCESS_KEY_ID" in environ else "not set"
    container = (
        "set"
        if {"AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"}
        & environ.keys()
        else "not set"
    )
    instance = (
        "disabled by AWS_EC2_METADATA_DISABLED" if _imds_disabled(environ) else "no role found"
    )
    return (
        f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment or env file ({keys}); "
        f"profile {profile!r} in {' and '.join(files)}; "
        f"a container role (AWS_CONTAINER_CREDENTIALS_*_URI: {container}); "
        f"the instance role from the instance metadata service ({instance})"
    )
