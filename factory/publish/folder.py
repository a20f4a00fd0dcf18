"""The registry folder: FACTORY_HOME/registry/<name>/<tag>@<rev>/ holds a quant's files and manifest.json.

The manifest records the source identity, spec, calibration hash, tool versions, eval results and the sha256
and size of every file. Publishing is atomic (a temp folder beside the target, then a rename) and idempotent
(the same files again change nothing). Pulling copies the files out and checks every sha256.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from factory.errors import JobFailed, SpecError
from factory.sources import file_sha256

MANIFEST = "manifest.json"


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


def publish(registry: Path, name: str, tag: str, rev: str, files: Path, manifest: dict) -> tuple[Path, dict]:
    """Put `files` (a flat folder) into the registry as name:tag@rev; returns (folder, manifest written)."""
    dest = quant_dir(registry, name, tag, rev)
    dest.parent.mkdir(parents=True, exist_ok=True)
    manifest = {**manifest, "name": name, "tag": tag, "rev": rev, "files": file_table(files)}
    if dest.is_dir() and _read(dest) == manifest:
        return dest, manifest
    tmp = dest.parent / f".tmp-{dest.name}-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(files, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        old = None
        if dest.exists():
            old = dest.parent / f".old-{dest.name}-{uuid.uuid4().hex[:8]}"
            dest.rename(old)
        tmp.rename(dest)
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest, manifest


def _read(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(folder: Path) -> dict:
    """The manifest of a registry folder whose files all match it; JobFailed naming the first that does not."""
    manifest = _read(folder)
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
        shutil.copytree(folder, tmp)
        for fname, want in manifest["files"].items():
            if file_sha256(tmp / fname) != want["sha256"]:
                raise JobFailed(f"{fname} changed while it was copied; pull again")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / f for f in manifest["files"]]
