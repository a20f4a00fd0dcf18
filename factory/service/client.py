"""The CLI's side of the service (FACTORY_SERVER, FACTORY_TOKEN): the same requests as the local commands, over
HTTP; every refusal comes back as the error class (and so the exit code) the local command raises."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from factory import naming
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
from factory.identity import file_sha256

_BY_EXIT = {1: JobFailed, 2: SpecError, 3: ModelRefused, 4: NotFound}  # 409 is a Conflict (a SpecError: exit 2)
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


class Client:
    def __init__(self, url: str, token: str | None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(60.0, connect=10.0))

    def _error(self, response: httpx.Response) -> FactoryError:
        try:
            body = response.json()
            message, exit_code = body["error"], int(body.get("exit_code", 5))
        except (ValueError, KeyError, TypeError):
            return ServiceUnavailable(f"the factory's service at {mask_url(self.url)} answered HTTP "
                                      f"{response.status_code} without saying why")
        if response.status_code == 429:
            return OverQuota(message)
        if response.status_code == 409:
            return Conflict(message)
        if response.status_code in (401, 403):
            return AccessDenied(message)
        return _BY_EXIT.get(exit_code, ServiceUnavailable)(message)

    def _unreachable(self) -> ServiceUnavailable:
        return ServiceUnavailable(f"the factory's service at {mask_url(self.url)} cannot be reached")

    def call(self, method: str, path: str, **request) -> dict | list:
        try:
            response = self.http.request(method, path, **request)
        except httpx.TransportError:
            raise self._unreachable() from None
        if response.status_code >= 400:
            raise self._error(response)
        try:
            return response.json()
        except ValueError:
            raise ServiceUnavailable(f"{mask_url(self.url)} answered {path} with something other than JSON; is "
                                     "FACTORY_SERVER the factory's service?") from None

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
            with self.http.stream("GET", f"/api/jobs/{_segment(job_id)}/events",
                                  timeout=httpx.Timeout(60.0, connect=10.0, read=None)) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self._error(response)
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        yield json.loads(line.removeprefix("data: "))
        except httpx.TransportError:
            raise self._unreachable() from None

    def pull(self, ref: naming.QuantRef, dest: Path, progress: Progress = lambda d, t: None) -> tuple[dict, list]:
        """Download a quant into `dest` (new or empty): each file resumed where an interrupted pull left it (HTTP
        Range), checked against its sha256 in the manifest, and moved into place only when all of them match."""
        info = self.call("GET", f"/api/quants/{ref.name}/{ref.tag}", params=_tag_rev(ref, tag=False))
        quant, manifest = info["quant"], info["manifest"]
        staging = dest.parent / f".qf-pull-{dest.name}-{quant['rev']}"  # the same pull again resumes here
        staging.mkdir(parents=True, exist_ok=True)
        files = manifest["files"]
        total, before = sum(f["bytes"] for f in files.values()), 0
        for fname, want in files.items():
            path = staging / fname
            have = path.stat().st_size if path.exists() else 0
            if have > want["bytes"]:
                path.unlink()
                have = 0
            progress(before + have, total)
            if have < want["bytes"]:
                self._download(quant, fname, path, have, lambda n, at=before + have: progress(at + n, total))
            if file_sha256(path) != want["sha256"]:
                path.unlink()
                raise JobFailed(f"{fname} of {quant['name']}@{quant['rev']} does not match its sha256 in the "
                                "manifest; pull again")
            before += want["bytes"]
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if dest.exists():
            dest.rmdir()  # empty: checked by the CLI
        staging.rename(dest)
        return quant, [dest / f for f in files]

    def _download(self, quant: dict, fname: str, path: Path, have: int, progress: Callable[[int], None]) -> None:
        url = f"/api/quants/{quant['model']}/{quant['tag']}/files/{_segment(fname)}"
        headers = {"Range": f"bytes={have}-"} if have else {}
        got = 0  # bytes of this response
        try:
            with self.http.stream("GET", url, params={"rev": quant["rev"]}, headers=headers,
                                  timeout=httpx.Timeout(60.0, connect=10.0)) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self._error(response)
                mode = "ab" if response.status_code == 206 else "wb"  # 200: the server sent the whole file
                with open(path, mode) as out:
                    for chunk in response.iter_bytes():  # as they arrive: a killed pull keeps what it got
                        out.write(chunk)
                        got += len(chunk)
                        progress(got)
        except httpx.TransportError:
            raise self._unreachable() from None


def _segment(text: str) -> str:
    """A job id or file name as one path segment (no '/' that would make it another endpoint)."""
    if not text or "/" in text or text in (".", ".."):
        raise SpecError(f"{text!r} is not a job id or file name")
    return text


def _tag_rev(ref: naming.QuantRef, tag: bool = True) -> dict:
    return {**({"tag": ref.tag} if tag and ref.tag else {}), **({"rev": ref.rev} if ref.rev else {})}
