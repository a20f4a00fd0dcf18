"""What the `qf` commands share: the typer app they register on, the consoles, the error handling that maps
every FactoryError to its exit code, the options several commands take, and the catalog, factory and service
client they work through."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import signal
import threading
import warnings
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from factory import engines, settings, submission
from factory.catalog import status
from factory.catalog.status import latest_steps
from factory.errors import FactoryError, NotFound

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


def handled(fn):
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


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)


def make_factory(emit=lambda e: None, max_units: int | None = None):
    from factory.factory import Factory

    loaded = settings.load()
    return Factory(replace(loaded, max_units=max_units or loaded.max_units), emit)


def open_catalog():
    from factory.catalog import Catalog

    return Catalog(settings.load().db_url)


def service_client():
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
        help="Memory budgets, e.g. 24GB,16GB: for each, the quant of any format with the lowest KLD that fits with "
        "--ctx and --kv-cache, as qf plan ranks the model's scored quants (none scored yet: "
        f"{submission.sizers()[0].label} at the largest size that fits); with "
        f"{' or '.join(f'--{e.name} fit' for e in engines.all_engines() if e.memory.sizes_to_budget)}, those "
        "engines' largest sizes.",
    ),
]
CtxOpt = Annotated[int | None, typer.Option("--ctx", min=1, help="Context in tokens (default: the model's max).")]
KvOpt = Annotated[str, typer.Option("--kv-cache", help="fp16, q8, q6 or q4.")]
RuntimeOpt = Annotated[
    str | None,
    typer.Option("--runtime", metavar="NAME", help="Only quants this runtime loads: tabbyapi, vllm, llama.cpp, ..."),
]
UnitsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-units",
        min=1,
        help="Units of a job (conversions, evaluations) run at once (default: as many as fit the "
        "GPU's memory and the CPU's cores; 1: one after another).",
    ),
]


def with_engine_flags(fn):
    """Adds an option for every engine that has a flag (`--<engine> 3.0,4.0`, or a switch) after the command's
    required parameters; the command gets their values as `flags` (engine name -> value)."""
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

    required = next((i for i, p in enumerate(params) if p.default is not inspect.Parameter.empty), len(params))
    wrapper.__signature__ = inspect.Signature([*params[:required], *added, *params[required:]])
    return wrapper


def with_submission_options(fn):
    """Adds the submission's options (submission.Options: SOURCE, the engine flags, --recipe ... --kv-cache) before
    the command's own; the command gets them as one value, `options`."""
    params = [p for name, p in inspect.signature(fn, eval_str=True).parameters.items() if name != "options"]
    added = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)
        for name, annotation, default in _SUBMISSION_OPTIONS
    ]

    @functools.wraps(fn)
    def wrapper(*args, flags: dict, **kwargs):
        values = {name: kwargs.pop(name) for name, _, _ in _SUBMISSION_OPTIONS}
        values["eval"] = values.pop("eval_set")
        return fn(*args, options=submission.Options.from_command_line(flags=flags, **values), **kwargs)

    wrapper.__signature__ = inspect.Signature([*added, *params])
    return with_engine_flags(wrapper)


_SUBMISSION_OPTIONS = [  # (parameter, its typer option, default), in the order `qf run --help` lists them
    ("source", SourceArg, inspect.Parameter.empty),
    ("recipe", RecipeOpt, None),
    ("calibration", CalibrationOpt, None),
    ("eval_set", EvalOpt, None),
    ("eval_windows", WindowsOpt, None),
    ("name", NameOpt, None),
    ("base_model", BaseOpt, None),
    ("fit", FitOpt, None),
    ("ctx", CtxOpt, None),
    ("kv_cache", KvOpt, "fp16"),
]


def say(line: str) -> None:
    """What planning a submission tells the user on the way (the sizes --fit chose)."""
    err.print(line, highlight=False)


def job_rows(**query) -> list[dict]:
    """Jobs as `qf status` and `qf jobs` print them: from the catalog, or the service's (the user's own); every
    attempt at each step (`--json`), of which the tables show the latest (`latest`)."""
    if (remote := service_client()) is not None:
        if query.get("job_id"):
            try:
                return [remote.job(query["job_id"])]
            except NotFound:
                return []
        return remote.jobs(limit=query.get("limit", 20), name=query.get("name"))

    config = settings.load()
    rows = status.job_rows(config.db_url, broker_url=config.broker_url, **query)
    if any(row["state"] == "running" and row["holder"] is None for row in rows) and open_catalog().leases.expired():
        # a holder that was killed (a `qf run` has no reconciler): its job goes back to queued, as the fleet's would
        rows = status.job_rows(config.db_url, broker_url=config.broker_url, **query)
    return rows


def latest(rows: list[dict]) -> list[dict]:
    """The rows with each step once, its latest record (a worker's job records inspect and gate in both passes)."""
    return [{**row, "steps": latest_steps(row["steps"])} for row in rows]
