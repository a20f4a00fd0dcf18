"""`qf plan`: what fits a GPU, as each engine's memory model says, and how long converting takes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from factory import engines, ranking, recipes, settings, tables
from factory import vram as memory
from factory.cli.shared import (
    CtxOpt,
    JsonOpt,
    KvOpt,
    RecipeOpt,
    RuntimeOpt,
    app,
    handled,
    open_catalog,
    out,
    with_engine_flags,
)
from factory.errors import FactoryError
from factory.jobs import eta, planning
from factory.jobs.costs import Costs, Projection


@app.command()
@handled
@with_engine_flags
def plan(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="A local FP16 folder or a Hub repo org/name.")],
    vram: Annotated[str, typer.Option("--vram", help="GPU memory, e.g. 24GB (GB means GiB, as on the card).")],
    flags: dict,
    recipe: RecipeOpt = None,
    ctx: CtxOpt = None,
    kv_cache: KvOpt = "fp16",
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="Split the layers over N such GPUs (estimate).")] = 1,
    engine: Annotated[str | None, typer.Option("--engine", metavar="NAME", help="Only this engine's plan.")] = None,
    runtime: RuntimeOpt = None,
    cores: Annotated[
        int | None,
        typer.Option("--cores", min=1, help="CPU cores of the machine that runs the job (default: this one's)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """What fits a GPU with its context and KV cache, as each engine's memory model says (every size and the
    highest that fits, or an estimate for its server); an engine that cannot convert the model says why instead;
    and how long the whole job (the standard recipe, or --recipe, or the engine flags as `qf run` takes them)
    takes on one such GPU beside this machine's cores (--cores: another machine's), packed as the factory packs.
    Reads only the config and safetensors headers. SOURCE may also be a model the catalog knows (its name): then
    its quants, of every format, are ranked by KLD among those whose runtime fits (--runtime: only those it
    loads), with the sizes not made yet that its formats' measured curves cover, marked expected. --json: the
    numbers by engine ({"refused": why} for those), the job's under "job", the ranking under "ranking"."""
    budget = memory.parse_size(vram)
    runtime = ranking.check_runtime(runtime)
    asked = [engines.get(engine)] if engine else engines.all_engines()
    asked = [e for e in asked if runtime is None or runtime in e.memory.runtimes]
    catalog = _catalog()
    name, source, quants = ranking.of_catalog(catalog, source)
    shape, params, info = memory.source_model(source)
    ranked = ranking.rank(name, ranking.Model(shape, params, info), quants, budget, ctx, kv_cache, runtime)
    refused = {e.name: why for e in asked if (why := e.refuse(info)) is not None}
    plans = {
        e.name: p
        for e in asked
        if e.name not in refused and (p := e.memory.plan(shape, params, budget, ctx, kv_cache, gpus)) is not None
    }
    steps = catalog.steps if catalog else None
    costs = Costs(steps, None, cores=cores)
    times = _conversion_times(list(plans), params.total, steps, costs.cores())
    specs, job = planning.projection(costs, source, recipes.build_recipe(recipe, flags), budget, info)
    if as_json:
        answers = {name: {**p.data, "expected_seconds": times[name]} for name, p in plans.items()}
        answers.update({name: {"refused": why} for name, why in refused.items()})
        job_data = _job_data(specs, job) if job else None
        print(json.dumps({**dict(sorted(answers.items())), "job": job_data, "ranking": ranked.to_json()}, indent=2))
        return
    if info.vision is not None:  # say which part is which: the plans size the language model's quant and the rest
        out.print(info.parts(), markup=False, highlight=False)
    for line in _ranking_lines(ranked):
        if isinstance(line, str):
            out.print(line, markup=False, highlight=False)
        else:
            out.print(line)
    for name, plan_ in sorted(plans.items(), key=lambda item: not item[1].rows):  # tables first
        if plan_.rows:
            out.print(_plan_table(plan_))
        engine = engines.get(name)
        about = {s.stage: f"the {s.about}" for s in engine.shared}
        # a shared unit only where this job's sizes of the engine need it (EXL3's measurement: an `opt` size)
        sizes = [s for s in specs if s.method == name] or engine.memory.sizes()
        needed = {u.stage for s in sizes for u in engine.shared_units(s)}
        parts = [
            f"{about.get(kind, 'each size')} about {tables.duration(t['seconds'])} ({t['basis']})"
            for kind, t in times[name].items()
            if kind not in about or kind in needed
        ]
        for line in [*plan_.lines, f"converting with {engine.label} on a GPU: {', then '.join(parts)}"]:
            out.print(line, markup=False, highlight=False)
    for why in refused.values():
        out.print(why, markup=False, highlight=False)
    if specs:
        out.print(_job_line(specs, job, vram, costs.cores()), markup=False, highlight=False)


def _ranking_lines(ranked: ranking.Ranking) -> list:
    """The ranking's table (the quants that fit and have a KLD, best first) and what it leaves out, in lines."""
    if not any(r.kind == "measured" for r in ranked.rows):
        loads = f" that {ranked.runtime} loads" if ranked.runtime else ""
        return [f"nothing of {ranked.name}{loads} to rank by KLD: no quant of it is scored yet (qf run scores them)"]
    title = f"{ranked.name} ranked by KLD: what fits {ranked.where()}, scored on {ranked.protocol}"
    lines: list = [tables.ranking(ranked.ranked, out.width, title)] if ranked.ranked else []
    if any(r.kind == "expected" for r in ranked.ranked):
        lines.append("~: expected, read off its format's measured curve on this model (qf plan --json says which)")
    too_big = [r.tag for r in ranked.rows if not r.fits and r.kld is not None]
    if too_big:
        lines.append(f"too big for {memory.human(ranked.budget)}: {', '.join(too_big)}")
    unscored: dict[str, dict[str, int]] = {}  # why -> format -> sizes that fit
    for r in ranked.rows:
        if r.kind == "unscored" and r.fits:
            counts = unscored.setdefault(r.basis, {})
            counts[engines.get(r.method).label] = counts.get(engines.get(r.method).label, 0) + 1
    for why, counts in unscored.items():
        sizes = ", ".join(f"{label} {n} size{'s' if n != 1 else ''}" for label, n in counts.items())
        more = " (two sizes of a format scored on these windows make its curve)" if why == ranking.NO_CURVE else ""
        lines.append(f"not ranked, {why}{more}: {sizes}")
    return lines + ranked.notes


def _job_data(specs: list, job: Projection) -> dict:
    return {
        "quants": [s.tag for s in specs],
        "expected_seconds": round(job.seconds),
        "one_at_a_time_seconds": round(job.serial_seconds),
        "critical_path": [{"unit": s.name, "seconds": round(s.end - s.start)} for s in job.critical_path],
        "units": {s.name: {"start": round(s.start), "end": round(s.end)} for s in job.slots},
    }


def _job_line(specs: list, job: Projection, vram: str, cores: int) -> str:
    """One line: the job's time packed and one unit after another, and the units its end waits on that take a
    twentieth of it or more (the gate, publishing and a quant's evaluation are seconds: counted, not named)."""
    long = [s for s in job.critical_path if s.end - s.start >= job.seconds / 20]
    path = ", ".join(f"{s.name} {tables.duration(s.end - s.start)}" for s in long)
    if short := len(job.critical_path) - len(long):
        path += f" and {short} short unit{'s' if short != 1 else ''}"
    return (
        f"the whole job ({len(specs)} quant{'s' if len(specs) != 1 else ''}) on one {vram} GPU and "
        f"{cores} cores, packed as the factory "
        f"packs: about {tables.duration(job.seconds)} to publish (one unit after another "
        f"{tables.duration(job.serial_seconds)}); the critical path: {path}"
    )


def _plan_table(plan_) -> tables.Table:
    """A memory plan's table, the sizes that need the same (as shown) in one row ("1.0-8.0" where all do), so that
    `qf plan` fits a 40-line screen."""
    rows: list[list[str]] = []
    for row in plan_.rows:
        if rows and rows[-1][1:] == list(row[1:]):
            rows[-1][0] = f"{rows[-1][0].split('-')[0]}-{row[0]}"
        else:
            rows.append(list(row))
    columns = [tables.Col(header, [r[i] for r in rows], right=True) for i, header in enumerate(plan_.columns)]
    return tables.layout(columns, out.width, plan_.title)


def _catalog():
    """The catalog, for its units' history and the model's quants, where one exists and can be read; else None
    (the engines' estimates; nothing to rank)."""
    url = settings.load().db_url
    if settings.database_kind(url) != "sqlite" or Path(url.removeprefix("sqlite:///")).is_file():  # none: none made
        try:
            return open_catalog()
        except FactoryError:
            pass
    return None


def _conversion_times(names: list[str], parameters: int, steps, cores: int) -> dict[str, dict]:
    """Expected seconds of each engine's conversion units for `qf plan`: the catalog's history where it can be
    read, else the engines' estimates."""

    def history(family: str) -> list:
        if steps is None:
            return []
        return [
            eta.Past(seconds, params)
            for name, seconds, params in steps.history(family, "cuda")
            if eta.family(name) == family
        ]

    return {name: eta.conversion(engines.get(name), parameters, history, cores=cores) for name in names}
