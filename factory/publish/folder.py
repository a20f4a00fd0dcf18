"""The registry folder: FACTORY_HOME/registry/<name>/<tag>@<rev>/ holds a quant's files and manifest.json.

The manifest records the source identity, spec, calibration hash, tool versions, the eval results the quant was
published with, and the sha256 and size of every file. A folder never changes once it is in place: publishing is a
staging folder beside the target renamed onto it, which fails when a folder is there already (another publisher got
there first); the folder there is then compared, and the same files (but the card) are this quant published, other
files are RevTaken (factory/publish/publishing.py takes another rev). A publisher holds a lock on its staging folder
(`<stem>.lock`, flock) while it works; a publish that was killed leaves its staging behind, and every later publish
removes staging folders that are older than STALE_SECONDS and not held. Published files are mode 0444 (folders
0755), whatever the engine wrote. Pulling checks every sha256; it reflinks the files where the filesystem can
(btrfs, XFS) and copies otherwise, never hard-links them: a pulled file is the user's to edit, and no edit of it
reaches the registry.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from factory.catalog import RevTaken
from factory.checkpoints import files
from factory.errors import JobFailed, SpecError
from factory.identity import file_sha256

log = logging.getLogger("quantfactory")

MANIFEST = "manifest.json"
CARD = "README.md"  # the model card (factory/publish/card.py): the one file that is not the quant itself
FICLONE = 0x40049409  # linux/fs.h: clone a file's extents (btrfs, XFS)
STAGING = ".tmp-"  # the prefix of a publisher's staging folder, its `.old` twin and its `.lock`
STALE_SECONDS = 3600
FILE_MODE, DIR_MODE = 0o444, 0o755  # of everything in the registry: readable by all, written only by replacing
# the folder (AutoAWQ writes its weights 0600)


def quant_dir(registry: Path, name: str, tag: str, rev: str) -> Path:
    path = (registry / name / f"{tag}@{rev}").resolve()
    if not path.is_relative_to(registry.resolve()):
        raise SpecError(f"{name}:{tag}@{rev} would reach outside the registry")
    return path


def file_table(folder: Path) -> dict[str, dict]:
    return {
        p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }


def content(table: dict[str, dict], card: str = CARD) -> dict[str, dict]:
    """What a quant is (its weights and companions): its file table but the card, which records the evaluation it
    was published with (the manifest is never in a file table)."""
    return {name: entry for name, entry in table.items() if name != card}


def publish(
    registry: Path, name: str, tag: str, rev: str, files: Path, manifest: dict, card: str = CARD
) -> tuple[Path, dict]:
    """Put `files` (a flat folder) into the registry as name:tag@rev, or find them there; returns (folder, its
    manifest). Create-or-verify: a folder never changes once it is in place. The staging folder is renamed onto
    the name, which fails when another publisher put a folder there first (rename(2) onto a non-empty folder);
    that folder is then compared: the same files but `card` (a publisher of the same quant with another evaluation,
    or this job's earlier attempt) are this quant, published; other files raise RevTaken."""
    dest = quant_dir(registry, name, tag, rev)
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep(registry)
    manifest = {**manifest, "name": name, "tag": tag, "rev": rev, "files": file_table(files)}
    if dest.is_dir():
        return dest, _same(dest, manifest, card)
    with _staging(dest.parent / f"{STAGING}{dest.name}-{uuid.uuid4().hex[:8]}") as tmp:
        shutil.copytree(files, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        for path in (tmp, *tmp.iterdir()):  # whatever modes the engine wrote: a shared registry is readable by all
            path.chmod(DIR_MODE if path.is_dir() else FILE_MODE)
        try:
            os.rename(tmp, dest)
        except OSError as e:  # ENOTEMPTY or EEXIST: another publisher's folder is there now
            if not dest.is_dir():
                raise
            log.info("%s appeared while it was staged (%s)", dest, e.strerror)
            return dest, _same(dest, manifest, card)
    return dest, manifest


def _same(dest: Path, manifest: dict, card: str) -> dict:
    """The manifest of `dest` if it holds the files of `manifest` (but the card); RevTaken if not."""
    found = read_manifest(dest)
    if found is None or content(found.get("files", {}), card) != content(manifest["files"], card):
        raise RevTaken(f"{dest.name} of {dest.parent.name} holds other files")
    return found


@contextmanager
def _staging(tmp: Path) -> Iterator[Path]:
    """`tmp` (not created yet), held under its lock until the block ends; whatever is left of it then goes."""
    lock = tmp.with_name(tmp.name + ".lock")
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            lock.unlink(missing_ok=True)


def sweep(registry: Path, older_than: float = STALE_SECONDS, remove: bool = True) -> list[Path]:
    """Remove the staging left by publishes that were killed: older than `older_than` seconds and not held (with
    remove=False, only list it)."""
    removed = []
    for path in sorted(registry.glob(f"*/{STAGING}*")):
        lock = path.with_name(path.name.removesuffix(".lock").removesuffix(".old") + ".lock")
        try:
            age = time.time() - os.lstat(path).st_mtime
        except FileNotFoundError:
            continue
        if age < older_than or files.held(lock):
            continue
        removed.append(path)
        if not remove:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed


def remove(dest: Path) -> None:
    """Take a quant's folder out of the registry: renamed into staging at once (a reader sees it or not), then
    deleted; a removal that is killed half-way leaves staging that a later sweep takes."""
    if not dest.exists():
        return
    with _staging(dest.parent / f"{STAGING}{dest.name}-rm-{uuid.uuid4().hex[:8]}") as tmp:
        dest.rename(tmp)


def _share_or_copy(src: str, dst: str) -> None:
    """A reflink (a copy-on-write clone: no disk taken until one side changes), else a copy; never a hard link,
    whose every edit (by root, or after a chmod) would be an edit of the registry's own file."""
    try:
        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        return
    except OSError:
        Path(dst).unlink(missing_ok=True)
    shutil.copyfile(src, dst)  # not copy2: the registry's 0444 stays there; the user's copy is theirs to edit


def replace_card(folder: Path, text: str, card: str = CARD) -> None:
    """A pulled folder's card replaced by `text`, its manifest's entry for it too (the card is no part of the
    quant's content: `content`); the folder is the user's copy, never the registry's."""
    path = folder / card
    manifest = read_manifest(folder)
    if manifest is None or card not in manifest["files"] or path.read_text() == text:
        return
    path.unlink()
    path.write_text(text)
    manifest["files"][card] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(folder: Path) -> dict:
    """The manifest of a registry folder whose files all match it; JobFailed naming the first that does not."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise JobFailed(f"{folder} has no readable {MANIFEST}")
    for fname, want in manifest["files"].items():
        path = folder / fname
        if not path.is_file():
            raise JobFailed(f"{fname} is missing from {folder}")
        if file_sha256(path) != want["sha256"]:
            raise JobFailed(f"{fname} in {folder} does not match its sha256 in the manifest")
    return manifest


def pull(folder: Path, out: Path) -> list[Path]:
    """Copy a quant's files (and its manifest) into `out`, verifying every sha256 on both sides."""
    manifest = verify(folder)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecError(f"output folder {str(out)!r} exists and is not empty; pass -o with a new or empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(folder, tmp, copy_function=_share_or_copy)
        for fname, want in manifest["files"].items():
            if file_sha256(tmp / fname) != want["sha256"]:
                raise JobFailed(f"{fname} changed while it was copied; pull again")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / f for f in manifest["files"]]
