"""One run per output folder: rank 0 holds an exclusive lock on `run.lock` there while the run lives,
so two runs can never mix their checkpoints, adapters and metrics in one folder.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Optional

from foundation.cli import UsageError
from foundation.files import entry_problem

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
_held: dict[str, "RunLock"] = {}  # resolved folder -> the lock this process holds on it


class RunLocked(UsageError):
    """Another run holds (or may hold) the output folder; the message names its host and process."""


def _holder(text: str) -> Optional[dict]:
    """Who the lock file names; None for an empty (released) or garbled one, which claims nothing."""
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) and "host" in holder else None


def _who(holder: Optional[dict]) -> str:
    if not holder:
        return "another run (it has not written its name yet)"
    started = f", started {holder['started']}" if holder.get("started") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{started}"


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # another user's process, or a pid we cannot read: assume it runs
    return True


class RunLock:
    """The exclusive lock of one output folder, held by this process until `release()`.

    `fcntl.flock` on `run.lock`, which the kernel drops when its holder dies; the file names the holder (host,
    pid, start time). Flock held: refused, naming the holder. Free, and the file names a process of this host:
    that run was killed; taken over with a warning. Free, but another host: refused (flock may not reach across
    hosts on a shared filesystem). Empty or garbled: taken. Without flock, a same-host holder counts as alive
    while its pid is. Release removes the file.
    """

    def __init__(self, path: Path, file):
        self.path, self.file = path, file

    @classmethod
    def acquire(cls, folder: str | os.PathLike) -> "RunLock":
        folder = Path(folder)
        earlier = _held.pop(str(folder.resolve()), None)
        if earlier is not None:
            earlier.release()
        path = folder / LOCK_FILE
        while True:
            file = _open_lock_file(path, folder)
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                trusted = True
            except BlockingIOError:
                holder = _holder(file.read())
                _close(file)
                raise RunLocked(f"--output_dir {folder} is in use by {_who(holder)} ({path}); wait for that run "
                                "to end or pick another --output_dir") from None
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    _close(file)
                    raise
                trusted = False
            if _same_file(file, path):
                break
            _close(file)  # the holder released (removed) it between our open and flock: lock the new file
        lock = cls(path, file)
        try:
            lock._claim(folder, _holder(file.read()), trusted)
        except BaseException:
            _close(file)
            raise
        _held[str(folder.resolve())] = lock
        return lock

    def _claim(self, folder: Path, holder: Optional[dict], trusted: bool) -> None:
        host = socket.gethostname()
        if holder and holder.get("host") != host:
            raise RunLocked(f"--output_dir {folder} is locked by {_who(holder)} ({self.path}): a lock of another "
                            "host is never taken over; if that run is over, delete the file, else pick another "
                            "--output_dir")
        if holder and not trusted and _alive(holder.get("pid")):
            raise RunLocked(f"--output_dir {folder} is in use by {_who(holder)} ({self.path}); wait for that run "
                            "to end or pick another --output_dir")
        if not trusted:
            logger.warning("%s: this filesystem has no flock; the run lock is advisory only", self.path)
        if holder:
            logger.warning("--output_dir %s: taking over the lock of %s, which ended without releasing it",
                           folder, _who(holder))
        try:
            self.file.seek(0)
            self.file.truncate()
            self.file.write(json.dumps({"host": host, "pid": os.getpid(),
                                        "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
            self.file.flush()
        except OSError as exc:  # a full or read-only disk: before any of the run's work
            raise RunLocked(f"--output_dir {folder}: cannot write its lock file {self.path} "
                            f"({exc.strerror or exc}); free space, or pick another --output_dir") from None

    def release(self) -> None:
        """Remove the file, then drop the flock (closing it): a run waiting on the old file locks a fresh one."""
        if self.file is None:
            return
        try:
            if _same_file(self.file, self.path):
                self.path.unlink()
        except OSError:
            pass  # the folder went away: nothing left to unlock
        _close(self.file)
        self.file = None
        for key, lock in list(_held.items()):
            if lock is self:
                del _held[key]


def _open_lock_file(path: Path, folder: Path):
    """`run.lock` opened for reading and writing, created if absent: never through a link (a link could send the
    holder's name into a file outside the folder), and only a regular file; anything else is one line."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise RunLocked(planted(folder, path, entry_problem(path) or f"not usable ({exc.strerror})")) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunLocked(planted(folder, path, entry_problem(path) or "not a regular file"))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r+", encoding="utf-8", errors="replace")  # a garbled name claims nothing


def planted(folder: Path, path: Path, problem: str) -> str:
    """The one line refusing a run folder whose entry `path` is `problem` (`foundation.files.entry_problem`)."""
    return f"--output_dir {folder}: its {path.name} ({path}) is {problem}; remove it, or pick another --output_dir"


def _close(file) -> None:
    """Close `file` even when what it still buffers cannot be written (a full disk): the write's failure is the
    one reported, and closing drops the flock either way."""
    try:
        file.close()
    except OSError:
        pass


def _same_file(file, path: Path) -> bool:
    try:
        mine, now = os.fstat(file.fileno()), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


@atexit.register
def _release_all() -> None:
    """A run that ends in an error exits through here: its folder is free again, with no stale file."""
    for lock in list(_held.values()):
        lock.release()
