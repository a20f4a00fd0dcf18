"""Which upstream releases to quantize: watchlist + what the Hub says + what was already done -> a plan.

`plan` is pure: no Hub, no database, no clock. `hub_releases` asks the Hub what the watches name now;
`workers/tasks.py` gathers the inputs with it (beat, or `qf watch check`) and carries the plan out through the same
submission path as `qf submit`, so a release planned twice is still one job.

A watch is a Hub repo (`org/name`) or an author's repos by name pattern (`Qwen/*-Instruct`; fnmatch, any case),
with a recipe (a key per engine, as in configs/standard.yaml) and an optional filter: `architectures`
(a list) and `max_params` (a number, e.g. 8e9). A watchlist file (configs/watchlist.yaml) lists them under
`watch:`, each with `target`, `recipe` and `filter`.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from factory import engines
from factory import hubclient as hub
from factory.catalog import Watchlist
from factory.checkpoints.inspection import read_config
from factory.errors import FactoryError, NotFound, SpecError
from factory.recipes import recipe_from_dict

_TARGET = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.*?\[\]-]+")
FILTER_KEYS = {"architectures", "max_params"}


@dataclass(frozen=True)
class WatchEntry:
    target: str
    recipe: dict
    filter: dict = field(default_factory=dict)

    @property
    def author(self) -> str:
        return self.target.split("/")[0]

    @property
    def is_pattern(self) -> bool:
        return any(c in self.target for c in "*?[")

    def matches(self, repo: str) -> bool:
        return fnmatch.fnmatchcase(repo.lower(), self.target.lower())


@dataclass(frozen=True)
class Release:
    """The newest commit of one upstream repo, as the Hub describes it."""

    repo: str
    sha: str
    architectures: tuple[str, ...] = ()
    params: int | None = None
    problem: str | None = None  # why it cannot be quantized at all (gated without access, no config.json)


@dataclass(frozen=True)
class Planned:
    watch: str
    repo: str
    sha: str
    recipe: dict
    skipped: str | None = None  # a reason: recorded once, never submitted


def entry(target: str, recipe: dict, filter: dict | None = None) -> WatchEntry:
    """A checked watch; SpecError (exit 2) saying what is wrong."""
    if not _TARGET.fullmatch(target) or any(c in target.split("/")[0] for c in "*?["):
        raise SpecError(f"watch target {target!r} is neither org/name nor org/pattern (a pattern only in the name)")
    parsed = recipe_from_dict(recipe, f"the recipe of watch {target}")
    if not parsed.specs():
        known = engines.available()
        raise SpecError(
            f"the recipe of watch {target} makes nothing: give it {', '.join(known[:-1])} or {known[-1]} targets"
        )
    filter = dict(filter or {})
    if unknown := set(filter) - FILTER_KEYS:
        raise SpecError(f"watch {target}: unknown filter keys {sorted(unknown)}; allowed: {sorted(FILTER_KEYS)}")
    if "max_params" in filter:
        try:
            filter["max_params"] = int(float(filter["max_params"]))
        except (TypeError, ValueError):
            raise SpecError(f"watch {target}: max_params must be a number, e.g. 8e9") from None
        if filter["max_params"] <= 0:
            raise SpecError(f"watch {target}: max_params must be positive")
    if "architectures" in filter and not (isinstance(filter["architectures"], list) and filter["architectures"]):
        raise SpecError(f"watch {target}: architectures must be a non-empty list, e.g. [LlamaForCausalLM]")
    return WatchEntry(target, recipe, filter)


def load(path: Path) -> list[WatchEntry]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpecError(f"cannot read watchlist {path}: {e}") from None
    items = data.get("watch") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise SpecError(f"watchlist {path} needs a list under `watch:`")
    bad = [i for i in items if not isinstance(i, dict) or "target" not in i or set(i) - {"target", "recipe", "filter"}]
    if bad:
        raise SpecError(f"watchlist {path}: each entry has `target`, `recipe` and optionally `filter`; got {bad[0]!r}")
    return [entry(str(i["target"]), i.get("recipe") or {}, i.get("filter")) for i in items]


def plan(
    watches: list[WatchEntry], releases: list[Release], done: set[tuple[str, str, str]], supported: dict[str, set[str]]
) -> list[Planned]:
    """One Planned per (watch, release) that matches and is not done yet; `done` holds (watch, repo, sha);
    `supported`: engine name -> the architectures it converts (a release is skipped when no engine of the
    watch's recipe converts it)."""
    planned = []
    for watch in watches:
        for release in releases:
            if watch.matches(release.repo) and (watch.target, release.repo, release.sha) not in done:
                reason = _reason(watch, release, supported)
                planned.append(Planned(watch.target, release.repo, release.sha, watch.recipe, reason))
    return planned


def _reason(watch: WatchEntry, release: Release, supported: set[str]) -> str | None:
    if release.problem:
        return release.problem
    if not release.architectures:
        return "its config.json names no architecture"
    arch = release.architectures[0]
    used = [name for name in supported if name in watch.recipe] or list(supported)
    if not any(arch in supported[name] for name in used):
        return f"architecture {arch} is not supported by {', '.join(used)}"
    wanted = watch.filter.get("architectures")
    if wanted and arch not in wanted:
        return f"architecture {arch} is not in the watch's filter ({', '.join(wanted)})"
    limit = watch.filter.get("max_params")
    if limit and release.params and release.params > limit:
        return f"{release.params / 1e9:.2f}B parameters, the watch's filter allows {limit / 1e9:.2f}B"
    return None


# what the Hub says ---------------------------------------------------------------------------------------------
def hub_releases(watches: list[WatchEntry]) -> tuple[list[Release], list[FactoryError]]:
    """What the Hub says now about every repo the watches name: (releases, errors). A Hub
    error about one repo or author goes to `errors` and the others still count; the next check tries again."""
    repos, errors = set(), []
    for w in watches:
        if not w.is_pattern:
            repos.add(w.target)
            continue
        try:
            with hub.errors(f"the models of {w.author}"):
                ids = hub.retrying(lambda w=w: [m.id for m in hub.client(hub.token()).list_models(author=w.author)])
            repos |= {i for i in ids if w.matches(i)}
        except FactoryError as e:
            errors.append(e)
    releases = []
    for repo in sorted(repos):
        try:
            releases.append(_release(repo))
        except FactoryError as e:
            errors.append(e)
    return releases, errors


def _release(repo: str):
    """The newest commit of `repo` with its architectures and parameter count; a gated repo or one without a
    config.json is a release with a `problem` (recorded as skipped once), a Hub outage raises."""
    from huggingface_hub.errors import NotASafetensorsRepoError, SafetensorsParsingError

    api = hub.client(hub.token())
    with hub.errors(repo):
        info = hub.retrying(lambda: api.model_info(repo))
    try:
        with hub.errors(repo):
            config = read_config(hub.config_file(repo, info.sha), check_numbers=False)
    except NotFound as e:
        return Release(repo, info.sha, problem=e.message)
    params = info.safetensors.total if getattr(info, "safetensors", None) else None
    if params is None:
        try:
            with hub.errors(repo):
                meta = hub.retrying(lambda: api.get_safetensors_metadata(repo, revision=info.sha))
            params = sum(meta.parameter_count.values())
        except (FactoryError, NotASafetensorsRepoError, SafetensorsParsingError):
            params = None  # a count we cannot read leaves the max_params filter open
    return Release(repo, info.sha, tuple(config.get("architectures") or ()), params)


def watch_rows(watchlist: Watchlist) -> list[dict]:
    """The watchlist as `qf watch ls --json` prints it: each watch with what it saw upstream and did."""
    seen: dict[str, list] = {}
    for u in watchlist.upstream():
        seen.setdefault(u.watch, []).append(u)
    return [
        {
            "target": w.target,
            "recipe": w.recipe,
            "filter": w.filter,
            "seen": [
                {"repo": u.repo, "sha": u.sha, "job": u.job_id, "skipped": u.skipped} for u in seen.get(w.target, [])
            ],
        }
        for w in watchlist.watches()
    ]
