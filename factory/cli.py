"""`qf`: the command line. Renders the pipeline's events; maps every FactoryError to its exit code.

Exit codes (factory/errors.py): 0 ok, 1 job failed or refused by the quality gate, 2 bad usage or spec,
3 model refused by inspection, 4 not found, 5 a service unavailable; `qf status JOB`: 1 failed, 6 cancelled.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from factory import engines, settings, tables
from factory.errors import FactoryError, JobFailed, NotFound, SpecError
from factory.events import Event
from factory.submission import sizer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help=f"quantfactory: {', '.join(e.label for e in engines.all_engines())} quants of FP16 checkpoints, evaluated "
    "and published by name.",
)
# soft wrap: a line wider than the terminal (a table whose names alone are) wraps there, never cropped or cut by rich
out = Console(soft_wrap=True)
if not out.is_terminal and "COLUMNS" not in os.environ:
    out = Console(width=200, soft_wrap=True)  # tables piped to a file keep their columns; COLUMNS=80 says otherwise
err = Console(stderr=True, soft_wrap=True)


def _handled(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with _sigterm_interrupts():
                engines.check_plugins()  # FACTORY_ENGINES named one that cannot be loaded
                return fn(*args, **kwargs)
        except FactoryError as e:
            err.print(f"error: {e.message}", markup=False, highlight=False)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


@contextmanager
def _sigterm_interrupts():
    """SIGTERM (what `timeout`, systemd and docker send) stops a command the way Ctrl-C does: a run's job is marked
    failed ("interrupted", so the same command continues it), its running step interrupted, its engine child
    stopped; a pull removes its staging folder."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _quiet_libraries() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)


HEARTBEAT_SECONDS = 60  # without a terminal, a progress line at least this often, so a long step does not look hung


class Renderer:
    """Pipeline events -> JSON lines (--json), or rich progress on a terminal, or plain lines otherwise (a line per
    step, and one with the step's progress when nothing was printed for HEARTBEAT_SECONDS)."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.live = not as_json and err.is_terminal
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            console=err,
        )
        self.tasks: dict[str, int] = {}
        self.last_line = time.monotonic()
        self.lock = threading.Lock()  # units running at once emit from their threads

    def __enter__(self):
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.progress.stop()

    def __call__(self, event: Event) -> None:
        with self.lock:
            self._render(event)

    def _render(self, event: Event) -> None:
        if self.as_json:
            print(json.dumps(event, default=str), flush=True)
            return
        kind = event["event"]
        if kind == "job":
            what = "new job" if event["created"] else "existing job"
            self._line(
                f"{what} {event['job']}: {event['name']} from {event['source']} ({event['source_identity'][:19]})"
            )
        elif kind == "note":
            self._line(event["message"])
        elif kind == "step":
            self._step(event)
        elif kind == "progress":
            if self.live and event["step"] not in self.tasks:  # following a step that started before we looked
                self.tasks[event["step"]] = self.progress.add_task(event["step"], total=None, count="")
            task = self.tasks.get(event["step"])
            if task is not None and "total" in event:
                self.progress.update(task, total=event["total"], completed=event["done"], count=_count(event))
            elif not self.live and "total" in event and time.monotonic() - self.last_line > HEARTBEAT_SECONDS:
                self._line(f"{event['step']}: {_count(event)}")
        elif kind == "evaluation":
            divergence = (
                f", KL divergence from FP16 {tables.kld(event['kld'])} (p99 "
                f"{tables.kld(event['kld_p99'], 3)}), top-1 {event['top1'] * 100:.1f}%"
                if "kld" in event
                else ""
            )
            self._line(f"perplexity {event['subject']}: {event['ppl']:.4f}{divergence}")

    def _step(self, event: dict) -> None:
        name, state = event["step"], event["state"]
        if state == "running":
            if self.live:
                self.tasks[name] = self.progress.add_task(name, total=None, count="")
            else:
                self._line(f"{name} ...")
            return
        task = self.tasks.pop(name, None)
        if task is not None:
            self.progress.update(
                task,
                completed=self.progress.tasks[task].total or 1,
                total=self.progress.tasks[task].total or 1,
                description=f"{name} [{'green' if state == 'succeeded' else 'red'}]{state}[/]",
            )
            self.progress.stop_task(task)
        elif not self.live:
            self._line(f"{name} {state}")

    def _line(self, text: str) -> None:
        self.last_line = time.monotonic()
        (self.progress.console if self.live else err).print(text, markup=False, highlight=False)


def _count(event: dict) -> str:
    """A progress event's count as people say it: "layer 3 of 30", "window 5 of 48", "37.5%", "1.2 MiB of 4.0 MiB"."""
    done, total, unit = event["done"], event["total"], event.get("unit", "")
    if unit == "%":
        return f"{100 * done / total:.3g}%" if total else f"{done:g}%"
    if unit == "B":
        return f"{tables.size(done)} of {tables.size(total)}"
    return f"{unit} {done:g} of {total:g}".strip()


def _factory(emit=lambda e: None, max_units: int | None = None):
    from factory.pipeline import Factory

    loaded = settings.load()
    return Factory(replace(loaded, max_units=max_units or loaded.max_units), emit)


def _catalog():
    from factory.catalog import Catalog

    return Catalog(settings.load().db_url)


def _remote():
    """The service's client when FACTORY_SERVER (or --server) names one: the command goes through it."""
    config = settings.load()
    if not config.server:
        return None
    from factory.service.client import Client

    return Client(config.server, config.token)


# `\\[` is a bracket, not rich markup (which would swallow `[@revision]`)
SourceArg = Annotated[
    str,
    typer.Argument(
        metavar="SOURCE",
        help="A local checkpoint folder (config.json, tokenizer, safetensors) or a Hub repo org/name\\[@revision].",
    ),
]
RecipeOpt = Annotated[Path | None, typer.Option("--recipe", help="A recipe YAML (see configs/standard.yaml).")]
CalibrationOpt = Annotated[str | None, typer.Option("--calibration", help="builtin:<name> or file:<path>.")]
EvalOpt = Annotated[str | None, typer.Option("--eval", help="builtin:<name> or file:<path>.")]
WindowsOpt = Annotated[int | None, typer.Option("--eval-windows", min=1, help="2048-token windows to score.")]
NameOpt = Annotated[str | None, typer.Option("--name", help="The quant name (default: the folder's name).")]
BaseOpt = Annotated[str | None, typer.Option("--base-model", help="The Hub repo the card names as base_model.")]
JsonOpt = Annotated[bool, typer.Option("--json", metavar="", help="JSON instead of tables and progress bars.")]
WideOpt = Annotated[bool, typer.Option("--wide", metavar="", help="Show every column, whatever the terminal's width.")]
FitOpt = Annotated[
    str | None,
    typer.Option(
        "--fit",
        help=f"VRAM budgets, e.g. 24GB,16GB: {sizer().label} at the "
        "highest bpw that fits each with --ctx and --kv-cache (see qf plan).",
    ),
]
CtxOpt = Annotated[int | None, typer.Option("--ctx", min=1, help="Context in tokens (default: the model's max).")]
KvOpt = Annotated[str, typer.Option("--kv-cache", help="fp16, q8, q6 or q4.")]
UnitsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-units",
        min=1,
        help="Units of a job (conversions, evaluations) run at once (default: as many as fit the "
        "GPU's memory and the CPU's cores; 1: one after another).",
    ),
]


def _with_engine_flags(fn):
    """Adds an option for every engine that has a flag (`--<engine> 3.0,4.0`, or a switch) after the command's first
    parameter; the command gets their values as `flags` (engine name -> value)."""
    params = [p for name, p in inspect.signature(fn, eval_str=True).parameters.items() if name != "flags"]
    added = []
    for engine in engines.all_engines():
        if engine.flag is None:
            continue
        if engine.flag.takes_value:
            option = Annotated[str | None, typer.Option(f"--{engine.name}", help=engine.flag.help)]
            added.append(
                inspect.Parameter(
                    f"engine_{engine.name}", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=option
                )
            )
        else:
            option = Annotated[bool, typer.Option(f"--{engine.name}", metavar="", help=engine.flag.help)]
            added.append(
                inspect.Parameter(
                    f"engine_{engine.name}", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=False, annotation=option
                )
            )

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        flags = {key.removeprefix("engine_"): kwargs.pop(key) for key in list(kwargs) if key.startswith("engine_")}
        return fn(*args, flags=flags, **kwargs)

    wrapper.__signature__ = inspect.Signature([*params[:1], *added, *params[1:]])
    return wrapper


def _request(
    source,
    flags,
    recipe,
    calibration,
    eval_set,
    eval_windows,
    name,
    base_model,
    device=None,
    fit=None,
    ctx=None,
    kv_cache="fp16",
):
    from factory import submission

    return submission.request(
        source,
        flags,
        recipe,
        calibration,
        eval_set,
        eval_windows,
        name,
        base_model,
        device,
        fit,
        ctx,
        kv_cache,
        say=lambda line: err.print(line, highlight=False),
    )


@app.command()
@_handled
@_with_engine_flags
def run(
    source: SourceArg,
    flags: dict,
    recipe: RecipeOpt = None,
    calibration: CalibrationOpt = None,
    eval_set: EvalOpt = None,
    eval_windows: WindowsOpt = None,
    name: NameOpt = None,
    base_model: BaseOpt = None,
    fit: FitOpt = None,
    ctx: CtxOpt = None,
    kv_cache: KvOpt = "fp16",
    max_units: UnitsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Quantize, evaluate and publish SOURCE in this process: inspect, quantize, evaluate, gate, publish (units
    that do not wait for each other at once, where they fit)."""
    request = _request(
        source,
        flags,
        recipe,
        calibration,
        eval_set,
        eval_windows,
        name,
        base_model,
        fit=fit,
        ctx=ctx,
        kv_cache=kv_cache,
    )
    if owner := settings.load().hub_owner:
        from factory.publish import hub

        hub.writer(owner)  # a missing or read-only token fails now, not after hours of quantizing
    _quiet_libraries()
    with Renderer(as_json) as render:
        factory = _factory(render, max_units)
        job, created = factory.submit(request)
        job = _run_held(factory, job)
    if not as_json:
        rows = [q.row() for q in factory.catalog.quants(job_id=job.id)]
        out.print(tables.quants(rows, out.width, title=f"job {job.id} {job.state}", shows="qf ls --wide"))


def _run_held(factory, job):
    """`qf run` holds the job as a worker does (a fenced lease, renewed while it makes progress): a job that another
    `qf run` or a worker holds is not run twice; one whose holder is gone is taken over where it stopped."""
    from factory import identity, leases
    from factory.catalog import JobState

    if job.state in (JobState.succeeded, JobState.cancelled):
        return factory.execute(job.id)  # nothing to run: its result
    config = factory.settings
    holder = factory.catalog.holder(job.id)
    lease = factory.catalog.take_lease(
        job.id, identity.holder_name(), config.lease_seconds, gone=holder if identity.gone(holder) else None
    )
    if lease is None:
        who = leases.describe_holder(factory.catalog.holder(job.id))
        raise JobFailed(f"job {job.id} is running on {who}; `qf status {job.id} --follow` follows it")
    last = [time.monotonic()]
    render = factory.emit

    def emit(event: dict) -> None:
        last[0] = time.monotonic()
        render(event)

    def alive() -> str | None:
        if time.monotonic() - last[0] > config.stall_seconds:
            return f"no progress for {config.stall_seconds:g} s (FACTORY_STALL_SECONDS); giving up its lease"
        return None

    factory.emit = emit
    try:
        with leases.held(factory.catalog, lease, config.lease_seconds, alive):
            return factory.execute(job.id, lease=lease)
    finally:
        factory.catalog.release_lease(lease)  # fenced: a no-op once another holder has the job


@app.command()
@_handled
@_with_engine_flags
def submit(
    source: SourceArg,
    flags: dict,
    recipe: RecipeOpt = None,
    calibration: CalibrationOpt = None,
    eval_set: EvalOpt = None,
    eval_windows: WindowsOpt = None,
    name: NameOpt = None,
    base_model: BaseOpt = None,
    fit: FitOpt = None,
    ctx: CtxOpt = None,
    kv_cache: KvOpt = "fp16",
) -> None:
    """Queue a job for the workers; prints only its id (the same job twice: the same id)."""
    if (remote := _remote()) is not None:
        if recipe is not None and not recipe.is_file():
            raise SpecError(f"recipe {str(recipe)!r} does not exist; pass a YAML file such as configs/standard.yaml")
        answer = remote.submit(
            {
                "source": source,
                "flags": flags,
                "recipe": recipe.read_text(encoding="utf-8") if recipe else None,
                "calibration": calibration,
                "eval": eval_set,
                "eval_windows": eval_windows,
                "name": name,
                "base_model": base_model,
                "fit": fit,
                "ctx": ctx,
                "kv_cache": kv_cache,
            }
        )
        for line in answer["notes"]:
            err.print(line, markup=False, highlight=False)
        print(answer["id"])
        guess = answer["estimate"] and (answer["estimate"]["packed"], answer["estimate"]["alone"])
    else:
        from workers.tasks import submit as queue

        factory = _factory()
        job = queue(
            factory,
            _request(
                source,
                flags,
                recipe,
                calibration,
                eval_set,
                eval_windows,
                name,
                base_model,
                device=factory.settings.worker_device,
                fit=fit,
                ctx=ctx,
                kv_cache=kv_cache,
            ),
        )
        print(job.id)
        guess = factory.estimate(job)
    if guess:
        packed, alone = guess
        err.print(
            f"expected to take about {tables.duration(packed)} on a worker (units packed; "
            f"{tables.duration(alone)} one after another)",
            markup=False,
            highlight=False,
        )


def _job_rows(**query) -> list[dict]:
    """Jobs as `qf status` and `qf jobs` print them: from the catalog, or the service's (the user's own); every
    attempt at each step (`--json`), of which the tables show the latest (`_latest`)."""
    if (remote := _remote()) is not None:
        if query.get("job_id"):
            try:
                return [remote.job(query["job_id"])]
            except NotFound:
                return []
        return remote.jobs(limit=query.get("limit", 20), name=query.get("name"))
    from factory import status

    config = settings.load()
    return status.job_rows(config.db_url, broker_url=config.broker_url, **query)


@app.command()
@_handled
def jobs(
    as_json: JsonOpt = False,
    limit: Annotated[int, typer.Option("--limit", min=1)] = 20,
) -> None:
    """Recent jobs with their state and step timings."""
    rows = _job_rows(limit=limit)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        out.print(tables.jobs(_latest(rows), out.width))


# `qf status JOB` of a job that ended so (errors.py); with --json 0, as its `state` says it to the scripts that read it
STATUS_EXIT = {"failed": JobFailed.exit_code, "cancelled": 6}


@app.command()
@_handled
def status(
    job_id: Annotated[str | None, typer.Argument(metavar="JOB")] = None,
    as_json: JsonOpt = False,
    follow: Annotated[
        bool, typer.Option("--follow", metavar="", help="Show the job's progress live until it ends.")
    ] = False,
) -> None:
    """A job's state and steps; without JOB, the recent jobs. With JOB it exits 1 when the job failed and 6 when
    it was cancelled (0 while it is queued or running, when it succeeded, and with --json, whose `state` says)."""
    if follow and job_id is None:
        raise SpecError("--follow needs a JOB to follow; `qf status` lists the recent ones")
    if follow and job_id is not None:
        _follow(job_id, as_json)
    rows = _job_rows(job_id=job_id) if job_id else _job_rows(limit=20)
    if job_id is not None and not rows:
        raise NotFound(f"no job {job_id!r}; `qf status` lists the recent ones")
    if as_json and not follow:
        print(json.dumps(rows if job_id is None else rows[0], indent=2))
    elif job_id is None:
        out.print(tables.jobs(_latest(rows), out.width))
    elif not as_json:  # with --follow --json, the events were the output
        _print_job(rows[0])
    if job_id is not None and not as_json and rows[0]["state"] in STATUS_EXIT:
        raise typer.Exit(STATUS_EXIT[rows[0]["state"]])


def _latest(rows: list[dict]) -> list[dict]:
    """The rows with each step once, its latest record (a worker's job records inspect and gate in both passes)."""
    from factory.status import latest_steps

    return [{**row, "steps": latest_steps(row["steps"])} for row in rows]


def _print_job(row: dict) -> None:
    """One job as `qf status JOB` prints it: its steps, why it waits, when it should end, its holder, its error."""
    out.print(tables.steps(_latest([row])[0], out.width))
    if row.get("waiting"):
        out.print(f"queued: {row['waiting']}", markup=False, highlight=False)
    if row.get("eta_seconds") is not None:
        left = row["eta_seconds"]
        when = (
            f"about {tables.duration(left)} from now" if left >= 0 else f"{tables.duration(-left)} later than expected"
        )
        out.print(
            f"expected to end at {row['expected_end'].replace('T', ' ')} UTC ({when})", markup=False, highlight=False
        )
    if row["holder"]:
        from factory.leases import describe_holder

        out.print(
            f"held by {describe_holder(row['holder'])} (attempt {row['attempts']})", markup=False, highlight=False
        )
    if row["error"]:
        out.print(f"error: {row['error']}", markup=False, highlight=False)


def _follow(job_id: str, as_json: bool) -> None:
    """Render the job's events as its worker publishes them (or the service relays them), until a result event
    or a terminal state."""
    if (remote := _remote()) is not None:
        events = remote.events(job_id)
    else:
        from workers.tasks import follow

        events = follow(_catalog(), settings.load().broker_url, job_id)
    with Renderer(as_json) as render:
        for event in events:
            if event is not None:
                render(event)


@app.command()
@_handled
def cancel(job_id: Annotated[str, typer.Argument(metavar="JOB")]) -> None:
    """Cancel a queued or running job: its engine gets SIGTERM, its work folder goes, nothing is published. Through
    a service, a job that other users submitted too goes on for them (your interest in it is withdrawn)."""
    if (remote := _remote()) is not None:
        job = remote.cancel(job_id)
        if job.get("others") and job["state"] != "cancelled":
            err.print(
                f"job {job['id']}: withdrawn; it goes on ({job['state']}) for {job['others']} other user(s) who "
                "submitted it too"
            )
        else:
            err.print(f"job {job['id']}: {job['state']}")
        return
    job = _catalog().cancel_job(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}; `qf status` lists the recent ones")
    err.print(f"job {job.id}: {job.state}")


@app.command()
@_handled
def retry(job_id: Annotated[str, typer.Argument(metavar="JOB")]) -> None:
    """Queue a failed or cancelled job again; finished steps are kept."""
    if (remote := _remote()) is not None:
        print(remote.retry(job_id)["id"])
        return
    from workers.tasks import retry as queue_again

    print(queue_again(_factory(), job_id).id)


@app.command()
@_handled
def plan(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="A local FP16 folder or a Hub repo org/name.")],
    vram: Annotated[str, typer.Option("--vram", help="GPU memory, e.g. 24GB (GB means GiB, as on the card).")],
    ctx: CtxOpt = None,
    kv_cache: KvOpt = "fp16",
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="Split the layers over N such GPUs (estimate).")] = 1,
    engine: Annotated[str | None, typer.Option("--engine", metavar="NAME", help="Only this engine's plan.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """What fits a GPU with its context and KV cache, as each engine's memory model says (every size and the
    highest that fits, or an estimate for its server); an engine that cannot convert the model says why instead.
    Reads only the config and safetensors headers. --json: the numbers by engine ({"refused": why} for those)."""
    from factory import vram as memory

    budget = memory.parse_size(vram)
    asked = [engines.get(engine)] if engine else engines.all_engines()
    shape, params, info = memory.source_model(source)
    refused = {e.name: why for e in asked if (why := e.refuse(info)) is not None}
    plans = {
        e.name: p
        for e in asked
        if e.name not in refused and (p := e.memory_plan(shape, params, budget, ctx, kv_cache, gpus)) is not None
    }
    times = _conversion_times(list(plans), params.total)
    if as_json:
        answers = {name: {**p.data, "expected_seconds": times[name]} for name, p in plans.items()}
        answers.update({name: {"refused": why} for name, why in refused.items()})
        print(json.dumps(dict(sorted(answers.items())), indent=2))
        return
    if info.vision is not None:  # say which part is which: the plans size the language model's quant and the rest
        out.print(info.parts(), markup=False, highlight=False)
    for name, plan_ in sorted(plans.items(), key=lambda item: not item[1].rows):  # tables first
        if plan_.rows:
            out.print(_plan_table(plan_))
        parts = [
            f"{'the measurement' if kind == 'measure' else 'each size'} about "
            f"{tables.duration(t['seconds'])} ({t['basis']})"
            for kind, t in times[name].items()
        ]
        for line in [*plan_.lines, f"converting with {engines.get(name).label} on a GPU: {', then '.join(parts)}"]:
            out.print(line, markup=False, highlight=False)
    for why in refused.values():
        out.print(why, markup=False, highlight=False)


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


def _conversion_times(names: list[str], parameters: int) -> dict[str, dict]:
    """Expected seconds of each engine's conversion units for `qf plan`: the catalog's history where it can be
    read, else the engines' estimates."""
    from factory.jobs import eta

    url = settings.load().db_url
    catalog = None
    if settings.database_kind(url) != "sqlite" or Path(url.removeprefix("sqlite:///")).is_file():  # none: none made
        try:
            catalog = _catalog()
        except FactoryError:
            pass  # the engines' estimates

    def history(family: str) -> list:
        if catalog is None:
            return []
        return [
            eta.Past(seconds, params)
            for name, seconds, params in catalog.unit_history(family, "cuda")
            if eta.family(name) == family
        ]

    return {name: eta.conversion(engines.get(name), parameters, history) for name in names}


calib_app = typer.Typer(help="Calibration and eval text sets.", no_args_is_help=True)
app.add_typer(calib_app, name="calib")


@calib_app.command("ls")
@_handled
def calib_ls(as_json: JsonOpt = False) -> None:
    """The text sets --calibration and --eval can name: builtin ones and files in $FACTORY_HOME/texts."""
    import calibration

    rows = [
        {"name": t.name, "chars": len(t.text), "sha256": t.sha256} for t in calibration.available(settings.load().texts)
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    out.print(
        tables.layout(
            [
                tables.Col("NAME", [r["name"] for r in rows]),
                tables.Col("CHARS", [f"{r['chars']:,}" for r in rows], right=True),
                tables.Col("SHA256", [r["sha256"][:16] for r in rows]),
            ],
            out.width,
        )
    )
    err.print('also: file:<path> to any .txt, .jsonl (a "text" field per line) or .parquet (a "text" column)')


from factory import cli_fleet, cli_registry, cli_service, cli_watch  # noqa: E402, F401  (register their commands)


@app.callback()
def _options(
    server: Annotated[
        str | None,
        typer.Option(
            "--server", metavar="URL", help="Talk to the factory's service at URL (FACTORY_SERVER) with FACTORY_TOKEN."
        ),
    ] = None,
) -> None:
    if server:
        import os

        os.environ["FACTORY_SERVER"] = server


def command() -> typer.core.TyperGroup:
    """The click command `qf` runs, with typer's rich help mended once for every command: a group's Commands panel
    keeps the line breaks of each command's docstring (sentences broke mid-line at any width; paragraphs stay),
    and --help, a flag, showed the metavar <bool> (the factory's flags set metavar="" for the same reason)."""
    group = typer.main.get_command(app)
    todo = [group]
    while todo:
        each = todo.pop()
        if each.help:
            each.help = "\n\n".join(p if p.startswith("\b") else p.replace("\n", " ") for p in each.help.split("\n\n"))
        help_option = each.get_help_option(typer.Context(each))
        if help_option is not None:
            help_option.metavar = ""
        todo.extend(getattr(each, "commands", {}).values())
    return group


def main() -> None:
    try:
        command()(standalone_mode=True)
    except SpecError as e:  # raised while typer parses options
        err.print(f"error: {e.message}", markup=False)
        sys.exit(e.exit_code)


if __name__ == "__main__":  # python -m factory.cli: run the module that cli_service registered its commands on
    from factory.cli import main as registered

    registered()
