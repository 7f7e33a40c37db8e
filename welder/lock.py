"""One ``welder tune`` or ``welder build`` at a time per PREFIX.

Two processes writing one PREFIX overwrite each other's runtime sources and run CMake in
one build folder at once, which fails in confusing ways.  The first takes an exclusive
``fcntl.flock`` on ``PREFIX/.welder.lock`` and writes who it is into that file; a second
finds the lock taken and stops at once, naming the holder.  The operating system drops the
lock when its holder exits, however it exits, so a lock file left behind by a killed run
never blocks anything: only a running holder does.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from welder.errors import WelderError

LOCK_NAME = ".welder.lock"

# Folders this process holds: ``welder tune`` builds with the lock it took already.
_held: dict[Path, int] = {}


class PrefixBusyError(WelderError):
    """Another running welder process is writing the same PREFIX."""


def _describe_self(command: str) -> str:
    """Who holds a lock, as the lock file records it."""
    args = " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith(("welder", "cli.py")) else ""
    return f"pid {os.getpid()} on host {socket.gethostname()} ({command}{' ' + args if args else ''})"


@contextmanager
def prefix_lock(prefix: str | os.PathLike[str], command: str) -> Iterator[None]:
    """Hold ``prefix``'s lock for the ``with`` body; a :class:`PrefixBusyError` naming the
    holder if another process has it.  Re-entrant within one process.  ``prefix`` must
    exist."""
    key = Path(prefix).resolve()
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    path = key / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise WelderError(f"cannot create the lock file {path}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that is starting"
            raise PrefixBusyError(
                f"{prefix} is in use by another welder: {holder}. Wait for it to finish, or write "
                "elsewhere with -o"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{_describe_self(command)}\n".encode(), 0)
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
    finally:
        os.close(fd)  # releases the lock
