"""A space's env file, ``<data>/<host>.env``: the only plaintext copy of its admin token.

Written atomically and private from the first byte (:func:`lchat.files.write_atomic`, mode 0600).
Lines other than ``LCHAT_ADMIN_TOKEN`` (an operator's own settings) survive a rewrite. The CLI
writes these files, and so does the router when a mesh peer replicates a route
(:mod:`lchat.mesh.api`).
"""

from __future__ import annotations

import os
import pwd
import re
import stat
from collections.abc import Iterable, Mapping

from lchat import config
from lchat.files import write_atomic

TOKEN_VAR = "LCHAT_ADMIN_TOKEN"  # noqa: S105 -- a variable name, not a secret
MODE = 0o600


def read_token(path: str) -> str | None:
    """The token already in ``path``, or None when the file or the variable is absent."""
    return config.read_env_file(path).get(TOKEN_VAR) or None


def write_token(path: str, token: str) -> None:
    """Set ``LCHAT_ADMIN_TOKEN`` in ``path`` (:func:`assign`), keeping any other lines, mode
    exactly 0600."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        lines = []
    assign(lines, TOKEN_VAR, token)
    write_lines(path, lines)


def write_lines(path: str, lines: list[str]) -> None:
    """Write ``lines`` (an env file's, as :func:`assign` leaves them) to ``path``, atomically,
    mode 0600 from the first byte."""
    write_atomic(path, "".join(f"{line}\n" for line in lines).encode("utf-8"), MODE)


def assign(lines: list[str], name: str, value: str) -> bool:
    """Set ``name`` to ``value`` in ``lines`` (an env file's), every other line kept: its last
    assignment (the one that wins) is rewritten, else its first commented-out one (as the
    example has them) becomes it, else the line is appended. True when an assignment was
    rewritten; ValueError as :func:`env_line`."""
    line = env_line(name, value)
    assignment = rf"\s*(?:export\s+)?{name}\s*="
    assigned = [i for i, x in enumerate(lines) if re.match(assignment, x)]
    commented = [i for i, x in enumerate(lines) if re.match(rf"\s*#{assignment}", x)]
    if assigned or commented:
        lines[assigned[-1] if assigned else commented[0]] = line
    else:
        lines.append(line)
    return bool(assigned)


def env_line(name: str, value: str) -> str:
    """``NAME=VALUE`` spelled so that :func:`lchat.config.read_env_file` reads back exactly
    ``value``; raises ValueError for a name or value no line can carry (a line break, a control
    character, or both quote characters where quoting is needed)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"{name!r} is not a variable name")
    if any(_breaks_line(c) for c in value):
        raise ValueError(f"{name}: the value holds a line break or a control character")
    plain = (
        value == value.strip()
        and value[:1] not in ("'", '"')
        and not re.search(r"\s#", value)
        and not value.startswith("#")
    )
    if plain and value:
        return f"{name}={value}"
    for quote in ("'", '"'):
        if quote not in value:
            return f"{name}={quote}{value}{quote}"
    raise ValueError(f"{name}: the value needs quoting but holds both quote characters")


def write_env(path: str, values: Mapping[str, str]) -> None:
    """Write exactly ``values`` to ``path`` (sorted by name), atomically, mode 0600 from the
    first byte. ValueError (before anything is written) when a value cannot be carried."""
    text = "".join(f"{env_line(name, values[name])}\n" for name in sorted(values))
    write_atomic(path, text.encode("utf-8"), MODE)


def edit(path: str, assign_values: Mapping[str, str], unset: Iterable[str] = ()) -> None:
    """Set ``assign_values`` (:func:`assign`) and remove every assignment of the names in
    ``unset`` in the env file ``path``, every other line kept, atomically and mode 0600
    (``lchat env``). The file keeps its owner and group: run as root, the edit must not leave
    a hibernating space's file, which the router's user reads at each wake, owned by root (a
    wake that cannot read it fails). ValueError (before anything is written) when a value
    cannot be carried; FileNotFoundError when the file is absent (a space's env file is made by
    its create)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
        st = os.fstat(f.fileno())
    # (Only root may give a file away; anyone else writes it as its own, as before.)
    uid, gid = (st.st_uid, st.st_gid) if os.geteuid() == 0 else (-1, -1)
    for name in unset:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"{name!r} is not a variable name")
        lines = [x for x in lines if not re.match(rf"\s*(?:export\s+)?{name}\s*=", x)]
    for name, value in assign_values.items():
        assign(lines, name, value)
    text = "".join(f"{line}\n" for line in lines).encode("utf-8")
    write_atomic(path, text, MODE, uid=uid, gid=gid)


def _breaks_line(c: str) -> bool:
    # What str.splitlines() splits on, plus every other control character except the tab.
    return (ord(c) < 0x20 and c != "\t") or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029"


def make_private(path: str) -> None:
    """Tighten an existing env file to 0600: it holds a secret."""
    if stat.S_IMODE(os.stat(path).st_mode) != MODE:
        os.chmod(path, MODE)


def owner_of_router(admin_socket: str, registry: str, data_dir: str) -> tuple[int, int]:
    """Who the router runs as, judged by who owns what it makes: its admin socket while it runs,
    else the registry it writes, else the data directory."""
    for path in (admin_socket, registry, data_dir):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        return st.st_uid, st.st_gid
    raise FileNotFoundError(2, "No such file or directory", data_dir)


def hand_to(path: str, uid: int, gid: int) -> tuple[bool, str]:
    """Make ``path`` owned by ``uid:gid`` and private (no group/other bits; never looser than it
    was). Returns whether it was right already, and what was done in a few words. Only root may
    change the owner; anyone else changes nothing but says so."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise OSError(f"{path} is not a regular file: not changing its owner")
    mode = stat.S_IMODE(st.st_mode)
    private = mode & ~0o077  # only ever removes bits
    owned = (st.st_uid, st.st_gid) == (uid, gid)
    if owned and mode == private:
        return True, f"already owned by {_user(uid)} with mode {mode:04o}"
    if os.geteuid() != 0:
        if owned:
            os.chmod(path, private, follow_symlinks=False)
            return False, f"owned by {_user(uid)}; mode {mode:04o} -> {private:04o}"
        return False, (
            f"owned by {_user(st.st_uid)}, not {_user(uid)} (the router's user), and not running "
            f"as root: left as it is; the router may fail to read it (chown it by hand)"
        )
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        # What was opened must be what was looked at, with one name: a hard link to another
        # file (/etc/shadow, say) swapped in since the lstat is not handed over.
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) or opened.st_nlink != 1:
            raise OSError(
                f"{path} changed while being handed over, or has another name: not changing "
                "its owner"
            )
        # Tighten before handing over, so the new owner never sees a looser file.
        if mode != private:
            os.fchmod(fd, private)
        if not owned:
            os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
    done = []
    if not owned:
        done.append(f"owner {_user(st.st_uid)} -> {_user(uid)}")
    if mode != private:
        done.append(f"mode {mode:04o} -> {private:04o}")
    return False, ", ".join(done)


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
