"""Measuring and removing a folder that sandboxed code filled, whatever it put there.

The walk holds one directory descriptor at a time and climbs back through "..", so a tree
thousands of levels deep costs neither recursion nor a path longer than one name; links are
never followed (`O_NOFOLLOW`, `lstat` only); folders whose permissions the code took away are
given back to their owner (the caller, or root) first. Only call it when no process of the
sandbox is alive: nothing may change the tree during the walk.
"""

from __future__ import annotations

import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, parent: int | None, writable: bool) -> int:
    mode = 0o700 if writable else 0o500
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:
        os.chmod(name, mode, dir_fd=parent)  # a folder (lstat said so), not a link
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    if writable and stat.S_IMODE(os.fstat(fd).st_mode) & 0o300 != 0o300:
        os.chmod(fd, mode)
    return fd


def _scan(fd: int, remove: bool) -> tuple[list[str], int, int]:
    """(sub-folder names, bytes, entries) of one folder; files and links unlinked if `remove`."""
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
    return folders, size, count


def _walk(folder: str, remove: bool) -> tuple[int, int]:
    fd = _open_dir(folder, None, remove)
    folders, size, count = _scan(fd, remove)
    pending = [folders]  # per level: the sub-folders not walked yet
    names: list[str] = []  # the folder names from `folder` down to the current one
    try:
        while pending:
            if pending[-1]:
                name = pending[-1].pop()
                child = _open_dir(name, fd, remove)
                os.close(fd)
                fd = child
                names.append(name)
                folders, s, c = _scan(fd, remove)
                pending.append(folders)
                size, count = size + s, count + c
                continue
            pending.pop()
            if not names:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            name = names.pop()
            if remove:
                os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    return size, count


def tree_usage(folder: str) -> tuple[int, int]:
    """(bytes allocated, entries) under `folder`, itself not counted."""
    return _walk(folder, remove=False)


def empty_tree(folder: str) -> None:
    """Remove everything under `folder`, keeping the folder."""
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


__all__ = ["empty_tree", "remove_tree", "tree_usage"]
