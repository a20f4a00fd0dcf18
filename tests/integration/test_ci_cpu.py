"""benchmarks/ci_cpu.py counts a test's whole process tree: a child that burned CPU and was reaped counts, as the
workers, engines and servers a test starts do (it needs root and cgroup v1's cpuacct, as this project's CI machines
have)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import ci_cpu
from tests.support import ROOT

BURN = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.6: pass"


@pytest.mark.skipif(os.geteuid() != 0 or not ci_cpu.CPUACCT.is_dir(), reason="needs root and cgroup v1's cpuacct")
def test_each_test_is_charged_its_childrens_cpu(tmp_path):
    tests = tmp_path / "test_burn.py"
    tests.write_text(
        "import subprocess, sys\n"
        f"def test_burns():\n    subprocess.run([sys.executable, '-c', {BURN!r}], check=True)\n"
        "def test_idles():\n    pass\n"
    )
    env = {**os.environ, "QF_CPU_PROFILE": str(tmp_path / "profile")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.ci_cpu", str(tests)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    [profile] = (tmp_path / "profile").iterdir()
    cpu = {t["test"].split("::")[1]: t["cpu_s"] for t in json.loads(profile.read_text())["tests"]}
    assert cpu["test_burns"] >= 0.6 and cpu["test_idles"] < 0.2, cpu
    summary = ci_cpu.summary(tmp_path / "profile")
    assert [f["tests"] for f in summary["files"]] == [2] and summary["tests"][0]["test"].endswith("test_burns")
