"""compose.yaml: every service that runs the factory runs a `qf` command that exists and parses, waits for healthy
services, restarts, keeps exllamav2's extension on a volume; the image is built without local state."""

import shlex
from pathlib import Path

import typer
import yaml

from factory.cli import app

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
FACTORY = {name: s for name, s in SERVICES.items() if str(s.get("command", "")).startswith("qf ")}


def test_services():
    assert {"redis", "postgres", "worker-gpu0", "worker-cpu", "beat", "service"} <= set(SERVICES)
    assert SERVICES["service"]["ports"] == ["8750:8750"] and "--port 8750" in SERVICES["service"]["command"]
    assert "--appendonly yes" in SERVICES["redis"]["command"]
    assert SERVICES["postgres"]["volumes"]
    gpu = SERVICES["worker-gpu0"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert (gpu["driver"], gpu["device_ids"], gpu["capabilities"]) == ("nvidia", ["0"], ["gpu"])


def test_every_qf_command_exists_and_parses():
    group = typer.main.get_command(app)
    assert len(FACTORY) == 4
    for service in FACTORY.values():
        name, *args = shlex.split(service["command"])[1:]
        assert name in group.commands, service["command"]
        group.commands[name].make_context(name, args)  # raises on an unknown option or a bad value


def test_gpu_workers_see_one_device_as_gpu_0():
    """A container sees only its own device, as GPU 0: each GPU worker names one device and keeps `--gpu 0`."""
    gpus = {n: s for n, s in FACTORY.items() if "deploy" in s}
    assert gpus
    for service in gpus.values():
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(device["device_ids"]) == 1 and "--gpu 0" in service["command"]


def test_services_wait_for_health_and_restart():
    for name in ("redis", "postgres"):
        assert SERVICES[name]["healthcheck"]["test"] and SERVICES[name]["restart"] == "unless-stopped"
    for service in FACTORY.values():
        assert service["depends_on"] == {"redis": {"condition": "service_healthy"},
                                         "postgres": {"condition": "service_healthy"}}
        assert service["restart"] == "unless-stopped"


def test_the_extension_is_built_once_on_a_volume():
    dockerfile = (ROOT / "Dockerfile").read_text()
    folder = next(w.split("=", 1)[1] for w in dockerfile.split() if w.startswith("TORCH_EXTENSIONS_DIR="))
    for service in FACTORY.values():
        assert f"torch-extensions:{folder}" in service["volumes"]
    assert "torch-extensions" in COMPOSE["volumes"]


def test_the_image_leaves_local_state_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".factory", ".git", ".whl"} <= set(ignored)


def test_beat_keeps_its_schedule_in_factory_home(tmp_path, monkeypatch):
    """`qf beat` in a checkout must not leave celerybeat-schedule files there."""
    import os

    from typer.testing import CliRunner

    calls = []
    monkeypatch.setattr(os, "execvp", lambda file, argv: calls.append(argv))
    result = CliRunner().invoke(app, ["beat"], env={"FACTORY_HOME": str(tmp_path / "home")})
    assert result.exit_code == 0, result.output
    [argv] = calls
    assert argv[argv.index("--schedule") + 1] == str((tmp_path / "home" / "celerybeat-schedule").resolve())
