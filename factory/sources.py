"""Where a job's FP16 checkpoint comes from, and its identity.

A local folder's identity is `sha256:<hex>` over its config, tokenizer and weight files (names and contents);
file hashes are cached by path, size and mtime under FACTORY_HOME, so a second run does not re-read the weights.
A Hub repo (`org/name[@revision]`) is identified by `org/name@<commit sha>`, resolved when the job is submitted;
its files are fetched by the job (factory/hub.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from factory.errors import NotFound

IDENTITY_FILES = re.compile(
    r"config\.json|generation_config\.json|tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json"
    r"|.*\.safetensors|model\.safetensors\.index\.json"
)
_HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


@dataclass(frozen=True)
class Source:
    path: Path | None  # the local folder; None for a Hub repo (its job fetches it)
    source: str  # what the user named: an absolute folder path or org/name
    label: str  # the name part, for the quant name
    owner: str  # the owner part (parent folder or org), for a name that is taken
    identity: str  # sha256:<hex> for a folder, org/name@<sha> for a Hub repo
    base_model: str  # what the model card names as base_model: the Hub repo, or the folder's name

    @property
    def rev(self) -> str:
        return rev(self.identity)


def is_hub(identity: str) -> bool:
    return not identity.startswith("sha256:")


def rev(identity: str) -> str:
    """The short revision of a source identity: `sha256:1a2b3c4...` or `org/name@1a2b3c4...` -> `1a2b3c4`."""
    return identity.rsplit("@", 1)[-1].removeprefix("sha256:")[:7]


def resolve(arg: str, cache_dir: Path) -> Source:
    path = Path(arg).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotFound(f"source {arg!r} is a file; pass the folder that holds config.json and the weights")
        path = path.resolve()
        return Source(
            path=path,
            source=str(path),
            label=path.name,
            owner=path.parent.name,
            identity=folder_identity(path, cache_dir),
            base_model=path.name,
        )
    if _HUB_REPO.fullmatch(arg) and not arg.startswith((".", "/", "~")):
        from factory import hub

        repo, _, revision = arg.partition("@")
        sha = hub.resolve(repo, revision or None)
        owner, label = repo.split("/")
        return Source(path=None, source=repo, label=label, owner=owner, identity=f"{repo}@{sha}", base_model=repo)
    raise NotFound(f"source {arg!r} does not exist; pass a local folder with config.json and safetensors weights")


def folder_identity(folder: Path, cache_dir: Path) -> str:
    cache_file = cache_dir / "file-sha256.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    entries = []
    for f in sorted(p for p in folder.iterdir() if p.is_file() and IDENTITY_FILES.fullmatch(p.name)):
        st = f.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        hit = cache.get(str(f))
        if not hit or hit[0] != stamp:
            hit = cache[str(f)] = [stamp, file_sha256(f)]
        entries.append(f"{f.name}:{hit[1]}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache))
    tmp.replace(cache_file)
    return "sha256:" + hashlib.sha256("\n".join(entries).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
