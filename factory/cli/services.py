"""`qf serve` and `qf token`: the factory's service and its users' tokens (factory/service/). Registered on the
`qf` app (factory/cli/)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from factory import settings, tables
from factory.cli.shared import WideOpt, app, err, handled, open_catalog, out

token_app = typer.Typer(
    help="Tokens of the factory's service (`qf serve`): one per person, only its hash is kept.", no_args_is_help=True
)
app.add_typer(token_app, name="token")


@app.command()
@handled
def serve(
    host: Annotated[str, typer.Option("--host", help="The address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8750,
    public: Annotated[
        bool,
        typer.Option(
            "--public", metavar="", help="The dashboard and read-only pages need no token (FACTORY_SERVE_PUBLIC)."
        ),
    ] = False,
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="Server processes (default: one per CPU core, at most 4).")
    ] = None,
) -> None:
    """Serve the HTTP API (docs at /docs) and the dashboard (/) in front of the catalog, broker and registry."""
    import uvicorn

    if public:
        os.environ["FACTORY_SERVE_PUBLIC"] = "1"  # read by each server process (settings.load)
    open_catalog()  # a catalog that cannot be reached is exit 5 before the port opens
    _serve_from_an_empty_folder()
    uvicorn.run(
        "factory.service.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers or min(4, os.cpu_count() or 1),
        log_level="info",
        access_log=True,
        # uvicorn kills a server process that does not answer its ping within this many seconds and starts another;
        # its default, 5, is less than a new process takes to start on a loaded machine, which then never serves
        # (seen in CI: every server process killed before it could answer).
        timeout_worker_healthcheck=60,
    )


def _serve_from_an_empty_folder() -> None:
    """The server processes run in an empty folder of their own: a source a user names by a relative name is a Hub
    repo, never a file of the server's that happens to lie where `qf serve` was started (service/app.py). The
    settings that name paths are made absolute first, for the server processes that read them again."""
    config = settings.load()
    os.environ["FACTORY_HOME"] = str(config.home)
    if config.db_url.startswith("sqlite:///"):
        os.environ["FACTORY_DB_URL"] = "sqlite:///" + str(Path(config.db_url.removeprefix("sqlite:///")).resolve())
    if config.serve_sources:
        os.environ["FACTORY_SERVE_SOURCES"] = ":".join(str(p) for p in config.serve_sources)
    empty = config.home / "serve"
    empty.mkdir(parents=True, exist_ok=True)
    os.chdir(empty)


def _accounts():
    return open_catalog().accounts


@token_app.command("create")
@handled
def token_create(
    user: Annotated[str, typer.Option("--user", help="Who the token is for.")],
    scope: Annotated[str, typer.Option("--scope", help="read, submit, pull and/or admin, comma-separated.")] = (
        "read,submit,pull"
    ),
    quota: Annotated[
        int | None,
        typer.Option(
            "--quota-jobs-per-day", min=0, help="Submissions a day (any 24 hours), over all of the user's tokens."
        ),
    ] = None,
    max_running: Annotated[
        int | None, typer.Option("--max-running", min=0, help="Jobs queued or running at once.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="")] = False,
) -> None:
    """Make a token and print it, this once (only its sha256 is kept)."""
    from factory.catalog.accounts import parse_scopes

    secret, row = _accounts().create(user, parse_scopes(scope), quota, max_running)
    if as_json:
        print(json.dumps({"token": secret, "id": row.id, "user": row.username, "scopes": row.scopes}))
        return
    print(secret)
    err.print(
        f"token {row.id} for {row.username} ({', '.join(row.scopes)}): give it to them as FACTORY_TOKEN; it "
        "is not shown again",
        markup=False,
        highlight=False,
    )


@token_app.command("ls")
@handled
def token_ls(as_json: Annotated[bool, typer.Option("--json", metavar="")] = False, wide: WideOpt = False) -> None:
    """Every token: its id, user, scopes, quotas and whether it was revoked (never the token)."""
    rows = [
        {
            "id": t.id,
            "user": t.username,
            "scopes": t.scopes,
            "quota_jobs_per_day": t.quota_jobs_per_day,
            "max_running": t.max_running,
            "created_at": t.created_at.isoformat(timespec="seconds"),
            "last_used_at": t.last_used_at.isoformat(timespec="seconds") if t.last_used_at else None,
            "revoked_at": t.revoked_at.isoformat(timespec="seconds") if t.revoked_at else None,
        }
        for t in _accounts().tokens()
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    out.print(
        tables.layout(
            [
                tables.Col("ID", [r["id"] for r in rows]),
                tables.Col("USER", [r["user"] for r in rows]),
                tables.Col("SCOPES", [",".join(r["scopes"]) for r in rows]),
                tables.Col("JOBS/DAY", [str(r["quota_jobs_per_day"] or "-") for r in rows], priority=2, right=True),
                tables.Col("RUNNING", [str(r["max_running"] or "-") for r in rows], priority=2, right=True),
                tables.Col("CREATED", [r["created_at"].replace("T", " ") for r in rows], priority=3),
                tables.Col("REVOKED", [(r["revoked_at"] or "-").replace("T", " ") for r in rows], priority=1),
            ],
            None if wide else out.width,
            shows=tables.WIDE,
        )
    )


@token_app.command("revoke")
@handled
def token_revoke(token_id: Annotated[str, typer.Argument(metavar="ID", help="As `qf token ls` shows it.")]) -> None:
    """Refuse the token from now on (its user's jobs stay)."""
    row = _accounts().revoke(token_id)
    err.print(f"token {row.id} of {row.username} revoked", markup=False, highlight=False)
