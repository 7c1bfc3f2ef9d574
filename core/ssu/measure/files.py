"""Files that several processes update at once (a tuning cache shared by the ranks of a
tensor-parallel job): an exclusive lock around read-merge-write, and atomic replacement, so that
no writer's entries are lost and no reader sees half a file.

The lock is an advisory lock on a sibling file ``NAME.lock`` (``fcntl.flock`` on POSIX,
``msvcrt.locking`` on Windows). The operating system releases it when its process ends, so a
crashed writer never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]


def lock_path(path: PathLike) -> Path:
    """The lock file that guards ``path``."""
    return Path(f"{os.fspath(path)}.lock")


@contextlib.contextmanager
def locked(path: PathLike, timeout: float = 120.0, poll: float = 0.02) -> Iterator[None]:
    """Hold the exclusive lock of ``path`` while the block runs.

    Waits up to ``timeout`` seconds for another holder; then raises ``TimeoutError`` naming the
    lock file (its holder is a live process: find it with ``fuser`` or ``lsof``)."""
    guard = lock_path(path)
    guard.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(guard, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while not _try_lock(fd):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{guard} is still held by another process after {timeout:.0f} s; "
                    "find it with `fuser` or `lsof` on that file"
                )
            time.sleep(poll)
        try:
            yield
        finally:
            _unlock(fd)
    finally:
        os.close(fd)


def write_atomically(path: PathLike, text: str) -> None:
    """Replace ``path`` by a file holding ``text``, so that a reader sees the old file or the new
    one, never a part: write a temporary file in the same folder, flush it to disk, rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


try:  # POSIX
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

except ImportError:  # Windows
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
