"""A folder of this process's own beside a destination, where a download is put together before it becomes the
destination: what `qf pull` from a factory's service stages in.

A folder with a name anyone can guess can be made first by anyone who can write beside it, holding links to their
victim's files (a pull then appended to them or deleted them) or itself a link to the victim's folder (a pull then
wrote into it and exited 0). So:
- it is made with mkdtemp (a name no one can guess, mode 0700), or it is the one an interrupted pull of the same
  files left (`prefix` + mkdtemp's suffix), taken again only when it is a real folder of this user's, mode 0700;
- every file in it is opened, measured, hashed and removed relative to the folder's descriptor, never following a
  link (O_NOFOLLOW), and a name there that is not a plain file is removed, not followed;
- it becomes the destination by one rename (onto a new or empty folder), checked afterwards to have moved this very
  folder (its device and inode), not one put at its name meanwhile.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

from factory.errors import JobFailed

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class PrivateFolder:
    def __init__(self, dest: Path, prefix: str):
        """A folder beside `dest` named `prefix` + a random suffix: the last one an interrupted pull left, or new."""
        self.dest = dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._parent = os.open(dest.parent, _DIR)
        self._fd = -1
        self.name = _left_by_us(self._parent, prefix) or os.path.basename(
            tempfile.mkdtemp(prefix=prefix, dir=dest.parent)
        )
        try:
            self._fd = os.open(self.name, _DIR | os.O_NOFOLLOW, dir_fd=self._parent)
            if not _ours(os.fstat(self._fd)):
                raise OSError
        except OSError:  # the name was swapped between mkdtemp and open
            self.close()
            raise JobFailed(f"the staging folder {self.path} is not this user's own folder; pull again") from None

    @property
    def path(self) -> Path:
        return self.dest.parent / self.name

    def size(self, fname: str) -> int:
        """How much of `fname` is there (0: none); anything there that is not a plain file is removed."""
        try:
            st = os.stat(fname, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        if not stat.S_ISREG(st.st_mode):
            self.remove(fname)
            return 0
        return st.st_size

    def open(self, fname: str, append: bool) -> BinaryIO:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
        return os.fdopen(os.open(fname, flags, 0o644, dir_fd=self._fd), "ab" if append else "wb")

    def sha256(self, fname: str) -> str:
        with os.fdopen(os.open(fname, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._fd), "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    def remove(self, fname: str) -> None:
        try:
            os.unlink(fname, dir_fd=self._fd)
        except FileNotFoundError:
            pass

    def write_text(self, fname: str, text: str) -> None:
        with self.open(fname, append=False) as f:
            f.write(text.encode())

    def move_into_place(self) -> None:
        """The folder becomes `dest` (new, or an empty folder that it replaces), readable as a folder the user made."""
        os.fchmod(self._fd, 0o755)
        try:
            os.rename(self.name, self.dest.name, src_dir_fd=self._parent, dst_dir_fd=self._parent)
        except OSError as e:
            raise JobFailed(f"the pulled files in {self.path} could not become {self.dest}: {e.strerror}") from None
        moved = os.stat(self.dest.name, dir_fd=self._parent, follow_symlinks=False)
        mine = os.fstat(self._fd)
        if (moved.st_dev, moved.st_ino) != (mine.st_dev, mine.st_ino):
            raise JobFailed(f"another folder was put in place of the staging folder {self.path}; pull again")

    def close(self) -> None:
        for fd in (self._fd, self._parent):
            if fd >= 0:
                os.close(fd)
        self._fd = self._parent = -1

    def __enter__(self) -> PrivateFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def _left_by_us(parent: int, prefix: str) -> str | None:
    """The newest folder `prefix*` beside the destination that is a real folder of ours, mode 0700 (mkdtemp's)."""
    found = []
    for name in os.listdir(parent):
        if name.startswith(prefix):
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except OSError:
                continue
            if _ours(st):
                found.append((st.st_mtime_ns, name))
    return max(found)[1] if found else None
