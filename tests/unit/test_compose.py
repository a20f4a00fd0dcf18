"""compose.yaml: every service that runs the factory runs a `qf` command that exists and parses, waits for healthy
services, restarts, keeps exllamav2's extension on a volume; the image is built without local state and runs as an
unprivileged user who owns the folders the factory writes."""

import re
import shlex
from pathlib import PurePosixPath

import typer
import yaml

from factory.cli import app
from tests.support import ROOT

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
        assert service["depends_on"] == {
            "redis": {"condition": "service_healthy"},
            "postgres": {"condition": "service_healthy"},
        }
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


def _dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _commands(runs: list[str]) -> list[list[str]]:
    """The shell commands of RUN lines (split at &&, ; and |)."""
    return [shlex.split(part) for run in runs for part in re.split(r"&&|;|\|\|?", run) if part.strip()]


def test_the_image_runs_as_an_unprivileged_user_who_owns_what_the_factory_writes():
    steps = _dockerfile()
    last_run = max(i for i, (keyword, _) in enumerate(steps) if keyword == "RUN")
    users = [(i, args.split(":")[0].strip()) for i, (keyword, args) in enumerate(steps) if keyword == "USER"]
    assert users and users[-1][0] > last_run, "USER must come after the last RUN (which may need root)"
    user = users[-1][1]
    assert user not in ("root", "0")
    commands = _commands([args for keyword, args in steps if keyword == "RUN"])
    [useradd] = [c for c in commands if c[0] == "useradd"]
    assert useradd[-1] == user and useradd[useradd.index("--uid") + 1] == "1000"
    made = {PurePosixPath(p) for c in commands if c[:2] == ["mkdir", "-p"] for p in c[2:]}
    owned = {PurePosixPath(c[-1]) for c in commands if c[:2] == ["chown", "-R"] and c[2] == f"{user}:{user}"}
    written = {PurePosixPath(volume.split(":")[1]) for service in FACTORY.values() for volume in service["volumes"]}
    written |= {
        PurePosixPath(service["environment"][key])
        for service in FACTORY.values()
        for key in ("FACTORY_HOME", "FACTORY_SERVE_SOURCES")
        if key in service["environment"]
    }
    assert PurePosixPath("/data/factory") in written and len(written) >= 3
    for folder in written:  # made in the image (so a new named volume copies it, owner included) and owned by user
        assert any(m == folder or folder in m.parents for m in made), folder
        assert any(o == folder or o in folder.parents for o in owned), folder
