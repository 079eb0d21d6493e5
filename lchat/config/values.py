"""The grammar of one setting's value, shared by every part of the box's settings (and by
``lchat.home.config``): the env file's syntax, durations, sizes, keys, switches, domain lists,
bucket URLs. Each refusal is a :class:`ConfigError` whose message names the variable."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable

from lchat import hosts
from lchat.objstore.where import Where, parse_where

Getter = Callable[[str], str]  # a variable's value (its default when unset), stripped


class ConfigError(ValueError):
    """A setting that cannot be used. The message names the variable."""


def read_env_file(path: str, must_exist: bool = False) -> dict[str, str]:
    """Parse a systemd-style ``KEY=VALUE`` file: comments, blank lines, ``export``, quotes.

    An unquoted value ends at `` #`` (the seeds write inline comments). A line that is not an
    assignment is an error naming the file and line: a typo must not silently drop a setting.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        if must_exist:
            raise ConfigError(f"--env-file {path}: no such file") from None
        return {}
    except OSError as e:
        raise ConfigError(f"--env-file {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"--env-file {path}: not UTF-8 text") from e
    except ValueError as e:  # a NUL byte in the path
        raise ConfigError(f"--env-file {path!r}: {e}") from e
    result: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export ") :].lstrip()
        name, sep, value = stripped.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"{path}:{number}: expected NAME=VALUE")
        result[name] = _unquote(value, f"{path}:{number}")
    return result


def _unquote(value: str, where: str) -> str:
    if re.match(r"\s+#", value):  # ``NAME= # comment`` (as the seeds write): an empty value
        return ""
    value = value.strip()
    if value[:1] in ("'", '"'):
        quote = value[0]
        end = value.find(quote, 1)
        if end == -1:
            raise ConfigError(f"{where}: unterminated quote")
        rest = value[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise ConfigError(f"{where}: text after the closing quote")
        return value[1:end]
    comment = re.search(r"\s#", value)
    return value[: comment.start()].rstrip() if comment else value


def positive_duration(get: Getter, name: str) -> float:
    """``name``'s value, a duration longer than zero."""
    value = parse_duration(name, get(name))
    if value <= 0:
        raise ConfigError(f"{name} must be a positive duration")
    return value


def parse_duration(name: str, text: str) -> float:
    """Parse ``15m``, ``90s``, ``1h30m``, ``250ms`` (Go's duration syntax) into seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ConfigError(f"{name}={text!r} is not a duration (examples: 15m, 90s, 1h30m)")
    return sum(float(n) * units[u] for n, u in parts)


# Binary multiples, as nginx reads ``1k``/``1m``/``1g``; "KB"/"MB" are refused as ambiguous.
_SIZE_UNITS = {"": 1} | {
    unit: 1 << shift
    for shift, units in ((10, "k K KiB"), (20, "m M MiB"), (30, "g G GiB"))
    for unit in units.split()
}

_MAX_SIZE = (1 << 63) - 1  # what a 64-bit length can hold


def parse_size(name: str, text: str) -> int:
    """Parse a byte count: ``1048576``, ``512k``, ``100MiB``, ``2G`` (k/K/KiB, m/M/MiB, g/G/GiB:
    binary multiples) into bytes."""
    match = re.fullmatch(r"([0-9]+)([A-Za-z]*)", text)
    if not match or match.group(2) not in _SIZE_UNITS:
        raise ConfigError(
            f"{name}={text!r} is not a size in bytes (examples: 1048576, 512k, 100MiB, 2G)"
        )
    size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if size > _MAX_SIZE:
        raise ConfigError(f"{name}={text!r} is too large")
    return size


def aes_key(name: str, text: str) -> bytes:
    """An AES-256 key given in base64 (``openssl rand -base64 32``), checked."""
    padded = text + "=" * (-len(text) % 4)
    try:
        if re.fullmatch(r"[A-Za-z0-9+/]+=*", padded):
            key = base64.b64decode(padded, validate=True)
        else:
            key = base64.urlsafe_b64decode(padded.encode("ascii"))
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise ConfigError(f"{name} is not base64 (`openssl rand -base64 32`)") from None
    if len(key) != 32:
        raise ConfigError(
            f"{name} must be 32 bytes (AES-256) in base64, not {len(key)} bytes "
            f"(`openssl rand -base64 32`)"
        )
    return key


def one_of(name: str, text: str, *options: str) -> str:
    """``text`` if it is one of ``options``, else a refusal naming them."""
    if text not in options:
        listed = ", ".join(options[:-1]) + " or " + options[-1]
        raise ConfigError(f"{name} must be {listed}, not {text!r}")
    return text


def switch(name: str, text: str) -> bool:
    return one_of(name, text, "on", "off") == "on"


def comma_list(text: str) -> list[str]:
    """The items of a comma-separated list, stripped; empty ones left out."""
    return [item.strip() for item in text.split(",") if item.strip()]


def domains(name: str, text: str) -> tuple[str, ...]:
    try:
        return tuple(hosts.normalise(item) for item in comma_list(text))
    except hosts.InvalidHost as e:
        raise ConfigError(f"{name}: {e}") from e


def parse_bucket_url(what: str, url: str) -> Where:
    """:func:`lchat.objstore.where.parse_where`, a refusal a :class:`ConfigError` beginning
    with ``what``."""
    try:
        return parse_where(url)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from e
