"""`qf serve`: the factory's front door, an HTTP API (and the dashboard, service/dashboard.py) in front of the
catalog, the broker and the registry. It is the only component that needs their credentials; its users hold
tokens (catalog/accounts.py).

Every refusal is a JSON body `{"error": "<the CLI's sentence>", "exit_code": N}` with its HTTP status:

| status | error class                   | exit |
|--------|-------------------------------|------|
| 401    | no token, or not a valid one  | 5    |
| 403    | a scope the token lacks       | 5    |
| 404    | NotFound (also another user's job) | 4 |
| 409    | Conflict (retrying a job that is not failed or cancelled) | 2 |
| 409    | JobFailed (a file that changed while it was read) | 1 |
| 413    | a request body over MAX_BODY  | 2    |
| 422    | SpecError, ModelRefused, a malformed request | 2, 3 |
| 429    | OverQuota                     | 5    |
| 503    | ServiceUnavailable            | 5    |

Names in paths go through the CLI's parser (naming.parse); files are served only by their name in a quant's
manifest; sources are Hub repos or folders under FACTORY_SERVE_SOURCES.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from factory import fleet, schedule, settings, submission
from factory.catalog import JobState
from factory.catalog.accounts import PUBLIC, Account, Unauthenticated
from factory.checkpoints import sources
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
)
from factory.factory import Factory
from factory.publish import folder, lookup
from factory.registry import naming
from factory.service import dashboard, redact
from factory.service.dashboard import COOKIE
from factory.service.followers import Followers
from factory.service.redact import shown, visible_jobs

MAX_BODY = 64 * 1024  # a submission is a few hundred bytes; a recipe a few kilobytes
log = logging.getLogger("quantfactory.service")

_STATUS = [
    (Unauthenticated, 401),
    (OverQuota, 429),
    (AccessDenied, 403),
    (NotFound, 404),
    (Conflict, 409),
    (SpecError, 422),
    (ModelRefused, 422),
    (ServiceUnavailable, 503),
    (JobFailed, 409),
]


def http_status(error: FactoryError) -> int:
    return next((code for kind, code in _STATUS if isinstance(error, kind)), 400)


def refusal(status_code: int, message: str, exit_code: int) -> JSONResponse:
    return JSONResponse({"error": message, "exit_code": exit_code}, status_code=status_code)


class SubmitBody(submission.Options):
    """What `qf submit` sends (submission.Options), within the service's limits on a request's size."""

    source: str = Field(max_length=500)
    recipe: str | None = Field(default=None, max_length=MAX_BODY)


class WatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str = Field(max_length=200)
    recipe: dict
    filter: dict = {}


class _BodyLimit:
    """Refuses a request body over MAX_BODY (413) before the application reads it, declared or streamed."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
            return await _too_large(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > MAX_BODY:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _too_large(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _too_large(scope, receive, send):
    response = refusal(413, f"the request body is over {MAX_BODY // 1024} KiB, the most this factory takes", 2)
    await response(scope, receive, send)


def account(request: Request) -> Account:
    """Who sent the request: the bearer token's user; for a page (GET), the dashboard's sign-in cookie, or the
    public where the admin allows it."""
    config, accounts = request.app.state.config, request.app.state.accounts
    header = request.headers.get("authorization", "")
    secret = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else None
    if secret is None and request.method == "GET":
        secret = request.cookies.get(COOKIE)
    if secret is None and config.serve_public and request.method == "GET":
        return PUBLIC
    return accounts.authenticate(secret)


Who = Annotated[Account, Depends(account)]


def create_app(config: settings.Settings | None = None) -> FastAPI:
    config = config or settings.load()
    factory = Factory(config)
    accounts = factory.catalog.accounts
    followers = Followers()
    # The API's docs (/docs, /redoc) from files in the fastapi-offline wheel: a factory without internet shows them too.
    app = FastAPIOffline(
        title="quantfactory", summary="Submit quantization jobs, follow them, pull finished quants.", version="1"
    )
    app.add_middleware(_BodyLimit)
    app.state.config, app.state.factory, app.state.accounts = config, factory, accounts

    @app.exception_handler(FactoryError)
    async def _factory_error(request: Request, e: FactoryError):
        message = e.message if isinstance(e, _NotServed) else redact.paths(e.message, config)  # the log has it whole
        if isinstance(e, ServiceUnavailable):  # which database or broker, where: the admin's business
            log.warning("%s %s: %s", request.method, request.url.path, e.message)
            message = (
                "the factory's service cannot reach a service it needs (its catalog, broker or the Hub) now; "
                "try again later (its log says which)"
            )
        if not request.url.path.startswith("/api/") and "text/html" in request.headers.get("accept", ""):
            return dashboard.error_page(http_status(e), message)  # a person at a browser
        return refusal(http_status(e), message, e.exit_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "malformed"}
        where = ".".join(str(part) for part in first["loc"] if part != "body") or "the request"
        return refusal(422, f"{where}: {first['msg']}", 2)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        return refusal(e.status_code, str(e.detail), 2 if e.status_code < 500 else 5)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("%s %s", request.method, request.url.path)
        return refusal(500, "the factory's service failed on this request; its log has the details", 5)

    @app.get("/api/me")
    def me(who: Who) -> dict:
        return {"user": who.user, "scopes": sorted(who.scopes)}

    @app.post("/api/jobs", status_code=201)
    def submit(body: SubmitBody, who: Who) -> dict:
        """Queue a job (the same job again: the same id)."""
        who.require("submit")
        queue = fleet.get()
        _check_source(body.source, config)
        place, notes = accounts.reserve(who, config.place_seconds), []
        try:
            # --fit alone sizes the job by the ranking of the model's scored quants, in the factory's catalog
            request = body.request(config.worker_device, say=notes.append, catalog=lambda: factory.catalog)
            for text in (request.recipe.calibration, request.recipe.eval):
                _check_text(text, config)

            def note(event: dict) -> None:  # what planning says (a quant `qf rm` removed is made again)
                if event["event"] == "note":
                    notes.append(event["message"])

            job = queue.submit(factory.emitting(note), request)
        except BaseException:
            accounts.release(place)
            raise
        if accounts.record(place, who, job.id).state == JobState.cancelled:
            job = queue.submit(
                factory, request
            )  # its last other owner cancelled it just before this user's place counted
        guess = factory.estimate(job)
        return {
            "id": job.id,
            "state": str(job.state),
            "notes": notes,
            "estimate": {"packed": guess[0], "alone": guess[1]} if guess else None,
        }

    @app.get("/api/jobs")
    def jobs(who: Who, limit: Annotated[int, Query(ge=1, le=1000)] = 20, name: str | None = None) -> list[dict]:
        who.require("read")
        return visible_jobs(config, who, limit=limit, name=naming.parse(name).name if name else None)

    @app.get("/api/jobs/{job_id}")
    def job(job_id: str, who: Who) -> dict:
        who.require("read")
        rows = visible_jobs(config, who, job_id=job_id)
        if not rows:
            raise NotFound(f"no job {job_id!r}; `qf status` lists the recent ones")
        return rows[0]

    @app.get("/api/jobs/{job_id}/events")
    def events(job_id: str, who: Who) -> StreamingResponse:
        """The job's progress events as server-sent events (`data: <json>`), until its result or its end."""
        who.require("read")
        accounts.check_job(who, job_id)
        events = fleet.get().follow(factory.catalog, config.broker_url, job_id)
        return followers.response(who.user, redact.shown_events(events, who, config))

    @app.post("/api/jobs/{job_id}/cancel")
    def cancel(job_id: str, who: Who) -> dict:
        """Withdraw the caller's interest in the job; the job is cancelled when no other user wants it (an admin's
        cancel cancels it outright). `others`: how many users still want it."""
        who.require("submit")
        accounts.check_job(who, job_id)
        job, others = accounts.withdraw(who, job_id)
        return {"id": job.id, "state": str(job.state), "others": others}

    @app.post("/api/jobs/{job_id}/retry")
    def retry(job_id: str, who: Who) -> dict:
        """Queue a failed or cancelled job again, as submitting it again would: it counts against the caller's
        quotas as a submission does, and the caller wants it again."""
        who.require("submit")
        accounts.check_job(who, job_id)
        queue, place = fleet.get(), accounts.reserve(who, config.place_seconds)
        try:
            job = queue.retry(factory, job_id)
        except BaseException:
            accounts.release(place)
            raise
        accounts.rejoin(who, job_id)
        if accounts.record(place, who, job_id).state == JobState.cancelled:
            job = queue.retry(
                factory, job_id
            )  # its last other owner cancelled it just before this user's place counted
        return {"id": job.id, "state": str(job.state)}

    @app.get("/api/quants")
    def quants(who: Who) -> list[dict]:
        who.require("read")
        return shown([q.row().to_json() for q in factory.catalog.quants.live()], who, config)

    @app.get("/api/models/{name}")
    def model(name: str, who: Who, tag: str | None = None, rev: str | None = None) -> dict:
        """`qf show NAME[:TAG]`: the model's quants (with what fits each GPU) and the user's jobs of it."""
        who.require("read")
        ref = _ref(name, tag, rev, tag_required=False)
        return {
            "quants": shown(
                [r.to_json() for r in lookup.with_fits(factory.catalog, config.registry, ref)], who, config
            ),
            "jobs": visible_jobs(config, who, limit=50, name=ref.name),
        }

    @app.get("/api/quants/{name}/{tag}")
    def quant(name: str, tag: str, who: Who, rev: str | None = None) -> dict:
        """One quant (the newest revision, or `rev`) with its manifest: what `qf pull` downloads and checks."""
        who.require("read")
        found, manifest = _quant(name, tag, rev)
        row = factory.catalog.quants.row(found)  # with every evaluation: the card a pull writes lists them
        return shown({"quant": row.to_json(), "manifest": manifest}, who, config)

    @app.get("/api/quants/{name}/{tag}/files/{fname}")
    def quant_file(name: str, tag: str, fname: str, who: Who, rev: str | None = None) -> FileResponse:
        """One file of a quant, by its name in the manifest; HTTP Range requests resume a download."""
        who.require("pull")
        found, manifest = _quant(name, tag, rev)
        if fname != folder.MANIFEST and fname not in manifest["files"]:
            raise NotFound(f"{found.name}:{found.tag}@{found.rev} has no file {fname!r}")
        return FileResponse(config.registry / found.path / fname, filename=fname, media_type="application/octet-stream")

    def _quant(name: str, tag: str, rev: str | None):
        ref = _ref(name, tag, rev, tag_required=True)
        found = lookup.find(factory.catalog, ref)[0]
        manifest = folder.read_manifest(config.registry / found.path)
        if manifest is None:
            raise NotFound(f"{ref} has no files in this factory's registry")
        return found, manifest

    @app.get("/api/watches")
    def watches(who: Who) -> list[dict]:
        """`qf watch ls` (admin)."""
        who.require("admin")
        return schedule.watch_rows(factory.catalog.watchlist)

    @app.put("/api/watches")
    def watch_add(entries: list[WatchBody], who: Who) -> dict:
        """`qf watch add`: each entry checked as the CLI checks it (admin)."""
        who.require("admin")
        checked = [schedule.entry(e.target, e.recipe, e.filter) for e in entries]
        for e in checked:
            factory.catalog.watchlist.put(e.target, e.recipe, e.filter)
        return {"watching": [e.target for e in checked]}

    @app.delete("/api/watches")
    def watch_rm(target: str, who: Who) -> dict:
        who.require("admin")
        if not factory.catalog.watchlist.remove(target):
            raise NotFound(f"{target!r} is not on the watchlist; `qf watch ls` shows it")
        return {"removed": target}

    @app.post("/api/watches/check")
    def watch_check(who: Who, dry_run: bool = False) -> dict:
        """`qf watch check`: ask the Hub about every watch now and submit what is new (admin)."""
        who.require("admin")
        return fleet.get().watch_check(dry_run=dry_run)

    dashboard.mount(app, account)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    def unknown(path: str) -> None:
        raise NotFound(f"no page or API endpoint /{path}; /docs lists the API")

    return app


def _ref(name: str, tag: str | None, rev: str | None, tag_required: bool) -> naming.QuantRef:
    text = name + (f":{tag}" if tag is not None else "") + (f"@{rev}" if rev is not None else "")
    return naming.parse(text, tag_required=tag_required)


class _NotServed(AccessDenied):
    """A source or text the user named that this factory does not serve: the sentence echoes what they sent."""


def _check_source(source: str, config: settings.Settings) -> None:
    """A source a service's user may name: a Hub repo, or a folder under FACTORY_SERVE_SOURCES named by its
    absolute path (after following links). Anything else gets one answer, whether or not it exists on the server:
    the answer never tells a user what the server holds."""
    path = Path(source)
    if path.is_absolute():
        allowed = any(path.resolve().is_relative_to(root) for root in config.serve_sources)
    else:  # a Hub repo: `qf serve` runs in an empty folder (cli/services.py), where no relative name is found
        allowed = sources.is_hub_name(source) and not path.exists()
    if not allowed:
        raise _NotServed(
            f"source {source!r} is neither a Hub repo org/name[@revision] nor a folder this factory "
            "serves models from (FACTORY_SERVE_SOURCES, by its absolute path)"
        )


def _check_text(text: str | None, config: settings.Settings) -> None:
    """Calibration and eval texts: builtin ones, or files under FACTORY_SERVE_SOURCES."""
    if text and text.startswith("file:"):
        _check_source(text.removeprefix("file:"), config)
        if not Path(text.removeprefix("file:")).is_absolute():
            raise _NotServed(
                f"{text!r}: a text file must be named by its absolute path in a folder this factory "
                "serves (FACTORY_SERVE_SOURCES)"
            )
