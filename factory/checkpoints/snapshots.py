"""One snapshot of each local source in FACTORY_HOME/snapshots/<key>, shared by every job of that source (key: the
source identity's digest): a job's staging folder holds hard links to its files, so a source is on disk once more
however many jobs, attempts and helpers read it (three jobs of one 14 GB 8B, each with a copy of its own, filled a
64 GB disk: the H100 sitting of 2026-12-06).

The first job that needs it makes it under a lock, as the BF16 copy is made (factory/checkpoints/dequantize.py):
copied and hashed into a folder of its own (files.snapshot), kept only when its hash is the identity the job was
submitted with, its files' stamps written into a marker, then renamed into place; a job of the same source that
comes meanwhile waits for it rather than copying too. Every later job hashes the folder again (it must still hold
the bytes of the job's identity: reading them costs about half of copying them, benchmarks/snapshot_cost.py), links
the snapshot's files and checks that the links have the stamps the marker holds (only the factory writes under
FACTORY_HOME; a snapshot changed anyway is made again). `qf gc` removes a snapshot no unfinished job needs; the jobs'
links keep its bytes until their work folders go."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from factory.checkpoints import files
from factory.errors import JobFailed
from factory.identity import digest

MARKER = ".quantfactory-snapshot"  # written last into a snapshot: its identity and its files' stamps


def root(home: Path) -> Path:
    return home / "snapshots"


def folder(home: Path, source_identity: str) -> Path:
    """Where the snapshot of a source lives (whether or not it was made)."""
    return root(home) / digest(["snapshot", source_identity])[:32]


def staged(
    home: Path,
    source: Path,
    source_identity: str,
    dest: Path,
    verify: Callable[[dict[str, str]], None],
    progress: Callable[..., None],
) -> bool:
    """`dest` holds links to the snapshot of `source`: made now from its files when no job made it before (True), or
    reused (False). `verify(hashes)` raises when the folder's files (name -> sha256: the copy's, or the folder's as
    read again for a reuse) are not the job's identity; a copy is then removed. `progress(done=, total=, unit="B")`
    as the folder is copied or read."""
    shared = folder(home, source_identity)
    if _reused(shared, source, dest, verify, progress):
        return False
    shared.parent.mkdir(parents=True, exist_ok=True)
    lock, waiting = shared.parent / f".{shared.name}.lock", "the snapshot of this source another job is making"
    with files.locked(lock, progress, waiting):
        if _reused(shared, source, dest, verify, progress):  # the job that held the lock made it
            return False
        tmp = shared.parent / f"{files.MAKING}{shared.name}"
        shutil.rmtree(tmp, ignore_errors=True)  # a writer that was killed: the lock is ours, so it is gone
        shutil.rmtree(shared, ignore_errors=True)  # a snapshot without its marker, or one that changed
        try:
            verify(files.snapshot(source, tmp, progress))
            marker = {"source_identity": source_identity, "stamps": files.stamps(tmp)}
            files.write_atomic(tmp / MARKER, json.dumps(marker).encode())
            os.rename(tmp, shared)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if not _linked(shared, dest):
        raise JobFailed(f"the snapshot of {source} in {shared} was removed as it was made; run the job again")
    return True


def _reused(shared: Path, source: Path, dest: Path, verify: Callable, progress: Callable[..., None]) -> bool:
    """A snapshot made earlier, linked into `dest`, once the folder is read again and still holds its bytes."""
    if not (shared / MARKER).is_file():
        return False
    verify(files.hashes(source, progress))
    return _linked(shared, dest)


def _linked(shared: Path, dest: Path) -> bool:
    """Link the snapshot's files into `dest`; whether they are the files it was made with (False: `dest` is left
    empty)."""
    try:
        made = json.loads((shared / MARKER).read_bytes())["stamps"]
        files.empty(dest)
        for name in made:
            os.link(shared / name, dest / name)
    except (OSError, ValueError, KeyError, TypeError):
        files.empty(dest)
        return False
    if files.stamps(dest) != {name: tuple(stamp) for name, stamp in made.items()}:
        files.empty(dest)
        return False
    return True


def leftovers(home: Path, keep: set[Path]) -> list[tuple[Path, str]]:
    """What `qf gc` may remove here: copies not in `keep` (those unfinished jobs read), and what writers that were
    killed left."""
    return files.leftovers(
        root(home),
        keep,
        "snapshot of a source whose copy was killed",
        "snapshot of a local source that no unfinished job needs",
    )
