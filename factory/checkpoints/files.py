"""Which files the factory reads from a source and which may leave it in a quant: one allowlist for all of it.

A source folder contributes its safetensors weights (and their index) and the companion files below, nothing else:
the source identity hashes them, the Hub fetch downloads them, the engines see a staging folder that holds only
them (a user's folder: the job's snapshot of them, hashed once copied; a folder the factory owns: links to the
weights), and a quant carries them beside its engine's own outputs. A source file is read only when it is a regular
file; a symlink is followed only when its target lies inside the source folder or inside the same Hugging Face cache
repository (`models--ORG--NAME/`, whose snapshots link into `blobs/`). Anything else (a link leaving the folder, a
FIFO, socket or device) is refused (ModelRefused, exit 3), before any of it is opened; so is a file not every user
may read that belongs to another user or is a hard link (a quant's files are readable by all: publishing it would
widen who may read it).
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import hashlib
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from factory.errors import JobFailed, ModelRefused
from factory.tables import size

COMPANIONS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",  # a vision-language model's processor: images, its own config, videos
    "processor_config.json",
    "video_preprocessor_config.json",
)
WEIGHTS = "*.safetensors"
INDEX = "model.safetensors.index.json"
SOURCE_PATTERNS = (*COMPANIONS, WEIGHTS, INDEX)  # what a source contributes; the Hub fetch asks for these too
PUBLISHING = ("README.md", "manifest.json")  # what publishing adds: the model card and the manifest
UPSTREAM_CARD = "README.md"  # the source's own model card: read for its license and language, never published
MAX_CARD = 1 << 20
CHUNK = 1 << 20  # a snapshot's reads (16 MiB made the one-pass copy 3x as slow: out of the CPU's cache)
KERNEL_CHUNK = 1 << 26  # a snapshot's in-kernel copies, between progress events
MAKING = ".tmp-"  # a copy made once (`locked`) is written as MAKING + its name, then renamed
WAIT_SECONDS = 2.0  # how often a job that waits for another's copy of the same source says so
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")  # a file name a quant's file may have


_KINDS = (
    ("folder", stat.S_ISDIR),
    ("FIFO", stat.S_ISFIFO),
    ("socket", stat.S_ISSOCK),
    ("device", stat.S_ISCHR),
    ("device", stat.S_ISBLK),
)


def is_source_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in SOURCE_PATTERNS)


def _roots(folder: Path) -> list[Path]:
    """Where the links of `folder` may point: the folder, and the Hugging Face cache repo it is a snapshot of."""
    roots = [folder]
    for parent in folder.parents:
        if parent.name.startswith("models--"):
            roots.append(parent)
            break
    return roots


def _checked(path: Path, roots: list[Path]) -> Path:
    """The regular file `path` is, or stands for through links that stay inside `roots`."""
    try:
        target = path.resolve(strict=True) if path.is_symlink() else path
        st = os.stat(target)  # a stat, never an open: opening a FIFO would wait forever
    except (OSError, RuntimeError):  # a dangling link or a loop
        raise ModelRefused(
            f"{path.name} is a link to nothing ({os.readlink(path)!r}); replace it with the file"
        ) from None
    if target is not path and not any(target.is_relative_to(root) for root in roots):
        raise ModelRefused(
            f"{path.name} is a link to {str(target)!r}, outside the model folder; copy the file "
            "into the folder if it belongs to the model"
        )
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for k, test in _KINDS if test(st.st_mode)), "special file")
        raise ModelRefused(f"{path.name} is a {kind}, not a regular file; the factory reads only regular files")
    _check_readers(path.name, st)
    return target


def _check_readers(name: str, st: os.stat_result) -> None:
    """A quant's files are readable by every user: a file that not everyone may read is taken only where its owner
    is the one running the factory, through its only name. Another user's file, or a hard link that may stand for
    someone's private file, would be published wider than its owner allowed."""
    if st.st_mode & stat.S_IROTH:
        return
    if st.st_uid != os.geteuid():
        why = f"belongs to another user (uid {st.st_uid})"
    elif st.st_nlink > 1:
        why = f"is a hard link ({st.st_nlink} names)"
    else:
        return
    raise ModelRefused(
        f"{name} {why} and not every user may read it (mode {stat.S_IMODE(st.st_mode):04o}); a quant's files are "
        "readable by all, so make it readable (chmod a+r) or copy it into the folder as its owner"
    )


def source_files(folder: Path) -> dict[str, Path]:
    """Every file the factory takes from a source folder: name -> the regular file it reads (links resolved)."""
    folder = folder.resolve()
    roots = _roots(folder)
    return {p.name: _checked(p, roots) for p in sorted(folder.iterdir()) if is_source_file(p.name)}


def upstream_card(folder: Path) -> str | None:
    """The source's README.md (its model card) when it is a regular file of the folder, at most MAX_CARD bytes;
    None otherwise (it is not part of the model: a link out of the folder is not followed, and not refused)."""
    path = folder / UPSTREAM_CARD
    if not (path.exists() or path.is_symlink()):
        return None
    try:
        real = _checked(path, _roots(folder.resolve()))
    except ModelRefused:
        return None
    with open(real, "rb") as f:
        return f.read(MAX_CARD).decode("utf-8", errors="replace")


def stage(folder: Path, dest: Path) -> Path:
    """A staging folder of links to `folder`, for a source the factory owns (a verified Hub download, a BF16 copy):
    every engine and evaluator reads the staging folder, so a tool that copies "everything beside the weights"
    finds nothing else to copy. The companions are copied (read through one descriptor opened without following a
    link); the weights are links that staged_files checks again. A user's folder is snapshot instead."""
    files = source_files(folder)
    empty(dest)
    for name, path in files.items():
        if name in COMPANIONS:
            _copy(path, dest / name)
        else:
            (dest / name).symlink_to(path)
    return dest


def snapshot(folder: Path, dest: Path, progress: Callable[..., None] = lambda **_: None) -> dict[str, str]:
    """The job's own copy of a user's folder in `dest`: every source file copied, then the copy hashed (what was
    hashed is what `dest` holds), read-only; name -> sha256. Whatever the folder does later (rewritten in place,
    swapped, truncated), the job reads this copy. `progress(done=, total=, unit="B")` as it is copied. A disk that
    fills up is JobFailed, and leaves `dest` empty."""
    files = source_files(folder)
    empty(dest)
    total, done, hashes = sum(p.stat().st_size for p in files.values()), 0, {}
    for name, path in files.items():

        def copied(n: int, base: int = done) -> None:
            progress(done=base + n, total=total, unit="B")

        try:
            hashes[name] = _copy(path, dest / name, copied)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            empty(dest)
            raise JobFailed(
                f"no space left in {dest.parent} for the job's copy of {folder} ({size(total)}); free some "
                "(qf gc removes finished jobs' work folders) and run it again"
            ) from None
        os.chmod(dest / name, 0o444)
        done += (dest / name).stat().st_size
    return hashes


def stamps(dest: Path) -> dict[str, tuple[int, int, int]]:
    """What a snapshot's files are on disk (inode, size, mtime): the same stamps mean the files the job hashed,
    since only the factory writes under FACTORY_HOME."""
    found = {}
    for p in sorted(dest.iterdir()):
        st = p.lstat()
        found[p.name] = (st.st_ino, st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else (0, -1, -1)
    return found


def held(lock: Path) -> bool:
    """Whether a process holds `lock` (`locked`, a publisher's staging lock): what it is writing is not a leftover.
    Never creates the lock."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def leftovers(base: Path, keep: set[Path], killed: str, unneeded: str) -> list[tuple[Path, str]]:
    """What `qf gc` may remove of the copies made once in `base` (`locked`, then renamed from `.tmp-<name>`): those
    not in `keep` (the ones unfinished jobs read), and what writers that were killed left (not held by a writer
    now); each with why (`killed`, `unneeded`)."""
    found = []
    for path in sorted(base.iterdir()) if base.is_dir() else []:
        if path.name.startswith(MAKING) and not held(base / f".{path.name.removeprefix(MAKING)}.lock"):
            found.append((path, killed))
        elif not path.name.startswith(".") and path not in keep:
            found.append((path, unneeded))
    return found


@contextmanager
def locked(lock: Path, progress: Callable[..., None], waiting_for: str) -> Iterator[None]:
    """Hold `lock` (a copy made once for every job that needs it: a snapshot, a BF16 copy); while another process
    holds it, say what this one waits for through `progress` (which may stop the wait)."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                progress(waiting_for=waiting_for)
                time.sleep(WAIT_SECONDS)
        yield
    finally:
        os.close(fd)  # releases the lock


def empty(dest: Path) -> None:
    """`dest` as an empty folder (made if missing; its files removed)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.iterdir():
        old.unlink()


def _copy(path: Path, dest: Path, progress: Callable[[int], None] = lambda _: None) -> str:
    """Copy `path` to `dest` through one descriptor opened without following a link; the sha256 of the copy. The
    kernel copies (copy_file_range: a reflink where the filesystem shares blocks, XFS or Btrfs, else a copy that
    never passes through this process), then the copy is hashed; where the kernel cannot copy between the two
    filesystems, one pass reads, hashes and writes. On ext4 both take about as long, bound by the disk's writes
    (benchmarks/snapshot_cost.py)."""
    with _open_regular(path) as f, open(dest, "w+b", buffering=0) as out:
        try:
            return _kernel_copy(f, out, progress)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
        f.seek(0)
        out.seek(0)
        out.truncate()
        return _copy_hashing(f, out, progress)


def _open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading without following a link, refused unless it is a regular file now."""
    try:  # O_NONBLOCK: a FIFO swapped in does not make the open wait
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise ModelRefused(
            f"{path.name} changed while it was read ({e.strerror}); the factory reads only regular files"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ModelRefused(
            f"{path.name} changed while it was read (it is not a regular file now); the factory reads only "
            "regular files"
        )
    return os.fdopen(fd, "rb", buffering=0)


def hashes(folder: Path, progress: Callable[..., None] = lambda **_: None) -> dict[str, str]:
    """The sha256 of every source file of `folder` (name -> sha256), each read through one descriptor opened without
    following a link; `progress(done=, total=, unit="B")` as they are read."""
    found, done = {}, 0
    paths = source_files(folder)
    total = sum(p.stat().st_size for p in paths.values())
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    for name, path in paths.items():
        h = hashlib.sha256()
        with _open_regular(path) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                done += n
                if done % KERNEL_CHUNK < CHUNK:
                    progress(done=done, total=total, unit="B")
        found[name] = h.hexdigest()
    progress(done=done, total=total, unit="B")
    return found


def _kernel_copy(f: BinaryIO, out: BinaryIO, progress: Callable[[int], None]) -> str:
    done = 0
    while n := os.copy_file_range(f.fileno(), out.fileno(), KERNEL_CHUNK):
        done += n
        progress(done)
    out.seek(0)
    h, buf = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buf)
    while n := out.readinto(buf):
        h.update(view[:n])
    return h.hexdigest()


def _copy_hashing(f: BinaryIO, out: BinaryIO, progress: Callable[[int], None]) -> str:
    h, buf, done = hashlib.sha256(), bytearray(CHUNK), 0
    view = memoryview(buf)
    while n := f.readinto(buf):
        h.update(view[:n])
        written = 0
        while written < n:
            written += out.write(view[written:n])
        done += n
        progress(done)
    return h.hexdigest()


def staged_files(dest: Path, folder: Path) -> dict[str, Path]:
    """What the staging folder `dest` of `folder` stands for: its companion copies, and the source files its weight
    links reach, checked as source_files checks them (a weight swapped for a link out of the folder is refused)."""
    roots = _roots(folder.resolve())
    return {p.name: _checked(p, roots) if p.is_symlink() else p for p in sorted(dest.iterdir())}


def carried(name: str, outputs: tuple[str, ...]) -> bool:
    """Whether a quant may carry a file of this name, wherever it comes from (the registry, the factory's service,
    the Hub): a plain name (no '/', NUL or leading dot, 255 characters at most) among the companions, the engine's
    own `outputs` (glob patterns) and what publishing writes."""
    return PLAIN_NAME.fullmatch(name) is not None and any(
        fnmatch.fnmatchcase(name, pattern) for pattern in (*COMPANIONS, *outputs, *PUBLISHING)
    )


def check_publishable(folder: Path, outputs: tuple[str, ...]) -> None:
    """Refuse to publish a folder with anything but regular files on the allowlist: the companions, the engine's
    own `outputs` (glob patterns) and what publishing writes. JobFailed names the first stranger."""
    for p in sorted(folder.iterdir()):
        if p.is_symlink() or not p.is_file():
            raise JobFailed(f"{p.name} in {folder} is not a regular file; nothing was published")
        if not carried(p.name, outputs):
            raise JobFailed(
                f"{p.name} in {folder} is not on the list of files a quant may carry; nothing was published"
            )


def write_atomic(path: Path, data: bytes) -> None:
    """`path` written whole or not at all: through a temporary file of its own beside it (unique across threads,
    processes and hosts sharing FACTORY_HOME), synced to disk and renamed over it, so that readers never see half a
    file, nor an empty one after a crash. A failed write leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o644)  # as a plain write would make it (mkstemp's is 0600): other users may read it
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)
