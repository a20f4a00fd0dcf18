"""Where CI's CPU goes, test by test (issue 50: `.ci/run` is bound by its CPU seconds on 2 cores).

As a pytest plugin, each pytest process moves itself into a cgroup of its own (cgroup v1 `cpuacct`, so root) and
records, for every test, the CPU seconds its whole tree of processes spent from the test's setup to its teardown:
the pytest process, and every `qf`, worker, job process, engine, warm starter and browser it started, those that
ended and were reaped included (what psutil or /proc/PID/stat cannot see once a process is gone). A session-scoped
fixture's cost goes to the first test that asks for it. Each pass writes DIR/<pid>.json.

    QF_CPU_PROFILE=DIR PYTEST_ADDOPTS="-p benchmarks.ci_cpu" .ci/run   # or scripts/test
    python benchmarks/ci_cpu.py DIR [--out benchmarks/results/ci_cpu.json]   # by file and by test, largest first
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class Profile:
    def __init__(self, out: Path):
        self.out = out
        for old in CPUACCT.glob("qf-test-*"):  # groups of pytest processes gone, emptied since
            if not Path(f"/proc/{old.name.removeprefix('qf-test-')}").exists():
                try:
                    old.rmdir()
                except OSError:  # one of its processes outlives it
                    pass
        self.group = CPUACCT / f"qf-test-{os.getpid()}"
        self.group.mkdir(exist_ok=True)
        (self.group / "cgroup.procs").write_text(str(os.getpid()))
        self.start = self.usage()
        self.tests: list[dict] = []

    def usage(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def record(self, nodeid: str, cpu: float, wall: float) -> None:
        self.tests.append({"test": nodeid, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)})

    def finish(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        total = self.usage() - self.start
        argv = [a for a in sys.argv[1:] if not a.startswith("--basetemp")]
        result = {"argv": argv, "cpu_s": round(total, 1), "tests": self.tests}
        (self.out / f"{os.getpid()}.json").write_text(json.dumps(result, indent=1) + "\n")
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        try:
            self.group.rmdir()
        except OSError:  # a process of the tests outlived them; the group goes with the machine
            pass


_profile: Profile | None = None


def pytest_configure(config) -> None:
    global _profile
    if os.environ.get("QF_CPU_PROFILE") and _profile is None:
        try:
            _profile = Profile(Path(os.environ["QF_CPU_PROFILE"]))
        except OSError as e:
            raise pytest.UsageError(f"QF_CPU_PROFILE needs root and cgroup v1's cpuacct at {CPUACCT}: {e}") from e


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _profile is None:
        yield
        return
    cpu, wall = _profile.usage(), time.monotonic()
    yield
    _profile.record(item.nodeid, _profile.usage() - cpu, time.monotonic() - wall)


def pytest_unconfigure(config) -> None:
    if _profile is not None:
        _profile.finish()


def summary(folder: Path) -> dict:
    """Every pass's tests, by file and by test, largest CPU first."""
    passes = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    files: dict[str, dict] = defaultdict(lambda: {"cpu_s": 0.0, "wall_s": 0.0, "tests": 0})
    tests = []
    for run in passes:
        for test in run["tests"]:
            name = test["test"].split("::")[0]
            files[name]["cpu_s"] += test["cpu_s"]
            files[name]["wall_s"] += test["wall_s"]
            files[name]["tests"] += 1
            tests.append(test)
    by_file = sorted(({"file": f, **{k: round(v, 1) for k, v in s.items()}} for f, s in files.items()),
                     key=lambda r: -r["cpu_s"])  # fmt: skip
    return {
        "passes": [{"argv": r["argv"], "cpu_s": r["cpu_s"], "tests": len(r["tests"])} for r in passes],
        "cpu_s": round(sum(r["cpu_s"] for r in passes), 1),
        "files": by_file,
        "tests": sorted(tests, key=lambda t: -t["cpu_s"])[:60],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = summary(args.folder)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['cpu_s']:.0f} CPU-s in {len(result['passes'])} passes")
    for row in result["files"][:25]:
        print(f"{row['cpu_s']:8.1f} {row['wall_s']:8.1f} {row['tests']:4d}  {row['file']}")


if __name__ == "__main__":
    main()
