"""A job's units (factory/jobs/graph.py) and running them several at once (factory/jobs/packing.py): the graph of
a job, admission within a memory budget, the pool with real threads, and `qf run --max-units` with a real engine
whose conversions run at the same time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime

import pytest

from factory import engines
from factory.engines.awq.spec import AwqSpec
from factory.engines.exl2.spec import Exl2Spec
from factory.engines.gguf.spec import GgufSpec
from factory.errors import JobFailed
from factory.jobs import graph, packing
from factory.jobs.graph import Unit
from factory.jobs.packing import Need, Packer
from tests.support import ROOT

GiB = 2**30


def test_the_graph_of_a_job_with_exl2_and_awq_targets():
    specs = [AwqSpec(w_bit=4, group_size=64), Exl2Spec(bpw=4.0), Exl2Spec(bpw=6.0)]
    key = "ab" * 32
    keys = {"exl2-4.0bpw": {"measure": key}, "exl2-6.0bpw": {"measure": key}}
    units = {u.name: u for u in graph.units(specs, keys, True, True)}
    awq, e4, e6 = (s.tag for s in specs)
    measure = f"measure:{key[:12]}"
    assert [n for n in units if n.startswith("measure:")] == [measure]  # one measurement serves both sizes
    assert units[f"quantize:{awq}"].needs == frozenset()
    assert units[f"quantize:{e4}"].needs == units[f"quantize:{e6}"].needs == frozenset({measure})
    assert units["evaluate:fp16"].needs == frozenset()  # runs beside the conversions
    assert units[f"evaluate:{e4}"].needs == frozenset({f"quantize:{e4}", "evaluate:fp16"})  # FP16's KL reference
    assert units[f"evaluate:{e4}:kv"].needs == frozenset({f"quantize:{e4}"})  # EXL2's KV-cache scores
    assert units["gate"].needs == frozenset(n for n in units if n.startswith("evaluate:"))
    assert units[f"publish:{e6}"].needs == frozenset({"gate"})
    assert units[f"push:{e6}"].needs == frozenset({f"publish:{e6}"})
    # one unit at a time runs them as the steps ran before packing: conversions, FP16, quants, extra scores, ...
    assert list(units)[:5] == [f"quantize:{awq}", measure, f"quantize:{e4}", f"quantize:{e6}", "evaluate:fp16"]
    names = list(units)
    assert all(names.index(need) < names.index(name) for name, u in units.items() for need in u.needs)


def test_gguf_shares_two_units_in_order_the_conversion_and_the_importance_matrix():
    """Every type waits for both; the importance matrix for the conversion it runs; one of each for the job."""
    specs = [GgufSpec(type="Q8_0"), GgufSpec(type="Q4_K_M"), GgufSpec(type="IQ4_XS")]
    convert, imatrix = "cd" * 32, "ef" * 32
    keys = {s.tag: {"convert": convert, "imatrix": imatrix} for s in specs}
    units = {u.name: u for u in graph.units(specs, keys, True, False)}
    shared = [f"convert:{convert[:12]}", f"imatrix:{imatrix[:12]}"]
    assert [n for n, u in units.items() if u.kind == "measure"] == shared
    assert units[shared[0]].needs == frozenset() and units[shared[1]].needs == frozenset(shared[:1])
    assert [units[n].stage for n in shared] == ["convert", "imatrix"]
    assert all(units[f"quantize:{s.tag}"].needs == frozenset(shared) for s in specs)


def test_a_vision_language_models_gguf_adds_its_projector_as_a_third_shared_unit():
    """`mmproj` only where the spec says the model has a vision tower (the engine's resolve sets it): after the
    importance matrix, and every type waits for it too."""
    gguf = engines.get("gguf")
    text, vlm = GgufSpec(type="Q4_K_M"), GgufSpec(type="Q4_K_M", mmproj=True)
    assert [s.stage for s in gguf.shared_units(text)] == ["convert", "imatrix"]
    assert [s.stage for s in gguf.shared_units(vlm)] == ["convert", "imatrix", "mmproj"]
    keys = {vlm.tag: {"convert": "cd" * 32, "imatrix": "ef" * 32, "mmproj": "ab" * 32}}
    units = {u.name: u for u in graph.units([vlm], keys, True, False)}
    assert units["mmproj:" + "ab" * 6].needs == frozenset({"imatrix:" + "ef" * 6})
    assert units["quantize:gguf-q4_k_m"].needs == frozenset(
        {"convert:" + "cd" * 6, "imatrix:" + "ef" * 6, "mmproj:" + "ab" * 6}
    )


def test_no_publish_units_for_a_gpu_worker_and_no_push_without_a_hub_owner():
    specs = [AwqSpec(w_bit=4, group_size=64)]
    assert [u.kind for u in graph.units(specs, {}, False, True)] == ["quantize", "evaluate", "evaluate", "gate"]
    assert [u.kind for u in graph.units(specs, {}, True, False)][-1] == "publish"


def test_admission_within_the_memory_budget_cores_and_max_units():
    packer = Packer(max_units=4, gpu_budget=10 * GiB, cores=16)
    four = Need(gpu_bytes=4 * GiB, cores=1)
    assert packer.admits(Need(gpu_bytes=40 * GiB), [])  # one unit always runs
    assert packer.admits(four, [four])
    assert not packer.admits(four, [four, four])  # 12 GiB > 10
    assert packer.admits(Need(gpu_bytes=2 * GiB, cores=1), [four, four])
    assert not packer.admits(Need(cores=1), [Need(cores=1)] * 4)  # max_units
    assert not Packer(8, None, 2).admits(Need(cores=2), [Need(cores=1)])  # cores
    assert Packer(8, None, 2).admits(Need(cores=1), [Need(cores=1)])  # no GPU: memory is not a limit
    evaluation = Need(gpu_bytes=GiB, cores=1, in_process=True)
    assert packer.admits(evaluation, [four]) and not packer.admits(evaluation, [four, evaluation])
    assert not packer.admits(Need(cores=1, alone=True), [four]) and not packer.admits(four, [Need(alone=True)])


class _Recorder:
    """Units that sleep, recording when each ran; a unit named in `fail` raises once (an OOM if so named)."""

    def __init__(self, seconds: float = 0.3, fail: dict[str, BaseException] | None = None):
        self.seconds, self.fail = seconds, dict(fail or {})
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.lock = threading.Lock()

    def __call__(self, unit: Unit) -> None:
        start = time.monotonic()
        time.sleep(self.seconds)
        with self.lock:
            self.spans.setdefault(unit.name, []).append((start, time.monotonic()))
            error = self.fail.pop(unit.name, None)
        if error:
            raise error

    def overlap(self, a: str, b: str) -> bool:
        (a0, a1), (b0, b1) = self.spans[a][-1], self.spans[b][-1]
        return a0 < b1 and b0 < a1


def _units() -> list[Unit]:
    return [
        Unit("quantize:a", "quantize"),
        Unit("quantize:b", "quantize"),
        Unit("evaluate:a", "evaluate", frozenset({"quantize:a"})),
        Unit("evaluate:b", "evaluate", frozenset({"quantize:b"})),
        Unit("gate", "gate", frozenset({"evaluate:a", "evaluate:b"})),
    ]


def _need(unit: Unit) -> Need:
    return Need(gpu_bytes=4 * GiB, cores=1) if unit.kind == "quantize" else Need(in_process=True)


def test_the_pool_runs_what_fits_at_once_and_keeps_the_order_of_needs():
    work = _Recorder()
    packing.run(_units(), work, _need, Packer(4, 10 * GiB, 4), threading.Event())
    assert work.overlap("quantize:a", "quantize:b")
    assert not work.overlap("evaluate:a", "evaluate:b")  # in-process units take turns
    for unit in _units():
        for need in unit.needs:
            assert work.spans[need][-1][1] <= work.spans[unit.name][-1][0]
    work = _Recorder()
    packing.run(_units(), work, _need, Packer(4, 6 * GiB, 4), threading.Event())  # one conversion fits at a time
    assert not work.overlap("quantize:a", "quantize:b")


def test_a_unit_out_of_memory_beside_others_runs_again_alone():
    notes = []
    work = _Recorder(fail={"quantize:b": JobFailed("EXL2 pass failed: torch.OutOfMemoryError: CUDA out of memory")})
    packing.run(_units(), work, _need, Packer(4, 10 * GiB, 4), threading.Event(), notes.append)
    assert len(work.spans["quantize:b"]) == 2  # the first, packed, ran out; the second ran alone
    alone = work.spans["quantize:b"][1]
    assert all(
        not (s < alone[1] and alone[0] < e) for n, spans in work.spans.items() if n != "quantize:b" for s, e in spans
    )
    assert notes == ["quantize:b ran out of GPU memory beside other units; running it again alone"]


def test_the_first_failure_stops_the_running_units_and_is_raised():
    stop = threading.Event()
    seen = []

    def work(unit: Unit) -> None:
        if unit.name == "quantize:a":
            time.sleep(0.2)
            raise JobFailed("quantize:a broke")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # a long conversion: its progress looks at `stop`
            if stop.is_set():
                seen.append(unit.name)
                raise packing.Stopped("stopped")
            time.sleep(0.05)

    start = time.monotonic()
    with pytest.raises(JobFailed, match="quantize:a broke"):
        packing.run(_units(), work, _need, Packer(4, 10 * GiB, 4), stop)
    assert seen == ["quantize:b"] and time.monotonic() - start < 5


def _spans(qf, job_id: str) -> dict[str, tuple[float, float]]:
    spans = {}
    for step in qf.json("status", job_id)["steps"]:
        start = datetime.fromisoformat(step["started_at"]).timestamp()
        spans[step["name"]] = (start, start + step["seconds"])
    return spans


@pytest.mark.parametrize("max_units, together", [(2, True), (1, False)])
def test_qf_run_packs_conversions_of_a_real_engine(qf, tiny, tmp_path, round_engine, max_units, together):
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3, 5]}\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 2, "--max-units", max_units, "--json")
    assert result.exit_code == 0, result.output
    rows = qf.json("ls")
    assert sorted(r["name"] for r in rows) == ["tiny:round-m3", "tiny:round-m5"]
    spans = _spans(qf, rows[0]["job"])
    (a0, a1), (b0, b1) = spans["quantize:round-m3"], spans["quantize:round-m5"]
    assert (a0 < b1 and b0 < a1) is together
    # what the run said would run at once bounds what did: the most steps whose spans overlap
    [said] = [
        e["message"]
        for e in map(json.loads, result.stdout.splitlines())
        if e["event"] == "note" and "expected to take" in e["message"]
    ]
    most = max(sum(1 for s, e in spans.values() if s <= t < e) for t, _ in spans.values())
    if together:
        assert said.endswith(" at once)") and 2 <= most <= int(said.split("up to ")[1].split()[0]), (said, spans)
    else:
        assert (said.endswith("(one at a time)"), most) == (True, 1), said


def test_units_record_what_was_expected_and_a_later_job_learns_from_an_earlier_one(
    qf, tiny, tmp_path, round_engine, monkeypatch
):
    from factory import settings
    from factory.factory import Factory

    for mantissa in (3, 5):
        recipe = tmp_path / f"m{mantissa}.yaml"
        recipe.write_text(f"round: {{mantissa: [{mantissa}]}}\n")
        result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 2, "--json")
        assert result.exit_code == 0, result.output
        notes = [e["message"] for e in map(json.loads, result.stdout.splitlines()) if e["event"] == "note"]
        assert any("units, expected to take" in n for n in notes), notes
    first, second = sorted(qf.json("ls"), key=lambda r: r["bits"])
    done = {s["name"]: s for s in qf.json("status", first["job"])["steps"]}
    later = {s["name"]: s for s in qf.json("status", second["job"])["steps"]}
    assert all(s["expected_seconds"] is not None for name, s in later.items() if name != "inspect")
    # the same engine on the same model: the second job expects what the first one's conversion took
    assert abs(later["quantize:round-m5"]["expected_seconds"] - done["quantize:round-m3"]["seconds"]) < 0.01
    monkeypatch.setenv("FACTORY_HOME", str(qf.home))
    monkeypatch.setenv("FACTORY_DB_URL", qf.db_url)
    factory = Factory(settings.load())
    packed, alone = factory.estimate(factory.catalog.jobs.get(second["job"]))  # what `qf submit` prints
    assert 0 < packed <= alone


# -- one measurement for every job that needs it --------------------------------------------------------------------
def _qf_process(qf, tiny, tmp_path, mantissa: int, **env: str):
    recipe = tmp_path / f"mround-{mantissa}.yaml"
    recipe.write_text(f"mround: {{mantissa: [{mantissa}]}}\n")
    cmd = [
        sys.executable,
        "-m",
        "tests.support.qf_with_test_engines",
        "run",
        str(tiny),
        "--recipe",
        str(recipe),
        "--eval-windows",
        "2",
        "--json",
    ]
    env = {**os.environ, **qf.env, "QF_TEST_MEASURE_SECONDS": "20", **env}  # long enough to be waited for
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _steps_of_all_jobs(qf) -> list[dict]:
    result = qf("status", "--json")
    return [s for job in json.loads(result.stdout or "[]") for s in job["steps"]] if result.exit_code == 0 else []


def _when(qf, what, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if any(what(s) for s in _steps_of_all_jobs(qf)):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step came to {what} within {seconds} s: {_steps_of_all_jobs(qf)}")


@pytest.mark.database
def test_a_second_job_waits_for_the_measurement_another_job_is_making(qf, tiny, tmp_path):
    first = _qf_process(qf, tiny, tmp_path, 3)
    _when(qf, lambda s: s["name"].startswith("measure:") and s["state"] == "running")
    second = _qf_process(qf, tiny, tmp_path, 5)
    for proc in (first, second):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    steps = _steps_of_all_jobs(qf)
    assert [s["state"] for s in steps if s["name"].startswith("measure:")] == ["succeeded"]  # made once
    assert [s["state"] for s in steps if s["name"].startswith("wait:measure:")] == ["succeeded"]
    assert "is making this measurement; waiting for it" in out
    assert sorted(r["name"] for r in qf.json("ls")) == ["tiny:mround-m3", "tiny:mround-m5"]


@pytest.mark.database
def test_a_waiting_job_makes_the_measurement_when_its_maker_is_killed(qf, tiny, tmp_path):
    short = {"FACTORY_LEASE_SECONDS": "3"}
    first = _qf_process(qf, tiny, tmp_path, 3, **short)
    _when(qf, lambda s: s["name"].startswith("measure:") and s["state"] == "running")
    second = _qf_process(qf, tiny, tmp_path, 5, **short)
    _when(qf, lambda s: s["name"].startswith("wait:measure:") and s["state"] == "running")
    os.killpg(first.pid, signal.SIGKILL)  # the maker and its measuring child, for real
    first.communicate()
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-2000:]
    made = [s["state"] for s in _steps_of_all_jobs(qf) if s["name"].startswith("measure:")]
    assert sorted(made) == ["running", "succeeded"]  # the killed one never ended; the waiter made it once its
    # maker's claim ran out
    assert [r["name"] for r in qf.json("ls")] == ["tiny:mround-m5"]
