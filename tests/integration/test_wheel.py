"""The package runs from its built wheel: built from a copy of the tracked files, installed into a fresh virtualenv
with no source tree in sight (the dependencies come from this environment's site-packages, read as a plain path so
that its editable install of quantfactory stays invisible), then `qf run --awq` on the tiny model there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from tests.support import ROOT


def _run(*args, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_the_wheel_runs_without_the_source_tree(tiny, tmp_path):
    source = tmp_path / "source"
    tracked = _run("git", "ls-files", "-z", cwd=ROOT).stdout.split("\0")
    untracked = _run("git", "ls-files", "-z", "--others", "--exclude-standard", cwd=ROOT).stdout.split("\0")
    for name in filter(None, tracked + untracked):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    _run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source
    )
    [wheel] = (tmp_path / "dist").glob("quantfactory-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # a path: its .pth files stay unread
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FACTORY_DB_URL")}
    env.update(
        FACTORY_HOME=str(tmp_path / "home"),
        VIRTUAL_ENV=str(env_dir),
        PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}",
    )
    imports = "import factory.cli, configs; print(factory.cli.__file__, configs.__file__)"
    where = _run(python, "-c", imports, cwd=elsewhere, env=env).stdout.split()
    assert all(Path(w).is_relative_to(site) for w in where), where
    result = _run(env_dir / "bin" / "qf", "run", tiny, "--awq", "--eval-windows", 1, "--json", cwd=elsewhere, env=env)
    final = json.loads(result.stdout.splitlines()[-1])
    assert final["state"] == "succeeded" and final["quants"][0]["name"] == "tiny:awq-w4g128"
