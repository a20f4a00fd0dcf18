"""The README and docs/ as a user reads them: every link leads to a file (and heading) of the repository, nothing
points outside it, and every `qf` command in the README's shell blocks is one the CLI accepts as written."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from factory import cli
from tests.support import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"\.\./shared|shared/(GPU|DESIGN|STYLE)\.md|\b(GPU|DESIGN|STYLE)\.md")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_leads_into_the_repository(doc):
    links = [link for link in LINK.findall(doc.read_text()) if not link.startswith(("http://", "https://"))]
    assert links or doc.name != "README.md"
    for link in links:
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.is_relative_to(ROOT) and path.exists(), f"{doc.name}: {link} is not a file of the repository"
        assert not anchor or anchor in _anchors(path), f"{doc.name}: {link}: no such heading"


def test_nothing_points_outside_the_repository():
    """No file the repository tracks sends its reader to ../shared (GPU.md, DESIGN.md): the facts are stated."""
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "scripts/*"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = [
        f"{name}:{n}: {line.strip()}"
        for name in files
        if name != "tests/unit/test_docs.py"
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, "\n".join(found)


def _readme_commands() -> list[list[str]]:
    """The `qf` lines of the README's bash blocks, without comments and environment assignments; lines that show
    optional parts in brackets ([--scope ...]) are synopses, not commands."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    commands = []
    lines = (line for block in blocks for line in block.replace("\\\n", " ").splitlines())
    for part in (part for line in lines for part in line.split("#")[0].split(";")):
        words = shlex.split(part)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["qf"] and "[" not in part:
            commands.append([w for w in words[1:] if w != "&"])
    return commands


COMMANDS = _readme_commands()


def test_the_readme_has_the_commands_of_the_demos_quant():
    lines = [" ".join(c) for c in COMMANDS]
    assert "show smollm2-135m-instruct" in lines
    assert any(line.startswith("pull smollm2-135m-instruct:awq-w4g64 -o ~/") for line in lines)
    assert not any(" ./out" in line or "-o ./" in line for line in lines)


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_each_readme_command_is_accepted_by_the_cli(words):
    """Parsed by the command `qf` runs (names, options, values, required arguments), not run."""
    command, args = cli.command(), list(words)
    while args and args[0] in getattr(command, "commands", {}):
        command = command.commands[args.pop(0)]
    assert not hasattr(command, "commands"), f"qf {' '.join(words)}: not a command"
    command.make_context(" ".join(words[: len(words) - len(args)]), args)
