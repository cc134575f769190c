"""Atomic writes, the one way the project publishes a file or a folder: readers never see half of one.

A file is written beside its target and renamed over it; a folder is built under a temporary name,
flushed to disk, and renamed into place (checkpoints, saved adapters, the converted embedded model).
What is published gets the user's normal modes (0666 / 0777 less the umask), as a plain `open` or `mkdir`
would give, so another user (an inference server) can read it: temporary files and folders start private,
and safetensors writes 0600 files.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

from foundation.cli import InputError, UsageError, first_line


class SaveError(InputError):
    """A file or folder that could not be written (a full disk, a file size limit); the message says where."""


# torch.save reports a failed write (ENOSPC included) as a RuntimeError from its zip writer.
_TORCH_WRITE_FAILURE = ("inline_container", "PytorchStreamWriter", "iostream error")


def current_umask() -> int:
    """The process's umask, read from /proc/self/status (Linux), else through os.umask."""
    # /proc reads it at each call without changing it; os.umask reads only by setting, racing other threads.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def file_mode(umask: int, executable: bool = False) -> int:
    return (0o777 if executable else 0o666) & ~umask


def folder_mode(umask: int) -> int:
    return 0o777 & ~umask


def set_published_modes(root: Path) -> None:
    """Give `root` and everything below it the modes a plain `mkdir` / `open` would have (files keep
    whether their owner may execute them)."""
    umask = current_umask()
    os.chmod(root, folder_mode(umask))
    for path in Path(root).rglob("*"):
        if path.is_symlink():
            continue
        if path.is_dir():
            os.chmod(path, folder_mode(umask))
        elif path.is_file():
            os.chmod(path, file_mode(umask, bool(path.stat().st_mode & 0o100)))


def write_atomic(path: Union[str, os.PathLike], data: Union[str, bytes]) -> Path:
    """Write `data` to `path` through a temporary file in the same folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        os.fchmod(fd, file_mode(current_umask()))  # mkstemp makes it 0600
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def fsync_tree(root: Path) -> None:
    """Flush every file below `root`, so a rename never publishes data still in the page cache only."""
    for path in Path(root).rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def publish_folder(tmp: Path, target: Path, replace: bool = True) -> Path:
    """Make the finished folder `tmp` (flushed first, with the user's modes) the `target`. With replace=False
    an existing `target` wins (another process published the same thing first) and `tmp` is dropped."""
    set_published_modes(tmp)
    fsync_tree(tmp)
    if target.exists():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return target
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def publish_into_empty(tmp: Path, target: Path) -> Path:
    """Make the finished folder `tmp` (flushed first, with the user's modes) the `target` only where `target` is
    absent or an empty folder: one rename, which the kernel refuses over a non-empty folder or a file, so
    nothing that appeared at `target` meanwhile is deleted. Raises FileExistsError then."""
    set_published_modes(tmp)
    fsync_tree(tmp)
    try:
        os.rename(tmp, target)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(errno.EEXIST, "exists and is not an empty folder", str(target)) from None
        raise
    return target


def entry_problem(path: Union[str, os.PathLike], folder: bool = False, follow: bool = False) -> Optional[str]:
    """Why `path` cannot be written as a file (a folder with `folder`); None when it is absent or of that kind.
    Without `follow` a symbolic link is refused too: planted in a folder the program writes, it would send the
    writes elsewhere. A FIFO, socket or device is never a file to write (a FIFO would hang the writer)."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"not usable ({exc.strerror or exc})"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return None if folder else "a folder"
    if folder:
        return "a file, not a folder"
    return None if stat.S_ISREG(mode) else "not a regular file (a FIFO, socket or device)"


def check_writable(target: Union[str, os.PathLike], what: str, folder: bool = False) -> None:
    """A UsageError naming `what` unless `target` can be written: a file (a folder with `folder`) or absent, and a
    file can be written in it (a folder) or beside it, in its nearest existing folder. A read-only or full
    filesystem is found before the work whose result would go there."""
    problem = entry_problem(target, folder, follow=True)
    if problem:
        raise UsageError(f"{what} {target}: it is {problem}; pick another place")
    place = Path(target) if folder else Path(target).parent
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=place)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{what} {target}: cannot write in {place} ({exc.strerror or exc}); free space or pick "
                         "another place") from None


def write_failure(exc: BaseException) -> Optional[str]:
    """Why a write failed, when `exc` is a failed file write (OSError, torch's zip writer, safetensors' I/O
    error); None for any other error, which is left to propagate."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    text = str(exc)
    if "No space left" in text:
        return "No space left on device"
    if isinstance(exc, RuntimeError) and any(marker in text for marker in _TORCH_WRITE_FAILURE):
        return "a file write failed"
    if type(exc).__name__ == "SafetensorError" and "os error" in text.lower():
        return first_line(exc, 160)
    return None


def free_space(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**30:.2f} GiB free there"
    except OSError:
        return "free space unknown"


def _remedy(exc: BaseException) -> str:
    """What to do about a failed write: most often a full disk; the errors that say otherwise, their own fix."""
    code = getattr(exc, "errno", None)
    if code == errno.EFBIG or "os error 27" in str(exc):
        return "raise the file size limit (ulimit -f) and rerun"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EEXIST):
        return "pick a writable place and rerun"
    return "free space and rerun"


@contextmanager
def reported_write_failure(what: str, folder: Path) -> Iterator[None]:
    """A failed file write inside the block becomes one SaveError line naming `what`, the reason and the free
    space of `folder`."""
    try:
        yield
    except Exception as exc:
        reason = write_failure(exc)
        if reason is None:
            raise
        raise SaveError(f"{what}: could not be written ({reason}; {free_space(folder)}); {_remedy(exc)}") from None


@contextmanager
def staged_files(folder: Union[str, os.PathLike]) -> Iterator[Path]:
    """Yield an empty temporary folder inside `folder`; on success its files are renamed into `folder` one by one
    (replacing those of the same name; renames do not fail for want of space), on error it is removed: a write that
    fails leaves none of the set beside what the folder held before."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".staged-", dir=folder))
    try:
        yield tmp
        for path in sorted(tmp.iterdir()):
            os.replace(path, folder / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_folder(target: Union[str, os.PathLike], replace: bool = True, into_empty: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; on success it becomes `target` (`publish_folder`, or
    with `into_empty` `publish_into_empty`), on error it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield tmp
        if into_empty:
            publish_into_empty(tmp, target)
        else:
            publish_folder(tmp, target, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
