"""Advisory OS file locks (``flock``) for stores: one writer at a time, readers seen by ``--overwrite``.

A lock lives as long as the file descriptor that holds it, so it dies with its process: a ``kill -9``
never leaves a stale lock behind. Lock files are never deleted (deleting one would let a second process
lock a new file of the same name while the first still holds the old one). Works on local disks and on
NFS (Linux maps ``flock`` to NFS byte-range locks); where a filesystem has no locks at all, acquiring
raises :class:`LocksUnsupported` and the caller decides (ingest warns; readers go on without).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
import weakref
from pathlib import Path

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}



def store_locks(store: Path) -> tuple[Path, Path]:
    """(writer, readers) lock files of a store: in a hidden folder beside it (``.<name>.lock/``), not inside,
    so zarr never sees them and deleting the store never deletes them. The writer lock is exclusive (the one
    ingest at work); readers share the readers lock, which an ``--overwrite`` takes exclusively."""
    folder = store.parent / f".{store.name}.lock"
    return folder / "writer", folder / "readers"


class LockHeld(OSError):
    """Another process holds the lock; ``holder`` describes it (pid, host, since) when known."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is locked by {holder}")
        self.path, self.holder = path, holder


class LocksUnsupported(OSError):
    """The filesystem of ``path`` does not support file locks."""


_held: "weakref.WeakSet[FileLock]" = weakref.WeakSet()


def _drop_in_child() -> None:
    """After a fork: the child closes its copies of the parent's lock descriptors. An flock belongs to the
    open file, which a forked worker shares; a worker that outlives a killed parent would hold the lock."""
    for lock in list(_held):
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = None


os.register_at_fork(after_in_child=_drop_in_child)


class FileLock:
    """A non-blocking ``flock`` on ``path``: exclusive (one holder, who writes its pid/host into the file)
    or shared (any number of holders, none exclusive). Held by this process only: forked children drop it."""

    def __init__(self, path, shared: bool = False):
        self.path, self.shared = Path(path), shared
        self._fd: int | None = None

    def acquire(self) -> "FileLock":
        """Take the lock now or raise :class:`LockHeld`. An exclusive lock creates its file if missing; a shared
        one opens an existing file read-only (readers need no write access, and never leave lock files in
        folders that are not theirs), so it raises FileNotFoundError where there is none."""
        if self.shared:
            fd = os.open(self.path, os.O_RDONLY)
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockHeld(self.path, holder_of(self.path)) from None
            if exc.errno in _UNSUPPORTED:
                raise LocksUnsupported(f"{self.path}: the filesystem does not support file locks ({exc})") from None
            raise
        self._fd = fd
        _held.add(self)
        if not self.shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            if not self.shared:
                try:
                    os.ftruncate(fd, 0)  # the file no longer names a holder
                except OSError:
                    pass
            os.close(fd)  # closing drops the lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


def holder_of(path: Path) -> str:
    """Who holds the lock on ``path``: what an exclusive holder wrote into it, else the pids that
    ``/proc/locks`` lists for the file on this host (shared holders write nothing)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        text = ""
    if text:
        return text
    pids = lock_pids(path)
    if pids:
        return f"process(es) {', '.join(map(str, pids))} on host {socket.gethostname()}"
    return "another process (on this or another host)"


def lock_pids(path: Path) -> list[int]:
    """Pids holding an flock on ``path`` on this host (Linux ``/proc/locks``), else []."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  READ  12345 08:01:1234567 0 EOF" ("->" marks a blocked waiter)
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        if fields[5] == want and fields[4].isdigit():
            pids.append(int(fields[4]))
    return sorted(set(pids))
