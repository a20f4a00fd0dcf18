"""The CLI's side of the service (FACTORY_SERVER, FACTORY_TOKEN): the same requests as the local commands, over
HTTP; every refusal comes back as the error class (and so the exit code) the local command raises."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from factory import engines
from factory.checkpoints.files import carried
from factory.errors import (
    AccessDenied,
    Conflict,
    FactoryError,
    JobFailed,
    ModelRefused,
    NotFound,
    OverQuota,
    ServiceUnavailable,
    SpecError,
    mask_url,
)
from factory.publish.folder import MANIFEST
from factory.registry import naming
from factory.service.private_folder import PrivateFolder

_BY_EXIT = {1: JobFailed, 2: SpecError, 3: ModelRefused, 4: NotFound}  # 409 is a Conflict (a SpecError: exit 2)
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_ANSWER = 64 << 20  # the most one JSON answer may take (a catalog of thousands of quants is a few MiB)


class Client:
    def __init__(self, url: str, token: str | None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(60.0, connect=10.0))

    def _error(self, status: int, body: bytes) -> FactoryError:
        try:
            answer = json.loads(body)
            message, exit_code = answer["error"], int(answer.get("exit_code", 5))
        except (ValueError, KeyError, TypeError, RecursionError):
            return ServiceUnavailable(
                f"the factory's service at {mask_url(self.url)} answered HTTP {status} without saying why"
            )
        if status == 429:
            return OverQuota(message)
        if status == 409:
            return Conflict(message)
        if status in (401, 403):
            return AccessDenied(message)
        return _BY_EXIT.get(exit_code, ServiceUnavailable)(message)

    def _read(self, response: httpx.Response, path: str) -> bytes:
        """An answer's body, up to MAX_ANSWER bytes: an endless one is refused, not kept in memory until it ends."""
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > MAX_ANSWER:
                raise self._refused(f"answered {path} with more than {MAX_ANSWER >> 20} MiB; the rest was not read")
        return bytes(body)

    def _unreachable(self) -> ServiceUnavailable:
        return ServiceUnavailable(f"the factory's service at {mask_url(self.url)} cannot be reached")

    def call(self, method: str, path: str, **request) -> dict | list:
        try:
            with self.http.stream(method, path, **request) as response:
                body = self._read(response, path)
        except httpx.TransportError:
            raise self._unreachable() from None
        if response.status_code >= 400:
            raise self._error(response.status_code, body)
        try:
            return json.loads(body)
        except RecursionError:
            raise self._refused(f"answered {path} with JSON nested too deeply to be read") from None
        except ValueError:
            raise ServiceUnavailable(
                f"{mask_url(self.url)} answered {path} with something other than JSON; is "
                "FACTORY_SERVER the factory's service?"
            ) from None

    def submit(self, body: dict) -> dict:
        return self.call("POST", "/api/jobs", json=body)

    def jobs(self, limit: int = 20, name: str | None = None) -> list[dict]:
        return self.call("GET", "/api/jobs", params={"limit": limit, **({"name": name} if name else {})})

    def job(self, job_id: str) -> dict:
        return self.call("GET", f"/api/jobs/{_segment(job_id)}")

    def cancel(self, job_id: str) -> dict:
        return self.call("POST", f"/api/jobs/{_segment(job_id)}/cancel")

    def retry(self, job_id: str) -> dict:
        return self.call("POST", f"/api/jobs/{_segment(job_id)}/retry")

    def quants(self) -> list[dict]:
        return self.call("GET", "/api/quants")

    def model(self, ref: naming.QuantRef) -> dict:
        return self.call("GET", f"/api/models/{ref.name}", params=_tag_rev(ref))

    def events(self, job_id: str) -> Iterator[dict]:
        """The job's events (server-sent), until its result or its end."""
        try:
            with self.http.stream(
                "GET", f"/api/jobs/{_segment(job_id)}/events", timeout=httpx.Timeout(60.0, connect=10.0, read=None)
            ) as response:
                if response.status_code >= 400:
                    raise self._error(response.status_code, self._read(response, "the job's events"))
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        yield _event(line.removeprefix("data: "), self._refused)
        except httpx.TransportError:
            raise self._unreachable() from None

    def pull(self, ref: naming.QuantRef, dest: Path, progress: Progress = lambda d, t: None) -> tuple[dict, list]:
        """Download a quant into `dest` (new or empty): each file resumed where an interrupted pull left it (HTTP
        Range), checked against its size and sha256 in the manifest, and moved into place only when all of them
        match. Nothing the server says is trusted (see _refusal): a name, revision, size or sha256 that the factory
        would not make, or a body longer or shorter than the manifest says, is JobFailed (exit 1) naming the
        server. The only files written or removed are in the client's own staging folder beside `dest` (which then
        becomes `dest`), one no one else can make or change (factory/service/private_folder.py)."""
        info = self.call("GET", f"/api/quants/{ref.name}/{ref.tag}", params=_tag_rev(ref, tag=False))
        if (problem := _refusal(ref, info)) is not None:
            raise self._refused(f"{problem}; nothing was pulled")
        quant, manifest = info["quant"], info["manifest"]
        files = manifest["files"]
        total, before = sum(f["bytes"] for f in files.values()), 0
        # the same pull again resumes in the folder this one leaves (factory/service/private_folder.py)
        with PrivateFolder(dest, f".qf-pull-{dest.name}-{quant['rev']}.") as staging:
            for fname, want in files.items():  # a plain name (checked): inside the client's own staging folder
                have = staging.size(fname)
                if have > want["bytes"]:
                    staging.remove(fname)
                    have = 0
                progress(before + have, total)
                if have < want["bytes"] or have == 0:
                    self._download(
                        quant, fname, staging, have, want["bytes"], lambda n, at=before: progress(at + n, total)
                    )
                if staging.sha256(fname) != want["sha256"]:
                    staging.remove(fname)
                    raise JobFailed(
                        f"{fname} of {quant['name']}@{quant['rev']} from the factory's service at "
                        f"{mask_url(self.url)} does not match its sha256 in the manifest; pull again"
                    )
                before += want["bytes"]
            staging.write_text(MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
            staging.move_into_place()
        return quant, [dest / f for f in files]

    def _download(
        self, quant: dict, fname: str, staging: PrivateFolder, have: int, size: int, progress: Callable[[int], None]
    ) -> None:
        """`fname` in the staging folder completed from its byte `have` (or from its start, when the server sends the
        whole file) to the manifest's `size`, never past it: a longer body is cut off there, a shorter one (a
        Content-Length that stops early, say) is refused too, and the file goes."""
        what = f"{fname} of {quant['name']}@{quant['rev']}"
        url = f"/api/quants/{quant['model']}/{quant['tag']}/files/{_segment(fname)}"
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with self.http.stream(
                "GET", url, params={"rev": quant["rev"]}, headers=headers, timeout=httpx.Timeout(60.0, connect=10.0)
            ) as response:
                if response.status_code >= 400:
                    raise self._error(response.status_code, self._read(response, what))
                if response.status_code not in (200, 206):
                    raise self._refused(f"answered {what} with HTTP {response.status_code}; nothing was pulled")
                at = have if response.status_code == 206 else 0  # 200: the whole file again, from its start
                with staging.open(fname, append=at > 0) as out:
                    for chunk in response.iter_bytes():  # as they arrive: a killed pull keeps what it got
                        if at + len(chunk) > size:
                            staging.remove(fname)
                            raise self._refused(
                                f"sent more than the {size} bytes the manifest gives {what}; the "
                                "download was stopped there"
                            )
                        out.write(chunk)
                        at += len(chunk)
                        progress(at)
        except httpx.TransportError:
            raise self._unreachable() from None
        if at < size:
            staging.remove(fname)
            raise self._refused(f"sent {at} of the {size} bytes the manifest gives {what}; pull again")

    def _refused(self, what: str) -> JobFailed:
        return JobFailed(f"the factory's service at {mask_url(self.url)} {what}")


def _refusal(ref: naming.QuantRef, info) -> str | None:
    """What is wrong with the service's answer about `ref` (None: nothing), checked against the grammar the factory
    makes these with: the quant's `model:tag@rev` parses (factory/registry/naming.py) and is the one asked for; its
    manifest is that quant's; every file name is plain (no `/`, no NUL, no leading dot) and on the list of what
    publishing lets out (factory/checkpoints/files.py and the engine's `outputs`); every size is a count of bytes, every
    sha256 64 hex digits."""
    quant, manifest = (info.get("quant"), info.get("manifest")) if isinstance(info, dict) else (None, None)
    if not (isinstance(quant, dict) and isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)):
        return f"answered {ref} with something other than a quant and its manifest"
    fields = [quant.get(key) for key in ("model", "tag", "rev")]
    if not all(isinstance(f, str) for f in fields):
        return f"answered {ref} without the quant's name, tag and revision"
    text = "{}:{}@{}".format(*fields)
    try:
        answered = naming.parse(text, tag_required=True)
    except SpecError:
        return f"answered {ref} with the quant {text!r}, which is not a valid quant name"
    if (
        str(answered) != text
        or (answered.name, answered.tag) != (ref.name, ref.tag)
        or not answered.rev.startswith(ref.rev or "")
        or quant.get("name") != f"{answered.name}:{answered.tag}"
    ):
        return f"answered {ref} with the quant {text!r}"
    if [manifest.get(key) for key in ("name", "tag", "rev")] != fields:
        return f"answered {ref} with the manifest of another quant"
    outputs = engines.of_tag(answered.tag).outputs
    for fname, entry in manifest["files"].items():
        if fname == MANIFEST or not carried(fname, outputs):
            return f"listed {fname!r} among the files of {text}, a name no quant's file has"
        if not isinstance(entry, dict) or type(entry.get("bytes")) is not int or entry["bytes"] < 0:
            return f"gave {fname} of {text} a size that is not a count of bytes"
        if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
            return f"gave {fname} of {text} a sha256 that is not 64 hex digits"
    return None


def _event(data: str, refused: Callable[[str], JobFailed]) -> dict:
    """One server-sent event of a job: a JSON object, or JobFailed naming the service."""
    try:
        event = json.loads(data)
    except (ValueError, RecursionError):
        event = None
    if not isinstance(event, dict):
        raise refused("sent an event of the job that is not a JSON object")
    return event


def _segment(text: str) -> str:
    """A job id or file name as one path segment (no '/' that would make it another endpoint)."""
    if not text or "/" in text or text in (".", ".."):
        raise SpecError(f"{text!r} is not a job id or file name")
    return text


def _tag_rev(ref: naming.QuantRef, tag: bool = True) -> dict:
    return {**({"tag": ref.tag} if tag and ref.tag else {}), **({"rev": ref.rev} if ref.rev else {})}
