"""Publishing quants to the Hugging Face Hub and pulling them by name (the client pieces it shares with fetching:
factory/hubclient.py).

Publishing (FACTORY_HUB_OWNER set): one engine's quants of a model share one repo (the engine's `hub_repo`
template, e.g. `{owner}/{model}-<engine>`), one branch per variant (the engine's `branch`, e.g. `4.0bpw`), with the
model card and its plot on main beside the files the engine puts there (`main_files`). Each branch changes in one
commit made against the head it read (parent_commit), so publishing the same quant again changes nothing, a
concurrent publish is read again and retried, and a failed upload leaves the branch where it was; 429 and 5xx
answers are retried with backoff.

Tokens come from HF_TOKEN or huggingface_hub's stored login and go nowhere else: not into task arguments, the
catalog, logs or messages. HF_ENDPOINT points all of it at another Hub (the tests' local server).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from factory import engines
from factory.checkpoints.files import carried
from factory.errors import JobFailed, NotFound, ServiceUnavailable, SpecError
from factory.hubclient import client, download, errors, file_id, remote_id, retrying, status, token

KEEP_ON_BRANCH = (".gitattributes",)


# publishing ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Place:
    """Where a quant lives on the Hub: a repo and a branch."""

    repo: str
    branch: str


def templates(repos: dict[str, str]) -> dict[str, str]:
    """Every engine's repo template: FACTORY_HUB_<ENGINE>_REPO where set (`repos`), else the engine's default."""
    return {e.name: repos.get(e.name, e.card.hub_repo) for e in engines.all_engines()}


def place(owner: str, name: str, tag: str, templates: dict[str, str]) -> Place:
    """`smollm2-135m-instruct:<engine>-4.0bpw` -> alice/smollm2-135m-instruct-<engine>, branch 4.0bpw."""
    engine = engines.of_tag(tag)
    return Place(templates[engine.name].format(owner=owner, model=name), engine.card.branch(tag))


def writer(owner: str):
    """An HfApi that may write under `owner`; one sentence (exit 5) when the token is missing or cannot."""
    secret = token()
    if not secret:
        raise ServiceUnavailable(
            "publishing to the Hub needs a token with write access: set HF_TOKEN or log in with `hf auth login`"
        )
    api = client(secret)
    with errors("the token's account"):
        me = retrying(api.whoami)
    role = me.get("auth", {}).get("accessToken", {}).get("role")
    if role == "read":
        raise ServiceUnavailable(f"the Hub token of {me['name']} is read-only; publishing needs write access")
    allowed = {me["name"], *(o["name"] for o in me.get("orgs", []))}
    if owner not in allowed:
        raise ServiceUnavailable(
            f"the Hub token of {me['name']} cannot publish under {owner!r} "
            f"(FACTORY_HUB_OWNER); it may publish under {', '.join(sorted(allowed))}"
        )
    return api


def put_branch(
    api, repo: str, branch: str, files: dict[str, Path] | Callable[[], dict[str, Path]], message: str
) -> str | None:
    """Make `branch` of `repo` hold exactly `files` (path in repo -> local file) in one commit made against the
    head it read; None when it already does. A concurrent commit to the branch makes it read again and retry
    (with `files` made again when it is a function: a card that lists what the other commit added)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import HfHubHTTPError

    with errors(f"{repo}@{branch}"):
        retrying(lambda: api.create_repo(repo, exist_ok=True))
        if branch != "main":
            retrying(lambda: api.create_branch(repo, branch=branch, exist_ok=True))
        for attempt in range(3):
            info = retrying(lambda: api.model_info(repo, revision=branch, files_metadata=True))
            remote = {s.rfilename: s for s in info.siblings}
            wanted = files() if callable(files) else files
            ops: list = [
                CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
                for name, path in sorted(wanted.items())
                if name not in remote or file_id(path, remote[name].lfs is not None) != remote_id(remote[name])
            ]
            gone = [n for n in remote if n not in wanted and n not in KEEP_ON_BRANCH]
            ops += [CommitOperationDelete(path_in_repo=n) for n in gone]
            if not ops:
                return None
            try:
                return retrying(
                    lambda ops=ops, head=info.sha: api.create_commit(
                        repo, ops, commit_message=message, revision=branch, parent_commit=head
                    )
                ).oid
            except HfHubHTTPError as e:  # another commit moved the branch: read it again
                if status(e) not in (409, 412) or attempt == 2:
                    raise
    return None


def refs(repo: str) -> dict[str, str]:
    """Branch name -> commit sha of a repo ({} when it does not exist)."""
    from huggingface_hub.errors import RepositoryNotFoundError

    with errors(repo):
        try:
            found = retrying(lambda: client(token()).list_repo_refs(repo))
        except RepositoryNotFoundError:
            return {}
    return {b.name: b.target_commit for b in found.branches}


# pulling ---------------------------------------------------------------------------------------------------------
def pull(
    where: Place, outputs: tuple[str, ...], revision: str | None, dest: Path, progress: Callable[..., None]
) -> list[str]:
    """Download a published quant pinned to one commit (the branch head; with `revision`, the newest commit of the
    branch made from that source revision, or that commit) and check every file against the Hub; the files land
    in `dest` only when all of them match. A branch that lists a file no quant of its engine carries (`outputs`,
    files.carried: a path, a name off the list) is refused before anything is downloaded."""
    dest = dest.resolve()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise SpecError(f"{dest} exists and is not an empty folder; pick another with -o")
    branches = refs(where.repo)
    if where.branch not in branches:
        raise NotFound(f"{where.repo} has no branch {where.branch!r}; it has {', '.join(sorted(branches)) or 'none'}")
    commit = branches[where.branch]
    if revision and not commit.startswith(revision):  # an older quant: its commit says which source revision
        with errors(f"{where.repo}@{where.branch}"):
            history = retrying(lambda: client(token()).list_repo_commits(where.repo, revision=where.branch))
        older = [c.commit_id for c in history if c.commit_id.startswith(revision) or f"@{revision} from " in c.title]
        if not older:
            raise NotFound(f"{where.repo}@{where.branch} holds no quant of source revision {revision}")
        commit = older[0]
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))  # ours alone
    staging.chmod(0o755)
    try:
        with errors(f"{where.repo}@{where.branch}"):
            info = retrying(lambda: client(token()).model_info(where.repo, revision=commit, files_metadata=True))
            files = [s for s in info.siblings if s.rfilename not in KEEP_ON_BRANCH]
            if strangers := [s.rfilename for s in files if not carried(s.rfilename, outputs)]:
                raise JobFailed(
                    f"{where.repo}@{where.branch} holds {strangers[0]!r}, a name no quant's file has; nothing was "
                    "pulled"
                )
            total, done = sum(s.size or 0 for s in files), 0
            for s in files:
                download(where.repo, s, commit, staging)  # a mismatch leaves nothing: staging goes below
                done += s.size or 0
                progress(done=done, total=total)
        shutil.rmtree(staging / ".cache", ignore_errors=True)
        if dest.exists():
            dest.rmdir()  # empty, checked above
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [s.rfilename for s in files]


def tags(owner: str, name: str, templates: dict[str, str]) -> dict[str, Place]:
    """The tags of model `name` published under `owner`: tag -> its Place (templates: method -> repo)."""
    found = {}
    for method, template in templates.items():
        repo = template.format(owner=owner, model=name)
        engine = engines.get(method)
        found.update({engine.card.tag_of_branch(b): Place(repo, b) for b in refs(repo) if b != "main"})
    return found


def published(owner: str, templates: dict[str, str]) -> list[dict]:
    """Every quant published under `owner`: name:tag, repo, branch, commit (repos the templates name only)."""
    with errors(f"the models of {owner}"):
        models = retrying(lambda: [m.id for m in client(token()).list_models(author=owner)])
    rows = []
    for method, template in templates.items():
        pattern = re.escape(template).replace(r"\{owner\}", re.escape(owner)).replace(r"\{model\}", "(?P<model>.+)")
        for repo in models:
            if match := re.fullmatch(pattern, repo):
                tag_of = engines.get(method).card.tag_of_branch
                rows += [
                    {"name": f"{match['model']}:{tag_of(b)}", "repo": repo, "branch": b, "commit": c}
                    for b, c in sorted(refs(repo).items())
                    if b != "main"
                ]
    return rows
