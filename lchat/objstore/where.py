"""Where a bucket is: one value type for every setting that names a bucket, one URL grammar.

``s3://BUCKET[/PREFIX][?region=R&endpoint=URL&access_key_env=NAME&secret_key_env=NAME]`` or
``file:PATH`` (``LCHAT_CLOUD_ID_LEDGER``, ``LCHAT_REGION_BUCKETS``, ``LCHAT_MESH_BUCKET``,
``LCHAT_RELEASE_MIRROR_URL``, ``lchat fleet --publish``); the ``LCHAT_{HIBERNATE,BACKUP}_*``
variables spell the same thing in parts (:attr:`lchat.config.HibernateConfig.where`).

Invariants: ``bucket`` is an S3 bucket name or ``file:<absolute path>`` (what
:func:`lchat.objstore.open_store` opens); ``prefix`` has no leading or trailing ``/``, no ``..``
segment and no NUL; ``region`` here is only ever the S3 signing region (``s3_region``), never the
mesh label a bucket may be filed under; the key pair is named, never held.
"""

from __future__ import annotations

import os.path
import re
from urllib.parse import parse_qsl, urlencode, urlsplit

from attrs import frozen

_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_REGION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


@frozen
class Where:
    """A bucket and the prefix inside it, with how to reach it (``s3_region`` signs requests, ""
    for the credential chain's region; ``endpoint`` an S3-compatible store, path-style) and the
    names of the variables holding its own key pair ("": the box's standard AWS chain)."""

    bucket: str
    prefix: str = ""
    s3_region: str = ""
    endpoint: str = ""
    access_key_env: str = ""
    secret_key_env: str = ""

    @property
    def is_file(self) -> bool:
        """``file:PATH``: a local directory as the bucket (one box, tests); needs no credentials."""
        return self.bucket.startswith("file:")

    @property
    def directory(self) -> str:
        """A ``file:`` bucket's directory (absolute)."""
        assert self.is_file, self.bucket
        return self.bucket[len("file:") :]

    def key(self, *parts: str) -> str:
        """An object key under the prefix."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def same_place(self, other: Where) -> bool:
        """Whether both name the same objects (bucket, prefix and endpoint): a shared bucket."""
        return (self.bucket, self.prefix, self.endpoint) == (
            other.bucket,
            other.prefix,
            other.endpoint,
        )

    def __str__(self) -> str:
        """The URL form :func:`parse_where` reads back (no secrets: keys are only named)."""
        if self.is_file:  # a directory: the prefix, if any, is a subdirectory
            return self.bucket + (f"/{self.prefix}" if self.prefix else "")
        text = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        params = (
            ("region", self.s3_region),
            ("endpoint", self.endpoint),
            ("access_key_env", self.access_key_env),
            ("secret_key_env", self.secret_key_env),
        )
        query = [f"{k}={v}" for k, v in params if v]
        return text + ("?" + "&".join(query) if query else "")


def file_bucket(text: str) -> str:
    """``file:PATH`` -> ``file:<absolute path>``; :class:`ValueError` without a usable path."""
    path = text[len("file:") :]
    if not path or "\x00" in path:
        raise ValueError(f"{text!r}: file: needs a directory path")
    return "file:" + os.path.abspath(path)


def parse_where(text: str, *, keys: bool = True) -> Where:
    """Parse the URL grammar; :class:`ValueError` says what is wrong (the caller names the
    variable). ``keys=False`` (``LCHAT_CLOUD_ID_LEDGER``): no ``access_key_env``/
    ``secret_key_env``, which are then unknown parameters."""
    names = {"access_key_env": "", "secret_key_env": ""}
    if keys:
        # The key names come off first, the rest is read as the ledger's grammar (so that
        # ``file:PATH?...`` stays the path it always was).
        base, _, query = text.partition("?")
        rest = []
        for name, value in parse_qsl(query, keep_blank_values=True):
            if name in names:
                if not _ENV_NAME.fullmatch(value):
                    raise ValueError(f"{name}={value!r} is not a variable name")
                names[name] = value
            else:
                rest.append((name, value))
        if bool(names["access_key_env"]) != bool(names["secret_key_env"]):
            raise ValueError(
                "give both access_key_env and secret_key_env, "
                "or neither (the box's AWS credential chain)"
            )
        text = base + ("?" + urlencode(rest) if rest else "")
    where = _parse_url(text)
    if where.is_file and names["access_key_env"]:
        raise ValueError("a file: bucket takes no keys")
    return Where(where.bucket, where.prefix, where.s3_region, where.endpoint, **names)


def _parse_url(text: str) -> Where:
    text = text.strip()
    if text.startswith("file:"):
        return Where(file_bucket(text))
    parts = urlsplit(text)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(
            f"{text!r} is neither s3://BUCKET[/PREFIX][?region=R&endpoint=URL] nor file:PATH"
        )
    bucket = parts.netloc
    if not _BUCKET_NAME.fullmatch(bucket):
        raise ValueError(f"{text!r}: {bucket!r} is not an S3 bucket name")
    prefix = parts.path.strip("/")
    if "\x00" in prefix or ".." in prefix.split("/") or "//" in prefix:
        raise ValueError(f"{text!r}: {prefix!r} is not a safe key prefix")
    if parts.fragment:
        raise ValueError(f"{text!r} must not have a fragment")
    region = endpoint = ""
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if name == "region":
            if not _REGION.fullmatch(value):
                raise ValueError(f"{text!r}: region={value!r} is not a region name")
            region = value
        elif name == "endpoint":
            at = urlsplit(value)
            if at.scheme not in ("http", "https") or not at.netloc:
                raise ValueError(f"{text!r}: endpoint={value!r} must be an http(s) URL")
            endpoint = value.rstrip("/")
        else:
            raise ValueError(f"{text!r}: unknown parameter {name!r} (only region and endpoint)")
    return Where(bucket, prefix, region, endpoint)
