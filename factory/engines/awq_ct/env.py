"""The packages this engine's child runs with: llmcompressor 0.14.0.1 requires transformers 5.15 to 5.17 (and so a
huggingface-hub below 2), while the factory runs a newer transformers, on which AutoAWQ and the coverage of the
other engines were proven (5.17 breaks AutoAWQ on GPT-J: docs/measured.md).

PINS are installed (`pip install --no-deps --target`) into a folder of their own, made on first use and keyed by the
pins and the Python version, as pre-commit makes a hook's environment: `$XDG_CACHE_HOME/quantfactory/envs/awqct-<key>/`
(`~/.cache/...` by default; every FACTORY_HOME and worker of the machine shares it). The child
puts it first on its path, so it takes these packages from it and everything else (torch, tokenizers, safetensors,
accelerate, datasets, the factory) from the factory's own environment. pip's own settings apply: on a machine
without a package index, PIP_NO_INDEX=1 and PIP_FIND_LINKS=<folder of these wheels>.

Whatever is on the child's path runs as the user of the job (a `sitecustomize.py` runs before anything else), so the
folder is checked every time before it is used (its 3,290 files, 68 MB: 0.19 s of CPU, 1.5 s from a cold disk):
- the path to it: every folder on the way, and every link, belongs to this user or root, and none is writable by
  others unless it is sticky (/tmp): no one else can swap it. Else JobFailed, and nothing there is touched.
- the folder: it belongs to this user (else JobFailed: another user's folder is neither used nor removed), and so
  does everything in it, none of it writable by others, no links;
- its contents: exactly the pinned distributions, and every file one of their RECORDs lists (pip's manifest,
  written at install) with the sha256 and size recorded there; nothing else but the `.complete` marker (the pins)
  and bytecode Python cached beside a recorded module.
A folder of ours that fails (a half-finished or damaged install, a file added) is installed again into a new folder
that replaces it; when that cannot be done the job fails saying what was wrong with it.

An install runs under a lock (`awqct-<key>.lock` beside it, opened without following links, refused unless it is a
plain file of this user's), in a temporary folder renamed into place when complete, so concurrent jobs make it once
and a killed install leaves nothing (what a SIGKILL left is removed by the next install). pip runs as a child process
that gets SIGTERM when the job stops (Ctrl-C, SIGTERM, a failed unit beside it: child.stop_running), when the process
installing gets SIGTERM, or when it dies, and is killed after INSTALL_SECONDS (FACTORY_AWQCT_INSTALL_SECONDS, default
1800): a package index that never answers ends the job with one sentence.
"""

from __future__ import annotations

import base64
import csv
import errno
import fcntl
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from factory.engines import child
from factory.errors import JobFailed

PINS = (
    "llmcompressor==0.14.0.1",
    "compressed-tensors==0.19.0",
    "transformers==5.17.0",
    "huggingface-hub==1.33.0",
    "tokenizers==0.23.3",
    "loguru==0.7.3",
)
DONE = ".complete"
INSTALL_SECONDS = ("FACTORY_AWQCT_INSTALL_SECONDS", 1800.0)  # how long an install (or the wait for another) may take
EMIT_SECONDS = 2.0  # while it installs or waits: a progress event this often (a stopped job raises there)
_PURELIB = "lib/python"  # where RECORD's paths start with --target (pip installs into a `--home` and moves it)


def key() -> str:
    python = f"{sys.implementation.name}{sys.version_info[0]}.{sys.version_info[1]}"
    return hashlib.sha256("\n".join((python, *PINS)).encode()).hexdigest()[:12]


def root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantfactory" / "envs"


def folder() -> Path:
    return root() / f"awqct-{key()}"


def ensure(emit: Callable[[dict], None] = lambda event: None) -> Path:
    """The packages' folder, checked; installed first if it is not there yet or fails the check. `emit` gets a
    progress event now and then while it installs or waits for another process's install."""
    target = folder()
    _make_safe_folder(target.parent)
    if (problem := _problem(target)) is None:
        return target
    with _sigterm_interrupts(), _locked(target, emit):
        if (problem := _problem(target)) is None:  # another job made it while this one waited
            return target
        _install(target, problem, emit)
    return target


def child_path(emit: Callable[[dict], None] = lambda event: None) -> dict[str, str]:
    """The child's PYTHONPATH: the packages first, then whatever the factory's processes have. It writes no bytecode
    into the packages' folder (a `__pycache__` made under a umask of 002 would be writable by the group)."""
    paths = [str(ensure(emit)), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths), "PYTHONDONTWRITEBYTECODE": "1"}


# -- the path to the folder --------------------------------------------------------------------------------------


def _make_safe_folder(path: Path) -> None:
    """`path` made where missing (0755 at most, whatever the umask), then checked as the module's docstring says."""
    missing = []
    at = path
    while not os.path.lexists(at):
        missing.append(at)
        at = at.parent
    for made in reversed(missing):
        try:
            os.mkdir(made, 0o755)
        except FileExistsError:
            pass
        except OSError as e:
            raise JobFailed(f"AWQ-CT's packages folder {path} cannot be made: {e.strerror}") from None
    for chain in (path, Path(os.path.realpath(path))):
        if (why := _unsafe_chain(chain)) is not None:
            raise JobFailed(
                f"AWQ-CT's packages under {path} were not used: {why}, so another user could change what the "
                "engine runs; set XDG_CACHE_HOME to a folder that only you (or root) can write"
            )


def _unsafe_chain(path: Path) -> str | None:
    uid = os.getuid()
    for at in [*reversed(path.parents), path]:
        st = os.lstat(at)
        if st.st_uid not in (0, uid):
            return f"{at} belongs to uid {st.st_uid}"
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{at} is writable by others"
    return None


# -- the folder and its contents ---------------------------------------------------------------------------------


def _problem(target: Path) -> str | None:
    """What is wrong with the folder (None: nothing; "missing"); JobFailed when it is another user's."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return "missing"
    if st.st_uid != os.getuid():
        raise JobFailed(
            f"AWQ-CT's packages folder {target} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}), "
            "so it was not used: its owner could have put anything in it; remove it, or set XDG_CACHE_HOME to a "
            "folder of your own"
        )
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if st.st_mode & 0o022:
        return "writable by others"
    try:
        return _contents(target)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    except (ValueError, csv.Error):
        return "its RECORD files are unreadable"


def _contents(target: Path) -> str | None:
    """Why the folder does not hold exactly what pip installed (None: it does)."""
    dists = sorted(p.name for p in target.iterdir() if p.name.endswith(".dist-info"))
    wanted = sorted(_distribution(*pin.split("==")) for pin in PINS)
    if sorted(_distribution(*d.removesuffix(".dist-info").rsplit("-", 1)) for d in dists) != wanted:
        return f"its distributions are {dists or 'none'}, not the {len(PINS)} pinned"
    recorded: dict[str, tuple[str, str]] = {}
    for dist in dists:
        with open(target / dist / "RECORD", newline="", encoding="utf-8") as f:
            for row in csv.reader(f):
                if row and (rel := _installed_path(row[0])) is not None:
                    recorded[rel] = (row[1], row[2]) if len(row) >= 3 else ("", "")
    uid, seen = os.getuid(), set()
    for dirpath, dirnames, filenames in os.walk(target):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, target)
            st = os.lstat(path)
            if st.st_uid != uid:
                return f"{rel} in it belongs to uid {st.st_uid}"
            if st.st_mode & 0o022:
                return f"{rel} in it is writable by others"
            if stat.S_ISLNK(st.st_mode):
                return f"{rel} in it is a link"
            if stat.S_ISDIR(st.st_mode) or rel == DONE:
                continue
            if not stat.S_ISREG(st.st_mode):
                return f"{rel} in it is not a file"
            if rel not in recorded:
                if _cached_bytecode(rel, recorded):
                    continue
                return f"{rel} in it is not one of the files pip installed"
            digest, size = recorded[rel]
            if digest and (str(st.st_size) != size or _digest(path, digest) != digest):
                return f"{rel} in it is not the file pip installed (its sha256 or size differs)"
            seen.add(rel)
    if missing := sorted(set(recorded) - seen):
        return f"it is half-installed: {len(missing)} of its files are missing ({missing[0]}, ...)"
    done = target / DONE
    if not done.is_file() or done.read_text(errors="replace").split() != list(PINS):
        return "its install never finished (no .complete marker listing the pins)"
    return None


def _distribution(name: str, version: str = "") -> tuple[str, str]:
    """A distribution as a pin and its .dist-info folder both name it (PEP 503's normal form)."""
    return re.sub(r"[-_.]+", "_", name).lower(), version


def _installed_path(recorded: str) -> str | None:
    """A RECORD path (relative to site-packages under pip's `--home`) as a path in the target folder."""
    home = os.path.normpath(os.path.join(_PURELIB, recorded))
    if home.startswith(_PURELIB + os.sep):
        return home[len(_PURELIB) + 1 :]
    return None if home.startswith("..") or os.path.isabs(home) else home


def _cached_bytecode(rel: str, recorded: dict) -> bool:
    """Python's cache of a recorded module (`__pycache__/<module>.<tag>[.opt-N].pyc`, or `.pyc.<id>` while Python
    writes it)."""
    parent, name = os.path.split(rel)
    tag = re.escape(sys.implementation.cache_tag or "")
    found = re.fullmatch(rf"(.+)\.{tag}(?:\.opt-[12])?\.pyc(?:\.\d+)?", name)
    return (
        os.path.basename(parent) == "__pycache__"
        and found is not None
        and os.path.join(os.path.dirname(parent), found[1] + ".py") in recorded
    )


def _digest(path: str, recorded: str) -> str:
    algorithm = recorded.partition("=")[0]
    if algorithm not in ("sha256", "sha384", "sha512"):
        return ""  # RECORD's hashes are sha256 or stronger (PEP 376, 627)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        digest = hashlib.file_digest(f, algorithm).digest()
    return f"{algorithm}=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


# -- the install -------------------------------------------------------------------------------------------------


def _seconds() -> float:
    variable, default = INSTALL_SECONDS
    try:
        return float(os.environ.get(variable) or default)
    except ValueError:
        raise JobFailed(f"{variable} must be a number of seconds, not {os.environ[variable]!r}") from None


@contextmanager
def _locked(target: Path, emit) -> Iterator[None]:
    path = target.parent / f"{target.name}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        linked = e.errno == errno.ELOOP or os.path.islink(path)  # some kernels say EACCES for O_CREAT on a link
        why = "is a link" if linked else f"cannot be opened ({e.strerror})"
        raise JobFailed(f"AWQ-CT's install lock {path} {why}; it was not used: remove it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
            raise JobFailed(
                f"AWQ-CT's install lock {path} is not a plain file of this user's (uid {st.st_uid}, "
                f"{st.st_nlink} links); it was not used: remove it"
            )
        seconds = _seconds()
        deadline = time.monotonic() + seconds
        wait = _waiting(emit, "another process installing AWQ-CT's packages")
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise JobFailed(
                        f"another process has been installing AWQ-CT's packages into {target} for more than "
                        f"{seconds:g} s ({INSTALL_SECONDS[0]}); try again later"
                    ) from None
                wait()
        yield
    finally:
        os.close(fd)


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """In a process that left SIGTERM as it comes (`python -c "...env.ensure()"`, scripts/setup): SIGTERM raises
    KeyboardInterrupt while it installs, so pip is stopped and the half-made folder removed before the process ends.
    `qf` sets its own (factory/cli/shared.py); a thread cannot set one."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _waiting(emit, what: str) -> Callable[[], None]:
    """Half a second's wait, with a progress event every EMIT_SECONDS (where a stopped job raises)."""
    last = [time.monotonic()]

    def wait() -> None:
        if time.monotonic() - last[0] >= EMIT_SECONDS:
            last[0] = time.monotonic()
            emit({"waiting_for": what})
        time.sleep(0.5)

    return wait


def _install(target: Path, problem: str, emit) -> None:
    """PINS into a new folder beside `target` that replaces it once it passes the check. Held: the lock."""
    for stale in target.parent.glob(f".{target.name}.*"):  # what a killed install left (this lock is ours now)
        if stale.lstat().st_uid == os.getuid():
            _remove(stale)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    before = "" if problem == "missing" else f"the folder there was damaged ({problem}) and "
    try:
        _pip(tmp, target, before, emit)
        (tmp / DONE).write_text("\n".join(PINS) + "\n")
        for dirpath, dirnames, filenames in os.walk(tmp):  # none of it writable by others, whatever pip's umask
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):  # a link fails the check below
                    os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & ~0o022)
        if (wrong := _contents(tmp)) is not None:
            raise JobFailed(f"AWQ-CT's packages as pip installed them fail the factory's check: {wrong}")
        if os.path.lexists(target):
            aside = tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent)
            if os.path.isdir(target) and not os.path.islink(target):
                os.rename(target, aside)  # onto the empty folder: the two renames are both atomic
            else:
                os.unlink(target)
            os.rename(tmp, target)
            _remove(Path(aside))
        else:
            os.rename(tmp, target)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


class _Group(subprocess.Popen):
    """pip and whatever it starts (a build of an sdist): terminate() stops them all."""

    def send_signal(self, sig):
        if self.poll() is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass


def _pip(tmp: Path, target: Path, before: str, emit) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-compile",
        "--disable-pip-version-check",
        "--target",
        str(tmp),
        *PINS,
    ]
    seconds = _seconds()
    deadline = time.monotonic() + seconds
    wait = _waiting(emit, "pip installing AWQ-CT's packages")
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        proc = _Group(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONNOUSERSITE": "1"},
            preexec_fn=child.die_with_parent,
            start_new_session=True,
        )
        with child.stoppable(proc):
            try:
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        raise JobFailed(
                            f"AWQ-CT's packages ({', '.join(PINS)}) were not installed into {target} within "
                            f"{seconds:g} s ({INSTALL_SECONDS[0]}): {before}pip was stopped; check that its "
                            "package index answers (PIP_INDEX_URL, or PIP_NO_INDEX=1 with PIP_FIND_LINKS)"
                        )
                    wait()
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        if proc.returncode != 0:
            log.seek(0)
            last = [ln for ln in log.read().splitlines() if ln.strip()][-1:] or ["no output"]
            said = f"pip was stopped by signal {-proc.returncode}" if proc.returncode < 0 else last[0][:300]
            raise JobFailed(f"AWQ-CT could not install its packages ({', '.join(PINS)}) into {target}: {before}{said}")
