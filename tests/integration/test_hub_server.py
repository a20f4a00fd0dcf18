"""The local Hub stand-in (tests/support/hub_server.py) driven by the real huggingface_hub client: what works, and which
exception the client raises for each failure a publisher has to handle."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")  # the client's PUT

ALICE, ALICE_READ, BOB = "hf_alice_write", "hf_alice_read", "hf_bob_write"
CARD = (
    b"---\nlicense: apache-2.0\nlibrary_name: transformers\nbase_model: org/base\nbase_model_relation: quantized\n"
    b"tags:\n- exl2\n---\n# tiny quant\n"
)


def weights(size: int = 1_500_000, seed: int = 0) -> bytes:
    """Safetensors-like bytes: a small JSON header after its length, then binary (NUL bytes included)."""
    header = b'{"w": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}}'
    body = hashlib.sha256(str(seed).encode()).digest() * (size // 32 + 1)
    return (len(header).to_bytes(8, "little") + header + body)[:size]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def api(hub) -> HfApi:
    return HfApi(endpoint=hub.url, token=ALICE)


def test_whoami_and_create_repo(hub, api):
    me = api.whoami()
    assert (me["name"], me["type"], me["auth"]["accessToken"]["role"]) == ("alice", "user", "write")
    assert HfApi(token=ALICE_READ).whoami()["auth"]["accessToken"]["role"] == "read"  # constants.ENDPOINT is patched

    url = api.create_repo("alice/tiny-exl2")
    assert url == f"{hub.url}/alice/tiny-exl2" and url.repo_id == "alice/tiny-exl2"
    api.create_repo("alice/tiny-exl2", exist_ok=True)  # 409, swallowed by the client
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo("alice/tiny-exl2")
    assert exc.value.response.status_code == 409
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo("bob/not-yours")  # another user's namespace
    assert exc.value.response.status_code == 403
    assert api.model_info("alice/tiny-exl2").siblings[0].rfilename == ".gitattributes"  # the Hub's initial commit


def test_branches_and_tags(hub, api):
    api.create_repo("alice/m")
    main = api.list_repo_refs("alice/m").branches[0]
    assert (main.name, main.ref) == ("main", "refs/heads/main")
    api.create_branch("alice/m", branch="4.0bpw")
    api.create_branch("alice/m", branch="4.0bpw", exist_ok=True)
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_branch("alice/m", branch="4.0bpw")
    assert exc.value.response.status_code == 409
    refs = {b.name: b.target_commit for b in api.list_repo_refs("alice/m").branches}
    assert refs == {"main": main.target_commit, "4.0bpw": main.target_commit}

    new = hub.add_repo("alice/m", {"a.txt": b"a"})  # main moves on; a branch made from the old sha stays behind
    api.create_branch("alice/m", branch="old", revision=main.target_commit)
    api.create_tag("alice/m", tag="v1", revision=new)
    refs = api.list_repo_refs("alice/m")
    assert {b.name: b.target_commit for b in refs.branches}["old"] == main.target_commit
    assert [(t.name, t.target_commit) for t in refs.tags] == [("v1", new)]
    api.delete_branch("alice/m", branch="old")
    assert {b.name for b in api.list_repo_refs("alice/m").branches} == {"main", "4.0bpw"}


def test_commit_lfs_and_regular_files_then_download(hub, api, tmp_path):
    repo = "alice/tiny-exl2"
    api.create_repo(repo)
    api.create_branch(repo, branch="4.0bpw")
    parent = api.model_info(repo, revision="4.0bpw").sha
    blob, config = weights(), b'{"model_type": "llama"}\n'
    info = api.create_commit(
        repo,
        revision="4.0bpw",
        parent_commit=parent,
        commit_message="4.0bpw quant",
        commit_description="made here",
        operations=[
            CommitOperationAdd("model.safetensors", blob),
            CommitOperationAdd("config.json", config),
            CommitOperationAdd("README.md", CARD),
        ],
    )
    sha = info.oid
    assert info.commit_url == f"{hub.url}/{repo}/commit/{sha}" and len(sha) == 40
    # Only the LFS file went through batch + PUT + verify; the small text files were inline in the commit.
    assert hub.count("PUT", r"^/_lfs/") == 1 and hub.count("POST", r"lfs/objects/verify$") == 1
    assert hub.count("POST", r"/preupload/") == 1 and hub.count("POST", r"/commit/4.0bpw$") == 1
    assert hub.files(repo, sha)["model.safetensors"] == blob
    assert api.list_repo_refs(repo).branches[0].target_commit != sha  # main untouched

    meta = api.model_info(repo, revision="4.0bpw", files_metadata=True)
    assert meta.sha == sha
    siblings = {s.rfilename: s for s in meta.siblings}
    assert siblings["model.safetensors"].lfs.sha256 == sha256(blob) and siblings["model.safetensors"].size == len(blob)
    assert siblings["config.json"].lfs is None and siblings["config.json"].size == len(config)
    assert {"exl2", "transformers", "license:apache-2.0", "base_model:quantized:org/base"} <= set(meta.tags)
    assert meta.card_data.base_model == "org/base"
    commits = api.list_repo_commits(repo, revision="4.0bpw")
    assert [c.commit_id for c in commits] == [sha, parent] and commits[0].title == "4.0bpw quant"
    assert sorted(api.list_repo_files(repo, revision=sha)) == [
        ".gitattributes",
        "README.md",
        "config.json",
        "model.safetensors",
    ]

    path = hf_hub_download(repo, "model.safetensors", revision=sha, token=ALICE)
    assert Path(path).read_bytes() == blob
    assert Path(hf_hub_download(repo, "config.json", revision="4.0bpw")).read_bytes() == config  # no token: public
    snap = snapshot_download(
        repo, revision=sha, allow_patterns=["*.safetensors", "*.json"], local_dir=tmp_path / "snap"
    )
    got = {p.name: p.read_bytes() for p in Path(snap).iterdir() if p.is_file()}
    assert got == {"model.safetensors": blob, "config.json": config}

    # upload_folder (legacy single-commit path, since xet is off) and a delete.
    folder = tmp_path / "out"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "notes.txt").write_text("hello")
    (folder / "sub" / "extra.safetensors").write_bytes(weights(5000, seed=3))  # LFS, uploaded from a path
    api.upload_folder(repo_id=repo, folder_path=folder, revision="4.0bpw")
    assert hub.count("PUT", r"^/_lfs/") == 2
    api.create_commit(repo, revision="4.0bpw", commit_message="rm", operations=[CommitOperationDelete("README.md")])
    assert sorted(hub.files(repo, "4.0bpw")) == [
        ".gitattributes",
        "config.json",
        "model.safetensors",
        "sub/extra.safetensors",
        "sub/notes.txt",
    ]
    assert hub.files(repo, "4.0bpw")["sub/extra.safetensors"] == weights(5000, seed=3)
    assert api.file_exists(repo, "sub/notes.txt", revision="4.0bpw") and not api.file_exists(repo, "sub/notes.txt")
    assert api.repo_exists(repo) and not api.repo_exists("alice/nope") and not api.revision_exists(repo, "nope")
    assert [m.id for m in api.list_models(author="alice")] == [repo]
    assert "safetensors" not in next(iter(api.list_models(author="alice"))).tags  # main has no weights


def test_stale_parent_commit_is_refused(hub, api):
    hub.add_repo("alice/m", {"a.txt": b"a"})
    parent = api.model_info("alice/m").sha
    first = api.create_commit(
        "alice/m", operations=[CommitOperationAdd("b.txt", b"b")], commit_message="first", parent_commit=parent
    )
    with pytest.raises(HfHubHTTPError) as exc:  # plain HfHubHTTPError (no subclass), status 412, the Hub's message
        api.create_commit(
            "alice/m", operations=[CommitOperationAdd("c.txt", b"c")], commit_message="second", parent_commit=parent
        )
    assert type(exc.value) is HfHubHTTPError and exc.value.response.status_code == 412
    assert "A commit has happened since" in str(exc.value)
    assert hub.head("alice/m") == first.oid and "c.txt" not in hub.files("alice/m")


def test_auth_errors(hub, api):
    hub.add_repo("alice/m", {"a.txt": b"a"})
    ops = [CommitOperationAdd("model.safetensors", weights(1000))]
    with pytest.raises(HfHubHTTPError) as exc:  # read-only token
        HfApi(token=ALICE_READ).create_commit("alice/m", operations=ops, commit_message="x")
    assert type(exc.value) is HfHubHTTPError and exc.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as exc:  # someone else's repo
        HfApi(token=BOB).create_commit("alice/m", operations=ops, commit_message="x")
    assert exc.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as exc:  # unknown token: 401, on reads as well
        HfApi(token="hf_wrong").create_commit("alice/m", operations=ops, commit_message="x")
    assert type(exc.value) is HfHubHTTPError and exc.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as exc:
        hf_hub_download("alice/m", "a.txt", token="hf_wrong")
    assert exc.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as exc:  # no token at all
        HfApi(token=False).create_branch("alice/m", branch="x")
    assert exc.value.response.status_code == 401
    assert hub.count("PUT", "") == 0 and list(hub.files("alice/m")) == [".gitattributes", "a.txt"]


def test_gated_private_missing_repo_and_revision(hub, api, tmp_path):
    hub.add_repo("meta/llama", {"model.safetensors": weights(1000), "config.json": b"{}"})
    hub.set_gated("meta/llama", allowed=("alice",))
    with pytest.raises(GatedRepoError):  # a token without access: 403 + X-Error-Code GatedRepo
        hf_hub_download("meta/llama", "config.json", token=BOB)
    with pytest.raises(GatedRepoError):  # no token: 401 + GatedRepo
        hf_hub_download("meta/llama", "config.json", token=False)
    with pytest.raises(GatedRepoError):
        snapshot_download("meta/llama", token=BOB, local_dir=tmp_path / "s")
    assert HfApi(token=BOB).model_info("meta/llama").gated == "manual"  # metadata stays readable
    assert Path(hf_hub_download("meta/llama", "config.json", token=ALICE)).read_bytes() == b"{}"

    api.create_repo("alice/secret", private=True)
    for call in (
        lambda: HfApi(token=BOB).model_info("alice/secret"),
        lambda: hf_hub_download("alice/secret", ".gitattributes", token=BOB),
        lambda: api.model_info("alice/missing"),
        lambda: hf_hub_download("alice/missing", "a.txt"),
        lambda: snapshot_download("alice/missing", local_dir=tmp_path / "m"),
    ):
        with pytest.raises(RepositoryNotFoundError):
            call()
    assert api.model_info("alice/secret").private is True

    for call in (
        lambda: api.model_info("meta/llama", revision="nope"),
        lambda: hf_hub_download("meta/llama", "config.json", revision="nope", token=ALICE),
        lambda: snapshot_download("meta/llama", revision="nope", token=ALICE, local_dir=tmp_path / "r"),
        lambda: api.create_commit(
            "alice/secret", revision="nope", commit_message="x", operations=[CommitOperationAdd("b.txt", b"b")]
        ),
    ):
        with pytest.raises(RevisionNotFoundError):
            call()
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("meta/llama", "missing.json", token=ALICE)


def test_one_500_on_the_lfs_put_is_retried_by_the_client(hub, api):
    hub.add_repo("alice/m", {})
    hub.fail("PUT", r"^/_lfs/", 500)
    started = time.monotonic()
    info = api.create_commit(
        "alice/m", operations=[CommitOperationAdd("model.safetensors", weights())], commit_message="w"
    )
    assert hub.count("PUT", r"^/_lfs/") == 2  # http_backoff retried the PUT itself, after ~1 s
    assert time.monotonic() - started >= 1 and hub.files("alice/m", info.oid)["model.safetensors"] == weights()


def test_a_put_that_keeps_failing_raises_after_the_clients_five_retries(hub, api, monkeypatch):
    import huggingface_hub.utils._http as http

    monkeypatch.setattr(http.time, "sleep", lambda seconds: None)  # skip the 1+2+4+8+8 s of backoff
    hub.add_repo("alice/m", {})
    hub.fail("PUT", r"^/_lfs/", 500, times=6)
    with pytest.raises(RuntimeError, match="Error while uploading 'model.safetensors'") as exc:
        api.create_commit(
            "alice/m", operations=[CommitOperationAdd("model.safetensors", weights())], commit_message="w"
        )
    assert type(exc.value.__cause__) is HfHubHTTPError and exc.value.__cause__.response.status_code == 500
    assert hub.count("PUT", r"^/_lfs/") == 6 and hub.count("POST", "/commit/") == 0


def test_failed_commit_is_rerun_without_reuploading_finished_objects(hub, api):
    hub.add_repo("alice/m", {})
    a, b = weights(seed=1), weights(seed=2)

    def ops():  # fresh operations each time, as a rerun in a new process would build them
        return [CommitOperationAdd("model-00001.safetensors", a), CommitOperationAdd("model-00002.safetensors", b)]

    hub.fail("PUT", sha256(b), 403)  # a status the client does not retry: b fails, a goes up
    with pytest.raises(RuntimeError, match="model-00002.safetensors") as exc:
        api.create_commit("alice/m", operations=ops(), commit_message="w")
    assert exc.value.__cause__.response.status_code == 403
    assert hub.count("PUT", sha256(a)) == 1 and hub.count("PUT", sha256(b)) == 1

    hub.fail("POST", r"/commit/main$", 500)  # the commit POST is not retried by the client either
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_commit("alice/m", operations=ops(), commit_message="w")
    assert exc.value.response.status_code == 500
    assert hub.count("PUT", sha256(a)) == 1 and hub.count("PUT", sha256(b)) == 2  # only b was uploaded again

    info = api.create_commit("alice/m", operations=ops(), commit_message="w")
    assert hub.count("PUT", "") == 3  # nothing uploaded by the successful run: both objects were already stored
    assert hub.files("alice/m", info.oid)["model-00002.safetensors"] == b


def test_429_with_retry_after(hub, api):
    hub.add_repo("alice/m", {})
    hub.fail("POST", r"/preupload/", 429, headers={"Retry-After": "0"})
    api.create_commit("alice/m", operations=[CommitOperationAdd("a.txt", b"a")], commit_message="a")
    assert hub.count("POST", r"/preupload/") == 2  # retried after Retry-After + 1 s
    hub.fail("POST", r"/commit/", 429, headers={"Retry-After": "0"})
    with pytest.raises(HfHubHTTPError) as exc:  # ... but a 429 on the commit POST itself is raised
        api.create_commit("alice/m", operations=[CommitOperationAdd("b.txt", b"b")], commit_message="b")
    assert exc.value.response.status_code == 429 and exc.value.response.headers["Retry-After"] == "0"


def test_a_500_on_the_metadata_head_is_retried_when_nothing_is_cached(hub):
    hub.add_repo("alice/m", {"a.txt": b"a"})
    hub.fail("HEAD", r"/resolve/", 500)
    assert Path(hf_hub_download("alice/m", "a.txt")).read_bytes() == b"a"
    assert hub.count("HEAD", r"/resolve/") == 2 and hub.count("GET", r"/resolve/") == 1


def test_corrupted_blob_is_served_with_wrong_bytes(hub, api):
    blob = weights(4096)
    sha = hub.add_repo("alice/m", {"model.safetensors": blob, "config.json": b'{"a": 1}'})
    hub.corrupt("alice/m", "model.safetensors")
    hub.corrupt("alice/m", "config.json")
    expected = next(s for s in api.model_info("alice/m", files_metadata=True).siblings if s.lfs).lfs.sha256
    got = Path(hf_hub_download("alice/m", "model.safetensors", revision=sha)).read_bytes()
    assert expected == sha256(blob) and len(got) == len(blob) and sha256(got) != expected
    assert Path(hf_hub_download("alice/m", "config.json", revision=sha)).read_bytes() != b'{"a": 1}'


def test_upstream_releases_appear_between_ticks(hub, api, tmp_path):
    assert list(api.list_models(author="org")) == []
    first = hub.add_repo("org/base", {"config.json": b"{}", "model.safetensors": weights(1000)})
    assert [m.id for m in api.list_models(author="org")] == ["org/base"]
    second = hub.add_repo("org/base", {"model.safetensors": weights(1000, seed=9)}, message="v2")
    assert api.model_info("org/base").sha == second != first
    assert api.list_repo_commits("org/base")[0].title == "v2"
    old = Path(hf_hub_download("org/base", "model.safetensors", revision=first)).read_bytes()
    new = Path(hf_hub_download("org/base", "model.safetensors", revision=second)).read_bytes()
    assert (old, new) == (weights(1000), weights(1000, seed=9))
    assert hub.add_repo("org/base", {"x.bin": b"\0"}, branch="dev") == hub.head("org/base", "dev")
    assert sorted(hub.files("org/base", "dev")) == [".gitattributes", "config.json", "model.safetensors", "x.bin"]


def test_environment_is_isolated_and_nothing_offers_xet(hub):
    from huggingface_hub import constants, get_session, hf_hub_url

    assert os.environ["HF_ENDPOINT"] == constants.ENDPOINT == hub.url
    assert constants.HF_HUB_DISABLE_XET and "HF_TOKEN" not in os.environ
    hub.add_repo("alice/m", {"model.safetensors": weights(1000)})
    response = get_session().head(hf_hub_url("alice/m", "model.safetensors"))
    assert response.status_code == 200 and response.headers["x-linked-size"] == "1000"
    assert not [name for name in response.headers if name.lower().startswith("x-xet")] and not response.links
    part = get_session().get(hf_hub_url("alice/m", "model.safetensors"), headers={"range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == weights(1000)[10:20]


def test_a_fresh_process_finds_the_hub_from_the_environment_alone(hub):
    """Workers run jobs in processes of their own: the fixture's environment variables are enough there (no xet
    either)."""
    script = (
        "from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download\n"
        "api = HfApi(token='hf_alice_write')\n"
        "api.create_repo('alice/sub')\n"
        "sha = api.create_commit('alice/sub', [CommitOperationAdd('w.safetensors', b'\\0' * 3000)], "
        "commit_message='w').oid\n"
        "print(len(open(hf_hub_download('alice/sub', 'w.safetensors', revision=sha), 'rb').read()))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3000" and hub.count("PUT", r"^/_lfs/alice/sub/") == 1
