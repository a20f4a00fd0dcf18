"""`qf ls`, `qf show`, `qf pull`, `qf rm`, `qf gc`: the registry's quants, locally, on the Hub or through the
factory's service. Registered on the `qf` app (factory/cli/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

from factory import engines, ranking, settings, tables, vram
from factory.cli.shared import (
    CtxOpt,
    JsonOpt,
    RuntimeOpt,
    WideOpt,
    app,
    err,
    handled,
    job_rows,
    open_catalog,
    out,
    service_client,
)
from factory.errors import NotFound, ServiceUnavailable, SpecError
from factory.publish import frontier, hub
from factory.registry import naming
from factory.registry.published import QuantRow


@app.command("ls")
@handled
def ls(
    as_json: JsonOpt = False,
    remote: Annotated[
        str | None,
        typer.Option("--remote", metavar="OWNER", help="List what OWNER published on the Hub instead of the catalog."),
    ] = None,
    wide: WideOpt = False,
) -> None:
    """List finished quants."""
    if remote:
        found = hub.published(remote, _templates())
        if as_json:
            print(json.dumps(found, indent=2))
            return
        out.print(
            tables.layout(
                [
                    tables.Col("QUANT", [r["name"] for r in found]),
                    tables.Col("REPO", [r["repo"] for r in found]),
                    tables.Col("BRANCH", [r["branch"] for r in found]),
                    tables.Col("COMMIT", [r["commit"][:7] for r in found]),
                ],
                None if wide else out.width,
                f"published by {remote} on the Hub",
            )
        )
        return
    if (client := service_client()) is not None:
        rows = [QuantRow.from_json(r) for r in client.quants()]
    else:
        rows = [q.row() for q in open_catalog().quants.live()]
    if as_json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
    elif not rows:
        err.print("no quants yet: qf run SOURCE makes some")
    else:
        out.print(tables.quants(rows, None if wide else out.width))


@app.command()
@handled
def show(
    ref: Annotated[str, typer.Argument(metavar="NAME[:TAG]")],
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    plot: Annotated[
        Path | None,
        typer.Option("--frontier", metavar="FILE", help="Also write the card's plot: KLD against size, as SVG."),
    ] = None,
) -> None:
    """One model's quants and job history."""
    parsed = naming.parse(ref)
    width = None if wide else out.width
    if plot is not None:
        _frontier(parsed, plot)
    if (remote := service_client()) is not None:
        found = remote.model(parsed)
        return _show(parsed, [QuantRow.from_json(r) for r in found["quants"]], found["jobs"], as_json, width)
    from factory.publish import lookup

    rows = lookup.with_fits(open_catalog(), settings.load().registry, parsed)
    _show(parsed, rows, job_rows(limit=50, name=parsed.name), as_json, width)


def _frontier(parsed: naming.QuantRef, path: Path) -> None:
    """The model's frontier plot (every published quant with a KLD, every format) written to `path`."""
    from factory.publish import lookup

    client = service_client()
    if client is not None:
        rows = [QuantRow.from_json(r) for r in client.model(naming.QuantRef(parsed.name))["quants"]]
    else:
        rows = [q.row() for q in lookup.find(open_catalog(), naming.QuantRef(parsed.name))]
    try:
        path.write_text(frontier.svg(parsed.name, rows))
    except ValueError:
        raise SpecError(f"no quant of {parsed.name} has a KLD to plot") from None
    except OSError as e:
        raise SpecError(f"--frontier {str(path)!r} cannot be written: {e.strerror}") from None
    err.print(f"{parsed.name}'s frontier: {path}", markup=False, highlight=False)


def _show(parsed: naming.QuantRef, rows: list, job_rows: list[dict], as_json: bool, width: int | None) -> None:
    if as_json:
        print(json.dumps({"quants": [r.to_json() for r in rows], "jobs": job_rows}, indent=2))
        return
    if rows:
        out.print(tables.quants(rows, width, title=f"quants of {parsed.name}"))
    else:
        jobs = "; its jobs are below" if job_rows else ""
        out.print(
            f"{parsed.name} has no quants (none published, or all removed with qf rm){jobs}",
            markup=False,
            highlight=False,
        )
    for r in rows:
        engine = engines.get(r.method)
        if r.fits:
            title = (
                f"{r.ref}@{r.rev}: the longest context that fits each GPU with {engine.evaluator}, "
                f"{vram.human(vram.HEADROOM)} left free"
            )
            caches = [k for k in r.fits[0] if k != "budget"]  # exllamav2's fp16 and q4, vLLM's fp16 and fp8
            cells = [(f"{f['budget'] / 2**30:.0f} GB", *(f"{f[c]:,}" if f[c] else "-" for c in caches)) for f in r.fits]
            headers = ("GPU", *(f"{c.upper()} CACHE" for c in caches))
            out.print(
                tables.layout(
                    [tables.Col(header, [c[i] for c in cells], right=True) for i, header in enumerate(headers)],
                    width,
                    title,
                )
            )
        for line in engine.card.describe_scores(r):
            out.print(line, markup=False, highlight=False)
        for line in _evaluations(r):
            out.print(line, markup=False, highlight=False)
    out.print(tables.jobs(job_rows, width, title="jobs", shows=tables.WIDE))


def _evaluations(r) -> list[str]:
    """Each evaluation of a quant's files, one line each: its own and those of later jobs that reused it."""
    count = len(r.evaluations or [])
    lines = [f"{r.ref}@{r.rev} evaluated {'once' if count == 1 else f'{count} times'}:"] if count else []
    for e in r.evaluations or []:
        scores = f"ppl {e['ppl']:.4f}"
        if e["kld"] is not None:
            scores += f", KLD {tables.kld(e['kld'])}"
        if e["top1"] is not None:
            scores += f", top-1 {e['top1'] * 100:.1f}%"
        lines.append(f"  {e['text']} {e['windows']} x {e['window_length']} on {e['device']}: {scores} (job {e['job']})")
    return lines


@app.command()
@handled
def pull(
    ref: Annotated[str, typer.Argument(metavar="NAME:TAG[@REV] | NAME --fit SIZE")],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Folder to put the files in.")] = None,
    owner: Annotated[
        str | None,
        typer.Option(
            "--hub",
            metavar="OWNER",
            help="Where to look on the Hub when the catalog does not know NAME:TAG (default FACTORY_HUB_OWNER).",
        ),
    ] = None,
    fit: Annotated[
        str | None,
        typer.Option(
            "--fit", metavar="SIZE", help="Pull NAME's published quant with the lowest KLD that fits, e.g. 24GB."
        ),
    ] = None,
    ctx: CtxOpt = None,
    runtime: RuntimeOpt = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", metavar="", help="With --fit: the pick, its folder and the whole ranking, as JSON."),
    ] = False,
) -> None:
    """Copy a finished quant out of the registry, or download it from the Hub; every file's sha256 verified. With
    --fit SIZE: the published quant of NAME, of any format, with the lowest KLD whose runtime fits SIZE at --ctx
    tokens (the model's maximum by default), as `qf plan` ranks them; one line says which and why."""
    from factory.publish import folder, lookup

    if fit is not None:
        return _pull_fit(ref, fit, ctx, runtime, output, as_json)
    if as_json or ctx is not None or runtime is not None:
        raise SpecError("--ctx, --runtime and --json go with --fit SIZE (qf pull NAME --fit 24GB)")
    parsed = naming.parse(ref, tag_required=True)
    if (remote := service_client()) is not None:
        return _pull_from_service(remote, parsed, output)
    owner = owner or settings.load().hub_owner
    try:
        quant = lookup.find(open_catalog(), parsed)[0]
    except (NotFound, ServiceUnavailable):
        if not owner:
            raise
        return _pull_from_hub(parsed, owner, output)
    dest = _output_folder(output or Path(f"{quant.name}-{quant.tag}"))
    files = folder.pull(settings.load().registry / quant.path, dest)
    _card_as_now(dest, open_catalog().quants.row(quant))
    _pulled(f"{quant.name}:{quant.tag}@{quant.rev}", files, dest, output)


def _pull_fit(ref: str, fit: str, ctx: int | None, runtime: str | None, output: Path | None, as_json: bool) -> None:
    from factory.publish import folder, lookup

    parsed = naming.parse(ref)
    if parsed.tag is not None:
        raise SpecError(f"--fit chooses the tag: pass {parsed.name} --fit {fit}, or {ref} without --fit")
    if service_client() is not None:
        raise SpecError("qf pull --fit ranks this machine's catalog; unset FACTORY_SERVER, or pull NAME:TAG")
    budget = vram.parse_size(fit)
    catalog = open_catalog()
    quants = lookup.find(catalog, parsed)
    name, source, rows = ranking.of_catalog(catalog, parsed.name)
    ranked = ranking.rank(name, ranking.Model.of(source), rows, budget, ctx, runtime=runtime, expected=False)
    if not ranked.published:
        smallest = min((r for r in ranked.rows if r.need is not None), key=lambda r: r.need, default=None)
        least = f": the smallest, {smallest.tag}, needs {tables.size(smallest.need)}" if smallest else ""
        raise SpecError(f"no published quant of {name} fits {ranked.where()}{least}")
    best, *others = ranked.published
    quant = next(q for q in quants if (q.tag, q.rev) == (best.tag, best.rev))
    dest = _output_folder(output or Path(f"{quant.name}-{quant.tag}"))
    files = folder.pull(settings.load().registry / quant.path, dest)
    _card_as_now(dest, catalog.quants.row(quant))
    next_best = f"; next: {others[0].tag}, KLD {tables.kld(others[0].kld)}" if others else ""
    err.print(
        f"{name}:{best.tag}@{best.rev}: the lowest KLD ({tables.kld(best.kld)}, on {ranked.protocol}) of the "
        f"{len(ranked.published)} published {'quants that fit' if len(ranked.published) != 1 else 'quant that fits'} "
        f"{ranked.where()}; it needs {tables.size(best.need)} with {best.runtime}{next_best}",
        markup=False,
        highlight=False,
    )
    if as_json:
        err.print(f"{len(files)} files verified, in {dest.resolve()}", markup=False, highlight=False)
        print(
            json.dumps({"pulled": best.to_json(), "path": str(dest.resolve()), "ranking": ranked.to_json()}, indent=2)
        )
    else:
        _pulled(f"{quant.name}:{quant.tag}@{quant.rev}", files, dest, output)


@app.command()
@handled
def rm(ref: Annotated[str, typer.Argument(metavar="NAME:TAG[@REV]")]) -> None:
    """Remove a quant from the registry and the catalog (its copy on the Hub stays; `hf repo` manages that)."""
    from factory.publish import housekeeping, lookup

    parsed = naming.parse(ref, tag_required=True)
    catalog = open_catalog()
    quant, freed = housekeeping.remove_quant(settings.load(), catalog, lookup.find(catalog, parsed))
    err.print(
        f"removed {quant.name}:{quant.tag}@{quant.rev} ({tables.size(freed)} freed); the same `qf run` makes it again"
    )


@app.command()
@handled
def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar="", help="List what would go; remove nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Free disk: work folders of finished jobs, staging of killed publishes, Hub downloads, snapshots of local
    sources and BF16 copies that no unfinished job needs."""
    from factory.publish import housekeeping

    items = housekeeping.garbage(settings.load(), open_catalog())
    freed = sum(i.bytes for i in items) if dry_run else housekeeping.collect(items)
    if as_json:
        print(
            json.dumps(
                {
                    "dry_run": dry_run,
                    "bytes": freed,
                    "items": [{"path": str(i.path), "bytes": i.bytes, "why": i.why} for i in items],
                },
                indent=2,
            )
        )
        return
    for i in items:
        out.print(f"{tables.size(i.bytes):>10}  {i.path}  ({i.why})", markup=False, highlight=False)
    err.print(f"{'would free' if dry_run else 'freed'} {tables.size(freed)} in {len(items)} places")


def _output_folder(dest: Path) -> Path:
    """Where `qf pull` may put files: a new or empty real folder outside FACTORY_HOME (SpecError, exit 2)."""
    if dest.is_symlink():
        raise SpecError(f"-o {str(dest)!r} is a symbolic link; pass a real folder")
    if dest.exists() and not dest.is_dir():
        raise SpecError(f"-o {str(dest)!r} is a file; pass a new or empty folder")
    home = settings.load().home
    if dest.resolve().is_relative_to(home):
        raise SpecError(f"-o {str(dest)!r} is inside FACTORY_HOME ({home}); pull into a folder outside it")
    return dest


def _templates() -> dict[str, str]:
    return hub.templates(settings.load().hub_repos)


def _pull_from_service(remote, parsed: naming.QuantRef, output: Path | None) -> None:
    dest = _output_folder(output or Path(f"{parsed.name}-{parsed.tag}"))
    if dest.exists() and any(dest.iterdir()):
        raise SpecError(f"output folder {str(dest)!r} exists and is not empty; pass -o with a new or empty folder")
    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), console=err, disable=not err.is_terminal
    ) as bar:
        task = bar.add_task(str(parsed), total=None)
        try:
            quant, files = remote.pull(parsed, dest, lambda done, total: bar.update(task, completed=done, total=total))
        except KeyboardInterrupt:
            err.print("interrupted: the same qf pull continues where this one stopped")
            raise
    try:
        _card_as_now(dest, QuantRow.from_json(quant))
    except (KeyError, TypeError, ValueError, AttributeError):  # a service that says less: the card as published
        pass
    _pulled(f"{quant['name']}@{quant['rev']}", files, dest, output)


def _pull_from_hub(parsed: naming.QuantRef, owner: str, output: Path | None) -> None:
    tags = hub.tags(owner, parsed.name, _templates())
    if parsed.tag not in tags:
        known = ", ".join(sorted(tags)) or "none"
        raise NotFound(f"{parsed.name}:{parsed.tag} is not published under {owner} on the Hub; tags there: {known}")
    where = tags[parsed.tag]
    dest = _output_folder(output or Path(f"{parsed.name}-{parsed.tag}"))
    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), console=err, disable=not err.is_terminal
    ) as bar:
        task = bar.add_task(f"{where.repo}@{where.branch}", total=None)
        outputs = engines.of_tag(parsed.tag).outputs
        files = hub.pull(
            where, outputs, parsed.rev, dest, lambda done, total: bar.update(task, completed=done, total=total)
        )
    _pulled(f"{parsed.name}:{parsed.tag} from {where.repo}@{where.branch}", files, dest, output)


def _pulled(what: str, files: list, dest: Path, output: Path | None) -> None:
    """Where a pull wrote (without -o, the folder NAME-TAG it made in the current one): said on stderr, and its
    absolute path alone on stdout."""
    where = f"in {dest.resolve()}" + ("" if output else " (without -o: NAME-TAG in the current folder)")
    err.print(f"{what}: {len(files)} files verified, {where}", markup=False, highlight=False)
    out.print(str(dest.resolve()), markup=False, highlight=False)


def _card_as_now(dest: Path, row: QuantRow) -> None:
    """The pulled card with every evaluation of the quant's files the catalog knows now (card.with_evaluations)."""
    from factory.publish import card, folder

    path = dest / card.FILENAME
    if row.evaluations and path.is_file():
        folder.replace_card(dest, card.with_evaluations(path.read_text(), row))
