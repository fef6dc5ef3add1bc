"""Measuring, emptying and copying a folder that sandboxed code filled, whatever it put there.

A walk holds one directory descriptor at a time: it goes down by name (`O_NOFOLLOW`, so never
through a link) and back up through "..", and on every step up it checks that it landed on the
folder it came down from (device and inode), so a folder renamed under it can never take it
out of its root: it stops with `FolderChangedError` instead. A tree thousands of levels deep
thus costs neither recursion nor a path longer than one name. Folders whose permissions the
code took away are given back to their owner (the caller) through the descriptor held, never
by name. Standard library only: the sandbox's init (`sandbox_init.py`) loads this file too.
"""

from __future__ import annotations

import errno
import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1 << 20


class FolderChangedError(OSError):
    """The tree changed under a walk in a way that would have taken it out of its root."""


class _Cursor:
    """A directory descriptor that moves down by name and up through "..", checking each
    step up against the (device, inode) it recorded on the way down."""

    def __init__(self, fd: int, writable: bool) -> None:
        self.fd = fd
        self.writable = writable
        self.trail: list[tuple[int, int]] = []  # (device, inode) of each folder above

    def down(self, name: str) -> None:
        child = _open_dir(name, self.fd, self.writable)
        here = os.fstat(self.fd)
        self.trail.append((here.st_dev, here.st_ino))
        os.close(self.fd)
        self.fd = child

    def up(self) -> None:
        parent = os.open("..", _DIR_FLAGS, dir_fd=self.fd)
        there = os.fstat(parent)
        if (there.st_dev, there.st_ino) != self.trail[-1]:
            os.close(parent)
            raise FolderChangedError(
                errno.ESTALE, "a folder was moved during the walk; stopped inside the root"
            )
        self.trail.pop()
        os.close(self.fd)
        self.fd = parent

    def close(self) -> None:
        os.close(self.fd)


def _fix_mode(fd: int, writable: bool) -> None:
    """Give the owner back the rights the walk needs (root has them whatever the mode)."""
    if os.geteuid() == 0:
        return
    need = 0o700 if writable else 0o500
    if stat.S_IMODE(os.fstat(fd).st_mode) & need != need:
        os.chmod(f"/proc/self/fd/{fd}", need)  # the held folder itself, whatever its name now


def _open_dir(name: str, parent: int, writable: bool) -> int:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:
        # no read right: take the folder by an O_PATH descriptor (needs none), give the rights
        # back through it, and reopen that same folder through the descriptor
        path_fd = os.open(
            name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent
        )
        try:
            _fix_mode(path_fd, writable)
            # the magic link names the held folder: followed on purpose (no O_NOFOLLOW)
            fd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        finally:
            os.close(path_fd)
    _fix_mode(fd, writable)
    return fd


def _root(folder: str | int, writable: bool) -> _Cursor:
    """A cursor on `folder` (a path the host made, or a directory descriptor, duplicated)."""
    if isinstance(folder, int):
        fd = os.open(".", _DIR_FLAGS, dir_fd=folder)
    else:
        fd = os.open(folder, _DIR_FLAGS)
    _fix_mode(fd, writable)
    return _Cursor(fd, writable)


def _scan(fd: int, remove: bool, room: int | None) -> tuple[list[str], int, int]:
    """(sub-folder names, bytes, entries) of one folder; files and links unlinked if `remove`;
    stops once more than `room` entries were seen (None: no bound)."""
    folders, size, count = [], 0, 0
    with os.scandir(fd) as entries:
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            count += 1
            size += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                folders.append(entry.name)
            elif remove:
                os.unlink(entry.name, dir_fd=fd)
            if room is not None and count > room:
                break
    return folders, size, count


def _walk(folder: str | int, remove: bool, max_entries: int | None = None) -> tuple[int, int]:
    cursor = _root(folder, remove)
    try:
        folders, size, count = _scan(cursor.fd, remove, max_entries)
        pending = [folders]  # per level: the sub-folders not walked yet
        names: list[str] = []  # the folder names from the root down to the current one
        while pending:
            if max_entries is not None and count > max_entries:
                break
            if pending[-1]:
                name = pending[-1].pop()
                cursor.down(name)
                names.append(name)
                room = None if max_entries is None else max_entries - count
                folders, s, c = _scan(cursor.fd, remove, room)
                pending.append(folders)
                size, count = size + s, count + c
                continue
            pending.pop()
            if not names:
                break
            cursor.up()
            name = names.pop()
            if remove:
                os.rmdir(name, dir_fd=cursor.fd)
    finally:
        cursor.close()
    return size, count


def tree_usage(folder: str | int, max_entries: int | None = None) -> tuple[int, int]:
    """(bytes allocated, entries) under `folder`, itself not counted. With `max_entries`
    the walk stops once it has seen more than that many: the count it returns is then just
    past the bound, so a huge tree costs no more than the quota it breaks."""
    return _walk(folder, remove=False, max_entries=max_entries)


def empty_tree(folder: str | int) -> None:
    """Remove everything under `folder` (a path or a directory descriptor), keeping it."""
    _walk(folder, remove=True)


def remove_tree(folder: str) -> None:
    """Remove `folder` and everything under it; a missing folder is not an error."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(folder)
        return
    _walk(folder, remove=True)
    os.rmdir(folder)


def _copy_data(src: int, dst: int, budget: list[int]) -> None:
    """Copy a file's data extents only (holes stay holes), spending `budget[0]` bytes."""
    size = os.fstat(src).st_size
    pos = 0
    while pos < size:
        try:
            start = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        end = os.lseek(src, start, os.SEEK_HOLE)
        while start < end:
            chunk = os.pread(src, min(_COPY_CHUNK, end - start), start)
            if not chunk:
                break
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise OSError(errno.EDQUOT, "the copy went past its byte budget")
            os.pwrite(dst, chunk, start)
            start += len(chunk)
        pos = end
    os.ftruncate(dst, size)


def _copy_entries(src: int, dst: int, budget: list[int], owner: int | None) -> list[str]:
    """Copy one folder's files, links and FIFOs from `src` into `dst`; make its sub-folders
    there and return their names. Sockets and devices are left out."""
    folders = []
    with os.scandir(src) as entries:
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            name, mode = entry.name, stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(name, 0o700, dir_fd=dst)
                folders.append(name)
            elif stat.S_ISREG(st.st_mode):
                s = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src)
                try:
                    d = os.open(
                        name,
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600,
                        dir_fd=dst,
                    )
                    try:
                        _copy_data(s, d, budget)
                        os.fchmod(d, (mode & 0o777) | 0o600)
                        if owner is not None:
                            os.fchown(d, owner, owner)
                    finally:
                        os.close(d)
                finally:
                    os.close(s)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
            elif stat.S_ISFIFO(st.st_mode):
                os.mkfifo(name, (mode & 0o777) | 0o600, dir_fd=dst)
            else:
                continue
            if owner is not None and not stat.S_ISREG(st.st_mode):
                os.chown(name, owner, owner, dir_fd=dst, follow_symlinks=False)
    return folders


def copy_tree(src: int, dst: int, max_bytes: int, owner: int | None = None) -> None:
    """Copy everything under the folder `src` into the empty folder `dst` (descriptors):
    files (holes kept), links as links, FIFOs, folders with the owner's rights always kept
    (`| 0o700`, files `| 0o600`), owned by `owner` when given. Hard links become separate
    files, so the copy stops with EDQUOT past `max_bytes` of data."""
    budget = [max_bytes]
    source, target = _root(src, False), _root(dst, True)
    try:
        pending = [_copy_entries(source.fd, target.fd, budget, owner)]
        while pending:
            if pending[-1]:
                name = pending[-1].pop()
                mode = stat.S_IMODE(os.stat(name, dir_fd=source.fd, follow_symlinks=False).st_mode)
                source.down(name)
                target.down(name)
                os.fchmod(target.fd, mode | 0o700)
                pending.append(_copy_entries(source.fd, target.fd, budget, owner))
                continue
            pending.pop()
            if len(pending) > 0:
                source.up()
                target.up()
    finally:
        source.close()
        target.close()


__all__ = ["FolderChangedError", "copy_tree", "empty_tree", "remove_tree", "tree_usage"]
