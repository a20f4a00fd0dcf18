"""An in-memory stand-in for the Hugging Face Hub HTTP API, for tests (stdlib, plus PyYAML to read model cards).

It speaks what the installed `huggingface_hub` client uses: whoami, repo creation, branches and tags, model info and
listing, tree and commit listing, commits (preupload, LFS batch with the "basic" transfer, PUT, verify, NDJSON commit)
and `/resolve` downloads, answered directly (no CDN redirect). It never offers xet (no xet transfer, no X-Xet-*
headers); the client itself picks xet whenever `hf_xet` is importable unless HF_HUB_DISABLE_XET is set, which the `hub`
fixture (tests/conftest.py) does.

State: repos -> branches/tags -> commit sha -> tree {path: Entry}; bytes live in Repo.blobs by oid (sha256 for LFS
files, git blob sha1 for regular ones), so `corrupt` changes bytes while the metadata keeps the right hashes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

# token -> (username, can_write)
TOKENS = {"hf_alice_write": ("alice", True), "hf_alice_read": ("alice", False), "hf_bob_write": ("bob", True)}

# Suffixes the Hub's default .gitattributes sends to LFS; binary samples and files of 10 MiB or more go there too.
LFS_SUFFIXES = (
    ".7z",
    ".arrow",
    ".bin",
    ".bz2",
    ".ckpt",
    ".ftz",
    ".gguf",
    ".gz",
    ".h5",
    ".joblib",
    ".mlmodel",
    ".model",
    ".msgpack",
    ".npy",
    ".npz",
    ".onnx",
    ".ot",
    ".parquet",
    ".pb",
    ".pickle",
    ".pkl",
    ".pt",
    ".pth",
    ".rar",
    ".safetensors",
    ".tar",
    ".tflite",
    ".tgz",
    ".wasm",
    ".xz",
    ".zip",
    ".zst",
)
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()
STALE_PARENT = "A commit has happened since. Please refresh and try again."


def is_lfs(path: str, size: int, sample: bytes = b"") -> bool:
    return size >= 10 * 2**20 or path.endswith(LFS_SUFFIXES) or b"\0" in sample


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


class HubError(Exception):
    """An error answer: JSON {"error": message}, X-Error-Message and (when given) X-Error-Code."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None, **extra):
        super().__init__(message)
        self.status, self.body, self.headers = status, {"error": message, **extra}, dict(headers or {})
        self.headers["X-Error-Message"] = message
        if code:
            self.headers["X-Error-Code"] = code


@dataclass
class Entry:
    oid: str  # sha256 for LFS files, git blob sha1 for regular ones; the bytes are Repo.blobs[oid]
    size: int
    lfs: bool

    def blob_id(self) -> str:
        return git_sha1(lfs_pointer(self.oid, self.size)) if self.lfs else self.oid

    def lfs_info(self, key: str) -> dict:
        return {key: self.oid, "size": self.size, "pointerSize": len(lfs_pointer(self.oid, self.size))}


@dataclass
class Commit:
    sha: str
    parent: str | None
    tree: dict[str, Entry]
    title: str
    message: str
    author: str
    date: str = field(default_factory=_now)


@dataclass
class Repo:
    id: str
    private: bool = False
    gated: bool = False
    allowed: set[str] = field(default_factory=set)  # users (besides the namespace) who may download a gated repo
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    blobs: dict[str, bytearray] = field(default_factory=dict)
    created: str = field(default_factory=_now)


@dataclass
class Request:
    method: str
    query: dict[str, list[str]]
    headers: Message  # case-insensitive .get
    body: bytes
    user: tuple[str, bool] | None

    def arg(self, name: str, default: str | None = None) -> str | None:
        return self.query.get(name, [default])[0]

    def flag(self, name: str) -> bool:
        return (self.arg(name) or "").lower() in ("1", "true")

    def json(self):
        return json.loads(self.body or b"{}")


@dataclass
class Failure:
    method: str
    pattern: re.Pattern
    status: int
    times: int
    headers: dict
    body: bytes | None = None  # the answer's body as it is, instead of an error's JSON


R = r"(?P<repo_id>[^/]+/[^/]+)"
ROUTES = [  # (methods, path regex on the raw path, handler name); groups are unquoted before the call
    ("GET", r"/api/whoami-v2", "whoami"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("POST", r"/api/repos/create", "create_repo"),
    ("GET", r"/api/models", "list_models"),
    ("GET", rf"/api/models/{R}(?:/revision/(?P<rev>[^/]+))?", "model_info"),
    ("GET", rf"/api/models/{R}/refs", "refs"),
    ("GET", rf"/api/models/{R}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", "tree"),
    ("GET", rf"/api/models/{R}/commits/(?P<rev>[^/]+)", "commits"),
    ("POST DELETE", rf"/api/models/{R}/branch/(?P<name>[^/]+)", "branch"),
    ("POST DELETE", rf"/api/models/{R}/tag/(?P<name>[^/]+)", "tag"),
    ("POST", rf"/api/models/{R}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{R}/commit/(?P<rev>[^/]+)", "commit_post"),
    ("POST", rf"/{R}\.git/info/lfs/objects/batch", "lfs_batch"),
    ("POST", rf"/{R}\.git/info/lfs/objects/verify", "lfs_verify"),
    ("PUT", rf"/_lfs/{R}/(?P<oid>[0-9a-f]{{64}})", "lfs_put"),
    ("GET HEAD", rf"/{R}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]


class HubServer:
    """`HubServer(TOKENS).start()`; `.url` is the HF_ENDPOINT to use; `.stop()` when done."""

    def __init__(self, tokens: dict[str, tuple[str, bool]] | None = None, orgs: dict[str, set[str]] | None = None):
        self.tokens = dict(TOKENS if tokens is None else tokens)
        self.orgs = {org: set(members) for org, members in (orgs or {}).items()}  # org -> members who may write
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, unquoted path) of every request, in order
        self.failures: list[Failure] = []
        self.lock = threading.RLock()
        self.conns: set[socket.socket] = set()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.hub = self
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.routes = [(methods.split(), re.compile(rx), getattr(self, "_" + name)) for methods, rx, name in ROUTES]

    def start(self) -> HubServer:
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True, name="hub-server").start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        for conn in list(self.conns):  # idle keep-alive connections would keep their handler threads waiting
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.httpd.server_close()

    # ---- test hooks ----

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        branch: str = "main",
        *,
        message: str = "Upstream release",
        private: bool = False,
    ) -> str:
        """Commit `files` (added/overwritten on top of the branch head) straight into the store, creating the repo and
        the branch (from main) as needed, as an upstream release would appear; returns the new commit sha."""
        with self.lock:
            repo = self.repos.get(repo_id) or self._create(repo_id, private=private)
            head = repo.branches.setdefault(branch, repo.branches["main"])
            tree = dict(repo.commits[head].tree)
            for path, data in files.items():
                tree[path] = self._store(repo, data, is_lfs(path, len(data), data[:512]))
            return self._new_commit(repo, branch, tree, message, "", repo_id.split("/")[0]).sha

    def fail(
        self,
        method: str,
        path_regex: str,
        status: int,
        times: int = 1,
        headers: dict | None = None,
        body: bytes | None = None,
    ) -> None:
        """Answer the next `times` requests whose method is `method` ("*": any) and whose unquoted path matches
        `path_regex` (re.search) with `status`, e.g. fail("PUT", r"^/_lfs/", 500) or fail("POST", "/preupload/", 429,
        headers={"Retry-After": "0"}); with `body`, the answer is those bytes (a hostile Hub's JSON)."""
        with self.lock:
            self.failures.append(
                Failure(method.upper(), re.compile(path_regex), status, times, dict(headers or {}), body)
            )

    def corrupt(self, repo_id: str, path: str, revision: str = "main") -> None:
        """Flip the stored bytes of a file (same length) so downloads get wrong content; metadata is left alone."""
        with self.lock:
            repo = self.repos[repo_id]
            blob = repo.blobs[self._rev(repo, revision).tree[path].oid]
            blob[:] = bytes(b ^ 0xFF for b in blob) if blob else b"!"

    def set_gated(self, repo_id: str, allowed: tuple[str, ...] = ()) -> None:
        """Gate a repo: only its namespace's users and `allowed` may download files (metadata stays readable)."""
        with self.lock:
            self.repos[repo_id].gated, self.repos[repo_id].allowed = True, set(allowed)

    def count(self, method: str, path_regex: str) -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m == method.upper() and re.search(path_regex, p))

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The files of a repo at a revision, as stored."""
        with self.lock:
            repo = self.repos[repo_id]
            return {p: bytes(repo.blobs[e.oid]) for p, e in self._rev(repo, revision).tree.items()}

    def head(self, repo_id: str, branch: str = "main") -> str:
        with self.lock:
            return self.repos[repo_id].branches[branch]

    # ---- store ----

    def _create(self, repo_id: str, private: bool = False) -> Repo:
        repo = self.repos[repo_id] = Repo(repo_id, private=private)
        tree = {".gitattributes": self._store(repo, GITATTRIBUTES, False)}
        self._new_commit(repo, "main", tree, "initial commit", "", repo_id.split("/")[0], parent=None)
        return repo

    def _store(self, repo: Repo, data: bytes, lfs: bool) -> Entry:
        oid = hashlib.sha256(data).hexdigest() if lfs else git_sha1(data)
        repo.blobs[oid] = bytearray(data)
        return Entry(oid, len(data), lfs)

    def _new_commit(
        self,
        repo: Repo,
        branch: str,
        tree: dict[str, Entry],
        title: str,
        message: str,
        author: str,
        parent: str | None = "head",
    ) -> Commit:
        parent = repo.branches.get(branch) if parent == "head" else parent
        key = json.dumps([parent, title, message, sorted((p, e.oid) for p, e in tree.items())])
        commit = Commit(hashlib.sha1(key.encode()).hexdigest(), parent, tree, title, message, author)
        repo.commits[commit.sha] = commit
        repo.branches[branch] = commit.sha
        return commit

    def _rev(self, repo: Repo, rev: str) -> Commit:
        sha = repo.branches.get(rev) or repo.tags.get(rev) or (rev if rev in repo.commits else None)
        if sha is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return repo.commits[sha]

    # ---- access ----

    def _member(self, user: str | None, namespace: str) -> bool:
        return user is not None and (user == namespace or user in self.orgs.get(namespace, ()))

    def _check_write(self, req: Request, namespace: str) -> str:
        if req.user is None:
            raise HubError(401, "You must be authenticated to do this (no token)")
        name, can_write = req.user
        if not can_write:
            raise HubError(403, "This is a read-only token: it cannot write")
        if not self._member(name, namespace):
            raise HubError(403, f"You don't have the rights to write in the namespace {namespace}")
        return name

    def _repo(self, req: Request, repo_id: str, write: bool = False, files: bool = False) -> Repo:
        repo, user = self.repos.get(repo_id), req.user[0] if req.user else None
        namespace = repo_id.split("/")[0]
        if repo is None or (repo.private and not self._member(user, namespace)):
            raise HubError(404, "Repository not found", "RepoNotFound")
        if write:
            self._check_write(req, namespace)
        if files and repo.gated and not (self._member(user, namespace) or user in repo.allowed):
            message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
            raise HubError(401 if user is None else 403, message, "GatedRepo")
        return repo

    # ---- HTTP plumbing ----

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        split = urlsplit(h.path)
        path = unquote(split.path)
        if "chunked" in h.headers.get("Transfer-Encoding", ""):  # not needed by the client: refuse, don't misread
            h.close_connection = True
            return h.send_error(411)
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))  # the client always sends a Content-Length
        status, payload, headers = 200, {}, {}
        with self.lock:
            self.requests.append((h.command, path))
            failure = next((f for f in self.failures if f.method in ("*", h.command) and f.pattern.search(path)), None)
            if failure is not None:
                failure.times -= 1
                if failure.times <= 0:
                    self.failures.remove(failure)
                status, payload = failure.status, {"error": f"injected failure ({failure.status})"}
                headers = {"X-Error-Message": payload["error"], **failure.headers}
                if failure.body is not None:
                    payload, headers = failure.body, {"Content-Type": "application/json", **failure.headers}
            else:
                try:
                    status, payload, headers = self._dispatch(h, split, body)
                except HubError as e:
                    status, payload, headers = e.status, e.body, e.headers
        data = json.dumps(payload).encode() if isinstance(payload, (dict, list)) else payload
        if isinstance(payload, (dict, list)):
            headers.setdefault("Content-Type", "application/json")
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, str(value))
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _dispatch(self, h: BaseHTTPRequestHandler, split, body: bytes):
        token = h.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if token and token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        req = Request(h.command, parse_qs(split.query), h.headers, body, self.tokens.get(token))
        for methods, rx, fn in self.routes:
            m = rx.fullmatch(split.path)
            if m and h.command in methods:
                out = fn(req, **{k: unquote(v) for k, v in m.groupdict().items() if v is not None})
                return out if isinstance(out, tuple) else (200, out, {})
        raise HubError(404, f"No route for {h.command} {split.path} in the test hub")

    # ---- endpoints ----

    def _whoami(self, req: Request):
        if req.user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        name, can_write = req.user
        role = "write" if can_write else "read"
        orgs = [{"type": "org", "name": org} for org, members in self.orgs.items() if name in members]
        return {
            "type": "user",
            "id": name,
            "name": name,
            "fullname": name,
            "email": f"{name}@example.com",
            "emailVerified": True,
            "isPro": False,
            "orgs": orgs,
            "auth": {"type": "access_token", "accessToken": {"displayName": f"{name}-{role}", "role": role}},
        }

    def _validate_yaml(self, req: Request):
        return {"errors": [], "warnings": []}

    def _create_repo(self, req: Request):
        body = req.json()
        if body.get("type", "model") != "model":
            raise HubError(400, "This test hub only has model repos")
        namespace = body.get("organization") or (req.user[0] if req.user else "")
        self._check_write(req, namespace)
        repo_id = f"{namespace}/{body['name']}"
        if repo_id in self.repos:
            # the client reads "url" from this 409 too (create_repo(exist_ok=True))
            raise HubError(409, "You already created this model repo", url=f"{self.url}/{repo_id}")
        self._create(repo_id, private=body.get("visibility") == "private" or body.get("private") is True)
        return {"url": f"{self.url}/{repo_id}", "name": repo_id, "id": repo_id}

    def _info(self, repo: Repo, commit: Commit, siblings: bool = True, blobs: bool = False) -> dict:
        card = self._card(repo, commit)
        info = {
            "id": repo.id,
            "modelId": repo.id,
            "author": repo.id.split("/")[0],
            "sha": commit.sha,
            "lastModified": commit.date,
            "createdAt": repo.created,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": _tags(card, commit),
            "library_name": card.get("library_name"),
            "cardData": card or None,
        }
        if siblings:
            info["siblings"] = [
                {
                    "rfilename": p,
                    **({"size": e.size, "blobId": e.blob_id()} if blobs else {}),
                    **({"lfs": e.lfs_info("sha256")} if blobs and e.lfs else {}),
                }
                for p, e in sorted(commit.tree.items())
            ]
        return info

    def _card(self, repo: Repo, commit: Commit) -> dict:
        entry = commit.tree.get("README.md")
        text = bytes(repo.blobs[entry.oid]).decode(errors="replace") if entry else ""
        m = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
        try:
            card = yaml.safe_load(m.group(1)) if m else None
        except yaml.YAMLError:
            card = None
        return card if isinstance(card, dict) else {}

    def _model_info(self, req: Request, repo_id: str, rev: str = "main"):
        repo = self._repo(req, repo_id)
        return self._info(repo, self._rev(repo, rev), blobs=req.flag("blobs"))

    def _list_models(self, req: Request):
        author, search, user = req.arg("author"), req.arg("search"), req.user[0] if req.user else None
        wanted = set(req.query.get("filter", []))
        out = []
        for repo_id, repo in sorted(self.repos.items()):
            info = self._info(repo, repo.commits[repo.branches["main"]], siblings=req.flag("full"))
            if (repo.private and not self._member(user, info["author"])) or (author and info["author"] != author):
                continue
            if (search and search.lower() not in repo_id.lower()) or not wanted <= set(info["tags"]):
                continue
            out.append(info)
        return out[: int(req.arg("limit") or len(out))]

    def _refs(self, req: Request, repo_id: str):
        repo = self._repo(req, repo_id)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s} for b, s in repo.branches.items()]
        tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": s} for t, s in repo.tags.items()]
        return {"branches": branches, "converts": [], "tags": tags, "pullRequests": []}

    def _tree(self, req: Request, repo_id: str, rev: str, path: str = ""):
        repo = self._repo(req, repo_id)
        commit, recursive = self._rev(repo, rev), req.flag("recursive")
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        files = {p: e for p, e in commit.tree.items() if p.startswith(prefix)}
        if prefix and not files:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        out, dirs = [], set()
        for p, e in sorted(files.items()):
            parts = p[len(prefix) :].split("/")
            dirs.update(prefix + "/".join(parts[:i]) for i in range(1, len(parts)) if recursive or i == 1)
            if recursive or len(parts) == 1:
                out.append(
                    {
                        "type": "file",
                        "oid": e.blob_id(),
                        "size": e.size,
                        "path": p,
                        **({"lfs": e.lfs_info("oid")} if e.lfs else {}),
                    }
                )
        return [{"type": "directory", "oid": git_sha1(d.encode()), "size": 0, "path": d} for d in sorted(dirs)] + out

    def _commits(self, req: Request, repo_id: str, rev: str):
        repo = self._repo(req, repo_id)
        commit, out = self._rev(repo, rev), []
        while commit is not None:
            out.append(
                {
                    "id": commit.sha,
                    "title": commit.title,
                    "message": commit.message,
                    "date": commit.date,
                    "authors": [{"user": commit.author}],
                }
            )
            commit = repo.commits.get(commit.parent) if commit.parent else None
        return out

    def _branch(self, req: Request, repo_id: str, name: str):
        repo = self._repo(req, repo_id, write=True)
        if req.method == "DELETE":
            if name not in repo.branches:
                raise HubError(404, f"Branch {name} not found", "RevisionNotFound")
            if name == "main":
                raise HubError(403, "Cannot delete the main branch")
            del repo.branches[name]
            return {}
        if name in repo.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{name}")
        repo.branches[name] = self._rev(repo, req.json().get("startingPoint") or "main").sha
        return {}

    def _tag(self, req: Request, repo_id: str, name: str):
        repo = self._repo(req, repo_id, write=True)
        if req.method == "DELETE":
            if repo.tags.pop(name, None) is None:
                raise HubError(404, f"Tag {name} not found", "RevisionNotFound")
            return {}
        tag = req.json()["tag"]  # POST .../tag/{revision} {"tag": ...}
        if tag in repo.tags:
            raise HubError(409, f"Reference already exists: refs/tags/{tag}")
        repo.tags[tag] = self._rev(repo, name).sha
        return {}

    def _preupload(self, req: Request, repo_id: str, rev: str):
        repo = self._repo(req, repo_id, write=True)
        if req.flag("create_pr"):
            raise HubError(400, "Pull requests are not supported by this test hub")
        commit, files = self._rev(repo, rev), []
        for f in req.json()["files"]:
            lfs = is_lfs(f["path"], f["size"], base64.b64decode(f.get("sample") or ""))
            old = commit.tree.get(f["path"])
            files.append(
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": old.oid if old is not None and old.lfs == lfs else None,
                }
            )
        return {"files": files, "commitOid": commit.sha}

    def _lfs_batch(self, req: Request, repo_id: str):
        repo = self._repo(req, repo_id, write=True)
        body = req.json()
        if body.get("operation") != "upload" or "basic" not in body.get("transfers", ["basic"]):
            raise HubError(400, "This test hub only does LFS uploads with the basic transfer")
        objects = []
        for obj in body["objects"]:
            oid, size = obj["oid"], obj["size"]
            if oid in repo.blobs:  # already stored: no actions, the client skips the upload
                objects.append({"oid": oid, "size": size})
                continue
            actions = {
                "upload": {"href": f"{self.url}/_lfs/{repo_id}/{oid}?size={size}"},
                "verify": {"href": f"{self.url}/{repo_id}.git/info/lfs/objects/verify"},
            }
            objects.append({"oid": oid, "size": size, "authenticated": True, "actions": actions})
        return (
            200,
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            {"Content-Type": "application/vnd.git-lfs+json"},
        )

    def _lfs_put(self, req: Request, repo_id: str, oid: str):
        """The PUT to the upload href (unauthenticated, as to a presigned S3 URL)."""
        if repo_id not in self.repos:
            raise HubError(404, "Repository not found", "RepoNotFound")
        if hashlib.sha256(req.body).hexdigest() != oid or str(len(req.body)) != req.arg("size"):
            raise HubError(400, f"Uploaded content does not match oid {oid} / size {req.arg('size')}")
        self.repos[repo_id].blobs[oid] = bytearray(req.body)
        return 200, b"", {"ETag": f'"{oid}"'}

    def _lfs_verify(self, req: Request, repo_id: str):
        repo = self._repo(req, repo_id, write=True)
        body = req.json()
        if body["oid"] not in repo.blobs or len(repo.blobs[body["oid"]]) != body["size"]:
            raise HubError(404, f"LFS object {body['oid']} not found")
        return {}

    def _commit_post(self, req: Request, repo_id: str, rev: str):
        """NDJSON: a header {summary, description, parentCommit?}, then file / lfsFile / deletedFile / deletedFolder
        lines. Atomic: the branch moves only when every line applies and the parent is still the head."""
        repo = self._repo(req, repo_id, write=True)
        if req.flag("create_pr"):
            raise HubError(400, "Pull requests are not supported by this test hub")
        if rev not in repo.branches:
            raise HubError(404, f"Invalid rev id: {rev} (commits go to branches)", "RevisionNotFound")
        lines = [json.loads(line) for line in req.body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        head, parent = repo.branches[rev], header.get("parentCommit")
        if parent and not head.startswith(parent.lower()):
            raise HubError(412, STALE_PARENT)
        tree = dict(repo.commits[head].tree)
        for line in lines:
            key, value = line["key"], line["value"]
            path = value.get("path", "")
            if key == "file":
                content = value["content"]
                data = base64.b64decode(content) if value.get("encoding") == "base64" else content.encode()
                tree[path] = self._store(repo, data, False)
            elif key == "lfsFile":
                blob = repo.blobs.get(value["oid"])
                if blob is None or value.get("size", len(blob)) != len(blob):
                    raise HubError(400, f"Your push was rejected: LFS object {value['oid']} ({path}) was not uploaded")
                tree[path] = Entry(value["oid"], len(blob), True)
            elif key in ("deletedFile", "deletedFolder"):
                folder = path.rstrip("/") + "/" if key == "deletedFolder" else None
                gone = [p for p in tree if p == path or (folder and p.startswith(folder))]
                if not gone:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                for p in gone:
                    del tree[p]
        commit = self._new_commit(repo, rev, tree, header["summary"], header.get("description", ""), req.user[0])
        return {
            "success": True,
            "commitOid": commit.sha,
            "commitUrl": f"{self.url}/{repo_id}/commit/{commit.sha}",
            "commitMessage": commit.title,
            "hookOutput": "",
            "pullRequestUrl": None,
        }

    def _resolve(self, req: Request, repo_id: str, rev: str, path: str):
        """A direct 200 (no redirect to a CDN) with the headers file_download.py reads; honours a simple Range."""
        repo = self._repo(req, repo_id, files=True)
        commit = self._rev(repo, rev)
        headers = {"X-Repo-Commit": commit.sha, "Accept-Ranges": "bytes"}
        entry = commit.tree.get(path)
        if entry is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", headers)
        data = bytes(repo.blobs[entry.oid])
        headers["ETag"] = f'"{entry.oid}"'  # sha256 for LFS files, git blob sha1 for regular ones
        if entry.lfs:
            headers.update({"X-Linked-Etag": f'"{entry.oid}"', "X-Linked-Size": str(entry.size)})
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", req.headers.get("Range", "").strip())
        if m and (m[1] or m[2]):
            start, end = (int(m[1]), int(m[2] or len(data) - 1)) if m[1] else (len(data) - int(m[2]), len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{min(end, len(data) - 1)}/{len(data)}"
            return 206, data[start : end + 1], headers
        return 200, data, {"Content-Type": "application/octet-stream", **headers}


def _tags(card: dict, commit: Commit) -> list[str]:
    """Tags the Hub derives from the model card (and the files), roughly."""

    def as_list(value) -> list:
        return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]

    tags = [str(t) for t in as_list(card.get("tags"))] + [str(x) for x in as_list(card.get("library_name"))]
    if any(p.endswith(".safetensors") for p in commit.tree):
        tags.append("safetensors")
    tags += [f"license:{x}" for x in as_list(card.get("license"))]
    relation = card.get("base_model_relation")
    for base in as_list(card.get("base_model")):
        tags += [f"base_model:{base}"] + ([f"base_model:{relation}:{base}"] if relation else [])
    return list(dict.fromkeys(tags))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's pooled connections expect

    def setup(self):
        super().setup()
        self.server.hub.conns.add(self.connection)

    def finish(self):
        self.server.hub.conns.discard(self.connection)
        super().finish()

    def do_GET(self):
        self.server.hub._handle(self)

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def log_message(self, format, *args):
        pass
