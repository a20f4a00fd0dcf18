"""`qf --help` and every command's `--help` read as sentences.

Rendered in this process through the command `qf` runs (`cli.command()`), once at 80 columns (a terminal) and once
at 1000: at that width rich wraps nothing, so a description that still takes two lines was broken by a line break in
its source text (typer keeps a docstring's line breaks in a group's Commands panel). `qf` itself checks the entry
point.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from factory import cli

QF = Path(sys.executable).parent / "qf"
WIDE = 1000
DEFAULTS = re.compile(r"\(default:? [^)]*\)")  # a default the help string states itself


def _paths(command, path=()):
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _paths(sub, (*path, name))


PATHS = list(_paths(cli.command()))


def _help(path, columns, monkeypatch, capsys) -> list[str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as exit:
        cli.command().main([*path, "--help"], prog_name="qf")
    assert exit.value.code == 0
    return capsys.readouterr().out.splitlines()


def _rows(lines: list[str]) -> list[list[str]]:
    """A panel's rows, as their cells: `│ --slots  <int range>  Jobs run at once ... │`."""
    inside = [line.strip().strip("│").strip() for line in lines if line.strip().startswith("│")]
    return [re.split(r"\s{2,}", line) for line in inside]


def test_every_command_is_covered():
    assert {"run", "status", "worker", "pull", "serve"} <= {p[0] for p in PATHS if p}
    assert ("token", "create") in PATHS and ("watch", "add") in PATHS and ("calib", "ls") in PATHS


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "qf")
def test_help_has_no_bool_metavar_or_doubled_default(path, monkeypatch, capsys):
    text = "\n".join(_help(path, 80, monkeypatch, capsys))
    assert "--help" in text and "<bool>" not in text
    for row in _rows(_help(path, WIDE, monkeypatch, capsys)):
        line = "  ".join(row)
        assert not ("[default: " in line and DEFAULTS.search(line)), f"a default stated twice: {line}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "qf")
def test_no_description_is_broken_mid_line(path, monkeypatch, capsys):
    """At 1000 columns a panel has one line per option, argument and command (a second line of a description is a
    line break in its text), and the text above the panels is paragraphs of one line each."""
    command = cli.command()
    for name in path:
        command = command.commands[name]
    shown = [p for p in command.get_params(typer.Context(command)) if not getattr(p, "hidden", False)]
    lines = _help(path, WIDE, monkeypatch, capsys)
    rows = [line.strip() for line in lines if line.strip().startswith("│")]
    assert len(rows) == len(shown) + len(getattr(command, "commands", {})), "\n".join(rows)
    top = [line.strip() for line in lines[: next(i for i, x in enumerate(lines) if x.strip()[:1] == "╭")]]
    for above, below in zip(top, top[1:], strict=False):
        assert not (above and below), f"a paragraph broken in two: {above!r} / {below!r}"


def test_a_bracket_in_help_is_text_not_markup(monkeypatch, capsys):
    assert "org/name[@revision]" in "\n".join(_help(("run",), WIDE, monkeypatch, capsys))


def test_the_qf_entry_point_renders_the_same_help():
    """`qf --help` and `qf worker --help` at 80 columns, as a terminal of that width shows them."""
    for args in (["--help"], ["worker", "--help"]):
        out = subprocess.run(
            [str(QF), *args], capture_output=True, text=True, check=True, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"}
        ).stdout
        assert "<bool>" not in out and "(default 1)" not in out
        assert max(len(line) for line in out.splitlines()) <= 80
