"""Wake a trio task when a file is written: Linux inotify, read through trio's I/O loop.

SQLite's change signal (`_sqlite.ChangeReader`) watches the database's WAL file with it, so
a commit by another process wakes the runtime within a scheduler tick instead of at the
next `PRAGMA data_version` poll, and an idle runtime makes no wake-up at all.

Invariants: a watch only ever says "look now"; it never says what changed, and a missed or
spurious event costs a look, never work (the reader still compares `data_version`, and the
runtime's fallback poll remains). Where inotify is unavailable (not Linux, no libc symbol,
the file missing, the watch limit reached) `open_watch` returns None and the caller polls.
"""

from __future__ import annotations

import ctypes
import os
import sys

import attrs
import trio

_IN_MODIFY = 0x2
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = 0o2000000  # O_CLOEXEC on Linux
_READ_SIZE = 4096


@attrs.define(eq=False)
class FileWatch:
    """One inotify descriptor watching one file for writes."""

    fd: int

    async def wait(self) -> None:
        """Return once the file was written since the last `wait` (or `discard`)."""
        await trio.lowlevel.wait_readable(self.fd)
        self.discard()

    def discard(self) -> bool:
        """Forget the events so far (the caller is about to look at the file anyway);
        whether there were any."""
        any_read = False
        try:
            while os.read(self.fd, _READ_SIZE):
                any_read = True
        except BlockingIOError:
            pass
        return any_read

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.fd)
        os.close(self.fd)


def open_watch(path: str) -> FileWatch | None:
    """A watch on writes to `path`, or None where inotify cannot watch it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the running process, libc included
        init, add_watch = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):
        return None
    fd = init(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        return None
    if add_watch(fd, os.fsencode(path), _IN_MODIFY) < 0:
        os.close(fd)
        return None
    return FileWatch(fd)
