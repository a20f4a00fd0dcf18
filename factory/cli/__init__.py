"""`qf`: the command line. Each module registers its commands on the typer app of shared.py; this one imports them
all, and `main` runs the app, mending typer's help once (`command`).

Exit codes (factory/errors.py): 0 ok, 1 job failed or refused by the quality gate, 2 bad usage or spec,
3 model refused by inspection, 4 not found, 5 a service unavailable; `qf status JOB`: 1 failed, 6 cancelled.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

# isort: off
# their commands, registered in the order `qf --help` lists them
from factory.cli import run, jobs, plan, texts, fleet, registry, services, watch  # noqa: F401

# isort: on
import os

from factory.cli.render import Renderer
from factory.cli.shared import app, err
from factory.errors import SpecError

__all__ = ["Renderer", "app", "command", "main"]


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
