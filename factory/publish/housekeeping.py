"""Disk: removing a published quant (`qf rm`) and what finished work leaves behind (`qf gc`).

`qf rm NAME:TAG[@REV]` forgets the quant in the catalog and removes its registry folder, nothing else: not another
revision, not the Hub's copy, not the measurement other sizes reuse. `qf gc` finds
  - work folders of jobs that succeeded or were cancelled, and of jobs the catalog does not know (a failed job keeps
    its folder: running it again continues from there);
  - staging folders of publishes that were killed (older than an hour and not held, see publish/folder.py);
  - registry folders that no catalog row lists (a publish killed between placing its folder and recording its row),
    older than an hour, whose job is not running: taken out under the job's row lock (Quants.remove_unlisted);
  - Hub downloads (FACTORY_HOME/cache/hub/ORG--NAME/SHA) that no queued, running or failed job needs;
  - BF16 copies of FP8/MXFP4 sources (FACTORY_HOME/dequantized/KEY, factory/checkpoints/dequantize.py) that no such job
  needs,
    and what a dequantization that was killed left (not held by a writer now).
Before it looks, running jobs whose lease ran out (their holder was killed: a `qf run` has no reconciler) go back to
queued, as the fleet's reconciler does: `qf run` again continues them, and their unlisted folders can go.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from factory.catalog import Catalog, JobState, Quant
from factory.checkpoints import dequantize, snapshots
from factory.errors import SpecError
from factory.publish import folder
from factory.settings import Settings

DONE = (JobState.succeeded, JobState.cancelled)


@dataclass(frozen=True)
class Garbage:
    path: Path
    bytes: int
    why: str
    remove: Callable[[], bool] | None = None  # where removing it must be decided again at that moment; False: left


def disk_bytes(path: Path) -> int:
    """The bytes `path` holds, a file with several names (a job's links to a shared snapshot) counted by its share:
    removing every name of it frees the whole."""
    if not path.is_dir() or path.is_symlink():
        return _share(path.lstat())
    return sum(_share(os.lstat(os.path.join(root, f))) for root, _, files in os.walk(path) for f in files)


def _share(st: os.stat_result) -> int:
    return st.st_size // max(st.st_nlink, 1) if stat.S_ISREG(st.st_mode) else st.st_size


def remove_quant(settings: Settings, catalog: Catalog, quants: list[Quant]) -> tuple[Quant, int]:
    """Remove the one quant of `quants` (the matches of a NAME:TAG[@REV]); (the quant, bytes freed)."""
    if len(quants) > 1:
        revs = ", ".join(q.rev for q in quants)
        raise SpecError(
            f"{quants[0].name}:{quants[0].tag} has {len(quants)} revisions ({revs}); name one: "
            f"qf rm {quants[0].name}:{quants[0].tag}@REV"
        )
    [quant] = quants
    published = folder.quant_dir(settings.registry, quant.name, quant.tag, quant.rev)
    freed = disk_bytes(published) if published.is_dir() else 0
    catalog.quants.remove(quant.name, quant.tag, quant.rev)
    folder.remove(published)
    return quant, freed


def garbage(settings: Settings, catalog: Catalog) -> list[Garbage]:
    catalog.leases.expired()
    states = catalog.jobs.states()
    found = []
    if settings.work.is_dir():
        for work in sorted(settings.work.iterdir()):
            state = states.get(work.name, (None, None))[0]
            if state is None:
                found.append(Garbage(work, disk_bytes(work), "work folder of a job the catalog does not know"))
            elif state in DONE:
                found.append(Garbage(work, disk_bytes(work), f"work folder of a {state} job"))
    if settings.registry.is_dir():
        found += [
            Garbage(p, disk_bytes(p), "staging of a publish that was killed")
            for p in folder.sweep(settings.registry, remove=False)
        ]
        found += _unlisted(settings, catalog, states)
    needed = {_hub_folder(ident) for state, ident in states.values() if state not in DONE}
    for download in sorted((settings.cache / "hub").glob("*/*")):
        if download.relative_to(settings.cache / "hub").as_posix() not in needed:
            found.append(Garbage(download, disk_bytes(download), "Hub download that no unfinished job needs"))
    copies = {dequantize.folder(settings.home, ident) for state, ident in states.values() if state not in DONE}
    found += [Garbage(p, disk_bytes(p), why) for p, why in dequantize.leftovers(settings.home, copies)]
    snapshots_read = {snapshots.folder(settings.home, ident) for state, ident in states.values() if state not in DONE}
    found += [Garbage(p, disk_bytes(p), why) for p, why in snapshots.leftovers(settings.home, snapshots_read)]
    return found


def _unlisted(settings: Settings, catalog: Catalog, states: dict) -> list[Garbage]:
    """Registry folders that no live row lists, older than folder.STALE_SECONDS, whose job is not running."""
    listed = {q.path for q in catalog.quants.live()}
    found = []
    for path in sorted(settings.registry.glob("*/*@*")):
        relative = path.relative_to(settings.registry).as_posix()
        if relative in listed or path.name.startswith(folder.STAGING) or path.is_symlink() or not path.is_dir():
            continue
        if time.time() - path.lstat().st_mtime < folder.STALE_SECONDS:
            continue  # a publish may be recording its row now
        job_id = (folder.read_manifest(path) or {}).get("job")
        job_id = job_id if isinstance(job_id, str) else None
        if states.get(job_id, (None, None))[0] == JobState.running:
            continue
        tag, _, rev = path.name.partition("@")

        def remove(path=path, name=path.parent.name, tag=tag, rev=rev, job_id=job_id) -> bool:
            return catalog.quants.remove_unlisted(name, tag, rev, job_id, lambda: folder.remove(path))

        why = "registry folder that no catalog row lists (a publish killed before recording it)"
        found.append(Garbage(path, disk_bytes(path), why, remove))
    return found


def _hub_folder(identity: str) -> str:
    """`org/name@sha` -> where sources.fetch_hub keeps it, relative to cache/hub (`org--name/sha`)."""
    repo, _, sha = identity.rpartition("@")
    return f"{repo.replace('/', '--')}/{sha}"


def collect(items: list[Garbage]) -> int:
    """Remove `items`; the bytes freed (an item whose removal was decided against at its moment frees none)."""
    freed = 0
    for item in items:
        if item.remove is not None:
            if not item.remove():
                continue
        elif item.path.is_dir() and not item.path.is_symlink():
            shutil.rmtree(item.path, ignore_errors=True)
        else:
            item.path.unlink(missing_ok=True)
        freed += item.bytes
    return freed
