"""compose.yaml: every service that runs the factory runs a `qf` command that exists and parses."""

import shlex
from pathlib import Path

import typer
import yaml

from factory.cli import app

COMPOSE = yaml.safe_load((Path(__file__).resolve().parent.parent / "compose.yaml").read_text())


def test_services():
    services = COMPOSE["services"]
    assert {"redis", "postgres", "worker-gpu0", "worker-cpu", "beat"} <= set(services)
    assert "--appendonly yes" in services["redis"]["command"]
    assert services["postgres"]["volumes"]
    gpu = services["worker-gpu0"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert (gpu["driver"], gpu["device_ids"], gpu["capabilities"]) == ("nvidia", ["0"], ["gpu"])


def test_every_qf_command_exists_and_parses():
    group = typer.main.get_command(app)
    commands = [s["command"] for s in COMPOSE["services"].values() if str(s.get("command", "")).startswith("qf ")]
    assert len(commands) == 3
    for command in commands:
        name, *args = shlex.split(command)[1:]
        assert name in group.commands, command
        group.commands[name].make_context(name, args)  # raises on an unknown option or a bad value
