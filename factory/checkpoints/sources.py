"""Where a job's FP16 checkpoint comes from, and its identity.

A local folder's identity is `sha256:<hex>` over the files it contributes (factory/checkpoints/files.py: weights,
config, tokenizer, chat template; names and contents);
file hashes are cached by path, size and mtime under FACTORY_HOME, so a second submit does not re-read the weights:
a hint, which the job verifies against the bytes of its own snapshot of the folder (factory/jobs/prepared.py).
A Hub repo (`org/name[@revision]`) is identified by `org/name@<commit sha>`, resolved when the job is submitted;
the job's fetch step downloads the same allowlist of files pinned to that sha into
FACTORY_HOME/cache/hub/<org>--<name>/<sha>/ and checks each against the Hub's sha256 (LFS) or git blob id, once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from factory import hubclient as hub
from factory import identity
from factory.checkpoints.dequantize import bf16_shapes
from factory.checkpoints.files import UPSTREAM_CARD, is_source_file, source_files, staged_files, write_atomic
from factory.checkpoints.inspection import (
    MAX_METADATA,
    check_against_tensors,
    check_config,
    read_config,
    read_headers,
    read_json,
)
from factory.errors import ModelRefused, NotFound, SpecError
from factory.identity import rev

VERIFIED = ".quantfactory-verified"  # written into a fetched Hub folder once every file matched the Hub
_HUB_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"  # the Hub's own grammar (huggingface_hub)
_HUB_REPO = re.compile(rf"{_HUB_PART}/{_HUB_PART}")
_HUB_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,254}")  # a branch, tag or commit
NOT_A_HUB_REPO = (
    "neither a folder here nor a Hub repo owner/name[@revision] (ASCII letters, digits, '-', '_' and "
    "'.', at most 96 each, no '--' or '..')"
)


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


def local(arg: str) -> Path:
    """The path a source names, `~` and `~user` expanded; NotFound (exit 4) for the home of a user that does not
    exist."""
    try:
        return Path(arg).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory"
        user = arg.split("/", 1)[0][1:]
        raise NotFound(
            f"source {arg!r} does not exist (there is no user {user!r}); pass a local folder with config.json and "
            "safetensors weights"
        ) from None


def resolve(arg: str, cache_dir: Path) -> Source:
    path = local(arg)
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
            base_model=_plain(path.name),
        )
    repo, revision = parse_hub(arg)
    sha = resolve_hub(repo, revision)
    owner, label = repo.split("/")
    return Source(path=None, source=repo, label=label, owner=owner, identity=f"{repo}@{sha}", base_model=repo)


def _plain(folder_name: str) -> str:
    """A folder's name as the card names the base model: letters, digits, `.`, `_` and `-`, the rest `-` (a folder
    may be named `x\n# Heading`, which would be a heading on the card)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", folder_name).strip("-")[:96] or "model"


def parse_hub(arg: str) -> tuple[str, str | None]:
    """The Hub repo and revision a source that is not a folder here names, before anything asks the Hub: a path
    (`/`, `.` or `~` first) that does not exist is NotFound (exit 4), anything else not a Hub repo a SpecError (2)."""
    if arg.startswith(("/", ".", "~")):
        raise NotFound(f"source {arg!r} does not exist; pass a local folder with config.json and safetensors weights")
    if not is_hub_name(arg):
        raise SpecError(f"source {arg!r} is {NOT_A_HUB_REPO}")
    repo, _, revision = arg.partition("@")
    return repo, revision or None


def is_hub_name(arg: str) -> bool:
    """Whether `arg` is a Hub repo `owner/name[@revision]`.

    Rules: owner and name are ASCII letters, digits, `-`, `_` and `.`, 1 to 96 characters, beginning and ending
    with a letter, digit or `_`, with no `--` or `..` and a name not ending in `.git` (the Hub's own rules); a
    revision (a branch, tag or commit) is ASCII letters, digits, `-`, `_`, `.` and `/`, no `..`.
    Valid: `meta-llama/Llama-3.1-8B`, `HuggingFaceTB/SmolLM2-135M-Instruct@main`, `org/name@refs/pr/1`.
    Not valid: `gpt2` (no owner), `alice/..`, `alice/x/y`, `alice/mödel`, `alice/x--y`, `alice/x@../main`.
    """
    repo, at, revision = arg.partition("@")
    if not _HUB_REPO.fullmatch(repo) or "--" in repo or ".." in repo or repo.endswith(".git"):
        return False
    return not at or (bool(_HUB_REVISION.fullmatch(revision)) and ".." not in revision)


def check_base_model(text: str) -> str:
    """`--base-model`, what the model card names as base_model and links to: a Hub repo id `owner/name` (is_hub_name's
    rules, huggingface_hub's validate_repo_id, with no revision). SpecError (exit 2; the service's 422) otherwise: a
    heading, a link or a command in it would reach the published card.

    Valid: `meta-llama/Llama-3.1-8B`.
    Not valid: `gpt2` (no owner), `org/name@main`, `org/x--y`, `org/a b`, `org/x\n# Hi`, `org/x](https://e.vil)`.
    """
    if "@" in text or not is_hub_name(text):
        shown = repr(text) if len(text) <= 100 else repr(text[:100]) + "..."
        raise SpecError(
            f"--base-model {shown} is not a Hub repo id: owner/name, ASCII letters, digits, '-', '_' and '.', at most "
            "96 each, no '--' or '..'"
        )
    return text


def resolve_hub(repo: str, revision: str | None) -> str:
    """The commit sha that `revision` (default main) of `repo` points at now."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError

    what = f"{repo}@{revision}" if revision else repo
    with hub.errors(what):
        sha = hub.retrying(lambda: hub.client(hub.token()).model_info(repo, revision=revision)).sha
        # a gated repo's listing is public, its files are not: ask for one now, not in the job
        url = hf_hub_url(repo, "config.json", revision=sha, endpoint=hub.endpoint())
        try:
            hub.retrying(lambda: get_hf_file_metadata(url, token=hub.token()))
        except EntryNotFoundError:
            raise ModelRefused(f"{what} has no config.json; quantfactory takes transformers checkpoints") from None
    return sha


def fetch_hub(identity: str, cache: Path, progress: Callable[..., None]) -> Path:
    """The source files of `org/name@sha`, downloaded once into the cache and checked against the Hub."""
    repo, sha = identity.rsplit("@", 1)
    dest = cache / "hub" / repo.replace("/", "--") / sha
    if (dest / VERIFIED).is_file():
        return dest
    with hub.errors(identity):
        info = hub.retrying(lambda: hub.client(hub.token()).model_info(repo, revision=sha, files_metadata=True))
        files = [s for s in info.siblings if "/" not in s.rfilename and is_source_file(s.rfilename)]
        if not any(s.rfilename.endswith(".safetensors") for s in files):
            raise ModelRefused(f"{identity} has no safetensors weights; quantfactory reads only safetensors")
        index = next((s for s in files if s.rfilename == "model.safetensors.index.json"), None)
        if index is not None:  # only the shards it names (not e.g. Mistral's consolidated.safetensors beside them)
            found = read_json(
                hub.download(repo, index, sha, dest), MAX_METADATA, "a safetensors index", index.rfilename
            )
            weight_map = found.get("weight_map") if isinstance(found, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ModelRefused(f"{identity}: {index.rfilename} is not a valid safetensors index")
            shards = set(weight_map.values())
            files = [s for s in files if not s.rfilename.endswith(".safetensors") or s.rfilename in shards]
        card = next((s for s in info.siblings if s.rfilename == UPSTREAM_CARD), None)
        if card is not None:  # the upstream card, for its license and language (not part of the source's identity)
            files.append(card)
        total, done = sum(s.size or 0 for s in files), 0
        for s in files:
            if s is not index:
                hub.download(repo, s, sha, dest)
            done += s.size or 0
            progress(done=done, total=total, unit="B")
    (dest / VERIFIED).write_text(json.dumps({s.rfilename: hub.remote_id(s) for s in files}, indent=1))
    return dest


def layout(arg: str) -> tuple[dict, dict[str, list[int]]]:
    """config.json and every tensor's shape of a local folder or a Hub repo (`org/name[@rev]`), without reading
    weights: safetensors headers locally, the Hub's safetensors metadata (ranged reads) for a repo. An FP8 or MXFP4
    source's shapes are those of its BF16 copy (factory/checkpoints/dequantize.py), which the engines read."""
    path = local(arg)
    if path.is_dir():
        files = source_files(path)
        if "config.json" not in files:
            raise NotFound(f"{arg!r} has no config.json")
        headers = read_headers({name: f for name, f in files.items() if name.endswith(".safetensors")})
        tensors = {n: i["shape"] for header in headers.values() for n, i in header.items()}
        config = read_config(files["config.json"])
        check_against_tensors(config, tensors)
        return config, bf16_shapes(config, tensors)
    repo, revision = parse_hub(arg)

    sha = resolve_hub(repo, revision)
    with hub.errors(arg):
        config = check_config(read_config(hub.config_file(repo, sha), check_numbers=False))
        meta = hub.retrying(lambda: hub.client(hub.token()).get_safetensors_metadata(repo, revision=sha))
    tensors = {n: t.shape for f in meta.files_metadata.values() for n, t in f.tensors.items()}
    check_against_tensors(config, tensors)
    return config, bf16_shapes(config, tensors)


def folder_identity(folder: Path, cache_dir: Path, staged: Path | None = None) -> str:
    """The identity of a local folder, over its source files (each file's sha256 cached by path, size and mtime).
    With `staged` (the job's staging folder of `folder`, files.stage): the identity of what the job reads, its
    companion copies hashed there (each time: they are small, and their paths are the job's) and its weights where
    their links lead."""
    cache_file, cache = _hash_cache(cache_dir)
    hashes, hashed = {}, False
    found = staged_files(staged, folder) if staged else source_files(folder)
    for name, f in found.items():  # regular files only: a bad link or a FIFO is refused here
        if staged and f.parent == staged:
            hashes[name] = identity.file_sha256(f)
            continue
        st = f.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        hit = cache.get(str(f))
        if not hit or hit[0] != stamp:
            hit = cache[str(f)] = [stamp, identity.file_sha256(f)]
            hashed = True
        hashes[name] = hit[1]
    if hashed:  # every file a hit: the cache on disk already says all this
        write_atomic(cache_file, json.dumps(cache).encode())
    return identity.of_files(hashes)


def _hash_cache(cache_dir: Path) -> tuple[Path, dict[str, list[str]]]:
    """The file of cached sha256s (path -> [size:mtime, sha256]) and what it holds."""
    cache_file = cache_dir / "file-sha256.json"
    try:
        return cache_file, json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return cache_file, {}


def forget_changed(folder: Path, cache_dir: Path, hashes: dict[str, str]) -> list[str]:
    """The files of `folder` whose cached sha256 is not the one just read (`hashes`, name -> sha256), and files
    the cache does not know; their entries leave the cache, so the next submit hashes them again."""
    cache_file, cache = _hash_cache(cache_dir)
    try:
        paths = source_files(folder)
    except ModelRefused:  # a file became a FIFO, ...: its entry, if any, goes by its name
        paths = {}
    changed = []
    for name, sha in hashes.items():
        key = str(paths.get(name, folder.resolve() / name))
        if cache.get(key, [None, None])[1] != sha:
            changed.append(name)
            cache.pop(key, None)
    if changed:
        write_atomic(cache_file, json.dumps(cache).encode())
    return changed
