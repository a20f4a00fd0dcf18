"""Disk: removing a published quant (`qf rm`) and what finished work leaves behind (`qf gc`).

`qf rm NAME:TAG[@REV]` forgets the quant in the catalog and removes its registry folder, nothing else: not another
revision, not the Hub's copy, not the measurement other sizes reuse. `qf gc` finds
  - work folders of jobs that succeeded or were cancelled, and of jobs the catalog does not know (a failed job keeps
    its folder: running it again continues from there);
  - staging folders of publishes that were killed (older than an hour and not held, see publish/folder.py);
  - Hub downloads (FACTORY_HOME/cache/hub/ORG--NAME/SHA) that no queued, running or failed job needs;
  - BF16 copies of FP8/MXFP4 sources (FACTORY_HOME/dequantized/KEY, factory/checkpoints/dequantize.py) that no such job
  needs,
    and what a dequantization that was killed left (not held by a writer now).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from factory.catalog import Catalog, JobState, Quant
from factory.checkpoints import dequantize
from factory.errors import SpecError
from factory.publish import folder as registry
from factory.settings import Settings

DONE = (JobState.succeeded, JobState.cancelled)


@dataclass(frozen=True)
class Garbage:
    path: Path
    bytes: int
    why: str


def disk_bytes(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(os.lstat(os.path.join(root, f)).st_size for root, _, files in os.walk(path) for f in files)


def remove_quant(settings: Settings, catalog: Catalog, quants: list[Quant]) -> tuple[Quant, int]:
    """Remove the one quant of `quants` (the matches of a NAME:TAG[@REV]); (the quant, bytes freed)."""
    if len(quants) > 1:
        revs = ", ".join(q.rev for q in quants)
        raise SpecError(
            f"{quants[0].name}:{quants[0].tag} has {len(quants)} revisions ({revs}); name one: "
            f"qf rm {quants[0].name}:{quants[0].tag}@REV"
        )
    [quant] = quants
    folder = registry.quant_dir(settings.registry, quant.name, quant.tag, quant.rev)
    freed = disk_bytes(folder) if folder.is_dir() else 0
    catalog.remove_quant(quant.name, quant.tag, quant.rev)
    registry.remove(folder)
    return quant, freed


def garbage(settings: Settings, catalog: Catalog) -> list[Garbage]:
    states = catalog.job_states()
    found = []
    if settings.work.is_dir():
        for folder in sorted(settings.work.iterdir()):
            state = states.get(folder.name, (None, None))[0]
            if state is None:
                found.append(Garbage(folder, disk_bytes(folder), "work folder of a job the catalog does not know"))
            elif state in DONE:
                found.append(Garbage(folder, disk_bytes(folder), f"work folder of a {state} job"))
    if settings.registry.is_dir():
        found += [
            Garbage(p, disk_bytes(p), "staging of a publish that was killed")
            for p in registry.sweep(settings.registry, remove=False)
        ]
    needed = {_hub_folder(ident) for state, ident in states.values() if state not in DONE}
    for download in sorted((settings.cache / "hub").glob("*/*")):
        if download.relative_to(settings.cache / "hub").as_posix() not in needed:
            found.append(Garbage(download, disk_bytes(download), "Hub download that no unfinished job needs"))
    copies = {dequantize.folder(settings.home, ident) for state, ident in states.values() if state not in DONE}
    found += [Garbage(p, disk_bytes(p), why) for p, why in dequantize.leftovers(settings.home, copies)]
    return found


def _hub_folder(identity: str) -> str:
    """`org/name@sha` -> where sources.fetch_hub keeps it, relative to cache/hub (`org--name/sha`)."""
    repo, _, sha = identity.rpartition("@")
    return f"{repo.replace('/', '--')}/{sha}"


def collect(items: list[Garbage]) -> int:
    for item in items:
        if item.path.is_dir() and not item.path.is_symlink():
            shutil.rmtree(item.path, ignore_errors=True)
        else:
            item.path.unlink(missing_ok=True)
    return sum(item.bytes for item in items)
