"""Replacing a small file atomically: the one way lchat writes the files it must never leave half
written (env files with their tokens, certificates and keys, the clean-sleep marker, a sidecar's
schedule), and the one way a root-run command puts a file into a directory another user writes.

:func:`write_atomic` writes a temp file beside the target, created with ``O_EXCL`` and set to the
final mode before the first byte, fsyncs it, renames it over the target and (by default) fsyncs
the directory. A reader, or a crash at any point, sees the old file or the complete new one, never
a mix; a secret is never readable by anyone the mode excludes, even for an instant.

Root writing into a directory the service user writes (the data dir, when ``lchat backup restore``
or ``lchat bootstrap`` runs as root) is a privilege boundary: that user can plant a symlink or a
hard link at any name there, or swap a file between two steps. So nothing here ever follows a
name it did not just create: the temp name is random and opened ``O_CREAT|O_EXCL|O_NOFOLLOW``
(a planted link makes the open fail, never redirects it), the owner and mode are set on the open
descriptor (``fchown``/``fchmod``) *before* the rename, the rename replaces whatever is at the
name (a planted symlink itself, never what it points to), and nothing is chowned by path
afterwards. With ``dir_fd`` every step is relative to one directory descriptor, so a directory
swapped for a symlink mid-way cannot redirect the later steps either (:func:`open_directory`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat

COPY_CHUNK = 1 << 20  # bytes per copy_file_range/read when a file is installed by copying


class UnsafePath(OSError):
    """A path that is not what a root-run writer may touch (a symlink, a hard-linked file, not a
    directory); the message says which and why."""


def write_atomic(
    path: str,
    data: bytes,
    mode: int = 0o600,
    *,
    fsync_dir: bool = True,
    uid: int = -1,
    gid: int = -1,
    dir_fd: int | None = None,
) -> None:
    """Replace ``path`` with ``data`` (:class:`Replacement`, whose arguments these are)."""
    staged = Replacement(path, mode, fsync_dir=fsync_dir, uid=uid, gid=gid, dir_fd=dir_fd)
    try:
        view, fd = memoryview(data), staged.file.fileno()
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        staged.discard()
        raise
    staged.commit()


class Replacement:
    """The next version of ``path``, written to :attr:`file` (a temp file beside it, for a body
    streamed in pieces) and put in place by :meth:`commit` (fsync, rename, fsync the directory
    unless ``fsync_dir=False``: for a file whose loss in a crash, the old version back, costs
    nothing); :meth:`discard`, or a failed commit, removes it and leaves ``path`` as it was.

    The temp file is ``.<name>.<random>.tmp`` (same filesystem, so the rename is atomic; hidden
    and ``*.tmp``, so directory scanners skip it), has exactly ``mode`` before its first byte and
    is owned by ``uid``/``gid`` when given (set on the descriptor: nothing is chowned by path).
    ``dir_fd``: ``path`` is a plain name in that directory (the module docstring)."""

    def __init__(
        self,
        path: str,
        mode: int = 0o600,
        *,
        fsync_dir: bool = True,
        uid: int = -1,
        gid: int = -1,
        dir_fd: int | None = None,
    ) -> None:
        if dir_fd is not None:
            _check_plain_name(path)
        self._directory, name = ("", path) if dir_fd is not None else os.path.split(path)
        self._path, self._dir_fd, self._fsync_dir = path, dir_fd, fsync_dir
        self._tmp = os.path.join(self._directory, f".{name}.{secrets.token_hex(6)}.tmp")
        fd = _create_exclusive(self._tmp, mode, dir_fd)
        self.file = os.fdopen(fd, "wb")
        try:
            os.fchmod(fd, mode)  # the umask can only have removed bits: make the mode exact
            if uid >= 0 or gid >= 0:
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)  # a chown may clear set-id bits: the mode stays exact
        except BaseException:
            self.discard()
            raise

    def commit(self) -> None:
        try:
            with self.file:
                self.file.flush()
                os.fsync(self.file.fileno())
            os.replace(self._tmp, self._path, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except BaseException:
            self.discard()
            raise
        if self._fsync_dir and self._dir_fd is not None:
            os.fsync(self._dir_fd)
        elif self._fsync_dir:
            fsync_directory(self._directory)

    def discard(self) -> None:
        with contextlib.suppress(OSError):  # a flush that failed before fails again: closed anyway
            self.file.close()
        _unlink_quietly(self._tmp, self._dir_fd)


def install_file(
    source: str,
    dir_fd: int,
    name: str,
    *,
    mode: int | None = None,
    uid: int = -1,
    gid: int = -1,
    overwrite: bool,
) -> None:
    """Put the regular file ``source`` (in a directory only this process's user writes: a
    ``mkdtemp`` of its own) at ``name`` in the directory ``dir_fd``, owned by ``uid``/``gid``
    when given and with ``mode`` (default: the source's), without following any name in the
    target directory (module docstring).

    Renamed into place when both are on one filesystem, else copied into an exclusive temp file
    there first. ``overwrite=False`` never replaces an existing ``name`` (:class:`FileExistsError`,
    even for one created meanwhile: a hard link, not a rename, publishes it); ``True`` replaces
    it, or a symlink planted there (the link itself). The source is consumed either way."""
    _check_plain_name(name)
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise UnsafePath(f"{source} is not a regular file of its own (links {st.st_nlink})")
        final = stat.S_IMODE(st.st_mode) if mode is None else mode
        if st.st_dev == os.fstat(dir_fd).st_dev:
            staged, tmp, where = src, source, None  # the source itself goes into place
        else:
            tmp = f".{name}.{secrets.token_hex(6)}.tmp"
            staged, where = _create_exclusive(tmp, 0o600, dir_fd), dir_fd
        try:
            if staged != src:
                _copy(src, staged, st.st_size)
            if uid >= 0 or gid >= 0:
                os.fchown(staged, uid, gid)
            os.fchmod(staged, final)
            os.fsync(staged)
        except BaseException:
            if where is not None:
                os.close(staged)
                _unlink_quietly(tmp, where)
            raise
        if staged != src:
            os.close(staged)
    finally:
        os.close(src)
    try:
        if overwrite:
            os.replace(tmp, name, src_dir_fd=where, dst_dir_fd=dir_fd)
        else:
            os.link(tmp, name, src_dir_fd=where, dst_dir_fd=dir_fd, follow_symlinks=False)
            _unlink_quietly(tmp, where)
    except BaseException:
        _unlink_quietly(tmp, where)
        raise
    os.fsync(dir_fd)


def open_directory(path: str) -> int:
    """A descriptor of the directory ``path`` for the ``dir_fd`` arguments here (the caller
    closes it). The last component must be a real directory, not a symlink to one
    (:class:`UnsafePath`)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafePath(f"{path} is a symbolic link: refusing to write through it") from e
        raise


def fsync_directory(directory: str) -> None:
    """Make the entries of ``directory`` (a rename, a new file) durable."""
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_exclusive(path: str, mode: int, dir_fd: int | None) -> int:
    # O_EXCL with O_CREAT fails on any existing name, a symlink included (it is never followed).
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, mode, dir_fd=dir_fd)


def _copy(src: int, dst: int, size: int) -> None:
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, min(COPY_CHUNK, size - done), done, done)
        except OSError:
            chunk = os.pread(src, min(COPY_CHUNK, size - done), done)
            n = len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.pwrite(dst, view, done + n - len(view)) :]
        if n == 0:
            raise OSError(f"the file shrank while it was copied ({done} of {size} bytes)")
        done += n


def _check_plain_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\x00" in name:
        raise ValueError(f"{name!r} is not a plain file name")


def _unlink_quietly(name: str, dir_fd: int | None) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
