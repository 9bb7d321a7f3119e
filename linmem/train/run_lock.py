"""The run folder's lock: one ``linmem train`` at a time writes into a run folder.

Before it changes anything in ``OUT``, the trainer (rank 0 alone under torchrun) takes an exclusive, non-blocking
``fcntl.flock`` on ``OUT/.linmem-train.lock`` and holds it until the run ends; the file names the holder (pid, host,
start time). A second trainer on the same folder fails at once with one line naming the folder and that holder.

The kernel drops a flock when the last descriptor of its open file closes, that is when the process ends, however
it ends (a ``kill -9`` too). So a lock file left by a killed run holds no lock: the next trainer takes it, rewrites
the file with its own pid and prints a warning naming the process that left it. There is no ``--break-lock``: a
lock that cannot be taken belongs to a live process, and breaking it would let two trainers write the same
checkpoints. A run that ends normally empties the file, so that an empty lock file reads as released, not stale.

On a file system without ``flock`` (``ENOLCK``, ``EOPNOTSUPP``) the run goes on unlocked, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

LOCK_NAME = ".linmem-train.lock"


class RunFolderLocked(ValueError):
    """Another live process holds the run folder's lock."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def describe_holder(holder: dict[str, Any]) -> str:
    """``pid 123 on host h (since START)`` (START: the holder's start time as it wrote it)."""
    since = f" (since {holder['since']})" if holder.get("since") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host', '?')}{since}"


def describe_live_holder(holder: dict[str, Any]) -> str:
    """``describe_holder`` of a lock that is held; a pid of this host that has ended is called so (a child that
    inherited its descriptor holds the lock then)."""
    if not holder:
        return "a process that has not yet written its pid"
    pid = holder.get("pid")
    gone = holder.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid)
    return describe_holder(holder) + (", which has ended: a process it started still holds the lock" if gone else "")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def read_holder(fd: int) -> dict[str, Any]:
    """The holder record in the open lock file ``fd`` (``{}`` when empty or unreadable)."""
    text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()
    try:
        holder = json.loads(text) if text else {}
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def open_lock_file(path: Path) -> int:
    """The lock file opened for reading and writing (created if absent); a symlink there is refused."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError(f"{path}: is a symlink where linmem train keeps the run folder's lock; remove "
                             "it") from None
        raise


class RunFolderLock:
    """The lock of one run folder, held from ``acquire`` to ``release`` (see the module doc)."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def acquire(self, folder: Path) -> None:
        """Take the lock of ``folder`` or raise ``RunFolderLocked`` naming its holder."""
        path = Path(folder) / LOCK_NAME
        fd = open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(fd)
            os.close(fd)
            raise RunFolderLocked(f"{folder}: another linmem train is writing this run folder "
                                  f"({describe_live_holder(holder)}; lock file "
                                  f"{LOCK_NAME}); wait for it to end, or choose another --out") from None
        except OSError as error:  # no flock on this file system
            os.close(fd)
            warn(f"{folder}: cannot lock the run folder ({os.strerror(error.errno)}); make sure no other "
                 "linmem train writes into it")
            return
        left = read_holder(fd)
        if left:
            warn(f"{folder}: taking over the run folder's lock from {describe_holder(left)}, which ended without "
                 f"releasing it (killed or crashed); {LOCK_NAME} now names this process")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": "linmem train"}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
        self.fd = fd

    def release(self) -> None:
        """Empty the lock file (released, not stale) and drop the lock; nothing when not held."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the only descriptor drops the flock
