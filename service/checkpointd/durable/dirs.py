"""Directories held open: a save's place bound at its accept, never looked up by path again.

A save's target is checked when it is accepted (inside the run's folder,
symlinks resolved). Whatever happens to the path afterwards (a component
renamed, replaced by a symlink to somewhere else, or by a file), the save
must neither write, rename nor delete anywhere but where it was checked. So
the target's parent is opened at the accept by walking down from the run's
folder one component at a time with `O_NOFOLLOW` (making the missing ones
with `mkdirat`), and everything after goes through that descriptor:

- the staging dir is made inside it and opened too; the format writes into
  it through `/proc/self/fd/<fd>`, which names the open directory itself
  (no component of the old path is resolved again);
- the publication is a `renameat` from that descriptor to itself;
- before it, the target's path is resolved once more and must still lead to
  the same directory (device and inode), else the save is refused: a path
  that changed under a save is the caller's to look at, and nothing is
  committed (`Moved`);
- a discarded save is deleted through the descriptor (`shutil.rmtree`'s
  `dir_fd`), with the parents its staging made.

Reads of committed files go the same way (`open_file`): the save's dir is
opened from `/` along the real path its lookup checked (`open_real`), and
its files below it, with `O_NOFOLLOW` at every component.

Linux only (`/proc/self/fd`), as the daemon is. Stdlib only.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

_LOGGER = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Moved(Exception):
    """A path component was swapped for a symlink or a file, or a dir moved, after the accept."""


def open_dir(path: str) -> int:
    """Opens the directory `path` (following links on the way: `path` is one the caller checked)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_real(path: str) -> int:
    """Opens the directory `path`, a real path taken earlier, walking down from `/` without following a link.

    A component swapped for a link since the path was taken is refused, at
    whatever moment the swap lands: no window between a check and the open.

    Raises:
        Moved: a component of `path` is a link now.
        NotADirectoryError: a component is a file now.
        OSError: it cannot be opened (gone).
    """
    top = os.open("/", _DIR_FLAGS)
    try:
        fd, _ = open_below(top, [part for part in path.split("/") if part])
    finally:
        os.close(top)
    return fd


def open_file(base: str | int, path: str) -> int:
    """Opens the regular file `base/path` for reading, following no link below `base`.

    The one way a committed save's files are opened for reading: `base` is
    its dir held open (an fd, or `fd_path` of one: taken by `open_real` from
    the path its lookup checked), and every component of `path` below it,
    the file's own name included, is opened with `O_NOFOLLOW`. Whatever was
    swapped in since (a link, a file, a fifo), nothing outside is read.

    Args:
        base: an open directory (not closed here), or a directory's path
            (opened here, following its links: the caller's to trust).
        path: '/'-separated, relative, with no '', '.' or '..' component.

    Raises:
        Moved: a component (the file included) is a symlink.
        NotADirectoryError: a dir component is a file.
        FileNotFoundError: a component is missing.
        OSError: it is not a regular file (EINVAL), or another failure.
    """
    parent, _, name = path.rpartition("/")
    owned = isinstance(base, str)
    base_fd = open_dir(base) if isinstance(base, str) else base
    try:
        where, _ = open_below(base_fd, parent.split("/") if parent else [])
    finally:
        if owned:
            os.close(base_fd)
    try:
        # O_NONBLOCK: a fifo put in the file's place opens at once (and is refused below) instead of hanging.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=where)
    except OSError as e:
        _refuse(where, name, e, path)
    finally:
        os.close(where)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


def open_below(base_fd: int, parts: Sequence[str], *, create: bool = False) -> tuple[int, list[str]]:
    """Opens `base/parts[0]/parts[1]/...` without following a symlink at any component.

    Args:
        base_fd: an open directory (not closed here).
        parts: the components below it, none of them '', '.' or '..'.
        create: make the missing components (mode 0o777 less the umask).

    Returns:
        The open directory, and the components this call made (outermost
        first, each relative to `base_fd`, '/'-joined), for `remove_empty`.

    Raises:
        Moved: a component is a symlink.
        NotADirectoryError: a component is a file.
        FileNotFoundError: a component is missing and `create` is False.
        OSError: another failure of open or mkdir.
    """
    made: list[str] = []
    fd = os.dup(base_fd)
    try:
        for i, part in enumerate(parts):
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, dir_fd=fd)
                    made.append("/".join(parts[: i + 1]))
                except FileExistsError:
                    pass  # made meanwhile by another save: opened below, if it is a dir
                child = _open_checked(fd, part)
            except OSError as e:
                _refuse(fd, part, e, "/".join(parts[: i + 1]))
            os.close(fd)
            fd = child
        return fd, made
    except BaseException:
        os.close(fd)
        raise


def _open_checked(dir_fd: int, name: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        _refuse(dir_fd, name, e, name)


def _refuse(dir_fd: int, name: str, error: OSError, shown: str) -> NoReturn:
    """Raises what opening `name` in `dir_fd` as a dir without following a link met: a link is Moved."""
    if error.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            is_link = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
        except OSError:
            is_link = False
        if is_link or error.errno == errno.ELOOP:
            raise Moved(f"{shown!r} is a symlink") from error
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), shown) from error
    raise error


def walk(top: str) -> Iterator[tuple[str, list[str], list[str], int]]:
    """`os.fwalk(top, follow_symlinks=False)`, top-down, skipping a dir swapped for anything else since its listing.

    os.fwalk tells a link put in a dir's place from the dir, but not a file:
    it opens the file, finds it is what it lstat'ed a moment before, and
    fails listing it (NotADirectoryError), ending the walk. Here each dir
    is opened with O_DIRECTORY | O_NOFOLLOW, so whatever is not a dir now (a
    link, a file, a fifo: no open that blocks) is left alone, and the walk
    goes on. As with os.fwalk, a link to a dir is listed in `dirnames` (not
    descended), and the caller may prune `dirnames` in place.

    Raises:
        OSError: `top` cannot be opened or listed.
    """
    fd = open_dir(top)
    try:
        yield from _walk(fd, top)
    finally:
        os.close(fd)


def _walk(fd: int, path: str) -> Iterator[tuple[str, list[str], list[str], int]]:
    dirnames: list[str] = []
    filenames: list[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                (dirnames if entry.is_dir() else filenames).append(entry.name)
            except OSError:
                continue  # gone meanwhile
    yield path, dirnames, filenames, fd
    for name in dirnames:
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            continue  # gone, a link, or no dir any more: not descended
        try:
            yield from _walk(child, os.path.join(path, name))
        finally:
            os.close(child)


def exists(dir_fd: int, name: str) -> bool:
    """Whether `name` is an entry of the dir `dir_fd` (a link counts, unfollowed)."""
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def fd_path(fd: int) -> str:
    """A path that names the open directory `fd` itself, whatever its path has become."""
    return f"/proc/self/fd/{fd}"


def same_dir(fd: int, path: str) -> bool:
    """Whether `path` (links followed) is the directory open as `fd`."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return stat.S_ISDIR(now.st_mode) and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def remove_tree(dir_fd: int, name: str) -> None:
    """Deletes the tree or file `name` in the open directory `dir_fd`; symlinks are unlinked, never followed.

    Raises:
        OSError: it could not be deleted.
    """
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def remove_quietly(dir_fd: int, name: str, shown: object) -> None:
    """`remove_tree`, logged (with `shown` for where), never raising."""
    try:
        remove_tree(dir_fd, name)
    except OSError as e:
        _LOGGER.warning("could not remove %s in %s: %s", name, shown, e)


def remove_empty(base_fd: int, made: Sequence[str]) -> None:
    """Removes the dirs `open_below` made (relative to `base_fd`), deepest first, while they are empty.

    A dir another save has put something in meanwhile stays (rmdir refuses
    it), and so do the ones above it. Never raises.
    """
    for rel in reversed(made):
        parent, _, name = rel.rpartition("/")
        try:
            fd, _ = open_below(base_fd, parent.split("/") if parent else [])
        except (OSError, Moved):
            return
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError:
            return
        finally:
            os.close(fd)


@dataclass
class HeldDir:
    """A directory opened at a save's accept, with the ones opening it made."""

    fd: int
    made: list[str] = field(default_factory=list)  # relative to the base it was opened below
    base_fd: int = -1  # kept open (for remove_empty) while `made` is not empty

    def close(self) -> None:
        for fd in (self.fd, self.base_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.base_fd = -1


def hold_below(base: str | int, parts: Sequence[str], *, create: bool = True) -> HeldDir:
    """`open_below(base, parts, create=create)`, holding the base too if it made a dir (to remove it again).

    `base`: a dir's path (opened here), or an open dir, which is then the
    HeldDir's to close.

    Raises:
        Moved, OSError: as `open_below`.
    """
    base_fd = open_dir(base) if isinstance(base, str) else base
    try:
        fd, made = open_below(base_fd, parts, create=create)
    except BaseException:
        os.close(base_fd)
        raise
    if not made:
        os.close(base_fd)
        base_fd = -1
    return HeldDir(fd, made, base_fd)
