"""`qf calib ls`: the calibration and evaluation text sets."""

from __future__ import annotations

import json

import typer

import calibration
from factory import settings, tables
from factory.cli.shared import JsonOpt, app, err, handled, out

calib_app = typer.Typer(help="Calibration and eval text sets.", no_args_is_help=True)
app.add_typer(calib_app, name="calib")


@calib_app.command("ls")
@handled
def calib_ls(as_json: JsonOpt = False) -> None:
    """The text sets --calibration and --eval can name: builtin ones and files in $FACTORY_HOME/texts."""
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
