"""The dashboard: server-rendered pages of the jobs (their units, where they run, the ETA), the workers' running
units, each model's quants with their quality and the fits-on table, and the quality-vs-size plots. No script of
our own: a page with running jobs reloads itself every REFRESH seconds; links and a form are all it needs, so a
keyboard alone gets everywhere. The same tokens as the API sign in (a cookie, sent with GET only)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from factory import tables
from factory.catalog.accounts import Account
from factory.errors import AccessDenied, NotFound
from factory.publish import card, lookup
from factory.registry import naming
from factory.service.redact import visible_jobs

COOKIE = "qf_token"  # the dashboard's sign-in; the API takes the Authorization header only

REFRESH = 10
_pages = Environment(loader=PackageLoader("factory.service", "templates"), autoescape=select_autoescape())
_pages.filters.update(size=tables.size, duration=tables.duration, ago=lambda t: t.replace("T", " "))


def running_units(rows: list[dict]) -> list[dict]:
    """What each worker process is running now: the jobs' running steps by holder (host:pid)."""
    units = [
        {
            "holder": step["holder"] or "-",
            "job": row["id"],
            "model": row["name"],
            "unit": step["name"],
            "started_at": step["started_at"],
            "expected_seconds": step["expected_seconds"],
        }
        for row in rows
        for step in row["steps"]
        if step["state"] == "running"
    ]
    return sorted(units, key=lambda u: (u["holder"], u["started_at"]))


def mount(app: FastAPI, account: Callable[[Request], Account]) -> None:
    config, accounts, catalog = app.state.config, app.state.accounts, app.state.factory.catalog

    def page(template: str, request: Request, who: Account | None, **values) -> HTMLResponse:
        html = _pages.get_template(template).render(who=who, path=request.url.path, refresh=REFRESH, **values)
        return HTMLResponse(html)

    def signed_in(request: Request) -> Account | RedirectResponse:
        try:
            who = account(request)
        except AccessDenied:
            return RedirectResponse(f"/login?next={request.url.path}", status_code=303)
        who.require("read")
        return who

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request):
        who = signed_in(request)
        if isinstance(who, RedirectResponse):
            return who
        recent = visible_jobs(config, who, limit=200)  # the table shows 50; the running units are looked for in all 200
        jobs = recent[:50]
        models = {}
        for q in catalog.quants.live():
            models.setdefault(q.name, []).append(q.row())
        return page(
            "index.html",
            request,
            who,
            jobs=jobs,
            units=running_units(recent),
            models=sorted(models.items()),
            live=any(j["state"] in ("queued", "running") for j in jobs),
        )

    @app.get("/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
    def job_page(job_id: str, request: Request):
        who = signed_in(request)
        if isinstance(who, RedirectResponse):
            return who
        rows = visible_jobs(config, who, job_id=job_id)
        if not rows:
            raise NotFound(f"no job {job_id!r}; `qf status` lists the recent ones")
        return page("job.html", request, who, job=rows[0], live=rows[0]["state"] in ("queued", "running"))

    @app.get("/models/{name}", response_class=HTMLResponse, include_in_schema=False)
    def model_page(name: str, request: Request):
        who = signed_in(request)
        if isinstance(who, RedirectResponse):
            return who
        ref = naming.parse(name)
        rows = lookup.with_fits(catalog, config.registry, ref)
        return page(
            "model.html",
            request,
            who,
            name=ref.name,
            rows=rows,
            jobs=visible_jobs(config, who, name=ref.name),
            has_kld=any(r.kld for r in rows),
            live=False,
        )

    @app.get("/models/{name}/{plot}.png", include_in_schema=False)
    def plot(name: str, plot: str, request: Request):
        who = signed_in(request)
        if isinstance(who, RedirectResponse):
            return who
        draw = {"ppl": card.plot, "kld": card.plot_kld}.get(plot)
        rows = [q.row() for q in lookup.find(catalog, naming.parse(name))]  # a plot needs no fits-on table
        if draw is None or (plot == "kld" and not card.has_kld(rows)):
            raise NotFound(f"no plot {plot!r} of {name}")
        with tempfile.TemporaryDirectory() as tmp:
            png = draw(rows, Path(tmp) / "plot.png").read_bytes()
        return Response(png, media_type="image/png", headers={"Cache-Control": "max-age=60"})

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    def login_form(request: Request, next: str = "/"):
        return page("login.html", request, None, next=_local(next), error=None)

    @app.post("/login", include_in_schema=False)
    async def login(request: Request):
        form = {k: v[0] for k, v in parse_qs((await request.body()).decode("utf-8", "replace")).items()}
        token, target = form.get("token", "").strip(), _local(form.get("next", "/"))
        try:
            accounts.authenticate(token).require("read")
        except AccessDenied as e:
            html = _pages.get_template("login.html").render(who=None, path="/login", next=target, error=e.message)
            return HTMLResponse(html, status_code=401)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", max_age=30 * 86400)
        return response

    @app.post("/logout", include_in_schema=False)
    def logout():
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE)
        return response


def error_page(status_code: int, message: str) -> HTMLResponse:
    html = _pages.get_template("error.html").render(who=None, path="", status_code=status_code, message=message)
    return HTMLResponse(html, status_code=status_code)


def _local(target: str) -> str:
    """Where a sign-in may send the browser: a path of this site, never another site."""
    return target if target.startswith("/") and not target.startswith("//") else "/"
