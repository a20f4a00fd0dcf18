"""`qf watch add|rm|ls|check`: the watchlist, locally or through the factory's service (admin). Registered on
the `qf` app (factory/cli/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from factory import engines, fleet, schedule, tables
from factory.cli.shared import (
    JsonOpt,
    RecipeOpt,
    WideOpt,
    app,
    err,
    handled,
    open_catalog,
    out,
    service_client,
    with_engine_flags,
)
from factory.errors import FactoryError, NotFound, SpecError
from factory.recipes import build_recipe, recipe_from_dict

watch_app = typer.Typer(
    help="The watchlist: upstream repos re-quantized when they get a new commit.", no_args_is_help=True
)
app.add_typer(watch_app, name="watch")


@watch_app.command("add")
@handled
@with_engine_flags
def watch_add(
    target: Annotated[str | None, typer.Argument(metavar="ORG/NAME|ORG/PATTERN")] = None,
    flags: dict | None = None,
    recipe: RecipeOpt = None,
    arch: Annotated[list[str] | None, typer.Option("--arch", help="Only these architectures (repeatable).")] = None,
    max_params: Annotated[float | None, typer.Option("--max-params", help="Only models up to N parameters.")] = None,
    file: Annotated[Path | None, typer.Option("--file", help="Add every entry of a watchlist YAML.")] = None,
) -> None:
    """Watch a repo (org/name) or an author's repos by pattern (Qwen/*-Instruct) with a recipe."""
    if (target is None) == (file is None):
        raise SpecError("give a target (org/name or org/pattern) or --file WATCHLIST.yaml, not both")
    if file is not None:
        entries = schedule.load(file)
    else:
        chosen = build_recipe(recipe, flags).to_dict()
        recipe_dict = {k: v for k, v in chosen.items() if k in engines.available() or recipe is not None}
        limits = {"architectures": arch, "max_params": max_params}
        entries = [schedule.entry(target, recipe_dict, {k: v for k, v in limits.items() if v})]
    if (remote := service_client()) is not None:
        remote.call(
            "PUT", "/api/watches", json=[{"target": e.target, "recipe": e.recipe, "filter": e.filter} for e in entries]
        )
    else:
        catalog = open_catalog()
        for e in entries:
            catalog.watchlist.put(e.target, e.recipe, e.filter)
    for e in entries:
        err.print(f"watching {e.target}")


@watch_app.command("rm")
@handled
def watch_rm(target: Annotated[str, typer.Argument(metavar="TARGET")]) -> None:
    """Stop watching TARGET (what it already submitted stays)."""
    if (remote := service_client()) is not None:
        remote.call("DELETE", "/api/watches", params={"target": target})
    elif not open_catalog().watchlist.remove(target):
        raise NotFound(f"{target!r} is not on the watchlist; `qf watch ls` shows it")
    err.print(f"stopped watching {target}; the jobs it submitted stay", markup=False, highlight=False)


@watch_app.command("ls")
@handled
def watch_ls(as_json: JsonOpt = False, wide: WideOpt = False) -> None:
    """The watchlist, and what each watch last did (the recipe as the tags it makes; --json has all of it)."""
    remote = service_client()
    rows = remote.call("GET", "/api/watches") if remote else schedule.watch_rows(open_catalog().watchlist)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    last = [r["seen"][-1] if r["seen"] else {} for r in rows]
    out.print(
        tables.layout(
            [
                tables.Col("TARGET", [r["target"] for r in rows]),
                tables.Col("RECIPE", [_recipe_text(r["recipe"]) for r in rows], priority=1, flex=True),
                tables.Col("FILTER", [_filter_text(r["filter"]) for r in rows], priority=2, flex=True),
                tables.Col("LAST SEEN", [f"{s['repo']}@{s['sha'][:7]}" if s else "-" for s in last]),
                tables.Col("JOB", [s.get("job") or "-" for s in last]),
                tables.Col("SKIPPED", [s.get("skipped") or "" for s in last], priority=3, flex=True),
            ],
            None if wide else out.width,
            "watchlist",
            tables.WIDE,
        )
    )


def _recipe_text(recipe: dict) -> str:
    """A watch's recipe as the tags it makes (`exl2-3.0bpw, exl2-4.0bpw`), or its engine's name where the tag waits
    for the model (AWQ's group size)."""
    try:
        specs = recipe_from_dict(recipe, "the watch's recipe").specs()
    except FactoryError:  # an engine this process does not have: the recipe as it is, on one line
        return json.dumps(recipe, separators=(",", ":"))
    return ", ".join(dict.fromkeys(_tag_or_method(s) for s in specs))


def _tag_or_method(spec) -> str:
    try:
        return spec.tag
    except ValueError:  # named once resolved against the model
        return spec.method


def _filter_text(filter: dict) -> str:
    parts = [" or ".join(filter["architectures"])] if filter.get("architectures") else []
    if most := filter.get("max_params"):
        parts.append(f"at most {most / 1e9:g}B parameters" if most >= 1e9 else f"at most {most / 1e6:g}M parameters")
    return ", ".join(parts) or "-"


@watch_app.command("check")
@handled
def watch_check(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", metavar="", help="Print the plan; submit and record nothing.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Ask the Hub about every watch now and submit what is new (what beat does every FACTORY_WATCH_SECONDS). Exits
    5 when the Hub cannot be reached (4 when a watched repo does not exist), after what it could do; with --json 0,
    its `exit_code` says."""
    if (remote := service_client()) is not None:
        result = remote.call("POST", "/api/watches/check", params={"dry_run": dry_run})
    else:
        result = fleet.get().watch_check(dry_run=dry_run)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    if result.get("busy"):
        err.print("another check is running; nothing done")
    for e in result["errors"]:
        err.print(f"hub error (tried again next check): {e}", markup=False)
    for p in result["planned"]:
        what = f"skip: {p['skipped']}" if p["skipped"] else (f"job {p['job']}" if p["job"] else "would submit")
        out.print(f"{p['watch']}: {p['repo']}@{p['sha'][:7]} {what}", markup=False, highlight=False)
    if not result["planned"] and not result.get("busy") and not result["errors"]:
        err.print("nothing new")
    if result.get("exit_code"):
        raise typer.Exit(result["exit_code"])
