"""`qf pull` trusts nothing a server says: a hostile factory service (a stdlib HTTP server in a thread of the test)
answers the real CLI in a subprocess with climbing revisions, absolute and `..` file names, names no quant carries,
size and sha256 lies, JSON nested 100k deep, short Content-Lengths and endless bodies. Each pull exits 1 with one
sentence naming the server, writes nothing outside its staging folder and `-o`, and leaves the victim file where the
attack points untouched. Another local user who prepares the staging folder where a pull would make it (a second
uid) changes nothing of root's. And a local pull copies the registry's files, never hard-links them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from factory.publish import folder
from factory.service.client import MAX_ANSWER
from tests.support import ROOT, hostile_user
from tests.support.service import user_env

MODEL, TAG, REV = "tiny", "awq-w4g128", "1234567"
CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 128}).encode()
WEIGHTS = bytes(range(256)) * 256  # 64 KiB
ENDLESS = 256 << 20  # what an "endless" body sends at most: a client that does not stop cannot fill the disk
VICTIM = b"mine, not the server's"


def _entry(data: bytes, **lie) -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), **lie}


@dataclass
class Answer:
    """What the hostile server says for one scenario: the quant's fields, its manifest's files, and how it sends
    each file (the bytes, the Content-Length it claims (None: none, the body ends when the connection closes),
    and whether the body never ends)."""

    quant: dict = field(default_factory=dict)
    files: dict = field(default_factory=lambda: {"config.json": _entry(CONFIG), "model.safetensors": _entry(WEIGHTS)})
    bodies: dict = field(default_factory=lambda: {"config.json": CONFIG, "model.safetensors": WEIGHTS})
    content_length: dict = field(default_factory=dict)
    endless: str | None = None  # "file" or "manifest": that answer's body never ends
    raw: bytes | None = None  # the manifest's answer as these bytes, whatever they are


def _answers(case: Path) -> dict[str, Answer]:
    victim = str(case / "victim" / "config.json")
    return {
        # the staging folder `.qf-pull-out-<rev>` beside -o would climb to <case>/victim
        "climbing-rev": Answer(quant={"rev": f"{REV}/../../victim"}),
        "absolute-name": Answer(files={victim: _entry(b"")}),
        "dotdot-name": Answer(files={"../../victim/config.json": _entry(b"")}),
        "name-off-the-list": Answer(files={"install.sh": _entry(b"")}),
        "hidden-name": Answer(files={".bashrc": _entry(b"")}),
        "another-quant": Answer(quant={"tag": "awq-w4g64", "name": f"{MODEL}:awq-w4g64"}),
        "negative-size": Answer(files={"config.json": _entry(CONFIG, bytes=-1)}),
        "sha256-not-hex": Answer(files={"config.json": _entry(CONFIG, sha256="../" * 21 + "x")}),
        # the manifest's first 1000 bytes and their sha256: a client that keeps the whole body is fooled later
        "size-lie": Answer(files={"model.safetensors": _entry(WEIGHTS[:1000])}),
        "sha256-lie": Answer(files={"model.safetensors": _entry(WEIGHTS, sha256=hashlib.sha256(b"x").hexdigest())}),
        "content-length-short": Answer(content_length={"model.safetensors": len(WEIGHTS) // 2}),
        "body-short": Answer(bodies={"config.json": CONFIG, "model.safetensors": WEIGHTS[:1000]}),
        "endless-body": Answer(endless="file"),
        "endless-manifest": Answer(endless="manifest"),
    }


class HostileServer:
    """A factory service that lies: FACTORY_TOKEN names the scenario (one of `answers`) each request is answered
    with, so that every pull of a test runs at once against one server."""

    def __init__(self, answers: dict[str, Answer]):
        self.answers = answers
        self.sent: dict[str, int] = {}  # scenario -> bytes of an endless body that reached the client's socket
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        answers, sent = self.answers, self.sent

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                scenario = self.headers["Authorization"].removeprefix("Bearer ")
                answer = answers[scenario]
                path = self.path.split("?")[0]
                if answer.endless == ("manifest" if path == f"/api/quants/{MODEL}/{TAG}" else "file"):
                    return self._endless(scenario)
                if path == f"/api/quants/{MODEL}/{TAG}" and answer.raw is not None:
                    return self._send(answer.raw, "application/json")
                if path == f"/api/quants/{MODEL}/{TAG}":
                    quant = {"name": f"{MODEL}:{TAG}", "model": MODEL, "tag": TAG, "rev": REV, **answer.quant}
                    manifest = {"name": quant["model"], "tag": quant["tag"], "rev": quant["rev"], "files": answer.files}
                    return self._send(json.dumps({"quant": quant, "manifest": manifest}).encode(), "application/json")
                fname = path.rsplit("/files/", 1)[-1]
                body = answer.bodies[fname]
                self._send(body, "application/octet-stream", answer.content_length.get(fname, len(body)))

            def _send(self, body: bytes, kind: str, length: int | None = None):
                self.send_response(200)  # never 206: a Range request is answered with the whole file
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def _endless(self, scenario: str):
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Connection", "close")  # no Content-Length: the body lasts as long as the connection
                self.end_headers()
                sent[scenario] = 0
                try:
                    while sent[scenario] < ENDLESS:
                        self.wfile.write(WEIGHTS)
                        sent[scenario] += len(WEIGHTS)
                except OSError:  # the client hung up
                    pass

        return Handler


def _tree(root: Path) -> dict[Path, tuple]:
    """Every path under `root`: a folder as such, a file with its inode, size, mtime and bytes."""
    return {
        p.relative_to(root): ("dir",)
        if p.is_dir()
        else (p.lstat().st_ino, p.lstat().st_size, p.lstat().st_mtime_ns, p.read_bytes())
        for p in root.rglob("*")
    }


def _the_client_own(rel: Path) -> bool:
    """Where a pull into pulls/out may write: -o itself and its staging folder `.qf-pull-out-<rev>.<random>` beside
    it."""
    parts = rel.parts
    return parts[0] == "pulls" and (
        len(parts) == 1
        or parts[1] == "out"
        or re.fullmatch(r"\.qf-pull-out-[0-9a-f]{7,64}\.[a-z0-9_]+", parts[1]) is not None
    )


def _staged_sizes(case: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (case / "pulls").glob(".qf-pull-out-*/*")}


def _problems(case: Path, answer: Answer, before: dict, code, stdout: str, stderr: str, url: str) -> list[str]:
    """What went wrong in one pull from the hostile server: anything but exit 1 with one sentence naming it, a
    touched victim, a path changed outside the client's own, a staged file larger than the manifest says."""
    problems = []
    if (
        (code, stdout) != (1, "")
        or not stderr.startswith("error: ")
        or f" the factory's service at {url} " not in stderr
        or stderr.count("\n") != 1
    ):
        problems.append(f"exit {code}, stdout {stdout!r}, stderr {stderr[-1500:]!r}")
    if not (case / "victim" / "config.json").exists() or (case / "victim" / "config.json").read_bytes() != VICTIM:
        problems.append("the victim file was changed, moved or deleted")
    after = _tree(case)
    changed = sorted(str(p) for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if not all(_the_client_own(Path(p)) for p in changed) or (case / "pulls" / "out").exists():
        problems.append(f"changed: {changed}")
    for fname, size in _staged_sizes(case).items():  # what is left to resume never outgrows the manifest
        if fname not in answer.files or size > answer.files[fname]["bytes"]:
            problems.append(f"staged {fname} has {size} bytes")
    return problems


def test_a_hostile_server_cannot_write_delete_or_flood(tmp_path):
    cases = {name: tmp_path / name for name in _answers(tmp_path)}  # one folder each: its pull, home and victim
    answers = {name: _answers(case)[name] for name, case in cases.items()}
    for case in cases.values():
        (case / "victim").mkdir(parents=True)
        (case / "victim" / "config.json").write_bytes(VICTIM)
        (case / "pulls").mkdir()
    server = HostileServer(answers)
    try:
        before = {name: _tree(case) for name, case in cases.items()}
        started = time.monotonic()
        pulls = {
            name: subprocess.Popen(
                [sys.executable, "-m", "factory.cli", "pull", f"{MODEL}:{TAG}", "-o", case / "pulls" / "out"],
                env=user_env(server, name, case / "home"),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, case in cases.items()
        }
        ended = {}
        for name, pull in pulls.items():
            try:
                stdout, stderr = pull.communicate(timeout=max(1.0, started + 30 - time.monotonic()))
                ended[name] = (pull.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                pull.kill()
                ended[name] = ("still running after 30 s", *pull.communicate())
    finally:
        server.stop()
    wrong = {
        name: problems
        for name, case in cases.items()
        if (problems := _problems(case, answers[name], before[name], *ended[name], server.url))
    }
    for name, most in (("endless-body", 16 << 20), ("endless-manifest", MAX_ANSWER + (16 << 20))):
        if server.sent[name] > most:  # what the client may read, and what socket buffers hold
            wrong[name] = [*wrong.get(name, []), f"read {server.sent[name]} bytes of an endless body"]
    assert not wrong, json.dumps(wrong, indent=1)


def test_a_200_answer_to_a_range_request_starts_the_file_again(tmp_path):
    """A pull killed half-way left a wrong half file; the server ignores the Range and sends the whole file."""
    server = HostileServer({"honest": Answer()})
    try:
        staged = Path(tempfile.mkdtemp(prefix=f".qf-pull-out-{REV}.", dir=tmp_path))  # as the killed pull made it
        (staged / "model.safetensors").write_bytes(b"\xff" * (len(WEIGHTS) // 2))
        pulled = subprocess.run(
            [sys.executable, "-m", "factory.cli", "pull", f"{MODEL}:{TAG}", "-o", tmp_path / "out"],
            env=user_env(server, "honest", tmp_path / "home"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert pulled.returncode == 0, pulled.stderr
        assert (tmp_path / "out" / "model.safetensors").read_bytes() == WEIGHTS
        assert (tmp_path / "out" / "config.json").read_bytes() == CONFIG
    finally:
        server.stop()


def test_a_manifest_nested_100k_deep_is_one_sentence(tmp_path):
    """json.loads of 100k levels ends in RecursionError: a traceback (issue 43)."""
    server = HostileServer({"deep": Answer(raw=b'{"quant": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")})
    try:
        pulled = subprocess.run(
            [sys.executable, "-m", "factory.cli", "pull", f"{MODEL}:{TAG}", "-o", tmp_path / "out"],
            env=user_env(server, "deep", tmp_path / "home"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.stop()
    assert (pulled.returncode, pulled.stdout) == (1, "")
    assert pulled.stderr == (
        f"error: the factory's service at {server.url} answered /api/quants/{MODEL}/{TAG} with JSON nested too "
        "deeply to be read\n"
    )
    assert list(tmp_path.iterdir()) == []  # no -o, no staging folder


def test_a_local_pull_copies_and_never_shares_the_registry_files(finished, tmp_path):
    qf, _ = finished
    [row] = qf.json("ls")
    registry = qf.home / "registry" / row["path"]
    result = qf("pull", row["name"], "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    for theirs in registry.iterdir():
        mine = tmp_path / "out" / theirs.name
        assert not os.path.samefile(mine, theirs) and mine.stat().st_ino != theirs.stat().st_ino, theirs.name
        kept = theirs.read_bytes()
        mine.chmod(mine.stat().st_mode | stat.S_IWUSR)  # the user's to edit
        with open(mine, "r+b") as f:
            f.write(b"edited by the user")
        assert theirs.read_bytes() == kept, theirs.name
    folder.verify(registry)


def test_a_staging_folder_another_user_prepared_is_not_used(tmp_path):
    """Root pulls into a folder another user can write (theirs, mode 0777), where that user made the staging folder
    the pull used to make, `.qf-pull-out-<rev>`: a link to root's folder (the pull wrote into it, deleted the file
    larger than the manifest's and exited 0), or a folder of links to root's files (the pull appended to one).
    Each pull now stages in a folder of its own, exits 0 with the quant's files in -o, and root's folder is as it
    was; what the other user made is left as it is."""
    cases = {"linked-folder": tmp_path / "a", "linked-files": tmp_path / "b"}
    victim = tmp_path / "victim"  # root's: a bigger model.safetensors and a shorter one, a config.json
    victim.mkdir()
    (victim / "model.safetensors").write_bytes(b"v" * (2 * len(WEIGHTS)))
    (victim / "short.bin").write_bytes(VICTIM)
    (victim / "config.json").write_bytes(VICTIM)
    drops = {name: Path(tempfile.mkdtemp(prefix="qf-drop-", dir="/tmp")) for name in cases}
    try:
        for drop in drops.values():
            os.chown(drop, hostile_user.uid(), -1)
            drop.chmod(0o777)
        staged = {name: drop / f".qf-pull-out-{REV}" for name, drop in drops.items()}
        hostile_user.run(
            f"ln -s {victim} {staged['linked-folder']}; mkdir -m 777 {staged['linked-files']}; "
            f"ln -s {victim / 'short.bin'} {staged['linked-files'] / 'model.safetensors'}; "
            f"ln -s {victim / 'config.json'} {staged['linked-files'] / 'config.json'}"
        )
        before, theirs = _tree(victim), {name: sorted(os.listdir(drop)) for name, drop in drops.items()}
        server = HostileServer({"honest": Answer()})
        try:
            pulls = {
                name: subprocess.run(
                    [sys.executable, "-m", "factory.cli", "pull", f"{MODEL}:{TAG}", "-o", drop / "out"],
                    env=user_env(server, "honest", cases[name] / "home"),
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                for name, drop in drops.items()
            }
        finally:
            server.stop()
        assert _tree(victim) == before
        for name, drop in drops.items():
            assert pulls[name].returncode == 0, (name, pulls[name].stderr)
            assert (drop / "out" / "model.safetensors").read_bytes() == WEIGHTS and not (drop / "out").is_symlink()
            assert (drop / "out" / "config.json").read_bytes() == CONFIG
            assert sorted(os.listdir(drop)) == sorted([*theirs[name], "out"]), name
            assert staged[name].is_symlink() or sorted(os.listdir(staged[name])) == ["config.json", "model.safetensors"]
    finally:
        for drop in drops.values():
            shutil.rmtree(drop)
